"""engine.mlx_env: MLX's process-wide variables are set before mlx.core loads; the deployer's win."""

import os
import pathlib
import subprocess
import sys

from engine.mlx_env import MLX_ENV_DEFAULTS, apply_mlx_env_defaults

ROOT = pathlib.Path(__file__).resolve().parents[1]
# records the variable at the moment mlx.core is first imported (MLX reads it once, from then on)
PROBE = ("import os, sys\n"
         "seen = []\n"
         "class Watch:\n"
         "    def find_spec(self, name, path=None, target=None):\n"
         "        if name == 'mlx.core':\n"
         "            seen.append(os.environ.get('MLX_USE_CUDA_GRAPHS'))\n"
         "sys.meta_path.insert(0, Watch())\n"
         "import engine\n"
         "import mlx.core\n"
         "print(seen[0], engine.MLX_ENV['MLX_USE_CUDA_GRAPHS'])\n")


def _run(extra_env):
    env = {k: v for k, v in os.environ.items() if k != "MLX_USE_CUDA_GRAPHS"} | extra_env
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_importing_engine_turns_cuda_graphs_off_before_mlx_loads():
    assert _run({}) == ["0", "0"]


def test_a_deployer_value_is_kept():
    assert _run({"MLX_USE_CUDA_GRAPHS": "1"}) == ["1", "1"]


def test_apply_only_fills_unset_variables(monkeypatch):
    for name in MLX_ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    assert apply_mlx_env_defaults() == MLX_ENV_DEFAULTS
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "1")
    assert apply_mlx_env_defaults()["MLX_USE_CUDA_GRAPHS"] == "1"
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "1"


def test_server_chooses_cuda_graphs_per_model():
    from server.cli import cuda_graphs_env
    from server.settings import load_settings

    def choice(argv, environ=None):
        return cuda_graphs_env(load_settings(argv), environ or {})

    assert choice([]) == "0"  # the default model runs as fused one-kernel passes
    assert choice(["--fused", "off"]) == "1"  # mlx-lm's modules: many kernels per pass
    assert choice(["--model", "some/other-model"]) == "1"
    assert choice([], {"MLX_USE_CUDA_GRAPHS": "1"}) == "1"  # auto keeps the deployer's value
    assert choice(["--model", "x"], {"MLX_USE_CUDA_GRAPHS": "0"}) == "0"
    assert choice(["--cuda-graphs", "on"], {"MLX_USE_CUDA_GRAPHS": "0"}) == "1"
    assert choice(["--cuda-graphs", "off", "--model", "x"]) == "0"
