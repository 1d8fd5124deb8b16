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
  no rollback is needed when drafts are rejected. :class:`DraftStep` holds the (compiled)
  forward shared across requests; each drafter holds its own cache buffers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..base import Draft, DraftContext
from .model import DSparkModel, Embed, LMHead, block_inputs, draft_keys, sample_block

MIN_CAPACITY = 256  # context rows a new draft cache holds; it doubles when full
MAX_PADDED_ROWS = 16  # absorbs of up to this many rows run padded to a power of two (few shapes)


def _any_set(flags: mx.array) -> bool:
    """Whether any of an evaluated launch's per-block failure flags is set (reads them through
    numpy: no new MLX op or evaluation on the per-cycle path)."""
    return bool(np.count_nonzero(np.asarray(flags)))


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DraftStep:
    """The draft forward of one network with one target's embedding and LM head, shared by every
    request's :class:`DSparkDrafter` (weights and compiled graphs are per engine, not per request).

    A request's draft cache is one static buffer per draft layer, keys and values
    ``[1, KV, capacity, D]`` in the network's dtype, of which the first ``length`` rows are valid;
    the block attends to the whole buffer with the rows from ``length`` on masked out. Fixed
    shapes let ``mx.compile`` fuse the forward: the block forward, LM head, Markov loop and
    confidence head compile once per (draft length, greedy/sampled, capacity), the context
    update once per (padded row count <= 16, capacity). Larger updates (a prompt, or the rows
    that piled up while another drafter ran) run the same function uncompiled, unless the fused
    launch below takes them (up to its ``max_absorb``: 16, or 64 in chunks with the 8-row
    kernel; :attr:`steady_rows`).

    With a ``fused`` block pass (``metal_kernels.fused.DraftFusedPass`` on CUDA: the draft
    layers and the LM head in one kernel launch instead of ~70 MLX ops), the block forward runs
    there; a greedy draft (Markov loop and confidence head) too when the pass can (its
    ``markov``), else those stay MLX ops after it (compiled per draft length). The draft cache
    then keeps ``block_size`` spare rows past the context, which the launch writes (the block's
    own keys and values, never read by a later block).

    Args:
        compiled: ``False`` runs the same functions eagerly (tests compare the two).
        fused: the one-launch block forward, called as ``fused(x0 [B, d], keys, values, start)``
            and returning ``logits [B, V]`` (``[B, V']`` with a draft vocabulary), ``hidden
            [layers, B, d]`` and ``errors`` (``metal_kernels.fused.FusedOutput``), or with
            ``anchor`` ``[1]`` as a last argument (when ``fused.markov``) also the greedy
            ``tokens [B]`` (target ids) and ``confidence [B]``; None: MLX ops only.
        vocab: a :class:`drafters.dspark.vocab.DraftVocab` built for this network and target
            head: drafts come from its ``V'`` tokens (the LM head and Markov table restricted
            to them, FR-Spec); None: the whole vocabulary.
    """

    def __init__(self, network: DSparkModel, embed: Embed, lm_head: LMHead, compiled: bool = True,
                 fused=None, vocab=None):
        if fused is not None and getattr(fused, "vocab", None) is not vocab:
            raise ValueError("the fused launch and the draft step must use the same draft vocabulary (or none)")
        self.network, self.embed, self.lm_head = network, embed, lm_head
        self.vocab = vocab
        self.head = vocab.head if vocab is not None else lm_head  # final-normed states -> draft logits
        self.config = network.config
        self.compiled = compiled
        self.fused = fused
        self.fused_failures = 0  # fused launches that gave up at a grid barrier (then MLX ops ran)
        self._fns: dict[tuple, object] = {}
        self._traced: set[tuple] = set()  # (function key, input shapes) already compiled
        self.traced = False  # whether a call since the last take_traced() compiled a new graph

    def _fn(self, key: tuple, build, shapes: tuple):
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = mx.compile(build()) if self.compiled else build()
        if self.compiled and (key, shapes) not in self._traced:
            self._traced.add((key, shapes))
            self.traced = True
        return fn

    def warm(self) -> None:
        """Compile the greedy draft of every length ``1..block_size`` and the padded context
        updates at the first capacity (256 rows). Sampled drafts and larger caches still compile
        on first use, in that request's cycle; such forwards set ``traced`` and the engine keeps
        them out of its draft cost and probe budget."""
        keys, values = self.empty_cache(MIN_CAPACITY)
        features = self.config.num_taps * self.config.hidden_size
        padded = 1
        while padded <= MAX_PADDED_ROWS:
            rows = mx.zeros((padded, features), self.network.fc_dtype)
            keys, values = self.absorb(rows, 0, keys, values)
            padded *= 2
        length = MAX_PADDED_ROWS  # (any valid context length: the graphs do not depend on it)
        mx.eval(keys, values)
        # One evaluation per draft: independent fused launches in one graph could run side by
        # side, and a launch's grid barrier needs all of its blocks resident.
        for n in range(1, self.config.block_size + 1):
            mx.eval(*(a for a in self.draft(0, length, keys, values, n, 0.0, 0) if a is not None))
            if self.fused is not None:  # (the MLX graphs too: a failed launch falls back to them)
                mx.eval(*(a for a in self.draft(0, length, keys, values, n, 0.0, 0, fused=False) if a is not None))
        if self.fused is not None:  # every kernel variant once: with(out) the greedy draft, context rows
            x0 = block_inputs(self.embed, mx.array([0], dtype=mx.int32), self.config.mask_token_id,
                              self.config.block_size)[0, 0]
            one = mx.zeros((1, features), self.network.fc_dtype)
            for anchor in (None, mx.array([0], dtype=mx.int32)) if self.fused.markov else (None,):
                for rows in (None, one) if self.fused.absorbs else (None,):
                    launch = self.fused(x0, keys, values, length, anchor, rows)
                    mx.eval(launch.logits, launch.errors)
        self.take_traced()

    def take_traced(self) -> bool:
        """Whether a call since the last ``take_traced()`` compiled a new graph (its time is not
        the forward's cost); resets the flag."""
        traced, self.traced = self.traced, False
        return traced

    def empty_cache(self, capacity: int) -> tuple[list[mx.array], list[mx.array]]:
        cfg = self.config
        shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        dtype = self.network.fc_dtype
        layers = range(cfg.num_hidden_layers)
        return [mx.zeros(shape, dtype) for _ in layers], [mx.zeros(shape, dtype) for _ in layers]

    def absorb(self, rows: mx.array, start: int, keys: list[mx.array], values: list[mx.array]):
        """Write the projected context of ``rows`` ``[n, m*d]`` (positions ``start..start+n-1``)
        into the buffers; the caller guarantees ``start + bucket(n) <= capacity``. Returns the
        updated ``(keys, values)`` (lazy)."""
        n = int(rows.shape[0])
        padded = _bucket(n) if n <= MAX_PADDED_ROWS else n
        if padded != n:  # rows past the valid length are masked, then overwritten by later rows
            rows = mx.concatenate([rows, mx.zeros((padded - n, rows.shape[1]), rows.dtype)])
        network = self.network

        def build():
            def update(rows, start, keys, values):
                kv = network.context_kv(network.project_context(rows[None]), start)
                return ([mx.slice_update(buf, k, start, (2,)) for buf, (k, _) in zip(keys, kv)],
                        [mx.slice_update(buf, v, start, (2,)) for buf, (_, v) in zip(values, kv)])
            return update

        fn = (self._fn(("absorb",), build, (padded, keys[0].shape[2])) if padded <= MAX_PADDED_ROWS
              else build())
        return fn(rows, mx.array([start], dtype=mx.int32), keys, values)

    @property
    def spare_rows(self) -> int:
        """Rows a draft cache keeps free past its context for the fused pass's writes."""
        return self.config.block_size if self.fused is not None else 0

    @property
    def steady_rows(self) -> int:
        """The most new context rows a forward projects at its steady cost: in the fused launch
        (its ``max_absorb``, in chunks) or in one compiled padded update (``MAX_PADDED_ROWS``);
        more run as uncompiled MLX ops first (a catch-up)."""
        if self.fused is not None and self.fused.absorbs:
            return self.fused.max_absorb
        return MAX_PADDED_ROWS

    def absorbs_in_launch(self, rows: int) -> bool:
        """Whether the fused launch projects ``rows`` new context rows itself (``draft(rows=)``)."""
        return self.fused is not None and self.fused.absorbs and 1 <= rows <= self.steady_rows

    def draft(self, anchor: int, anchor_pos: int, keys: list[mx.array], values: list[mx.array],
              n: int, temperature: float, seed: int, fused: bool = True, rows: mx.array | None = None):
        """Draft ``n <= block_size`` tokens after ``anchor`` (position ``anchor_pos``, which is also
        the number of valid context rows). Returns ``(tokens [n] int32, draft_probs [n, V] float32
        or None, confidence [n] float32 or None)``, lazy, and ``errors`` (the fused launch's
        per-block failure flags, or None without one) to evaluate with them and pass to
        :meth:`failed`. ``fused=False`` keeps to MLX ops. ``rows``: ``[A, m*d]`` context rows of
        positions ``anchor_pos - A .. anchor_pos - 1`` not yet in the buffers, which the fused
        launch writes first (:meth:`absorbs_in_launch`; the buffers need room for them and
        ``block_size`` more rows).

        Raises:
            ValueError: ``rows`` the fused launch cannot take here.
        """
        cfg, network, embed, head, vocab = self.config, self.network, self.embed, self.head, self.vocab
        sampled = temperature > 0
        noise = (mx.array(temperature, dtype=mx.float32), 0, draft_keys(seed, anchor_pos, n)) if sampled else ()
        anchor_ids = mx.array([anchor], dtype=mx.int32)
        room = anchor_pos + cfg.block_size <= keys[0].shape[2]
        if rows is not None and not (fused and room and self.absorbs_in_launch(int(rows.shape[0]))):
            raise ValueError("context rows go into the fused launch only (absorb() them otherwise)")
        if fused and self.fused is not None and room:
            x0 = block_inputs(embed, anchor_ids, cfg.mask_token_id, cfg.block_size)[0, 0]
            if not sampled and self.fused.markov:  # the whole greedy draft in the launch
                launch = self.fused(x0, keys, values, anchor_pos, anchor_ids, rows)
                conf = launch.confidence[:n] if launch.confidence is not None else None
                return launch.tokens[:n], None, conf, launch.errors
            launch = self.fused(x0, keys, values, anchor_pos, None, rows)

            def build_tail():
                def tail(logits, hidden, anchor, *noise):
                    h = network.norm(hidden[:n])
                    tokens, probs, conf = sample_block(network, logits[:n], h, anchor, 0, *noise, vocab=vocab)
                    return tuple(a for a in (tokens, probs, conf) if a is not None)
                return tail

            fn = self._fn(("tail", n, sampled), build_tail, ())
            out = list(fn(launch.logits, launch.hidden[-1], anchor_ids, *noise))
            errors = launch.errors
        else:
            def build():
                def step(anchor, pos, keys, values, *noise):
                    x = block_inputs(embed, anchor, cfg.mask_token_id, cfg.block_size)
                    visible = (mx.arange(keys[0].shape[2]) < pos)[None, None]
                    h = network(x, pos.reshape(1, 1), list(zip(keys, values)), visible, fast=True)[0, 0, :n]
                    base = head(h).astype(mx.float32)
                    tokens, probs, conf = sample_block(network, base, h, anchor, 0, *noise, vocab=vocab)
                    return tuple(a for a in (tokens, probs, conf) if a is not None)
                return step

            fn = self._fn(("draft", n, sampled), build, (keys[0].shape[2],))
            out = list(fn(anchor_ids, mx.array([anchor_pos], dtype=mx.int32), keys, values, *noise))
            errors = None
        tokens = out.pop(0)
        probs = out.pop(0) if sampled else None
        conf = out.pop(0) if out else None
        return tokens, probs, conf, errors

    def fused_error(self, context: int) -> float:
        """How far the fused launch is from the MLX ops over a draft cache of ``context >= 4``
        random context rows (a start-up probe): the largest logit difference relative to the
        largest MLX logit, for the block forward alone and with the last 3 context rows written
        by the launch itself (and the last ``2 max_rows + 3``, in chunks, where it takes that
        many); with the greedy draft in the launch (``markov``), how far its tokens fall below the MLX ops' best choices after the same previous tokens (relative
        to the same scale: a near tie is not a fault) and the largest absolute confidence
        difference (:meth:`_greedy_draft_errors`); infinity if any of these is NaN.
        Float32 sums in another order differ by ~1e-6; against MLX-CUDA, whose float32 matmuls
        run in TF32 (ml-explore/mlx#3860), by 1e-4 to 1.5e-3 (a 7-layer drafter); a broken
        launch by ~1.

        Raises:
            ValueError: no fused pass, or ``context < 4``. RuntimeError: a launch gave up at a
                grid barrier.
        """
        if self.fused is None or context < 4:
            raise ValueError("the probe needs a fused block pass and at least 4 context rows")
        cfg, network, fused = self.config, self.network, self.fused
        rows = mx.random.normal((context, cfg.num_taps * cfg.hidden_size), key=mx.random.key(7))
        rows = rows.astype(network.fc_dtype)
        capacity = max(MIN_CAPACITY, _bucket(context + cfg.block_size))

        def cache(n):
            keys, values = self.empty_cache(capacity)
            keys, values = self.absorb(rows[:n], 0, keys, values)
            mx.eval(keys, values)
            return keys, values

        anchor = mx.array([1], dtype=mx.int32)
        x0 = block_inputs(self.embed, anchor, cfg.mask_token_id, cfg.block_size)
        keys, values = cache(context)
        visible = (mx.arange(capacity) < context)[None, None]
        h = network(x0, mx.array([[context]], dtype=mx.int32), list(zip(keys, values)), visible, fast=True)[0, 0]
        want = self.head(h).astype(mx.float32)
        mx.eval(want, h)
        scale = mx.abs(want).max()

        def launch(greedy: bool, new: int):
            keys, values = cache(context - new)  # (fresh buffers: the launch writes into them)
            out = fused(x0[0, 0], keys, values, context, anchor if greedy else None,
                        rows[context - new:] if new else None)
            mx.eval(*(a for a in (out.logits, out.tokens, out.confidence, out.errors) if a is not None))
            if _any_set(out.errors):
                raise RuntimeError("the fused draft pass gave up at a grid barrier")
            return out

        errors = []
        # context rows written by the launch: none, a steady cycle's 3, and (where the launch
        # projects more rows than its block's, in chunks) two chunks and a part
        chunk = fused.max_rows
        chunked = (2 * chunk + 3,) if self.steady_rows >= 2 * chunk + 3 and context > 2 * chunk + 3 else ()
        for new in (0, 3, *chunked) if fused.absorbs else (0,):
            errors.append((mx.abs(launch(False, new).logits - want).max() / scale).item())
            if fused.markov:
                errors += self._greedy_draft_errors(launch(True, new), want, h, anchor, scale)
        return max(e if e == e else float("inf") for e in errors)  # (NaN: a broken launch)

    def _greedy_draft_errors(self, out, logits: mx.array, h: mx.array, anchor: mx.array, scale: mx.array) -> list:
        """A greedy launch's draft against the MLX ops fed the launch's own tokens (each slot's
        Markov bias and confidence follow the launch's token before it; the base ``logits``
        ``[L, V]`` (``[L, V']`` over a draft vocabulary, whose tokens the launch maps to target
        ids) and states ``h`` ``[L, d]`` do not depend on the draft): over all slots, how
        far the launch's token falls below the best Markov-corrected logit, relative to
        ``scale`` (0 where it is the best; a near tie that the MLX ops' TF32 rounding on
        MLX-CUDA breaks the other way costs its small gap, a wrong token ~1), and the largest
        confidence difference (confidences lie in [0, 1]: no scale). Infinity for tokens of
        another shape or outside the vocabulary, or a confidence missing or of another shape."""
        slots, width = logits.shape
        tokens = out.tokens.reshape(-1).astype(mx.int32)
        index = self.vocab.draft_index() if self.vocab is not None else np.arange(width)
        if tokens.shape[0] != slots or not all(0 <= t < index.size and index[t] >= 0 for t in tokens.tolist()):
            return [float("inf")]
        prevs = mx.concatenate([anchor, tokens[:-1]])
        bias = self.network.markov_bias(prevs, self.vocab.markov_w2 if self.vocab is not None else None)
        corrected = logits if bias is None else logits + bias.astype(mx.float32)
        picked = mx.take_along_axis(corrected, mx.array(index[np.array(tokens)])[:, None].astype(mx.int32),
                                    axis=-1)[:, 0]
        errors = [((corrected.max(axis=-1) - picked).max() / scale).item()]
        conf = self.network.confidence_logits(h, prevs)
        if conf is not None:
            if out.confidence is None or out.confidence.size != slots:
                return [float("inf")]
            want_conf = mx.sigmoid(conf.astype(mx.float32))
            errors.append(mx.abs(out.confidence.reshape(-1).astype(mx.float32) - want_conf).max().item())
        return errors

    def failed(self, errors: mx.array | None) -> bool:
        """Whether an evaluated fused launch gave up at a grid barrier (its drafts are garbage;
        the caller drafts again with ``fused=False``)."""
        if errors is None or not _any_set(errors):
            return False
        self.fused_failures += 1
        return True


