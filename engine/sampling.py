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


def position_key(seed: int, position: int) -> mx.array:
    """The PRNG key for the token at ``position`` of a request seeded with ``seed``."""
    return mx.random.key(((seed + 1) * _GOLDEN + position * 0xBF58476D1CE4E5B9) & _MASK64)


class LogitsPipeline:
    """A request's logits processing and token choice.

    Args:
        params: the request's sampling parameters.
        seed: the request's PRNG seed (the server draws one when the client gives none).
        prompt_len: number of prompt tokens (penalties split prompt and output history).
    """

    def __init__(self, params: SamplingParams, seed: int, prompt_len: int):
        self.params = params
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
        """Apply logit_bias and penalties to ``[R, V]`` float32 logits.

        Row ``r`` predicts the token after ``committed + draft[:r]`` and sees exactly that
        history, as a one-token decode step at that position would. Returns ``[R, V]``.
        """
        if self._bias is not None:
            ids, values = self._bias
            logits = logits.at[:, ids].add(values)
        if self._repetition is None and self._presence is None and self._frequency is None:
            return logits
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
        logprobs = self.filtered_logprobs(logits)
        vocab = logits.shape[-1]
        noise = mx.stack(
            [
                mx.random.gumbel(shape=(vocab,), key=position_key(self.seed, first_position + r))
                for r in range(logits.shape[0])
            ]
        )
        return mx.argmax(logprobs + noise, axis=-1)


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
