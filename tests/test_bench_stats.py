"""The paired bootstrap interval of benchmarks/bench_speculative.py."""

from __future__ import annotations

import pytest

from benchmarks.bench_speculative import paired_interval


def runs(seconds: list[float], tokens: int = 97, prompts: list[int] | None = None) -> list[dict]:
    rows = [{"tokens": tokens, "decode_s": s} for s in seconds]
    return rows if prompts is None else [{**r, "prompt": p} for r, p in zip(rows, prompts)]


def test_interval_brackets_the_ratio_and_pairs_cancel_shared_noise():
    # every run of b is 5% slower than its twin in a, under noise shared by the pair
    shared = [1.0, 3.0, 1.5, 2.5, 0.8, 2.0, 1.2, 2.8]
    a, b = runs(shared), runs([s * 1.05 for s in shared])
    low, high = paired_interval(a, b)
    assert low == pytest.approx(1.05) and high == pytest.approx(1.05)
    # unpaired noise of +-10% per run widens the interval around the true ratio
    jitter = [1.1, 0.9, 1.05, 0.95, 1.1, 0.9, 1.0, 1.0]
    low, high = paired_interval(runs([s * j for s, j in zip(shared, jitter)]), b)
    assert low < 1.05 < high and high - low > 0.05
    assert paired_interval(a, b, seed=1) == paired_interval(a, b, seed=1)
    assert paired_interval([], []) == [] and paired_interval(a, b[:-1]) == []
    # runs of one prompt are drawn together: two prompts, one 10% faster under a, one 10% slower
    prompts = [0, 0, 0, 0, 1, 1, 1, 1]
    fast = runs([1.0] * 4 + [1.1] * 4, prompts=prompts)
    low, high = paired_interval(fast, runs([1.1] * 4 + [1.0] * 4, prompts=prompts))
    assert (low, high) == (round(1 / 1.1, 4), 1.1)  # each draw holds 0, 1 or 2 copies of a prompt
    assert paired_interval(fast, runs([1.0] * 8, prompts=[1] * 8)) == []  # not the same prompts
    # one prompt (a single session): its runs are resampled one by one, not as one group
    low, high = paired_interval(runs([1.0] * 4 + [1.1] * 4, prompts=[0] * 8), runs([1.1] * 4 + [1.0] * 4, prompts=[0] * 8))
    assert low < 1.0 < high
