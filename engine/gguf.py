"""Build an mlx-lm model and a Hugging Face tokenizer from a GGUF file.

``mx.load(path, return_metadata=True)`` reads GGUF tensors, keeping Q4_0/Q4_1/Q8_0 as MLX affine
quantized triples (``weight`` uint32, ``scales``, ``biases``; group 32). This module maps the
llama.cpp tensor names to mlx-lm's, undoes llama.cpp's Q/K row permutation (so the model runs
with mlx-lm's standard non-traditional RoPE and converts to an ordinary MLX model directory),
derives the model config from the ``<arch>.*`` metadata, and builds the tokenizer from
``tokenizer.ggml.*`` with transformers' GGUF tokenizer builders.

Supported architectures: ``llama`` (including SmolLM2), ``qwen2`` and ``qwen3``.
Reference: llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) and
``gguf-py/gguf/constants.py`` (tensor names).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

_NAME_MAP = [
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.attn_q\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"model.layers.\1.self_attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"model.layers.\1.self_attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.attn_q_norm\.", r"model.layers.\1.self_attn.q_norm."),
    (r"^blk\.(\d+)\.attn_k_norm\.", r"model.layers.\1.self_attn.k_norm."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"model.layers.\1.mlp.up_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"model.layers.\1.mlp.down_proj."),
]
_SUPPORTED = ("llama", "qwen2", "qwen3")
# llama.cpp permutes Q/K rows for these architectures (GGML "normal" RoPE pairs adjacent dims).
_PERMUTED_QK = ("llama",)


class GGUFError(ValueError):
    """The GGUF file uses an architecture or layout this loader does not support."""


def _py(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def gguf_config(meta: dict) -> dict:
    """An mlx-lm/Hugging Face style config dict from GGUF metadata."""
    arch = _py(meta["general.architecture"])
    if arch not in _SUPPORTED:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {_SUPPORTED})")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}")
        return default if value is None else _py(value)

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": get("attention.key_length", hidden // n_heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length", 4096),
        "vocab_size": vocab,
        "tie_word_embeddings": True,  # fixed up by the loader when output.weight exists
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    return config


def _unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Invert llama.cpp's ``permute`` on the output rows of a Q or K projection."""
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def translate_weights(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """Rename GGUF tensors to mlx-lm names; undo the Q/K permutation where llama.cpp applied it."""
    out = {}
    for name, value in weights.items():
        new = name
        for pattern, repl in _NAME_MAP:
            new, n = re.subn(pattern, repl, new)
            if n:
                break
        else:
            if name.startswith("rope_freqs"):
                continue
            raise GGUFError(f"unexpected GGUF tensor {name!r}")
        if config["model_type"] in _PERMUTED_QK:
            if ".self_attn.q_proj." in new:
                value = _unpermute_rows(value, config["num_attention_heads"])
            elif ".self_attn.k_proj." in new:
                value = _unpermute_rows(value, config["num_key_value_heads"])
        out[new] = value
    return out


def quantization_of(weights: dict[str, mx.array], model: nn.Module) -> dict[str, dict]:
    """Per-module ``{"group_size", "bits"}`` for every weight stored quantized in ``weights``.

    The float model (built lazily, never evaluated) gives each layer's input width; the packed
    width gives the bits and the number of scale columns gives the group size.
    """
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    quant = {}
    for name in weights:
        if not name.endswith(".scales"):
            continue
        base = name[: -len(".scales")]
        in_features = shapes[base + ".weight"][-1]
        packed = weights[base + ".weight"].shape[-1]
        quant[base] = {
            "group_size": in_features // weights[name].shape[-1],
            "bits": packed * 32 // in_features,
        }
    return quant


def load_gguf_model(path: str | Path) -> tuple[nn.Module, dict, dict]:
    """Load a GGUF file as an mlx-lm model with the file's quantization kept.

    Returns:
        ``(model, config, metadata)``. The model's quantized layers are MLX ``QuantizedLinear``/
        ``QuantizedEmbedding`` (affine); norms stay float32.

    Raises:
        GGUFError: unsupported architecture or unexpected tensors.
    """
    from mlx_lm.utils import _get_classes

    weights, meta = mx.load(str(path), return_metadata=True)
    config = gguf_config(meta)
    weights = translate_weights(weights, config)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    quant = quantization_of(weights, model)
    if quant:
        nn.quantize(model, class_predicate=lambda p, m: quant.get(p, False))
        config["quantization"] = {"group_size": 32, "bits": 4, **quant}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model, config, meta


def gguf_tokenizer(meta: dict):
    """A ``PreTrainedTokenizerFast`` built from ``tokenizer.ggml.*`` metadata.

    Uses transformers' GGUF builders (the same ones ``from_pretrained(gguf_file=...)`` uses) on
    the metadata ``mx.load`` already read, so no second pass over the file and no torch.
    llama.cpp's ``smollm`` pre-tokenizer splits digits one by one before the GPT-2 regex; that
    split is added here since transformers has no entry for it.
    """
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    try:  # (transformers releases keep these in either module)
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    groups = {
        group: {
            name: _py(meta[f"tokenizer.{key}"])
            for key, name in renames.items()
            if f"tokenizer.{key}" in meta
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = groups["tokenizer"], groups["tokenizer_config"]
    backend, _ = convert_gguf_tokenizer(_py(meta["general.architecture"]), tok_dict)
    if tok_dict.get("pre_tokenizer_type") == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
        )
    tokens = tok_dict["tokens"]

    def special(key):
        idx = tok_dict.get(key)
        return tokens[idx] if idx is not None and idx < len(tokens) else None

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=special("bos_token_id"),
        eos_token=special("eos_token_id"),
        unk_token=special("unk_token_id"),
        pad_token=special("pad_token_id"),
        chat_template=tok_config.get("chat_template"),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_bos_token = bool(tok_config.get("add_bos_token", False))
    tokenizer.add_eos_token = bool(tok_config.get("add_eos_token", False))
    return tokenizer


def gguf_eos_ids(meta: dict) -> list[int]:
    """End-of-generation ids: ``eos`` plus ``eot``/``eom`` where the file names them."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and _py(value) not in ids:
            ids.append(_py(value))
    return ids
