"""Small-batch quantized matmul kernels (Metal and CUDA) for exact speculative verify.

Imports only mlx. Entry points: :func:`patch_model` (the engine calls it once after loading
the target), :func:`quantized_matmul` (drop-in for ``mx.quantized_matmul(transpose=True)``)
and :func:`plan` (the dispatch decision). See docs/kernels.md.
"""

from metal_kernels.patch import (
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
    PatchReport,
    patch_model,
    swap_layers,
    unpatch_model,
)
from metal_kernels.qmv import (
    MAX_ROWS,
    KernelPlan,
    backend,
    plan,
    quantized_matmul,
    reference_matmul,
)

__all__ = [
    "MAX_ROWS",
    "KernelPlan",
    "KernelQuantizedEmbedding",
    "KernelQuantizedLinear",
    "PatchReport",
    "backend",
    "patch_model",
    "plan",
    "quantized_matmul",
    "reference_matmul",
    "swap_layers",
    "unpatch_model",
]
