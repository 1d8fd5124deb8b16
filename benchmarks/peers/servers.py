"""The servers compared in benchmarks/peers: how each is started, checked for readiness and stopped.

Every server runs as its own process (own session, so stopping it stops its children) on
127.0.0.1 with a free port and its log in the work directory; benchmarks/peers/run.py decides
whether they are up together or one at a time, and only ever has one request in flight. All of
them serve the same default model:

- ``specserve_off`` / ``specserve_auto``: the real CLI (``python -m server``) on the default
  GGUF with ``--weights POLICY`` and ``--speculation off|auto``;
- ``mlx_lm``: ``python -m mlx_lm server`` on the MLX directory written by
  ``python -m engine.convert --weights POLICY`` (same tensors, dtype and tokenizer). On Linux
  CPUs the process gets the same BLAS specserve loads (``LD_PRELOAD`` of that OpenBLAS and the
  same ``OPENBLAS_CORETYPE``): the mlx[cpu] wheel otherwise runs the netlib reference BLAS,
  3-10x slower, and the comparison would measure the BLAS rather than the server;
- ``mlx_lm_refblas``: the same without the preload (what ``pip install mlx-lm`` gives);
- ``llama_cpp``: ``python -m llama_cpp.server`` (llama-cpp-python) on the GGUF itself (Q4_1
  kept quantized: llama.cpp runs Q4_1 natively), all cores for decode and prefill;
- ``llama_cpp_1t``: the same with one thread (llama.cpp's threads spin at barriers, so on a
  machine whose cores are shared with other jobs all-core runs can collapse).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Peer:
    """One server configuration. ``argv`` may contain ``{port}``."""

    name: str
    label: str
    argv: list[str]
    model: str  # the ``model`` field requests send
    ready_path: str
    env: dict = field(default_factory=dict)
    cwd: str = str(ROOT)

    def command(self, port: int) -> list[str]:
        return [a.format(port=port) for a in self.argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blas_env() -> dict:
    """Environment that makes another MLX process use the BLAS specserve preloads."""
    import engine

    if engine.BLAS.status != "openblas" or not engine.BLAS.path:
        return {}
    env = {"LD_PRELOAD": engine.BLAS.path}
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    return env


def make_peers(names: list[str], gguf: str, mlx_dir: str, weights: str, threads: int,
               n_ctx: int) -> list[Peer]:
    """The configurations named in ``names`` (see the module docstring)."""
    py = sys.executable
    spec = [py, "-m", "server", "--host", "127.0.0.1", "--port", "{port}", "--model", gguf,
            "--served-model-name", "smollm2-135m-instruct", "--weights", weights,
            "--log-level", "warning"]
    mlx = [py, "-m", "mlx_lm", "server", "--model", mlx_dir, "--host", "127.0.0.1", "--port", "{port}",
           "--log-level", "WARNING"]

    def llama(n: int) -> list[str]:
        return [py, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", "{port}",
                "--n_ctx", str(n_ctx), "--n_threads", str(n), "--n_threads_batch", str(n),
                "--model_alias", "smollm2-135m-instruct", "--verbose", "False"]

    table = {
        "specserve_off": Peer("specserve_off", "specserve (speculation off)",
                              spec + ["--speculation", "off"], "smollm2-135m-instruct", "/ready"),
        "specserve_auto": Peer("specserve_auto", "specserve (speculation auto)",
                               spec + ["--speculation", "auto"], "smollm2-135m-instruct", "/ready"),
        "mlx_lm": Peer("mlx_lm", "mlx_lm.server (same OpenBLAS)", mlx, "default_model", "/health",
                       env=blas_env()),
        "mlx_lm_refblas": Peer("mlx_lm_refblas", "mlx_lm.server (wheel's reference BLAS)", mlx,
                               "default_model", "/health", env={"LD_PRELOAD": ""}),
        "llama_cpp": Peer("llama_cpp", f"llama.cpp (llama-cpp-python, Q4_1, {threads} threads)", llama(threads),
                          "smollm2-135m-instruct", "/v1/models"),
        "llama_cpp_1t": Peer("llama_cpp_1t", "llama.cpp (llama-cpp-python, Q4_1, 1 thread)",
                             llama(1), "smollm2-135m-instruct",
                             "/v1/models"),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; have {sorted(table)}")
    return [table[n] for n in names]


def python_path() -> str:
    """PYTHONPATH for a child process: the repository first, then whatever the caller had
    (on the GPU machine the staged wheels live in a PYTHONPATH directory)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


class Running:
    """A started peer: ``url``, ``proc`` and its log file. Use as a context manager."""

    def __init__(self, peer: Peer, workdir: Path, timeout: float = 900):
        self.peer = peer
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{peer.name}.log"
        env = {**os.environ, "PYTHONPATH": python_path(), **peer.env}
        if env.get("LD_PRELOAD") == "":
            env.pop("LD_PRELOAD")
        self._log = open(self.log_path, "a")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(peer.command(self.port), cwd=peer.cwd, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - self.started

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.peer.name} exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + self.peer.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.peer.name} not ready after {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
