"""The scheduler's verify-cost model (engine/scheduler.py::CostModel) and draft-length choice."""

import pytest

from engine.scheduler import CostModel, choose_length

MS = 1e-3


def h200_like() -> CostModel:
    """A start-up curve shaped like the default model's fused pass on the H200: T(k) = 1.5 ms
    (1 + 0.04 (k - 1)), 16 rows."""
    return CostModel([1.5 * MS * (1 + 0.04 * k) for k in range(16)])


def test_one_row_drift_moves_every_width():
    """Passes of one row (what runs whenever nothing is drafted) that cost 0.45 ms more in the
    engine than at start-up shift the whole curve, so drafting does not look cheaper than it
    is. Refreshing each width on its own left T(2..16) at their start-up values, and a draft
    whose acceptance cannot pay for its row (3% against a 4% dearer pass) then looked worth
    verifying."""
    cost = h200_like()
    weak = [0.03] * 15
    assert choose_length(weak, cost)[0] == 0
    start = cost.verify_cost
    for _ in range(300):
        cost.observe(1, 1.95 * MS)
    assert cost.T(1) == pytest.approx(1.95 * MS, rel=0.01)
    shift = [a - b for a, b in zip(cost.verify_cost, start)]
    assert min(shift) > 0.4 * MS and max(shift) - min(shift) < 0.05 * MS
    assert choose_length(weak, cost)[0] == 0
    assert choose_length([0.9] * 15, cost)[0] == 15  # a good draft still runs, full length


def test_widths_that_run_correct_their_own_cost():
    """When two widths run and disagree with start-up in different ways, each converges to what
    it costs (the shared shift plus a residual per width)."""
    cost = CostModel([1.0 * MS] * 8)
    for _ in range(1500):
        cost.observe(1, 1.2 * MS)
        cost.observe(8, 1.8 * MS)
    assert cost.T(1) == pytest.approx(1.2 * MS, rel=0.03)
    assert cost.T(8) == pytest.approx(1.8 * MS, rel=0.03)
    assert cost.T(1) <= cost.T(4) <= cost.T(8)


def test_wide_widths_timed_wrong_at_start_up_do_not_drag_the_curve():
    """A 2-vCPU AVX2 CPU: start-up timed T(1) at 13.3 ms and T(16) at 491 ms; in the engine one
    row costs 18.7 ms and sixteen 219. One-row passes set the shared offset, and the few wide
    passes correct their own width: T(1) follows its passes, T(16) converges toward its own,
    and the curve stays steep. When wide passes moved the shared offset too, their large
    absolute errors dragged every width along and the curve went flat (T(1..16) = 15.7-16.5
    ms), so prompt lookup drafted 11 tokens at a time on novel text and ran at 0.66x."""
    shape = [13.3 * MS * (1 + 0.6 * k) for k in range(15)] + [491 * MS]
    truth = [18.7 * MS * (1 + 0.7 * k) for k in range(16)]
    cost = CostModel(shape)
    for step in range(600):
        cost.observe(16 if step % 10 == 9 else 1, truth[15] if step % 10 == 9 else truth[0])
    assert cost.T(1) == pytest.approx(truth[0], rel=0.05)
    assert cost.T(16) == pytest.approx(truth[15], rel=0.3)
    assert cost.T(8) / cost.T(1) > 3
    assert choose_length([0.1] * 15, cost)[0] == 0  # a weak draft does not pay for its rows


def test_curve_stays_non_decreasing_and_positive():
    """A wider pass never reads cheaper than a narrower one, however the observations fall, and
    no width drops below half its start-up time without a rescale."""
    cost = h200_like()
    start = cost.verify_cost
    for _ in range(400):
        cost.observe(2, 0.8 * MS)  # two-row passes cheaper than one-row ones were at start-up
    curve = cost.verify_cost
    assert all(a <= b for a, b in zip(curve, curve[1:]))
    assert all(t >= 0.5 * s for t, s in zip(curve, start))
    assert cost.T(20) >= cost.T(16)  # extrapolated past the measured range
    steep = CostModel([1 * MS, 10 * MS])  # (here monotonicity alone would let T(2) fall to T(1))
    for _ in range(400):
        steep.observe(2, 0.1 * MS)
    assert steep.T(2) == pytest.approx(5 * MS)


