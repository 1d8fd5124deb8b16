"""A tiny random Llama with a byte-level tokenizer, built in memory for unit tests.

conftest.py imports ``engine`` first, so OpenBLAS is loaded before ``mlx.core``.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import TokenTable, _gpt2_byte_decoder
from engine.loader import LoadedModel, apply_weight_policy
from metal_kernels.fused_cpu import quantized_modules

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(missing: bytes = b"") -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: ids 0-2 are special, 3..258 are the 256 bytes. ``missing``:
    bytes left out of the vocabulary, which tokenizing then drops (SmolLM2's has no 0x1d); the
    bytes after them get ids one lower each."""
    chars = sorted(_gpt2_byte_decoder().items(), key=lambda kv: kv[1])
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch, byte in chars:
        if byte not in missing:
            vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>", chat_template=CHAT_TEMPLATE,
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def tiny_model(seed: int = 0, vocab: int = 259, layers: int = 2, hidden: int = 320, scale: float = 1.0,
               head_dim: int = 80):
    """A 2-layer Llama (GQA: 8 query heads, 4 KV heads of ``head_dim`` = 80). Matrices are at
    least 320 wide: OpenBLAS's small-matrix kernels (used below ~64^3 multiply-adds) give row
    results that depend on the row count, which calibration would answer with a narrow verify
    width."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
        num_attention_heads=8, num_key_value_heads=4, head_dim=head_dim, rms_norm_eps=1e-5, vocab_size=vocab,
        rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=2048,
    )
    model = llama.Model(args)
    if scale != 1.0:  # sharpen the output distribution
        model.model.embed_tokens.weight = model.model.embed_tokens.weight * scale
    mx.eval(model.parameters())
    return model, args


def quantize_like_gguf(model, bits: int = 4, group_size: int = 32):
    """Quantize ``model`` in place as the default model's Q4_1 GGUF loads: projections to
    ``bits`` bits, the (tied) embedding to 8 bits, group size 32 (``group_size``: another)."""
    import mlx.nn as nn

    nn.quantize(model, class_predicate=lambda _, m: (
        {"group_size": group_size, "bits": 8} if isinstance(m, nn.Embedding)
        else {"group_size": group_size, "bits": bits} if isinstance(m, nn.Linear) else False))
    for _, m in model.named_modules():  # a GGUF stores Q4_1/Q8 scales and minimums in float16
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.scales = m.scales.astype(mx.float16).astype(m.scales.dtype)
            m.biases = m.biases.astype(mx.float16).astype(m.biases.dtype)
    mx.eval(model.parameters())
    return model


def tiny_loaded(seed: int = 0, weights: str = "float32", context: int = 2048, scale: float = 1.0,
                head_dim: int = 80, quantize_bits: int | None = None, dequantize: bool = False) -> LoadedModel:
    """The tiny model as the engine loads a target; ``quantize_bits`` quantizes its projections
    (group 32; the tied embedding in 8 bits) as the default model's GGUF is. ``dequantize``
    then serves float32 weights and keeps the quantized layers aside, as ``load_target`` does on
    the CPU (``LoadedModel.quantized``, what the CPU fused pass reads)."""
    model, args = tiny_model(seed, scale=scale, head_dim=head_dim)
    stored = None
    if quantize_bits:
        quantize_like_gguf(model, quantize_bits)
        weights = "float32" if dequantize else "quantized"
        stored = quantized_modules(model) if dequantize else None
    applied = apply_weight_policy(model, weights)
    hf = byte_tokenizer()
    wrapper = TokenizerWrapper(hf, eos_token_ids=[2])
    import dataclasses

    config = {**dataclasses.asdict(args), "max_position_embeddings": context}
    return LoadedModel(
        model=model, tokenizer=wrapper, config=config, name="tiny-llama", source="memory",
        context_length=context, eos_token_ids=frozenset({2}), weights=applied,
        token_table=TokenTable.from_tokenizer(wrapper), quantized=stored,
    )


# A Hermes/Qwen2.5-style template: tools in a system turn, earlier calls as <tool_call> blocks.
# mlx-lm infers its tool-call format ("json_tools") from "<tool_call>" and "tool_call.name".
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{% set tool_call = c.function %}<tool_call>{\"name\": "
    "\"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What the tool model says after any "\n": content, then two calls (the second block's markers
# inside one token, so markers are also found across and within tokens), then EOS.
TOOL_REPLY = ["Checking.", "<tool_call>",
              '{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<tool_call>'
              '{"name": "get_time", "arguments": {"zone": "CET"}}', "</tool_call>"]


def tool_call_loaded(seed: int = 0, context: int = 2048) -> LoadedModel:
    """A tiny Llama that answers every chat turn with ``TOOL_REPLY`` (greedy), with a
    tool-calling template: a bigram model (attention and MLP outputs zeroed, untied LM head)
    whose LM head makes each reply token the next one's only likely successor."""
    import dataclasses

    import mlx.nn as nn

    from engine.loader import tokenizer_wrapper

    hf = byte_tokenizer()
    hf.add_tokens(TOOL_REPLY)
    hf.chat_template = TOOL_CHAT_TEMPLATE
    vocab = len(hf)
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=320, num_hidden_layers=2, intermediate_size=640,
        num_attention_heads=8, num_key_value_heads=4, head_dim=80, rms_norm_eps=1e-5, vocab_size=vocab,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=2048,
    )
    model = llama.Model(args)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    chain = [hf.convert_tokens_to_ids(t) for t in ["\u010a", *TOOL_REPLY]] + [2]  # "\n" (byte-level) ... EOS
    embed = model.model.embed_tokens.weight
    hidden = embed / mx.sqrt(mx.mean(embed * embed, axis=-1, keepdims=True) + 1e-5)
    head = 0.01 * mx.random.normal(model.lm_head.weight.shape)
    rows = mx.array(chain[1:])
    head[rows] = hidden[mx.array(chain[:-1])]
    model.lm_head = nn.Linear(320, vocab, bias=False)
    model.lm_head.weight = head
    mx.eval(model.parameters())
    wrapper = tokenizer_wrapper(hf, [2])
    config = {**dataclasses.asdict(args), "max_position_embeddings": context}
    return LoadedModel(
        model=model, tokenizer=wrapper, config=config, name="tiny-tools", source="memory",
        context_length=context, eos_token_ids=frozenset({2}), weights="float32",
        token_table=TokenTable.from_tokenizer(wrapper),
    )


def write_tiny_mlx_dir(out, seed: int = 0, context: int = 2048):
    """Write the tiny model as an MLX model directory (config.json, safetensors, tokenizer), the
    supported `--model <dir>` path, so a real `specserve` process can serve it in tests."""
    import dataclasses

    from engine.loader import save_mlx_dir

    _, args = tiny_model(seed)
    loaded = tiny_loaded(seed, context=context)
    config = {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
    config["max_position_embeddings"] = context
    return save_mlx_dir(dataclasses.replace(loaded, config=config), out)
