"""The DSpark draft network in MLX (DSpark, arXiv 2607.05147; DFlash, arXiv 2602.06036).

Shapes: ``d`` hidden size, ``m`` number of tapped target layers, ``V`` vocabulary, ``B`` block
size, ``H``/``KV`` query/key-value heads of ``D`` dims, ``S`` context positions, ``N`` sequences,
``nb`` blocks per sequence.

* Context: tapped target hidden states ``[.., S, m*d]`` -> ``hidden_norm(fc(.))`` ``[.., S, d]``,
  computed once and injected into every draft layer as extra keys/values ("KV injection"): a
  layer's keys are ``[k_norm(W_K c) ; k_norm(W_K x)]`` and values ``[W_V c ; W_V x]``, with RoPE at
  absolute positions for both; queries come from the block tokens ``x`` only
  ([DeepSpec] ``Qwen3DSparkAttention``).
* Block: ``[anchor, MASK x (B-1)]`` at positions ``p..p+B-1`` through Qwen3-style layers (q/k
  RMSNorm on ``head_dim``, SwiGLU MLP) in one forward. Attention is bidirectional inside the
  block and sees context positions strictly before the anchor (``kv < p``), nothing else
  ([DeepSpec] ``create_dspark_attention_mask``).
* Slot alignment (``sample_from_anchor=True``): slot ``j`` (position ``p+j``) predicts token
  ``x_{p+j+1}``; so ``B`` slots give ``B`` drafts ``x_1..x_B`` (``x_k`` at position ``p+k``).
* Markov head (vanilla, rank ``r``): draft ``k``'s logits are ``U_k + W2(W1[x_{k-1}])`` with
  ``x_0`` the anchor, applied left to right when sampling.
* Confidence head: ``c_k = sigmoid(proj([h_k ; W1[x_{k-1}]]))``, the probability that draft ``k``
  is accepted given drafts ``1..k-1`` were; prefix survival ``a_k = prod_{i<=k} c_i``.

The embedding and LM head are the target's, passed in as callables by the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope

from .config import DSparkConfig

Embed = Callable[[mx.array], mx.array]  # token ids [...] -> [..., d]
LMHead = Callable[[mx.array], mx.array]  # hidden [..., d] -> logits [..., V]


def block_attention(q, k_blk, v_blk, k_ctx, v_ctx, ctx_mask, scale: float) -> mx.array:
    """Attention of block queries over [context ; own block] (the training-path kernel).

    Args:
        q: ``[N, nb, H, B, D]`` queries (RoPE applied).
        k_blk, v_blk: ``[N, nb, KV, B, D]`` the block's own keys/values.
        k_ctx, v_ctx: ``[N, KV, S, D]`` context keys/values shared by the ``nb`` blocks, or None.
        ctx_mask: ``[N, nb, S]`` bool, True where block ``b`` may see context position ``s``
            (``s < anchor_b``); None = all visible.
    Returns:
        ``[N, nb, H, B, D]``, same dtype as ``q``. Every block sees all of its own ``B`` keys.
    """
    n, nb, h, b, d = q.shape
    kv = k_blk.shape[2]
    qg = (q * scale).reshape(n, nb, kv, (h // kv) * b, d)
    s_blk = qg @ k_blk.swapaxes(-1, -2)  # [N, nb, KV, G*B, B]
    if k_ctx is None or k_ctx.shape[2] == 0:
        out = mx.softmax(s_blk, axis=-1, precise=True) @ v_blk
    else:
        s_ctx = qg @ k_ctx[:, None].swapaxes(-1, -2)  # [N, nb, KV, G*B, S]
        if ctx_mask is not None:
            neg = mx.array(mx.finfo(s_ctx.dtype).min, dtype=s_ctx.dtype)
            s_ctx = mx.where(ctx_mask[:, :, None, None, :], s_ctx, neg)
        size = s_ctx.shape[-1]
        p = mx.softmax(mx.concatenate([s_ctx, s_blk], axis=-1), axis=-1, precise=True)
        out = p[..., :size] @ v_ctx[:, None] + p[..., size:] @ v_blk
    return out.reshape(n, nb, h, b, d)


class DraftAttention(nn.Module):
    """Qwen3 attention with KV injection (module names match DeepSpec's state dict)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        d, self.n_heads, self.n_kv, self.head_dim = (
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.scale = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(self.head_dim, base=cfg.rope_theta, traditional=False,
                                    scaling_config=cfg.rope_scaling,
                                    max_position_embeddings=cfg.max_position_embeddings)

    def _kv(self, x: mx.array, rows: int, length: int) -> tuple[mx.array, mx.array]:
        k = self.k_norm(self.k_proj(x).reshape(rows, length, self.n_kv, self.head_dim))
        v = self.v_proj(x).reshape(rows, length, self.n_kv, self.head_dim)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def context_kv(self, c: mx.array, offset: int = 0) -> tuple[mx.array, mx.array]:
        """Keys/values of projected context ``c`` ``[N, S, d]`` at positions ``offset..offset+S-1``:
        ``[N, KV, S, D]`` each (keys k-normed and rotated)."""
        n, s, _ = c.shape
        k, v = self._kv(c, n, s)
        return self.rope(k, offset=offset), v

    def __call__(self, x, anchors, k_ctx, v_ctx, ctx_mask, fast: bool = False) -> mx.array:
        """``x``: ``[N, nb, B, d]`` normed block states; ``anchors``: ``[N, nb]`` int positions.
        ``fast`` uses ``mx.fast.scaled_dot_product_attention`` (needs ``N == nb == 1``; a
        ``ctx_mask`` then hides padded context rows)."""
        n, nb, b, _ = x.shape
        flat = x.reshape(n * nb, b, -1)
        q = self.q_norm(self.q_proj(flat).reshape(n * nb, b, self.n_heads, self.head_dim))
        q = q.transpose(0, 2, 1, 3)
        k, v = self._kv(flat, n * nb, b)
        offsets = anchors.reshape(-1).astype(mx.int32)
        q, k = self.rope(q, offset=offsets), self.rope(k, offset=offsets)
        if fast:
            if nb != 1 or n != 1:
                raise ValueError("the fast attention path takes one sequence of one block")
            mask = None
            if k_ctx is not None:
                k, v = mx.concatenate([k_ctx, k], axis=2), mx.concatenate([v_ctx, v], axis=2)
                if ctx_mask is not None:  # [1, 1, S] -> [S + B]: context as given, own block all visible
                    mask = mx.concatenate([ctx_mask.reshape(-1), mx.ones((b,), dtype=mx.bool_)])
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            out = out.reshape(n, nb, self.n_heads, b, self.head_dim)
        else:
            shape5 = (n, nb, -1, b, self.head_dim)
            out = block_attention(q.reshape(shape5), k.reshape(shape5), v.reshape(shape5),
                                  k_ctx, v_ctx, ctx_mask, self.scale)
        out = out.transpose(0, 1, 3, 2, 4).reshape(n, nb, b, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, anchors, k_ctx, v_ctx, ctx_mask, fast=False):
        h = x + self.self_attn(self.input_layernorm(x), anchors, k_ctx, v_ctx, ctx_mask, fast)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """Vanilla low-rank bigram bias ``W2(W1[prev])`` ([DeepSpec] ``VanillaMarkov``)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def __call__(self, prev: mx.array) -> mx.array:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """``proj``: Linear(d [+ r] -> 1, bias) giving the confidence logit ([DeepSpec] ``AcceptRatePredictor``)."""

    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1, bias=True)

    def __call__(self, features: mx.array) -> mx.array:
        return self.proj(features)[..., 0]


class DSparkModel(nn.Module):
    """The trainable draft network. Parameter names equal DeepSpec's state-dict keys
    (``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ``markov_head.markov_w1.weight``...)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.layers = [DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_taps * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        # the checkpoint's draft vocabulary (drafters.dspark.vocab): [V'] int32 target ids, a
        # numpy array (not a parameter), or None
        self.draft_vocab: np.ndarray | None = None
        if cfg.markov_rank > 0:
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        if cfg.enable_confidence_head:
            extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(d + extra)

    @property
    def has_markov(self) -> bool:
        return "markov_head" in self

    @property
    def has_confidence(self) -> bool:
        return "confidence_head" in self

    def project_context(self, hidden: mx.array) -> mx.array:
        """Tapped target states ``[..., S, m*d]`` -> context features ``[..., S, d]``."""
        return self.hidden_norm(self.fc(hidden.astype(self.fc_dtype)))

    @property
    def fc_dtype(self):
        return self.hidden_norm.weight.dtype

    def context_kv(self, c: mx.array, offset: int = 0) -> list[tuple[mx.array, mx.array]]:
        """Per-layer context keys/values ``[N, KV, S, D]`` for features ``c`` ``[N, S, d]``."""
        return [layer.self_attn.context_kv(c, offset) for layer in self.layers]

    def __call__(self, block_emb, anchors, ctx_kv, ctx_mask=None, fast: bool = False) -> mx.array:
        """Draft hidden states.

        Args:
            block_emb: ``[N, nb, B, d]`` target embeddings of ``[anchor, MASK x (B-1)]``.
            anchors: ``[N, nb]`` int anchor positions (slot ``j`` sits at ``anchor + j``).
            ctx_kv: per-layer ``(k, v)`` ``[N, KV, S, D]`` from :meth:`context_kv`, or None.
            ctx_mask: ``[N, nb, S]`` bool (block ``b`` sees context ``s`` iff True); None = all.
            fast: use the fused attention kernel (inference: ``N == nb == 1``).
        Returns:
            ``[N, nb, B, d]`` final-normed states; slot ``j`` predicts token ``anchor + j + 1``.
        """
        h = block_emb.astype(self.fc_dtype)
        for i, layer in enumerate(self.layers):
            k_ctx, v_ctx = ctx_kv[i] if ctx_kv is not None else (None, None)
            h = layer(h, anchors, k_ctx, v_ctx, ctx_mask, fast)
        return self.norm(h)

    def markov_bias(self, prev: mx.array, w2: nn.Module | None = None) -> mx.array | None:
        """``W2(W1[prev])`` ``[..., V]`` for previous tokens ``prev`` ``[...]`` (target ids); None
        without a Markov head. ``w2``: score these rows instead of ``W2`` (a draft vocabulary's,
        :class:`drafters.dspark.vocab.DraftVocab`: ``[..., V']``)."""
        if not self.has_markov:
            return None
        head = self.markov_head
        return (head.markov_w2 if w2 is None else w2)(head.markov_w1(prev))

    def confidence_logits(self, h: mx.array, prev: mx.array) -> mx.array | None:
        """Confidence logits ``[...]`` from states ``h`` ``[..., d]`` and previous tokens ``[...]``."""
        if not self.has_confidence:
            return None
        if self.config.confidence_head_with_markov:
            h = mx.concatenate([h, self.markov_head.markov_w1(prev).astype(h.dtype)], axis=-1)
        return self.confidence_head(h)


def init_weights(model: DSparkModel, std: float = 0.02, seed: int = 0) -> None:
    """Hugging Face ``_init_weights`` for a new drafter: Linear/Embedding weights ~ N(0, std),
    biases 0, RMSNorm weights 1 (the MLX constructor default)."""
    key = mx.random.key(seed)
    for _path, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            key, sub = mx.random.split(key)
            module.weight = std * mx.random.normal(module.weight.shape, key=sub)
            if "bias" in module:
                module.bias = mx.zeros_like(module.bias)
    mx.eval(model.parameters())


# ---- one draft step (shared by the drafter and the pure reference) ------------------------

_SALT = 0x5D5A7B3C1E2F4A69  # keeps draft noise independent of the engine's per-position keys
_MASK64 = (1 << 64) - 1


def _mixed_seed(seed: int, position: int) -> int:
    return (((seed + 1) * 0x9E3779B97F4A7C15 ^ _SALT) + position * 0xD6E8FEB86659FD93) & _MASK64


def draft_keys(seed: int, anchor_pos: int, n: int) -> mx.array:
    """``[n, 2]`` uint32 PRNG keys (``mx.random.key`` layout: high word, low word) for the draft
    tokens at absolute positions ``anchor_pos + 1 .. anchor_pos + n`` of a request seeded ``seed``,
    built on the host as one array."""
    rows = [(m >> 32, m & 0xFFFFFFFF) for m in (_mixed_seed(seed, anchor_pos + k) for k in range(1, n + 1))]
    return mx.array(rows, dtype=mx.uint32).reshape(n, 2)


def sample_block(model: DSparkModel, base_logits: mx.array, h: mx.array, anchor: int | mx.array,
                 anchor_pos: int, temperature: float | mx.array = 0.0, seed: int = 0,
                 keys: mx.array | None = None, vocab=None):
    """Sequential Markov-corrected sampling of one block (lazy; nothing is evaluated).

    Args:
        base_logits: ``[L, V]`` float32 base logits ``U_1..U_L`` (``[L, V']`` over ``vocab``).
        h: ``[L, d]`` draft states of the same slots.
        anchor: the anchor token ``x_0`` (an int or an int32 ``[1]`` array); ``anchor_pos`` its
            absolute position.
        temperature: 0 -> ``x_k = argmax(U_k + bias_k)``; else ``x_k ~ softmax((U_k + bias_k)/T)``
            drawn with :func:`draft_keys` ``(seed, anchor_pos, L)``. A float32 array (which
            must be > 0) means sampled with those keys given as ``keys`` (``[L, 2]`` uint32).
        vocab: a :class:`drafters.dspark.vocab.DraftVocab`: the base logits and the Markov bias
            cover its ``V'`` tokens only, and drafts are chosen among them (FR-Spec); None: the
            whole vocabulary.
    Returns:
        ``(tokens [L] int32 target ids, q [L, V] float32 or None (greedy; zero outside a
        draft vocabulary), confidence [L] float32 or None)``.
    """
    prev = anchor if isinstance(anchor, mx.array) else mx.array([anchor], dtype=mx.int32)
    sampled = isinstance(temperature, mx.array) or temperature > 0
    if sampled and keys is None:
        keys = draft_keys(seed, anchor_pos, base_logits.shape[0])
    w2 = vocab.markov_w2 if vocab is not None else None
    tokens, probs, prevs = [], [], [prev]
    for k in range(base_logits.shape[0]):
        logits = base_logits[k : k + 1]
        bias = model.markov_bias(prev, w2)
        if bias is not None:
            logits = logits + bias.astype(mx.float32)
        if sampled:
            scaled = logits / temperature
            probs.append(mx.softmax(scaled, axis=-1, precise=True))
            prev = mx.random.categorical(scaled, key=keys[k])
        else:
            prev = mx.argmax(logits, axis=-1)
        prev = prev.astype(mx.int32)
        if vocab is not None:
            prev = vocab.to_target(prev)
        tokens.append(prev)
        prevs.append(prev)
    out = mx.concatenate(tokens)
    conf = model.confidence_logits(h, mx.concatenate(prevs[:-1]))
    conf = mx.sigmoid(conf.astype(mx.float32)) if conf is not None else None
    q = mx.concatenate(probs) if probs else None
    if q is not None and vocab is not None:
        q = vocab.scatter(q)
    return out, q, conf


def block_inputs(embed: Embed, anchor: int | mx.array, mask_token_id: int, block_size: int) -> mx.array:
    """``[1, 1, B, d]`` embeddings of ``[anchor, MASK x (B-1)]`` (``anchor``: an int or an int32
    ``[1]`` array)."""
    anchor = anchor if isinstance(anchor, mx.array) else mx.array([anchor])
    ids = mx.concatenate([anchor.astype(mx.int32), mx.full((block_size - 1,), mask_token_id, mx.int32)])
    return embed(ids)[None, None]


def reference_draft(model: DSparkModel, embed: Embed, lm_head: LMHead, context_hidden: mx.array,
                    tokens: list[int], max_len: int, temperature: float = 0.0, seed: int = 0):
    """One draft step computed from scratch (no draft cache), for tests.

    Args:
        context_hidden: ``[P, m*d]`` tapped target states of positions ``0..P-1``; rows at or
            after the anchor position are present but must be masked out.
        tokens: prompt + output; ``tokens[-1]`` is the anchor at position ``len(tokens) - 1``.
    Returns:
        As :func:`sample_block`, for ``L = min(max_len, block_size)`` drafts.
    """
    cfg = model.config
    anchor_pos = len(tokens) - 1
    c = model.project_context(context_hidden[None])
    positions = mx.arange(context_hidden.shape[0])
    mask = (positions < anchor_pos)[None, None]
    x = block_inputs(embed, tokens[-1], cfg.mask_token_id, cfg.block_size)
    anchors = mx.array([[anchor_pos]], dtype=mx.int32)
    h = model(x, anchors, model.context_kv(c), mask)[0, 0]
    n = min(max_len, cfg.block_size)
    base = lm_head(h[:n]).astype(mx.float32)
    return sample_block(model, base, h[:n], tokens[-1], anchor_pos, temperature, seed)
