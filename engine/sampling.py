"""Turn target logits rows into tokens, the same way for one row or many.

Every function here works row by row on ``[R, V]`` logits, and each row's result depends only on
that row and on its own token history, so a verify pass of ``R`` rows chooses exactly the tokens
that ``R`` one-row decode steps would have chosen.

Sampling uses the Gumbel-max trick with a key derived from ``(seed, absolute position)``:
``token_n = argmax(log p_n + g_n)``. The token at position ``n`` is therefore a fixed function of
``p_n`` and the seed, whether or not a draft proposed it. For a draft token ``x`` with one-hot
draft distribution (prompt lookup), "accept iff ``token_n == x``" accepts with probability
``p_n(x)`` and, on rejection, yields a token distributed as ``p_n`` with ``x`` removed and
renormalised: exactly the rejection rule of Leviathan et al. 2023 / Chen et al. 2023 for a
one-hot ``q``, and the same coupling mlx-lm's speculative generator uses. A fixed seed gives a
fixed output whatever the drafter proposes.

Logits processors come from mlx-lm (``make_logits_processors``); the top-k/top-p/min-p filters
are mlx-lm's ``apply_top_k``/``apply_top_p``/``apply_min_p``.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

from .request import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def position_key(seed: int, position: int, stream: int = 0) -> mx.array:
    """The PRNG key for the token at ``position`` of a request seeded with ``seed``.

    ``stream`` separates independent uses at one position (0: the token's Gumbel noise,
    1: the uniform of the rejection test).
    """
    mixed = (seed + 1) * _GOLDEN + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB
    return mx.random.key(mixed & _MASK64)


class LogitsPipeline:
    """A request's logits processing and token choice.

    Args:
        params: the request's sampling parameters.
        seed: the request's PRNG seed (the server draws one when the client gives none).
        prompt_len: number of prompt tokens (penalties split prompt and output history).
    """

    def __init__(self, params: SamplingParams, seed: int, prompt_len: int, constraint=None):
        self.params = params
        self.constraint = constraint  # an engine.constraint.GrammarConstraint, or None
        self.seed = seed
        self.prompt_len = prompt_len
        self._bias = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self._bias = (mx.array(ids), mx.array(values, dtype=mx.float32))
        self._repetition = (
            make_repetition_penalty(params.repetition_penalty, params.repetition_context_size)
            if params.repetition_penalty != 1.0
            else None
        )
        big = 1 << 30  # presence/frequency see every generated token (OpenAI's rule)
        self._presence = (
            make_presence_penalty(params.presence_penalty, big) if params.presence_penalty else None
        )
        self._frequency = (
            make_frequency_penalty(params.frequency_penalty, big) if params.frequency_penalty else None
        )

    def process(
        self, logits: mx.array, committed: Sequence[int], draft: Sequence[int] = ()
    ) -> mx.array:
        """Apply logit_bias, penalties and the grammar's mask to ``[R, V]`` float32 logits.

        Row ``r`` predicts the token after ``committed + draft[:r]`` and sees exactly that
        history, as a one-token decode step at that position would. Returns ``[R, V]``.
        """
        if self._bias is not None:
            ids, values = self._bias
            logits = logits.at[:, ids].add(values)
        if self._repetition is not None or self._presence is not None or self._frequency is not None:
            logits = self._penalize(logits, committed, draft)
        if self.constraint is not None:  # (last: nothing may lift a forbidden token again)
            logits = self.constraint.apply(logits, draft)
        return logits

    def _penalize(self, logits: mx.array, committed: Sequence[int], draft: Sequence[int]) -> mx.array:
        history = list(committed) + list(draft)
        first = len(committed)
        rows = []
        for r in range(logits.shape[0]):
            row = logits[r : r + 1]
            end = first + r
            if self._repetition is not None:
                window = history[max(0, end - self.params.repetition_context_size) : end]
                row = self._repetition(mx.array(window), row)
            generated = history[self.prompt_len : end]
            if generated:
                gen = mx.array(generated)
                if self._presence is not None:
                    row = self._presence(gen, row)
                if self._frequency is not None:
                    row = self._frequency(gen, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def filtered_logprobs(self, logits: mx.array) -> mx.array:
        """Temperature, then top-k/top-p/min-p: the log of the distribution tokens are drawn from
        (unnormalised after filtering; only its argmax with Gumbel noise and its softmax are used)."""
        p = self.params
        logprobs = logits * (1.0 / p.temperature)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if 0 < p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        return logprobs

    def target_probs(self, logits: mx.array) -> mx.array:
        """The processed target distribution ``p`` per row, ``[R, V]`` float32 (sampled requests)."""
        return mx.softmax(self.filtered_logprobs(logits), axis=-1)

    def choose(self, logits: mx.array, first_position: int) -> mx.array:
        """The target's token for every row: argmax (greedy) or Gumbel-max with per-position keys.

        Args:
            logits: processed logits ``[R, V]``.
            first_position: absolute position of row 0's token.
        Returns:
            ``[R]`` uint32 token ids (lazy).
        """
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        return mx.argmax(self.filtered_logprobs(logits) + self._gumbel(logits, first_position), axis=-1)

    def _gumbel(self, logits: mx.array, first_position: int) -> mx.array:
        vocab = logits.shape[-1]
        return mx.stack(
            [
                mx.random.gumbel(shape=(vocab,), key=position_key(self.seed, first_position + r))
                for r in range(logits.shape[0])
            ]
        )

    def verify(
        self, logits: mx.array, draft: Sequence[int], draft_probs: mx.array | None, first_position: int
    ) -> tuple[mx.array, mx.array]:
        """Decide a verify pass: the token each row commits if reached, and which drafts pass.

        Args:
            logits: processed target logits ``[L + 1, V]``; row ``r`` follows ``draft[:r]``.
            draft: the ``L`` draft tokens.
            draft_probs: ``[L, V]`` float32 draft distributions q the drafts were sampled from,
                or None for a deterministic drafter (one-hot q).
            first_position: absolute position of row 0's token.
        Returns:
            ``(row_tokens [L + 1], accepted [L] bool)``, lazy. The accepted length ``n`` is the
            first False in ``accepted`` (or ``L``); the committed tokens are
            ``draft[:n] + [row_tokens[n]]`` and ``row_tokens[r] == draft[r]`` for ``r < n``.

        Greedy requests and one-hot drafts: a draft passes iff it equals the target's choice
        (argmax or Gumbel-max), i.e. accept with probability p(x) and recover from p without x.
        Otherwise the rejection rule of Leviathan et al. (2023) / Chen et al. (2023): draft x_r
        passes with probability min(1, p_r(x_r) / q_r(x_r)); the recovered token at the first
        rejection is drawn from norm(max(0, p_r - q_r)); after a full accept the bonus token is
        drawn from p_L. p is the processed target distribution (temperature, filters, penalties).
        """
        n = len(draft)
        drafted = mx.array(list(draft), dtype=mx.uint32)
        if draft_probs is None or self.params.greedy:
            targets = self.choose(logits, first_position)
            return targets, targets[:n] == drafted
        p = self.target_probs(logits)  # [L + 1, V]
        rows = mx.arange(n)
        p_x = p[rows, drafted]
        q_x = draft_probs[rows, drafted]
        uniform = mx.stack(
            [mx.random.uniform(key=position_key(self.seed, first_position + r, 1)) for r in range(n)]
        ) if n else mx.zeros((0,))
        accepted = uniform * q_x < p_x
        residual = mx.maximum(p[:n] - draft_probs, 0.0)
        residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p[:n])
        candidates = mx.concatenate([mx.log(residual), mx.log(p[n:])], axis=0)
        row_tokens = mx.argmax(candidates + self._gumbel(logits, first_position), axis=-1)
        row_tokens = mx.concatenate([mx.where(accepted, drafted, row_tokens[:n]), row_tokens[n:]])
        return row_tokens, accepted


def raw_logprobs(logits: mx.array, chosen: mx.array, top: int) -> tuple[mx.array, mx.array, mx.array]:
    """Log-probabilities of ``chosen`` tokens and the ``top`` most likely tokens per row.

    Args:
        logits: raw model logits ``[R, V]``.
        chosen: ``[R]`` token ids.
        top: number of alternatives (0 allowed).
    Returns:
        ``(chosen_logprob [R], top_ids [R, top], top_logprobs [R, top])``, lazy, sorted by
        descending logprob.
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen_lp = mx.take_along_axis(logprobs, chosen[:, None].astype(mx.int32), axis=-1)[:, 0]
    if top <= 0:
        empty = mx.zeros((logits.shape[0], 0))
        return chosen_lp, empty.astype(mx.int32), empty
    top_ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
    top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    return (
        chosen_lp,
        mx.take_along_axis(top_ids, order, axis=-1),
        mx.take_along_axis(top_lp, order, axis=-1),
    )
