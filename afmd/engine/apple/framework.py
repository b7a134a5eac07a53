"""Apple's SDK, imported lazily, and whether its model can answer now.

The SDK exists only where Apple's framework does (macOS 26+ on Apple silicon) and when
``apple-fm-sdk`` is installed (``pip install 'afmd[system]'``); everywhere else the model is
unavailable for good, with the framework's own reason for a device that cannot run it,
``device_not_eligible``. Where it exists, ``SystemLanguageModel.is_available()`` says
whether Apple Intelligence is on and the model downloaded; that can change while afmd runs
(a download finishes, a user turns Apple Intelligence on), so it is asked again, at most once
per :data:`RECHECK_SECONDS` (``/health`` may be polled by the thousand).

Nothing here imports MLX: ``afmd doctor`` and ``afmd show`` ask it too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from afmd.config.sections import BUILTIN_SYSTEM_PATH
from afmd.config.tables import ModelEntry
from afmd.errors import ServiceUnavailableError

#: The framework's reasons, as ``SystemLanguageModelUnavailableReason`` names them.
DEVICE_NOT_ELIGIBLE = "device_not_eligible"
APPLE_INTELLIGENCE_NOT_ENABLED = "apple_intelligence_not_enabled"
MODEL_NOT_READY = "model_not_ready"
REASONS = (DEVICE_NOT_ELIGIBLE, APPLE_INTELLIGENCE_NOT_ENABLED, MODEL_NOT_READY)

#: The context window (prompt, instructions, tools and answer) where the framework does not
#: say its own (:func:`context_length`): the window Apple documents for its on-device model
#: ("Managing the context window", TN3193).
CONTEXT_LENGTH = 4096
#: Seconds an availability answer is reused before the framework is asked again.
RECHECK_SECONDS = 1.0
#: Seconds a client is told to wait before retrying a request the model could not take.
RETRY_AFTER_S = 2

_DETAILS = {
    DEVICE_NOT_ELIGIBLE: "this device cannot run Apple's on-device model (it needs macOS 26 "
                         "or later on Apple silicon, with Apple Intelligence)",
    APPLE_INTELLIGENCE_NOT_ENABLED: "Apple Intelligence is not turned on (System Settings > "
                                    "Apple Intelligence & Siri)",
    MODEL_NOT_READY: "the model is still downloading or being prepared; retry shortly",
}


def is_system(entry: ModelEntry) -> bool:
    """Whether ``entry`` is Apple's model (the built-in ``system``, or an entry naming it)."""
    return entry.path == BUILTIN_SYSTEM_PATH


@dataclass(frozen=True, slots=True)
class Availability:
    """``reason`` None: the model can answer; else one of :data:`REASONS`, with why."""

    reason: str | None
    detail: str = ""

    @property
    def status(self) -> str:
        """As ``/health`` reports a model: ``available`` or ``unavailable: <reason>``."""
        return "available" if self.reason is None else f"unavailable: {self.reason}"


AVAILABLE = Availability(None, "Apple's on-device model is available")


def sdk() -> ModuleType | None:
    """The ``apple_fm_sdk`` module, or None where it cannot be imported (a failed import is
    not remembered by Python: looking again costs a scan of ``sys.path``, which
    :func:`availability` does at most once per :data:`RECHECK_SECONDS`)."""
    try:
        return importlib.import_module("apple_fm_sdk")
    except Exception:  # not installed, or its C bindings missing (ImportError and worse)
        return None

_lock = threading.Lock()
_model: Any = None
_checked: tuple[float, Availability] | None = None


def system_model() -> Any:
    """The framework's default model object, made once (its handle is thread-safe)."""
    global _model
    fm = sdk()
    if fm is None:
        raise RuntimeError("apple-fm-sdk is not importable here")
    with _lock:
        if _model is None or type(_model) is not fm.SystemLanguageModel:
            _model = fm.SystemLanguageModel()
        return _model


