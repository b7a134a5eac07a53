"""What afmd relies on in apple-fm-sdk beyond its documented surface, in one place.

- ``Property`` (``apple_fm_sdk.generation_property``, not exported by the package): the
  SDK builds a ``GenerationSchema`` from ``Property`` objects. A tool's arguments schema is
  made at run time from the client's JSON Schema, whose property names are any strings;
  the documented ``@generable`` decorator needs Python identifiers (``max-results`` and
  ``from`` are not), so afmd builds the schema from properties as the decorator does.
- ``GenerationOptions.to_dict``: the JSON the SDK hands its Swift side. apple-fm-sdk
  0.2.1 writes ``top_k``, ``top_p`` and ``seed`` as strings, which the Swift side reads as
  numbers only, so random sampling's nucleus and seed were dropped (and, with neither
  ``top_k`` nor ``top_p``, random sampling itself). :func:`options` writes numbers, and
  always a ``top_p`` with a seed (the Swift side reads the seed only beside one of them).

- ``_composed_prompt_from_prompt`` (``apple_fm_sdk.prompt``) and ``FMRelease``
  (``apple_fm_sdk._ctypes_bindings``): ``stream_response`` composes its prompt on the
  stream's own thread (``session.py`` ``_stream_response_basic``, 0.2.1 at e868e60), where
  an error, such as the ``ImagePromptError`` of an image on an OS before macOS 27, ends that
  thread without ending the stream: the stream then waits for ever, blocking the loop it
  runs on, so that not even a cancel reaches it. :func:`compose_check` composes the prompt
  first where its error is raised to the caller, as ``respond`` does.

``tests/meta/test_system_compat.py`` fingerprints these against whichever SDK is importable.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from afmd.engine.apple.conversation import Sampling

_options_class: dict[int, type] = {}


def property_class(fm: ModuleType) -> Any:
    """The SDK's ``Property(name, type_class, description=None, guides=[])``."""
    return importlib.import_module(fm.__name__ + ".generation_property").Property


def compose_check(fm: ModuleType, prompt: Any) -> None:
    """Raise what composing ``prompt`` for the Swift side raises (``ImagePromptError`` where
    the OS takes no images); the composed prompt is released."""
    composed = importlib.import_module(fm.__name__ + ".prompt")._composed_prompt_from_prompt(
        prompt)
    if composed:
        importlib.import_module(fm.__name__ + "._ctypes_bindings").FMRelease(composed)


def options_class(fm: ModuleType) -> type:
    """``GenerationOptions`` whose JSON carries sampling numbers as numbers."""
    found = _options_class.get(id(fm))
    if found is not None:
        return found

    class Options(fm.GenerationOptions):  # type: ignore[name-defined]  # a module known at run time
        def to_dict(self) -> dict[str, Any]:
            out: dict[str, Any] = super().to_dict()
            sampling = self.sampling
            if sampling is not None and "sampling" in out and out["sampling"].get("mode") \
                    == "random":
                numbers: dict[str, Any] = {"mode": "random"}
                if sampling.top is not None:
                    numbers["top_k"] = int(sampling.top)
                else:
                    threshold = sampling.probability_threshold
                    numbers["top_p"] = float(1.0 if threshold is None else threshold)
                if sampling.seed is not None:
                    numbers["seed"] = int(sampling.seed)
                out["sampling"] = numbers
            return out

    _options_class[id(fm)] = Options
    return Options


def options(fm: ModuleType, sampling: Sampling, max_tokens: int | None) -> Any:
    """The request's sampling and response limit as the framework's options."""
    if sampling.greedy:
        mode = fm.SamplingMode.greedy()
    elif sampling.top_k > 1 and sampling.top_p >= 1.0:
        mode = fm.SamplingMode.random(top=sampling.top_k, seed=_seed(sampling.seed))
    else:
        mode = fm.SamplingMode.random(probability_threshold=min(max(sampling.top_p, 0.0), 1.0),
                                      seed=_seed(sampling.seed))
    return options_class(fm)(
        sampling=mode,
        temperature=None if sampling.greedy else float(sampling.temperature),
        maximum_response_tokens=max_tokens,
    )


def _seed(seed: int | None) -> int | None:
    """A seed as the framework reads it: a JSON number its Swift side takes as UInt64 (kept
    under 2**63, which every JSON reader holds as an integer)."""
    return None if seed is None else seed & 0x7FFF_FFFF_FFFF_FFFF


__all__ = ["compose_check", "options", "options_class", "property_class"]
