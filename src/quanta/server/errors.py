"""OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, and the exception that carries it."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class APIError(Exception):
    """An error the server answers with ``status`` and OpenAI's error object (never a traceback)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A malformed or out-of-range request: 400."""
    return APIError(400, message, param=param, code=code)


def not_supported(feature: str, param: str) -> APIError:
    return APIError(400, f"{feature} is not supported yet by this server", param=param, code="unsupported")


def unavailable(message: str, code: str, retry_after_s: int) -> APIError:
    """The server cannot take the request now (loading, shutting down): 503 with Retry-After."""
    return APIError(503, message, type="server_error", code=code, headers={"Retry-After": str(retry_after_s)})


def queue_full(limit: int, retry_after_s: int) -> APIError:
    return APIError(429, f"the server's queue is full ({limit} requests waiting); retry later",
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)})


def internal(message: str = "the server failed to process the request; the error is in its log") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
