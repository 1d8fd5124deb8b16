"""Shared fixtures: a tiny random Llama engine (unit tier) and the real default model (model tier)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import engine  # noqa: E402,F401  (loads OpenBLAS before anything imports mlx.core)
from tiny import tiny_loaded  # noqa: E402

from engine import Engine, EngineConfig  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    """The tiny model, loaded once."""
    return tiny_loaded()


@pytest.fixture(scope="session")
def tiny_engine(tiny):
    eng = Engine(EngineConfig(speculation="prompt_lookup", max_verify_rows=16, calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    yield eng
    eng.stop()


@pytest.fixture(scope="session")
def default_engine():
    """The real default model (SmolLM2-135M-Instruct), fetched into the user cache on first use."""
    eng = Engine(EngineConfig(speculation="prompt_lookup", calibration_contexts=(48, 1100))).start(
        wait=True, timeout=900)
    yield eng
    eng.stop()
