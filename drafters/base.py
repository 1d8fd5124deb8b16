"""The drafter interface (DESIGN.md section 4)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class DraftContext:
    """What a drafter may read.

    Attributes:
        tokens: prompt + committed output; the last one is the anchor (sampled, not yet in the
            target's KV cache).
        hidden: tapped target hidden states of committed positions not yet seen by the drafter
            (DSpark only), ``[n, num_taps * hidden_size]``; None for other drafters.
        temperature: the request's sampling temperature; 0 = greedy (drafters that sample draw
            their drafts from their own distribution at this temperature).
        seed: the request's PRNG seed; a sampling drafter derives its keys from
            ``(seed, position)`` so a fixed seed gives fixed drafts.
    """

    tokens: Sequence[int]
    hidden: Any = None
    temperature: float = 0.0
    seed: int = 0


@dataclass
class Draft:
    """A proposal: ``tokens`` to verify after the anchor.

    Attributes:
        tokens: proposed token ids, possibly empty (no draft: decode plainly).
        draft_probs: ``[L, V]`` draft distributions q for sampled verification, or None for a
            deterministic (one-hot) drafter such as prompt lookup.
        confidence: per-token conditional survival estimates ``c_k`` (probability that draft k is
            accepted given drafts 1..k-1 were), or None when the drafter has none.
        match_length: for prompt lookup, the match's extent in tokens: the n-gram found,
            extended backwards while the tokens before both occurrences agree, up to
            ``PromptLookupDrafter.MAX_EXTENT`` (32); 0 otherwise.
        drafter: the proposing drafter's name (set by the engine's scheduler).
        expected_accepted: the scheduler's estimate of accepted drafts, ``sum_k a_k`` over the
            tokens kept (for calibration metrics).
        survival: the scheduler's conditional acceptance estimates ``c_1..c_L`` for the tokens
            kept (set by the engine; None before).
    """

    tokens: list[int] = field(default_factory=list)
    draft_probs: Any = None
    confidence: list[float] | None = None
    match_length: int = 0
    drafter: str | None = None
    expected_accepted: float = 0.0
    survival: list[float] | None = None


class Drafter(Protocol):
    name: str

    def propose(self, ctx: DraftContext, max_len: int) -> Draft: ...

    def on_commit(self, num_accepted: int, ctx: DraftContext) -> None: ...

    def reset(self) -> None: ...
