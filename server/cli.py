"""``specserve``: parse settings, then start uvicorn with the app.

Options that must act before MLX is imported (``--blas``, ``--cache-dir``, ``--cuda-graphs``) are
exported to the environment first; the engine package is imported only after that.

Shutdown: the first SIGTERM or SIGINT drains (new requests get 503, in-flight ones get
``shutdown_timeout`` seconds, the rest end with a 503 error), then uvicorn closes connections and
the engine stops; a SIGTERM shutdown exits 0. A second signal while the drain runs skips what is
left of it: the requests still running end with the 503 error at once. Later signals go to uvicorn
(a SIGINT once its shutdown began forces the exit, dropping open connections).
A signal while the engine is still loading or calibrating exits at once (0 for SIGTERM) without
waiting for that start-up phase to end.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback


def train_dspark(argv: list[str]) -> int:
    """``specserve train-dspark --target ... --out ...``: the DSpark self-distillation trainer
    (drafters/dspark/train.py) with the engine's loader, so GGUF targets work too."""
    # training runs passes of many kernels: keep MLX's CUDA graphs (engine/mlx_env.py) unless set
    os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "1")
    # engine first: it loads OpenBLAS before anything imports mlx.core
    from engine.loader import load_target  # noqa: I001
    from drafters.dspark.train import main as train_main

    def load(spec: str, weights: str):
        loaded = load_target(spec, weights=weights)
        return loaded.model, loaded.tokenizer

    return train_main(argv, load_target=load)


def dspark_vocab(argv: list[str]) -> int:
    """``specserve dspark-vocab DRAFTER --data ... --size N``: give a DSpark drafter a draft
    vocabulary (drafters/dspark/vocab.py)."""
    import engine  # noqa: F401  (OpenBLAS before mlx.core)
    from drafters.dspark.vocab import main as vocab_main

    return vocab_main(argv)


def cuda_graphs_env(settings, environ=os.environ) -> str:
    """The ``MLX_USE_CUDA_GRAPHS`` value for ``settings.cuda_graphs`` (``"0"`` or ``"1"``): ``on``
    and ``off`` say it; ``auto`` keeps a value already in ``environ``, else turns graphs off only
    where the target is expected to run as fused one-kernel passes (the default model with
    ``fused`` auto/on), whose graph capture costs more than it saves (docs/benchmarks.md)."""
    if settings.cuda_graphs != "auto":
        return "1" if settings.cuda_graphs == "on" else "0"
    if "MLX_USE_CUDA_GRAPHS" in environ:
        return environ["MLX_USE_CUDA_GRAPHS"]
    return "0" if settings.model == "default" and settings.fused != "off" else "1"


def main(argv: list[str] | None = None) -> None:
    from .settings import load_settings

    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "train-dspark":
        raise SystemExit(train_dspark(argv[1:]))
    if argv and argv[0] == "dspark-vocab":
        raise SystemExit(dspark_vocab(argv[1:]))
    settings = load_settings(argv)
    os.environ["SPECSERVE_BLAS"] = settings.blas
    os.environ["MLX_USE_CUDA_GRAPHS"] = cuda_graphs_env(settings)
    if settings.cache_dir:
        os.environ["SPECSERVE_CACHE_DIR"] = settings.cache_dir
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from engine import BLAS, MLX_ENV, Engine

    from .app import create_app, drain
    from .http_protocol import uvicorn_config
    from .metrics import Metrics

    log = logging.getLogger("specserve")
    log.info("open files: up to %s", raise_open_file_limit())
    log.info("BLAS: %s %s %s", BLAS.status, BLAS.path or "", BLAS.detail)
    log.info("MLX environment: %s", " ".join(f"{k}={v}" for k, v in MLX_ENV.items()))
    metrics = Metrics()
    engine = Engine(settings.engine_config(), sink=metrics)
    app = create_app(engine, settings, metrics)

    class Server(uvicorn.Server):
        draining = False
        signalled: int | None = None  # the first SIGTERM/SIGINT received

        def __init__(self, config):
            super().__init__(config)
            self.cut = threading.Event()  # set by a second signal: the drain aborts what is left now

        def handle_exit(self, sig, frame):
            if self.signalled is None:
                self.signalled = sig
            if not self.draining and not self.should_exit:
                self.draining = True  # drain off the signal handler; uvicorn's exit follows
                log.info("signal %d: draining for up to %.1f s", sig, settings.shutdown_timeout)
                threading.Thread(target=self._drain_then_exit, args=(sig,), name="specserve-drain",
                                 daemon=True).start()
                return
            if self.draining and not self.cut.is_set() and not self.should_exit:  # (the drain still runs)
                log.info("signal %d: cutting the drain short", sig)
                self.cut.set()
                return
            self._exit(sig)  # uvicorn's own handling: a SIGINT once its shutdown began forces the exit

        def _drain_then_exit(self, sig):
            try:
                drain(app, settings.shutdown_timeout, self.cut)
            except Exception:
                log.exception("drain failed")
            finally:
                self._exit(sig)

        def _exit(self, sig):
            super().handle_exit(sig, None)
            # uvicorn re-raises the signal after its graceful shutdown, which makes the exit
            # status -15; a SIGTERM-requested shutdown that completed is a clean exit (0).
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    server = Server(uvicorn_config(app, metrics, settings.host, settings.port, settings.log_level))
    try:
        server.run()
    except BaseException as exc:  # SystemExit (uvicorn's start-up failures), KeyboardInterrupt, bugs
        _leave_if_engine_runs(engine, exit_status(server.signalled, exc), exc)
        if isinstance(exc, KeyboardInterrupt) and server.signalled is not None:
            _quiet_interrupt()
        raise
    status = exit_status(server.signalled, None)
    _leave_if_engine_runs(engine, status, None)
    if status:  # (a SIGINT where SIGINT was ignored at launch: uvicorn's re-raise did nothing)
        raise SystemExit(status)