class DSparkDrafter:
    """Block drafter conditioned on the target's hidden states.

    Args:
        network: the shared draft network.
        embed: target embedding, token ids ``[...]`` -> ``[..., d]``.
        lm_head: target LM head, ``[..., d]`` -> logits ``[..., V]``.
        step: the shared :class:`DraftStep` (the engine passes one per engine so compiled graphs
            are reused across requests); built from the three above when None.
    """

    name = "dspark"

    def __init__(self, network: DSparkModel, embed: Embed, lm_head: LMHead, step: DraftStep | None = None):
        self.network = network
        self.config = network.config
        self.step = step or DraftStep(network, embed, lm_head)
        self.traced = False  # the last propose() compiled a new graph (its time is not a forward's)
        self.reset()

    @property
    def context_length(self) -> int:
        """Positions whose context rows the drafter holds (cached + pending)."""
        return self._length + sum(int(h.shape[0]) for h in self._pending)

    @property
    def projected_length(self) -> int:
        """Positions whose context rows are already projected into the draft cache: a
        :meth:`propose` with the anchor at position ``p`` projects ``p - projected_length`` new
        rows first (inside the fused launch for up to ``DraftStep.steady_rows``, else as MLX ops)."""
        return self._length

    def reset(self) -> None:
        self._keys: list[mx.array] = []
        self._values: list[mx.array] = []
        self._length = 0
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

    def _update_context(self, absorb: bool = True) -> mx.array | None:
        """Project pending rows into the draft cache, growing it (doubling) when they don't fit;
        ``absorb=False`` only makes room and returns the pending rows (``[A, m*d]``) for the
        fused launch to project (the caller counts them once written), else None."""
        pending = sum(int(h.shape[0]) for h in self._pending)
        # room for the rows as the MLX update writes them (padded; also the fallback after a
        # failed launch) and for the rows plus the launch's spare rows
        padded = _bucket(pending) if 0 < pending <= MAX_PADDED_ROWS else pending
        need = self._length + max(padded, pending + self.step.spare_rows)
        capacity = self._keys[0].shape[2] if self._keys else 0
        if need > capacity or not self._keys:
            new = max(MIN_CAPACITY, capacity)
            while new < need:
                new *= 2
            keys, values = self.step.empty_cache(new)
            if self._length:
                keys = [mx.slice_update(b, k[:, :, : self._length], mx.array([0]), (2,))
                        for b, k in zip(keys, self._keys)]
                values = [mx.slice_update(b, v[:, :, : self._length], mx.array([0]), (2,))
                          for b, v in zip(values, self._values)]
            self._keys, self._values = keys, values
        if not pending:
            return None
        rows = mx.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        if not absorb:
            return rows
        self._keys, self._values = self.step.absorb(rows, self._length, self._keys, self._values)
        self._length += pending
        return None

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
        self.traced = False
        if n <= 0:
            return Draft()
        self.step.take_traced()
        pending = anchor_pos - self._length
        rows = self._update_context(absorb=not self.step.absorbs_in_launch(pending))
        temperature = float(getattr(ctx, "temperature", 0.0) or 0.0)
        args = (int(ctx.tokens[-1]), anchor_pos, self._keys, self._values, n, temperature,
                int(getattr(ctx, "seed", 0) or 0))
        tokens, probs, conf, errors = self.step.draft(*args, rows=rows)
        mx.eval(*(a for a in (tokens, probs, conf, errors, *self._keys, *self._values) if a is not None))
        if self.step.failed(errors):  # the MLX ops again, context rows included
            if rows is not None:
                self._keys, self._values = self.step.absorb(rows, anchor_pos - int(rows.shape[0]),
                                                            self._keys, self._values)
            args = (*args[:2], self._keys, self._values, *args[4:])
            tokens, probs, conf, _ = self.step.draft(*args, fused=False)
            mx.eval(*(a for a in (tokens, probs, conf, *self._keys, *self._values) if a is not None))
        self._length = anchor_pos  # (rows given to the launch are in the cache now)
        self.traced = self.step.take_traced()
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
