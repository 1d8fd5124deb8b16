"""Decode and verify passes in one native call on the CPU: the CPU twin of :mod:`fused`.

On the CPU, MLX runs a decode step of the default model as ~600 ops over float32 weights
(the 4-bit matmul of ``mlx[cpu]`` is naive, so the loader dequantizes): 0.54 GB of weights per
step, and a verify pass of ``k`` rows costs OpenBLAS a packed ``sgemm``, 2.7x one row from 2
rows on. :class:`CpuFusedPass` runs a whole pass (every decoder layer and the LM head, for 1..16
rows) as one call into C (``sources/fused_cpu.c``) that streams the file's quantized weights
(4 or 8 bits, ~0.1 GB for the default model) once for all rows, dequantizing in registers,
with a pool of threads splitting every projection's outputs.

Row ``i`` of a ``k``-row pass is bit-identical to the one-row pass at its position: each output
is one dot product in a fixed order over that row's inputs (see the C source). Prefill stays
on mlx-lm's modules; passes read the KV cache those write and append their keys and values to
its buffers in place (:func:`metal_kernels.fused.writable_cache`).

The library is compiled at first use with the system C compiler (``cc``, ``-O3 -march=native
-pthread``) into the kernel cache directory; without a compiler :func:`unsupported_reason`
says so and the engine keeps mlx-lm's modules.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_kernels.fused import (
    FusedOutput,
    architecture_reason,
    cache_layout_ok,
    head_module,
    linears,
    writable_cache,
)
from metal_kernels.qmv import backend

log = logging.getLogger("specserve.fused_cpu")

MAX_ROWS = 16
SUPPORTED_BITS = (4, 8)
ACTIVATIONS = {"q16": 2, "q8": 1, "float32": 0}  # CpuFusedPass(activations=...): 8-bit digits per input
# Default pool size cap: a pass has ~10 barriers per layer and a few hundred outputs per phase,
# so beyond ~16 threads the barriers cost more than the split saves (not measured: 2 cores here).
MAX_THREADS = 16
_SOURCE = Path(__file__).parent / "sources" / "fused_cpu.c"
_CFLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=gnu11",
           "-ffp-contract=fast")  # (the generic code's a += b * c must fuse as the intrinsics do)


def kernel_dir() -> Path:
    """Where compiled libraries go: ``$SPECSERVE_CACHE_DIR/kernels``, else
    ``$XDG_CACHE_HOME/specserve/kernels``, else ``~/.cache/specserve/kernels``."""
    root = os.environ.get("SPECSERVE_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve"
    return Path(root) / "kernels"


def default_threads() -> int:
    """CPUs this process may use: its affinity mask, a cgroup v2 CPU quota (``cpu.max``, as a
    container's ``--cpus`` sets) if lower, and at most :data:`MAX_THREADS`."""
    n = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, min(MAX_THREADS, n))


class CompileError(RuntimeError):
    """The C pass could not be built (no compiler, or it rejected the source)."""


def _cpu_identity() -> str:
    """The machine and its instruction-set flags (Linux ``/proc/cpuinfo``), which
    ``-march=native`` builds for."""
    import platform

    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def _compiler_identity(cc: str) -> str:
    """``cc --version``'s first line (a new compiler or libc rebuilds the library)."""
    import platform

    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        version = proc.stdout.splitlines()[0] if proc.stdout else ""
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{version} {' '.join(platform.libc_ver())}"


