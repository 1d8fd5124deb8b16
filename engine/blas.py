"""Load an optimised BLAS for MLX's Linux CPU backend before ``mlx.core`` is imported.

The ``mlx[cpu]`` wheel links the netlib reference BLAS (``libblas.so.3`` bundled in
``mlx_cpu.libs``). MLX calls ``cblas_sgemm`` for every float32 matmul, and the reference
implementation is 3-10x slower than OpenBLAS on the same core. Loading OpenBLAS with
``RTLD_GLOBAL`` before ``libmlx.so`` is loaded makes the dynamic linker resolve
``cblas_*`` to OpenBLAS (global scope is searched before the library's own dependencies).

Measured on a 2-core x86-64 VM with SmolLM2-135M in float32: prefill 13 -> 368 tok/s,
decode 9 -> 27 tok/s, and an 8-row verify pass 7x -> 1.7x the cost of one row.

Search order (``SPECSERVE_BLAS``: ``auto`` | ``off`` | a path to a shared library):
1. an explicit path;
2. the system OpenBLAS (Debian/Ubuntu ``libopenblas0-pthread``, Fedora ``openblas``);
3. the ``cmeel-openblas`` wheel (``pip install 'specserve[openblas]'``; needs ``libgfortran.so.5``).

Nothing is done on macOS (MLX uses Accelerate and Metal there) or when ``mlx.core`` is
already imported (too late: a warning says so).

Kernel choice matters for exactness, not only speed: OpenBLAS picks micro-kernels by CPU, and
its AVX-512 (SkylakeX/Cooperlake) sgemm kernels give row results that depend on the number of
rows from 2 rows on, so start-up calibration would allow no speculation at all; its Haswell
(AVX2) kernels keep rows independent up to 12 rows. When ``OPENBLAS_CORETYPE`` is unset and the
CPU has AVX2 and FMA, it is set to ``Haswell`` before the library loads (a user's value wins).

OpenBLAS's idle threads spin for ``2^OPENBLAS_THREAD_TIMEOUT`` cycles (default 2^28, ~0.1 s) after
each call before they sleep. On a small machine they then take the cores from whatever runs next:
after every prefill the CPU fused pass's decode steps ran at 17 ms instead of 4 for ~90 ms. When
unset, it is set to 4 (the minimum: sleep at once); prefill speed was unchanged (512 tokens in
1.84 s either way).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import site
import sys
from dataclasses import dataclass

log = logging.getLogger("specserve.blas")

_SYSTEM_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

INSTALL_HINT = (
    "Install OpenBLAS for a 3-10x faster CPU backend: `sudo apt-get install libopenblas0-pthread` "
    "(Debian/Ubuntu), `sudo dnf install openblas` (Fedora), or `pip install 'specserve[openblas]'` "
    "(needs libgfortran5). `make setup` tries this for you."
)


@dataclass(frozen=True)
class BlasInfo:
    """What :func:`preload_blas` did. ``path`` is None when MLX keeps its bundled BLAS."""

    status: str  # "openblas", "bundled", "not-linux", "disabled", "too-late"
    path: str | None = None
    detail: str = ""


_RESULT: BlasInfo | None = None


def _cmeel_candidates() -> list[str]:
    roots = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
    found = []
    for root in roots:
        found += glob.glob(os.path.join(root, "cmeel.prefix", "lib", "libopenblas.so*"))
    return found


def _candidates(choice: str) -> list[str]:
    if choice not in ("", "auto"):
        return [choice]
    paths = [p for p in _SYSTEM_CANDIDATES if os.path.exists(p)]
    lib = ctypes.util.find_library("openblas")
    if lib:
        paths.append(lib)
    return paths + _cmeel_candidates()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _choose_coretype() -> None:
    if "OPENBLAS_CORETYPE" not in os.environ and {"avx2", "fma"} <= _cpu_flags():
        os.environ["OPENBLAS_CORETYPE"] = "Haswell"
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # (see the module docstring)


def preload_blas(choice: str | None = None) -> BlasInfo:
    """Load OpenBLAS globally so MLX's CPU matmuls use it. Idempotent.

    Args:
        choice: ``"auto"`` (default, from ``SPECSERVE_BLAS``), ``"off"``, or a library path.

    Returns:
        A :class:`BlasInfo` saying which library, if any, was loaded.
    """
    global _RESULT
    if _RESULT is not None:
        return _RESULT
    choice = (choice if choice is not None else os.environ.get("SPECSERVE_BLAS", "auto")).strip()
    if not sys.platform.startswith("linux"):
        _RESULT = BlasInfo("not-linux")
    elif choice.lower() in ("off", "0", "false", "none", "bundled"):
        _RESULT = BlasInfo("disabled", detail="SPECSERVE_BLAS=off")
    elif "mlx.core" in sys.modules:
        _RESULT = BlasInfo("too-late", detail="mlx.core was imported before engine.blas")
        log.warning("OpenBLAS not loaded: mlx.core was imported first. Import `engine` before mlx.")
    else:
        errors = []
        _choose_coretype()
        for path in _candidates(choice):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:  # e.g. libgfortran.so.5 missing for the cmeel wheel
                errors.append(f"{path}: {exc}")
                continue
            _RESULT = BlasInfo("openblas", path=path,
                               detail=f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'auto')} "
                                      f"OPENBLAS_THREAD_TIMEOUT={os.environ.get('OPENBLAS_THREAD_TIMEOUT')}")
            break
        else:
            detail = "; ".join(errors) or "no OpenBLAS found"
            _RESULT = BlasInfo("bundled", detail=detail)
            log.warning("MLX CPU backend uses its slow reference BLAS (%s). %s", detail, INSTALL_HINT)
    return _RESULT
