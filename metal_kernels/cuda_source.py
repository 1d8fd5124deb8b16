"""The qmv kernels' CUDA source as mx.fast.cuda_kernel compiles it, for offline checks.

MLX-CUDA builds each custom kernel's source at run time (``mlx/backend/cuda/custom_kernel.cpp``:
its default header, the kernel's header, then ``__global__ void name(<inputs, their shapes
where the body uses them, outputs>) { <template constants> <body> }``) and compiles it with
NVRTC. :func:`render_qmv` writes the same translation unit for a :class:`~metal_kernels.qmv.
KernelPlan`, so a CUDA toolkit without a GPU (``nvcc -arch=sm_90 -cubin``) can check that a
plan compiles, and :func:`ptxas_usage` reads back its registers and spills (tests/test_kernels.py;
``benchmarks/gpu/mma_sweep.py --regs``).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx

from . import qmv

CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}
# What MLX's default header provides to a custom kernel that these kernels use.
MLX_PRELUDE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
namespace mlx::core::cu { using Shape = cuda::std::array<int32_t, 10>; }
"""


def render_qmv(p: qmv.KernelPlan, xdt: mx.Dtype, sdt: mx.Dtype, fname: str, cuts: tuple[int, ...] = ()) -> str:
    """One kernel of plan ``p`` as mx.fast.cuda_kernel generates it; ``cuts``: the sibling
    variant with ``len(cuts) + 1`` outputs. A plan with launch bounds redefines ``__global__``
    in its header (as MLX compiles it); the rendering restores the macro after the kernel, so
    several kernels can share one translation unit."""
    options = p.source_options()
    header, body = qmv.kernel_sources(p.kind, "cuda", len(cuts) + 1, *options)
    bounds = options[0]
    sig = []
    for name, ctype in (("x", CUDA_TYPES[xdt]), ("w", "uint32_t"), ("scales", CUDA_TYPES[sdt]),
                        ("biases", CUDA_TYPES[sdt])):
        sig.append(f"const {ctype}* {name},")
        if f"{name}_shape" in body:
            sig.append(f"const __grid_constant__ Shape {name}_shape,")
        if f"{name}_ndim" in body:
            sig.append(f"const __grid_constant__ int {name}_ndim,")
    outs = ["y"] if not cuts else [f"y{i}" for i in range(len(cuts) + 1)]
    sig.append(", ".join(f"{CUDA_TYPES[xdt]}* {o}" for o in outs))
    consts = "".join(f"constexpr int {k} = {v};\n" for k, v in
                     (*p.consts, *((f"S{i + 1}", c) for i, c in enumerate(cuts))))
    push, pop = ('#pragma push_macro("__global__")\n', '#pragma pop_macro("__global__")\n') if bounds else ("", "")
    return (f"{push}{header}\nnamespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n"
            f"__global__ void {fname}(\n{''.join(sig)}) {{\n"
            f"using T = {CUDA_TYPES[xdt]};\nusing S = {CUDA_TYPES[sdt]};\n{consts}\n{body}\n}}\n}}\n{pop}")


def ptxas_usage(source: str, nvcc: str = "nvcc", arch: str = "sm_90", timeout: float = 600) -> dict[str, dict]:
    """Compile ``source`` (kernels rendered by :func:`render_qmv` after :data:`MLX_PRELUDE`) to
    a cubin; per kernel name: ``registers``, ``stack_frame``, ``spill_stores`` and
    ``spill_loads`` (bytes), as ptxas reports them.

    Raises:
        RuntimeError: the compilation failed (the compiler's last output in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.cu"
        src.write_text(source)
        # (--diag-error=821: an inline function referenced and not defined is an error, as NVRTC,
        # which MLX compiles with, makes it; nvcc alone only warns)
        res = subprocess.run([nvcc, f"-arch={arch}", "-std=c++17", "-cubin", "-Xptxas", "-v", "--diag-error=821",
                              "-o", str(Path(tmp) / "k.cubin"), str(src)],
                             capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-4000:])
    usage, current = {}, None
    for line in res.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for", line)
        if m:
            current = _unmangle(m.group(1))
            usage[current] = {}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame", line)
        if m:
            usage[current]["stack_frame"] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            usage[current].update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            usage[current]["registers"] = int(m.group(1))
    return usage


def _unmangle(name: str) -> str:
    """The last component of an Itanium nested name (``_ZN3mlx4core2cu2k0EPK...`` -> ``k0``)."""
    if not name.startswith("_ZN"):
        return name
    i, last = 3, name
    while i < len(name) and name[i].isdigit():
        j = i
        while name[j].isdigit():
            j += 1
        size = int(name[i:j])
        last, i = name[j:j + size], j + size
    return last
