"""uvicorn's HTTP/1.1 protocol, answering the requests it refuses itself as the API does.

uvicorn's h11 protocol answers bytes that do not parse as HTTP/1.1 (a malformed request line,
header or ``Content-Length``, or a malformed chunked body, which cuts off a request the app was
already reading) with a plain-text 400 (``Invalid HTTP request received.``) and closes the
connection. :func:`json_error_protocol` gives that protocol with the same status, the
``{"error": {"message", "type", "param", "code"}}`` body of every other error of this server
(code ``invalid_http_request``), and a hook that counts the refusal;
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
    rejection counter). The connection closes after the answer, as uvicorn's does. Where the
    app has already answered on the connection (a 401 or 413 sent before a chunked body ended
    badly), no second response can follow: the connection just closes, counted nowhere (its
    request was, with the app's answer). uvicorn's own method raises h11's
    ``LocalProtocolError`` there, which asyncio logs as a fatal error with a traceback."""

    class JSONErrorH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # (a response went out)
                self.transport.close()
                return
            if on_reject is not None:
                on_reject()
            body = json.dumps(error_body(msg, "invalid_request_error", None, INVALID_HTTP_CODE),
                              ensure_ascii=True, separators=(",", ":")).encode()
            headers = [*self.server_state.default_headers,  # (date and server, as on every response)
                       (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
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
