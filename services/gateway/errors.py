"""OpenAI-style API errors and the mapping from gRPC status codes and engine errors to them.

Body shape (serving.md §1.4): `{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status
as an int (llama.cpp and vLLM do so; clients only read `message`). Types follow llama.cpp's table.
"""

from __future__ import annotations

import re

import grpc

from services.engine.errors import ContextOverflowError, InvalidRequestError, SpecsplitError

# HTTP status -> OpenAI error type (llama.cpp server-common.cpp format_error_response).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
    504: "server_error",
}


class APIError(Exception):
    """An error answer: HTTP status, OpenAI body, and the gRPC status the public gRPC API uses."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error")
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, int(round(self.retry_after))))}

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return {
            400: grpc.StatusCode.INVALID_ARGUMENT,
            404: grpc.StatusCode.NOT_FOUND,
            429: grpc.StatusCode.RESOURCE_EXHAUSTED,
            501: grpc.StatusCode.UNIMPLEMENTED,
            503: grpc.StatusCode.UNAVAILABLE,
            504: grpc.StatusCode.DEADLINE_EXCEEDED,
        }.get(self.status, grpc.StatusCode.INTERNAL)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def prompt_param(operation: str) -> str:
    """The request field a prompt that does not fit is blamed on: a chat's messages, a completion's prompt."""
    return "messages" if operation == "chat" else "prompt"


def context_exceeded(needed: int, available: int, param: str = "prompt") -> APIError:
    return APIError(400, f"the request needs {needed} tokens of context but the model has {available} "
                         f"(prompt plus at least one generated token)",
                    type="exceed_context_size_error", param=param)


def unavailable(message: str = "no verifier is ready", retry_after: float | None = 1.0) -> APIError:
    return APIError(503, message, retry_after=retry_after)


def from_engine(err: SpecsplitError, prompt: str = "prompt") -> APIError:
    """prompt: the request field a context overflow is blamed on (prompt_param)."""
    if isinstance(err, ContextOverflowError):
        return context_exceeded(err.needed, err.available, prompt)
    if isinstance(err, InvalidRequestError):
        return invalid(str(err), err.param)
    return APIError(500, str(err))


def from_grpc(err: grpc.aio.AioRpcError | grpc.RpcError, prompt: str = "prompt") -> APIError:
    """Map a verifier's status to the client's (serving.md §3.3 table); prompt as for from_engine."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        low = details.lower()
        if "context" in low and any(w in low for w in ("exceed", "needs", "too long", "does not fit")):
            return APIError(400, details, type="exceed_context_size_error", param=prompt)
        named = re.search(r" \[(\w+)\]$", details)      # the verifier names the field: "... [param]"
        return invalid(details[:named.start()] if named else details, named.group(1) if named else None)
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return APIError(400, details, type="exceed_context_size_error", param=prompt)
    if code == grpc.StatusCode.NOT_FOUND:
        return APIError(404, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "out of memory" in details.lower():     # an allocation failed mid-request (the verifier goes on)
            return APIError(429, f"server out of memory: {details}", retry_after=1.0)
        return APIError(429, f"server busy: {details}", retry_after=1.0)
    if code == grpc.StatusCode.UNAVAILABLE:
        return unavailable(f"verifier unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "the request timed out", type="timeout_error")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return APIError(501, details)
    return APIError(500, f"verifier error ({code.name}): {details}")
