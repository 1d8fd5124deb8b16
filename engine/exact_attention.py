"""Row-exact attention for verify passes.

Greedy speculative decoding is lossless only if row ``i`` of a ``k``-row verify pass computes
exactly what a one-token decode step at that position computes. Matrix kernels do not promise
that: on Linux CPUs OpenBLAS picks different micro-kernels by the number of rows and by the key
length, so ``softmax(q K^T) V`` for a query differs in the last bits depending on how many other
queries share the call (measured: rows differ from width 3-4 on, and with the masked key length).
A near-tie in the logits then flips a greedy token.

The fix is to compute a verify pass's attention one query row at a time over exactly the keys a
decode step would see (``keys[:position + 1]``), through the same ``mx.fast`` call a decode step
makes. The projections (Linear layers) stay batched; their row-independence is checked at
start-up by :func:`engine.runner.probe_exact_width`.

mlx-lm's attention modules call the module-level ``scaled_dot_product_attention`` they imported
from ``mlx_lm.models.base``; :func:`install` rebinds that name in the model's modules to a
wrapper that changes nothing unless the cache passed in has ``row_exact`` set: an
:class:`ExactKVCache` (eager passes) or an ``engine.static_cache.StaticLayerCache`` (compiled
passes; ``static`` set). The engine sets it for decode/verify passes only, never for prefill.

With ``SPECSERVE_EXACT_VERIFY=kernel`` the cache also carries ``row_kernel``
(``metal_kernels.attention.row_attention``): every decode and verify pass then attends through
that one launch per layer, whose rows are independent by construction, instead of one call per
row (decode rows go through it too, so they match the verify rows).
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache

_original_sdpa = mlx_base.scaled_dot_product_attention


class ExactKVCache(KVCache):
    """mlx-lm's ``KVCache`` plus a flag that asks for row-exact attention."""

    row_exact = False
    row_kernel = None  # callable(queries, keys, values, scale) -> array | None, or None


class BatchLayerCache:
    """One layer's view of several sequences' caches during a batched pass (continuous batching).

    The model sees a batch ``[S, L]`` (sequence ``i``'s rows first, padding after ``lengths[i]``)
    and one cache object per layer. RoPE reads ``offset`` (each sequence's own position, an
    ``int32 [S]`` array); :meth:`update_and_fetch` appends each sequence's real rows to its own
    cache; :func:`scaled_dot_product_attention` then attends sequence by sequence with exactly
    the call a single-sequence pass of those rows makes. The projections stay batched: their
    rows must not depend on the batch, which calibration checks (``TargetRunner.calibrate_batch``).

    Args:
        layers: each sequence's cache for this layer (:class:`ExactKVCache`).
        lengths: real rows per sequence (``1 <= lengths[i] <= L``).
        row_exact: per sequence, attend row by row (as its single-sequence pass would).
        row_kernel: the row-attention kernel of the engine's passes, if any (see module doc).
    """

    batched = True

    def __init__(self, layers: list[ExactKVCache], lengths: list[int], row_exact: list[bool],
                 row_kernel=None):
        self.layers, self.lengths, self.row_exact = layers, lengths, row_exact
        self.row_kernel = row_kernel
        self.offset = mx.array([c.offset for c in layers], dtype=mx.int32)
        self.fetched: list[tuple[mx.array, mx.array]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.fetched = [c.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])
                        for i, (c, n) in enumerate(zip(self.layers, self.lengths))]
        return keys, values  # unused: attention reads `fetched`

    def make_mask(self, *args, **kwargs):
        return None  # causality is per sequence, in scaled_dot_product_attention


