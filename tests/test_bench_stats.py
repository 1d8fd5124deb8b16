"""The paired bootstrap interval of benchmarks/bench_speculative.py."""

from __future__ import annotations

import pytest

from benchmarks.bench_speculative import paired_interval


def runs(seconds: list[float], tokens: int = 97) -> list[dict]:
    return [{"tokens": tokens, "decode_s": s} for s in seconds]


def test_interval_brackets_the_ratio_and_pairs_cancel_shared_noise():
    # every run of b is 5% slower than its twin in a, under noise shared by the pair (x1..x3)
    shared = [1.0, 3.0, 1.5, 2.5, 0.8, 2.0, 1.2, 2.8]
    a, b = runs(shared), runs([s * 1.05 for s in shared])
    low, high = paired_interval(a, b)
    assert low == pytest.approx(1.05) and high == pytest.approx(1.05)
    # unpaired noise of +-10% per run widens the interval around the true ratio
    jitter = [1.1, 0.9, 1.05, 0.95, 1.1, 0.9, 1.0, 1.0]
    low, high = paired_interval(runs([s * j for s, j in zip(shared, jitter)]), b)
    assert low < 1.05 < high and high - low > 0.05
    assert paired_interval(a, b, seed=1) == paired_interval(a, b, seed=1)
    assert paired_interval([], []) == []
    with pytest.raises(ValueError, match="differ in number"):
        paired_interval(a, b[:-1])
