"""The error classes of apple-fm-sdk 0.2.1 (``apple_fm_sdk.errors``), same names, same
hierarchy, same constructors."""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class FoundationModelsError(Exception):
    """Base exception for Foundation Models errors."""


class GenerationError(FoundationModelsError):
    """Base class for generation-specific errors."""


class InvalidGenerationSchemaError(FoundationModelsError):
    """A generation schema is invalid."""


class ExceededContextWindowSizeError(GenerationError):
    pass


class AssetsUnavailableError(GenerationError):
    pass


class GuardrailViolationError(GenerationError):
    pass


class UnsupportedGuideError(GenerationError):
    pass


class UnsupportedLanguageOrLocaleError(GenerationError):
    pass


class DecodingFailureError(GenerationError):
    pass


class RateLimitedError(GenerationError):
    pass


class ConcurrentRequestsError(GenerationError):
    pass


class RefusalError(GenerationError):
    def __init__(self, message: str, debug_description: str | None = None,
                 explanation_entries: Any = None) -> None:
        super().__init__(message, debug_description)
        self.explanation_entries = explanation_entries or []


class ToolCallError(FoundationModelsError):
    def __init__(self, tool_name: str, underlying_error: Exception) -> None:
        super().__init__(f"Tool '{tool_name}' failed: {underlying_error}")
        self.tool_name = tool_name
        self.underlying_error = underlying_error


class GenerationErrorCode(IntEnum):
    SUCCESS = 0
    EXCEEDED_CONTEXT_WINDOW_SIZE = 1
    ASSETS_UNAVAILABLE = 2
    GUARDRAIL_VIOLATION = 3
    UNSUPPORTED_GUIDE = 4
    UNSUPPORTED_LANGUAGE_OR_LOCALE = 5
    DECODING_FAILURE = 6
    RATE_LIMITED = 7
    CONCURRENT_REQUESTS = 8
    REFUSAL = 9
    INVALID_SCHEMA = 10
    UNKNOWN_ERROR = 255


#: The messages the SDK puts before the framework's own description, by class.
MESSAGES = {
    ExceededContextWindowSizeError: "Context window size exceeded",
    AssetsUnavailableError: "Required assets are unavailable",
    GuardrailViolationError: "Guardrail violation occurred",
    UnsupportedGuideError: "Unsupported guide used",
    UnsupportedLanguageOrLocaleError: "Unsupported language or locale",
    DecodingFailureError: "Failed to decode response",
    RateLimitedError: "Request was rate limited",
    ConcurrentRequestsError: "Too many concurrent requests",
    RefusalError: "Model refused to generate content",
    InvalidGenerationSchemaError: "Invalid generation schema provided",
}


def make(cls: type[FoundationModelsError], detail: str) -> FoundationModelsError:
    """An error as the SDK raises it from a framework status: ``"<message>: <detail>"``."""
    message = MESSAGES.get(cls, "Generation error")
    return cls(f"{message}: {detail}")  # type: ignore[call-arg]
