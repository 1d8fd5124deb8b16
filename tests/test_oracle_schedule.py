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
        for a in range(1, pl[i] + 1) if use_pl else ():  # (verifying fewer than would be accepted)
            best = min(best, T[a] + go(i + a + 1, bump(a + 1)))
        if use_ds:
            forward = prompt if r == NEVER else steady if r <= steady_rows else catch_up
            for a in range(ds[i] + 1):
                best = min(best, forward + T[a] + go(i + a + 1, a + 1))
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


def test_verifying_fewer_drafts_can_be_faster():
    """Prompt lookup alone: at 0 two drafts pass, but stopping after one lands the next cycle on
    index 2's proposal of four, which beats the two-draft cycle followed by plain decoding."""
    n, T = 7, [1.0, 1.01, 1.3, 1.3, 1.3, 1.3, 1.3]
    pl = [2, 0, 4, 0, 0, 0, 0]
    seconds, cycles = best_times(pl, [0] * n, n, T, steady=1.0, catch_up=1.0, prompt=1.0, steady_rows=2,
                                 use_ds=False)
    assert seconds == pytest.approx(T[1] + T[4])  # 2 + 5 tokens (against T[2] + 4 T[0])
    assert cycles == {"plain": 0, "prompt_lookup": 2, "dspark": 0}


def test_forced_dspark_drafts_every_cycle_but_the_last():
    """DSpark forced: a forward every cycle with room to draft (the prompt's first, then the
    previous cycle's rows priced as steady or catch-up), none on the output's last token."""
    from benchmarks.oracle_schedule import forced_time

    output = [1, 2, 3, 4, 5]
    blocks = [([1, 2, 9], [0.99, 0.99, 0.99]), ([2], [0.9]), ([3, 4], [0.99, 0.99]), ([4], [0.9]), ([5], [0.9])]
    T = [1.0, 1.0, 1.0, 1.0]
    seconds, acc = forced_time(blocks, output, T, steady=0.5, catch_up=2.0, prompt=3.0, steady_rows=2)
    # cycle 1: prompt forward, 2 of 3 drafts pass (3 rows committed); cycle 2 at index 3: one
    # draft (room 1) passes, priced as a catch-up (3 rows > 2); no cycle left after index 5
    assert seconds == pytest.approx(3.0 + T[2] + 2.0 + T[1])
    assert acc == pytest.approx(1.5)


def test_a_drafter_that_is_always_right_is_used_every_cycle():
    n, T = 8, [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35]
    ds = [min(3, n - i - 1) for i in range(n)]
    seconds, cycles = best_times([0] * n, ds, n, T, steady=0.2, catch_up=5.0, prompt=0.5, steady_rows=4)
    assert cycles == {"plain": 0, "prompt_lookup": 0, "dspark": 2}  # (4 tokens a cycle)
    assert seconds == pytest.approx(0.5 + T[3] + 0.2 + T[3])
    assert accepted([5, 6, 9], [1, 5, 6, 7], 1) == 2 and accepted([5], [5], 1) == 0


def test_filling_prompt_lookups_gaps_pays_for_each_dspark_forward():
    """The guessing rule: prompt lookup's whole proposal when it has one, else a DSpark forward
    (always paid, its block cut by its confidence), else plain decoding."""
    from benchmarks.oracle_schedule import gap_fill_time

    output = [1, 2, 3, 4, 5, 6]
    pl_blocks = [[], [], [3, 4, 9], [], [], []]
    ds_blocks = [([1, 2], [0.99, 0.99]), ([7], [0.99]), ([3], [0.99]), ([4], [0.99]), ([9], [0.99]),
                 ([6], [0.99])]
    T = [1.0, 1.0, 1.0, 1.0, 1.0]
    costs = dict(steady=0.25, catch_up=0.5, prompt=0.75, steady_rows=2)
    # plain, plain, PL 3 drafts (2 pass: to index 5), plain
    assert gap_fill_time(pl_blocks, ds_blocks, output, T, use_ds=False, **costs) == pytest.approx(1 + 1 + T[3] + 1)
    # DSpark at 0 (prompt price; 2 pass: to index 3), DSpark at 3 (3 rows: a catch-up; 1 passes:
    # to index 5), last token plain (no room)
    assert gap_fill_time(pl_blocks, ds_blocks, output, T, **costs) == pytest.approx(0.75 + T[2] + 0.5 + T[1] + T[0])


def test_the_streak_rule_stops_drafting_after_a_miss_until_a_probe():
    from benchmarks.oracle_schedule import gap_fill_time

    output = [1, 2, 3, 4, 5]
    pl_blocks = [[]] * 5
    ds_blocks = [([9], [0.99])] * 5  # (never right)
    T = [1.0, 1.0]
    costs = dict(steady=0.25, catch_up=0.5, prompt=0.75, steady_rows=2)
    # every gap: a forward (the prompt's, then steady ones), one draft that fails, 4 cycles + a last plain one
    assert gap_fill_time(pl_blocks, ds_blocks, output, T, **costs) == pytest.approx(0.75 + 3 * 0.25 + 4 * T[1] + T[0])
    # streak: one miss, then plain until a probe after 2 plain gaps (index 3), which misses too
    assert gap_fill_time(pl_blocks, ds_blocks, output, T, keep_if=1, probe_every=2, **costs) == pytest.approx(
        0.75 + T[1] + T[0] + T[0] + 0.5 + T[1] + T[0])