_BUILD_LOCK = threading.Lock()


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled pass, built once per source, flags, compiler, libc and CPU (cached on disk
    under :func:`kernel_dir` by their hash; concurrent builders publish atomically).

    Raises:
        CompileError: no C compiler (``$CC`` or ``cc``) or the build failed.
    """
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise CompileError(f"no C compiler ({cc!r} not on PATH)")
    source = _SOURCE.read_bytes()
    # -march=native: a library built on one CPU may not run on another (a shared cache volume)
    key = " ".join((cc, *_CFLAGS, _compiler_identity(cc), _cpu_identity()))
    digest = hashlib.sha1(source + key.encode()).hexdigest()[:12]
    out = kernel_dir() / f"specserve_fused_cpu_{digest}.so"
    with _BUILD_LOCK:
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=out.parent)
            os.close(fd)
            try:
                proc = subprocess.run([cc, *_CFLAGS, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True)
                if proc.returncode:
                    raise CompileError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
                os.replace(tmp, out)  # (atomic: concurrent builders agree)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            log.info("built %s", out)
    lib = ctypes.CDLL(str(out))
    lib.specserve_cpu_pass.restype = ctypes.c_int
    return lib


class _QMat(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("b", ctypes.c_void_p),
                ("in_", ctypes.c_int32), ("out", ctypes.c_int32), ("bits", ctypes.c_int32), ("gs", ctypes.c_int32)]


class _Model(ctypes.Structure):
    _fields_ = [("nl", ctypes.c_int32), ("dm", ctypes.c_int32), ("nh", ctypes.c_int32), ("nkv", ctypes.c_int32),
                ("hd", ctypes.c_int32), ("di", ctypes.c_int32), ("vocab", ctypes.c_int32),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("inv_freq", ctypes.c_void_p), ("norms", ctypes.c_void_p), ("fnorm", ctypes.c_void_p),
                ("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gu", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("head", ctypes.c_void_p), ("digits", ctypes.c_int32)]


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's affine-quantized layers by module path (``QuantizedLinear`` and
    ``QuantizedEmbedding``). The loader keeps them when it dequantizes the model for the CPU
    (the modules stay alive after ``dequantize_model`` replaces them in the tree), so the C
    pass can stream the file's quantized weights while prefill runs on float32 ones."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and getattr(m, "mode", "affine") == "affine"}


def _source(model: nn.Module, quantized: dict[str, nn.Module] | None) -> dict[str, nn.Module]:
    """Module path -> the quantized layer the pass reads (the model's own, else ``quantized``'s)."""
    own = quantized_modules(model)
    return own if own or not quantized else quantized


def _paths(model: nn.Module) -> tuple[list[dict[str, str]], str]:
    """Per layer, projection name -> module path; and the LM head's path."""
    layers = [{name: f"model.layers.{i}.{'self_attn' if name.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{name}"
               for name in linears(layer)} for i, layer in enumerate(model.model.layers)]
    head = "model.embed_tokens" if head_module(model) is model.model.embed_tokens else "lm_head"
    return layers, head


def _float16_exact(a: mx.array) -> bool:
    return bool(mx.array_equal(a.astype(mx.float16).astype(a.dtype), a).item())


def unsupported_reason(model: nn.Module, quantized: dict[str, nn.Module] | None = None) -> str:
    """Empty when :class:`CpuFusedPass` runs ``model`` here, else why not.

    ``quantized``: the model's quantized layers by path (:func:`quantized_modules` before the
    loader dequantized it), when the model itself holds float weights.
    """
    if backend() != "cpu":
        return f"backend {backend()} (the CPU fused pass runs on the CPU)"
    reason = architecture_reason(model)
    if reason:
        return reason
    args = model.args
    hd = args.head_dim or args.hidden_size // args.num_attention_heads
    if hd % 16 or hd > 256 or args.hidden_size % 32 or args.intermediate_size % 32:
        return (f"head dim {hd}, hidden {args.hidden_size}, intermediate {args.intermediate_size} "
                "(need 16 | head dim <= 256, 32 | the others)")
    source = _source(model, quantized)
    layers, head = _paths(model)
    for path in [p for layer in layers for p in layer.values()] + [head]:
        m = source.get(path)
        if m is None:
            return f"{path} is not affine-quantized"
        if m.bits not in SUPPORTED_BITS or m.group_size % 32:
            return f"{path}: {m.bits} bits, group size {m.group_size} (4 or 8 bits, groups of 32k)"
        if "bias" in m:
            return f"{path} has a bias"
        if not (_float16_exact(m.scales) and _float16_exact(m.biases)):
            return f"{path}: scales/biases not exact in float16"
    for lp in layers:  # q|k|v and gate|up are stacked into one matrix: one layout each
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if len({(source[lp[n]].bits, source[lp[n]].group_size) for n in group}) != 1:
                return f"{'/'.join(group)} of {lp[group[0]]} differ in bits or group size"
    for layer in model.model.layers:
        if layer.input_layernorm.weight.dtype != mx.float32:
            return f"activations {layer.input_layernorm.weight.dtype} (float32 only)"
    try:
        library()
    except (CompileError, OSError) as e:
        return str(e)
    return ""


