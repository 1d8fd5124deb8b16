"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import EngineError

from .schemas import ParamError

log = logging.getLogger("specserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "unavailable_error",
}


class APIError(Exception):
    """An error the server answers with directly."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type or _TYPES.get(status, "server_error")
        self.param, self.code, self.headers = param, code, headers


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _ASCIIJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote client input that is not valid
    UTF-8 text (lone surrogates), and rendering the error must never fail."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_response(status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return _ASCIIJSON(
        error_body(message, type or _TYPES.get(status, "server_error"), param, code),
        status_code=status,
        headers=headers,
    )


def engine_error_response(exc: EngineError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return error_response(exc.status, str(exc), exc.type, exc.param, exc.code, headers)


def _param(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # drop pydantic's union-branch markers such as "str" or "list[str]"
    parts = [p for p in parts if not (p in ("str", "int", "float", "bool") or "[" in p or "function-" in p)]
    return ".".join(parts) or None


def _error_param(error: dict) -> str | None:
    """The request field a pydantic error is about; a cross-field check names its own (ParamError)."""
    param = _param(error.get("loc", ()))
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        return ".".join(p for p in (param, cause.param) if p)
    return param


def _message(error: dict) -> str:
    """pydantic's message without the "Value error, " it puts before our validators' own."""
    msg = error.get("msg") or "invalid"
    return msg.removeprefix("Value error, ") if error.get("type") == "value_error" else msg


_BODY_PARSE_FAILED = "There was an error parsing the body"  # FastAPI's detail (e.g. invalid UTF-8)


def _is_json(content_type: str) -> bool:
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


def _body_error(request: Request, error: dict) -> JSONResponse | None:
    """A clear answer when the body as a whole is unusable (FastAPI parses JSON only for a JSON
    Content-Type, so any other type leaves the body unparsed), or None."""
    if tuple(error.get("loc", ())) != ("body",):
        return None
    content_type = request.headers.get("content-type", "")
    if error.get("type") == "missing":
        return error_response(400, "Request body is empty: send a JSON object", code="invalid_json")
    if not content_type:  # (FastAPI parses a body as JSON only under a JSON Content-Type)
        return error_response(415, "Content-Type must be application/json (the request has none)",
                              param="Content-Type", code="unsupported_media_type")
    if not _is_json(content_type):
        return error_response(415, f"Content-Type must be application/json, not {content_type!r}",
                              param="Content-Type", code="unsupported_media_type")
    if error.get("type") in ("model_attributes_type", "dict_type"):
        return error_response(400, "Request body must be a JSON object", code="invalid_json")
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError):
        return engine_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"Invalid JSON body: {first.get('ctx', {}).get('error', 'parse error')}",
                                  code="invalid_json")
        body = _body_error(request, first)
        if body is not None:
            return body
        msg = "; ".join(f"{_error_param(e) or 'body'}: {_message(e)}" for e in errors[:5])
        return error_response(400, msg, param=_error_param(first))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"Unknown path {request.url.path}"
        if exc.status_code == 400 and message == _BODY_PARSE_FAILED:
            return error_response(400, "Invalid JSON body: not UTF-8 encoded JSON, nested too deeply, or a number "
                                  "longer than 4300 digits", code="invalid_json")
        return error_response(exc.status_code, message, code=getattr(exc, "code", None),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        """A bug: a 500 that names the request. Starlette answers it outside every middleware,
        so this handler sets the ``X-Request-Id`` header and counts the response itself."""
        rid = request.scope.get("state", {}).get("request_id")
        log.exception("unhandled error on %s (X-Request-Id %s)", request.url.path, rid)
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.requests.labels(getattr(request.scope.get("route"), "path", "unmatched"), "500").inc()
            metrics.errors.labels("server_error").inc()
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error",
                              headers={"X-Request-Id": rid} if rid else None)