def context_length() -> int:
    """The model's context window as the framework states it (``context_size``,
    apple-fm-sdk 0.2.1): it is the OS's model's, which a newer macOS may change, so it is
    asked rather than assumed; :data:`CONTEXT_LENGTH` where the framework cannot say."""
    if sdk() is None:
        return CONTEXT_LENGTH
    try:
        size = int(system_model().context_size)
    except Exception:  # an SDK without it, or the framework failing: the known window
        return CONTEXT_LENGTH
    return size if size > 0 else CONTEXT_LENGTH


def sdk_version(fm: ModuleType) -> str:
    """The installed SDK's release: its distribution's version (the package's own
    ``__version__`` still says 0.1.0 in apple-fm-sdk 0.2.1)."""
    try:
        return importlib.metadata.version("apple-fm-sdk")
    except Exception:  # not installed as a distribution (a frozen build): what it says
        return str(getattr(fm, "__version__", "?"))


def availability() -> Availability:
    """Whether the model can answer now (reused for :data:`RECHECK_SECONDS`)."""
    global _checked
    now = time.monotonic()
    checked = _checked
    if checked is not None and now - checked[0] < RECHECK_SECONDS:
        return checked[1]
    found = _ask()
    _checked = (now, found)
    return found


def forget() -> None:
    """Ask the framework again next time (tests change what their stand-in says)."""
    global _checked, _model
    with _lock:
        _checked = None
        _model = None


def _ask() -> Availability:
    fm = sdk()
    if fm is None:
        if sys.platform != "darwin":
            detail = f"Apple's Foundation Models framework does not exist on {sys.platform}"
        elif importlib.util.find_spec("apple_fm_sdk") is None:
            detail = ("apple-fm-sdk is not installed: pip install 'afmd[system]' (it needs "
                      "macOS 26 or later and Xcode's Swift toolchain to build)")
        else:
            detail = "apple-fm-sdk cannot load Apple's framework here (macOS 26 or later?)"
        return Availability(DEVICE_NOT_ELIGIBLE, detail)
    try:
        ok, reason = system_model().is_available()
    except Exception as exc:  # the framework itself failed: it cannot serve
        return Availability(DEVICE_NOT_ELIGIBLE, f"the framework failed: {exc}")
    if ok:
        return AVAILABLE
    name = str(getattr(reason, "name", reason) or "").lower()
    if name not in REASONS:
        name = MODEL_NOT_READY  # UNKNOWN: nothing says it cannot become ready
    return Availability(name, _DETAILS[name])


def describe(entry: ModelEntry) -> dict[str, object]:
    """What ``afmd show`` says of Apple's model: what it is and whether it can answer."""
    found = availability()
    fm = sdk()
    return {
        "id": entry.id,
        "path": entry.path,
        "architecture": "Apple Foundation Model (on-device, the model of Apple Intelligence)",
        "served_through": "apple-fm-sdk " + sdk_version(fm)
        if fm is not None else "apple-fm-sdk (not importable here)",
        "context_length": entry.context_length or context_length(),
        "kind": "chat",
        "tool_format": "the framework's own tool calling (afmd captures the calls)",
        "reasoning_format": None,
        "structured_output": "GenerationSchema (JSON Schema rewritten; pattern described)",
        "availability": found.status,
        "detail": found.detail,
    }


def unavailable_error(entry_id: str, found: Availability) -> ServiceUnavailableError:
    """503 ``model_unavailable`` for a request the model cannot take, the reason named."""
    return ServiceUnavailableError(
        f"The model '{entry_id}' is unavailable: {found.reason} ({found.detail}).",
        code="model_unavailable",
        param="model",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


__all__ = [
    "APPLE_INTELLIGENCE_NOT_ENABLED",
    "AVAILABLE",
    "CONTEXT_LENGTH",
    "DEVICE_NOT_ELIGIBLE",
    "MODEL_NOT_READY",
    "REASONS",
    "RECHECK_SECONDS",
    "RETRY_AFTER_S",
    "Availability",
    "availability",
    "context_length",
    "describe",
    "forget",
    "is_system",
    "sdk",
    "sdk_version",
    "system_model",
    "unavailable_error",
]
