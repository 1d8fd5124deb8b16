"""Choose the draft length that maximises expected committed tokens per second.

For a proposal of up to ``L_max`` tokens, committed tokens per verify step are
``E(L) = 1 + sum_{k=1..L} prod_{i<=k} c_i`` (accepted drafts plus the bonus/recovered token),
where ``c_i`` is the probability that draft ``i`` is accepted given drafts ``1..i-1`` were. A
step costs ``T(L + 1)``, the verify cost of ``L + 1`` rows (measured at start-up, refreshed
online by a shift shared by every width, :class:`CostModel`). The scheduler picks ``L`` maximising ``E(L) / T(L + 1)``; ``L = 0`` (plain decoding,
rate ``1 / T(1)``) whenever no draft length beats it. ``L`` is fixed before verification, so
the admission of draft ``k`` never depends on draft ``k`` being accepted (lossless).

Prompt-lookup ``c_i`` estimates are Beta-smoothed counts per request, per bucket of the match's
extent (:func:`_bucket`) and per draft position, shrunk toward engine-wide counts of earlier
requests.
This replaces ds4's fixed growth/back-off rules (7 -> 15 after 8 full accepts, 64-token back-off)
with the same quantity those rules approximate: expected tokens per second.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field


class CostModel:
    """Verify cost ``T(k, n)`` in seconds for ``k = 1..max_rows`` rows over a context of ``n``
    tokens, with online refresh.

    ``T(k, n) = curve[k] + (a + b (k - 1)) max(0, n - n_ref)``, where
    ``curve[k] = shape[k] + offset + residual[k]`` is made non-decreasing in ``k``:

    * ``shape`` is the start-up curve (each width timed alone, :meth:`TargetRunner.calibrate`);
    * ``offset`` (EMA over one-row passes of their time minus the start-up T(1)) is what a pass
      costs in the engine beyond its start-up time: the cycle's accept/logprob kernels, the host
      sync (the context term below is taken off first). It moves every width alike, so the one
      width that runs most (one row, whenever nothing is drafted) cannot drift away from widths
      that rarely run: refreshing each width on its own once let an in-engine T(1) rise 30% on
      the H200 while T(2..16) kept their start-up values, and the scheduler, seeing drafts as
      nearly free, drafted 13.6 tokens per draft on novel chat and ran at 0.92x plain;
    * ``residual[k]`` (EMA over width ``k``'s own passes, ``k > 1``, of what the offset leaves)
      corrects the curve's shape where the widths that run disagree with start-up; a width that
      never runs keeps its start-up time plus the offset. Residuals do not decay: on the H200
      the wide passes cost 0.4-0.7 ms more in the engine than at start-up, and a decay of the
      residuals of widths unseen for 64 passes (tried in the thirteenth session against a slow
      stretch of the CPU that had ratcheted T(4) up) made the replayed predictions of wide
      passes worse there (median |log error| 0.096 -> 0.127) and no better on the CPU;
    * ``a`` and ``b`` (:func:`engine.runner.context_slopes`, seconds per context token, fitted
      at start-up from T(1) and T(max_rows) at two contexts; 0 where attention is cheap) are
      what the first row and each further row of a pass cost more per token of context beyond
      the calibration context ``n_ref``: wide passes over long contexts cost more than the
      start-up curve says (on the CPU, where rows attend one by one, ``b`` is about ``a``).
      Contexts shorter than ``n_ref`` are priced at ``n_ref`` (the fit says nothing below it).
      Observations are brought back to ``n_ref`` before they move the offset or a residual.

    Raises:
        ValueError: an empty curve.
    """

    def __init__(self, verify_cost: list[float], alpha: float = 0.05, context_slope: float = 0.0,
                 context_row_slope: float = 0.0, reference_context: int = 256):
        self.alpha = alpha  # EMA weight of a new observation; 0 freezes the curve (no rescale)
        self.context_slope = max(0.0, context_slope)  # a: the first row's, s/token
        self.context_row_slope = max(0.0, context_row_slope)  # b: each further row's, s/token
        self.reference_context = reference_context
        self.reset(verify_cost)

    def reset(self, verify_cost: list[float]) -> None:
        """Start again from ``verify_cost`` (seconds, index ``k - 1``): no offset, no residuals,
        no streak of far-off passes.

        Raises:
            ValueError: an empty curve.
        """
        if not verify_cost:
            raise ValueError("a cost curve needs at least T(1)")
        self.far: list[float] = []  # ratios of consecutive observations >2x off, one direction
        self.shape = [float(t) for t in verify_cost]
        self.offset = 0.0
        self.residual = [0.0] * len(self.shape)
        self.observations = [0] * len(self.shape)  # passes observed per width (diagnostics)
        self._refresh()

    def _refresh(self) -> None:
        curve, floor = [], 0.0
        for base, res in zip(self.shape, self.residual):
            # never below half the start-up time (a streak of faster passes rescales instead)
            floor = max(floor, base + self.offset + res, 0.5 * base)
            curve.append(floor)
        self._curve = curve

    @property
    def verify_cost(self) -> list[float]:
        """The current curve ``T(1..max_rows)`` in seconds (a copy)."""
        return list(self._curve)

    @property
    def max_rows(self) -> int:
        return len(self._curve)

    def _context_term(self, rows: int, context: int | None) -> float:
        if context is None or context <= self.reference_context:
            return 0.0
        return (self.context_slope + (rows - 1) * self.context_row_slope) * (context - self.reference_context)

    def T(self, rows: int, context: int | None = None) -> float:
        """Seconds for a pass of ``rows`` rows over ``context`` tokens (None: the calibration
        context); past the measured range (wide batched passes), extrapolated linearly from the
        last two points."""
        curve = self._curve
        if rows <= len(curve):
            base = curve[rows - 1]
        else:
            last = curve[-1]
            step = last - curve[-2] if len(curve) > 1 else last
            base = last + (rows - len(curve)) * max(step, 0.0)
        return base + self._context_term(rows, context)

    def observe(self, rows: int, seconds: float, context: int | None = None) -> None:
        """A pass of ``rows`` rows over ``context`` tokens (None: the calibration context) took
        ``seconds``; the context term is taken off first.

        A one-row pass moves the offset (EMA): it runs most often, and its excess over start-up
        is the per-pass overhead every width pays. A wider pass moves only its width's residual,
        by an observation clipped to [0.5, 2] x the curve (a lone spike moves it by at most
        ``alpha`` of T(k); a width that start-up timed 2x off converges over ~20 passes). Wide
        passes used to move the shared offset too, and their errors, large in absolute terms,
        dragged T(1) along: on a 2-vCPU AVX2 CPU the curve went flat (T(1..16) = 15.7-16.5
        ms against 18.7-219 ms measured) and prompt lookup ran novel chat at 0.66x plain.
        Three one-row passes in a row more than 2x off the prediction (context term included,
        so a slope fitted 2x off is no streak), in one direction, rescale the start-up shape and
        the slopes so that T(1) at that context lands on their median and start the refresh again (a lone
        outlier changes nothing): a start-up measurement taken while other work loaded the CPU
        would otherwise leave the curve far off for hundreds of passes.

        With ``alpha == 0`` the curve is frozen: nothing moves it, a streak's rescale included
        (the offline replay's comparison with the engine relies on that)."""
        if not (1 <= rows <= self.max_rows and seconds > 0) or self.alpha <= 0:
            return
        i = rows - 1
        term = self._context_term(rows, context)
        current = self._curve[i]
        # brought back to the calibration context, within [0.5, 2] x the curve (a slope fitted
        # too steep or too flat moves the offset or a residual by at most alpha of that)
        seen = min(max(seconds - term, 0.5 * current), 2.0 * current)
        if i > 0:
            self.observations[i] += 1
            self.residual[i] += self.alpha * (seen - self.shape[i] - self.offset - self.residual[i])
            self._refresh()
            return
        predicted = current + term
        ratio = seconds / predicted  # against the whole prediction: a wrong slope is no streak
        if 0.5 <= ratio <= 2.0:
            self.far = []
            self.observations[0] += 1
            self.offset += self.alpha * (seen - self.shape[0] - self.offset)
            self._refresh()
            return
        if self.far and (self.far[-1] > 1) != (ratio > 1):
            self.far = []  # a streak runs in one direction
        self.far.append(ratio)
        if len(self.far) >= 3:  # (no EMA step meanwhile: a lone spike leaves the curve alone)
            # the start-up shape and slopes scaled so this context's T(1) lands on the median
            scale = sorted(self.far)[1] * predicted / (self.shape[0] + term)
            self.context_slope *= scale
            self.context_row_slope *= scale
            self.reset([t * scale for t in self.shape])

    def relative(self) -> list[float]:
        curve = self._curve
        return [t / curve[0] for t in curve]


def _bucket(match_length: int) -> int:
    """Evidence bucket of a prompt-lookup match extent (``Draft.match_length``): 1, 2 and 3 on
    their own, 4-5 (with the drafter's default longest n-gram, 5, a match found but not
    extended: a phrase recurring by chance, or the start of a copy), 6-15 and 16+ (text being
    copied). The edges are absolute, not relative to the drafter's ``max_n``: a deployment
    that raises it to 8 files unextended matches of 6-8 with copied text, which they more
    likely are than shorter ones. Before the thirty-fifth session every match of 4 or more
    shared bucket 4, so after copy-like requests a 4-token chance match in novel chat drew the
    rates copied spans had earned (0.95 and more at every position) and was drafted 6-8 tokens
    deep (docs/benchmarks.md, scheduler section, "Thirty-fifth session")."""
    if match_length >= 16:
        return 6
    if match_length >= 6:
        return 5
    return min(max(match_length, 1), 4)


@dataclass
class AcceptanceCounts:
    """Counts of drafts reaching / passing each position, per match-extent bucket."""

    reached: dict[tuple[int, int], float] = field(default_factory=dict)
    accepted: dict[tuple[int, int], float] = field(default_factory=dict)

    def observe(self, bucket: int, num_draft: int, num_accepted: int, weight: float = 1.0) -> None:
        for pos in range(1, min(num_accepted + 1, num_draft) + 1):
            key = (bucket, pos)
            self.reached[key] = self.reached.get(key, 0.0) + weight
            if pos <= num_accepted:
                self.accepted[key] = self.accepted.get(key, 0.0) + weight


# Prior conditional acceptance per match-extent bucket (:func:`_bucket`) before any evidence.
_PRIOR = {1: 0.2, 2: 0.35, 3: 0.5, 4: 0.65, 5: 0.75, 6: 0.85}


class AcceptanceModel:
    """Engine-wide prompt-lookup acceptance evidence (decayed), shared by all requests."""

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.999):
        self.prior_weight = prior_weight
        self.decay = decay
        self._global = AcceptanceCounts()
        self._lock = threading.Lock()

    def observe(self, bucket: int, num_draft: int, num_accepted: int) -> None:
        with self._lock:
            g = self._global
            for d in (g.reached, g.accepted):
                for key in d:
                    d[key] *= self.decay
            g.observe(bucket, num_draft, num_accepted)

    def global_rate(self, bucket: int, pos: int) -> float:
        key = (bucket, min(pos, 16))
        with self._lock:
            reached = self._global.reached.get(key, 0.0)
            accepted = self._global.accepted.get(key, 0.0)
        prior = _PRIOR[bucket]
        return (accepted + self.prior_weight * prior) / (reached + self.prior_weight)


@dataclass
class RequestAcceptance:
    """One request's prompt-lookup evidence, shrunk toward the engine-wide model."""

    model: AcceptanceModel
    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    weight: float = 3.0  # how many observations the engine-wide estimate is worth

    OPTIMISM = 0.5  # standard deviations of exploration bonus

    def rate(self, bucket: int, pos: int, optimism: float | None = None) -> float:
        """Posterior mean of ``c_pos`` plus ``optimism`` standard deviations (exploration: a
        request with little evidence still probes short drafts, so a good source of drafts is
        found; each failed probe shrinks the bonus). Half a deviation, not one: with one, the
        expected accepted tokens of the chosen drafts were 1.5-3.8x those accepted on the
        benchmark workloads (novel chat: 356 against 94), and the scheduler's replay on the
        H200 curve, refreshed online, ran 2-5% faster on 7 of 8 workloads with half (1% slower
        on adversarial; on the CPU curve copy lost 4%, novel code gained 7.5%; docs/benchmarks.md)."""
        optimism = self.OPTIMISM if optimism is None else optimism
        key = (bucket, pos)
        prior = self.model.global_rate(bucket, pos)
        reached = self.counts.reached.get(key, 0.0) + self.weight
        mean = (self.counts.accepted.get(key, 0.0) + self.weight * prior) / reached
        return min(1.0, mean + optimism * math.sqrt(mean * (1.0 - mean) / (reached + 1.0)))

    def survival(self, match_length: int, length: int) -> list[float]:
        """Conditional acceptance ``c_1..c_length`` for a proposal with this match length."""
        b = _bucket(match_length)
        return [self.rate(b, pos) for pos in range(1, length + 1)]

    def observe(self, match_length: int, num_draft: int, num_accepted: int) -> None:
        b = _bucket(match_length)
        self.counts.observe(b, num_draft, num_accepted)
        self.model.observe(b, num_draft, num_accepted)


def expected_tokens(conditional: list[float]) -> list[float]:
    """``E(L)`` for ``L = 0..len``: 1 + sum of prefix-survival products."""
    out, survive, total = [1.0], 1.0, 1.0
    for c in conditional:
        survive *= c
        total += survive
        out.append(total)
    return out


def best_length(conditional: list[float], cost: CostModel) -> int:
    """The ``L`` in ``0..len(conditional)`` maximising ``E(L) / T(L + 1)`` (0 = plain decoding)."""
    return choose_length(conditional, cost)[0]

def prefix_to_conditional(survival: list[float]) -> list[float]:
    out, prev = [], 1.0
    for a in survival:
        out.append(a / prev if prev > 0 else 0.0)
        prev = a
    return out


class DsparkStats:
    """Engine-wide DSpark evidence: confidence calibration, draft cost, recent realised yield.

    Calibration follows vLLM's online rule (confidence-scheduled verification, PR #47808): per
    draft position an EMA of realised over predicted prefix survival, clamped to [0.25, 4],
    rescales the confidence head's prefix survival ``a_k = prod c_i``.
    """

    PROBE_SHARE = 0.02  # losing probes may take at most this share of decode time (engine-wide)
    PROBE_SHARE_MIN = 0.0025  # ... halved by every probe (after BOUND_AFTER timed) down to this, until a win
    BOUND_AFTER = 3  # timed forwards before best_case_rate may keep probes from running
    # what the forwards timed while DSpark loses cost over a steady one: they project a prompt's
    # rows or the 32+ cycles' rows queued since the last probe, where those are more than
    # :attr:`steady_rows` (tiny model on the CPU: +40-50% at 65-100 rows; H200, the default
    # model: 2.86 against 2.27 ms for a request's first forward)
    ABSORB_MARGIN = 1.5
    # whether requests keep DSpark (its taps and queued rows) while it neither delivers more than
    # plain decoding nor may be probed: False (the rule, :meth:`worth_tapping`); True keeps it
    # whenever it could win, as before the thirty-third session (except that a cycle without room
    # to draft drops it now), a knob for side-by-side benchmarks
    TAP_WHILE_IDLE = False
    # draft_cost is the median of this many most recent timed steady forwards: one outlier (a forward
    # that compiled CUDA kernels on a fresh machine took ~17 s on an H100; an EMA seeded with it
    # still read 147 ms after 45 forwards of ~2 ms, docs/benchmarks.md "Thirty-fourth session")
    # is ignored from the third forward on, and a lasting change is followed within five
    COST_WINDOW = 9
    # Per-request acceptance evidence (:meth:`request_accepted`): the engine-wide EMA weighs as
    # this many of the request's own DSpark cycles in its running mean; 0 keeps the engine-wide
    # EMA alone. H200, side by side (docs/benchmarks.md, fifty-second session): auto with 2
    # against 0 +0.7% on average over 17 workload runs of nine workloads (-1.9% to +4.3%, within
    # noise run to run), and it rescues a request whose own drafts pass from other requests'
    # verdict.
    REQUEST_PRIOR = 2
    # A forward that projects at most this many new context rows (the rows committed since the
    # request's last DSpark forward) is a steady one, unless the engine says otherwise
    # (``steady_rows``: what one DSpark cycle commits, ``block_size + 1``, capped by what the
    # drafter projects in its steady path): what a cycle costs while DSpark keeps drafting.
    # Only those set draft_cost. The others (a request's first forward over its prompt, a probe
    # after cycles of other drafters that committed more rows) cost more and say nothing about
    # that: on an H100 every forward the scheduler timed in a benchmark run was one of them
    # (2.5-2.9 ms), against 1.2-1.3 ms for steady forwards (docs/benchmarks.md, "Thirty-ninth
    # session"), and DSpark was never chosen. Until the fifty-second session the engine passed
    # the fused launch's capacity (64 rows with its 8-row kernel, projected in the launch in
    # chunks): on an H200, the forwards of up to 64 rows auto timed (probes, short prompts'
    # first forwards) set the draft cost to 1.8-2.5 ms against 1.1-1.4 ms for forwards of one
    # cycle's rows.
    STEADY_ROWS = 16
    # How much a request's first DSpark cycle (the draft of its first forward, anchored on the
    # prompt's last token) weighs in :attr:`accepted_ema`: 1 as any other (the default), 0 leaves
    # it out. On the benchmark's novel-text workloads that position accepts half of what later
    # cycles do, on the CPU as on an H100 (docs/benchmarks.md, fifty-fourth session), and 11 of
    # the 13 forwards auto timed in an H100 run were requests' first. A knob for side-by-side GPU
    # runs (``bench_speculative --variant first0:engine.scheduler.DsparkStats.FIRST_CYCLE_WEIGHT=0``),
    # not yet measured.
    FIRST_CYCLE_WEIGHT = 1.0

    def __init__(self, positions: int = 16, alpha: float = 0.05, steady_cost: float = 0.0,
                 steady_rows: int = STEADY_ROWS):
        self.alpha = alpha
        # forwards of at most this many new rows (and not a request's first) are steady ones
        self.steady_rows = steady_rows
        # measured target-pass time of every cycle of a request that may run DSpark (earns probes)
        self.decode_seconds = 0.0
        self.probe_seconds = 0.0  # time spent on DSpark forwards that ran as probes
        self.probe_share = self.PROBE_SHARE  # the probe budget's current share of decode time
        self.realised = [1.0] * positions
        self.predicted = [1.0] * positions
        # seconds per steady propose: the median of the recent timed steady ones; before any,
        # steady_cost (timed at start-up, Engine._time_dspark_forward), else the median of the
        # other forwards (an overestimate)
        self.steady_cost = steady_cost
        self.draft_cost = steady_cost
        self.recent_costs: deque[float] = deque(maxlen=self.COST_WINDOW)  # steady forwards
        self.catch_up_costs: deque[float] = deque(maxlen=self.COST_WINDOW)  # later ones of more rows
        self.prompt_costs: deque[float] = deque(maxlen=self.COST_WINDOW)  # requests' first forwards
        self.fastest_forward = math.inf  # the fastest timed propose (seconds)
        self.timed_forwards = 0  # proposes timed (a forward that compiled a graph is not)
        self.accepted_ema = 1.0  # accepted drafts per DSpark cycle (EMA; the first cycle sets it)
        self.length_ema = 4.0  # verified draft length per DSpark cycle (EMA; the first sets it)
        self.cycles = 0  # DSpark cycles observed
        self.drafted_cycles = 0  # ... of which verified a draft (the length estimate's count)
        # share of the DSpark forwards of requests with another drafter that were catch-ups
        # (running mean, then EMA; :meth:`observe_forward`): 1 / the mean run of forwards that
        # a catch-up starts, over which its extra cost is spread (:meth:`forward_cost`)
        self.catch_up_share = 1.0
        self.shared_forwards = 0

    def calibrated(self, conditional: list[float]) -> list[float]:
        survival, acc = [], 1.0
        for k, c in enumerate(conditional):
            acc *= c
            i = min(k, len(self.realised) - 1)
            ratio = min(4.0, max(0.25, self.realised[i] / max(self.predicted[i], 1e-6)))
            survival.append(min(acc * ratio, survival[-1] if survival else 1.0))
        return prefix_to_conditional(survival)

    def observe(self, conditional: list[float], num_draft: int, num_accepted: int, first: bool = False) -> None:
        """A verified DSpark cycle (or a forward cut to no draft: ``num_draft`` 0); ``first``: the
        draft of its request's first forward (weighed by :attr:`FIRST_CYCLE_WEIGHT` in
        :attr:`accepted_ema`)."""
        acc = 1.0
        for k in range(min(num_draft, len(self.realised))):
            acc *= conditional[k]
            self.predicted[k] += self.alpha * (acc - self.predicted[k])
            self.realised[k] += self.alpha * (float(k < num_accepted) - self.realised[k])
        # A running mean over the first 1/alpha cycles, an EMA after: the first observation
        # replaces the optimistic priors (one losing probe is enough to gate DSpark off), and
        # each of the next few probes weighs as much as it (with the EMA's 5% from the start,
        # a drafter gated off by one unlucky probe would need dozens of winning probes, each
        # budget-limited, to come back). A cycle cut to no draft leaves the length alone.
        # (a weighted running mean, then EMA: a cycle of weight w moves it w times as far)
        weight = self.FIRST_CYCLE_WEIGHT if first else 1.0
        if weight > 0:
            self.cycles += 1 if weight == 1 else weight
            self.accepted_ema += weight * max(self.alpha, 1.0 / self.cycles) * (num_accepted - self.accepted_ema)
        if num_draft:
            self.drafted_cycles += 1
            self.length_ema += max(self.alpha, 1.0 / self.drafted_cycles) * (num_draft - self.length_ema)

    def observe_cycle(self, seconds: float) -> None:
        """A target pass of ``seconds`` of a request that may run DSpark (measured; any drafter
        or none, DSpark carried or dropped; one per batched pass): it earns probe time."""
        self.decode_seconds += seconds

    def may_probe(self) -> bool:
        """Whether a probe of a losing DSpark fits the probe budget: the time spent on probes
        so far stays within :attr:`probe_share` of the decode time (one probe always runs
        first). The share starts at :attr:`PROBE_SHARE` (2%); every probe once
        :attr:`BOUND_AFTER` forwards were timed halves it, down to :attr:`PROBE_SHARE_MIN`
        (0.25%), and a verified DSpark draft that beat the other options
        restores it (:meth:`observe_win`: ``(1 + accepted) / (T(L + 1) + draft cost)`` above the
        best alternative's expected rate when it was chosen). Exploration thus costs in proportion
        to the doubt left: a drafter that keeps losing (the shipped one on every benchmark
        workload: DSpark forwards of 4-5 target steps on the CPU, acceptance ~0.3) costs at most
        ~2% early and 0.25% in the long run, however many requests probe it, while one that starts
        winning is found by the remaining probes and used every cycle again."""
        return self.probe_seconds <= self.probe_share * self.decode_seconds

    def observe_probe(self, seconds: float) -> None:
        """A probe's DSpark forward took ``seconds``; the budget's share halves, once
        :attr:`BOUND_AFTER` forwards have been timed (the probes before measure what a forward
        costs, which :meth:`best_case_rate` needs: halving from the first one delayed the third
        timed forward on the CPU to ~54 s of decoding, and requests tapped hidden rows for a
        drafter that could not win until then)."""
        self.probe_seconds += seconds
        if self.timed_forwards >= self.BOUND_AFTER:
            self.probe_share = max(self.PROBE_SHARE_MIN, 0.5 * self.probe_share)

    def observe_win(self) -> None:
        """A verified DSpark draft yielded more tokens per second (its forward included) than
        the best other option promised when it was chosen."""
        self.probe_share = self.PROBE_SHARE

    def observe_cost(self, seconds: float, *, rows: int, first: bool = False) -> None:
        """A timed DSpark forward (propose) that projected ``rows`` new context rows took
        ``seconds``; ``first``: a request's first forward (over its prompt). :attr:`draft_cost`
        is the median of the last :attr:`COST_WINDOW` steady forwards (later ones of ``rows <=
        steady_rows``); before any, :attr:`steady_cost` if it was timed, else the median of the
        last others. :attr:`catch_up_cost` is the median of the later forwards of more rows: a
        prompt's projection (hundreds of rows for an agent's prompt) says little about a
        catch-up after a few cycles of other drafters (tens of rows). A first forward is never a
        steady one, however short its prompt: it projects the prompt and sets up the request's
        draft cache (a prompt of up to ``steady_rows`` tokens used to count as steady)."""
        if first:
            self.prompt_costs.append(seconds)
        elif rows <= self.steady_rows:
            self.recent_costs.append(seconds)
        else:
            self.catch_up_costs.append(seconds)
        if self.recent_costs:
            self.draft_cost = statistics.median(self.recent_costs)
        elif not self.steady_cost:
            self.draft_cost = statistics.median([*self.catch_up_costs, *self.prompt_costs])
        self.fastest_forward = min(self.fastest_forward, seconds)
        self.timed_forwards += 1

    @property
    def catch_up_cost(self) -> float:
        """Median seconds of the recent forwards after a request's first that projected more
        than :attr:`steady_rows` new rows (0.0 before any)."""
        return statistics.median(self.catch_up_costs) if self.catch_up_costs else 0.0

    def observe_forward(self, rows: int) -> None:
        """A DSpark forward ran that was priced at ``rows`` new context rows (the rows committed
        since the request's last DSpark forward; 0 for its first, over the prompt): it updates
        :attr:`catch_up_share` (a running mean over the first ``1 / alpha`` forwards, with its
        prior of 1 counted as one of them, so a first steady forward halves it rather than
        zeroing it; an EMA after). The engine feeds it the unforced forwards of requests that
        also have prompt lookup (auto): how long DSpark runs between other drafters' cycles is
        what the share prices. Requests with DSpark alone, or forcing it (``min_draft_tokens``),
        run it every cycle they can and would make runs look longer than auto's are. The share
        is engine-wide: mixed traffic averages the run lengths of all auto requests."""
        self.shared_forwards += 1
        weight = max(self.alpha, 1.0 / (self.shared_forwards + 1))
        self.catch_up_share += weight * (float(rows > self.steady_rows) - self.catch_up_share)

    def forward_cost(self, rows: int) -> float:
        """Seconds to charge the next DSpark forward of a request when it projects ``rows`` new
        context rows (the rows committed since the request's last DSpark forward).

        A steady forward (``rows <= steady_rows``) costs :attr:`draft_cost`. A catch-up costs
        more, :attr:`catch_up_cost` (before any was timed, :attr:`draft_cost` x
        :attr:`ABSORB_MARGIN`), but it is paid once for the run of steady forwards that follows
        while DSpark keeps being chosen, so its extra over :attr:`draft_cost` is charged times
        :attr:`catch_up_share` (catch-ups per forward, 1 / the mean run): all of it where
        DSpark's runs last one forward, little where they last many. Charged in full, a DSpark
        that wins at the steady price would stay locked out after a few other cycles until a
        probe ran it; charged at the steady price, auto ran code_edit at 0.973x prompt lookup
        alone on an H100 (forty-ninth session, ``spec_h100_s49_qat_r4.json``): its 50 DSpark
        drafts came after prompt-lookup cycles, and their forwards were catch-ups (median 2.33
        ms against 1.23 ms steady). A request's first forward, over its prompt, is priced as a
        steady one by the engine (``Sequence._dspark_rows``): every use of DSpark pays it."""
        if rows <= self.steady_rows:
            return self.draft_cost
        full = max(self.draft_cost, self.catch_up_cost or self.ABSORB_MARGIN * self.draft_cost)
        return self.draft_cost + self.catch_up_share * (full - self.draft_cost)

    def best_case_rate(self, cost: CostModel, max_draft: int, context: int | None = None) -> float:
        """Tokens per second DSpark would deliver if every draft were accepted: the best
        ``(1 + L) / (T(L + 1, context) + forward)`` over ``L = 1..max_draft``, the forward being
        the fastest timed one over :attr:`ABSORB_MARGIN`. A probe can only find DSpark winning
        where this beats the other options; where it does not (a CPU, whose DSpark forward costs
        ~9 one-row passes: 8 tokens would need ~10 T(1) even at a third less), probing is pure
        cost. Infinite until :attr:`BOUND_AFTER` forwards were timed; priced at the fastest of
        them, so one slow reading (a host stall) cannot shut DSpark out, and with the margin, so
        forwards that projected many queued rows do not either."""
        if max_draft <= 0 or cost.max_rows <= 1:  # no room to draft: nothing to win
            return 0.0
        if self.timed_forwards < self.BOUND_AFTER:
            return math.inf
        forward = self.fastest_forward / self.ABSORB_MARGIN
        return max(((1 + n) / (cost.T(n + 1, context) + forward)
                    for n in range(1, min(max_draft, cost.max_rows - 1) + 1)), default=0.0)

    def can_win(self, cost: CostModel, max_draft: int, context: int | None = None) -> bool:
        """Whether DSpark could beat plain decoding at all (:meth:`best_case_rate` over ``1 /
        T(1)``) at ``context`` tokens: a request that starts while it cannot runs without DSpark
        (no taps, no probes), and a running one drops it on its next cycle
        (:meth:`worth_tapping`)."""
        return self.best_case_rate(cost, max_draft, context) > 1.0 / cost.T(1, context)

    def worth_tapping(self, cost: CostModel, max_draft: int, context: int | None = None,
                      rows: int = 1, accepted: float | None = None) -> bool:
        """Whether a request should carry DSpark now, tapping the target's hidden rows for it:
        DSpark :meth:`can_win` at ``context`` tokens with ``max_draft`` drafts (the request's
        room this cycle; 0: never), and either it has recently delivered more than plain
        decoding (:meth:`expected_rate` over ``1 / T(1)``, its next forward projecting ``rows``
        new context rows, so it may be chosen) or the
        engine-wide probe budget has room (:meth:`may_probe`, so a probe may run; whether this
        request's probe would run also depends on its other options). Otherwise the taps
        feed a drafter that will not run before the budget refills: on the H200 (a block forward
        of ~1.9 ms against a 1.6-1.8 ms target step) requests kept DSpark for their whole life,
        and auto ran at 0.96-0.97x prompt lookup on agent_session, agent_turn and novel_chat
        against 0.97-1.01x with no drafter loaded (docs/benchmarks.md, "Thirty-third session").
        A request that carries DSpark drops it on the first cycle where this is False (it still
        taps its prefill, so the prefix cache's taps namespace stays warm). The budget is earned
        by every pass of every request that may run DSpark, carrying it or not
        (:meth:`observe_cycle`), so it refills, and a later request probes again. ``accepted``:
        the request's own estimate of accepted drafts per DSpark cycle (:meth:`request_accepted`),
        instead of the engine-wide :attr:`accepted_ema`."""
        if not self.can_win(cost, max_draft, context):
            return False
        if self.TAP_WHILE_IDLE or self.may_probe():
            return True
        return self.expected_rate(cost, context, rows, accepted) > 1.0 / cost.T(1, context)

    def expected_rate(self, cost: CostModel, context: int | None = None, rows: int = 1,
                      accepted: float | None = None) -> float:
        """Tokens per second DSpark has recently delivered, at ``context``, with a forward that
        projects ``rows`` new context rows (:meth:`forward_cost`; the default 1 prices a steady
        one, what a cycle costs while DSpark keeps drafting); ``accepted`` drafts per cycle
        (default: the engine-wide :attr:`accepted_ema`)."""
        length = max(1, min(round(self.length_ema), cost.max_rows - 1))
        accepted = self.accepted_ema if accepted is None else accepted
        return (1.0 + accepted) / (cost.T(length + 1, context) + self.forward_cost(rows))

    def request_accepted(self, accepted_sum: float, cycles: int) -> float | None:
        """A request's estimate of accepted drafts per DSpark cycle: the running mean of its own
        ``cycles`` DSpark cycles (``accepted_sum`` drafts accepted in them) with the engine-wide
        :attr:`accepted_ema` counted as :attr:`REQUEST_PRIOR` cycles; None (the engine-wide
        value) where :attr:`REQUEST_PRIOR` is 0 or the request has run none. DSpark's yield
        differs from request to request (novel text against adversarial or copied text), and
        an engine-wide value set by other requests' cycles can keep a request from drafting
        where its own cycles win (docs/benchmarks.md, fifty-first session: 0.39 after
        agent_session kept DSpark off novel_code, where forced cycles accept 1.16)."""
        if not self.REQUEST_PRIOR or not cycles:
            return None
        return (self.REQUEST_PRIOR * self.accepted_ema + accepted_sum) / (self.REQUEST_PRIOR + cycles)


def choose_length(conditional: list[float], cost: CostModel, extra_cost: float = 0.0,
                  context: int | None = None) -> tuple[int, float]:
    """``(L, rate)`` maximising ``E(L) / (T(L + 1, context) + extra_cost)`` over ``L = 0..len``."""
    exp = expected_tokens(conditional[: cost.max_rows - 1])
    best, best_rate = 0, 1.0 / cost.T(1, context)
    for length in range(1, len(exp)):
        rate = exp[length] / (cost.T(length + 1, context) + extra_cost)
        if rate > best_rate:
            best, best_rate = length, rate
    return best, best_rate


def batch_width(survivals: list[list[float]], cost: CostModel, max_width: int,
                context: int | None = None) -> int:
    """Rows per sequence of a batched verify pass (continuous batching): the ``w`` in
    ``1..max_width`` maximising ``sum_s E_s(w - 1) / T(S * w)``, where ``survivals[s]`` are
    sequence ``s``'s conditional acceptance estimates for its proposal (empty: no draft) and
    every sequence's rows are padded to ``w``. A draft row is worth its expected tokens against
    the cost of widening the whole batch, so drafts shrink as the batch grows. ``context``: the
    sequences' mean context length (None: the calibration context)."""
    n = len(survivals)
    best, best_rate = 1, n / cost.T(n, context)
    for width in range(2, max_width + 1):
        tokens = sum(expected_tokens(c[: width - 1])[-1] for c in survivals)
        rate = tokens / cost.T(n * width, context)
        if rate > best_rate:
            best, best_rate = width, rate
    return best
