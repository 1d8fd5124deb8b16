"""Swap an mlx-lm model's quantized layers for ones that dispatch to the small-batch kernels.

``patch_model(model, mode)`` is called once after the target is loaded. With
``mode="auto"`` on a GPU backend (Metal or CUDA) every ``nn.QuantizedLinear`` (the
projections and an untied LM head) and every ``nn.QuantizedEmbedding`` (whose
``as_linear`` is the tied LM head) whose layout the kernels take becomes a dispatching
layer: same parameters, same object, only its class changes, so weights, freezing and
saving are untouched. Calls with 1..16 rows go through :func:`metal_kernels.qmv.
quantized_matmul`, others through ``mx.quantized_matmul``. With ``mode="off"`` or on the
CPU backend nothing is changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.nn as nn

from metal_kernels.qmv import (
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    backend,
    layer_matmul,
)

MODES = ("auto", "off")


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose matmul goes through the small-batch dispatcher."""

    def __call__(self, x):
        y = layer_matmul(self, x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (tied LM head) goes through the dispatcher."""

    def as_linear(self, x):
        return layer_matmul(self, x)


_SWAPS = {nn.QuantizedLinear: KernelQuantizedLinear,
          nn.QuantizedEmbedding: KernelQuantizedEmbedding}
_UNSWAPS = {v: k for k, v in _SWAPS.items()}


@dataclass
class PatchReport:
    """What :func:`patch_model` did.

    ``patched``: module paths now dispatching; ``skipped``: (path, reason) for quantized
    layers left alone; ``reason``: why nothing was patched, if so.
    """

    mode: str
    backend: str
    patched: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    reason: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.patched)

    def summary(self) -> str:
        """One log line (the start-up log: the target's passes are reported separately)."""
        head = f"small-batch matmul kernels (SPECSERVE_KERNELS={self.mode}) on {self.backend}"
        if not self.patched:
            return f"{head}: not patched ({self.reason})"
        s = f"{head}: {len(self.patched)} layers patched"
        return s + (f", {len(self.skipped)} skipped" if self.skipped else "")


def _unsupported(m: nn.Module) -> str:
    if getattr(m, "mode", "affine") != "affine":
        return f"mode {m.mode!r}"
    if m.bits not in SUPPORTED_BITS:
        return f"{m.bits}-bit"
    if m.group_size not in SUPPORTED_GROUP_SIZES:
        return f"group size {m.group_size}"
    if m.get("biases") is None:
        return "no biases"
    return ""


def swap_layers(model: nn.Module, report: PatchReport | None = None) -> PatchReport:
    """Make every supported quantized layer of ``model`` a dispatching layer, in place.

    Works on any backend (on the CPU the dispatcher always picks ``mx.quantized_matmul``,
    so results are unchanged); :func:`patch_model` is the policy-aware entry point.
    Idempotent; only exact ``nn.QuantizedLinear``/``nn.QuantizedEmbedding`` instances are
    touched (subclasses may override ``__call__``).
    """
    report = report or PatchReport(mode="auto", backend=backend())
    for path, m in model.named_modules():
        new_cls = _SWAPS.get(type(m))
        if new_cls is None:
            if type(m) in _UNSWAPS:
                report.patched.append(path)
            continue
        why = _unsupported(m)
        if why:
            report.skipped.append((path, why))
            continue
        m.__class__ = new_cls
        report.patched.append(path)
    return report


def unpatch_model(model: nn.Module) -> int:
    """Undo :func:`swap_layers`/:func:`patch_model`; returns the number of layers restored."""
    n = 0
    for _, m in model.named_modules():
        old = _UNSWAPS.get(type(m))
        if old is not None:
            m.__class__ = old
            n += 1
    return n


def patch_model(model: nn.Module, mode: str = "auto") -> PatchReport:
    """Route ``model``'s quantized matmuls through the small-batch kernels where they apply.

    Args:
        model: an mlx-lm model (any ``nn.Module``), modified in place.
        mode: ``"auto"`` patches on a GPU backend (Metal or CUDA, MLX's default device)
            and does nothing on the CPU; ``"off"`` does nothing. (``SPECSERVE_KERNELS``.)

    Returns a :class:`PatchReport`. Raises ``ValueError`` for another mode.
    """
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, not {mode!r}")
    report = PatchReport(mode=mode, backend=backend())
    if mode == "off":
        report.reason = "disabled"
        return report
    if report.backend == "cpu":
        report.reason = "no GPU backend: the CPU uses mx.quantized_matmul"
        return report
    swap_layers(model, report)
    if not report.patched:
        report.reason = "no supported quantized layers"
    return report
