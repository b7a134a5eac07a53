"""The framework's errors as afmd's: the status, code and ``Retry-After`` a client is told.

=============================================  ======  ===========================  =========
apple-fm-sdk error                              status  code                         Retry-After
=============================================  ======  ===========================  =========
``GuardrailViolationError``                     400     ``content_filter``
``UnsupportedLanguageOrLocaleError``            400     ``unsupported_language``
``ExceededContextWindowSizeError``              400     ``context_length_exceeded``
``InvalidGenerationSchemaError``,
``UnsupportedGuideError``                       400     ``invalid_schema``
``ImagePromptError`` (images need a newer OS)   400     ``image_input_not_supported``
``RateLimitedError``                            429     ``rate_limited``                 yes
``ConcurrentRequestsError``                     503     ``busy``                         yes
``AssetsUnavailableError``                      503     ``model_unavailable``            yes
``DecodingFailureError``, any other failure     500     ``generation_failed`` (retried)
=============================================  ======  ===========================  =========

``InvalidGenerationSchemaError`` and ``UnsupportedGuideError`` come from a tool's arguments
schema the framework cannot build; a ``json_schema`` answer's schema that the framework's
decoder refuses comes back from apple-fm-sdk 0.2.1 as a plain ``GenerationError`` (status
255), a 500 like any other failure.

``RefusalError`` is no error: the model declined, and the client gets a 200 whose
``refusal`` says so (:class:`afmd.engine.generation.Refused`).
"""

from __future__ import annotations

from types import ModuleType

from afmd.engine.apple.framework import MODEL_NOT_READY, RETRY_AFTER_S, context_length
from afmd.errors import (
    APIError,
    InvalidRequestError,
    RateLimitError,
    ServerError,
    ServiceUnavailableError,
)

#: What a refusal says when the framework gives no explanation of its own.
REFUSAL = "The model declined to answer this request."


def _retry() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def is_refusal(fm: ModuleType, exc: BaseException) -> bool:
    return isinstance(exc, fm.RefusalError)


def refusal_text(exc: BaseException) -> str:
    """The refusal's explanation: its entries when the SDK gives them, else its message
    without the SDK's prefix."""
    entries = getattr(exc, "explanation_entries", None) or []
    texts = [str(getattr(e, "text", e)) for e in entries if e]
    if texts:
        return " ".join(texts)
    message = str(exc.args[0]) if exc.args else ""
    _, _, detail = message.partition(": ")
    detail = detail.strip()
    return detail if detail and detail.lower() not in ("none", "") else REFUSAL


def api_error(fm: ModuleType, exc: BaseException, *, schema_param: str | None = None,
              image_param: str | None = None) -> APIError:
    """The client's error for a framework failure (the table in the module doc)."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, fm.GuardrailViolationError):
        return InvalidRequestError(
            "The request or the answer was blocked by Apple's safety guardrails "
            f"({detail}).", code="content_filter")
    if isinstance(exc, fm.UnsupportedLanguageOrLocaleError):
        return InvalidRequestError(
            f"Apple's on-device model does not support this language or locale ({detail}).",
            code="unsupported_language", param="messages")
    if isinstance(exc, fm.ExceededContextWindowSizeError):
        return InvalidRequestError(
            f"This model's maximum context length is {context_length()} tokens; the "
            f"conversation and its answer do not fit ({detail}). Please reduce the length of "
            "the messages or completion.", code="context_length_exceeded", param="messages")
    if isinstance(exc, fm.InvalidGenerationSchemaError | fm.UnsupportedGuideError):
        return InvalidRequestError(
            f"Invalid JSON schema for Apple's on-device model: {detail}",
            code="invalid_schema", param=schema_param)
    if isinstance(exc, fm.ImagePromptError | fm.PromptError):
        return InvalidRequestError(
            f"Apple's on-device model cannot take this prompt here: {detail}",
            code="image_input_not_supported" if isinstance(exc, fm.ImagePromptError)
            else "invalid_value", param=image_param or "messages")
    if isinstance(exc, fm.RateLimitedError):
        return RateLimitError(
            f"Apple's on-device model is rate limited by the system ({detail}); retry shortly.",
            code="rate_limited", headers=_retry())
    if isinstance(exc, fm.ConcurrentRequestsError):
        return ServiceUnavailableError(
            f"Apple's on-device model is busy with other requests ({detail}); retry shortly.",
            code="busy", headers=_retry())
    if isinstance(exc, fm.AssetsUnavailableError):
        return ServiceUnavailableError(
            f"The model 'system' is unavailable: {MODEL_NOT_READY} ({detail}).",
            code="model_unavailable", param="model", headers=_retry())
    return ServerError(f"Apple's on-device model failed: {type(exc).__name__}: {detail}",
                       code="generation_failed")


__all__ = ["REFUSAL", "api_error", "is_refusal", "refusal_text"]
