"""The OpenAI error envelope and the one exception type every route raises.

Routes never build error JSON by hand: they raise ``ApiError`` and the app turns it into
``{"error": {"message", "type", "param", "code"}}`` with the right status and headers
(``Retry-After`` for the transient 429/503 codes, docs/API.md).
"""

from __future__ import annotations

from typing import Any

#: HTTP status → OpenAI error ``type``.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

#: the error ``code`` of a refusal made by the HTTP layer itself (no route, method, size, type)
HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                    415: "unsupported_media_type"}

#: codes that mean "try again shortly" and therefore carry ``Retry-After``.
RETRYABLE_CODES = frozenset({"queue_full", "slot_budget_exceeded", "not_ready", "engine_unhealthy",
                             "shutting_down"})


class ApiError(Exception):
    """A request that ends in an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        if retry_after is None and code in RETRYABLE_CODES:
            retry_after = 1
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500
                                                            else "invalid_request_error"),
                      "param": param, "code": code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """400 for a request field: the message and ``param`` both name the field."""
    return ApiError(400, f"{param}: {message}", code=code, param=param)
