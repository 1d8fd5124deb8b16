"""Shared fixtures: a tiny random Llama engine (unit tier) and the real default model (model tier)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import engine  # noqa: E402,F401,I001  (loads OpenBLAS before anything imports mlx.core: tiny does)
from engine import Engine, EngineConfig  # noqa: E402
from helpers import pin_cost  # noqa: E402
from tiny import tiny_loaded  # noqa: E402

# SPECSERVE_COMPILE=on|off runs every engine of the suite with compiled target passes forced on
# or off (tests that pin the mode themselves pass their own EngineConfig.compile and are kept).
_FORCED_COMPILE = os.environ.get("SPECSERVE_COMPILE")
if _FORCED_COMPILE:
    import dataclasses

    _engine_init = Engine.__init__

    def _forced_init(self, config=None, *args, **kwargs):
        config = config or EngineConfig()
        if config.compile == "auto":
            config = dataclasses.replace(config, compile=_FORCED_COMPILE)
        _engine_init(self, config, *args, **kwargs)

    Engine._unforced_init = _engine_init  # for tests of the `auto` mode itself
    Engine.__init__ = _forced_init


@pytest.fixture(scope="session")
def tiny():
    """The tiny model, loaded once."""
    return tiny_loaded()


@pytest.fixture(scope="session")
def tiny_engine(tiny):
    eng = Engine(EngineConfig(speculation="prompt_lookup", max_verify_rows=16, calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    pin_cost([eng])  # the tests' drafting must not depend on how fast this machine timed the widths
    yield eng
    eng.stop()


@pytest.fixture(scope="session")
def default_engine():
    """The real default model (SmolLM2-135M-Instruct), fetched into the user cache on first use,
    with the DSpark drafter shipped for it in models/."""
    eng = Engine(EngineConfig(speculation="prompt_lookup", dspark=True, calibration_contexts=(48, 1100))).start(
        wait=True, timeout=900)
    yield eng
    eng.stop()


class LiveServer:
    """uvicorn serving an app on 127.0.0.1 in a background thread."""

    def __init__(self, app, eng, metrics):
        import threading

        import uvicorn

        from server.http_protocol import uvicorn_config

        self.engine, self.metrics = eng, metrics
        self.server = uvicorn.Server(uvicorn_config(app, metrics, "127.0.0.1", 0, "warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        import time

        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        eng.wait_ready(300)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def tiny_server(tiny):
    from server.app import create_app
    from server.metrics import Metrics
    from server.settings import Settings

    metrics = Metrics()
    eng = Engine(EngineConfig(speculation="auto", calibration_contexts=(40, 300)), loaded=tiny, sink=metrics)
    live = LiveServer(create_app(eng, Settings(max_n=4), metrics), eng, metrics)
    yield live
    live.stop()


def tiny_live_server(tiny_model, **settings) -> LiveServer:
    """A LiveServer on the tiny model with these server settings (engine options follow them, as
    in `specserve`); calibration is shortened for tests."""
    import dataclasses

    from server.app import create_app
    from server.metrics import Metrics
    from server.settings import Settings

    s = Settings(**settings)
    metrics = Metrics()
    cfg = dataclasses.replace(s.engine_config(), calibration_contexts=(40, 300))
    eng = Engine(cfg, loaded=tiny_model, sink=metrics)
    return LiveServer(create_app(eng, s, metrics), eng, metrics)
