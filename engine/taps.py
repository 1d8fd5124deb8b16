"""Hidden-state taps: record chosen decoder layers' outputs during the normal forward pass.

DSpark conditions on the target's hidden states at a few layers (never the last). Instead of
re-implementing each architecture's forward loop, each tapped mlx-lm layer object gets a
subclass of its own class whose ``__call__`` runs the original and stores the output while a
recording is active. The forward pass, the parameter tree and the numerics are untouched, so a
tapped pass gives the same logits bit for bit. Id ``-1`` taps the embedding output (DeepSpec's
``extract_context_feature`` convention).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

_TAPPED: dict[type, type] = {}


def _tapped_class(cls: type) -> type:
    if cls not in _TAPPED:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            store = self.__dict__.get("_tap_store")
            if store is not None:
                store[self.__dict__["_tap_index"]] = out
            return out

        _TAPPED[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _TAPPED[cls]


def _tap(module: nn.Module, index: int) -> nn.Module:
    if type(module) not in _TAPPED.values():
        module.__class__ = _tapped_class(type(module))
    object.__setattr__(module, "_tap_index", index)
    object.__setattr__(module, "_tap_store", None)
    return module


def _backbone(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None) or getattr(model, "language_model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise ValueError(f"{type(model).__name__}: no `.model.layers` to tap (unsupported architecture)")
    return inner


class Taps:
    """Install taps on ``model`` for ``layer_ids`` and collect them per forward pass.

    Usage::

        taps = Taps(model, [1, 8, 14])
        with taps.recording() as store:
            logits = model(tokens, cache=cache)
        hidden = taps.concat(store)   # [B, L, len(layer_ids) * d] float32

    Raises:
        ValueError: the model has no ``.model.layers``, or an id is outside ``[-1, n_layers - 2]``
            (the last layer is never tapped: DeepSpec ``assert_no_final_target_layer``).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        backbone = _backbone(model)
        n = len(backbone.layers)
        if not self.layer_ids or any(i >= n - 1 or i < -1 for i in self.layer_ids):
            raise ValueError(f"tap ids must be in [-1, {n - 2}] (never the last layer), got {self.layer_ids}")
        self._modules = [
            _tap(backbone.embed_tokens if i == -1 else backbone.layers[i], i) for i in self.layer_ids
        ]

    class _Recording:
        def __init__(self, taps: Taps):
            self.taps, self.store = taps, {}

        def __enter__(self) -> dict:
            for m in self.taps._modules:
                object.__setattr__(m, "_tap_store", self.store)
            return self.store

        def __exit__(self, *exc) -> None:
            for m in self.taps._modules:
                object.__setattr__(m, "_tap_store", None)

    def recording(self) -> Taps._Recording:
        return Taps._Recording(self)

    def concat(self, store: dict) -> mx.array:
        """The tapped outputs in ``layer_ids`` order, concatenated on the feature axis (float32)."""
        return mx.concatenate([store[i].astype(mx.float32) for i in self.layer_ids], axis=-1)
