"""The one error type every gateway layer raises; each protocol (HTTP, WebSocket, gRPC, jobs) maps it
to its own shape. Over HTTP it is OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", code, param)


def unavailable(message: str, code: str = "no_healthy_replica") -> GatewayError:
    return GatewayError(503, message, "service_unavailable", code)


def internal_error() -> GatewayError:
    """What a client gets for an exception nothing expected: OpenAI's shape, as `ember serve` answers it,
    and no traceback (that goes to the gateway log)."""
    return GatewayError(500, "Internal server error; see the gateway log", "server_error", "internal_error")
