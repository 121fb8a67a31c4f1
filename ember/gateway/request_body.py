"""The request body fields the gateway itself reads, validated once before any of them is used.

Every entry point (the HTTP proxy routes, WebSocket, gRPC, async jobs and Batch API lines) hands its
body to `parse_request_body` before the gateway reads a field of it, so a wrong type answers one
OpenAI-shaped 400 whose `param` names the field, never a crash deeper in. Only the fields the gateway
reads are declared (model, stream, stream_options, n, best_of, max_tokens, max_completion_tokens,
prompt, messages, priority, user); every other field is left to the replica, which validates the
full request. The body forwarded upstream stays the client's own dict (or bytes); this model only
checks it.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ember.gateway.errors import GatewayError, bad_request

NON_FINITE_MESSAGE = "must be a finite number"

PositiveInt = Annotated[int, Field(ge=1)]


class _Fields(BaseModel):
    """Strict types (no "1" for 1, no 1 for true), unknown fields kept for the replica."""

    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Fields):
    include_usage: bool | None = None


class ContentPart(_Fields):
    text: str | None = None


class Message(_Fields):
    role: str
    content: str | list[ContentPart] | None = None


class RequestBody(_Fields):
    model: Annotated[str, Field(min_length=1)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: PositiveInt | None = None
    best_of: PositiveInt | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    priority: int | None = None  # overwritten from the key's tier, never forwarded (ember.gateway.priority)
    user: str | None = None

    @model_validator(mode="after")
    def _finite_numbers(self) -> RequestBody:
        # A body built in-process (gRPC's float fields) can carry NaN or infinity, which orjson
        # would silently forward as null; JSON bodies never do (parse_json_object refuses them).
        for name, value in (self.model_extra or {}).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name}: {NON_FINITE_MESSAGE}")
        return self

    @property
    def client_wants_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage is True


class ChatRequestBody(RequestBody):
    messages: list[Message]  # an empty list is the replica's to refuse


class CompletionRequestBody(RequestBody):
    # Types only: token ids are checked against the vocabulary by the replica. Token-id lists come
    # first, so a long one is matched without trying it as a list of strings (one error per item).
    prompt: str | list[int] | list[str] | list[list[int]]


BODY_MODELS: dict[str, type[RequestBody]] = {
    "chat/completions": ChatRequestBody,
    "completions": CompletionRequestBody,
}


def parse_request_body(endpoint: str, body: dict[str, Any]) -> RequestBody:
    """The validated view of `body` for `endpoint` ("chat/completions" | "completions"), or a 400
    naming the first wrong field as `param`."""
    try:
        return BODY_MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc) from None


def _first_error(exc: ValidationError) -> GatewayError:
    error = exc.errors()[0]
    path, in_union = _field_path(error["loc"])
    if error["type"] == "missing":
        return bad_request(f"You must provide a {path} parameter.", param=path)
    if error["type"] == "value_error":  # from _finite_numbers, which names the field itself
        message = str(error["msg"]).removeprefix("Value error, ")
        return bad_request(message, param=message.split(":", 1)[0])
    if in_union:  # pydantic reports the first alternative only; name them all
        return bad_request(f"{path}: must be {UNION_TYPES[path.rsplit('.', 1)[-1]]}.", param=path)
    if error["type"] == "model_type":
        return bad_request(f"{path}: must be a JSON object.", param=path)
    return bad_request(f"{path}: {error['msg']}", param=path)


# The fields declared as a union of types, as a message names them.
UNION_TYPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "content": "a string, a list of content parts or null",
}
_UNION_TAGS = frozenset({"str", "list[str]", "list[int]", "list[list[int]]", "list[ContentPart]"})


def _field_path(loc: tuple) -> tuple[str, bool]:
    """(`messages.0.content`, whether the error is one alternative of a union) from pydantic's
    location, which names the union member it tried after the field."""
    parts: list[str] = []
    for part in loc:
        if part in _UNION_TAGS:
            return ".".join(parts), True
        parts.append(str(part))
    return ".".join(parts), False


def parse_json_object(raw: bytes | str, what: str = "The request body") -> dict[str, Any]:
    """A JSON object from a request body or frame, or a 400: not JSON, not an object, or a number
    that is NaN or infinite (JSON has none; Python's json module writes them)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        path = _non_finite_path(raw)
        if path is not None:
            raise bad_request(f"{path}: {NON_FINITE_MESSAGE}", param=path) from None
        raise bad_request(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request(f"{what} must be a JSON object.")
    return value


class _NonFinite:
    pass


def _non_finite_path(raw: bytes | str) -> str | None:
    """The dotted path of the first NaN/Infinity literal in a document orjson refused, if that is
    why it refused it (only called on that error path)."""
    try:
        value = json.loads(raw, parse_constant=lambda _: _NonFinite(), parse_float=_parse_float)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than orjson's limit, too
        return None
    return _find_non_finite(value, "")


def _parse_float(text: str) -> float | _NonFinite:
    number = float(text)  # 1e400 parses as infinity
    return number if math.isfinite(number) else _NonFinite()


def _find_non_finite(value: Any, path: str) -> str | None:
    if isinstance(value, _NonFinite):
        return path or "body"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _find_non_finite(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None
