"""A static KV cache and compiled decode/verify passes over it.

Why: a one-token step of a small model on a GPU is bound by the host (Python builds ~20 ops per
layer through mlx-lm's modules every step), not by the device. ``mx.compile`` records the graph
once per input shape and replays it, but mlx-lm's ``KVCache`` changes shape every step. Here
each layer's keys and values live in preallocated ``[1, KV, capacity, D]`` buffers; the write
position is an ``mx.array`` (``mx.slice_update`` at that offset) and the attention mask is built
from it, so a pass of ``k`` rows at a given capacity has fixed shapes whatever the position: one
trace per ``(k, capacity, row_exact)``, replayed every cycle. Capacity grows in doubling buckets (the
buffers are copied into larger ones), rollback (trim) only moves the host-side length back.

Exactness: in a compiled pass every query row attends over the whole buffer with its own mask
row (``key <= position``), so row ``i`` of a ``k``-row verify sees the same shapes and values as
a one-row decode at that position. Batched attention is used up to the calibrated
batched-exact width; wider passes call attention once per row inside the compiled graph
(:func:`engine.exact_attention.scaled_dot_product_attention`), the very call a decode step makes.
Masked keys get probability exactly 0, so stale keys left behind by a rollback cannot change a
row. Prefill stays uncompiled (chunked, causal over the filled prefix, as mlx-lm does it) and
writes the same buffers.

The model code is mlx-lm's: the per-layer cache objects below provide the three things its
attention modules use (``offset`` for RoPE, ``update_and_fetch``, ``make_mask``).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

MIN_CAPACITY = 256


def bucket(n: int, limit: int | None = None) -> int:
    """Smallest capacity ``MIN_CAPACITY * 2**j >= n`` (at least ``n`` when ``limit`` caps it)."""
    cap = MIN_CAPACITY
    while cap < n:
        cap *= 2
    return max(n, min(cap, limit)) if limit else cap


class StaticLayerCache:
    """One layer's view of the static cache during a forward pass (what mlx-lm's attention sees).

    Args:
        keys, values: ``[1, KV, capacity, D]`` buffers.
        offset: first position written by this pass: a Python ``int`` (prefill: attend to the
            filled prefix, causal) or an int32 scalar ``mx.array`` (compiled decode/verify: attend
            over the whole buffer under a position mask).
        row_exact: ask :mod:`engine.exact_attention` to attend one query row per call.
    """

    static = True  # engine.exact_attention: attend over the whole buffer under mask rows

    def __init__(self, keys: mx.array, values: mx.array, offset, row_exact: bool = False):
        self.keys, self.values, self.offset, self.row_exact = keys, values, offset, row_exact

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``keys``/``values`` ``[1, KV, n, D]`` at ``offset``; return what to attend to."""
        if isinstance(self.offset, int):
            end = self.offset + keys.shape[2]
            self.keys[..., self.offset : end, :] = keys
            self.values[..., self.offset : end, :] = values
            return self.keys[..., :end, :], self.values[..., :end, :]
        start = mx.reshape(self.offset, (1,))
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), start, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """Prefill: mlx-lm's causal mask. Static pass: additive ``[n, capacity]`` in the cache's
        dtype, 0 where key ``j`` is visible to row ``i`` (``j <= offset + i``), else ``-inf``."""
        if window_size is not None:
            raise ValueError("the static KV cache supports full-attention models only")
        if isinstance(self.offset, int):
            from mlx_lm.models.cache import create_attention_mask

            return create_attention_mask(n, self.offset, return_array, None)
        # additive (0 / -inf in the cache's dtype), not bool: MLX-CUDA 0.32's fused attention
        # takes the additive form directly (H200, 8B shapes, 1024 keys: 23-29 us a call against
        # 37-58 us with a bool mask); a masked key still gets probability exactly 0
        positions = self.offset + mx.arange(n, dtype=mx.int32)
        visible = mx.arange(self.keys.shape[2], dtype=mx.int32)[None] <= positions[:, None]
        return mx.where(visible, mx.array(0, self.keys.dtype), mx.array(-mx.inf, self.keys.dtype))


