"""Prompt-lookup drafting: copy what followed an earlier occurrence of the current suffix.

Reference: Saxena, "Prompt Lookup Decoding" (2023); vLLM ``NgramProposer``; llama.cpp
``ngram-simple``. Rule used here: the longest suffix n-gram (``max_n`` down to ``min_n``) of
``tokens`` that also ends earlier in ``tokens``; among equally long matches the most recent
occurrence wins (vLLM takes the earliest; the most recent tracks edits better), except that
:class:`PromptLookupDrafter` takes, among the last few occurrences of a ``max_n``-gram, the one
whose match extends furthest back (:meth:`NgramIndex.longest_match`). The proposal is
up to ``k`` tokens that followed that occurrence; no match means no draft. When that
continuation runs into the current suffix (a loop: the match is less than ``k`` tokens back), it
repeats with the loop's period, so ``a a a a`` drafts ``a a a ...`` rather than one ``a``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Draft, DraftContext


def _continue(tokens: Sequence[int], end: int, k: int) -> list[int]:
    """Up to ``k`` tokens after position ``end``, extended periodically past the sequence end."""
    size = len(tokens)
    out = list(tokens[end + 1 : min(size, end + 1 + k)])
    period = size - 1 - end
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


def find_ngram_continuation(
    tokens: Sequence[int], min_n: int, max_n: int, k: int
) -> tuple[list[int], int]:
    """Reference implementation (O(len * max_n)); :class:`NgramIndex` does the same in O(1).

    Returns:
        ``(continuation, n)``: up to ``k`` tokens and the matched n-gram length, or ``([], 0)``.
    """
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n :])
        for end in range(size - 2, n - 2, -1):  # most recent earlier end position first
            if list(tokens[end - n + 1 : end + 1]) == suffix:
                return _continue(tokens, end, k), n
    return [], 0


class NgramIndex:
    """Incremental index from n-gram to the most recent position where it ended, and from each
    ``max_n``-gram to its last ``keep`` end positions (:meth:`longest_match`'s candidates).

    Only n-grams that already have a following token are indexed, so the current suffix never
    matches itself. ``extend`` costs O(max_n - min_n) per token; ``find`` O(max_n - min_n);
    ``extent`` O(cap); ``longest_match`` O(keep * cap) at worst.

    Raises:
        ValueError: unless ``1 <= min_n <= max_n`` and ``keep >= 1``.
    """

    def __init__(self, min_n: int, max_n: int, keep: int = 8):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if keep < 1:
            raise ValueError(f"need keep >= 1, got {keep}")
        self.min_n, self.max_n, self.keep = min_n, max_n, keep
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}  # n-grams shorter than max_n
        # the ends of each max_n-gram, in order (its last end is the list's last); a list is cut
        # back to the last `keep` once it holds 2 * keep (far smaller than a deque per n-gram)
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, new_tokens: Sequence[int]) -> None:
        for token in new_tokens:
            end = len(self.tokens) - 1  # n-grams ending here now have a continuation
            self.tokens.append(token)
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 < 0:
                    break
                key = tuple(self.tokens[end - n + 1 : end + 1])
                if n < self.max_n:
                    self._last_end[key] = end
                else:
                    ends = self._ends.setdefault(key, [])
                    ends.append(end)
                    if len(ends) >= 2 * self.keep:
                        del ends[: -self.keep]

    def find(self) -> tuple[int, int]:
        """``(end, n)``: where the longest indexed suffix n-gram last ended, and its length;
        ``(-1, 0)`` when no suffix n-gram occurred before."""
        size = len(self.tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            key = tuple(self.tokens[size - n :])
            if n == self.max_n:
                ends = self._ends.get(key)
                end = ends[-1] if ends else None
            else:
                end = self._last_end.get(key)
            if end is not None:
                return end, n
        return -1, 0

    def extent(self, end: int, n: int, cap: int) -> int:
        """The match's extent: how many tokens, ending at the last one, agree with those ending
        at ``end``: the matched ``n``, extended backwards up to ``cap`` (``n`` if ``n >= cap``).
        Only a match of ``max_n`` can extend: for a shorter one, the (n+1)-gram occurred
        nowhere before, or :meth:`find` would have returned it."""
        tokens, size = self.tokens, len(self.tokens)
        length = n
        while length < cap and end - length >= 0 and tokens[end - length] == tokens[size - 1 - length]:
            length += 1
        return length

    def longest_match(self, cap: int) -> tuple[int, int]:
        """``(end, extent)`` of the match :meth:`find` returns or, for a ``max_n``-gram, of the
        one among its last ``keep`` occurrences whose :meth:`extent` (up to ``cap``; ``n`` if
        ``n >= cap``) is longest, the most recent among equals; ``(-1, 0)`` without a match.
        Each candidate costs one slice comparison of ``best + 1`` tokens (so O(keep * cap) at
        worst), and only one that beats the best so far is measured further."""
        end, n = self.find()
        if not n:
            return -1, 0
        best = self.extent(end, n, cap)
        if n < self.max_n or best >= cap:
            return end, best
        tokens, size = self.tokens, len(self.tokens)
        suffix = tokens[size - 1 - best : size]  # best + 1 tokens: what an occurrence must match to beat it
        for other in reversed(self._ends[tuple(tokens[size - n :])][-self.keep :]):
            if other < end and other - best >= 0 and tokens[other - best : other + 1] == suffix:
                end, best = other, self.extent(other, best + 1, cap)
                if best >= cap:
                    break
                suffix = tokens[size - 1 - best : size]
        return end, best


class PromptLookupDrafter:
    """Per-request prompt-lookup drafter: holds the config and the n-gram index.

    Args:
        min_n, max_n: n-gram lengths tried, longest first.

    A proposal's ``match_length`` is the match's extent: the n-gram found, extended backwards
    while the tokens before both occurrences agree, up to :attr:`MAX_EXTENT`. The scheduler
    buckets its acceptance evidence by it, so text being copied (a match tens of tokens long)
    and a phrase recurring by chance in novel text (a match of a few tokens) do not share one
    estimate (SuffixDecoding, Oliaro et al. 2024, likewise scales its drafts with the match
    length).
    """

    name = "prompt_lookup"
    MAX_EXTENT = 32
    # occurrences of a max_n-gram compared by extent: in code_edit and copy the most recent one
    # is often a chance repeat near the cursor while an older one is the text being copied
    # (replay, docs/benchmarks.md "Thirty-fifth session": +1.4-5.8% on those, +-2% elsewhere)
    MATCH_CANDIDATES = 8

    def __init__(self, min_n: int = 2, max_n: int = 5):
        self.min_n, self.max_n = min_n, max_n
        self.index = NgramIndex(min_n, max_n, self.MATCH_CANDIDATES)

    def _sync(self, tokens: Sequence[int]) -> None:
        have = len(self.index.tokens)
        if have > len(tokens) or (have and self.index.tokens[-1] != tokens[have - 1]):
            self.reset()  # the history was rewritten (not expected within one request)
            have = 0
        self.index.extend(tokens[have:])

    def propose(self, ctx: DraftContext, max_len: int) -> Draft:
        if max_len <= 0:
            return Draft()
        self._sync(ctx.tokens)
        end, extent = self.index.longest_match(self.MAX_EXTENT)
        if not extent:
            return Draft()
        return Draft(tokens=_continue(self.index.tokens, end, max_len), match_length=extent)

    def on_commit(self, num_accepted: int, ctx: DraftContext) -> None:
        self._sync(ctx.tokens)

    def reset(self) -> None:
        self.index = NgramIndex(self.min_n, self.max_n, self.MATCH_CANDIDATES)
