"""Small-batch quantized matmul for MLX affine-quantized weights (verify and decode).

``quantized_matmul(x, w, scales, biases, group_size, bits)`` computes
``y[m, n] = sum_k x[m, k] * W[n, k]`` where ``W[n, k] = scales[n, k // gs] * q[n, k] +
biases[n, k // gs]`` and ``q`` is packed by ``mx.quantize`` (``bits`` 4 or 8, element
``k`` of a row in bits ``[bits * (k % (32 // bits)), ...)`` of word ``k // (32 // bits)``,
least significant first). It is a drop-in for ``mx.quantized_matmul(..., transpose=True)``
that, for 1..16 activation rows on a GPU, reads each weight once for all rows and gives
each row a fixed reduction order, so row ``i`` of an M-row call is bit-identical to the
1-row call on the same input. That is what keeps greedy speculative decoding (verify over
k+1 rows) byte-identical to one-token decoding.

Kernels (sources in ``metal_kernels/sources/``):

- ``mma`` (CUDA, fp16/bf16 activations): weights dequantized to fp16/bf16 in registers and
  multiplied on the tensor cores (``mma.sync.m16n8k16``, fp32 accumulation). K is split
  into fixed chunks across the warps of a block and the partial sums are added in warp
  order; the split depends only on (N, K, bits), never on M.
- ``simd`` (Metal for every dtype; CUDA for fp32 activations and N % 16 != 0): fp32
  dequantize and fp32 FMAs per lane in increasing k, then a fixed xor butterfly. One body
  (``simd_body.inc``) for both backends; the Metal build has not been run (no Mac here).
- ``reference``: ``mx.quantized_matmul`` (CPU, more than 16 rows, unsupported layouts).

Row exactness holds within one backend and kernel family; it does not make the kernel
agree bit for bit with ``mx.quantized_matmul`` (only to rounding, see tests).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

MAX_ROWS = 16
SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
_SOURCES = Path(__file__).parent / "sources"
# The mma split's K warps: the smallest power of two with N/32 * WK >= this. Nsight Compute on
# the H200 (benchmarks/gpu/mma_sweep.py, ninth session): at M = 1, 4096x4096 took 7.5 us with
# 16 warps splitting K and one chunk in flight against 8.2 us with 8 warps and two (the
# former defaults, target 1024).
_TARGET_WARPS = 2048


@dataclass(frozen=True)
class KernelPlan:
    """One launch: which kernel, its compile-time constants and its launch shape.

    ``kind`` is ``"mma"`` or ``"simd"``; ``consts`` are the integer template constants
    (names as in the kernel sources); ``grid``/``threadgroup`` are in threads, as
    ``mx.fast.cuda_kernel``/``metal_kernel`` take them (grid = total threads).
    ``k_split`` names the parts of the configuration that fix the per-row reduction order;
    it is independent of the row count M by construction. ``min_blocks`` > 0 compiles the
    kernel with ``__launch_bounds__(threadgroup, min_blocks)`` (ptxas then keeps registers
    within what ``min_blocks`` resident blocks per multiprocessor allow).
    """

    kind: str
    backend: str
    consts: tuple[tuple[str, int], ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    k_split: tuple[tuple[str, int], ...]
    min_blocks: int = 0  # > 0: compiled with __launch_bounds__(threads, min_blocks)

    def const(self, name: str) -> int:
        return dict(self.consts)[name]

    def source_options(self) -> tuple[tuple[int, int] | None, bool, bool]:
        """(launch bounds as (threads, min_blocks) or None, with the compile-time-shape loop,
        with the extra helpers of an L2 prefetch hint or shuffled activations): what
        :func:`kernel_sources` takes to build this plan's source."""
        bounds = (self.threadgroup[0], self.min_blocks) if self.min_blocks else None
        mma = self.kind == "mma"
        return bounds, mma and self.const("KC") > 0, mma and (self.const("LP") > 0 or self.const("XS") > 0)


@functools.cache
def _gpu_backend() -> str:
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"


