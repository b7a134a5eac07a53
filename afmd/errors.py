"""One exception hierarchy for everything a client can be told.

Every failure that reaches a client is an :class:`APIError`; the HTTP layer turns it into
OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}`` without knowing which
layer raised it. Lower layers raise these directly so the ``param`` that pinpoints the
problem is chosen where the problem is understood.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

#: Longest message and param a client is sent. Layers quote client values in errors (a
#: model name, a tool name, a schema checker's verdict on a whole schema); each should cut
#: them short itself, and this bounds every error body whichever layer forgot.
MAX_MESSAGE_CHARS = 1000
MAX_PARAM_CHARS = 200


def _bounded_message(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}… (message cut short from {len(message)} characters)"


def _bounded_param(param: str | None) -> str | None:
    if param is None or len(param) <= MAX_PARAM_CHARS:
        return param
    return param[: MAX_PARAM_CHARS - 1] + "…"


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error envelope."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str] = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        message = _bounded_message(message)
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = _bounded_param(param)
        if status is not None:
            self.status = status  # type: ignore[misc]
        self.headers: dict[str, str] = dict(headers or {})

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.code!r}, param={self.param!r})"


class InvalidRequestError(APIError):
    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_value"


class ContextLengthError(InvalidRequestError):
    """A prompt (with the room its answer needs) over the model's context window. The
    numbers travel with the error because dialects word it differently, and clients parse
    the wording: Claude Code compacts a conversation when /v1/messages says ``prompt is
    too long: N tokens > M maximum``, Anthropic's phrase."""

    default_code = "context_length_exceeded"

    def __init__(self, message: str, *, prompt_tokens: int, limit: int,
                 param: str | None = "messages") -> None:
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class ModelKindError(InvalidRequestError):
    """A request for a model of another kind (an embedding model asked to chat, a chat
    model asked for embeddings). What was asked travels with the error because Ollama's
    clients see Ollama's words for it, which name the route (``"m" does not support
    chat``), not the model's kind."""

    default_code = "invalid_model_kind"

    def __init__(self, message: str, *, model: str, wanted: str) -> None:
        super().__init__(message, param="model")
        self.model = model
        self.wanted = wanted


class AuthenticationError(APIError):
    status = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(APIError):
    status = 403
    error_type = "invalid_request_error"
    default_code = "origin_not_allowed"


class NotFoundError(APIError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ConflictError(APIError):
    status = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class RateLimitError(APIError):
    status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limited"


class ServerError(APIError):
    status = 500
    error_type = "server_error"
    default_code = "internal_error"


class ServiceUnavailableError(APIError):
    status = 503
    error_type = "server_error"
    default_code = "server_overloaded"


class GatewayTimeoutError(APIError):
    """A deadline the server holds every request to passed. The same request sent again
    meets it again (a generation too long for it) or waits as long (a queue as busy),
    and the official SDKs retry a 504 twice: a non-streamed generation past
    ``request_timeout`` ran three times before the client heard of it. The answer says
    ``x-should-retry: false``, which those retries read."""

    status = 504
    error_type = "timeout_error"
    default_code = "timeout"

    def __init__(self, message: str, *, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message, code=code, headers=headers)
        self.headers.setdefault("x-should-retry", "false")


def request_timeout_error() -> GatewayTimeoutError:
    """A request's deadline passed (``request_timeout``): the one 504 every layer that
    finds it gives, whether the request was still rendering, queued or generating."""
    return GatewayTimeoutError(
        "The request did not complete within the server's request_timeout.", code="timeout"
    )


class MethodNotAllowedError(APIError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


# ----------------------------------------------------------------- transport-level refusals
# Raised (or rendered) by the HTTP gate before a request reaches a handler.


class RequestTimeoutError(APIError):
    status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class ExpectationFailedError(APIError):
    status = 417
    error_type = "invalid_request_error"
    default_code = "malformed_request"


class PayloadTooLargeError(APIError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "malformed_request"


class UnsupportedMediaTypeError(APIError):
    status = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class MisdirectedRequestError(APIError):
    """The Host header names a server this one does not claim to be (DNS rebinding)."""

    status = 421
    error_type = "invalid_request_error"
    default_code = "invalid_host"


class HeaderFieldsTooLargeError(APIError):
    status = 431
    error_type = "invalid_request_error"
    default_code = "malformed_request"


class NotImplementedHTTPError(APIError):
    """A transfer coding (or other framing feature) the server does not implement."""

    status = 501
    error_type = "invalid_request_error"
    default_code = "malformed_request"


class HTTPVersionNotSupportedError(APIError):
    status = 505
    error_type = "invalid_request_error"
    default_code = "malformed_request"


class TooManyConnectionsError(ServiceUnavailableError):
    default_code = "too_many_connections"