def _codes(m: nn.Module, integer: bool) -> np.ndarray:
    """``[out, in * bits / 8]`` uint8 codes in the C pass's layout (see ``fused_cpu.c``). Float32
    activations: 4 bits, per 32 inputs 16 bytes (inputs 0..15 in the low nibbles, 16..31 in the
    high ones); 8 bits, one byte per input. ``integer`` activations: per group of ``n <= 16`` blocks of 32
    inputs, segments of ``4 n`` bytes, segment ``t`` holding inputs ``4t..4t+3`` of each block
    (4 bits: 4 segments, inputs ``16+4t..`` in the high nibbles; 8 bits: 8 segments)."""
    words = np.asarray(m.weight).view(np.uint32)
    per = 32 // m.bits
    shifts = (np.arange(per, dtype=np.uint32) * m.bits)[None, None, :]
    q = ((words[:, :, None] >> shifts) & ((1 << m.bits) - 1)).astype(np.uint8).reshape(words.shape[0], -1)
    out, blocks = q.shape[0], q.shape[1] // 32
    if integer:
        groups = []
        for j0 in range(0, blocks, 16):
            g = q[:, 32 * j0: 32 * min(j0 + 16, blocks)].reshape(out, -1, 32)
            if m.bits == 4:
                g = g[:, :, :16] | (g[:, :, 16:] << 4)
            groups.append(g.reshape(out, g.shape[1], -1, 4).transpose(0, 2, 1, 3).reshape(out, -1))
        return np.ascontiguousarray(np.concatenate(groups, axis=1))
    if m.bits == 8:
        return np.ascontiguousarray(q)
    q = q.reshape(out, blocks, 2, 16)  # per 32 inputs: [0..15], [16..31]
    return np.ascontiguousarray((q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(out, -1))


class CpuFusedPass:
    """Decode/verify passes of ``model`` as one native call each (the CPU twin of
    :class:`metal_kernels.fused.FusedPass`, same call interface).

    Args:
        model: an mlx-lm Llama that :func:`unsupported_reason` accepts (float32 activations).
        quantized: its quantized layers by path when the model holds dequantized weights
            (:func:`quantized_modules`, taken before dequantizing); None: the model's own.
        threads: threads of the process-wide pool that runs the passes, the caller included
            (default: the CPUs this process may run on, at most :data:`MAX_THREADS`); the first
            pass built in the process sets it for all.
        activations: how projections multiply. ``"q16"`` (the default): every projection's
            input rows are quantized per block of 32 into two 8-bit digits (``x ~ d q + d' q'``,
            to ~1/32000 of the block's largest input) and multiplied in integers (AVX512-VNNI
            ``vpdpbusd`` where the CPU has it); the default model's logits stay within ~1e-4 of
            their scale of float32's. ``"q8"``: one digit, llama.cpp's Q8 activations for its
            Q4_1/Q8_0 dot products: cheaper verify rows, but logits move by ~2% of their scale,
            enough to flip near-tied greedy choices. ``"float32"``: float32 inputs and FMAs, within
            ~1e-5 of mlx-lm's modules. Either way rows are bit-identical for every width.

    Raises:
        ValueError: the model is not supported (the message says why).
    """

    max_rows = MAX_ROWS
    segment = 256  # attention keys per work unit (SEG in the C source): the start-up probe
    # prefills 2 * segment - 1 tokens so its rows go through the segment combine

    def __init__(self, model: nn.Module, quantized: dict[str, nn.Module] | None = None, threads: int | None = None,
                 activations: str = "q16"):
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {sorted(ACTIVATIONS)}, got {activations!r}")
        reason = unsupported_reason(model, quantized)
        if reason:
            raise ValueError(f"CPU fused pass unsupported: {reason}")
        self.activations = activations
        integer = ACTIVATIONS[activations] > 0
        self.model = model
        self.lib = library()
        args, inner = model.args, model.model
        self.layers, self.hidden_size = len(inner.layers), args.hidden_size
        self.heads, self.kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim or args.hidden_size // self.heads
        self.threads = self.lib.specserve_cpu_threads(threads or default_threads())
        source = _source(model, quantized)
        layers, head = _paths(model)
        self._keep: list[np.ndarray] = []  # arrays the C structs point into

        def ptr(a: np.ndarray) -> int:
            self._keep.append(a)
            return a.ctypes.data

        def qmat(modules: list[nn.Module]) -> _QMat:
            m0 = modules[0]
            codes = np.concatenate([_codes(m, integer) for m in modules])
            s = np.concatenate([np.asarray(m.scales.astype(mx.float16)) for m in modules])
            b = np.concatenate([np.asarray(m.biases.astype(mx.float16)) for m in modules])
            return _QMat(ptr(codes), ptr(s), ptr(b), codes.shape[1] * 8 // m0.bits, codes.shape[0], m0.bits,
                         m0.group_size)

        def per_layer(names):
            return (_QMat * self.layers)(*(qmat([source[lp[n]] for n in names]) for lp in layers))

        self._mats = {"qkv": per_layer(("q_proj", "k_proj", "v_proj")), "o": per_layer(("o_proj",)),
                      "gu": per_layer(("gate_proj", "up_proj")), "down": per_layer(("down_proj",)),
                      "head": qmat([source[head]])}
        norms = np.stack([np.stack([np.asarray(layer.input_layernorm.weight),
                                    np.asarray(layer.post_attention_layernorm.weight)]) for layer in inner.layers])
        rope = inner.layers[0].self_attn.rope
        half = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        inv_freq = (rope.scale * rope.base ** -half).astype(np.float32)
        self._model = _Model(
            self.layers, self.hidden_size, self.heads, self.kv_heads, self.head_dim, args.intermediate_size,
            self._mats["head"].out, inner.layers[0].input_layernorm.eps,
            inner.layers[0].self_attn.scale, ptr(inv_freq), ptr(np.ascontiguousarray(norms, np.float32)),
            ptr(np.asarray(inner.norm.weight, np.float32)),
            *(ctypes.addressof(self._mats[k]) for k in ("qkv", "o", "gu", "down", "head")), ACTIVATIONS[activations])
        self.passes = 0
        self._ok = mx.zeros((1,), mx.int32)  # FusedOutput.errors: a failed CPU pass raises instead

    def supports_cache(self, cache: list, rows: int) -> bool:
        """Whether a pass of ``rows`` rows can append to ``cache`` (see
        :meth:`metal_kernels.fused.FusedPass.supports_cache`)."""
        return 1 <= rows <= MAX_ROWS and len(cache) == self.layers and cache_layout_ok(cache)

    prefills = True  # the engine may prefill through it (:meth:`TargetRunner.prefill`, max_rows at a time)

    @property
    def probe_tolerance(self) -> float:
        """How far (relative to their scale) this pass's logits may be from mlx-lm's float32
        modules at the engine's start-up probe: one-digit ``q8`` activations moved the default
        model's logits by 1.9% of their scale on the probe's input (2-8% on chat prompts), the
        other modes by < 2e-4."""
        return 5e-2 if self.activations == "q8" else 1e-3

    def __call__(self, tokens: list[int], cache: list, logits: bool = True) -> FusedOutput:
        """Run ``tokens`` (one decode token, or the anchor plus drafts) through the target at the
        cache's current length, appending their keys and values to ``cache``.

        Args:
            tokens: 1..16 token ids.
            cache: the sequence's per-layer mlx-lm ``KVCache`` list, prefilled, float32.
            logits: False skips the LM head (a prefill chunk): ``FusedOutput.logits`` is None.

        Returns:
            :class:`metal_kernels.fused.FusedOutput` (``logits [M, V]``, ``hidden [L, M, d]``,
            ``embeddings [M, d]``, float32); the cache's offsets count the new rows.

        Raises:
            ValueError: more than 16 or no tokens, or a cache :meth:`supports_cache` rejects.
            MemoryError: the pass could not allocate its workspace.
        """
        return self.batch([tokens], [cache], logits)[0]

    batches = True  # several sequences may share a pass (:meth:`batch`)

    def batch(self, rows: list[list[int]], caches: list[list], logits: bool = True) -> list[FusedOutput]:
        """One pass over several sequences' rows (continuous batching): the weights are read once
        for all of them, and each sequence's rows compute exactly what its own pass computes.

        Args:
            rows: per sequence, 1..16 token ids (16 rows in all at most).
            caches: per sequence, its own per-layer ``KVCache`` list (see :meth:`supports_cache`).
            logits: False skips the LM head (``FusedOutput.logits`` is None).

        Returns:
            per sequence, :class:`metal_kernels.fused.FusedOutput` of its rows.

        Raises:
            ValueError: no rows, more than 16 rows in all, a cache :meth:`supports_cache`
                rejects, or one cache given twice.
            MemoryError: the pass could not allocate its workspace.
        """
        m = sum(len(r) for r in rows)
        if not rows or len(rows) != len(caches) or not 1 <= m <= MAX_ROWS or len({id(c) for c in caches}) < len(caches):
            raise ValueError(f"CPU fused pass takes 1..{MAX_ROWS} rows in all over distinct caches; "
                             f"got {[len(r) for r in rows]} rows over {len(caches)} caches")
        for r, cache in zip(rows, caches):
            if not self.supports_cache(cache, len(r)):
                raise ValueError(f"CPU fused pass takes 1..{MAX_ROWS} rows over a prefilled float32 KVCache "
                                 f"list of {self.layers} layers with equal shapes; got {len(r)} rows")
            writable_cache(cache, len(r), self.kv_heads, self.head_dim)
        tokens = [t for r in rows for t in r]
        x0 = self.model.model.embed_tokens(mx.array(tokens, dtype=mx.uint32)).astype(mx.float32)
        pointers = [self._pointers(cache) for cache in caches]
        mx.eval(x0)
        pos = np.array([c[0].offset + i for r, c in zip(rows, caches) for i in range(len(r))], np.int32)
        seq = np.array([s for s, r in enumerate(rows) for _ in r], np.int32)
        cap = np.array([c[0].keys.shape[2] for c in caches], np.int32)
        n = len(caches) * self.layers
        keys = (ctypes.c_void_p * n)(*(a for ptr in pointers for a in ptr[1]))
        values = (ctypes.c_void_p * n)(*(a for ptr in pointers for a in ptr[2]))
        out_logits = np.empty((m, self._model.vocab), np.float32) if logits else None
        hidden = np.empty((self.layers, m, self.hidden_size), np.float32)
        x0_np = np.ascontiguousarray(np.asarray(x0))
        rc = self.lib.specserve_cpu_pass(
            ctypes.byref(self._model), m, ctypes.c_void_p(pos.ctypes.data), ctypes.c_void_p(seq.ctypes.data),
            ctypes.c_void_p(x0_np.ctypes.data), keys, values, ctypes.c_void_p(cap.ctypes.data),
            ctypes.c_void_p(None if out_logits is None else out_logits.ctypes.data), ctypes.c_void_p(hidden.ctypes.data))
        if rc:
            raise MemoryError("CPU fused pass: workspace allocation failed")
        self.passes += 1
        outs, at = [], 0
        for r, cache in zip(rows, caches):
            for layer in cache:
                layer.offset += len(r)
            part = slice(at, at + len(r))
            outs.append(FusedOutput(None if out_logits is None else mx.array(out_logits[part]),
                                    mx.array(hidden[:, part]), x0[part], self._ok))
            at += len(r)
        return outs

    def _pointers(self, cache: list) -> tuple:
        """``(buffers, key addresses, value addresses, views)`` of the buffers a pass writes for
        ``cache`` (after :func:`writable_cache`): zero-copy views of the evaluated arrays, checked,
        since a copy here would silently drop the pass's keys and values. Kept on the cache and
        reused while its layers hold the same buffers (every pass until one grows them), which
        saves ~0.3 ms of evaluating and viewing 2 x layers arrays per pass; the entry holds the
        arrays, so their addresses cannot be reused while it is looked up."""
        held = cache[0].__dict__.get("_cpu_pass_pointers")
        if held is not None and all(c.keys is k and c.values is v for c, (k, v) in zip(cache, held[0])):
            return held
        buffers = [(c.keys, c.values) for c in cache]
        mx.eval(*(a for kv in buffers for a in kv))
        views = [(np.asarray(k), np.asarray(v)) for k, v in buffers]
        shape = (1, self.kv_heads, cache[0].keys.shape[2], self.head_dim)
        for view in (v for kv in views for v in kv):
            if view.shape != shape or not view.flags.c_contiguous or view.dtype != np.float32:
                raise ValueError(f"CPU fused pass: cache buffer {view.shape} {view.dtype} is not a contiguous {shape}")
        held = (buffers, [k.ctypes.data for k, _ in views], [v.ctypes.data for _, v in views], views)
        cache[0].__dict__["_cpu_pass_pointers"] = held
        return held

    def check(self, out: FusedOutput) -> None:
        """Nothing to check on the CPU (a failed pass raises in :meth:`__call__`)."""
