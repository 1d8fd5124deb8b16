"""Hidden-state taps from an mlx-lm target (Llama / Qwen2 / Qwen3 style models).

A DSpark drafter reads the raw outputs of chosen target decoder layers (the residual stream
after layer ``l``, before the final norm; HF ``hidden_states[l + 1]``; id ``-1`` is the
embedding output), concatenated in ``target_layer_ids`` order. :class:`TargetTaps` runs the
target's own modules in the order ``Model.__call__`` does (embedding, the layers with the mask
from ``create_attention_mask``, final norm, LM head) and keeps those outputs, so logits equal
the model's plain forward on the same caches.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from metal_kernels.fused import head_module


class TargetTaps:
    """The target's embedding, LM head and a forward pass that returns tapped states.

    Args:
        model: an mlx-lm model with ``model.model.{embed_tokens, layers, norm}`` and either
            ``model.lm_head`` or tied embeddings (``embed_tokens.as_linear``).
        layer_ids: tapped decoder layers (``-1`` = embedding output).

    Raises:
        ValueError: the model has another structure (sliding-window or hybrid layers), or its
            forward does more than that order (Gemma's, Granite's or MiniCPM's embedding scale,
            say): on a 4-token probe, :meth:`forward` must leave the model's own logits and KV
            bit for bit, since verify passes run through it and the engine's prefix cache lends
            a tapped prefill's KV to requests without taps.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
            raise ValueError("DSpark taps need an mlx-lm model with model.{embed_tokens,layers,norm}")
        if getattr(inner, "swa_idx", None) is not None or getattr(model.args, "sliding_window", None):
            raise ValueError("DSpark taps support full-attention targets only")
        self.model, self.inner = model, inner
        self.layer_ids = list(layer_ids)
        self.num_layers = len(inner.layers)
        if self.layer_ids and self.layer_ids[-1] >= self.num_layers:
            raise ValueError(f"tap {self.layer_ids[-1]} beyond the target's {self.num_layers} layers")
        self.tied = self.head_module is inner.embed_tokens
        self._check_plain_forward()

    def _check_plain_forward(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        ids = mx.arange(1, 5, dtype=mx.uint32)[None]
        own, tapped = make_prompt_cache(self.model), make_prompt_cache(self.model)
        want = self.model(ids, cache=own)
        final, _ = self.forward(ids, tapped)
        same = mx.array_equal(self.lm_head(final), want, equal_nan=True).item()
        for a, b in zip(own, tapped):
            same = same and all(mx.array_equal(x, y, equal_nan=True).item() for x, y in zip(a.state, b.state))
        if not same:
            raise ValueError(f"DSpark taps need a target whose forward is embedding, layers, norm and head "
                             f"and nothing else; {type(self.inner).__name__}'s differs (its logits or KV "
                             f"change when run layer by layer)")

    @property
    def row_bytes(self) -> int:
        """Bytes of one position's tapped states as the engine keeps them (float32, ``m*d``)."""
        return 4 * len(self.layer_ids) * self.model.args.hidden_size

    def embed(self, ids: mx.array) -> mx.array:
        """Token ids ``[...]`` -> embeddings ``[..., d]`` (the target's frozen table)."""
        return self.inner.embed_tokens(ids)

    @property
    def head_module(self) -> nn.Module:
        """The module holding the LM head's rows: the tied embedding (whose ``as_linear`` is the
        head) or ``lm_head``; the fused passes' rule (``metal_kernels.fused.head_module``)."""
        return head_module(self.model)

    def lm_head(self, h: mx.array) -> mx.array:
        """Final-normed states ``[..., d]`` -> logits ``[..., V]``."""
        return self.head_module.as_linear(h) if self.tied else self.head_module(h)

    def forward(self, ids: mx.array, cache: list | None = None) -> tuple[mx.array, mx.array]:
        """Run the target on ``ids`` ``[N, S]`` (appending to ``cache`` if given).

        Returns:
            ``(final, taps)``: final-normed states ``[N, S, d]`` (``lm_head(final)`` are the
            logits) and tapped states ``[N, S, m*d]`` in the activation dtype.
        """
        h = self.inner.embed_tokens(ids)
        if cache is None:
            cache = [None] * self.num_layers
        mask = create_attention_mask(h, cache[0])
        taps = [h] if -1 in self.layer_ids else []
        wanted = set(self.layer_ids)
        for i, (layer, c) in enumerate(zip(self.inner.layers, cache)):
            h = layer(h, mask, cache=c)
            if i in wanted:
                taps.append(h)
        return self.inner.norm(h), mx.concatenate(taps, axis=-1)


def model_config_dict(model: nn.Module) -> dict:
    """The target's HF-style config from its mlx-lm ``ModelArgs`` (for a new draft config)."""
    import dataclasses

    args = model.args
    d = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
    d.setdefault("num_hidden_layers", len(model.model.layers))
    if d.get("head_dim") is None:
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    return d
