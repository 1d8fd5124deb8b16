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

import mlx.core as mx
import mlx.nn as nn

from metal_kernels.qmv import (
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    backend,
    config_generation,
    layer_matmul,
    run_sibling_launch,
    sibling_launcher,
)

MODES = ("auto", "off")


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose matmul goes through the small-batch dispatcher (and, for
    a member of a :class:`SiblingGroup`, through its group's one launch)."""

    def __call__(self, x):
        member = self.__dict__.get("_ssk_sibling")
        y = layer_matmul(self, x) if member is None else member[0].output(member[1], self, x)
        if "bias" in self:
            y = y + self["bias"]
        return y


# Projections of one module that read the same input in mlx-lm's Llama/Qwen/Mistral-style
# blocks: ``attn(x)`` calls q_proj(x), k_proj(x), v_proj(x); ``mlp(x)`` gate_proj(x), up_proj(x).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SiblingGroup:
    """Two or three projections that read the same input, computed by one kernel launch.

    The members' weights, scales and biases are concatenated along N once; each member's
    arrays become row slices (views) of the concatenation, so no memory is added and every
    other path (``mx.quantized_matmul`` for prefill, unpatching, saving) still sees each
    member's own weights. The first member called on an input ``x`` launches the fused
    kernel (:func:`metal_kernels.qmv.sibling_matmul`) and keeps the outputs; the others, called
    on the same ``x`` object, take theirs. Where the fused launch does not apply (more than 16
    rows, fp32 activations, Metal, the CPU) each member computes alone.

    Contract (mlx-lm's blocks keep it): the members are called one after another on one
    thread (the engine builds graphs on a single worker thread), and ``x`` is not modified in
    place (``x += ...``, ``x[...] = ...``) between the members' calls. If a member's arrays are
    replaced after grouping (``model.update``, ``load_weights``), the group dissolves: every
    member computes alone from then on, for every row count.

    Why: a decode or verify pass of an 8B-shaped Llama is bound by the host's cost per
    graph node (benchmarks/gpu/host_split.py); this removes 3 of 7 launches per layer.
    """

    def __init__(self, layers):
        self.bits, self.group_size = layers[0].bits, layers[0].group_size
        ns = [m["weight"].shape[0] for m in layers]
        self.cuts = tuple(sum(ns[:i + 1]) for i in range(len(ns) - 1))
        cat = {key: mx.concatenate([m[key] for m in layers]) for key in ("weight", "scales", "biases")}
        mx.eval(cat)
        self.weight, self.scales, self.biases = cat["weight"], cat["scales"], cat["biases"]
        lo = 0
        for i, (m, n) in enumerate(zip(layers, ns)):
            m.update({key: cat[key][lo:lo + n] for key in cat})
            object.__setattr__(m, "_ssk_sibling", (self, i))
            lo += n
        mx.eval([m.parameters() for m in layers])
        self._members = [(m, tuple(m[key] for key in cat)) for m in layers]
        self.dissolved = False
        self._launches: dict = {}
        self._x = None
        self._ys: list | None = None
        self._taken: set[int] = set()

    def _intact(self) -> bool:
        """Whether every member still holds the views made at grouping (identity)."""
        if not self.dissolved and any(
                m[k] is not a for m, arrays in self._members for k, a in zip(
                    ("weight", "scales", "biases"), arrays)):
            self.dissolved = True
            self._launches.clear()
        return not self.dissolved

    def _launch(self, x):
        key = (x.size // x.shape[-1] if x.shape[-1] else 0, x.shape[-1], x.dtype, backend(),
               config_generation())
        launch = self._launches.get(key, False)
        if launch is False:
            w, s, b = self.weight, self.scales, self.biases
            launch = self._launches[key] = sibling_launcher(
                key[0], w.shape[0], key[1], w.shape[1], s.shape, b.shape, x.dtype, w.dtype,
                s.dtype, b.dtype, self.bits, self.group_size, key[3], self.cuts)
        return launch

    def output(self, index: int, layer: nn.Module, x: mx.array) -> mx.array:
        """Member ``index``'s product with ``x`` (no bias), shape (..., N_index)."""
        if self._x is not x or index in self._taken:
            self._x = self._ys = None
            launch = self._launch(x) if self._intact() else None
            if launch is None:
                return layer_matmul(layer, x)
            ys = run_sibling_launch(launch, x, self.weight, self.scales, self.biases, self.cuts)
            self._x, self._ys, self._taken = x, ys, set()
        y = self._ys[index]
        self._taken.add(index)
        if len(self._taken) == len(self._members):  # every member served: let the arrays go
            self._x = self._ys = None
        return y


def _group_siblings(model: nn.Module) -> int:
    """Form a :class:`SiblingGroup` wherever all members of a :data:`SIBLINGS` set are
    patched layers of one module with the same input width, bits, group size and dtypes.
    Returns the number of groups (existing ones count; idempotent)."""
    groups = 0
    for _, parent in model.named_modules():
        for names in SIBLINGS:
            layers = [parent.get(n) if isinstance(parent, dict) else None for n in names]
            if not all(type(m) is KernelQuantizedLinear for m in layers):
                continue
            if all(m.__dict__.get("_ssk_sibling") is not None for m in layers):
                groups += 1
                continue
            ref = layers[0]
            if any(m.bits != ref.bits or m.group_size != ref.group_size
                   or m.__dict__.get("_ssk_sibling") is not None
                   or m["weight"].shape[1] != ref["weight"].shape[1]
                   or m["scales"].dtype != ref["scales"].dtype
                   or m["biases"].dtype != ref["biases"].dtype for m in layers):
                continue
            SiblingGroup(layers)
            groups += 1
    return groups


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
    sibling_groups: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.patched)

    def summary(self) -> str:
        """One log line (the start-up log: the target's passes are reported separately)."""
        head = f"small-batch matmul kernels (SPECSERVE_KERNELS={self.mode}) on {self.backend}"
        if not self.patched:
            return f"{head}: not patched ({self.reason})"
        s = f"{head}: {len(self.patched)} layers patched"
        if self.sibling_groups:
            s += f", {self.sibling_groups} sibling groups (q/k/v, gate/up) in one launch each"
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


