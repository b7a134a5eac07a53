"""The one entry of the SDK's generated ctypes bindings (``apple_fm_sdk._ctypes_bindings``,
built from ``FoundationModels.h``) that afmd calls itself: ``FMRelease``, which drops a
native reference such as a composed prompt."""

from __future__ import annotations

from typing import Any


def FMRelease(ref: Any) -> None:
    """Nothing to release here: the stand-in's native objects are Python's."""
