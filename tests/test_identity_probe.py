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


PROMPT = [3, 9, 27, 81, 12, 40, 7, 150, 33, 99, 201, 17] * 4
# A random tiny model's greedy continuation is one repeated token; feeding varied tokens makes a
# position or row slip visible.
FORCED = [5, 88, 140, 23, 61, 230, 9, 177, 42, 111, 64, 199]


def test_probe_finds_no_mismatch_when_rows_are_exact():
    model, _ = tiny_model(seed=5)
    runner, sink = _runner(model)
    report = probe(runner, sink, PROMPT, 12, [2, 4, 8], prefill_step=16, forced=FORCED)
    assert report["tokens"] == FORCED
    assert {w: r["first_mismatch"] for w, r in report["widths"].items()} == {2: None, 4: None, 8: None}
    assert report["widths"][4]["probes"] == 12 - 4 + 1


def test_probe_names_the_first_row_dependent_layer():
    for layer in (0, 1):
        model, _ = tiny_model(seed=5)
        model.layers[layer].mlp = _RowDependent(model.layers[layer].mlp)
        runner, sink = _runner(model)
        report = probe(runner, sink, PROMPT, 10, [3], prefill_step=16, forced=FORCED)
        first = report["widths"][3]["first_mismatch"]
        # row 0 of every pass is untouched; row 1 of the first pass is the first to part
        assert {k: first[k] for k in ("position", "row", "layer", "what")} == \
            {"position": 1, "row": 1, "layer": layer, "what": "output"}
        assert 5e-4 < first["max_abs_diff"] < 5e-3
