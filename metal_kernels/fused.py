"""One-launch decode and verify passes for small Llama-family targets (CUDA).

A small target's decode step is bound by kernel launches and host work, not by its weights:
on an H200 the default model (30 layers, 135M parameters) spends ~6 ms per step in ~20 MLX
ops per layer while reading its 4-bit weights takes ~0.02 ms. :class:`FusedPass` runs a
whole decode or verify pass (every decoder layer and the LM head, for 1..16 rows) as one
``mx.fast.cuda_kernel`` launch: one block per multiprocessor, phases separated by a grid-wide
barrier (``sources/fused_body.cu``). Each row's arithmetic depends on that row alone, so row
``i`` of a ``k``-row verify pass is bit-identical to the one-row decode step at its position,
for every ``k`` up to :data:`MAX_ROWS`.

What is supported (:func:`unsupported_reason` says why not otherwise): mlx-lm's ``llama``
architecture with full attention, no projection biases, non-traditional RoPE without scaling,
head dim 64 or 128, affine-quantized projections (4 or 8 bits, one bit width for all of them,
power-of-two group sizes), a quantized LM head (tied embedding or ``lm_head``), float32
activations, and a hidden size small enough that 16 normalized rows fit in shared memory
(<= 640). Prefill stays on mlx-lm's modules; decode/verify passes read the KV cache those
write and append their own keys and values into the cache's buffers in place (no extra ops):
the launcher first gives each layer a buffer of its own with room for the rows.

The algorithm is a persistent "megakernel" as in Spector et al. 2025, "Look Ma, No Bubbles!
Designing a Low-Latency Megakernel for Llama-1B" (Hazy Research), here without their
instruction interpreter: a fixed phase order with grid barriers.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_kernels.qmv import _minify, backend

log = logging.getLogger("specserve.fused")

MAX_ROWS = 16
# DraftFusedPass(rows=8), the default since the fifty-first session: a DSpark block of at most
# this many rows runs in a kernel built for it: 8 rows' accumulators leave room for 16 warps
# (104-110 registers per thread, NVRTC 12.x/13 for sm_90) where 16 rows' need 136-150 and fit
# only 8 warps with the context update; and the launch projects up to MAX_ABSORB_ROWS new context
# rows itself, in chunks of 8 (else MLX ops first). On an H100 (default model, v12 drafter, its
# draft vocabulary): steady forward 1.14 ms against the 16-row kernel's 1.32, a request's first
# forward over a prompt of 17-64 tokens 1.48 ms against 2.53 (docs/kernels.md). rows=16 keeps the
# 16-row kernel (8 warps, at most 16 context rows in the launch), which larger blocks always get.
DRAFT_ROWS = 8
DEFAULT_DRAFT_KERNEL_ROWS = 8
MAX_ABSORB_ROWS = 64
WARPS = (16, 8)  # warps per block, in order of preference (16 measured faster on the H200)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BITS = (4, 8)
_SHARED_BYTES = 40 * 1024  # the normalized rows kept in shared memory, per block
_SOURCES = Path(__file__).parent / "sources"


class FusedPassError(RuntimeError):
    """A fused pass did not complete (a grid barrier timed out); its outputs are garbage."""


def _float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


@functools.cache
def multiprocessors() -> int:
    """Streaming multiprocessors of CUDA device 0 (MLX's default GPU; the driver API), or 16 if
    it cannot be asked."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        dev, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), 0):
            return 16
        if lib.cuDeviceGetAttribute(ctypes.byref(value), 16, dev):  # MULTIPROCESSOR_COUNT
            return 16
        return max(1, value.value)
    except OSError:
        return 16


def linears(layer) -> dict[str, nn.Module]:
    a, m = layer.self_attn, layer.mlp
    return {"q_proj": a.q_proj, "k_proj": a.k_proj, "v_proj": a.v_proj, "o_proj": a.o_proj,
            "gate_proj": m.gate_proj, "up_proj": m.up_proj, "down_proj": m.down_proj}


def head_module(model) -> nn.Module:
    """The module whose quantized weight is the LM head: the tied embedding or ``lm_head``."""
    inner = model.model
    if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return inner.embed_tokens
    return model.lm_head


def architecture_reason(model) -> str:
    """Empty when ``model`` has the architecture the one-call passes implement (CUDA and CPU):
    mlx-lm's ``llama`` with full attention, no projection biases, grouped heads, and plain
    non-traditional RoPE over the full head dim; else why not."""
    if type(model).__module__ != "mlx_lm.models.llama":
        return f"architecture {type(model).__module__} (only mlx_lm.models.llama)"
    args = model.args
    inner = model.model
    if getattr(inner, "swa_idx", None) is not None or getattr(args, "sliding_window", None):
        return "sliding-window attention"
    if args.attention_bias or args.mlp_bias:
        return "projection biases"
    heads, kv = args.num_attention_heads, args.num_key_value_heads
    hd = args.head_dim or args.hidden_size // heads
    if heads % kv:
        return f"heads {heads}:{kv}"
    for layer in inner.layers:
        rope = layer.self_attn.rope
        if type(rope) is not nn.RoPE or rope.traditional or rope.dims != hd:
            return f"RoPE {type(rope).__name__} (only nn.RoPE, non-traditional, full head dim)"
    return ""


def _shape_reason(hidden: int, intermediate: int, head_dim: int) -> str:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head dim {head_dim} (the CUDA pass takes {SUPPORTED_HEAD_DIMS})"
    if hidden % 8 or intermediate % 8 or not 256 <= hidden <= _SHARED_BYTES // (4 * MAX_ROWS):
        # (>= 256: a column tile of o_proj/down_proj inputs then holds 32 packed words per row)
        return (f"hidden size {hidden} / intermediate {intermediate} "
                f"(hidden 256..{_SHARED_BYTES // (4 * MAX_ROWS)}, multiples of 8)")
    return ""


def _layers_reason(layers) -> str:
    """Empty when every layer's projections are affine-quantized without biases, of one bit
    width the pass takes, with power-of-two groups and float32 scales/biases, and its norms
    float32; else why not."""
    bits = set()
    for layer in layers:
        for name, lin in linears(layer).items():
            if not isinstance(lin, nn.QuantizedLinear) or getattr(lin, "mode", "affine") != "affine":
                return f"{name} is {type(lin).__name__} (needs affine-quantized weights)"
            if "bias" in lin:
                return f"{name} has a bias"
            gs = lin.group_size
            if gs & (gs - 1) or gs < 32 // lin.bits:
                return f"{name} group size {gs}"
            if lin.scales.dtype != mx.float32 or lin.biases.dtype != mx.float32:
                return f"{name} scales/biases {lin.scales.dtype} (float32 only)"
            bits.add(lin.bits)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != mx.float32:
                return f"activations {norm.weight.dtype} (float32 only)"
    if len(bits) != 1 or not bits <= set(SUPPORTED_BITS):
        return f"projection bits {sorted(bits)} (one of {SUPPORTED_BITS} for all)"
    return ""


def _head_reason(head) -> str:
    """Empty when ``head`` (a tied embedding or ``lm_head``) is a quantized LM head the pass takes."""
    if not isinstance(head, (nn.QuantizedEmbedding, nn.QuantizedLinear)) or head.bits not in SUPPORTED_BITS:
        return f"LM head {type(head).__name__} (needs a 4/8-bit quantized head)"
    if getattr(head, "mode", "affine") != "affine" or "bias" in head:
        return "LM head mode or bias"
    hgs = head.group_size
    if hgs & (hgs - 1) or hgs < 32 // head.bits or head.biases.dtype != mx.float32:
        return f"LM head group size {hgs} or biases dtype {head.biases.dtype}"
    if head.scales.dtype != mx.float32:
        return "LM head scales not float32 (float32 activations only)"
    return ""


def structure_reason(model) -> str:
    """Empty when :class:`FusedPass` can run ``model`` (backend aside), else why not."""
    reason = architecture_reason(model)
    if reason:
        return reason
    args = model.args
    inner = model.model
    hd = args.head_dim or args.hidden_size // args.num_attention_heads
    reason = (_shape_reason(args.hidden_size, args.intermediate_size, hd) or _layers_reason(inner.layers)
              or _head_reason(head_module(model)))
    if reason:
        return reason
    if inner.embed_tokens.weight.dtype != mx.uint32 or getattr(inner.embed_tokens, "scales", None) is None:
        return "embedding not quantized"
    if inner.embed_tokens.scales.dtype != mx.float32:
        return "embedding scales not float32 (float32 activations only)"
    return ""


def draft_unsupported_reason(network, target) -> str:
    """Empty when :class:`DraftFusedPass` runs the DSpark ``network``'s block forward with
    ``target``'s LM head on this machine, else why not. ``network`` is a
    ``drafters.dspark.DSparkModel`` (Qwen3-style layers with q/k norms, no biases, plain
    non-traditional RoPE); ``target`` the mlx-lm model whose embedding and LM head it shares."""
    if backend() != "cuda":
        return f"backend {backend()} (the fused pass is CUDA only)"
    cfg = network.config
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        return f"heads {cfg.num_attention_heads}:{cfg.num_key_value_heads}"
    if getattr(cfg, "attention_bias", False):
        return "projection biases"
    for layer in network.layers:
        rope = layer.self_attn.rope
        if type(rope) is not nn.RoPE or rope.traditional or rope.dims != cfg.head_dim:
            return f"RoPE {type(rope).__name__} (only nn.RoPE, non-traditional, full head dim)"
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            if norm.weight.dtype != mx.float32:
                return f"q/k norms {norm.weight.dtype} (float32 only)"
    if network.norm.weight.dtype != mx.float32:
        return f"activations {network.norm.weight.dtype} (float32 only)"
    return (_shape_reason(cfg.hidden_size, cfg.intermediate_size, cfg.head_dim) or _layers_reason(network.layers)
            or _head_reason(head_module(target)))


def unsupported_reason(model) -> str:
    """Empty when :class:`FusedPass` runs ``model`` on this machine, else why not."""
    if backend() != "cuda":
        return f"backend {backend()} (the fused pass is CUDA only)"
    return structure_reason(model)


def cache_layout_ok(cache: list) -> bool:
    """Whether a one-call pass can append to ``cache``: mlx-lm ``KVCache`` layers (or the
    engine's ``ExactKVCache``), already holding a prefill, float32, every layer of one buffer
    shape and length. The buffers may be views (a prefix-cache hit restores slices of stored
    arrays): :func:`writable_cache` copies them into buffers of the cache's own first."""
    first = cache[0]
    keys = getattr(first, "keys", None)
    if keys is None or keys.dtype != mx.float32 or first.offset < 1 or type(first).__name__ not in (
            "KVCache", "ExactKVCache"):
        return False
    shape = keys.shape
    return all(type(c) is type(first) and c.keys is not None and c.keys.shape == shape
               and c.values.shape == shape and c.offset == first.offset for c in cache)


def writable_cache(cache: list, rows: int, kv_heads: int, head_dim: int) -> None:
    """Give every layer of ``cache`` buffers a pass may write in place: allocated here (so no
    other array shares them: a prefix-cache hit leaves views of stored arrays), contiguous, all
    layers of one shape (a pass reads layer 0's strides for every layer), with room for
    ``rows`` more positions (grown in mlx-lm's steps of ``KVCache.step``). One decision for
    the whole cache: either every layer keeps the buffers this function gave it, or every
    layer gets new ones (a zeros and a slice_update each for keys and values: once per
    sequence and per step of growth). :func:`cache_layout_ok` has already refused caches
    whose layers differ in shape or length, so only identity is checked here."""
    n = cache[0].offset
    if n + rows <= cache[0].keys.shape[2] and all(
            c.__dict__.get("_fused_buffers", (None, None))[0] is c.keys
            and c.__dict__["_fused_buffers"][1] is c.values for c in cache):
        return
    capacity = -(-(n + rows) // cache[0].step) * cache[0].step
    shape = (1, kv_heads, capacity, head_dim)
    for c in cache:
        keys, values = mx.zeros(shape, mx.float32), mx.zeros(shape, mx.float32)
        keys[..., :n, :] = c.keys[..., :n, :]
        values[..., :n, :] = c.values[..., :n, :]
        c.keys, c.values = keys, values
        c._fused_buffers = (keys, values)


def _no_draft_inputs() -> dict[str, mx.array]:
    u32, f32 = mx.zeros((1,), mx.uint32), mx.zeros((1,), mx.float32)
    return {"tok0": mx.zeros((1,), mx.int32), "mw1": u32, "ms1": f32, "mb1": f32, "mw2": u32, "ms2": f32,
            "mb2": f32, "cw": f32, "cb": f32, "crow": f32, "wfc": u32, "sfc": f32, "bfc": f32, "hnw": f32,
            "dvoc": mx.zeros((1,), mx.int32)}


@dataclass
class FusedOutput:
    """One fused pass (evaluated by :meth:`FusedPass.__call__`).

    ``logits``: ``[M, V]`` float32; ``hidden``: ``[L, M, d]`` float32, decoder layer ``l``'s
    output (what mlx-lm's layer ``l`` returns); ``embeddings``: ``[M, d]``, the pass's input;
    ``errors``: ``[blocks]`` int32, nonzero where a block gave up at a grid barrier;
    ``profile``: with ``profile=True``, ``[blocks, 5 L + 2, 2]`` uint32 SM cycles per block and
    barrier slot (layer ``l``'s phase ``p`` at ``5 l + p``, the LM head at ``5 L``, a greedy
    draft's Markov phase at ``5 L + 1``): ``[.., 0]`` the block's work since the previous
    barrier, ``[.., 1]`` its wait at this one (0 after the last phase); else None.
    ``tokens`` / ``confidence``: a :class:`DraftFusedPass`'s greedy drafts ``[M]`` int32 and
    their confidence ``[M]`` float32 (None without a confidence head), else None.
    """

    logits: mx.array
    hidden: mx.array
    embeddings: mx.array
    errors: mx.array
    profile: mx.array | None = None
    tokens: mx.array | None = None
    confidence: mx.array | None = None


class FusedPass:
    """Decode/verify passes of ``model`` in one kernel launch each.

    Args:
        model: an mlx-lm Llama model that :func:`unsupported_reason` accepts.
        blocks: blocks in the launch (at most one per multiprocessor, so all are resident for
            the grid barrier); default: the device's multiprocessor count.
        warps: warps per block (8 or 16); default: 16 where its shared memory fits, else 8
            (on the H200, 16 was 6% faster for 1 and 4 rows, equal for 16).
        skip: phases to leave out (bit mask, see ``sources/fused_body.cu``), for profiling
            only: the outputs are then meaningless.
        profile: record per-phase cycle counts (:attr:`FusedOutput.profile`); profiling only.

    Raises:
        ValueError: the model or backend is not supported (the message says why).
    """

    def __init__(self, model: nn.Module, blocks: int | None = None, warps: int | None = None, skip: int = 0,
                 profile: bool = False):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"fused pass unsupported: {reason}")
        self.model = model
        args, inner = model.args, model.model
        self._build(inner.layers, head_module(model), inner.norm.weight, args.num_attention_heads,
                    args.num_key_value_heads, args.head_dim or args.hidden_size // args.num_attention_heads,
                    args.hidden_size, args.intermediate_size, blocks, warps, skip, profile)

    def _build(self, layers, head, final_norm, heads, kv_heads, head_dim, hidden, intermediate, blocks, warps,
               skip, profile, qk_norm: bool = False, bidirectional: bool = False) -> None:
        """Stack the layers' weights for the kernel and choose its launch shape."""
        self.layers = len(layers)
        self.hidden_size = hidden
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = head_dim
        self.intermediate = intermediate
        self.qk_norm, self.bidirectional = qk_norm, bidirectional
        # a greedy DSpark draft after the LM head (DraftFusedPass sets these and _draft_inputs)
        self.markov, self.markov_rank, self.markov_bits, self.confidence = False, 0, 4, 0
        # the DraftVocab whose rows the LM head (and W2) cover, a greedy draft's rows mapped to
        # target ids by dvoc (DV; DraftFusedPass), else None: the whole vocabulary
        self.vocab = None
        self.absorbs, self.taps = False, 1  # (a context update in the launch: DraftFusedPass)
        self._draft_inputs = _no_draft_inputs()
        self.blocks = min(blocks or multiprocessors(), multiprocessors())
        if warps is None:
            warps = next((w for w in WARPS if self._shared_bytes(w) <= 48 * 1024 and self._registers_fit(w)),
                         WARPS[-1])
        if warps not in WARPS:
            raise ValueError(f"warps must be 8 or 16, got {warps}")
        shared = self._shared_bytes(warps)
        if shared > 48 * 1024:
            raise ValueError(f"{warps} warps need more static shared memory than a block has (48 KiB), "
                             "or attention's per-warp scratch does not fit the row buffer")
        if not self._registers_fit(warps):
            raise ValueError(f"{warps} warps with head dim {self.head_dim}: the kernel needs more than "
                             f"{65536 // (32 * warps)} registers per thread")
        self.warps, self.skip, self.profile = warps, skip, profile
        self.segment = 32 * warps  # keys per attention work unit (sources/fused_body.cu, phase B)
        lins = [linears(layer) for layer in layers]

        def stack(names, part):
            return mx.stack([mx.concatenate([getattr(li[n], part) for n in names], axis=0) for li in lins])

        w = {}
        for key, names in (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)),
                           ("gu", ("gate_proj", "up_proj")), ("d", ("down_proj",))):
            w["w" + key], w["s" + key], w["b" + key] = (stack(names, p) for p in ("weight", "scales", "biases"))
        self.bits = lins[0]["q_proj"].bits
        self.head_bits = head.bits
        w["we"], w["se"], w["bee"] = head.weight, head.scales, head.biases
        w["norms"] = mx.stack([mx.stack([layer.input_layernorm.weight, layer.post_attention_layernorm.weight])
                               for layer in layers])
        w["fnorm"] = final_norm
        w["qkn"] = (mx.stack([mx.stack([layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight])
                              for layer in layers]) if qk_norm else mx.zeros((1,), mx.float32))
        rope = layers[0].self_attn.rope
        half = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        w["inv_freq"] = mx.array((rope.scale * rope.base ** -half).astype(np.float32))
        self.eps = layers[0].input_layernorm.eps
        self.scale = layers[0].self_attn.scale
        self.weights = {k: mx.contiguous(v) for k, v in w.items()}  # the kernel indexes them densely
        mx.eval(list(self.weights.values()))
        self._zero = mx.zeros((1,), dtype=mx.uint8)
        self.passes = 0

    max_rows = MAX_ROWS  # widest pass (rows) it runs

    def _registers_fit(self, warps: int) -> bool:
        """Whether a block of ``warps`` warps fits the 64K-register file: the head-dim-128 kernel
        takes ~139 registers per thread (NVRTC, sm_90), over 16 warps' 128; head dim 64 ~112."""
        return warps == 8 or self.head_dim == 64

    def _shared_bytes(self, warps: int) -> int:
        """Static shared memory of a block (fused_body.cu: xs, qs, wm, wl), or more than any
        block has when attention's scratch does not fit xs (its new keys, then each warp's
        values for the query heads of one KV head)."""
        group = self.heads // self.kv_heads
        rows = self.max_rows
        if rows * self.head_dim + warps * group * self.head_dim > rows * self.hidden_size:
            return 1 << 30
        return 4 * (rows * self.hidden_size + group * self.head_dim + 2 * warps * group)

    # per-launch draft inputs: the anchor, the Markov tables, the confidence head (dummies unless
    # a DraftFusedPass drafts greedily in the launch)
    _DRAFT_NAMES = ("tok0", "mw1", "ms1", "mb1", "mw2", "ms2", "mb2", "cw", "cb", "crow", "wfc", "sfc", "bfc", "hnw",
                    "dvoc")
    _WEIGHT_NAMES = ("inv_freq", "norms", "fnorm", "qkn", "wqkv", "sqkv", "bqkv", "wo", "so", "bo",
                     "wgu", "sgu", "bgu", "wd", "sd", "bd", "we", "se", "bee")

    def kernel_source(self) -> tuple[str, str, list[str], list[str]]:
        """``(header, body, input_names, output_names)`` exactly as handed to
        ``mx.fast.cuda_kernel`` (the body starts with this model's per-layer cache tables)."""
        n = self.layers
        tables = (f"const float* KC[NL] = {{{', '.join(f'kc{i}' for i in range(n))}}};\n"
                  f"const float* VC[NL] = {{{', '.join(f'vc{i}' for i in range(n))}}};\n")
        header = _minify((_SOURCES / "fused_cuda.cuh").read_text())
        body = tables + _minify((_SOURCES / "fused_body.cu").read_text())
        inputs = ["x0", "pos", "pseg", *self._WEIGHT_NAMES, *self._DRAFT_NAMES, *(f"kc{i}" for i in range(n)), *(f"vc{i}" for i in range(n)), "bar"]
        return header, body, inputs, ["logits", "hidden", "qkv", "att", "hmid", "act", "part", "prof", "err",
                                      "dtok", "dconf", "cand", "cfc", "ckv"]

    def template(self, markov: bool = False, absorb: bool = False) -> list[tuple[str, object]]:
        """The kernel's template arguments (type ``ST`` and integer constants); ``markov``: a
        launch that drafts greedily (:class:`DraftFusedPass` given the anchor); ``absorb``: one
        that first writes new context rows into the draft cache (given ``rows``)."""
        return [("ST", self.weights["sqkv"].dtype), ("NL", self.layers), ("DM", self.hidden_size),
                ("NH", self.heads), ("NKV", self.kv_heads), ("HD", self.head_dim), ("DI", self.intermediate),
                ("MB", self.max_rows), ("W", self.warps), ("BITS", self.bits), ("HBITS", self.head_bits),
                ("EPS_BITS", _float_bits(self.eps)), ("SCALE_BITS", _float_bits(self.scale)), ("SKIP", self.skip),
                ("PROF", int(self.profile)), ("QKN", int(self.qk_norm)), ("BIDIR", int(self.bidirectional)),
                ("MARKOV", int(markov)), ("MR", self.markov_rank), ("MBITS", self.markov_bits),
                ("CONF", self.confidence), ("ABS", int(absorb)), ("NT", self.taps), ("DV", int(self.vocab is not None))]

    @functools.cached_property
    def _kernel(self):
        """The launcher: ``mx.fast.cuda_kernel`` objects per template (the target's pass and a
        drafter's, greedy or not, differ only there; the template is part of the name)."""
        header, body, inputs, outputs = self.kernel_source()
        kernels = {}

        def launch(*, template, **kw):
            key = repr(template)
            if key not in kernels:
                digest = hashlib.sha1((header + body + key).encode()).hexdigest()[:10]
                kernels[key] = mx.fast.cuda_kernel(name=f"specserve_fused_pass_{digest}", input_names=inputs,
                                                   output_names=outputs, source=body, header=header,
                                                   ensure_row_contiguous=False)
            return kernels[key](template=template, **kw)

        return launch

    def supports_cache(self, cache: list, rows: int) -> bool:
        """Whether a pass of ``rows`` rows can append to ``cache`` (:func:`cache_layout_ok`)."""
        return 1 <= rows <= MAX_ROWS and len(cache) == self.layers and cache_layout_ok(cache)

    def __call__(self, tokens: list[int], cache: list) -> FusedOutput:
        """Run ``tokens`` (one decode token, or the anchor plus drafts) through the target at
        the cache's current length, appending their keys and values to ``cache``.

        The pass is evaluated before this returns: the kernel writes the cache buffers, which
        are its inputs, so MLX sees no dependency of later readers of the cache on it (nor of
        the next pass); evaluating here orders every later use after the writes.

        Args:
            tokens: 1..16 token ids.
            cache: the sequence's per-layer mlx-lm ``KVCache`` list (see :meth:`supports_cache`).

        Returns:
            :class:`FusedOutput`, evaluated; the cache's offsets count the new rows. Call
            :meth:`check` before using it.

        Raises:
            ValueError: more than 16 or no tokens, or a cache :meth:`supports_cache` rejects.
        """
        m = len(tokens)
        if not self.supports_cache(cache, m):
            raise ValueError(f"fused pass takes 1..{MAX_ROWS} rows over a prefilled float32 KVCache list "
                             f"of {self.layers} layers with equal shapes; got {m} rows")
        writable_cache(cache, m, self.kv_heads, self.head_dim)
        x0 = self.model.model.embed_tokens(mx.array(tokens, dtype=mx.uint32))
        out = self._launch(x0, cache[0].offset, [c.keys for c in cache], [c.values for c in cache])
        mx.eval(out.logits, out.errors)  # (the hidden states and the profile are outputs of the same launch)
        for c in cache:
            c.offset += m
        self.passes += 1
        return out

    def _launch(self, x0: mx.array, start: int, keys: list[mx.array], values: list[mx.array],
                anchor: mx.array | None = None, rows: mx.array | None = None) -> FusedOutput:
        """One launch over ``x0`` ``[m, d]`` float32 at positions ``start..start+m-1`` of the
        per-layer key/value buffers (written in place at those positions); ``anchor``: the
        ``[1]`` int32 token a greedy draft starts from (``markov`` only); ``rows``: ``[A,
        taps * d]`` float32 context rows of positions ``start - A .. start - 1`` to write into
        the buffers first (``absorbs`` only); lazy."""
        m = int(x0.shape[0])
        nqkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        d, nl, hd = self.hidden_size, self.layers, self.head_dim
        # Sizes reach the kernel as the lengths of stride-0 views (kernel parameters, no device
        # memory the host writes): the cached length, and the attention segments of the last
        # row (the one with most keys), which size `part`.
        pos = mx.broadcast_to(self._zero, (start,))
        segments = (start + m - 1) // self.segment + 1
        pseg = mx.broadcast_to(self._zero, (segments,))
        # Each launch gets its own zeroed barrier slots and attention counters: no state carries
        # over between launches (a failed one cannot poison the next).
        bar = mx.zeros((self.blocks * 32 + nl * m * self.heads,), dtype=mx.uint32)
        draft = dict(self._draft_inputs)
        if anchor is not None:
            draft["tok0"] = anchor.astype(mx.int32).reshape(1)
        absorb = rows is not None
        if absorb:
            draft["crow"] = mx.contiguous(rows.astype(mx.float32))  # (the kernel reads it densely)
        inputs = [x0, pos, pseg, *(self.weights[k] for k in self._WEIGHT_NAMES),
                  *(draft[k] for k in self._DRAFT_NAMES), *keys, *values, bar]
        markov = self.markov and anchor is not None
        drafted = m if markov else 1
        outs = self._kernel(
            inputs=inputs,
            template=self.template(markov, absorb),
            grid=(self.blocks * 32 * self.warps, 1, 1), threadgroup=(32 * self.warps, 1, 1),
            output_shapes=[(m, self.weights["we"].shape[0]), (nl, m, d), (m, nqkv), (m, self.heads * hd), (m, d),
                           (m, self.intermediate), (m, self.heads, segments, hd + 2),
                           (self.blocks, 5 * nl + 2, 2) if self.profile else (1,), (self.blocks,),
                           (drafted,), (drafted,), (4 * self.blocks if markov else 1,),
                           (rows.shape[0], d) if absorb else (1,),
                           (nl * rows.shape[0] * 2 * self.kv_heads * hd,) if absorb else (1,)],
            output_dtypes=[mx.float32] * 7 + [mx.uint32, mx.int32, mx.int32] + [mx.float32] * 4)
        out = FusedOutput(outs[0], outs[1], x0, outs[8], outs[7] if self.profile else None)
        if markov:
            out.tokens = outs[9]
            out.confidence = outs[10] if self.confidence else None
        return out

    def check(self, out: FusedOutput) -> None:
        """Raise :class:`FusedPassError` if ``out``'s pass gave up at a grid barrier (blocks not
        all resident, or a fault). Its outputs, including the keys and values it appended to the
        cache, are then garbage: the sequence cannot continue."""
        failed = int(np.count_nonzero(np.asarray(out.errors)))  # no new op: reads the evaluated flags
        if failed:
            raise FusedPassError(f"fused pass: {failed} of {self.blocks} blocks timed out at a grid barrier")


