"""Request guard: shutdown draining, API-key auth and the request body limit (pure ASGI).

It runs before routing, so a refused request costs no body read and no JSON parsing:

1. While the server drains for shutdown, every path but /health and /metrics gets 503
   (``Retry-After``, ``Connection: close``) so load balancers move traffic elsewhere.
2. With ``api_key`` set, every path but /health, /ready and (unless ``protect_metrics``)
   /metrics needs ``Authorization: Bearer <key>``; otherwise 401 ``authentication_error``. The
   comparison is constant-time (:func:`hmac.compare_digest` over SHA-256 digests, so neither the
   key's bytes nor its length show in the timing).
3. A body whose Content-Length exceeds ``max_body_bytes`` gets 413 before any of it is read; a
   body without one (chunked) is counted as it arrives and fails with 413 as soon as it passes the
   limit, so an unbounded body is never buffered.

Refusals are counted in ``specserve:requests_rejected_total{reason}``.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response

ALWAYS_OPEN = frozenset({"/health", "/ready"})
OPEN_WHILE_DRAINING = frozenset({"/health", "/metrics"})


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a streamed body passes the limit (the app's HTTP error handler
    turns it into the 413 envelope)."""

    code = "body_too_large"

    def __init__(self, limit: int):
        super().__init__(413, f"The request body exceeds this server's limit of {limit} bytes.")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def bearer_token(scope: Scope) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


class Guard:
    """ASGI middleware; reads settings, metrics and the ``draining`` flag from the app's state."""

    def __init__(self, app: ASGIApp, state):
        self.app = app
        self.state = state
        key = state.settings.api_key
        self.key_digest = hashlib.sha256(key.get_secret_value().encode()).digest() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        settings, path = self.state.settings, scope["path"]
        if getattr(self.state, "draining", False) and path not in OPEN_WHILE_DRAINING:
            return await self._refuse(scope, receive, send, "ShuttingDown", error_response(
                503, "The server is shutting down; retry on another replica.", code="shutting_down",
                headers={"Retry-After": "1", "Connection": "close"}))
        if self.key_digest is not None and self._needs_key(path) and not self._authorized(scope):
            return await self._refuse(scope, receive, send, "Unauthorized", error_response(
                401, "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        limit = settings.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, "BodyTooLarge", error_response(
                413, BodyTooLarge(limit).detail, code=BodyTooLarge.code, headers={"Connection": "close"}))
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    self.state.metrics.request_rejected("BodyTooLarge")
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)

    def _needs_key(self, path: str) -> bool:
        if path in ALWAYS_OPEN:
            return False
        return path != "/metrics" or self.state.settings.protect_metrics

    def _authorized(self, scope: Scope) -> bool:
        token = bearer_token(scope)
        digest = hashlib.sha256(token or b"").digest()
        return hmac.compare_digest(digest, self.key_digest) and token is not None

    async def _refuse(self, scope, receive, send, reason: str, response) -> None:
        self.state.metrics.request_rejected(reason)
        await response(scope, receive, send)
