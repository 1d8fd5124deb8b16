import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from tiny import tiny_model

from engine.taps import Taps


def test_taps_record_layer_outputs_without_changing_the_forward():
    model, _ = tiny_model(seed=3)
    tokens = mx.array([[5, 6, 7, 8, 9]])
    names = [k for k, _ in tree_flatten(model.parameters())]
    before = model(tokens)
    taps = Taps(model, [-1, 0])
    with taps.recording() as store:
        after = model(tokens)
    assert mx.array_equal(before, after).item()
    assert [k for k, _ in tree_flatten(model.parameters())] == names  # parameter paths unchanged
    hidden = taps.concat(store)
    assert hidden.shape == (1, 5, 2 * 320) and hidden.dtype == mx.float32
    # the embedding tap is the embedding; layer 0's tap is layer 0 applied to it
    emb = model.model.embed_tokens(tokens)
    assert mx.array_equal(hidden[..., :320], emb).item()
    layer0 = model.model.layers[0](emb, "causal", None)
    assert mx.allclose(hidden[..., 320:], layer0, atol=1e-5).item()
    # outside a recording nothing is stored
    with taps.recording() as store2:
        pass
    model(tokens)
    assert store2 == {}


def test_taps_refuse_the_last_layer():
    model, _ = tiny_model()
    with pytest.raises(ValueError):
        Taps(model, [1])  # the tiny model has 2 layers: layer 1 is the last
