"""One sequence's generation: prefill, then speculative cycles until a finish condition.

Glossary (vLLM's): a verify pass over ``[anchor, d_1..d_L]`` yields ``L + 1`` logits rows; the
*accepted* tokens are the longest prefix of drafts equal to the target's choice per row; the
row after them supplies one more token from the target: the *bonus* token when every draft was
accepted, the *recovered* token otherwise. Committed tokens per cycle = accepted + 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from drafters import Draft, DraftContext

from .constraint import GrammarError
from .detokenizer import StreamingDetokenizer, TokenTable
from .request import FinishReason, GenerationRequest, SpecStats, TokenEvent, TokenLogprob
from .runner import LayerRows, TargetRunner, join_rows
from .sampling import LogitsPipeline, raw_logprobs
from .scheduler import (
    CostModel,
    DsparkStats,
    RequestAcceptance,
    batch_width,
    choose_length,
    expected_tokens,
)
from .stops import StopMatcher

DSPARK_PROBE_EVERY = 32  # cycles before the first re-probe of a DSpark drafter that loses
DSPARK_PROBE_MAX = 512  # the probe interval doubles after every losing probe, up to this
PENDING_HIDDEN_MAX = 16  # committed hidden-state slices held before they are folded into one
MAX_VERIFY_ROWS = 64  # the widest verify pass any setting allows (sizes static caches)
# acceptance estimate of a token the request's grammar forces: llguidance's mask then allows that
# token alone, so it is accepted (10,700 of 10,700 in a review's runs); kept under 1 for safety
GRAMMAR_SURVIVAL = 0.99


@dataclass
class CommitResult:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    verify_step: tuple | None = None  # (drafter, drafted, accepted, expected accepted)


class Sequence:
    """Per-request state. Owns its KV cache, drafter, detokenizer and statistics."""

    def __init__(
        self,
        request: GenerationRequest,
        runner: TargetRunner,
        table: TokenTable,
        eos_token_ids: frozenset[int],
        context_length: int,
        seed: int,
        drafters: dict | None = None,
        constraint=None,
        acceptance: RequestAcceptance | None = None,
        dspark_stats: DsparkStats | None = None,
        taps=None,
        max_draft: int = 0,
        speculative: bool | None = None,
        submitted_at: float | None = None,
    ):
        self.request = request
        self.runner = runner
        self.tokens: list[int] = list(request.prompt_tokens)
        self.prompt_len = len(self.tokens)
        self.cache = runner.make_cache(self.prompt_len + request.max_tokens + MAX_VERIFY_ROWS)  # clamped to the context
        self.num_prefilled = 0
        self.num_generated = 0
        self.cached_tokens = 0  # prompt positions taken from the prefix cache or a twin's prefill
        self.pipeline = LogitsPipeline(request.sampling, seed, self.prompt_len, constraint)
        self.constraint = constraint  # engine.constraint.GrammarConstraint, or None
        self.table = table
        self.detok = StreamingDetokenizer(table)
        self.stop = StopMatcher(request.stop)
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= set(eos_token_ids)
        self.stop_ids = frozenset(stop_ids)
        self.context_length = context_length
        self.drafters = drafters or {}
        # drafts at all: a request's grammar drafts the tokens it forces even when no drafter
        # runs (a dspark request without DSpark, or after dropping it); not under method off
        self.speculative = bool(self.drafters) if speculative is None else speculative
        self.acceptance = acceptance
        self.dspark_stats = dspark_stats  # engine-wide; None for a request that may not run DSpark
        # DSpark reads tapped target hidden states: rows of committed positions not yet given
        # to the drafter wait here (every row is handed over exactly once).
        self.taps = taps if "dspark" in self.drafters else None
        self.pending_hidden: list = []  # [n, taps * d] arrays and LayerRows
        self.pending_folded = 0  # leading entries of pending_hidden that are evaluated chunks
        self.cycles_since_dspark = DSPARK_PROBE_EVERY  # the first cycle probes DSpark
        self.dspark_probe_every = DSPARK_PROBE_EVERY
        self.dspark_forwards = 0  # DSpark forwards this request ran
        self.dspark_cycles = 0  # ... whose drafts were verified (or cut to none), and
        self.dspark_accepted = 0  # ... the drafts accepted in them (DsparkStats.request_accepted)
        self.dspark_bar: tuple[float, float] | None = None  # (rate to beat, seconds) of the DSpark draft in flight
        self.max_draft = max_draft
        self.stats = SpecStats()
        self.finish_reason: FinishReason | None = None
        self.pending_error: Exception | None = None  # a grammar failure after committed tokens: raised by the next propose()
        # (time.perf_counter() values) submit: when the request was queued (default: now), so
        # timings include its wait for a slot; admission: now
        self.admitted_at = time.perf_counter()
        self.submitted_at = self.admitted_at if submitted_at is None else submitted_at
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.prefill_row_seconds: float | None = None  # wall seconds per row of the last prefill step from position > 0
        self.prompt_logprobs: list[TokenLogprob] | None = [] if request.prompt_logprobs else None

    def reuse_prefix(self, cache: list, hidden: mx.array | None, num_tokens: int) -> None:
        """Start from prompt positions computed before: ``cache`` holds the first ``num_tokens``
        (whole prefill chunks from the prefix cache, or every position but the anchor copied from
        a sequence with the same prompt), ``hidden`` their tapped rows when DSpark is on."""
        if not 0 < num_tokens < self.prompt_len or self.num_prefilled:
            raise ValueError("a prefix hit must cover part of the prompt before prefill starts")
        self.cache = cache
        self.num_prefilled = self.cached_tokens = num_tokens
        if self.taps is not None:
            self.pending_hidden, self.pending_folded = [hidden], 0

    def prompt_hidden(self) -> mx.array | None:
        """The tapped rows of every prefilled prompt position (before the first cycle hands them
        to the drafter), merged into one array; None without taps."""
        if self.taps is None or not self.pending_hidden:
            return None
        if len(self.pending_hidden) > 1 or isinstance(self.pending_hidden[0], LayerRows):
            self.pending_hidden, self.pending_folded = [join_rows(self.pending_hidden)], 0
        return self.pending_hidden[0]

    @property
    def prefilled(self) -> bool:
        return self.num_prefilled >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # ---- committing tokens ----------------------------------------------------------------

    def commit(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> CommitResult:
        """Append generated tokens, cutting at EOS, a stop string, the end of the request's
        grammar, max_tokens or the context.

        Raises:
            GrammarError: the grammar refused the first token (an llguidance limit). At a later
                token the tokens before it are returned and the error is kept in
                ``pending_error`` for the next step: plain decoding emits them, then fails.
        """
        ids, parts, stopped = [], [], False
        for token in tokens:
            self.tokens.append(token)
            self.num_generated += 1
            ids.append(token)
            if token in self.stop_ids:
                self.finish_reason = FinishReason.STOP
                break
            text, stopped = self.stop.feed(self.detok.add(token))
            parts.append(text)
            if stopped:
                self.finish_reason = FinishReason.STOP
                break
            if self.constraint is not None:
                try:
                    self.constraint.commit(token)
                except GrammarError as exc:  # the refused token is not output (nor counted)
                    self.tokens.pop()
                    self.num_generated -= 1
                    ids.pop()
                    parts.pop()  # (and any text held back for a stop string: never emitted)
                    if not ids:
                        raise
                    self.pending_error = exc  # plain decoding emits the tokens before it, then fails
                    break
                if self.constraint.done:  # only EOS could follow
                    self.finish_reason = FinishReason.STOP
                    break
            if self.num_generated >= self.request.max_tokens or len(self.tokens) >= self.context_length:
                self.finish_reason = FinishReason.LENGTH
                break
        if self.finished and not stopped:  # release text held back for a possible stop string
            tail = self.detok.flush()
            # (a character the last token left unfinished ends it as U+FFFD: the cut made that,
            # not the model, so no stop string is matched against it)
            cut = "\ufffd" if tail.endswith("\ufffd") else ""
            tail, stopped = self.stop.feed(tail[: len(tail) - len(cut)])
            parts.append(tail if stopped else tail + self.stop.flush() + cut)
            if stopped:
                self.finish_reason = FinishReason.STOP
        if ids:
            self.last_token_at = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = self.last_token_at
        return CommitResult(ids, "".join(parts), logprobs[: len(ids)] if logprobs else None, self.finished)

    def event(self, result: CommitResult, first_event: bool) -> TokenEvent:
        now = time.perf_counter()
        return TokenEvent(
            request_id=self.request.request_id,
            token_ids=result.token_ids,
            text=result.text,
            logprobs=result.logprobs,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_len,
            completion_tokens=self.num_generated,
            cached_tokens=self.cached_tokens,
            prompt_logprobs=self.prompt_logprobs if first_event else None,
            stats=self.stats if self.finished else None,
            time_to_first_token=(
                self.first_token_at - self.submitted_at
                if first_event and self.first_token_at is not None
                else None
            ),
            elapsed=(now - self.submitted_at) if self.finished else None,
            **(self.end_timings() if self.finished else {}),
        )

    def end_timings(self) -> dict:
        """The last event's ``queue_time`` and ``time_per_output_token`` (None where it had
        fewer than two tokens)."""
        tpot = None
        if self.num_generated >= 2 and self.first_token_at is not None and self.last_token_at is not None:
            tpot = (self.last_token_at - self.first_token_at) / (self.num_generated - 1)
        return {"queue_time": self.admitted_at - self.submitted_at, "time_per_output_token": tpot}

    # ---- drafting ---------------------------------------------------------------------------

    def draft_budget(self, max_rows: int) -> int:
        """Most drafts this cycle: never past max_tokens, the context, or the exact verify width."""
        left = self.request.max_tokens - self.num_generated - 1
        room = self.context_length - len(self.tokens) - 1
        cap = self.max_draft if self.request.speculative.max_draft_tokens is None else min(
            self.max_draft, self.request.speculative.max_draft_tokens
        )
        return max(0, min(left, room, max_rows - 1, cap))

    def propose(self, cost: CostModel, max_rows: int | None = None) -> Draft:
        """Choose this cycle's drafter and draft length (issue #6's rule, engine/scheduler.py).

        Prompt lookup proposes for free, and so does a request's grammar (the tokens it forces
        next, drafter ``grammar``); DSpark costs a draft forward, so it runs only when its recent
        yield (tokens per second, the cost of this forward included: a catch-up over the rows
        committed since its last forward costs more, ``DsparkStats.forward_cost``) beats the best
        option so far (plain decoding included, also when DSpark is the only drafter), or as a
        probe on a request's first cycle and then after ``DSPARK_PROBE_EVERY`` cycles (only when a
        block accepted whole would beat that option: ``DsparkStats.best_case_rate``), an interval
        that doubles after every probe while DSpark loses (up to ``DSPARK_PROBE_MAX``) and resets
        once it wins, as long as the engine's probes fit their budget (at most 2% of its decode
        time, shrinking to 0.25% while probes keep losing: ``DsparkStats.may_probe``); it always
        runs when the request sets ``min_draft_tokens``. A request carrying DSpark drops it (taps,
        queued rows) for good on the first cycle where DSpark could not win with this cycle's room
        to draft, or has recently yielded less than plain decoding (its pending forward priced as
        in the choice) while the engine's probe budget is spent (``DsparkStats.worth_tapping``),
        unless it sets ``min_draft_tokens``. (No room to draft includes a full batched pass, whose
        share leaves one row per sequence.) A DSpark forward whose draft is cut to nothing counts
        as a cycle that yielded nothing, and any DSpark forward whose proposal is not verified
        counts in the request's stats (``num_unused_proposals``). Each proposal is cut to the
        length maximising ``E(L) / T(L + 1)`` under its acceptance estimate; the best rate wins,
        plain decoding when none beats it. ``max_rows`` caps the verify rows (a sequence's share of
        a batched pass).
        """
        if self.pending_error is not None:  # the last cycle committed the tokens before it
            raise self.pending_error
        budget = self.draft_budget(min(cost.max_rows, max_rows or cost.max_rows))
        dspark = self.drafters.get("dspark")
        if (dspark is not None and self.request.speculative.min_draft_tokens == 0
                and not self.dspark_stats.worth_tapping(cost, min(budget, dspark.config.block_size),
                                                        len(self.tokens), self._dspark_rows(),
                                                        self._dspark_accepted())):
            self._drop_dspark()  # not chosen, and no probe before the budget refills: no more taps
        if budget == 0 or not self.speculative:
            return Draft()
        draft, dspark_ran = self._choose(budget, cost)
        if dspark_ran and not (draft.tokens and draft.drafter == "dspark"):
            self.stats.unused_proposal("dspark")
        return draft

    def _choose(self, budget: int, cost: CostModel) -> tuple[Draft, bool]:
        """The draft to verify, and whether a DSpark forward ran for it."""
        ctx = DraftContext(self.tokens, temperature=self.request.sampling.temperature,
                           seed=self.pipeline.seed)
        options = []  # (rate, length, proposal, conditional)
        forced = self.request.speculative.min_draft_tokens > 0
        if self.constraint is not None:  # tokens the request's grammar forces next, for free
            tokens = self.constraint.forced_tokens(budget)
            if tokens:
                conditional = [GRAMMAR_SURVIVAL] * len(tokens)
                length, rate = choose_length(conditional, cost, context=len(self.tokens))
                options.append((rate, length, Draft(tokens=tokens, drafter="grammar"), conditional))
        lookup = self.drafters.get("prompt_lookup")
        if lookup is not None:
            proposal = self._grammar_cut(lookup.propose(ctx, budget))
            proposal.drafter = "prompt_lookup"
            if proposal.tokens:
                conditional = self.acceptance.survival(proposal.match_length, len(proposal.tokens))
                length, rate = choose_length(conditional, cost, context=len(self.tokens))
                options.append((rate, length, proposal, conditional))
        dspark_ran, rows = False, 0
        dspark = self.drafters.get("dspark")
        if dspark is not None:
            best_so_far = max([1.0 / cost.T(1, len(self.tokens))] + [o[0] for o in options])
            rows = self._dspark_rows()  # (after other cycles, a catch-up: priced as one)
            wins = forced or self.dspark_stats.expected_rate(cost, len(self.tokens), rows,
                                                             self._dspark_accepted()) > best_so_far
            # a probe that could not win even with every draft accepted is not run
            probe = (not wins and self.cycles_since_dspark >= self.dspark_probe_every
                     and self.dspark_stats.best_case_rate(cost, min(budget, dspark.config.block_size),
                                                          len(self.tokens)) > best_so_far
                     and self.dspark_stats.may_probe())
            if wins or probe:
                # a probe runs only while DSpark loses: back off (ds4 backed off after misses
                # too), within the engine-wide probe budget
                self.dspark_probe_every = (DSPARK_PROBE_EVERY if wins else
                                           min(2 * self.dspark_probe_every, DSPARK_PROBE_MAX))
                started = time.perf_counter()
                option = self._propose_dspark(ctx, budget, cost)
                if probe:  # (a forward that compiled a graph is charged at the usual cost of a
                    # probe, a catch-up forward)
                    traced = getattr(self.drafters["dspark"], "traced", False)
                    ds = self.dspark_stats
                    ds.observe_probe((ds.catch_up_cost or ds.draft_cost) if traced
                                     else time.perf_counter() - started)
                dspark_ran = True
                if option[1] == 0 and not forced:  # paid for, drafted nothing
                    self.dspark_stats.observe([], 0, 0, first=self.dspark_forwards == 1)
                    self.dspark_cycles += 1
                else:
                    options.append(option)
        if not options:
            return Draft(), dspark_ran
        rate, length, proposal, conditional = max(options, key=lambda o: o[0])
        if length == 0 and forced:
            rate, length, proposal, conditional = options[0]
        length = max(length, min(self.request.speculative.min_draft_tokens, len(proposal.tokens)))
        if length == 0:
            return Draft(), dspark_ran
        proposal.survival = conditional
        cut(proposal, length)
        if proposal.drafter == "dspark" and not forced:
            # what its verify pass must yield to beat the other options (observe() judges it)
            self.dspark_bar = (best_so_far, cost.T(length + 1, len(self.tokens)) + self.dspark_stats.forward_cost(rows))
        return proposal, dspark_ran

    def _dspark_accepted(self) -> float | None:
        """This request's estimate of accepted drafts per DSpark cycle (None: the engine-wide
        one; ``DsparkStats.request_accepted``)."""
        return self.dspark_stats.request_accepted(self.dspark_accepted, self.dspark_cycles)

    def _dspark_rows(self) -> int:
        """New context rows to price the next DSpark forward at (``DsparkStats.forward_cost``):
        the rows committed since this request's last DSpark forward. A request's first forward,
        over its prompt, is priced as a steady one (though never timed as one:
        ``DsparkStats.observe_cost``): every use of DSpark in the request pays it, so
        it prices the request's DSpark, not this cycle's (charged as a catch-up, a request would
        drop DSpark on its first cycle whenever the probe budget is spent, before it could
        win)."""
        # (counted, not read off projected_length == 0: a 1-token prompt's first forward leaves
        # that at 0)
        if self.dspark_forwards == 0:
            return 0
        return len(self.tokens) - 1 - self.drafters["dspark"].projected_length

    def _drop_dspark(self) -> None:
        """Run the rest of the request without DSpark: no drafter, no taps, no pending rows
        (after prefill the taps feed only the drafter; the prompt's rows are already stored)."""
        del self.drafters["dspark"]
        self.taps = None
        self.pending_hidden, self.pending_folded = [], 0

    def _propose_dspark(self, ctx: DraftContext, budget: int, cost: CostModel):
        self.cycles_since_dspark = 0
        if self.pending_hidden:
            ctx.hidden = join_rows(self.pending_hidden)
            self.pending_hidden, self.pending_folded = [], 0
        started = time.perf_counter()
        drafter = self.drafters["dspark"]
        new_rows = len(self.tokens) - 1 - drafter.projected_length  # (projected by this forward)
        first = self.dspark_forwards == 0
        priced_rows = 0 if first else new_rows  # (_dspark_rows: the prompt's forward priced as a steady one)
        proposal = self._grammar_cut(drafter.propose(ctx, budget))
        self.dspark_forwards += 1
        if "prompt_lookup" in self.drafters and self.request.speculative.min_draft_tokens == 0:
            self.dspark_stats.observe_forward(priced_rows)  # (auto, unforced: runs between other cycles)
        if not getattr(drafter, "traced", False):  # a forward that compiled a graph is not typical
            self.dspark_stats.observe_cost(time.perf_counter() - started, rows=new_rows, first=first)
        proposal.drafter = "dspark"
        raw = proposal.confidence or [0.5] * len(proposal.tokens)
        conditional = self.dspark_stats.calibrated(raw)
        length, rate = choose_length(conditional, cost, context=len(self.tokens))
        return rate, length, proposal, conditional

    def _grammar_cut(self, proposal: Draft) -> Draft:
        """A proposal without the tokens after the first one the request's grammar forbids
        (never reached: that token's row gives it probability 0, so it is rejected).

        A one-hot proposal (prompt lookup, greedy DSpark) loses that token too: its row then
        gives the bonus token, the same token its rejection would have recovered (the target's
        choice does not depend on the draft). A proposal with ``draft_probs`` keeps it: there
        the recovered token is drawn from norm(max(0, p - q)), not from p, so ending the draft
        before it would change the output distribution."""
        if self.constraint is not None and proposal.tokens:
            n = self.constraint.valid_prefix(proposal.tokens)
            if n < len(proposal.tokens):
                keep = n if proposal.draft_probs is None else n + 1
                cut(proposal, keep)
                if proposal.confidence:
                    proposal.confidence = proposal.confidence[:keep]
        return proposal

    def observe(self, draft: Draft, num_accepted: int, hidden: mx.array | LayerRows | None) -> str | None:
        """Record a verify step and hand committed hidden rows on; returns the drafter's name."""
        if hidden is not None:
            self.pending_hidden.append(hidden[: num_accepted + 1])
            if len(self.pending_hidden) - self.pending_folded >= PENDING_HIDDEN_MAX:
                # Each new entry is a slice of its pass's tapped rows (a fused pass's
                # LayerRows, or rows evaluated with the verdict): fold the new ones into one
                # chunk, so a sequence that rarely runs DSpark holds one array per 16 cycles and
                # only the committed rows (earlier chunks stay as they are: no copy grows with
                # the wait). It used to slice the lazy taps of each pass, and the fold's
                # synchronous evaluation of 16 of them cost auto ~0.1 ms per cycle on the H200
                # (5% of a step).
                chunk = join_rows(self.pending_hidden[self.pending_folded:])
                mx.async_eval(chunk)  # (no host sync: the next pass queues behind it)
                self.pending_hidden[self.pending_folded:] = [chunk]
                self.pending_folded += 1
        name = draft.drafter if draft.tokens else None
        self.stats.observe(name, len(draft.tokens), num_accepted)
        if "dspark" in self.drafters and name != "dspark":
            self.cycles_since_dspark += 1
        if name == "prompt_lookup":
            self.acceptance.observe(draft.match_length, len(draft.tokens), num_accepted)
        elif name == "dspark":
            raw = draft.confidence[: len(draft.tokens)] if draft.confidence else [0.5] * len(draft.tokens)
            # (a verified DSpark draft is the last forward's: the request's first when it ran one)
            self.dspark_stats.observe(raw, len(draft.tokens), num_accepted, first=self.dspark_forwards == 1)
            self.dspark_cycles += 1
            self.dspark_accepted += num_accepted
            if self.dspark_bar is not None:
                rate_to_beat, seconds = self.dspark_bar
                if (1 + num_accepted) / seconds > rate_to_beat:  # this cycle DSpark paid its way
                    self.dspark_stats.observe_win()
        self.dspark_bar = None
        return name


def _logprob_rows(chosen_lp, top_ids, top_lp, tokens: list[int]) -> list[TokenLogprob]:
    chosen_lp, top_ids, top_lp = chosen_lp.tolist(), top_ids.tolist(), top_lp.tolist()
    return [
        TokenLogprob(t, chosen_lp[i], list(zip(top_ids[i], top_lp[i]))) for i, t in enumerate(tokens)
    ]


def prefill_step(seq: Sequence, max_rows: int | None = None) -> CommitResult | None:
    """Feed the next prompt chunk (or a slice of it) into the KV cache.

    Chunks are ``[j*S, (j+1)*S)`` for ``S = runner.prefill_step`` (absolute positions), the last
    one ending before the anchor: the prefix cache reuses whole chunks, so a warm start computes
    exactly the chunks a cold one would. ``max_rows`` (a multiple of
    ``runner.prefill_slice_rows``; only for runners that have one) feeds at most that many
    tokens of the current chunk, so other sequences can step sooner; the cache, logits and taps
    hold the same bits either way. Sets ``seq.prefill_row_seconds`` (wall time per row) when the
    step did not start at position 0.

    Raises:
        ValueError: ``max_rows`` on a runner whose chunks must run whole, or not a positive
            multiple of its slice.

    The last prompt token is not prefilled: it is the first anchor, and the first output token
    comes from the first verify pass, computed exactly as a one-token decode step would (as
    mlx-lm's ``generate_step`` does), so prompt-lookup drafts can start on the first cycle.
    Returns a finished result only for ``max_tokens == 0`` (prompt scoring), else None.
    """
    runner, start = seq.runner, seq.num_prefilled
    end = min((start // runner.prefill_step + 1) * runner.prefill_step, seq.prompt_len - 1)
    if max_rows is not None:
        slice_rows = runner.prefill_slice_rows
        if slice_rows is None or max_rows <= 0 or max_rows % slice_rows:
            raise ValueError(f"prefill slices of {max_rows} rows on a runner with slices of {slice_rows}")
        end = min(end, start + max_rows)
    if seq.prompt_logprobs is not None and start == 0:
        seq.prompt_logprobs.append(TokenLogprob(seq.tokens[0], None))
    if end > start:
        started = time.perf_counter()
        logits, hidden = runner.prefill(seq.tokens[start:end], seq.cache, seq.taps,
                                        logits=seq.prompt_logprobs is not None)
        if hidden is not None:
            seq.pending_hidden.append(hidden)
        if seq.prompt_logprobs is not None:
            targets = seq.tokens[start + 1 : end + 1]
            lp = raw_logprobs(logits.astype(mx.float32), mx.array(targets), seq.request.logprobs or 0)
            mx.eval(*lp)
            seq.prompt_logprobs += _logprob_rows(*lp, targets)
        else:  # only the KV (and taps) are needed: the LM head rows stay unevaluated
            mx.eval(runner.cache_arrays(seq.cache), *(() if hidden is None else (hidden,)))
        if start > 0:  # (position 0 runs through mlx-lm's modules: several times a pass row)
            seq.prefill_row_seconds = (time.perf_counter() - started) / (end - start)
    seq.num_prefilled = end if end < seq.prompt_len - 1 else seq.prompt_len
    if seq.prefilled and seq.request.max_tokens == 0:  # echo + logprobs scoring: prompt only
        seq.finish_reason = FinishReason.LENGTH
        return CommitResult([], "", None, True)
    return None


def speculative_step(seq: Sequence, cost: CostModel) -> CommitResult:
    """One cycle: draft -> verify -> accept -> rollback -> commit (DESIGN.md section 3)."""
    # 1. Draft: a proposal cut to the length that maximises expected tokens per second.
    draft = seq.propose(cost)
    rows = [seq.tokens[-1], *draft.tokens]  # the anchor, then the drafts

    # 2. Verify: one target pass; row r decides the token after anchor + draft[:r].
    started = time.perf_counter()
    logits, hidden = seq.runner.verify(rows, seq.cache, seq.taps, layer_rows=True)
    verdict = _verdict(seq, draft, logits)
    # the cycle's only host sync; tapped hidden rows (DSpark's context) are computed in it,
    # unless they are a fused pass's LayerRows (already computed: laid out at the next fold)
    mx.eval(*verdict, *(() if hidden is None or isinstance(hidden, LayerRows) else (hidden,)))
    elapsed = time.perf_counter() - started
    if seq.num_generated:  # a request's first pass runs cold after its prefill: not a width's cost
        cost.observe(len(rows), elapsed, context=len(seq.tokens))
    if seq.dspark_stats is not None:  # a request that may run DSpark, carrying it or not
        seq.dspark_stats.observe_cycle(elapsed)  # (earns DSpark's probe budget)

    # 3-5. Accept, roll back, commit.
    return _accept(seq, draft, verdict, hidden)


def speculative_batch_step(seqs: list[Sequence], cost: CostModel,
                           max_rows: int) -> list[CommitResult | Exception]:
    """One cycle for several sequences at once (continuous batching).

    Each sequence drafts within its share of ``max_rows`` (the calibrated exact batch size); the
    batch's width is the one maximising expected tokens per second over all of them
    (:func:`scheduler.batch_width`: drafts shrink as the batch grows); one batched target pass
    verifies every ``[anchor | drafts]``; each sequence then accepts, rolls back and commits on
    its own, as :func:`speculative_step` does.

    Returns:
        per sequence, its :class:`CommitResult`, or the exception its own drafting or commit
        raised (the other sequences are unaffected).

    Raises:
        whatever the batched pass raises (nothing has been committed then).
    """
    share = max(1, max_rows // len(seqs))
    out: list = [None] * len(seqs)
    drafts: dict[int, Draft] = {}
    for i, seq in enumerate(seqs):
        try:
            drafts[i] = seq.propose(cost, max_rows=share)
        except Exception as exc:  # this sequence sits the pass out
            out[i] = exc
    if drafts:
        width = batch_width([d.survival or [] for d in drafts.values()], cost,
                            max(len(d.tokens) for d in drafts.values()) + 1,
                            context=sum(len(seqs[i].tokens) for i in drafts) // len(drafts))
        for i, draft in drafts.items():
            if len(draft.tokens) >= width:
                if draft.drafter == "dspark" and width == 1:
                    seqs[i].stats.unused_proposal("dspark")
                cut(draft, width - 1)
        live = list(drafts)
        rows = [[seqs[i].tokens[-1], *drafts[i].tokens] for i in live]
        taps = next((seqs[i].taps for i in live if seqs[i].taps is not None), None)
        started = time.perf_counter()
        outs = seqs[live[0]].runner.verify_batch(rows, [seqs[i].cache for i in live], taps)
        verdicts = {}
        for i, (logits, _) in zip(live, outs):
            try:
                verdicts[i] = _verdict(seqs[i], drafts[i], logits)
            except Exception as exc:  # (a grammar that fails its request's masks) this sequence alone
                out[i] = exc
        mx.eval(*(a for v in verdicts.values() for a in v),  # the cycle's only host sync (and the taps, as above)
                *(hidden for i, (_, hidden) in zip(live, outs)
                  if i in verdicts and hidden is not None and seqs[i].taps is not None))
        stats = next((seqs[i].dspark_stats for i in live if seqs[i].dspark_stats is not None), None)
        if stats is not None:  # one pass, credited once (as above: DSpark carried or not)
            stats.observe_cycle(time.perf_counter() - started)
        for i, (_, hidden) in zip(live, outs):
            if i not in verdicts:
                continue
            verdict = verdicts[i]
            try:
                out[i] = _accept(seqs[i], drafts[i], verdict, hidden if seqs[i].taps is not None else None)
            except Exception as exc:
                out[i] = exc
    return out


def cut(draft: Draft, length: int) -> None:
    """Keep the first ``length`` drafts (and their draft_probs and survival estimates)."""
    draft.tokens = draft.tokens[:length]
    if draft.draft_probs is not None:
        draft.draft_probs = draft.draft_probs[:length]
    survival = (draft.survival or [])[:length]
    draft.survival = survival
    draft.expected_accepted = expected_tokens(survival)[-1] - 1.0 if survival else 0.0


def _verdict(seq: Sequence, draft: Draft, logits: mx.array) -> tuple:
    """Lazy ``(row_tokens, passed, *logprob arrays)`` of a verify pass's rows."""
    if seq.constraint is not None:  # the pass runs while the host computes the grammar's masks
        mx.async_eval(logits)
    processed = seq.pipeline.process(logits, seq.tokens, draft.tokens)
    row_tokens, passed = seq.pipeline.verify(processed, draft.tokens, draft.draft_probs, len(seq.tokens))
    lp = raw_logprobs(logits, row_tokens, seq.request.logprobs) if seq.request.logprobs is not None else ()
    return (row_tokens, passed, *lp)


def _accept(seq: Sequence, draft: Draft, verdict: tuple, hidden: mx.array | LayerRows | None) -> CommitResult:
    row_tokens, passed, *lp = verdict
    # 3. Accept the drafts up to the first rejection, plus the bonus/recovered token.
    num_accepted = next((i for i, ok in enumerate(passed.tolist()) if not ok), len(draft.tokens))
    row_tokens = row_tokens.tolist()
    committed = draft.tokens[:num_accepted] + [row_tokens[num_accepted]]
    constraint, failure = seq.constraint, None
    if constraint is not None and constraint.failed_row is not None and num_accepted >= constraint.failed_row:
        # A row whose grammar step failed was reached: plain decoding emits the drafts before
        # that row (no bonus token), then fails there (the next propose() raises).
        committed = draft.tokens[: constraint.failed_row]
        failure = GrammarError(constraint.failure)

    # 4. Commit (cut at EOS, a stop string, the grammar's end or refusal, max_tokens).
    logprobs = _logprob_rows(*lp, row_tokens)[: len(committed)] if lp else None
    result = seq.commit(committed, logprobs)
    if failure is not None and seq.pending_error is None:
        seq.pending_error = failure
    kept = len(result.token_ids) if seq.pending_error is not None else len(committed)

    # 5. Roll back the KV cache to the anchor and the kept drafts (the last token kept is the
    # next anchor), then statistics: the target's verdict, whatever the grammar cut.
    seq.runner.trim(seq.cache, len(draft.tokens) + 1 - kept)
    drafter = seq.observe(draft, num_accepted, hidden if seq.pending_error is None else None)
    result.verify_step = (drafter, len(draft.tokens), num_accepted, draft.expected_accepted)
    return result
