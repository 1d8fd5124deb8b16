"""Load a target model: the default model, a GGUF file, or an MLX model directory.

Everything model-specific comes from mlx-lm (architectures, caches, tokenizer wrapper); this
module only picks the source, applies the weight-dtype policy and describes the result.
"""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.tokenizer_utils import TokenizerWrapper

from metal_kernels.fused_cpu import quantized_modules

from .default_model import DEFAULT_MODEL_NAME, ensure_default_model
from .detokenizer import TokenTable
from .tool_grammar import parser_module

log = logging.getLogger("specserve.loader")

WEIGHT_POLICIES = ("auto", "quantized", "quantized-bfloat16", "quantized-float16", "float32",
                   "float16", "bfloat16")


@dataclass
class LoadedModel:
    """A ready target: model, tokenizer and what the server needs to describe it."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    name: str
    source: str
    context_length: int
    eos_token_ids: frozenset[int]
    weights: str  # the applied weight policy, e.g. "float32" or "quantized"
    token_table: TokenTable = field(repr=False, default=None)
    # The file's quantized layers by module path, kept on the CPU when the policy dequantized
    # them: the CPU fused pass (metal_kernels.fused_cpu) streams these, prefill the float ones.
    quantized: dict[str, nn.Module] | None = field(repr=False, default=None)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)


def resolve_policy(policy: str) -> str:
    """``auto`` means float32 on the CPU backend (MLX's CPU quantized matmul is naive and the
    BLAS float32 path is 3-10x faster) and the file's quantization on a GPU."""
    if policy not in WEIGHT_POLICIES:
        raise ValueError(f"weights must be one of {WEIGHT_POLICIES}, got {policy!r}")
    if policy == "auto":
        return "float32" if mx.default_device() == mx.cpu else "quantized"
    return policy


def apply_weight_policy(model: nn.Module, policy: str) -> str:
    """Dequantize or cast the model's weights in place. Returns the resolved policy.

    ``quantized`` keeps quantized layers and makes every other float parameter (and the
    quantization scales/biases) float32, so activations are float32. ``quantized-bfloat16``
    and ``quantized-float16`` keep the quantized layers too but cast every float parameter,
    scales and biases included, to that dtype, so activations are bfloat16/float16: the
    dtype the GPU small-batch kernels run on tensor cores (metal_kernels/); bfloat16 scales keep
    3 fewer mantissa bits than a GGUF's float16 ones. Float policies
    dequantize with float32 scales (no float16 rounding of the weights) and cast to that dtype.
    """
    from mlx_lm.utils import dequantize_model

    policy = resolve_policy(policy)

    def cast(dtype):
        model.update(tree_map_with_path(
            lambda p, x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x,
            model.parameters()))

    cast(mx.float32)
    if policy.startswith("quantized-"):
        cast(getattr(mx, policy.split("-", 1)[1]))
    elif policy != "quantized":
        dequantize_model(model)
        cast(getattr(mx, policy))
    mx.eval(model.parameters())
    return policy


def tokenizer_wrapper(hf_tokenizer, eos_token_ids) -> TokenizerWrapper:
    """mlx-lm's ``TokenizerWrapper`` around a Hugging Face tokenizer, with the tool-call format
    (markers and parser from ``mlx_lm.tool_parsers``) that ``mlx_lm.tokenizer_utils.load``
    infers from the chat template for model directories; None of it when the template has no
    tool-call format (the default model's) or this mlx-lm cannot infer one."""
    tool = {}
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser  # (mlx-lm's own rule, not public)

        name = _infer_tool_parser(hf_tokenizer)
        if name is not None:
            module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
            tool = {"tool_parser": module.parse_tool_call, "tool_call_start": module.tool_call_start,
                    "tool_call_end": module.tool_call_end}
    except (ImportError, AttributeError) as exc:  # another mlx-lm: serve without tool calls
        log.warning("tool-call format not inferred (%s); chat requests with tools get 400", exc)
    return TokenizerWrapper(hf_tokenizer, eos_token_ids=eos_token_ids, **tool)


