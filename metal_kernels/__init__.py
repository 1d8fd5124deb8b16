"""Small-batch quantized matmul kernels (Metal and CUDA) for exact speculative verify.

Imports only mlx. Entry points: :func:`patch_model` (the engine calls it once after loading
the target), :func:`quantized_matmul` (drop-in for ``mx.quantized_matmul(transpose=True)``)
and :func:`plan` (the dispatch decision); :func:`make_fused_pass` (whole decode/verify passes
in one call: the CUDA kernel of :mod:`metal_kernels.fused` or the C twin of
:mod:`metal_kernels.fused_cpu`). See docs/kernels.md.
"""

from metal_kernels.patch import (
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
    PatchReport,
    SiblingGroup,
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
    sibling_matmul,
)


def fused_unsupported_reason(model, quantized=None) -> str:
    """Empty when :func:`make_fused_pass` can build a pass for ``model`` on this backend, else
    why not. ``quantized``: the model's quantized layers by path when it holds dequantized
    weights (``engine.loader.LoadedModel.quantized``; used on the CPU)."""
    from metal_kernels import fused, fused_cpu

    if fused.backend() == "cpu":
        return fused_cpu.unsupported_reason(model, quantized)
    return fused.unsupported_reason(model)


def make_fused_pass(model, quantized=None, cpu_activations: str = "q16"):
    """The backend's one-call decode/verify pass: :class:`metal_kernels.fused_cpu.CpuFusedPass`
    on the CPU (``cpu_activations``: its ``activations``, ``q16``, ``q8`` or ``float32``),
    :class:`metal_kernels.fused.FusedPass` on CUDA (same call interface).

    Raises:
        ValueError: unsupported model or backend (the message says why).
    """
    from metal_kernels import fused, fused_cpu

    if fused.backend() == "cpu":
        return fused_cpu.CpuFusedPass(model, quantized, activations=cpu_activations)
    return fused.FusedPass(model)


__all__ = [
    "MAX_ROWS",
    "KernelPlan",
    "KernelQuantizedEmbedding",
    "KernelQuantizedLinear",
    "PatchReport",
    "SiblingGroup",
    "backend",
    "fused_unsupported_reason",
    "make_fused_pass",
    "patch_model",
    "plan",
    "quantized_matmul",
    "reference_matmul",
    "sibling_matmul",
    "swap_layers",
    "unpatch_model",
]