def test_reset_forgets_online_state_and_rejects_empty_curves():
    cost = h200_like()
    for _ in range(50):
        cost.observe(3, 3 * MS)
    cost.reset([1 * MS, 2 * MS])
    assert cost.verify_cost == [1 * MS, 2 * MS] and cost.offset == 0 and cost.max_rows == 2
    cost.observe(5, 1 * MS)  # wider than the curve: ignored
    for _ in range(3):  # nonsense, even as a streak (three one-row passes would rescale): ignored
        cost.observe(1, -1.0)
    cost.observe(2, -1.0)
    assert cost.verify_cost == [1 * MS, 2 * MS]
    with pytest.raises(ValueError):
        CostModel([])


def test_alpha_zero_freezes_the_curve_even_against_a_far_off_streak():
    """``alpha = 0`` holds the start-up curve: one-row passes 3x slower than start-up, which
    rescale a live model (``live``, beside it), leave it as it was. The offline replay's
    comparison with the engine (tests/test_replay_scheduler.py) freezes the curve this way; on a
    slow CI machine a streak rescaled it anyway and the two disagreed."""
    frozen, live = h200_like(), h200_like()
    frozen.alpha = 0.0
    start = frozen.verify_cost
    for _ in range(10):
        frozen.observe(1, 3 * start[0])
        frozen.observe(4, 3 * start[3])
        live.observe(1, 3 * start[0])
    assert frozen.verify_cost == start
    assert live.T(1) == pytest.approx(3 * start[0], rel=0.05)


def test_wide_passes_over_long_contexts_cost_their_rows_attention():
    """With fitted context slopes (seconds per context token for a pass's first row, ``a``, and
    each further row, ``b``), a k-row pass over n tokens costs ``(a + b (k - 1)) (n - n_ref)``
    more than the start-up curve (timed at n_ref); passes that cost exactly that leave the
    offset and residuals at zero, so the curve at n_ref stays the start-up one and a long
    context makes drafts dearer for that request only. Shorter contexts are priced at n_ref."""
    shape = [10 * MS + 4.5 * MS * k for k in range(8)]
    a, b = 6 * MS / 1000, 5 * MS / 1000  # ~6 ms per row per 1k tokens: the default model on the CPU
    cost = CostModel(shape, context_slope=a, context_row_slope=b, reference_context=256)
    assert cost.T(4, 1256) - cost.T(4) == pytest.approx(6 * MS + 3 * 5 * MS)
    assert cost.T(1, 1256) - cost.T(1, 256) == pytest.approx(6 * MS)
    assert cost.T(4, 10) == cost.T(4, 256) == cost.T(4) == pytest.approx(shape[3])
    for step in range(400):
        rows = 1 + step % 4
        cost.observe(rows, shape[rows - 1] + (a + (rows - 1) * b) * (3000 - 256), context=3000)
    assert cost.offset == pytest.approx(0, abs=1e-9)
    assert max(abs(r) for r in cost.residual) < 1e-9
    assert cost.verify_cost == pytest.approx(shape)
    # the same acceptance pays for fewer drafts at 3k tokens than at 256
    conditional = [0.6] * 7
    assert choose_length(conditional, cost, context=3000)[0] < choose_length(conditional, cost, context=256)[0]


