"""benchmarks/identity_probe.py: finds the first layer where verify rows and decode steps part."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from tiny import tiny_model

from benchmarks.identity_probe import configure, probe, record_layers
from engine.runner import TargetRunner


class _RowDependent(nn.Module):
    """Adds a tiny offset to every row but the first of a multi-row pass: the kind of
    row-count dependence (a kernel switching with M) that breaks greedy identity."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __call__(self, x):
        y = self.inner(x)
        if y.shape[1] > 1:
            y = y + mx.concatenate([mx.zeros_like(y[:, :1]), mx.full(y[:, 1:].shape, 1e-3, y.dtype)], axis=1)
        return y


def _runner(model):
    sink = record_layers(model)
    runner = TargetRunner(model)
    configure(runner, "row")
    return runner, sink


def test_probe_finds_no_mismatch_when_rows_are_exact():
    model, _ = tiny_model(seed=5)
    runner, sink = _runner(model)
    report = probe(runner, sink, [3, 9, 27, 81, 12, 40, 7] * 6, 12, [2, 4, 8])
    assert len(report["tokens"]) == 12
    assert {w: r["first_mismatch"] for w, r in report["widths"].items()} == {2: None, 4: None, 8: None}
    assert report["widths"][4]["probes"] == 12 - 4 + 1


def test_probe_names_the_first_row_dependent_layer():
    model, _ = tiny_model(seed=5)
    model.layers[1].mlp = _RowDependent(model.layers[1].mlp)
    runner, sink = _runner(model)
    report = probe(runner, sink, [3, 9, 27, 81, 12, 40, 7] * 6, 10, [3])
    first = report["widths"][3]["first_mismatch"]
    assert first == {"position": 1, "row": 1, "layer": 1, "max_abs_diff": first["max_abs_diff"]}
    assert 5e-4 < first["max_abs_diff"] < 5e-3
