"""A stand-in for Apple's ``apple_fm_sdk`` (apple-fm-sdk 0.2.1), for tests on machines
without Apple's framework.

Written from the SDK's public source (github.com/apple/python-apple-fm-sdk at e868e60,
version 0.2.1, the newest source audited): the same module paths afmd touches, class and
method names, signatures, availability reasons, error classes and the JSON formats that
cross into Swift (transcripts, options, schemas), and the same threading: responses
answered from native threads, tools called on threads with loops of their own, a stream
whose prompt is composed on a thread of its own (an error there leaves the stream waiting
for ever), iterated detached and read by a blocking queue, ``GenerationOptions.to_dict``
writing sampling numbers as strings that the Swift side reads as numbers only, the
``__version__`` the SDK says (0.1.0; its metadata, ``apple_fm_sdk-0.2.1.dist-info``, says
0.2.1), and the Swift side's traps on bounds it cannot take (``SwiftTrap``). The model
itself is scripted (:mod:`.native`).

Tests put ``tests/helpers/fm_standin`` on ``sys.path`` (in process) or ``PYTHONPATH`` (a
server process); without it, ``import apple_fm_sdk`` fails as on any machine without the
framework.
"""

from .errors import (
    AssetsUnavailableError,
    ConcurrentRequestsError,
    DecodingFailureError,
    ExceededContextWindowSizeError,
    FoundationModelsError,
    GenerationError,
    GenerationErrorCode,
    GuardrailViolationError,
    InvalidGenerationSchemaError,
    RateLimitedError,
    RefusalError,
    ToolCallError,
    UnsupportedGuideError,
    UnsupportedLanguageOrLocaleError,
)
from .generation_guide import GenerationGuide, GuideType
from .generation_options import GenerationOptions, SamplingMode, SamplingModeType
from .generation_schema import GeneratedContent, GenerationID, GenerationSchema
from .prompt import Attachment, ImageAttachment, ImagePromptError, Prompt, PromptError
from .session import (
    LanguageModelSession,
    SystemLanguageModel,
    SystemLanguageModelGuardrails,
    SystemLanguageModelUnavailableReason,
    SystemLanguageModelUseCase,
    Tool,
    Transcript,
)

__version__ = "0.1.0"  # what apple-fm-sdk 0.2.1 itself says; its metadata says 0.2.1
__all__ = [
    "AssetsUnavailableError",
    "Attachment",
    "ConcurrentRequestsError",
    "DecodingFailureError",
    "ExceededContextWindowSizeError",
    "FoundationModelsError",
    "GeneratedContent",
    "GenerationError",
    "GenerationErrorCode",
    "GenerationGuide",
    "GenerationID",
    "GenerationOptions",
    "GenerationSchema",
    "GuardrailViolationError",
    "GuideType",
    "ImageAttachment",
    "ImagePromptError",
    "InvalidGenerationSchemaError",
    "LanguageModelSession",
    "Prompt",
    "PromptError",
    "RateLimitedError",
    "RefusalError",
    "SamplingMode",
    "SamplingModeType",
    "SystemLanguageModel",
    "SystemLanguageModelGuardrails",
    "SystemLanguageModelUnavailableReason",
    "SystemLanguageModelUseCase",
    "Tool",
    "ToolCallError",
    "Transcript",
    "UnsupportedGuideError",
    "UnsupportedLanguageOrLocaleError",
]
