"""Tiny random DSpark drafters for tests, importable without the HTTP test modules (the GPU tier
runs tests/test_fused.py on machines without the openai client or scipy)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from drafters.dspark import DSparkModel, init_weights, save_dspark
from drafters.dspark.config import draft_config_from_target
from engine import SpeculativeParams

DS = SpeculativeParams("dspark")
FORCE = SpeculativeParams("dspark", min_draft_tokens=3)


def favour(net: DSparkModel, boosts: dict[int, float]) -> None:
    """Markov bias ``W2(W1[prev])`` = ``boosts[t]`` for every previous token."""
    r = net.config.markov_rank
    w1 = mx.ones_like(net.markov_head.markov_w1.weight)
    w2 = mx.zeros_like(net.markov_head.markov_w2.weight)
    for token, value in boosts.items():
        w2[token] = value / r
    net.markov_head.markov_w1.weight = w1
    net.markov_head.markov_w2.weight = w2


def make_drafter(tiny, path, boosts=None, draft_vocab=None):
    """A 1-layer random drafter for ``tiny`` saved at ``path``; ``draft_vocab``: token ids of a
    draft vocabulary to save with it."""
    cfg = draft_config_from_target(tiny.config, num_hidden_layers=1, target_layer_ids=[0], block_size=5,
                                   mask_token_id=0, markov_rank=16)
    net = DSparkModel(cfg)
    init_weights(net, std=0.05, seed=1)
    if boosts:
        favour(net, boosts)
    if draft_vocab is not None:
        net.draft_vocab = np.asarray(draft_vocab, dtype=np.int32)
    save_dspark(net, path)
    return path
