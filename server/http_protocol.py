"""uvicorn's HTTP/1.1 protocol, answering the requests it refuses itself as the API does.

uvicorn refuses bytes that are not an HTTP/1.1 request (a malformed request line or header, an
upgrade it cannot serve) before any application code runs, with a plain-text 400
(``Invalid HTTP request received.``). :func:`json_error_protocol` gives its h11 protocol with
the same status, the ``{"error": {"message", "type", "param", "code"}}`` body of every other
error of this server (code ``invalid_http_request``), and a hook that counts the refusal;
:func:`uvicorn_config` is the one uvicorn configuration the CLI (and the tests' live servers)
serve the app with.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

INVALID_HTTP_CODE = "invalid_http_request"


def json_error_protocol(on_reject: Callable[[], None] | None = None) -> type[H11Protocol]:
    """An :class:`H11Protocol` subclass for ``uvicorn.Config(http=...)`` whose own 400 answers
    are OpenAI-style JSON; ``on_reject()`` runs once per refused connection (the metrics'
    rejection counter). The connection closes after the answer, as uvicorn's does."""

    class JSONErrorH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            if on_reject is not None:
                on_reject()
            body = json.dumps(error_body(msg, "invalid_request_error", None, INVALID_HTTP_CODE),
                              ensure_ascii=True, separators=(",", ":")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return JSONErrorH11Protocol


def uvicorn_config(app, metrics, host: str, port: int, log_level: str) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: h11 with :func:`json_error_protocol`, whose refusals
    count in ``metrics`` as rejections with reason ``InvalidHTTP``; 5 s for open connections
    after a shutdown begins (the drain has finished the responses by then)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          http=json_error_protocol(lambda: metrics.request_rejected("InvalidHTTP")))