def markov_reason(network) -> str:
    """Empty when a greedy draft can run inside the launch (:class:`DraftFusedPass`): no Markov
    head, or one whose two tables are affine-quantized with the same 4/8 bits, power-of-two
    groups and float32 scales (rank a multiple of 8), and a float32 confidence head if any."""
    head = getattr(network, "markov_head", None) if network.has_markov else None
    if head is not None:
        w1, w2 = head.markov_w1, head.markov_w2
        if not (isinstance(w1, nn.QuantizedEmbedding) and isinstance(w2, nn.QuantizedLinear)):
            return "Markov tables not quantized"
        for t in (w1, w2):
            if (t.bits not in SUPPORTED_BITS or t.bits != w1.bits or getattr(t, "mode", "affine") != "affine"
                    or t.group_size & (t.group_size - 1) or t.scales.dtype != mx.float32
                    or t.biases.dtype != mx.float32):
                return f"Markov tables {t.bits} bits, group {t.group_size}, scales {t.scales.dtype}"
        if network.config.markov_rank % 8:
            return f"Markov rank {network.config.markov_rank} (a multiple of 8)"
    if network.has_confidence and network.confidence_head.proj.weight.dtype != mx.float32:
        return "confidence head not float32"
    return ""


def absorb_reason(network, bits: int) -> str:
    """Empty when the draft cache update (``fc``, ``hidden_norm``, each layer's k/v) can run
    inside the launch: ``fc`` affine-quantized with the layers' ``bits``, a power-of-two group,
    float32 scales, and a float32 ``hidden_norm``."""
    fc = network.fc
    if not isinstance(fc, nn.QuantizedLinear) or fc.bits != bits or getattr(fc, "mode", "affine") != "affine":
        return f"fc is {type(fc).__name__} (needs the layers' {bits}-bit affine quantization)"
    if fc.group_size & (fc.group_size - 1) or fc.scales.dtype != mx.float32 or fc.biases.dtype != mx.float32:
        return f"fc group {fc.group_size}, scales {fc.scales.dtype}"
    if network.hidden_norm.weight.dtype != mx.float32:
        return f"hidden_norm {network.hidden_norm.weight.dtype}"
    return ""


