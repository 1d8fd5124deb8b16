"""Process-wide MLX settings that must be in the environment before ``mlx.core`` is imported.

MLX reads these variables once, when its first device or stream is made, so they are set here,
from ``engine/__init__.py``, before anything imports ``mlx.core``. A value already in the
environment is kept (the deployer's choice wins).

``MLX_USE_CUDA_GRAPHS=0`` (MLX-CUDA only; other backends never read it): MLX-CUDA 0.32.4 records
each evaluation's kernels as a CUDA graph keyed by its topology, and updates or instantiates an
executable graph before launching it (``mlx/backend/cuda/device.cpp``). For the engine's fused
passes (one kernel per evaluation: the default model) that bookkeeping is pure overhead: on an
NVIDIA H200, direct stream launches made an empty fused draft launch 0.53 -> 0.27 ms, the fused
DSpark draft network 0.97 -> 0.81 ms, a drafter cycle ~12% cheaper and one-token fused decode
5-8% faster. Passes of many kernels gain from graphs instead (mlx-lm's modules on an 8B-shaped
4-bit stack: 8-16 verify rows ~18 ms with graphs, ~23 ms without; docs/benchmarks.md,
seventeenth session), so the server chooses per model before importing the engine
(``SPECSERVE_CUDA_GRAPHS``, ``server/cli.py``); this module's default serves the engine's own
default target.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("specserve.mlx_env")

MLX_ENV_DEFAULTS: dict[str, str] = {"MLX_USE_CUDA_GRAPHS": "0"}


def apply_mlx_env_defaults() -> dict[str, str]:
    """Put :data:`MLX_ENV_DEFAULTS` into ``os.environ`` where a variable is unset. Idempotent.

    Returns:
        ``{name: value}`` in effect for every variable of :data:`MLX_ENV_DEFAULTS` (the
        deployer's value where one was set).
    """
    late = "mlx.core" in sys.modules
    for name, value in MLX_ENV_DEFAULTS.items():
        if name not in os.environ:
            if late:
                log.info("%s=%s set after mlx.core was imported: it may not apply", name, value)
            os.environ[name] = value
    return {name: os.environ[name] for name in MLX_ENV_DEFAULTS}
