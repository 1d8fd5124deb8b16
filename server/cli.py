"""``specserve``: parse settings, then start uvicorn with the app.

Options that must act before MLX is imported (``--blas``, ``--cache-dir``) are exported to the
environment first; the engine package is imported only after that.

Shutdown: the first SIGTERM or SIGINT drains (new requests get 503, in-flight ones get
``shutdown_timeout`` seconds, the rest end with a 503 error), then uvicorn closes connections and
the engine stops; a SIGTERM shutdown exits 0. A second signal skips what is left of the drain.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading


def train_dspark(argv: list[str]) -> int:
    """``specserve train-dspark --target ... --out ...``: the DSpark self-distillation trainer
    (drafters/dspark/train.py) with the engine's loader, so GGUF targets work too."""
    # engine first: it loads OpenBLAS before anything imports mlx.core
    from engine.loader import load_target  # noqa: I001
    from drafters.dspark.train import main as train_main

    def load(spec: str, weights: str):
        loaded = load_target(spec, weights=weights)
        return loaded.model, loaded.tokenizer

    return train_main(argv, load_target=load)


def main(argv: list[str] | None = None) -> None:
    from .settings import load_settings

    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "train-dspark":
        raise SystemExit(train_dspark(argv[1:]))
    settings = load_settings(argv)
    os.environ["SPECSERVE_BLAS"] = settings.blas
    if settings.cache_dir:
        os.environ["SPECSERVE_CACHE_DIR"] = settings.cache_dir
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from engine import BLAS, MLX_ENV, Engine

    from .app import create_app, drain
    from .metrics import Metrics

    log = logging.getLogger("specserve")
    log.info("BLAS: %s %s %s", BLAS.status, BLAS.path or "", BLAS.detail)
    log.info("MLX environment: %s", " ".join(f"{k}={v}" for k, v in MLX_ENV.items()))
    metrics = Metrics()
    engine = Engine(settings.engine_config(), sink=metrics)
    app = create_app(engine, settings, metrics)

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame):
            if not self.draining and not self.should_exit:
                self.draining = True  # drain off the signal handler; uvicorn's exit follows
                log.info("signal %d: draining for up to %.1f s", sig, settings.shutdown_timeout)
                threading.Thread(target=self._drain_then_exit, args=(sig,), name="specserve-drain",
                                 daemon=True).start()
                return
            self._exit(sig)

        def _drain_then_exit(self, sig):
            try:
                drain(app, settings.shutdown_timeout)
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

    # after the drain only finished responses remain to be flushed
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=5)
    Server(config).run()


if __name__ == "__main__":
    main()
