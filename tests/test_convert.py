"""``python -m engine.convert``: the MLX directory it writes loads in mlx-lm with the same
weights, dtype, logits and tokenizer as specserve serves."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from tiny import write_tiny_mlx_dir

from engine.loader import load_target

ROOT = Path(__file__).resolve().parents[1]
TEXT = "def add(a, b):\n    return a + b  # 123 é"


def convert(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "engine.convert", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_same_model(served, out: Path):
    from mlx_lm import load

    model, tokenizer = load(str(out))
    ids = served.tokenizer.encode(TEXT)
    assert tokenizer.encode(TEXT) == ids
    dtypes = {v.dtype for v in served.model.parameters()["model"]["layers"][0]["mlp"]["up_proj"].values()}
    assert {v.dtype for v in model.parameters()["model"]["layers"][0]["mlp"]["up_proj"].values()} == dtypes
    x = mx.array(ids)[None]
    assert mx.array_equal(model(x), served.model(x)).item()


def test_convert_tiny_dir_round_trips_bit_for_bit(tmp_path):
    src = write_tiny_mlx_dir(tmp_path / "src")
    info = convert("--model", str(src), "--weights", "float32", "--out", str(tmp_path / "out"))
    assert info["weights"] == "float32" and not info["tokenizer_only"]
    assert_same_model(load_target(str(src), weights="float32"), tmp_path / "out")


def test_convert_tokenizer_only_writes_a_local_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    src = write_tiny_mlx_dir(tmp_path / "src")
    convert("--model", str(src), "--tokenizer-only", "--out", str(tmp_path / "tok"))
    assert not (tmp_path / "tok" / "model.safetensors").exists()
    served = load_target(str(src), weights="float32")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert hf.encode(TEXT, add_special_tokens=False) == served.tokenizer.encode(TEXT)


@pytest.mark.model
def test_convert_default_model_float32_matches_served_model(tmp_path):
    info = convert("--weights", "float32", "--out", str(tmp_path / "smollm2"))
    assert info["model"] == "smollm2-135m-instruct" and info["weights"] == "float32"
    config = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert "quantization" not in config
    assert_same_model(load_target("default", weights="float32"), tmp_path / "smollm2")


@pytest.mark.model
def test_convert_default_model_quantized_keeps_the_files_quantization(tmp_path):
    """The GPU path of the peer comparison: mlx_lm.server gets the same 4-bit layers."""
    info = convert("--weights", "quantized", "--out", str(tmp_path / "smollm2-q"))
    assert info["weights"] == "quantized"
    quant = json.loads((tmp_path / "smollm2-q" / "config.json").read_text())["quantization"]
    assert quant["model.layers.0.mlp.up_proj"] == {"group_size": 32, "bits": 4}
    assert_same_model(load_target("default", weights="quantized"), tmp_path / "smollm2-q")