def backend() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: the backend MLX's default device runs on."""
    return _gpu_backend() if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def _pow2_at_most(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


# Benchmark-tuned overrides: (n, k, bits) -> wk and (n, k, bits, mb) -> (nt, u).
_WK_OVERRIDE: dict[tuple[int, int, int], int] = {}
_NTU_OVERRIDE: dict[tuple[int, int, int, int], tuple[int, int]] = {}
# (n, k, bits, mb) -> {"const_shape": bool, "xl": bool, "min_blocks": int, "fixed_rows": bool,
# "unroll": bool, "l2_prefetch": int, "x_shuffle": bool, "multi_row_only": bool}: how a row
# bucket's launch is built (none of them changes a row's arithmetic).
_PATH_OVERRIDE: dict[tuple[int, int, int, int], dict] = {}
_CONFIG_GENERATION = [0]  # bumped by every override change: cached launch decisions keyed on it


def config_generation() -> int:
    """A counter that changes whenever :func:`set_mma_config`/:func:`clear_mma_config` change
    the mma split; launch decisions cached outside this module are keyed on it, so every row
    count of a layer switches to the new split together."""
    return _CONFIG_GENERATION[0]


def set_mma_config(n: int, k: int, bits: int, *, wk: int | None = None,
                   nt_u: dict[int, tuple[int, int]] | None = None,
                   path: dict[int, dict] | None = None) -> None:
    """Override the mma split for one weight shape (used by benchmarks/verify_cost.py --tune).

    ``wk`` (warps splitting K, a power of two <= 16) applies to every row bucket, so rows stay
    bit-identical across M; ``nt_u`` maps a row bucket (8 or 16) to (tiles per warp, chunks
    in flight) and ``path`` a row bucket to launch-building options (``const_shape``: K as a
    compile-time constant; ``xl``: a chunk's activations loaded just before its products;
    ``min_blocks``: launch bounds; ``fixed_rows``: the row count as a compile-time constant,
    True for every row count, False for none, default one-row launches only; ``unroll``: the
    compile-time-shape loop unrolled; ``l2_prefetch``: an L2 prefetch-size hint in bytes on
    the weight loads; ``x_shuffle``: for one fixed row, the activations held two registers per
    lane and passed by shuffles), none of which changes any row's arithmetic. Any ``nt_u`` or
    ``path`` for the 8-row bucket also replaces the one-row launch form of
    :func:`_one_row_launch`, unless its ``path`` has ``multi_row_only`` True: then one-row
    launches keep their defaults and the override applies to 2..8 rows only.
    """
    for mb, opts in (path or {}).items():
        _PATH_OVERRIDE[(n, k, bits, mb)] = dict(opts)
    if wk is not None:
        _WK_OVERRIDE[(n, k, bits)] = wk
    for mb, ntu in (nt_u or {}).items():
        _NTU_OVERRIDE[(n, k, bits, mb)] = ntu
    _forget_launch_decisions()


def _forget_launch_decisions() -> None:
    """Drop every cached plan and launcher and bump :func:`config_generation`, so every row
    count of a layer switches to the new launch decisions together."""
    _plan_cached.cache_clear()
    _launcher.cache_clear()
    sibling_launcher.cache_clear()
    _CONFIG_GENERATION[0] += 1


def clear_mma_config() -> None:
    """Forget every :func:`set_mma_config` override."""
    _WK_OVERRIDE.clear()
    _NTU_OVERRIDE.clear()
    _PATH_OVERRIDE.clear()
    _forget_launch_decisions()


def mma_config_fits(nt: int, u: int, mb: int, wk: int, xl: bool = False) -> bool:
    """Whether an mma configuration launches: registers per thread grow with the data a
    warp keeps in flight (NT * U * MB / 8 units; ptxas: 42-64 registers for 1 unit, 78-114
    for 2, 139-156 for 4, 199-255 with spills for 8), and a block of 32 * WK threads must
    fit the multiprocessor's 64K registers (at most 128 each for WK = 16; the H200 refused to
    launch a 512-thread block at exactly 128). With XL (a chunk's activations loaded just before
    its products, compile-time-shape loop) a unit costs less: ptxas 13.0 (nvcc and NVRTC alike)
    gave 54-82 registers for up to 4 units and 108-124 for 8 (K = 4096-14336). With one chunk
    in flight (U = 1) 4 units fit at WK = 16 too since the twenty-fifth session's loop: ptxas
    13.0 gave 56-90 registers for NT 2 at 16 rows over 176 plans (N 4096/6144, K 576-14336,
    4/8 bits, groups 32-128, both loops), a review's NVRTC sweep 54-98 over 468 (K 64-18944;
    96-98 where the chunks do not divide evenly among the warps), and 53-86 for NT 4 at 8 rows."""
    units = nt * u * mb // 8
    if xl:
        return units <= (4 if wk >= 16 else 8)
    if u == 1:
        return units <= 4
    return units <= (2 if wk >= 16 else 4)


def registers_fit(registers: int, threads: int, min_blocks: int = 0) -> bool:
    """Whether a kernel that ptxas gave ``registers`` per thread launches in blocks of
    ``threads`` (``min_blocks`` > 0: compiled with launch bounds, which ptxas meets). Without
    bounds it keeps 4 registers of margin below a multiprocessor's 64K per block: MLX compiles
    with NVRTC, and the H200 refused a 512-thread block that nvcc 13.0 counted at 128 registers
    while one it counted at 121 ran (twenty-fourth session)."""
    if min_blocks:
        return registers * threads * min_blocks <= 65536
    return (registers + 4) * threads <= 65536


# K as a compile-time constant where a chunk holds whole groups (the addresses become
# immediates; same bits): see _mma_plan. Nsight Compute on the H200 (twenty-fourth session,
# docs/benchmarks.md): as fast as the runtime-shape loop or faster at one row on all six
# shapes timed (4096x4096 6.85-6.88 against 6.91-7.39 us over two runs; 14336x4096 15.36
# against 16.42; 49152x576 11.30 against 11.52), within ~3% either way at 8 rows.
CONST_SHAPE = True
# One-row launches compiled with the row count fixed (template MR = 1): see _mma_plan. UNROLL
# (the compile-time-shape loop unrolled) is off by default; docs/benchmarks.md ("Twenty-fifth
# session") has the measurements.
FIXED_ONE_ROW = True
UNROLL = False
# One-row launches of 4-bit weights of the shapes timed on the H200 get their own launch form
# unless a benchmark set one (_one_row_launch). None of them changes a row's arithmetic. Switch
# with set_one_row_forms.
ONE_ROW_FORMS = True


def set_one_row_forms(enabled: bool) -> None:
    """Turn the one-row launch forms of :func:`_one_row_launch` on or off (every cached launch
    decision is dropped, as by :func:`clear_mma_config`)."""
    global ONE_ROW_FORMS
    ONE_ROW_FORMS = bool(enabled)
    _forget_launch_decisions()


def _one_row_launch(n: int, k: int) -> tuple[int, dict]:
    """(U, path options) of a one-row launch of a 4-bit ``n x k`` weight with the
    compile-time-shape loop, for the shape regimes that were timed; ``(1, {})`` elsewhere.

    Nsight Compute on the H200, bf16 activations, groups of 64, medians of 5 launches
    (twenty-seventh session, docs/benchmarks.md; against the plain compile-time-shape launch):
    - N = 4096, 4096 <= K < 8192 (timed: 4096x4096): one row's activations shuffled between
      lanes (``x_shuffle``, 6.62 against 6.82 us), one chunk in flight, and the
      compile-time-shape loop unrolled (``unroll``): 6.43-6.50 against shuffling alone's
      6.62-6.72 us in four sweeps of 31-51 launches (forty-fourth session), 2.04-2.06x MLX's
      13.2-13.3 us. Its bits were checked against rows of wider calls and against the
      runtime-shape loop on an H100 (forty-fifth session; the same sm_90 code);
    - N = 4096, K >= 8192 (timed: 4096x14336): 13.82 against 15.07 with two chunks in flight
      under launch bounds and the activations loaded just before their products;
    - 8192 <= N <= 16384, 4096 <= K < 8192 (timed: 14336x4096): 14.21 against 15.65 with two
      chunks in flight under launch bounds, shuffled activations and a 256-byte L2 hint.
    Other widths (the 8B stack's 6144-wide q/k/v sibling launch, N < 4096, ...) keep the plain
    launch."""
    if n == 4096 and 4096 <= k < 8192:
        return 1, {"x_shuffle": True, "unroll": True}
    if n == 4096 and k >= 8192:
        return 2, {"xl": True, "min_blocks": 2}
    if 8192 <= n <= 16384 and 4096 <= k < 8192:
        return 2, {"x_shuffle": True, "min_blocks": 2, "l2_prefetch": 256}
    return 1, {}


def _mma_plan(m: int, n: int, k: int, bits: int, gs: int = 64) -> KernelPlan:
    vw = next(v for v in (4, 2, 1) if k % (4 * v * 32 // bits) == 0)
    sc = 4 * vw * 32 // bits  # columns per chunk
    nchunks = k // sc
    wk = 1
    while wk < 16 and (n / 32) * wk < _TARGET_WARPS:
        wk *= 2
    wk = _WK_OVERRIDE.get((n, k, bits), _pow2_at_most(nchunks, wk))
    mb = 8 if m <= 8 else 16
    # Two tiles per warp from N = 8192, and in the 16-row bucket from N = 4096: on the H200 at
    # 16 rows NT 2 took 8.45 against 10.30 us on 4096x4096 and 19.68 against 26.02 on
    # 4096x14336 (twenty-fifth session, one launch each), 8.80 / 21.41 against 11.62 / 28.48
    # with U = 2 and late activations (twenty-fourth); at 8 rows and one row it was slower
    # (7.87 against 7.62, 7.68 against 6.69 on 4096x4096). In the 8-row bucket from N = 6144
    # (the 8B stack's q/k/v sibling launch): 11.39 against 13.90 us at 8 rows on the H100
    # (thirty-fourth session, medians of 6 launches; 4096x4096 8.58 against 8.51, a tie).
    # (one row outside the one-row forms below, e.g. 8-bit weights, keeps one tile below 8192)
    nt, u = (2 if n % 32 == 0 and n >= (4096 if mb == 16 else 6144 if m > 1 else 8192) else 1), 1
    path = {}
    if mb == 8 and m > 1 and bits == 4 and n >= 65536 and k >= 4096:
        # A vocabulary-wide LM head (8B stack: 128256x4096) at 2..8 rows: two chunks in flight
        # under launch bounds, activations loaded late: 128.3 against 153.7 us at 8 rows on the
        # H100 (thirty-fourth session). One row keeps the plain launch (untimed there).
        u, path = 2, {"xl": True, "min_blocks": 2}
    key = (n, k, bits, mb)
    # an 8-row-bucket override marked "multi_row_only" leaves one-row launches to the defaults
    overridden = not (m == 1 and _PATH_OVERRIDE.get(key, {}).get("multi_row_only", False))
    one_row = m == 1 and bits == 4 and k >= 4096 and n <= 16384
    if one_row:
        # One row over a long K: twice the blocks of one tile each keep more loads in flight.
        # Nsight Compute on the H200 (twenty-first session), 14336x4096: 16.6-16.9 us at
        # (WK, NT, U) = (8, 1, 1) against 19.6-20.4 at (8, 2, 1); at 8 rows two tiles win
        # (21.0-21.6 against 23.65 us). Wider N (the 8B stack's 28672-row gate/up sibling
        # launch) and 8-bit weights were not timed at NT = 1 and keep two tiles. NT changes no
        # row's arithmetic, so rows stay bit-identical across M.
        nt = 1
        tuned = overridden and (key in _NTU_OVERRIDE or key in _PATH_OVERRIDE)
        if ONE_ROW_FORMS and CONST_SHAPE and sc % gs == 0 and not tuned:
            u, path = _one_row_launch(n, k)
    if overridden:
        nt, u = _NTU_OVERRIDE.get(key, (nt, u))
        path = _PATH_OVERRIDE.get(key, path)
    # K as a compile-time constant (addresses as immediates): where a chunk holds whole groups.
    const_shape = bool(path.get("const_shape", CONST_SHAPE) and sc % gs == 0)
    xl = bool(const_shape and path.get("xl", False))
    unroll = bool(const_shape and path.get("unroll", UNROLL))
    # an L2 prefetch-size hint (bytes) on the weight loads: 0 (none), 64, 128 or 256
    l2_prefetch = int(path.get("l2_prefetch", 0)) if const_shape else 0
    if l2_prefetch not in (0, 64, 128, 256):
        raise ValueError(f"l2_prefetch={l2_prefetch}: 0, 64, 128 or 256 bytes")
    # The row count as a compile-time constant (MR): by default for one-row launches only
    # (their own compiled variant; 2..16 rows share their bucket's); path "fixed_rows" True
    # fixes every row count, False none. No row count is read from x's shape and the epilogue
    # skips the padding rows; the arithmetic, hence every row's bits, is unchanged.
    fixed = path.get("fixed_rows")
    mr = m if (fixed or (fixed is None and m == 1 and FIXED_ONE_ROW)) else 0
    # one fixed row: the activations held two registers per lane and shuffled (instead of XW
    # registers per lane, all zeros but row 0's), with the compile-time-shape loop
    x_shuffle = bool(path.get("x_shuffle", False) and const_shape and mr == 1 and mb == 8)
    min_blocks = int(path.get("min_blocks", 0))
    if n % (16 * nt):
        nt = 1
    # (launch bounds make ptxas fit the registers, spilling if it must: always launchable;
    # "exact": a benchmark's configuration whose registers it checked with ptxas)
    exact = min_blocks or path.get("exact", False)
    while u > 1 and not (exact or mma_config_fits(nt, u, mb, wk, xl)):
        u //= 2
    if not (exact or mma_config_fits(nt, u, mb, wk, xl)):
        nt = 1
    threads = 32 * wk
    # (KC = GS = 0 for the runtime-shape loop: one compiled variant for every shape and group)
    consts = (("BITS", bits), ("NT", nt), ("WK", wk), ("MB", mb), ("VW", vw), ("U", u),
              ("KC", k if const_shape else 0), ("GS", gs if const_shape else 0), ("XL", int(xl)),
              ("MR", mr), ("FU", int(unroll)), ("LP", l2_prefetch),
              ("XS", int(x_shuffle)))
    return KernelPlan("mma", "cuda", consts, (n // (16 * nt) * threads, 1, 1), (threads, 1, 1),
                      (("VW", vw), ("WK", wk)), min_blocks)


def _simd_plan(m: int, n: int, bits: int, be: str) -> KernelPlan:
    mb = 1
    while mb < m:
        mb *= 2
    r, nsg = 4, (2 if be == "metal" else 4)
    blocks = -(-n // (r * nsg))
    consts = (("BITS", bits), ("MB", mb), ("R", r), ("NSG", nsg))
    return KernelPlan("simd", be, consts, (blocks * 32 * nsg, 1, 1), (32 * nsg, 1, 1), ())


@functools.lru_cache(maxsize=4096)
def _plan_cached(m, n, k, bits, gs, dtype, be) -> KernelPlan | None:
    if be not in ("metal", "cuda") or not 1 <= m <= MAX_ROWS:
        return None
    if bits not in SUPPORTED_BITS or gs not in SUPPORTED_GROUP_SIZES or k % gs or n < 1:
        return None
    if dtype not in SUPPORTED_DTYPES:
        return None
    if be == "cuda" and dtype != mx.float32 and n % 16 == 0:
        return _mma_plan(m, n, k, bits, gs)
    return _simd_plan(m, n, bits, be)


def plan(m: int, n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype,
         backend_name: str | None = None) -> KernelPlan | None:
    """The kernel launch for ``m`` activation rows against an ``n x k`` quantized weight.

    Returns ``None`` when the reference path (``mx.quantized_matmul``) must be used: CPU
    backend, ``m`` outside 1..16, bits not 4/8, group size not 32/64/128, ``k`` not a
    multiple of the group size, or an activation dtype other than fp16/bf16/fp32.
    ``backend_name`` defaults to :func:`backend`.
    """
    be = backend() if backend_name is None else backend_name
    return _plan_cached(int(m), int(n), int(k), int(bits), int(group_size), dtype, be)


def _read(name: str) -> str:
    return (_SOURCES / name).read_text()


def _minify(src: str) -> str:
    """Drop ``//`` comments, indentation and blank lines (the sources have no string literal
    holding ``//``). MLX-CUDA builds the full kernel source into every call's primitive and
    a shorter source measurably cuts the per-call cost (docs/kernels.md: 15 KB of source
    cost +0.7 us to build and +2.7 us to evaluate a call on the H200 host)."""
    lines = []
    for line in src.splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            lines.append(code)
    return "\n".join(lines) + "\n"


def _sibling_store(nout: int) -> str:
    """The mma body's ``SSK_STORE`` for ``nout`` outputs ``y0..``: output i holds columns
    [S_i, S_{i+1}) of the concatenated weight (S_0 = 0, S_nout = N), row-major."""
    cuts = ["0"] + [f"S{i}" for i in range(1, nout)] + ["N"]
    cases = []
    for i in range(nout):
        lo, hi = cuts[i], cuts[i + 1]
        put = f"y{i}[(size_t)(m) * ({hi} - {lo}) + (n) - {lo}] = static_cast<T>(v);"
        cases.append(put if i == nout - 1 else f"if ((n) < {hi}) {{ {put} }} else ")
    return "#define SSK_STORE(m, n, v) do { " + "".join(cases) + " } while (0)\n"


def _launch_bounds(threads: int, min_blocks: int) -> str:
    """A header suffix that compiles the kernel MLX declares after it with
    ``__launch_bounds__(threads, min_blocks)``. mx.fast.cuda_kernel writes the ``__global__``
    declaration itself (mlx/backend/cuda/custom_kernel.cpp: default header, this header, then
    the kernel), so the only hook is the ``__global__`` macro (CUDA's crt/host_defines.h:
    ``__location__(global)``), redefined here; the kernel is the only declaration after it."""
    return (f"#undef __global__\n#define __global__ __location__(global) "
            f"__launch_bounds__({threads}, {min_blocks})\n")


_CONST_SHAPE_MARK = "// SSK_CONST_SHAPE_LOOP"


def kernel_sources(kind: str, be: str, nout: int = 1, bounds: tuple[int, int] | None = None,
                   const_shape: bool = False, extras: bool = False) -> tuple[str, str]:
    """(header, body) of one kernel family exactly as they are handed to MLX (minified).

    ``nout`` > 1 (mma only): the sibling variant with one output per fused projection.
    ``bounds`` = (threads, min_blocks) (CUDA only): compiled with those launch bounds.
    ``const_shape`` (mma only): with the compile-time-shape loop (``mma_const_shape.cu``, for
    plans with KC > 0), spliced in only where it runs: MLX builds a custom kernel's whole source
    into every call and hashes it at every evaluation, so the default launches keep the shorter
    source. ``extras`` (mma only): the helpers of the L2 prefetch hint and of shuffled
    activations (``mma_extras.cuh``) appended to the header, likewise only where used."""
    if nout != 1 and kind != "mma":
        raise ValueError("only the mma kernel has a sibling (multi-output) variant")
    if bounds and be != "cuda":
        raise ValueError("launch bounds are a CUDA kernel option")
    if (const_shape or extras) and kind != "mma":
        raise ValueError("the compile-time-shape loop and the extra helpers are the mma kernel's")
    if kind == "mma":
        header, body = _read("mma_cuda.cuh"), _read("mma_body.cu")
        if extras:
            header += _read("mma_extras.cuh")
        lines = body.splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if line.startswith(_CONST_SHAPE_MARK))
        lines[at] = _read("mma_const_shape.cu") if const_shape else ""
        body = "".join(lines)
        if nout > 1:
            body = _sibling_store(nout) + body
    elif be == "cuda":
        header, body = _read("simd_cuda.cuh"), _read("simd_cuda_prologue.inc") + _read(
            "simd_body.inc")
    else:
        header, body = _read("simd_metal.h"), _read("simd_metal_prologue.inc") + _read(
            "simd_body.inc")
    if bounds:
        header = header + _launch_bounds(*bounds)
    return _minify(header), _minify(body)


@functools.cache
def _kernel(kind: str, be: str, nout: int = 1, bounds: tuple[int, int] | None = None,
            const_shape: bool = False, extras: bool = False):
    """The mx.fast kernel object for one kernel family (compiled per template on first use);
    ``nout`` > 1: the mma kernel's sibling variant (outputs ``y0..``); ``bounds``: launch
    bounds (threads, min_blocks); ``const_shape``: with the compile-time-shape loop;
    ``extras``: with the helpers of the L2 prefetch hint and shuffled activations."""
    header, body = kernel_sources(kind, be, nout, bounds, const_shape, extras)
    # The source hash is in the name so an edited source never reuses a kernel compiled
    # under the same name (MLX caches compiled kernels by name).
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:10]
    lb = f"_lb{bounds[0]}x{bounds[1]}" if bounds else ""
    name = (f"specserve_qmv_{kind}{nout if nout > 1 else ''}{'_k' if const_shape else ''}"
            f"{'_x' if extras else ''}{lb}_{digest}")
    outs = ["y"] if nout == 1 else [f"y{i}" for i in range(nout)]
    args = dict(name=name, input_names=["x", "w", "scales", "biases"], output_names=outs,
                source=body, header=header, ensure_row_contiguous=True)
    if be == "cuda":
        return mx.fast.cuda_kernel(**args)
    return mx.fast.metal_kernel(**args)


def _kernel_for(p: KernelPlan, nout: int = 1):
    """The kernel object plan ``p`` launches (launch bounds, compile-time-shape loop, extras)."""
    return _kernel(p.kind, p.backend, nout, *p.source_options())


def run_plan(p: KernelPlan, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
             init_value: float | None = None) -> mx.array:
    """Launch plan ``p`` on ``x`` of shape (M, K); returns (M, N) in ``x.dtype``.

    Launches exactly what :func:`quantized_matmul` launches for that plan, without its
    shape checks (tests and benchmarks use it). ``init_value`` pre-fills the output (tests
    poison it with NaN to catch unwritten elements).

    Raises:
        ValueError: an mma plan compiled for a fixed row count (``MR`` > 0, one-row plans by
            default) with an ``x`` of another row count.
    """
    if p.kind == "mma" and p.const("MR") and x.size // x.shape[-1] != p.const("MR"):
        # (a fixed row count with another x would leave rows unwritten or read past x's end)
        raise ValueError(f"this plan is compiled for {p.const('MR')} rows; x has "
                         f"{x.size // x.shape[-1]}")
    template = [("T", x.dtype), ("S", scales.dtype), *p.consts]
    out = _kernel_for(p)(
        inputs=[x, w, scales, biases], template=template, grid=p.grid,
        threadgroup=p.threadgroup, output_shapes=[(x.shape[0], w.shape[0])],
        output_dtypes=[x.dtype], init_value=init_value)
    return out[0]


def reference_matmul(x, w, scales, biases=None, group_size=64, bits=4, mode="affine"):
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)``: the reference."""
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True,
                               group_size=group_size, bits=bits, mode=mode)


def _signature_plan(rows, n, k, wcols, sshape, bshape, xdt, wdt, sdt, bdt, bits, gs, be):
    if (gs not in SUPPORTED_GROUP_SIZES or wdt != mx.uint32 or wcols * 32 != k * bits or not k
            or k % gs or sshape != (n, k // gs)
            or bshape != sshape or sdt not in SUPPORTED_DTYPES or bdt != sdt):
        return None
    return _plan_cached(rows, n, k, bits, gs, xdt, be)


@functools.lru_cache(maxsize=4096)
def _launcher(rows, n, k, wcols, sshape, bshape, xdt, wdt, sdt, bdt, bits, gs, be):
    """(kernel, template, grid, threadgroup, nd) for one call signature, or None (reference).
    ``nd``: the kernel takes x as (..., K) (mma), else x is flattened to (rows, K)."""
    p = _signature_plan(rows, n, k, wcols, sshape, bshape, xdt, wdt, sdt, bdt, bits, gs, be)
    if p is None:
        return None
    return (_kernel_for(p), [("T", xdt), ("S", sdt), *p.consts], p.grid,
            p.threadgroup, p.kind == "mma")


@functools.lru_cache(maxsize=1024)
def sibling_launcher(rows, n, k, wcols, sshape, bshape, xdt, wdt, sdt, bdt, bits, gs, be, cuts):
    """:func:`_launcher` for projections fused along N at ``cuts`` (one output each), or
    None where the fused launch does not apply (not the mma kernel, more than 3 projections,
    cuts not strictly increasing inside (0, N)); the projections then run one launch each.
    The answer depends on the row count only through 1..16 (the kernel is mma for every
    row count of a given dtype and N), so decode and verify rows take the same path."""
    p = _signature_plan(rows, n, k, wcols, sshape, bshape, xdt, wdt, sdt, bdt, bits, gs, be)
    if p is None or p.kind != "mma" or not 1 <= len(cuts) <= 2:
        return None
    if any(c <= 0 or c >= n for c in cuts) or list(cuts) != sorted(set(cuts)):
        return None
    template = [("T", xdt), ("S", sdt), *p.consts, *((f"S{i + 1}", c) for i, c in enumerate(cuts))]
    return (_kernel_for(p, len(cuts) + 1), template, p.grid, p.threadgroup, True)


_MISSING = object()


def layer_matmul(layer, x: mx.array) -> mx.array:
    """``quantized_matmul`` for a quantized mlx layer (``weight``/``scales``/``biases``,
    ``group_size``, ``bits``, ``mode``), with the launch decision cached on the layer per
    (row count, input width, activation dtype, backend), so a decode step pays one dict lookup per matmul
    instead of re-deriving the plan. The cache is keyed on the identity of the layer's
    arrays: replacing them (``model.update``) invalidates it at the layer's next call (until
    then it keeps the replaced arrays alive). Same results as :func:`quantized_matmul`.
    """
    w, s, b = layer["weight"], layer["scales"], layer.get("biases")
    mode = getattr(layer, "mode", "affine")
    k = x.shape[-1]
    rows = x.size // k if k else 0
    state = layer.__dict__.get("_ssk_launch")
    if state is None or state[0] is not w or state[1] is not s or state[2] is not b:
        state = (w, s, b, {})
        object.__setattr__(layer, "_ssk_launch", state)  # nn.Module would store a tuple as a parameter
    be = backend()
    key = (rows, k, x.dtype, be, _CONFIG_GENERATION[0])
    launch = state[3].get(key, _MISSING)
    if launch is _MISSING:
        launch = None
        if mode == "affine" and b is not None and x.ndim >= 1 and w.ndim == 2:
            launch = _launcher(rows, w.shape[0], k, w.shape[1], s.shape, b.shape, x.dtype,
                               w.dtype, s.dtype, b.dtype, layer.bits, layer.group_size, be)
        state[3][key] = launch
    if launch is None:
        return reference_matmul(x, w, s, b, layer.group_size, layer.bits, mode)
    return _run(launch, x, w, s, b, rows)


def _run(launch, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, rows: int) -> mx.array:
    """Launch a :func:`_launcher` decision on ``x`` (..., K); returns (..., N)."""
    kernel, template, grid, tg, nd = launch
    n = w.shape[0]
    if nd:  # no reshapes: each is one more graph node for the host to build and dispatch
        return kernel(inputs=[x, w, scales, biases], template=template, grid=grid, threadgroup=tg,
                      output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype])[0]
    y = kernel(inputs=[x.reshape(rows, x.shape[-1]), w, scales, biases], template=template,
               grid=grid, threadgroup=tg, output_shapes=[(rows, n)], output_dtypes=[x.dtype])[0]
    return y.reshape(*x.shape[:-1], n)


def sibling_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                   cuts: tuple[int, ...], group_size: int, bits: int,
                   init_value: float | None = None) -> list[mx.array] | None:
    """Projections that read the same ``x`` (q/k/v, gate/up), in one kernel launch.

    ``w``/``scales``/``biases`` are the projections' weights concatenated along N (rows
    ``[0, cuts[0])`` are the first projection's, and so on; 2 or 3 projections). Returns one
    (..., N_i) output per projection, or ``None`` when the fused launch does not apply (rows
    outside 1..16, a kernel other than mma, unsupported layout): the caller then runs each
    projection on its own. Each row is bit-identical whatever the row count, as for
    :func:`quantized_matmul` (the split depends on (N, K, bits) of the concatenation, so the
    bits differ from unfused launches of the same projections: use one or the other for
    every pass of a model).
    """
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k if k else 0
    launch = sibling_launcher(rows, n, k, w.shape[1], scales.shape, biases.shape, x.dtype,
                               w.dtype, scales.dtype, biases.dtype, bits, group_size, backend(),
                               tuple(cuts))
    if launch is None:
        return None
    return run_sibling_launch(launch, x, w, scales, biases, cuts, init_value)


def run_sibling_launch(launch, x, w, scales, biases, cuts,
                       init_value: float | None = None) -> list[mx.array]:
    """Run a :func:`sibling_launcher` decision (a cached one: see patch.SiblingGroup).
    ``init_value`` pre-fills the outputs (tests poison them with NaN)."""
    kernel, template, grid, tg, _ = launch
    bounds = (0, *cuts, w.shape[0])
    lead = x.shape[:-1]
    return kernel(inputs=[x, w, scales, biases], template=template, grid=grid, threadgroup=tg,
                  output_shapes=[(*lead, bounds[i + 1] - bounds[i]) for i in range(len(cuts) + 1)],
                  output_dtypes=[x.dtype] * (len(cuts) + 1), init_value=init_value)


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None = None,
                     group_size: int = 64, bits: int = 4, mode: str = "affine", *,
                     kernels: str = "auto") -> mx.array:
    """``x @ dequantize(w).T`` for MLX affine-quantized ``w``, through the small-batch kernel.

    Args:
        x: activations, shape (..., K), float16/bfloat16/float32.
        w: packed weights, uint32 (N, K * bits / 32), from ``mx.quantize``.
        scales, biases: (N, K / group_size), float.
        group_size, bits, mode: as for ``mx.quantized_matmul``.
        kernels: ``"auto"`` uses a kernel when :func:`plan` finds one for the flattened
            row count; ``"off"`` always uses ``mx.quantized_matmul``.

    Returns (..., N) in ``x.dtype``. Inputs the kernels do not take (non-affine modes, no
    biases, mismatched shapes) go to ``mx.quantized_matmul``, which raises its own errors.
    """
    if kernels != "auto":
        if kernels != "off":
            raise ValueError(f"kernels must be 'auto' or 'off', not {kernels!r}")
    elif mode == "affine" and biases is not None and x.ndim >= 1 and w.ndim == 2:
        k, n = x.shape[-1], w.shape[0]
        rows = x.size // k if k else 0
        launch = _launcher(rows, n, k, w.shape[1], scales.shape, biases.shape, x.dtype, w.dtype,
                           scales.dtype, biases.dtype, bits, group_size, backend())
        if launch is not None:
            return _run(launch, x, w, scales, biases, rows)
    return reference_matmul(x, w, scales, biases, group_size, bits, mode)