class DraftFusedPass(FusedPass):
    """A DSpark drafter's block forward and the target's LM head in one kernel launch, and for
    greedy drafts the Markov head's left-to-right argmax and the confidence head too.

    The same kernel as :class:`FusedPass` with Qwen3's per-head q/k RMSNorm (``QKN``) and
    bidirectional attention among the block's rows (``BIDIR``): the block ``[anchor, MASK x
    (B-1)]`` at positions ``p..p+B-1`` attends to the draft cache's context rows ``0..p-1`` and
    to all of its own rows, as :class:`drafters.dspark.DSparkModel` does with ``fast=True``
    (DSpark, arXiv 2607.05147; [DeepSpec] ``create_dspark_attention_mask``). The launch writes
    the block's keys and values into the draft cache at ``p..p+B-1``: rows past the valid
    context, masked for later blocks and overwritten when the next context rows arrive. With
    ``markov`` (:func:`markov_reason` empty) a launch given the anchor also drafts greedily:
    ``x_k = argmax(U_k + W2 W1[x_{k-1}])``, one grid barrier per draft, as
    ``drafters.dspark.model.sample_block`` at temperature 0.

    Args:
        network: a ``drafters.dspark.DSparkModel`` that :func:`draft_unsupported_reason` accepts
            (4/8-bit affine projections, float32 activations).
        target: the mlx-lm target whose LM head (tied embedding or ``lm_head``) the drafter shares.
        blocks, skip, profile: as for :class:`FusedPass`.
        rows: the kernel's rows, 8 (default, :data:`DRAFT_ROWS`, for a block of at most 8: 16
            warps where they fit, up to :data:`MAX_ABSORB_ROWS` context rows in the launch, in
            chunks) or 16 (8 warps, up to 16 context rows in the launch); a larger block always
            gets 16.
        vocab: a ``drafters.dspark.vocab.DraftVocab`` built for ``network`` and ``target``'s
            head: the LM head and the Markov table's ``W2`` run over its ``V'`` rows (logits
            ``[B, V']``) and greedy tokens come out as target ids; None: the whole vocabulary.
        warps: 8 or 16; default 16 where it fits (the 8-row kernel, head dim 64, the attention
            scratch within shared memory), else 8.

    Raises:
        ValueError: unsupported network, target head or backend (the message says why).
    """

    def __init__(self, network, target, blocks: int | None = None, warps: int | None = None, skip: int = 0,
                 profile: bool = False, rows: int = DEFAULT_DRAFT_KERNEL_ROWS, vocab=None):
        if rows not in (DRAFT_ROWS, MAX_ROWS):
            raise ValueError(f"the draft kernel's rows must be {DRAFT_ROWS} or {MAX_ROWS}, got {rows}")
        reason = draft_unsupported_reason(network, target)
        if reason:
            raise ValueError(f"fused draft pass unsupported: {reason}")
        cfg = network.config
        self.model = target
        # the 8-row kernel where asked for and the block fits, with 16 warps; else 16 rows with 8
        # warps (with 16 rows' accumulators and the Markov phase, 16 warps' 128 registers per
        # thread did not fit: "too many resources requested" on an H200)
        self.max_rows = DRAFT_ROWS if rows == DRAFT_ROWS and cfg.block_size <= DRAFT_ROWS else MAX_ROWS
        self.max_absorb = MAX_ABSORB_ROWS if self.max_rows == DRAFT_ROWS else MAX_ROWS
        head = vocab.head_module if vocab is not None else head_module(target)
        self._build(network.layers, head, network.norm.weight, cfg.num_attention_heads,
                    cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size, blocks,
                    warps, skip, profile, qk_norm=True, bidirectional=True)
        self.vocab = vocab  # (the launch's logits cover its rows, greedy draft in the launch or not)
        inputs = _no_draft_inputs()
        if vocab is not None:
            inputs["dvoc"] = vocab.ids.astype(mx.int32)
        if not absorb_reason(network, self.bits):
            self.absorbs, self.taps = True, cfg.num_taps
            fc = network.fc
            inputs.update(wfc=fc.weight, sfc=fc.scales, bfc=fc.biases, hnw=network.hidden_norm.weight)
        markov_shared = 4 * cfg.markov_rank + 8 * self.warps + 4  # w1s, red_v/red_i, next_s
        if not markov_reason(network) and self._shared_bytes(self.warps) + markov_shared <= 48 * 1024:
            # (else greedy drafts stay MLX ops after the launch)
            self.markov = True
            if network.has_markov:
                w1 = network.markov_head.markov_w1
                w2 = vocab.markov_w2 if vocab is not None else network.markov_head.markov_w2
                self.markov_rank, self.markov_bits = cfg.markov_rank, w1.bits
                inputs.update(mw1=w1.weight, ms1=w1.scales, mb1=w1.biases, mw2=w2.weight, ms2=w2.scales,
                              mb2=w2.biases)
            if network.has_confidence:
                proj = network.confidence_head.proj
                self.confidence = 2 if cfg.confidence_head_with_markov else 1
                inputs.update(cw=proj.weight.reshape(-1), cb=proj.bias.reshape(-1))
        self._draft_inputs = {k: mx.contiguous(v) for k, v in inputs.items()}
        mx.eval(list(self._draft_inputs.values()))

    def _registers_fit(self, warps: int) -> bool:
        """16 warps only for the 8-row kernel of head dim 64 (104-110 registers per thread); the
        16-row one with the context update or the greedy draft takes 136-150."""
        return warps == 8 or (self.max_rows == DRAFT_ROWS and self.head_dim == 64)

    def __call__(self, x0: mx.array, keys: list[mx.array], values: list[mx.array], start: int,
                 anchor: mx.array | None = None, rows: mx.array | None = None) -> FusedOutput:
        """The block forward (lazy; evaluate ``logits``/``tokens``, ``confidence`` and
        ``errors`` together, then :meth:`check`).

        Args:
            x0: ``[B, d]`` float32 target embeddings of the block, ``B <=`` :attr:`max_rows` (8
                with the 8-row kernel, else 16).
            keys, values: per draft layer ``[1, KV, capacity, D]`` float32 contiguous buffers
                that no other array shares, rows ``0..start-1`` valid; ``capacity >= start + B``.
            start: the anchor's position (= valid context rows).
            anchor: ``[1]`` int32 anchor token: also draft greedily (needs ``markov``).
            rows: ``[A, taps * d]`` tapped target states of positions ``start - A .. start - 1``
                (``1 <= A <=`` :attr:`max_absorb`, 64; projected in chunks of :attr:`max_rows`)
                to project into the draft cache first (needs ``absorbs``): the buffers then hold
                ``start - A`` valid rows before the launch.

        Returns:
            :class:`FusedOutput`: ``logits`` ``[B, V]`` (final norm + LM head), ``hidden``
            ``[layers, B, d]`` (each draft layer's output, before the final norm); with
            ``anchor``, ``tokens`` ``[B]`` and ``confidence`` ``[B]`` (or None).

        Raises:
            ValueError: too many rows, buffers without room for them, or an anchor without
                ``markov``.
        """
        m = int(x0.shape[0])
        if not 1 <= m <= self.max_rows or len(keys) != self.layers or start + m > keys[0].shape[2]:
            raise ValueError(f"fused draft pass takes 1..{self.max_rows} rows and {self.layers} layers' buffers "
                             f"with room for them; got {m} rows at {start} in {keys[0].shape[2]}")
        if anchor is not None and not self.markov:
            raise ValueError("this drafter's Markov head cannot draft inside the launch")
        if rows is not None and (not self.absorbs or not 1 <= rows.shape[0] <= min(self.max_absorb, start)
                                 or rows.shape[1] != self.taps * self.hidden_size):
            raise ValueError(f"context rows in the launch need absorbs and 1..{self.max_absorb} rows of "
                             f"{self.taps * self.hidden_size} features before the anchor")
        out = self._launch(x0.astype(mx.float32), start, keys, values, anchor, rows)
        self.passes += 1
        return out