class StaticCache:
    """A sequence's KV cache: per-layer preallocated buffers and the committed length.

    Args:
        num_layers: decoder layers.
        kv_heads, head_dim: per-layer K/V shape ``[1, kv_heads, capacity, head_dim]``.
        dtype: buffer dtype (the model's activation dtype).
        capacity: initial capacity (grown by :meth:`reserve`).
        limit: largest capacity ever needed (the context window), or None.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, capacity: int = MIN_CAPACITY,
                 limit: int | None = None):
        self.shape = (1, kv_heads, 0, head_dim)
        self.dtype, self.limit, self.length = dtype, limit, 0
        capacity = min(capacity, limit) if limit else capacity
        self.keys = [self._zeros(capacity) for _ in range(num_layers)]
        self.values = [self._zeros(capacity) for _ in range(num_layers)]

    def _zeros(self, capacity: int) -> mx.array:
        return mx.zeros((*self.shape[:2], capacity, self.shape[3]), self.dtype)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more positions (grow to the next bucket, copying the contents)."""
        need = self.length + n
        if need <= self.capacity:
            return
        extra = bucket(need, self.limit) - self.capacity
        grow = lambda b: mx.concatenate([b, self._zeros(extra)], axis=2)  # noqa: E731
        self.keys = [grow(b) for b in self.keys]
        self.values = [grow(b) for b in self.values]

    def trim(self, n: int) -> int:
        """Roll back the last ``n`` positions (their stale entries stay masked). Returns ``n`` done."""
        n = min(self.length, max(0, n))
        self.length -= n
        return n

    def layers(self, offset, row_exact: bool = False) -> list[StaticLayerCache]:
        return [StaticLayerCache(k, v, offset, row_exact) for k, v in zip(self.keys, self.values)]

    def store(self, layers: list[StaticLayerCache], n: int) -> None:
        """Take the buffers a pass of ``n`` positions wrote back from its layer views."""
        self.keys = [c.keys for c in layers]
        self.values = [c.values for c in layers]
        self.length += n


ForwardFn = Callable[[mx.array, list], tuple[mx.array, mx.array | None]]


class CompiledPasses:
    """Compiled decode/verify passes over :class:`StaticCache` buffers, one trace per shape.

    Args:
        forward: ``forward(ids [1, k] uint32, layer_caches) -> (logits [k, V] float32, hidden
            [k, m*d] float32 or None)``, built from the model's own modules.
        compile: False runs the same function uncompiled (same arithmetic, for tests and the
            benchmark's host/device split).
    """

    def __init__(self, forward: ForwardFn, compile: bool = True):
        self.forward, self.compile = forward, compile
        self._fns: dict[tuple, Callable] = {}

    def _make(self, row_exact: bool) -> Callable:
        def step(ids, offset, keys, values):
            layers = [StaticLayerCache(k, v, offset, row_exact) for k, v in zip(keys, values)]
            logits, hidden = self.forward(ids, layers)
            out = [logits, [c.keys for c in layers], [c.values for c in layers]]
            return out + ([hidden] if hidden is not None else [])

        return mx.compile(step) if self.compile else step

    def run(self, tokens: list[int], cache: StaticCache, row_exact: bool):
        """One pass of ``len(tokens)`` rows at ``cache.length``; commits them to ``cache``.

        Returns:
            ``(logits [k, V] float32, hidden [k, m*d] or None)``, lazy.
        """
        k = len(tokens)
        cache.reserve(k)
        fkey = (k, cache.capacity, row_exact)
        fn = self._fns.get(fkey)
        if fn is None:
            fn = self._fns[fkey] = self._make(row_exact)
        ids = mx.array(tokens, dtype=mx.uint32)[None]
        offset = mx.array(cache.length, dtype=mx.int32)
        out = fn(ids, offset, cache.keys, cache.values)
        cache.keys, cache.values = out[1], out[2]
        cache.length += k
        return out[0], (out[3] if len(out) > 3 else None)

    def traces(self) -> int:
        return len(self._fns)


class _Recorder:
    """A cache that records what each layer writes (shape probe for :func:`kv_layout`)."""

    offset = 0

    def __init__(self, seen: list):
        self.seen = seen

    def update_and_fetch(self, keys, values):
        self.seen.append((keys.shape, keys.dtype, values.shape))
        return keys, values

    def make_mask(self, n, return_array=False, window_size=None):
        return None


def kv_layout(model) -> tuple[int, int, int, mx.Dtype]:
    """``(layers, kv_heads, head_dim, dtype)`` of ``model``'s K/V, from a one-token probe pass.

    Raises:
        ValueError: layers differ in K/V shape or keys and values differ in shape (not supported
            by :class:`StaticCache`).
    """
    seen: list = []
    n = len(model.layers)
    model(mx.zeros((1, 1), dtype=mx.uint32), cache=[_Recorder(seen) for _ in range(n)])
    if len(seen) != n or len({s for s in seen}) != 1 or seen[0][0] != seen[0][2]:
        raise ValueError(f"the static KV cache needs identical K/V shapes in every layer, got {set(seen)}")
    (_, kv_heads, _, head_dim), dtype, _ = seen[0]
    return n, kv_heads, head_dim, dtype