def test_context_slopes_from_start_up_times_at_two_contexts():
    """``(a, b)`` from T(1) and T(w) at the reference context and one 844 tokens longer: rows
    that attend one by one (the CPU) give b ~ a; rows that attend in parallel (the H200's
    fused pass) give b ~ 0; differences within 3% are noise; nothing goes negative."""
    from engine.runner import context_slopes

    a, b = context_slopes(844, 8, (10.5 * MS, 46 * MS), (15.6 * MS, 86.8 * MS))
    assert a == pytest.approx(5.1 * MS / 844) and b == pytest.approx(a, rel=0.01)
    a, b = context_slopes(844, 16, (1.57 * MS, 3.49 * MS), (1.85 * MS, 3.80 * MS))
    assert a == pytest.approx(0.28 * MS / 844) and b == pytest.approx((0.31 - 0.28) * MS / 844 / 15)
    assert context_slopes(844, 8, (10 * MS, 40 * MS), (10.2 * MS, 40.5 * MS)) == (0.0, 0.0)  # within noise
    assert context_slopes(844, 8, (11 * MS, 40 * MS), (10 * MS, 30 * MS)) == (0.0, 0.0)


def test_a_slope_fitted_twice_too_steep_does_not_rescale_the_shared_curve():
    """A start-up fit of the context slope 2x too steep (the CPU's fits ranged 2.7-6.0 ms per 1k
    tokens): a long request's one-row passes look far faster than the curve once the term is
    taken off, but they are within 2x of the whole prediction, so they are no streak; the curve
    at the calibration context stays within the clip of start-up, and a far-off streak against
    the whole prediction still rescales it."""
    shape = [10.5 * MS + 4.5 * MS * k for k in range(8)]
    true_a = 3 * MS / 1000
    cost = CostModel(shape, context_slope=2 * true_a, context_row_slope=2 * true_a, reference_context=256)
    for _ in range(60):  # one long request
        cost.observe(1, shape[0] + true_a * (2500 - 256), context=2500)
    assert cost.context_slope == pytest.approx(2 * true_a)  # no streak, no rescale
    assert cost.T(1) >= 0.5 * shape[0]  # the offset moved by clipped observations only
    for _ in range(100):  # then short ones
        cost.observe(1, shape[0], context=200)
    assert cost.T(1) == pytest.approx(shape[0], rel=0.1)
    for _ in range(3):  # the machine got 3x slower
        cost.observe(1, 3 * cost.T(1, 2500), context=2500)
    assert cost.T(1, 2500) == pytest.approx(3 * (shape[0] + 2 * true_a * 2244), rel=0.2)


def test_copied_spans_do_not_lend_their_rates_to_a_chance_match():
    """Evidence from matches 6+ tokens long (text being copied) stays in their own buckets: a
    4-token match, all that a phrase recurring by chance in novel text gets, keeps the
    estimate its own bucket earned. When every match of 4+ shared one bucket, a chance match
    after copy-like requests was estimated at 0.95+ per position and drafted 6-8 deep."""
    from engine.scheduler import AcceptanceModel, RequestAcceptance, _bucket

    assert [_bucket(m) for m in (0, 1, 2, 3, 4, 5, 6, 15, 16, 32)] == [1, 1, 2, 3, 4, 4, 5, 5, 6, 6]

    model = AcceptanceModel()
    earlier = RequestAcceptance(model)  # (earlier requests' drafts feed the engine-wide model)
    for _ in range(200):  # copying: 8-token drafts after long matches, all accepted
        earlier.observe(24, 8, 8)
        earlier.observe(8, 8, 8)
    for _ in range(30):  # chance matches of 4: the first draft is rejected
        earlier.observe(4, 1, 0)
    request = RequestAcceptance(model)
    chance, copied = request.survival(4, 8), request.survival(24, 8)
    assert chance[0] < 0.2 and copied[0] > 0.95 and min(copied) > 0.9
    cost = CostModel([MS * (1 + 0.3 * k) for k in range(16)])  # a CPU-like curve, T(2) = 1.3 T(1)
    assert choose_length(chance, cost)[0] == 0 and choose_length(copied, cost)[0] == 8