def tool_marker_ids(tokenizer) -> list[int]:
    """The ids of tool-call markers that are special tokens (decoded to nothing otherwise):
    the start and end markers, and Mistral's ``[ARGS]``."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return []
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    markers = [tokenizer.tool_call_start, tokenizer.tool_call_end]
    if parser_module(tokenizer.tool_parser) == "mistral":
        markers.append("[ARGS]")  # (between a call's name and its arguments: NAME[ARGS]{...})
    ids = []
    for marker in markers:
        encoded = tokenizer.encode(marker, add_special_tokens=False) if marker else []
        if len(encoded) == 1 and encoded[0] in special:
            ids.append(encoded[0])
    return ids


def _load_gguf(path: Path):
    from .gguf import gguf_eos_ids, gguf_tokenizer, load_gguf_model

    model, config, meta = load_gguf_model(path)
    hf_tokenizer = gguf_tokenizer(meta)
    eos = gguf_eos_ids(meta)
    return model, tokenizer_wrapper(hf_tokenizer, eos), config


def _load_mlx_dir(path_or_repo: str):
    from mlx_lm.utils import load

    model, tokenizer, config = load(path_or_repo, return_config=True)
    return model, tokenizer, config


def load_target(model: str = "default", weights: str = "auto", served_name: str | None = None) -> LoadedModel:
    """Load the target model.

    Args:
        model: ``"default"`` (SmolLM2-135M-Instruct Q4_1, fetched on first use), a ``.gguf``
            path, or an MLX model directory / Hugging Face repo id that ``mlx_lm.load`` accepts.
        weights: one of :data:`WEIGHT_POLICIES`.
        served_name: the id clients use in ``"model"``; defaults to the directory or file stem.

    Raises:
        FileNotFoundError: the path does not exist.
        engine.gguf.GGUFError / ValueError: unsupported file or architecture.
        engine.default_model.ModelFetchError: the default model could not be fetched.
    """
    if model in ("default", DEFAULT_MODEL_NAME):
        path = ensure_default_model()
        name = served_name or DEFAULT_MODEL_NAME
        net, tokenizer, config = _load_gguf(path)
    elif model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        name = served_name or path.stem.lower()
        net, tokenizer, config = _load_gguf(path)
    else:
        path = Path(model).expanduser()
        name = served_name or (path.name if path.exists() else model).lower()
        net, tokenizer, config = _load_mlx_dir(str(path) if path.exists() else model)
    stored = quantized_modules(net) if mx.default_device() == mx.cpu else {}
    applied = apply_weight_policy(net, weights)
    context = int(config.get("max_position_embeddings") or config.get("max_seq_len") or 4096)
    eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
    n_params = sum(v.size for _, v in tree_flatten(net.parameters()))
    log.info("loaded %s from %s: %d layers, %.1fM stored values, weights=%s, context=%d",
             name, path, len(net.layers), n_params / 1e6, applied, context)
    return LoadedModel(
        model=net,
        tokenizer=tokenizer,
        config=config,
        name=name,
        source=str(path),
        context_length=context,
        eos_token_ids=eos,
        weights=applied,
        token_table=TokenTable.from_tokenizer(tokenizer, visible=tool_marker_ids(tokenizer)),
        quantized=stored if stored and not applied.startswith("quantized") else None,
    )


DSPARK_SHIPPED = {DEFAULT_MODEL_NAME: "dspark-smollm2-135m-instruct"}


def models_dir() -> Path:
    """The project's ``models/`` folder: the source tree's, else ``<prefix>/share/specserve/models``."""
    import sys

    here = Path(__file__).resolve().parents[1] / "models"
    return here if here.is_dir() else Path(sys.prefix) / "share" / "specserve" / "models"


def default_dspark_path(loaded: LoadedModel) -> str | None:
    """The DSpark drafter shipped for this target, if there is one."""
    name = DSPARK_SHIPPED.get(loaded.name)
    if name is None:
        return None
    path = models_dir() / name
    return str(path) if (path / "config.json").exists() else None


def save_mlx_dir(loaded: LoadedModel, out: str | Path) -> Path:
    """Write the loaded model as an MLX model directory (config.json, safetensors, tokenizer).

    Used to serve the same weights from ``mlx_lm.server`` for side-by-side comparisons.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(loaded.model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {k: v for k, v in loaded.config.items() if k != "quantization"}
    if loaded.weights.startswith("quantized") and "quantization" in loaded.config:
        config["quantization"] = loaded.config["quantization"]
    config["eos_token_id"] = sorted(loaded.eos_token_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(loaded, out)
    return out


def save_tokenizer(loaded: LoadedModel, out: str | Path) -> Path:
    """Write only the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, chat
    template) of ``loaded`` to ``out``; ``transformers.AutoTokenizer.from_pretrained(out)`` reads
    them back without network access."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    loaded.tokenizer._tokenizer.save_pretrained(str(out))
    return out
