"""The scheduler's upper bound (benchmarks/oracle_schedule.py): its dynamic programme finds the
fastest schedule, checked against every schedule enumerated on small random instances."""

import random

import pytest

from benchmarks.oracle_schedule import NEVER, accepted, best_times


def brute_force(pl, ds, n, T, steady, catch_up, prompt, steady_rows, use_pl=True, use_ds=True):
    """The least time over every schedule, enumerated (a DSpark forward's price depends on the
    rows committed since the last one: all of them, or the prompt before the first)."""
    def go(i, r):
        if i >= n:
            return 0.0
        bump = (lambda c: NEVER if r == NEVER else r + c)
        best = T[0] + go(i + 1, bump(1))
        if use_pl and pl[i]:
            best = min(best, T[pl[i]] + go(i + pl[i] + 1, bump(pl[i] + 1)))
        if use_ds:
            forward = prompt if r == NEVER else steady if r <= steady_rows else catch_up
            best = min(best, forward + T[ds[i]] + go(i + ds[i] + 1, ds[i] + 1))
        return best
    return go(0, NEVER)


@pytest.mark.parametrize("seed", range(40))
def test_the_programme_finds_the_fastest_schedule(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    pl = [rng.randint(0, min(4, n - i - 1)) for i in range(n)]
    ds = [rng.randint(0, min(3, n - i - 1)) for i in range(n)]
    T = [1.0 + 0.1 * k + rng.random() * 0.05 for k in range(8)]
    costs = dict(steady=rng.uniform(0.1, 1.0), catch_up=rng.uniform(1.0, 2.5), prompt=rng.uniform(1.0, 3.0),
                 steady_rows=rng.randint(1, 3))
    for use_pl, use_ds in ((True, False), (False, True), (True, True)):
        seconds, cycles = best_times(pl, ds, n, T, use_pl=use_pl, use_ds=use_ds, **costs)
        assert seconds == pytest.approx(brute_force(pl, ds, n, T, use_pl=use_pl, use_ds=use_ds, **costs))
        assert seconds <= n * T[0] + 1e-12  # (plain decoding is always a schedule)
        assert (use_pl or not cycles["prompt_lookup"]) and (use_ds or not cycles["dspark"])
        assert sum(cycles.values()) >= 1


def test_a_drafter_that_is_always_right_is_used_every_cycle():
    n, T = 8, [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35]
    ds = [min(3, n - i - 1) for i in range(n)]
    seconds, cycles = best_times([0] * n, ds, n, T, steady=0.2, catch_up=5.0, prompt=0.5, steady_rows=4)
    assert cycles == {"plain": 0, "prompt_lookup": 0, "dspark": 2}  # (4 tokens a cycle)
    assert seconds == pytest.approx(0.5 + T[3] + 0.2 + T[3])
    assert accepted([5, 6, 9], [1, 5, 6, 7], 1) == 2 and accepted([5], [5], 1) == 0
