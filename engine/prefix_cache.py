"""Prefix cache: reuse prompt KV across requests that share a token prefix.

Agent clients resend the same system prompt, tool definitions and earlier turns with every
request. The prefix cache keeps the target's KV cache (and, with DSpark on, the tapped hidden
states the drafter reads) for prompt prefixes it has prefilled, and a later request with the same
prefix starts its prefill where the cached part ends.

Exactness. Reusing KV must not change a single output token, so the cached part must hold the very
bits a cold prefill of the new prompt would compute. A chunk's rows do not only depend on their
own tokens: matrix kernels pick different code paths by the number of rows (engine/exact_attention
explains the BLAS case), so the same position prefilled in a chunk of 100 rows and in one of 512
may differ in the last bits. Prefill therefore always runs in chunks aligned to absolute
multiples of ``block`` (the engine's ``prefill_step``): ``[0, B), [B, 2B), ...`` and a last
partial chunk ending before the anchor. Only whole chunks are cached and reused, so a warm
request computes exactly the chunks a cold one would, on exactly the same cached inputs (vLLM's
automatic prefix caching reuses whole KV blocks for the same reason of bookkeeping; here it is
also what keeps warm output bit-identical to cold output). Output tokens' KV, computed by decode
and verify passes, is never cached: a later prompt containing them prefills them itself.

Storage and lookup are mlx-lm's :class:`mlx_lm.models.cache.LRUPromptCache` (a token trie per
namespace, exact / shorter / longer-and-trim matches, eviction of the least recently stored entry
under a byte cap; a hit that uses a whole entry stores it again, so it counts as recent). Namespaces keep apart entries with and without DSpark hidden states and requests
with different ``cache_salt`` values (vLLM's field: tenants that must not share cache timing). A
request without DSpark reads both namespaces of its salt: an entry stored with hidden states holds
the same KV bits (``drafters.dspark.TargetTaps`` runs the model's own modules), so a system prompt
first prefilled by a DSpark request serves plain ones too. A DSpark request reads only entries
with hidden states (its drafter needs the prompt's rows).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from .exact_attention import ExactKVCache


class StoredLayer:
    """One cached layer's arrays (KV: ``(keys, values)`` ``[1, KV, P, D]``; DSpark taps:
    ``(rows,)`` ``[P, m*d]``), as :class:`LRUPromptCache` holds them.

    The arrays are never modified. ``LRUPromptCache`` deep-copies an entry on every fetch and
    trims the copy; here a deep copy is a new view on the same arrays with its own ``offset``, so
    a fetch copies no data and a hit on a long entry holds nothing beyond the rows it uses once
    :meth:`PrefixCache.fetch` has sliced them.
    """

    def __init__(self, arrays: tuple[mx.array, ...], offset: int | None = None):
        self.arrays = arrays
        self.offset = arrays[0].shape[-2] if offset is None else offset

    @property
    def length(self) -> int:
        """Positions the arrays hold (the offset may have been trimmed below it)."""
        return self.arrays[0].shape[-2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def __deepcopy__(self, memo) -> StoredLayer:
        return StoredLayer(self.arrays, self.offset)


@dataclass
class PrefixHit:
    """A fetched prefix: ``cache`` (fresh per-layer KV caches holding ``num_tokens`` positions),
    ``hidden`` (``[num_tokens, m*d]`` float32 tapped rows, or None without taps)."""

    cache: list
    hidden: mx.array | None
    num_tokens: int


class PrefixCache:
    """Whole prefill chunks of earlier prompts, keyed by their tokens.

    Args:
        block: the prefill chunk size; cached prefixes are multiples of it.
        max_bytes: byte budget for stored KV (and tapped hidden rows); past it the least
            recently stored (or wholly reused) entries are evicted. A prompt whose whole chunks
            exceed the budget stores only the leading chunks that fit.

    Thread safety: the engine's worker calls :meth:`fetch` and :meth:`insert`; :meth:`info` may
    be called from any thread (a scrape).
    """

    def __init__(self, block: int, max_bytes: int):
        if block < 1 or max_bytes < 1:
            raise ValueError("prefix cache block and max_bytes must be positive")
        self.block = block
        self.max_bytes = max_bytes
        self._store = LRUPromptCache(max_size=1 << 62, max_bytes=max_bytes)
        self._lock = threading.Lock()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens served from the cache

    @staticmethod
    def supports(cache: list) -> bool:
        """True for caches made only of plain per-layer KV caches (no rotating/recurrent state)."""
        return isinstance(cache, list) and all(type(c) is ExactKVCache for c in cache)

    def cacheable(self, prompt_len: int) -> int:
        """Positions of a ``prompt_len``-token prompt covered by whole chunks (the last prompt
        token, the first anchor, is never prefilled)."""
        return (prompt_len - 1) // self.block * self.block

    def storable(self, prompt_len: int, cache: list, hidden_bytes: int = 0) -> int:
        """Positions :meth:`insert` would store for a ``prompt_len``-token prompt prefilled into
        ``cache``: whole chunks, capped by the byte budget, which ``hidden_bytes`` per position of
        DSpark hidden rows share with the KV (before the first chunk is prefilled the budget is
        not known yet and only chunks count)."""
        if not self.supports(cache):
            return 0
        if cache[0].keys is None:
            return self.cacheable(prompt_len)
        per_position = sum(c.keys.nbytes // c.keys.shape[2] + c.values.nbytes // c.values.shape[2] for c in cache)
        per_position += hidden_bytes
        return min(self.cacheable(prompt_len), self.max_bytes // per_position // self.block * self.block)

    @staticmethod
    def _namespace(taps: bool, salt: str | None) -> tuple:
        return ("taps" if taps else "kv", salt or "")

    def fetch(self, prompt: list[int], taps: bool, salt: str | None = None) -> PrefixHit | None:
        """The longest cached whole-chunk prefix of ``prompt`` (None on a miss): with ``taps``,
        among entries stored with hidden rows; without, among all entries of ``salt`` (a tapped
        entry's KV serves a plain request; its hidden rows are left out).

        Counts ``len(prompt)`` queried tokens and the hit's length as hit tokens.
        """
        usable = self.cacheable(len(prompt))
        with self._lock:
            self.queries += len(prompt)
            if usable == 0:
                return None
            cache = stored_taps = None
            for ns_taps in (True,) if taps else (False, True):
                # The sentinel (-1, never a token) makes mlx-lm's lookup keep all `usable` positions
                # when a longer entry matches them (it otherwise leaves the last one out).
                found, _ = self._store.fetch_nearest_cache(self._namespace(ns_taps, salt), prompt[:usable] + [-1])
                if found is not None and (cache is None or found[0].offset > cache[0].offset):
                    cache, stored_taps = found, ns_taps
        if cache is None:
            return None
        aligned = min(cache[0].offset, usable) // self.block * self.block
        if aligned == 0:
            return None
        layers = []
        for stored in cache[:-1] if stored_taps else cache:
            layer = ExactKVCache()  # fresh arrays objects: the request's writes never reach the entry
            keys, values = stored.arrays
            layer.state = (keys[..., :aligned, :], values[..., :aligned, :], aligned)
            layers.append(layer)
        hidden = cache[-1].arrays[0][:aligned] if taps else None
        with self._lock:
            self.hits += aligned
            if aligned == cache[0].length:  # the whole entry is in use: make it the most recent
                self._store.insert_cache(self._namespace(stored_taps, salt), prompt[:aligned], cache)
        return PrefixHit(layers, hidden, aligned)

    def insert(self, prompt: list[int], cache: list, hidden: mx.array | None, taps: bool,
               salt: str | None = None, already: int = 0, prefilled: int | None = None) -> int:
        """Store the whole chunks of a freshly prefilled ``prompt``.

        Args:
            prompt: the request's prompt tokens.
            cache: its per-layer KV caches, holding at least ``cacheable(len(prompt))`` positions
                (or ``prefilled``) computed by prefill (call before any decode or verify pass
                changes them).
            hidden: ``[>= P, m*d]`` tapped hidden rows of those positions (required with ``taps``).
            already: positions that came from this cache (nothing new to store at or below it).
            prefilled: positions prefilled so far, for a prompt whose prefill stopped early (a
                request cancelled mid-prefill): only the whole chunks among them are stored.

        Returns:
            Positions stored (0 when nothing new).
        """
        length = self.cacheable(len(prompt))
        if prefilled is not None:
            length = min(length, prefilled // self.block * self.block)
        if length <= already or not self.supports(cache):
            return 0
        if taps and (hidden is None or hidden.shape[0] < length):
            raise ValueError("a tapped prefix needs the hidden rows of every cached position")
        per_position = sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in cache)
        if taps:
            per_position += hidden[:1].nbytes
        fits = self.max_bytes // per_position // self.block * self.block
        length = min(length, fits)  # an entry over the whole budget would evict everything
        if length <= already:
            return 0
        entry = [StoredLayer((_copy(c.keys[..., :length, :]), _copy(c.values[..., :length, :]))) for c in cache]
        if taps:
            entry.append(StoredLayer((_copy(hidden[:length]),)))
        mx.eval([a for layer in entry for a in layer.arrays])
        with self._lock:
            self._store.insert_cache(self._namespace(taps, salt), prompt[:length], entry)
        return length

    def info(self) -> dict:
        """``bytes``, ``entries``, ``queries`` and ``hits`` (tokens), ``block``, ``max_bytes``."""
        with self._lock:
            return {"bytes": self._store.nbytes, "entries": len(self._store), "queries": self.queries,
                    "hits": self.hits, "block": self.block, "max_bytes": self.max_bytes}


def copy_prefix(cache: list, n: int) -> list:
    """Fresh per-layer KV caches holding copies of the first ``n`` positions of ``cache`` (plain
    per-layer caches, :meth:`PrefixCache.supports`), evaluated, so the live cache's later
    in-place writes neither reach them nor wait on them."""
    layers = []
    for c in cache:
        layer = ExactKVCache()
        layer.state = (_copy(c.keys[..., :n, :]), _copy(c.values[..., :n, :]), n)
        layers.append(layer)
    mx.eval([a for layer in layers for a in (layer.keys, layer.values)])
    return layers


def _copy(view: mx.array) -> mx.array:
    """A copy of ``view`` in its own buffer, bit for bit (``x * 1`` keeps signed zeros and NaNs).

    A slice may share the live cache's buffer; while it did, MLX could not update that buffer in
    place and every later decode step would copy the whole cache."""
    return view * mx.array(1, dtype=view.dtype)