def _batched_sdpa(queries, cache: BatchLayerCache, scale, sinks):
    width = queries.shape[2]
    outs = []
    for i, ((keys, values), n, layer) in enumerate(zip(cache.fetched, cache.lengths, cache.layers)):
        layer.row_exact = cache.row_exact[i]
        layer.row_kernel = cache.row_kernel if cache.row_exact[i] else None
        try:  # what a single-sequence pass of these n rows calls (mask as mlx-lm's KVCache makes it)
            out = scaled_dot_product_attention(queries[i : i + 1, :, :n], keys, values, layer, scale,
                                               None if n == 1 else "causal", sinks)
        finally:
            layer.row_exact, layer.row_kernel = False, None
        if n < width:
            out = mx.concatenate([out, mx.zeros((1, out.shape[1], width - n, out.shape[3]), out.dtype)], axis=2)
        outs.append(out)
    return mx.concatenate(outs, axis=0)


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """Drop-in for mlx-lm's ``scaled_dot_product_attention``.

    ``queries``: ``[B, H, L, D]``; ``keys``/``values``: ``[B, KV, S + L, D]`` (the cache's
    contents including the ``L`` new positions). With ``cache.row_exact`` and ``L > 1``, query
    ``i`` attends to ``keys[:, :, :S + i + 1]`` on its own (causal by construction). With a
    static cache (``cache.static``; ``mask`` an additive array ``[L, capacity]``, keys the whole buffer)
    query ``i`` attends over the whole buffer with mask row ``i`` (one-row calls: :func:`_static_row`).
    """
    if getattr(cache, "batched", False):
        return _batched_sdpa(queries, cache, scale, sinks)
    kernel = getattr(cache, "row_kernel", None)
    if (kernel is not None and getattr(cache, "row_exact", False) and sinks is None
            and (mask is None or isinstance(mask, str) and mask == "causal")):
        out = kernel(queries, keys, values, scale)
        if out is not None:
            return out
    n = queries.shape[2]
    # a compiled pass over the static cache (its write position is an array; prefill chunks
    # through the same cache have an int position and mlx-lm's own mask, and stay below)
    static = getattr(cache, "static", False) and not isinstance(cache.offset, int) and sinks is None
    if static and not isinstance(mask, mx.array):
        raise ValueError(f"a compiled pass over the static KV cache needs its array mask, got {mask!r}")
    if static and n == 1:
        return _static_row(queries, keys, values, scale, mask)
    if n == 1 or not getattr(cache, "row_exact", False) or sinks is not None:
        return _original_sdpa(queries, keys, values, cache, scale, mask, sinks)
    if static:
        # Static cache (engine.static_cache): every row attends over the whole buffer under its
        # own mask row [1, capacity], the very call a one-row decode step makes.
        rows = [_static_row(queries[:, :, i : i + 1], keys, values, scale, mask[..., i : i + 1, :])
                for i in range(n)]
        return mx.concatenate(rows, axis=2)
    start = keys.shape[2] - n
    rows = [
        mx.fast.scaled_dot_product_attention(
            queries[:, :, i : i + 1],
            keys[:, :, : start + i + 1],
            values[:, :, : start + i + 1],
            scale=scale,
        )
        for i in range(n)
    ]
    return mx.concatenate(rows, axis=2)


# One query row under an array mask (a static cache's decode row, or one row of a row-exact
# verify): MLX-CUDA 0.32's one-row attention kernel takes no array mask, so such a call falls back
# to unfused ops (H200, bf16, 32/8 heads of 128, 1024 keys: 80-87 us a call), while two rows take
# the fused path (29 us). On CUDA the row is therefore attended as row 0 of a two-row call whose
# second row is a copy; decode rows and row-exact verify rows make that same call, so they stay
# identical. Only where the fused path takes masked rows (cuDNN: half-precision activations, head
# dim a multiple of 8 up to 128); elsewhere both forms fall back, and padding would only move the
# fp32 scores from a one-row product to a matrix product. Fixed per model, like the call itself.
PAD_ONE_ROW = hasattr(mx, "cuda") and mx.cuda.is_available()
PAD_DTYPES = (mx.float16, mx.bfloat16)


def _static_row(query, keys, values, scale, mask):
    """Attention of one query row ``[B, H, 1, D]`` over the whole static buffer under ``mask``
    (``[1, capacity]``); see :data:`PAD_ONE_ROW`."""
    head_dim = query.shape[-1]
    if not (PAD_ONE_ROW and query.dtype in PAD_DTYPES and head_dim % 8 == 0 and head_dim <= 128):
        return mx.fast.scaled_dot_product_attention(query, keys, values, scale=scale, mask=mask)
    two = mx.concatenate([query, query], axis=2)
    out = mx.fast.scaled_dot_product_attention(two, keys, values, scale=scale,
                                               mask=mx.concatenate([mask, mask], axis=-2))
    return out[:, :, :1]


def install(model) -> list[str]:
    """Rebind ``scaled_dot_product_attention`` in every module that defines one of ``model``'s
    submodules and imported mlx-lm's version. Idempotent. Returns the patched module names."""
    patched = []
    names = {type(m).__module__ for _, m in model.named_modules()}
    for name in sorted(names):
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is _original_sdpa:
            module.scaled_dot_product_attention = scaled_dot_product_attention
            patched.append(name)
        elif current is scaled_dot_product_attention:
            patched.append(name)
    return patched


def make_cache(model) -> list:
    """mlx-lm's cache for ``model`` with plain ``KVCache`` layers replaced by :class:`ExactKVCache`."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    return [ExactKVCache() if type(c) is KVCache else c for c in cache]


def set_row_exact(cache: list, on: bool, kernel=None) -> None:
    """Mark ``cache``'s layers for row-exact attention (``on``), through ``kernel`` if given."""
    for c in cache:
        if isinstance(c, ExactKVCache):
            c.row_exact = on
            c.row_kernel = kernel if on else None
