"""Target forward passes: prefill, decode and verify, plus the start-up calibration.

Calibration answers two questions on the machine at hand, before serving:
1. How wide may a verify pass be while every row stays bit-identical to a one-token decode
   step? Decode steps and verify passes are run on the same tokens and their logits compared
   bit for bit, first with MLX's batched attention, then with row-exact attention
   (:mod:`engine.exact_attention`). The widest exact configuration wins.
2. What does a pass of ``k`` rows cost? ``T(k)`` feeds the draft-length scheduler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import exact_attention
from .scheduler import CostModel
from .static_cache import MIN_CAPACITY, CompiledPasses, StaticCache, bucket, kv_layout

log = logging.getLogger("specserve.runner")


class LayerRows:
    """Tapped hidden rows of one fused pass, left in the pass's own layer-major output.

    A fused pass writes every decoder layer's output (``[L, n, d]`` float32); DSpark reads the
    tapped layers side by side (``[n, taps * d]``). Laying one pass's rows out costs a copy per
    tapped layer, and on MLX-CUDA a launch costs ~15-20 us of host time: under auto, tapping
    every cycle so cost ~6% of the default model's 1.9 ms step on the H200 (cycle_profile:
    one-row cycles 1.93 against 1.82 ms). A ``LayerRows`` is a view of the pass's output (no
    launch); :func:`join_rows` lays many passes' rows out at once. The view keeps the whole
    output alive (every layer, every row of the pass: ~1.1 MB for a 16-row pass of the default
    model) until then; the engine folds a sequence's rows every 16 cycles.
    """

    def __init__(self, hidden: mx.array, layer_ids: list[int]):
        self.hidden = hidden  # [L, n, d]
        self.layer_ids = layer_ids

    def __len__(self) -> int:
        return self.hidden.shape[1]

    def __getitem__(self, rows: slice) -> LayerRows:
        return LayerRows(self.hidden[:, rows], self.layer_ids)


def join_rows(entries: list) -> mx.array:
    """Tapped rows in order (``[n_i, taps * d]`` arrays and :class:`LayerRows`) as one
    ``[sum n_i, taps * d]`` float32 array, lazy. Consecutive ``LayerRows`` are concatenated in
    their layer-major layout first (a copy per pass), then laid out once (a copy per tap).

    Raises:
        ValueError: no entries.
    """
    if not entries:
        raise ValueError("no tapped rows to join")
    out, run = [], []

    def lay_out() -> None:
        if run:
            h = run[0].hidden if len(run) == 1 else mx.concatenate([r.hidden for r in run], axis=1)
            out.append(mx.concatenate([h[i] for i in run[0].layer_ids], axis=-1))
            run.clear()

    for entry in entries:
        if isinstance(entry, LayerRows):
            run.append(entry)
        else:
            lay_out()
            out.append(entry)
    lay_out()
    return out[0] if len(out) == 1 else mx.concatenate(out)


@dataclass
class Calibration:
    max_rows: int  # widest exact verify pass (anchor + drafts); 1 = no speculation possible
    row_exact_attention: bool  # passes wider than batched_rows attend row by row
    verify_cost: list[float]  # seconds for k = 1..max_rows rows
    probed_rows: int  # the width asked for
    batched_rows: int = 0  # widest pass exact with MLX's batched attention
    attention_kernel: bool = False  # decode/verify passes attend through metal_kernels.attention
    fused_pass: bool = False  # decode/verify passes run as one launch (metal_kernels.fused)
    context_slope: float = 0.0  # seconds per context token a pass's first row adds (:func:`context_slopes`)
    context_row_slope: float = 0.0  # ... and each further row
    reference_context: int = 256  # the context length verify_cost was timed at

    def summary(self) -> dict:
        base = self.verify_cost[0]
        return {
            "max_verify_rows": self.max_rows,
            "batched_attention_rows": self.batched_rows,
            "row_exact_attention": self.row_exact_attention,
            "attention_kernel": self.attention_kernel,
            "fused_pass": self.fused_pass,
            "verify_cost_ms": [round(t * 1e3, 3) for t in self.verify_cost],
            "verify_cost_relative": [round(t / base, 3) for t in self.verify_cost],
            "verify_cost_context": self.reference_context,
            "context_cost_us_per_1k_tokens": [round(self.context_slope * 1e9, 1),
                                              round(self.context_row_slope * 1e9, 1)],
        }


class TargetRunner:
    """Runs the target model on caller-owned KV caches.

    Args:
        model: an mlx-lm model (``model(tokens[None], cache=...) -> logits``).
        prefill_step: prompt chunk size for prefill.
        compile: run decode/verify passes as ``mx.compile``d graphs over a static KV cache
            (:mod:`engine.static_cache`); caches are then :class:`StaticCache` objects.
        max_context: the context window (largest static cache capacity needed).
        fused: a one-call pass for ``model`` (``metal_kernels.make_fused_pass``: the CUDA
            ``FusedPass`` or the CPU ``CpuFusedPass``), or None: decode/verify passes of 1..16
            rows then run as one call each (eager caches only; prefill keeps mlx-lm's modules).
            Batched passes of several sequences go through it when it ``batches`` (the CPU
            pass), else there are none.
    """

    def __init__(self, model: nn.Module, prefill_step: int = 512, compile: bool = False,
                 max_context: int | None = None, fused=None):
        self.model = model
        self.prefill_step = prefill_step
        self.row_exact_attention = False
        self.batched_rows = 1 << 30  # passes up to this many rows use batched attention
        # The row-attention kernel (metal_kernels.attention) for decode/verify passes, set by
        # calibrate(mode="kernel"); None: MLX's attention, row by row where needed.
        self.row_kernel = None
        self.patched_modules = exact_attention.install(model)
        self.compiled = compile
        self.max_context = max_context
        self._kv_layout = None  # (layers, kv_heads, head_dim, dtype) of the static cache
        self._passes: dict[int, CompiledPasses] = {}  # id(taps) (0: none) -> compiled passes
        self._taps_alive: dict[int, object] = {}
        self.fused = None if compile else fused

    def make_cache(self, positions: int | None = None):
        """A new empty KV cache (mlx-lm per-layer caches, or a :class:`StaticCache` when compiled).

        ``positions``: the most positions this cache will hold (prompt + max_tokens + the widest
        verify). A static cache is sized for it up front, so it never grows mid-request: a
        compiled pass attends over the whole capacity, and the same position computed at two
        capacities may differ in the last bits, which would break speculative == plain."""
        if not self.compiled:
            return exact_attention.make_cache(self.model)
        if self._kv_layout is None:
            self._kv_layout = kv_layout(self.model)
        capacity = bucket(positions, self.max_context) if positions else MIN_CAPACITY
        return StaticCache(*self._kv_layout, capacity=capacity, limit=self.max_context)

    @staticmethod
    def trim(cache, n: int) -> None:
        """Roll back the last ``n`` positions of every layer's cache."""
        if n <= 0:
            return
        if isinstance(cache, StaticCache):
            cache.trim(n)
            return
        for c in cache:
            c.trim(n)

    @staticmethod
    def cache_arrays(cache) -> list[mx.array]:
        """The arrays holding ``cache``'s keys and values (what to evaluate after a prefill)."""
        if isinstance(cache, StaticCache):
            return cache.keys + cache.values
        return [a for c in cache for a in (c.keys, c.values) if a is not None]

    @staticmethod
    def cache_length(cache) -> int:
        return cache.length if isinstance(cache, StaticCache) else cache[0].offset

    def _run_modules(self, ids: mx.array, cache, taps):
        if taps is None:
            return self.model(ids, cache=cache)[0], None
        # drafters.dspark.TargetTaps runs the same modules as the model's own forward (same
        # logits bit for bit) and keeps the tapped layers' outputs.
        final, hidden = taps.forward(ids, cache)
        return taps.lm_head(final)[0], hidden[0].astype(mx.float32)

    def _forward(self, tokens: list[int], cache, taps):
        ids = mx.array(tokens, dtype=mx.uint32)[None]
        if not isinstance(cache, StaticCache):
            return self._run_modules(ids, cache, taps)
        cache.reserve(len(tokens))
        layers = cache.layers(cache.length)
        out = self._run_modules(ids, layers, taps)
        cache.store(layers, len(tokens))
        return out

    def passes(self, taps=None) -> CompiledPasses:
        """The compiled decode/verify passes (with ``taps``' hidden states when given)."""
        key = 0 if taps is None else id(taps)
        if key not in self._passes:
            def forward(ids, layers):
                logits, hidden = self._run_modules(ids, layers, taps)
                return logits.astype(mx.float32), hidden

            self._passes[key] = CompiledPasses(forward)
            self._taps_alive[key] = taps  # keeps id(taps) unique while its passes live
        return self._passes[key]

    @property
    def prefill_slice_rows(self) -> int | None:
        """The row count prefill slices are made of (engine.Engine._prefill_slice): a fused pass
        that prefills takes a chunk this many rows at a time, each row with the decode step's
        arithmetic, so any split of a chunk leaves the same bits in the cache. None where a chunk
        must run whole (mlx-lm's modules: another split changes the matmul shapes, hence bits,
        and the prefix cache relies on them)."""
        if self.fused is None or not getattr(self.fused, "prefills", False):
            return None
        return self.fused.max_rows

    def prefill(self, tokens: list[int], cache, taps=None, logits: bool = True):
        """Run ``tokens`` (a prompt chunk) through the target (never compiled: chunk sizes vary).

        A fused pass that ``prefills`` (the CPU twin) takes the chunk ``max_rows`` rows at a time:
        on the default model with q16 activations that is ~2x OpenBLAS's float32 prefill. Its rows
        are the decode step's arithmetic, so the cache holds the same bits however the prompt
        was chunked (the prefix cache relies on that); position 0 goes through mlx-lm's modules,
        as in decoding.

        Args:
            logits: False when only the cache (and taps) are wanted: a fused prefill then skips
                the LM head, and the returned logits are None.

        Returns:
            ``(logits [n, V] float32 or None, hidden [n, m*d] float32 or None)``, lazy;
            ``hidden`` holds the tapped layers' outputs when ``taps`` (a
            ``drafters.dspark.TargetTaps``) is given.
        """
        if self.fused is None or not getattr(self.fused, "prefills", False) or not tokens:
            return self._forward(tokens, cache, taps)
        parts = []
        if self.cache_length(cache) == 0:
            parts.append(self._module_pass(tokens[:1], cache, taps))
            tokens = tokens[1:]
        for i in range(0, len(tokens), self.fused.max_rows):
            out = self.fused(tokens[i:i + self.fused.max_rows], cache, logits=logits)
            self.fused.check(out)
            parts.append(self._fused_result(out, taps))
        def joined(i):
            return parts[0][i] if len(parts) == 1 else mx.concatenate([p[i] for p in parts])

        return (joined(0) if logits else None), (joined(1) if taps is not None else None)

    def verify(self, tokens: list[int], cache, taps=None, layer_rows: bool = False):
        """Decode (one token) or verify (anchor + drafts).

        Every row computes what a one-token decode step at its position computes.

        Args:
            layer_rows: a fused pass may return its tapped rows as :class:`LayerRows` (join
                them with :func:`join_rows`).

        Returns:
            ``(logits [len(tokens), V] float32, hidden [len(tokens), m*d] float32 or None)``, lazy;
            with ``layer_rows``, ``hidden`` may be a :class:`LayerRows` of ``len(tokens)`` rows.
        """
        if self.fused is not None:
            if self.cache_length(cache) > 0:
                return self._fused_pass(tokens, cache, taps, layer_rows)
            # An empty cache (a one-token prompt): position 0 goes through mlx-lm's modules, as
            # in plain decoding, and the rest through the fused pass, as in plain decoding.
            first = self._module_pass(tokens[:1], cache, taps)
            if len(tokens) == 1:
                return first
            rest = self._fused_pass(tokens[1:], cache, taps)
            return (mx.concatenate([first[0], rest[0]]),
                    None if first[1] is None else mx.concatenate([first[1], rest[1]]))
        return self._module_pass(tokens, cache, taps)

    def _module_pass(self, tokens: list[int], cache, taps):
        """A decode/verify pass through mlx-lm's modules (eager or compiled)."""
        row_exact = self._row_exact(len(tokens))
        if isinstance(cache, StaticCache):
            return self.passes(taps).run(tokens, cache, row_exact)
        exact_attention.set_row_exact(cache, row_exact, self.row_kernel)
        try:
            logits, hidden = self._forward(tokens, cache, taps)
            return logits.astype(mx.float32), hidden
        finally:
            exact_attention.set_row_exact(cache, False)

    def _fused_pass(self, tokens: list[int], cache, taps, layer_rows: bool = False):
        """One fused pass, evaluated (its completion flags are checked before the logits are
        used). A failed pass raises: that sequence ends, later ones keep the fused pass (their
        verify width was calibrated on it, so switching to mlx-lm's modules would not be exact)."""
        out = self.fused(tokens, cache)  # evaluated (the kernel writes the cache)
        self.fused.check(out)
        return self._fused_result(out, taps, layer_rows)

    @staticmethod
    def _fused_result(out, taps, layer_rows: bool = False):
        """``(logits, tapped hidden states or None)`` of a fused pass's output; with
        ``layer_rows``, the taps as :class:`LayerRows` where no tap is the embeddings."""
        if taps is None:
            return out.logits, None
        if layer_rows and min(taps.layer_ids) >= 0:
            return out.logits, LayerRows(out.hidden, taps.layer_ids)
        layers = [out.embeddings if i < 0 else out.hidden[i] for i in taps.layer_ids]  # each [n, d]
        return out.logits, mx.concatenate(layers, axis=-1).astype(mx.float32)

    def _row_exact(self, rows: int) -> bool:
        """Whether a pass of ``rows`` rows attends row by row (calibration's choice)."""
        return self.row_exact_attention and rows > self.batched_rows

    def verify_batch(self, rows: list[list[int]], caches: list[list], taps=None) -> list[tuple]:
        """Several sequences' decode/verify rows in one target pass (continuous batching).

        Sequence ``i``'s rows are padded to the longest; its real rows go into ``caches[i]``
        (eager per-layer caches). Each real row computes what the sequence's own
        :meth:`verify` computes, as long as the padded batch holds at most
        :meth:`calibrate_batch`'s row count.

        Returns:
            per sequence ``(logits [n_i, V] float32, hidden [n_i, m*d] float32 or None)``, lazy.
        """
        if self.fused is not None:
            return self._fused_batch(rows, caches, taps)
        lengths = [len(r) for r in rows]
        width = max(lengths)
        ids = mx.array([r + [r[-1]] * (width - len(r)) for r in rows], dtype=mx.uint32)
        row_exact = [self._row_exact(n) for n in lengths]
        layers = [exact_attention.BatchLayerCache([c[j] for c in caches], lengths, row_exact, self.row_kernel)
                  for j in range(len(caches[0]))]
        if taps is None:
            logits, hidden = self.model(ids, cache=layers), None
        else:
            final, hidden = taps.forward(ids, layers)
            logits, hidden = taps.lm_head(final), hidden.astype(mx.float32)
        return [(logits[i, :n].astype(mx.float32), None if hidden is None else hidden[i, :n])
                for i, n in enumerate(lengths)]

    def _fused_batch(self, rows: list[list[int]], caches: list[list], taps) -> list[tuple]:
        """Several sequences in one fused pass (a pass that :attr:`batches`: the CPU twin),
        unpadded; sequences with an empty cache take their own passes, as :meth:`verify` does."""
        together = [i for i, c in enumerate(caches) if self.cache_length(c) > 0]
        outs: list = [None] * len(rows)
        if together:
            batch = self.fused.batch([rows[i] for i in together], [caches[i] for i in together])
            for i, out in zip(together, batch):
                self.fused.check(out)
                outs[i] = self._fused_result(out, taps)
        for i, cache in enumerate(caches):
            if outs[i] is None:
                outs[i] = self.verify(rows[i], cache, taps)
        return outs

    def calibrate_batch(self, vocab_size: int, max_rows: int, max_width: int, context: int = 40) -> int:
        """Most rows (sequences x padded width) a batched pass may hold while every sequence's
        rows stay bit-identical to its own pass (0: batching is not exact here, or ``max_rows``
        < 2, or the model's modules cannot run a batched pass). Checks, for each size ``P``,
        ``P`` one-row sequences and two sequences of ``min(P // 2, max_width)`` and 1 rows
        (``max_width``: the widest exact single verify), at different context lengths. A
        batched pass attends sequence by sequence with the calls each sequence's own pass makes,
        so only the batched projections and RoPE's per-sequence offsets are under test here: a
        few short contexts suffice."""
        if self.fused is not None:
            if not getattr(self.fused, "batches", False):
                return 0  # (the CUDA fused pass takes one sequence: a batched pass would not match it)
            max_rows = min(max_rows, self.fused.max_rows)
        if self.compiled or max_rows < 2:
            return 0
        ids = mx.random.randint(3, vocab_size, (context + 4 * max_rows + max_rows,), key=mx.random.key(99)).tolist()

        caches = []  # sequence i: a cache holding context + 3 i tokens, reused by every check
        solo = {}  # (i, n) -> sequence i's own pass over its n rows (the same at every size checked)

        def exact(lengths: list[int]) -> bool:
            while len(caches) < len(lengths):
                caches.append(self.make_cache())
                self.prefill(ids[: context + 3 * (len(caches) - 1)], caches[-1])
                mx.eval(self.cache_arrays(caches[-1]))
            seqs = [(caches[i], ids[context + 3 * i : context + 3 * i + n]) for i, n in enumerate(lengths)]
            alone = []
            for i, (cache, rows) in enumerate(seqs):
                if (i, len(rows)) not in solo:
                    logits = self.verify(rows, cache)[0]
                    mx.eval(logits)
                    self.trim(cache, len(rows))
                    solo[i, len(rows)] = logits
                alone.append(solo[i, len(rows)])
            together = self.verify_batch([r for _, r in seqs], [c for c, _ in seqs])
            mx.eval([t[0] for t in together])
            for cache, rows in seqs:
                self.trim(cache, len(rows))
            return all(mx.array_equal(a, t[0]).item() for a, t in zip(alone, together))

        best = 0
        try:
            for size in range(2, max_rows + 1):
                wide = min(size // 2, max_width)
                if not exact([1] * size) or (wide >= 2 and not exact([wide, 1])):
                    break
                best = size
        except Exception:  # a model whose attention or RoPE cannot take a BatchLayerCache
            log.warning("batched passes unavailable for this model: one sequence per pass", exc_info=True)
            return 0
        log.info("batched passes: exact up to %d rows", best)
        return best

    # ---- calibration -------------------------------------------------------------------------

    def _exact_width(self, context: list[int], probe: list[int], widths: int) -> int:
        """Widest ``w <= widths`` whose verify rows equal one-token decode logits bit for bit."""
        cache = self.make_cache()
        mx.eval(self.prefill(context, cache)[0])
        decoded = []
        for t in probe[:widths]:
            row = self.verify([t], cache)[0][0]
            mx.eval(row)
            decoded.append(row)
        self.trim(cache, widths)
        for w in range(2, widths + 1):
            rows = self.verify(probe[:w], cache)[0]
            mx.eval(rows)
            self.trim(cache, w)
            if not all(mx.array_equal(rows[i], decoded[i]).item() for i in range(w)):
                return w - 1
        return widths

    def _time_widths(self, context: list[int], probe: list[int], widths: list[int], repeats: int) -> list[float]:
        """Seconds of a pass of each of ``widths`` rows after ``context``: each width's fastest of
        ``repeats`` passes, taken in rounds over all widths after one warm-up round, so a burst of
        other work inflates at most one round (interference only ever adds time; consecutive
        repeats per width, medians, once made T(1) 4x too high and, with the smoothing of
        :meth:`_measure_cost`, the curve flat to 11 rows, and under a test suite's load T(3) =
        6 T(1), which kept drafts at one token)."""
        cache = self.make_cache()
        mx.eval(self.prefill(context, cache)[0])
        best = [float("inf")] * len(widths)
        for round_ in range(repeats + 1):  # round 0 warms every width up
            for i, w in enumerate(widths):
                start = time.perf_counter()
                mx.eval(self.verify(probe[:w], cache)[0])
                elapsed = time.perf_counter() - start
                self.trim(cache, w)
                if round_:
                    best[i] = min(best[i], elapsed)
        return best

    def _measure_cost(self, context: list[int], probe: list[int], widths: int, repeats: int) -> list[float]:
        """``T(k)`` for ``k = 1..widths`` (:meth:`_time_widths`), made non-decreasing."""
        costs = self._time_widths(context, probe, list(range(1, widths + 1)), repeats)
        # A wider pass never costs less than a narrower one for the scheduler's purposes.
        for i in range(1, len(costs)):
            costs[i] = max(costs[i], costs[i - 1])
        return costs

    def calibrate(
        self,
        vocab_size: int,
        max_rows: int = 16,
        mode: str = "auto",
        contexts: tuple[int, ...] = (48, 1100),
        max_context: int | None = None,
        repeats: int = 3,
    ) -> Calibration:
        """Probe exact verify width and measure ``T(k)``.

        Args:
            vocab_size: tokens are drawn from ``[0, vocab_size)``.
            max_rows: widest verify pass to consider (anchor + drafts).
            mode: ``row`` (and ``auto``): every pass wider than one row attends row by row;
                ``batched``: MLX's batched attention up to the widest width exact at ``contexts``,
                row by row beyond. ``auto`` is ``row`` because batched attention that is exact at
                the probed contexts was found inexact at others (2-3 rows on OpenBLAS at 8 of 64
                context lengths), and no affordable probe covers every length. ``kernel``: every
                decode and verify pass attends through ``metal_kernels.attention.row_attention``
                (one launch per layer, rows independent by construction; CUDA only, ``row``
                elsewhere).
            contexts: context lengths probed (long ones catch attention kernels that switch
                algorithm with the key length).
            max_context: the model's context window (probes are clipped to it).
        """
        self.row_kernel, launched = None, []
        if self.fused is not None:
            mode = "row"  # attention runs inside the fused pass
            # wider passes would leave the fused pass for mlx-lm's modules: never mix the two
            max_rows = min(max_rows, self.fused.max_rows)
        kernel_mode = mode == "kernel"
        if kernel_mode:
            from metal_kernels import attention

            if attention.backend() != "cuda" or self.compiled:
                log.warning("exact_verify=kernel: the row-attention kernel needs CUDA and eager passes; "
                            "using row")
            else:
                def counted(queries, keys, values, scale):
                    out = attention.row_attention(queries, keys, values, scale)
                    if out is not None and not launched:
                        launched.append(True)
                    return out
                self.row_kernel = counted
            mode = "row"
        rng = mx.random.key(1234)
        need = max(contexts) + max_rows
        if max_context:
            contexts = tuple(min(c, max_context - max_rows - 1) for c in contexts)
            need = min(need, max_context)
        ids = mx.random.randint(3, vocab_size, (need,), key=rng).tolist()

        def exact_width(row_exact: bool) -> int:
            self.row_exact_attention = row_exact
            self.batched_rows = 0 if row_exact else max_rows
            width = min(self._exact_width(ids[:c], ids[c : c + max_rows], max_rows) for c in contexts)
            log.info("verify exactness: row_exact=%s -> %d rows", row_exact, width)
            return width

        batched = exact_width(False) if mode == "batched" and max_rows > 1 else 1
        row = exact_width(True) if batched < max_rows and max_rows > 1 else 0
        # Passes up to `batched` rows use MLX's batched attention; wider ones (up to `row`) attend
        # row by row (the same call a one-row decode makes, so exact whatever the context).
        self.batched_rows = batched if mode == "batched" else 0
        self.row_exact_attention = row > batched
        width = max(batched, row)
        if self.row_kernel is not None:
            if not launched:  # every call fell back: same code as `row`, say so
                log.warning("exact_verify=kernel: the kernel does not take this model's attention "
                            "(head dim, dtype or layout); using row")
                self.row_kernel = None
            else:
                from metal_kernels import attention

                self.row_kernel = attention.row_attention
        if kernel_mode and max_rows > 1 and width <= 1:
            log.warning("exact_verify=kernel found no exact verify width (a model whose attention "
                        "takes an array mask verifies through MLX but decodes through the kernel); "
                        "try exact_verify=row")
        ctx = min(256, need - max_rows)
        costs = self._measure_cost(ids[:ctx], ids[ctx : ctx + width], width, repeats)
        slopes = (0.0, 0.0)
        long_ctx = max(contexts) if contexts else 0
        if width > 1 and long_ctx - ctx >= MIN_CONTEXT_SPAN:
            far = self._time_widths(ids[:long_ctx], ids[long_ctx : long_ctx + width], [1, width], repeats)
            slopes = context_slopes(long_ctx - ctx, width, (costs[0], costs[width - 1]), tuple(far))
        return Calibration(width, row > batched, costs, max_rows, batched_rows=self.batched_rows,
                           attention_kernel=self.row_kernel is not None and self.row_exact_attention,
                           fused_pass=self.fused is not None, context_slope=slopes[0],
                           context_row_slope=slopes[1], reference_context=ctx)


MIN_CONTEXT_SPAN = 512  # tokens between the two contexts a context slope is fitted from
NOISE = 0.03  # a time difference below this share of the shorter context's time counts as none


def context_slopes(span: int, width: int, near: tuple[float, float], far: tuple[float, float]) -> tuple[float, float]:
    """``(a, b)``, seconds per context token: what a pass's first row (``a``) and each further
    row (``b``) cost more per token of context, from ``T(1)`` and ``T(width)`` timed at two
    contexts ``span`` tokens apart (``near``, ``far``: ``(T(1), T(width))`` at each), so that
    ``T(k, n) = T(k) + (a + b (k - 1)) (n - n_ref)``. A difference within ``NOISE`` of the
    nearer time counts as none; both are floored at 0.

    The two differ by machine: on the 2-vCPU CPU a row attends on its own (row-exact attention
    inside the fused pass) and one row took 15.7 ms at 1,100 tokens against 10.5 at 256, so each
    row pays about ``a``; on the H200 the fused pass's rows attend in parallel, so the rows
    after the first add far less than the first."""
    def grown(t_near: float, t_far: float) -> float:
        return t_far - t_near if t_far - t_near > NOISE * t_near else 0.0

    a = grown(near[0], far[0]) / span
    total = grown(near[1], far[1]) / span
    b = max(0.0, total - a) / (width - 1) if width > 1 else 0.0
    return a, b


def cost_model(cal: Calibration) -> CostModel:
    return CostModel(list(cal.verify_cost), context_slope=cal.context_slope,
                     context_row_slope=cal.context_row_slope, reference_context=cal.reference_context)
