"""The DSpark draft configuration (DeepSpec ``config.json`` schema).

A DeepSpec draft config is a deep copy of the target's Hugging Face config with the draft's
fields overridden or added ([DeepSpec] ``build_draft_config``; see docs/dspark.md):
``num_hidden_layers`` (the draft's layers), ``block_size``, ``target_layer_ids``,
``mask_token_id``, ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
``confidence_head_with_markov``, ``num_target_layers``. :meth:`DSparkConfig.from_dict` reads
that schema and ignores every other key; :meth:`DSparkConfig.to_dict` writes it back on top of
the original dictionary so unknown keys survive a load/save round trip.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Default tap layers: z-lab DFlash ``build_target_layer_ids``.

    One tap: ``[N // 2]``; otherwise ``num_taps`` ids evenly spaced from 1 to ``N - 3``,
    rounded half to even (Python ``round``). Examples: ``(36, 5) -> [1, 9, 17, 25, 33]``,
    ``(30, 5) -> [1, 8, 14, 20, 27]``.
    """
    if num_taps < 1:
        raise ValueError("num_taps must be >= 1")
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_taps - 1))) for i in range(num_taps)]


def validate_target_layer_ids(layer_ids: list[int], num_target_layers: int | None) -> list[int]:
    """Check tap ids: strictly increasing, each ``-1`` (embedding output) or a decoder layer
    ``0..N-2``. The last layer is refused: Hugging Face returns it after the final norm, so a
    DeepSpec-trained drafter would see a different tensor there ([DeepSpec]
    ``assert_no_final_target_layer``).

    Raises:
        ValueError: empty, unordered or out-of-range ids.
    """
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("target_layer_ids must not be empty")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"target_layer_ids must be strictly increasing, got {ids}")
    if ids[0] < -1:
        raise ValueError(f"target_layer_ids must be >= -1 (-1 = embedding output), got {ids}")
    if num_target_layers is not None and ids[-1] > num_target_layers - 2:
        raise ValueError(
            f"target_layer_ids {ids} reach layer {ids[-1]}, but a target of {num_target_layers} "
            f"layers may only be tapped up to layer {num_target_layers - 2} (never the last)"
        )
    return ids