def _quiet_interrupt() -> None:
    """No traceback for the KeyboardInterrupt leaving :func:`main`: uvicorn re-raises a Ctrl-C
    (`signal.raise_signal`) after the graceful shutdown it ran for it, so it is a finished
    shutdown, not a crash. Python still ends the process by SIGINT after its teardown, as for
    any uncaught KeyboardInterrupt, so a calling shell or supervisor sees the interrupt."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)

    sys.excepthook = hook


def raise_open_file_limit(target: int = 65536) -> int | str:
    """Raise this process's soft limit of open files to ``target`` (within the hard limit), as
    vLLM does at start-up: every client connection holds a descriptor, and uvicorn keeps one
    whose request headers never finish until the client hangs up (docs/security.md). Where the
    platform refuses that (macOS caps it at 10,240), 10,240 then 4,096 are tried. Returns the
    soft limit now in force ("unlimited", or the old one where every step is refused)."""
    try:
        import resource
    except ImportError:  # (not a Unix)
        return "the platform's default"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    # (macOS refuses more than OPEN_MAX, 10240, even under an unlimited hard limit)
    for limit in sorted({want, min(want, 10240), min(want, 4096)}, reverse=True):
        if soft == resource.RLIM_INFINITY or soft >= limit:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            soft = limit
            break
        except (ValueError, OSError):
            continue
    return "unlimited" if soft == resource.RLIM_INFINITY else soft


def exit_status(signalled: int | None, exc: BaseException | None) -> int:
    """The process's exit status after the server stopped: what ``exc`` says if it is a
    ``SystemExit`` (uvicorn exits 3 when it cannot start, e.g. on a port in use), 1 for any other
    error, else 0 after SIGTERM (or no signal) and 128 + the signal after another (SIGINT: 130)."""
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    if exc is not None and not isinstance(exc, KeyboardInterrupt):
        return 1
    if isinstance(exc, KeyboardInterrupt) and signalled is None:
        signalled = signal.SIGINT
    return 0 if signalled in (None, signal.SIGTERM) else 128 + signalled


def _leave_if_engine_runs(engine, status: int, exc: BaseException | None) -> None:
    """Exit at once with ``status`` if the engine thread is still running once the server has
    stopped: a signal (or a failure) during start-up, while the thread is inside a load or
    calibration phase that cannot be interrupted. Ending the interpreter under it would abort
    the process in MLX's C++ runtime ("terminate called without an active exception"), and it
    holds nothing to save, so leave without the interpreter's teardown (printing ``exc``'s
    traceback first, which Python would otherwise print)."""
    if engine.stop(timeout=0):
        return
    log = logging.getLogger("specserve")
    if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
        traceback.print_exception(exc)
    log.warning("engine still %s: exiting (status %d) without waiting for it", engine.health()["state"], status)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