def swap_layers(model: nn.Module, report: PatchReport | None = None,
                siblings: bool = True) -> PatchReport:
    """Make every supported quantized layer of ``model`` a dispatching layer, in place.

    Works on any backend (on the CPU the dispatcher always picks ``mx.quantized_matmul``,
    so results are unchanged); :func:`patch_model` is the policy-aware entry point.
    Idempotent; only exact ``nn.QuantizedLinear``/``nn.QuantizedEmbedding`` instances are
    touched (subclasses may override ``__call__``). ``siblings``: also fuse the projections
    that read one input into :class:`SiblingGroup` s (``report.sibling_groups``).
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
    if siblings:
        report.sibling_groups = _group_siblings(model)
    return report


def unpatch_model(model: nn.Module) -> int:
    """Undo :func:`swap_layers`/:func:`patch_model`; returns the number of layers restored."""
    n = 0
    for _, m in model.named_modules():
        old = _UNSWAPS.get(type(m))
        if old is not None:
            m.__dict__.pop("_ssk_sibling", None)  # (its weights stay views of the group's arrays)
            m.__class__ = old
            n += 1
    return n


def patch_model(model: nn.Module, mode: str = "auto", siblings: bool = True) -> PatchReport:
    """Route ``model``'s quantized matmuls through the small-batch kernels where they apply.

    Args:
        model: an mlx-lm model (any ``nn.Module``), modified in place.
        mode: ``"auto"`` patches on a GPU backend (Metal or CUDA, MLX's default device)
            and does nothing on the CPU; ``"off"`` does nothing. (``SPECSERVE_KERNELS``.)
        siblings: fuse q/k/v and gate/up into one launch each (:class:`SiblingGroup`).

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
    swap_layers(model, report, siblings=siblings)
    if not report.patched:
        report.reason = "no supported quantized layers"
    return report