def _rope_fields(d: dict) -> tuple[float, dict | None]:
    """``rope_theta`` and ``rope_scaling`` from a transformers 4 or 5 (``rope_parameters``) config."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling")
    if scaling is None and params and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


@dataclass
class DSparkConfig:
    """DSpark draft hyper-parameters.

    Width fields (``hidden_size`` .. ``vocab_size``) must equal the target's: the draft shares the
    target's embedding and LM head. ``num_hidden_layers`` counts the draft's layers.
    ``sample_from_anchor`` is the DeepSpec convention (True: ``block_size`` input slots yield
    ``block_size`` drafts); False (z-lab DFlash) is not supported.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "qwen3"
    block_size: int = 7
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_target_layers: int | None = None
    sample_from_anchor: bool = True
    quantization: dict | None = None
    layer_types: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.target_layer_ids = validate_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}")
        if self.markov_rank > 0 and self.markov_head_type != "vanilla":
            raise NotImplementedError(
                f"markov_head_type={self.markov_head_type!r} is not implemented; only 'vanilla' "
                "(bias = W2(W1[prev])) is. Retrain with markov_head_type='vanilla'."
            )
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov needs markov_rank > 0")
        if not self.sample_from_anchor:
            raise NotImplementedError(
                "sample_from_anchor=False (z-lab DFlash: the mask at p+k predicts token p+k) is not "
                "supported; DeepSpec drafters (sample_from_anchor=True) are."
            )
        if self.layer_types and any(t != "full_attention" for t in self.layer_types[: self.num_hidden_layers]):
            raise NotImplementedError(f"draft layer_types must be full_attention, got {self.layer_types}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def target_mismatch(self, vocab_size: int, hidden_size: int, num_layers: int) -> str | None:
        """Why this drafter cannot run on a target of these widths and decoder layers (it shares
        the target's embedding and LM head and taps its layers), or None when it can."""
        if (self.vocab_size, self.hidden_size) != (vocab_size, hidden_size):
            return (f"drafter for vocab {self.vocab_size}, hidden {self.hidden_size}; the target has vocab "
                    f"{vocab_size}, hidden {hidden_size}")
        if self.num_target_layers not in (None, num_layers) or self.target_layer_ids[-1] > num_layers - 2:
            return (f"drafter for a target of {self.num_target_layers} layers tapping {self.target_layer_ids}; "
                    f"the target has {num_layers}")
        if not 0 <= self.mask_token_id < vocab_size:
            return f"mask token {self.mask_token_id} outside the vocabulary"
        return None

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, d: dict) -> DSparkConfig:
        """Read a DeepSpec draft ``config.json`` dictionary; unknown keys are kept in ``extra``.

        Also accepts the legacy nesting ``dflash_config: {mask_token_id, target_layer_ids, ...}``.

        Raises:
            KeyError: a required field (widths, ``target_layer_ids``, ``mask_token_id``) is missing.
            NotImplementedError: gated/rnn Markov heads, ``sample_from_anchor=False``.
        """
        flat = dict(d)
        for key, value in (d.get("dflash_config") or {}).items():
            flat.setdefault(key, value)
        theta, scaling = _rope_fields(flat)
        flat["rope_theta"], flat["rope_scaling"] = theta, scaling
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        missing = [n for n in ("hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "vocab_size", "target_layer_ids",
                               "mask_token_id") if flat.get(n) is None]
        if missing:
            raise KeyError(f"DSpark config lacks {missing}")
        kwargs = {k: v for k, v in flat.items() if k in names and v is not None}
        kwargs.setdefault("num_key_value_heads", flat["num_attention_heads"])
        return cls(**kwargs, extra={k: v for k, v in d.items() if k not in names})

    def to_dict(self) -> dict:
        """The DeepSpec ``config.json`` dictionary (``extra`` keys first, fields on top)."""
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None and f.name in ("quantization", "rope_scaling", "layer_types"):
                out.pop(f.name, None)
                continue
            out[f.name] = value
        out["architectures"] = ["Qwen3DSparkModel"]
        out["layer_types"] = ["full_attention"] * self.num_hidden_layers
        out.pop("rope_parameters", None)  # rope_theta / rope_scaling are authoritative here
        return out


def draft_config_from_target(
    target_config: dict,
    *,
    num_hidden_layers: int = 3,
    target_layer_ids: list[int] | None = None,
    num_taps: int = 5,
    block_size: int = 7,
    mask_token_id: int,
    markov_rank: int = 128,
    enable_confidence_head: bool = True,
    **overrides,
) -> DSparkConfig:
    """A new draft config as DeepSpec's ``build_draft_config`` makes it: a copy of the target's
    config with the draft fields set. The draft layers are Qwen3-style (q/k norm), so
    ``model_type`` becomes ``qwen3`` and the target's is kept as ``target_model_type``.

    Args:
        target_config: the target's HF-style config (``hidden_size``, ``num_hidden_layers``...).
        target_layer_ids: taps; default :func:`build_target_layer_ids` with ``num_taps``.
    """
    base = {k: v for k, v in target_config.items() if k not in ("quantization", "quantization_config")}
    n_target = int(base["num_hidden_layers"])
    ids = target_layer_ids if target_layer_ids is not None else build_target_layer_ids(n_target, num_taps)
    base.update(
        target_model_type=base.get("model_type"), model_type="qwen3",
        num_hidden_layers=num_hidden_layers, num_target_layers=n_target, target_layer_ids=list(ids),
        block_size=block_size, mask_token_id=int(mask_token_id), markov_rank=markov_rank,
        markov_head_type="vanilla", enable_confidence_head=enable_confidence_head,
        confidence_head_with_markov=enable_confidence_head and markov_rank > 0,
        tie_word_embeddings=False, attention_bias=False, sample_from_anchor=True,
    )
    base.pop("layer_types", None)
    base.update(overrides)
    return DSparkConfig.from_dict(base)
