"""Prompts as apple-fm-sdk 0.2.1 takes them: text and ``ImageAttachment`` (a file path)."""

from __future__ import annotations

from abc import ABC
from pathlib import Path
from typing import Union


class PromptError(Exception):
    """Base exception for prompt-related errors."""


class ImagePromptError(PromptError):
    """An image attachment could not be added."""


class Attachment(ABC):  # noqa: B024 (abstract in the SDK through its one method)
    pass


class ImageAttachment(Attachment):
    def __init__(self, path: Path, label: str | None = None) -> None:
        if not path.is_file():
            raise ImagePromptError(
                f"Failed to add attachment to prompt: file does not exist at {path}")
        self._path = path
        self._label = label
        self.data = path.read_bytes()  # read now: afmd deletes its files after the request


PromptComponent = Union[str, Attachment]  # noqa: UP007 (as the SDK spells it)
Prompt = Union[PromptComponent, list[PromptComponent]]  # noqa: UP007


def components(prompt: Prompt) -> list[str | Attachment]:
    """The parts of a prompt: a string, one attachment or a list."""
    if isinstance(prompt, str | Attachment):
        return [prompt]
    if isinstance(prompt, list):
        for part in prompt:
            if not isinstance(part, str | Attachment):
                raise PromptError(f"Unsupported prompt component: {type(part).__name__}")
        return list(prompt)
    raise PromptError(f"Unsupported prompt type: {type(prompt).__name__}")


def _composed_prompt_from_prompt(prompt: Prompt) -> list[str | Attachment]:
    """The prompt composed for the Swift side, as the SDK composes it (``prompt.py``,
    apple-fm-sdk 0.2.1 at e868e60): each image goes through
    ``FMComposedPromptAddAttachment``, which fails before macOS 27 (or in bindings built
    without its SDK) with ``ImagePromptError``. Here the composed prompt is the parts; release
    it with ``_ctypes_bindings.FMRelease``."""
    from . import native

    parts = components(prompt)
    if not native.STATE.images_supported and any(isinstance(p, Attachment) for p in parts):
        raise ImagePromptError("Failed to add attachment to prompt: the current OS does not "
                               "support attachment prompts")
    return parts
