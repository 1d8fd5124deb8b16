"""The FastAPI app: lifespan starts and stops the engine; health, readiness, models, metrics."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.middleware.base import BaseHTTPMiddleware

from engine import Engine

from .errors import APIError, error_response, install_error_handlers
from .guard import Guard
from .metrics import Metrics
from .openai_api import router as openai_router
from .settings import Settings
from .tokenize_api import router as tokenize_router

log = logging.getLogger("specserve.server")


# Probe endpoints: their 503 answers a probe ("not yet", "not alive") and is no error response.
_PROBES = ("/health", "/ready")


class _CountRequests(BaseHTTPMiddleware):
    """Count every response by endpoint and status, and errors by OpenAI type (not the
    probes' answers: a load balancer polling /ready while the model loads is not an error; nor
    499, nginx's "client closed request", for a client that left before its answer: nothing was
    sent, and the request ended as ``cancelled``)."""

    async def dispatch(self, request: Request, call_next):
        response = await call_next(request)
        metrics: Metrics = request.app.state.metrics
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if response.status_code >= 400 and response.status_code != 499 and endpoint not in _PROBES:
            metrics.errors.labels(_error_type(response.status_code)).inc()
        return response


class _TrailingSlash:
    """Pure ASGI: a path with one trailing slash (``/v1/completions/``) is served as the path
    without it, before the guard and the router see it. Starlette would answer it with a 307
    redirect without a body, which a client that does not follow redirects (httpx's default)
    reads as an unexplained failure. The root path and paths ending in ``//`` are left alone:
    they get the JSON 404 (the app makes no redirects). The guard sees the path the router
    serves, so a slash opens nothing."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/") and not path.endswith("//"):
            scope = dict(scope, path=path[:-1])
            raw = scope.get("raw_path")
            if raw is not None and raw.endswith(b"/"):
                scope["raw_path"] = raw[:-1]
        await self.app(scope, receive, send)


class _RequestId:
    """Pure ASGI: every HTTP response carries ``X-Request-Id``: the request's own when it sent
    one (1-128 visible ASCII characters; anything else is replaced), else a new random id, so a
    client can name one request to an operator (vLLM's ``--enable-request-id-headers``, on
    always). The id is in ``scope["state"]["request_id"]`` for handlers (an unexpected error's
    500 and its log line carry it: server/errors.py, which Starlette runs outside every
    middleware). Outermost, so the guard's refusals (401, 413) carry it too."""

    _VALID = re.compile(rb"[\x21-\x7e]{1,128}")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        rid = given if given is not None and self._VALID.fullmatch(given) else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = rid.decode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "unavailable_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")


def create_app(engine: Engine, settings: Settings | None = None, metrics: Metrics | None = None) -> FastAPI:
    """Build the app around an engine (started by the lifespan if it is not yet running)."""
    settings = settings or Settings()
    metrics = metrics or Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        # a worker still loading ends at its next start-up phase boundary, which may be tens of
        # seconds away: the CLI does not wait for it (server/cli.py)
        engine.stop(timeout=10.0 if engine.ready else 1.0)

    # (no redirects: _TrailingSlash serves one trailing slash, other paths the router lacks get a 404)
    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan, redirect_slashes=False)
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.started = int(time.time())
    app.state.fingerprint = "fp_" + hashlib.sha1(f"{settings.model}:{settings.weights}".encode()).hexdigest()[:10]
    app.state.draining = False
    metrics.attach(engine)
    install_error_handlers(app)
    app.add_middleware(Guard, state=app.state)
    app.add_middleware(_CountRequests)  # counts the guard's refusals too
    app.add_middleware(_TrailingSlash)  # the guard sees the path the router serves
    app.add_middleware(_RequestId)  # outermost: every response carries X-Request-Id
    log.info("API key authentication %s; /metrics %s", "on" if settings.api_key else "off",
             "protected" if settings.api_key and settings.protect_metrics else "open")
    app.include_router(openai_router)
    app.include_router(tokenize_router)

    def get_and_head(path: str):
        """GET and HEAD on ``path``, with one OpenAPI operation (the GET's). Requests reach one
        route of both methods, kept out of the schema (in it, the two operations would share an
        id, and FastAPI warns of it), so a 405 for another method allows GET and HEAD
        (with a route per method, Starlette answered from the first partial match: ``Allow:
        HEAD``); a GET route after it, never reached, gives the schema its operation."""
        def register(endpoint):
            app.add_api_route(path, endpoint, methods=["GET", "HEAD"], include_in_schema=False)
            return app.get(path)(endpoint)
        return register

    @get_and_head("/health")
    async def health():
        """Liveness: 200 while the process and the engine thread are alive (even while loading)."""
        info = engine.health()
        if info["state"] in ("error", "stopped"):
            return JSONResponse({"status": info["state"], **info}, status_code=503)
        # (draining: alive, but no longer ready for new requests, as /ready answers)
        return {"status": "ok", **info, "draining": app.state.draining,
                "ready": bool(info.get("ready")) and not app.state.draining}

    @get_and_head("/ready")
    async def ready():
        """Readiness: 503 until the model is loaded, calibrated and warmed up."""
        if not engine.ready:
            info = engine.health()
            message = "Loading model" if info["state"] == "loading" else f"engine {info['state']}"
            return error_response(503, info.get("error", message), "unavailable_error")
        return {"status": "ready"}

    def _model_card():
        info = engine.info()
        return {"id": info.get("model", settings.served_model_name or settings.model), "object": "model",
                "created": app.state.started, "owned_by": "specserve",
                "max_model_len": info.get("context_length")}

    @get_and_head("/v1/models")
    async def models():
        if engine.loaded is None:
            return {"object": "list", "data": []}
        return {"object": "list", "data": [_model_card()]}

    @get_and_head("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if engine.loaded is None or model_id.lower() != engine.loaded.name.lower():
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return _model_card()

    @get_and_head("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def drain(app: FastAPI, timeout: float, cut: threading.Event | None = None) -> bool:
    """Graceful shutdown, blocking (run it off the event loop): from now on every request but
    /health and /metrics gets 503; queued and running generations get ``timeout`` seconds to
    finish (less once ``cut`` is set), then the rest end with a 503 error. Returns True when
    none had to be cut."""
    app.state.draining = True
    finished = app.state.engine.drain(timeout, cut=cut)
    log.info("drained: %s", "all requests finished" if finished else "unfinished requests aborted")
    return finished
