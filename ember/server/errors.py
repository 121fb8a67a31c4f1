"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Handlers turn validation errors, bad JSON, HTTP exceptions and unexpected exceptions into that shape,
so no client ever sees a traceback or an HTML page."""

from __future__ import annotations

import logging
from http import HTTPStatus

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ember.engine.errors import EngineDeadError, EngineError, InvalidRequestError

logger = logging.getLogger("ember.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client in OpenAI's shape with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_error(exc: EngineError) -> APIError:
    """The one mapping of the engine's typed errors: a refused request is a 400 naming its field, a dead
    engine a 503, a failed request a 500."""
    if isinstance(exc, InvalidRequestError):
        return bad_request(exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not running: {exc}", code="engine_dead")
    return APIError(500, f"The engine failed this request: {exc}", code="engine_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if any(err.get("type") == "json_invalid" for err in errors):
        detail = next(err for err in errors if err.get("type") == "json_invalid")
        reason = detail.get("ctx", {}).get("error", "malformed JSON")
        return bad_request(f"Invalid JSON body: {reason}", code="invalid_json")
    messages: list[str] = []
    param = None
    for err in errors:
        path = _field_path(err.get("loc", ()))
        param = param or (path.split(".", 1)[0] if path else None)
        message = (
            "must be a finite number"
            if err.get("type") == "finite_number"
            else str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        )
        line = f"{path}: {message}" if path else message
        if line not in messages:
            messages.append(line)
    shown = "; ".join(messages[:3]) + (f" (and {len(messages) - 3} more)" if len(messages) > 3 else "")
    return bad_request(shown or "invalid request", param=param)


def _field_path(loc: tuple) -> str:
    """`messages.0.role` from pydantic's location, without the `body` root and union-member tags."""
    parts = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and ("[" in part or part in _UNION_TAGS):
            break
        parts.append(str(part))
    return ".".join(parts)


_UNION_TAGS = frozenset(
    {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before"}
)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    async def on_engine_error(_: Request, exc: EngineError) -> Response:
        return engine_error(exc).response()

    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        # vLLM answers 400 (not FastAPI's 422) for a body that does not validate; so do we.
        return _validation_error(exc).response()

    async def on_http_exception(_: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return APIError(exc.status_code, message, headers=exc.headers).response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, "Internal server error; see the server log", code="internal_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(EngineError, on_engine_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)
