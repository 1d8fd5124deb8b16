"""Load and save DSpark drafters in the DeepSpec / Hugging Face layout.

A checkpoint directory holds ``config.json`` (see :mod:`drafters.dspark.config`) and one or more
``*.safetensors`` files with these tensor names (optionally prefixed ``model.``):

* ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``
* ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``
* ``norm.weight``, ``fc.weight`` ``[d, m*d]``, ``hidden_norm.weight``
* ``markov_head.markov_w1.weight`` ``[V, r]``, ``markov_head.markov_w2.weight`` ``[V, r]``
* ``confidence_head.proj.weight`` ``[1, d+r]``, ``confidence_head.proj.bias`` ``[1]``
* optional ``embed_tokens.weight`` / ``lm_head.weight`` ``[V, d]``: DeepSpec ships frozen copies
  of the target's; the drafter always uses the target's own, so these are shape-checked and
  dropped (z-lab and our checkpoints omit them).
* optional ``d2t`` ``[V']`` (and ``t2d`` ``[V]``), with ``config.json["draft_vocab_size"]``: a
  draft vocabulary as EAGLE-3 / speculators store one (:mod:`drafters.dspark.vocab`); kept as
  ``DSparkModel.draft_vocab`` (target ids) and drafted from the target's LM head rows. A
  reduced-vocabulary drafter with an LM head of its own (``lm_head.weight`` ``[V', d]``) is
  not supported.

Quantized checkpoints (written by :func:`save_dspark` with ``bits``) use MLX's affine
quantization, stored the way mlx-lm stores quantized models: a quantized matrix ``<name>`` is
``<name>.weight`` (uint32, ``32 / bits`` values per word, shape ``[out, in * bits / 32]``),
``<name>.scales`` and ``<name>.biases`` (``[out, in / group_size]``, float), with
``config.json["quantization"] = {"group_size": g, "bits": b, "mode": "affine"}``; value =
``scale * q + bias`` per group of ``g`` inputs. The loader quantizes exactly the modules whose
``.scales`` are present, so plain and quantized files load through the same call.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from .config import DSparkConfig
from .model import DSparkModel
from .vocab import d2t_from_ids, ids_from_d2t

log = logging.getLogger("specserve.dspark")

_SHARED = ("embed_tokens.", "lm_head.")
_IGNORED = ("rotary_emb.inv_freq", "mask_embedding")
_REDUCED_VOCAB = ("d2t", "t2d", "draft_id_to_target_id")  # (vLLM renames d2t draft_id_to_target_id)


def _read_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def _normalise(weights: dict[str, mx.array], cfg: DSparkConfig) -> tuple[dict[str, mx.array], dict]:
    """Strip a ``model.`` prefix, check and drop the shared embedding/LM head copies; returns
    the network's tensors and the draft vocabulary's (``d2t``, ``t2d``) apart."""
    out, vocab = {}, {}
    for name, value in weights.items():
        key = name[len("model."):] if name.startswith("model.") else name
        if key in _REDUCED_VOCAB:
            slot = "t2d" if key == "t2d" else "d2t"
            if slot in vocab:
                raise ValueError(f"two draft vocabulary maps ({slot}): {name} and another")
            vocab[slot] = value
            continue
        if key.startswith(_SHARED):
            if key.startswith("lm_head.") and value.shape[0] != cfg.vocab_size:
                # (an LM head over a reduced vocabulary: EAGLE-3 style, the drafter's own rows)
                raise NotImplementedError(f"{name} has {value.shape[0]} rows, not the target's {cfg.vocab_size}: "
                                          "a reduced-vocabulary drafter with an LM head of its own is not "
                                          "supported (the drafter uses the target's LM head rows)")
            if key.endswith(".weight") and value.dtype != mx.uint32:
                want = (cfg.vocab_size, cfg.hidden_size)
                if tuple(value.shape) != want:
                    raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {want}: "
                                     "the drafter's vocabulary/width must match the target's")
            continue
        if key in _IGNORED:
            continue
        out[key] = value
    return out, vocab


def _draft_vocab(vocab: dict, cfg: DSparkConfig):
    """Target ids ``[V']`` of the checkpoint's draft vocabulary, or None (checked against
    ``draft_vocab_size``)."""
    size = cfg.extra.get("draft_vocab_size")
    if "d2t" not in vocab:
        if "t2d" in vocab or (size is not None and int(size) != cfg.vocab_size):
            raise ValueError(f"draft_vocab_size {size} or t2d without d2t (the draft-to-target map)")
        return None
    t2d = np.array(vocab["t2d"]) if "t2d" in vocab else None
    ids = ids_from_d2t(np.array(vocab["d2t"]), cfg.vocab_size, t2d)
    if size is not None and int(size) != ids.size:
        raise ValueError(f"draft_vocab_size {size} but d2t has {ids.size} entries")
    return ids


def load_dspark(path: str | Path, dtype: str | None = "float32", dequantize: bool = False,
                check_matmuls: bool | None = None) -> DSparkModel:
    """Load a drafter checkpoint directory (DeepSpec layout, plain or MLX-quantized).

    Args:
        path: directory with ``config.json`` and ``*.safetensors``.
        dtype: cast floating parameters (and quantization scales/biases) to this MLX dtype
            name; None keeps the stored dtypes. float32 suits the CPU backend.
        dequantize: turn quantized layers back into float ones (faster on the CPU backend).
        check_matmuls: check the quantized layers that stay quantized against their dequantized
            weights (:func:`guard_quantized_matmuls`); None: on backends other than the CPU.

    Returns:
        The network (``.config`` holds the :class:`DSparkConfig`), evaluated.

    Raises:
        FileNotFoundError: missing config.json or weights.
        ValueError: missing, unexpected or mis-shaped tensors (names are listed), or a draft
            vocabulary (``d2t``, ``t2d``, ``draft_vocab_size``) that disagrees with itself or
            leaves the target vocabulary.
        NotImplementedError: unsupported variants (gated/rnn Markov, a reduced vocabulary with
            an LM head of its own).
    """
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    cfg = DSparkConfig.from_dict(raw)
    weights, vocab = _normalise(_read_weights(path), cfg)
    draft_vocab = _draft_vocab(vocab, cfg)
    if cfg.enable_confidence_head and "confidence_head.proj.weight" not in weights:
        log.warning("%s: config enables the confidence head but it has no weights; disabled", path)
        cfg.enable_confidence_head = False
    model = DSparkModel(cfg)
    if cfg.quantization:
        q = cfg.quantization
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ValueError(f"{path}: tensors do not match the DeepSpec layout for this config: {exc}") from exc
    if dtype is not None:  # before dequantizing: scales in the target dtype, no extra rounding
        target = getattr(mx, dtype)
        model.update(tree_map(
            lambda x: x.astype(target) if mx.issubdtype(x.dtype, mx.floating) else x,
            model.parameters()))
    if dequantize and cfg.quantization:
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
        cfg.quantization = None
    if check_matmuls is None:
        check_matmuls = mx.default_device().type != mx.cpu  # (the CPU backend: MLX's reference)
    if cfg.quantization and check_matmuls:
        for name, why in guard_quantized_matmuls(model):
            log.warning("%s: %s multiplies with its dequantized weights: %s", path, name, why)
    mx.eval(model.parameters())
    model.eval()
    model.draft_vocab = draft_vocab
    return model


class DenseQuantizedLinear(nn.QuantizedLinear):
    """A ``QuantizedLinear`` that multiplies with a float copy of its dequantized weights.

    The packed ``weight``/``scales``/``biases`` stay as they are (parameters, export, and the
    fused draft launch read them). ``__call__`` multiplies with their dequantization, a snapshot
    taken by :meth:`refresh` (an instance attribute, not a parameter; 4 bytes per weight in
    float32, 12.6 MB for a 49,152 x 64 Markov table): call it again after replacing the arrays.
    :func:`guard_quantized_matmuls` turns a layer into one, in place, where the backend's
    ``mx.quantized_matmul`` is wrong or missing for its shape.
    """

    def refresh(self) -> None:
        dense = _dequantized(self)
        mx.eval(dense)  # (a lazy copy would be dequantized again inside every compiled call)
        self.__dict__["_dense"] = dense

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.__dict__["_dense"].T
        return y + self["bias"] if "bias" in self else y


def _dequantized(layer: nn.QuantizedLinear) -> mx.array:
    return mx.dequantize(layer["weight"], layer["scales"], layer["biases"], group_size=layer.group_size,
                         bits=layer.bits, mode=getattr(layer, "mode", "affine"))


def guard_quantized_matmuls(model: nn.Module, rows: tuple[int, ...] = (1, 8)) -> list[tuple[str, str]]:
    """Check each affine ``nn.QuantizedLinear`` of ``model`` against its dequantized weights on
    the current backend, and turn the ones that fail into :class:`DenseQuantizedLinear`, in place.

    Why: on MLX-CUDA 0.32.4, ``mx.quantized_matmul`` with one quantization group per row returned
    zeros or values around 1e-38 at K = 128, group 128 (docs/kernels.md); a rank-64 Markov head's
    ``markov_w2`` (K = 64, group 64) failed the fused draft's probe against MLX's ops and
    drafted nothing accepted on an H100; and K = 64 with group 32 raises "No implementation for
    problem shape". The failures are gross, so the check is loose: the layer's own dtype against
    a float32 reference, within 1e-3 of max |y| for float32 and 5e-2 for 16-bit types (whose
    rounding alone reaches ~1.5e-2). On the CPU backend every layer passes.

    Args:
        rows: input row counts to try (MLX picks its kernel by the row count, among other things;
            2-D inputs only).

    Returns:
        ``[(module path, reason)]`` for the layers turned dense.
    """
    swapped = []
    for name, layer in model.named_modules():
        if type(layer) is not nn.QuantizedLinear or getattr(layer, "mode", "affine") != "affine":
            continue
        dense = _dequantized(layer).astype(mx.float32)
        k, dtype = dense.shape[-1], layer.scales.dtype
        tol = 1e-3 if dtype == mx.float32 else 5e-2
        why = ""
        for m in rows:
            x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
            want = x.astype(mx.float32) @ dense.T
            try:
                got = mx.quantized_matmul(x, layer.weight, layer.scales, layer.biases, transpose=True,
                                          group_size=layer.group_size, bits=layer.bits, mode="affine")
                err, scale = mx.abs(got.astype(mx.float32) - want).max(), mx.abs(want).max()
                mx.eval(err, scale)
                err, scale = err.item(), scale.item()
            except (RuntimeError, ValueError) as exc:  # (MLX: no kernel for this shape)
                why = f"mx.quantized_matmul failed for {m} rows of {k}: {exc}"
                break
            if not err <= tol * scale + 1e-6:  # (also NaN)
                why = f"mx.quantized_matmul is off by {err:.3g} (max |y| {scale:.3g}) for {m} rows of {k}"
                break
        if why:
            layer.__class__ = DenseQuantizedLinear  # (in place: same arrays, same module tree)
            layer.refresh()
            swapped.append((name, why))
    return swapped


def quantizable(group_size: int):
    """``nn.quantize``'s ``class_predicate`` for what :func:`save_dspark` quantizes: every
    Linear/Embedding whose input width is a multiple of ``group_size``, except the confidence
    head (a 1-output matrix that quantizing would only blur)."""
    def predicate(path: str, module: nn.Module) -> bool:
        if path.startswith("confidence_head") or not isinstance(module, (nn.Linear, nn.Embedding)):
            return False
        return module.weight.shape[-1] % group_size == 0
    return predicate


def _clone(model: DSparkModel, cfg: DSparkConfig) -> DSparkModel:
    """A separate network with ``model``'s weights (quantized layers stay quantized)."""
    flat = dict(tree_flatten(model.parameters()))
    copy = DSparkModel(cfg)
    if cfg.quantization:
        q = cfg.quantization
        nn.quantize(copy, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                    class_predicate=lambda p, m: f"{p}.scales" in flat)
    copy.load_weights(list(flat.items()), strict=True)
    return copy


def save_dspark(model: DSparkModel, out: str | Path, *, bits: int | None = None,
                group_size: int = 64, dtype: str | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the DeepSpec layout (no embed/LM head).

    Args:
        bits: quantize the big matrices (every Linear/Embedding except the confidence head whose
            input width is a multiple of ``group_size``) to this many bits (2, 3, 4, 5, 6, 8);
            None writes plain tensors.
        dtype: cast floating tensors (and scales/biases) to this dtype first; None keeps them.
    Returns:
        The directory written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = DSparkConfig.from_dict(model.config.to_dict())
    copy = _clone(model, cfg)
    if dtype is not None:
        target = getattr(mx, dtype)
        copy.update(tree_map(
            lambda x: x.astype(target) if mx.issubdtype(x.dtype, mx.floating) else x, copy.parameters()))
    if bits is not None:
        if cfg.quantization:
            raise ValueError("the model is already quantized")
        nn.quantize(copy, group_size=group_size, bits=bits, class_predicate=quantizable(group_size))
        cfg.quantization = {"group_size": group_size, "bits": bits, "mode": "affine"}
    weights = dict(tree_flatten(copy.parameters()))
    if model.draft_vocab is not None:  # (EAGLE-3's offsets; int64 as its checkpoints store them)
        ids = np.asarray(model.draft_vocab).reshape(-1)
        weights["d2t"] = mx.array(d2t_from_ids(ids))
        cfg.extra["draft_vocab_size"] = int(ids.size)
    else:
        cfg.extra.pop("draft_vocab_size", None)
    mx.eval(weights)
    fmt = "mlx" if cfg.quantization else "pt"
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": fmt})
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    return out
