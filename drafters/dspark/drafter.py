"""The per-request DSpark drafter (DESIGN.md section 4; inference cycle of dspark.md section 5).

Contract with the engine:

* One :class:`DSparkDrafter` per request, sharing one :class:`DSparkModel` (weights loaded once)
  and the target's ``embed``/``lm_head`` callables.
* ``ctx.tokens`` is prompt + committed output; ``ctx.tokens[-1]`` is the anchor (sampled, not yet
  in the target's KV cache) at position ``len(ctx.tokens) - 1``.
* ``ctx.hidden`` carries the tapped target states ``[n, m*d]`` (the outputs of the decoder layers
  in ``config.target_layer_ids``, concatenated in that order; ``-1`` = embedding output) of
  committed positions the drafter has not been given yet, in order: after prefill, positions
  ``0..P-2``; after a verify pass, the rows of the anchor and the accepted drafts. Each row is
  given exactly once, with ``on_commit`` or with the next ``propose``; before a ``propose`` the
  drafter must hold rows for exactly the positions ``0..anchor_pos-1`` (else ``ValueError``).
* The draft cache keeps only the context's keys/values; the block's own are never stored, so
  no rollback is needed when drafts are rejected.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..base import Draft, DraftContext
from .model import DSparkModel, Embed, LMHead, block_inputs, sample_block


class DSparkDrafter:
    """Block drafter conditioned on the target's hidden states.

    Args:
        network: the shared draft network.
        embed: target embedding, token ids ``[...]`` -> ``[..., d]``.
        lm_head: target LM head, ``[..., d]`` -> logits ``[..., V]``.
    """

    name = "dspark"

    def __init__(self, network: DSparkModel, embed: Embed, lm_head: LMHead):
        self.network = network
        self.config = network.config
        self.embed = embed
        self.lm_head = lm_head
        self.reset()

    @property
    def context_length(self) -> int:
        """Positions whose context rows the drafter holds (cached + pending)."""
        return self._caches[0].offset + sum(int(h.shape[0]) for h in self._pending)

    def reset(self) -> None:
        self._caches = [KVCache() for _ in self.network.layers]
        self._pending: list[mx.array] = []

    def _absorb(self, hidden) -> None:
        if hidden is None:
            return
        rows = hidden if isinstance(hidden, mx.array) else mx.array(hidden)
        rows = rows.reshape(-1, rows.shape[-1])
        want = self.config.num_taps * self.config.hidden_size
        if rows.shape[-1] != want:
            raise ValueError(f"DSpark hidden rows must have {want} features "
                             f"({self.config.num_taps} taps x {self.config.hidden_size}), got {rows.shape[-1]}")
        if rows.shape[0]:
            self._pending.append(rows)

    def _context(self) -> list[tuple[mx.array, mx.array]] | None:
        """Project pending rows, append their K/V to the draft cache, return every layer's K/V."""
        if self._pending:
            rows = mx.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending = []
            offset = self._caches[0].offset
            kv = self.network.context_kv(self.network.project_context(rows[None]), offset)
            return [c.update_and_fetch(k, v) for c, (k, v) in zip(self._caches, kv)]
        if self._caches[0].offset == 0:
            return None
        return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in self._caches]

    def propose(self, ctx: DraftContext, max_len: int) -> Draft:
        """Draft up to ``min(max_len, block_size)`` tokens after the anchor ``ctx.tokens[-1]``.

        Greedy (``ctx.temperature == 0``): ``draft_probs`` is None. Sampled: ``draft_probs`` is
        ``[L, V]`` float32, the Markov-corrected, temperature-scaled distributions the tokens
        were drawn from (keys from ``(ctx.seed, position)``). ``confidence`` = ``[c_1..c_L]``.

        Raises:
            ValueError: the context rows received do not cover exactly ``0..anchor_pos-1``.
        """
        self._absorb(ctx.hidden)
        anchor_pos = len(ctx.tokens) - 1
        have = self.context_length
        if have != anchor_pos:
            raise ValueError(f"DSpark drafter holds context rows for {have} positions but the "
                             f"anchor is at position {anchor_pos}; the engine must pass every "
                             "committed position's hidden row exactly once")
        n = min(max_len, self.config.block_size)
        if n <= 0:
            return Draft()
        ctx_kv = self._context()
        anchor = int(ctx.tokens[-1])
        x = block_inputs(self.embed, anchor, self.config.mask_token_id, self.config.block_size)
        h = self.network(x, mx.array([[anchor_pos]], dtype=mx.int32), ctx_kv, fast=True)[0, 0, :n]
        base = self.lm_head(h).astype(mx.float32)
        temperature = float(getattr(ctx, "temperature", 0.0) or 0.0)
        tokens, probs, conf = sample_block(self.network, base, h, anchor, anchor_pos,
                                           temperature, int(getattr(ctx, "seed", 0) or 0))
        mx.eval(*(a for a in (tokens, probs, conf) if a is not None))
        return Draft(tokens=tokens.tolist(), draft_probs=probs,
                     confidence=conf.tolist() if conf is not None else None)

    def on_commit(self, num_accepted: int, ctx: DraftContext) -> None:
        """Take the committed rows in ``ctx.hidden`` (anchor + accepted drafts), if given here."""
        self._absorb(ctx.hidden)


def prefix_survival(confidence: list[float]) -> list[float]:
    """``a_k = prod_{i<=k} c_i`` (expected accepted drafts = ``sum_k a_k``)."""
    out, acc = [], 1.0
    for c in confidence:
        acc *= c
        out.append(acc)
    return out
