"""What afmd relies on in apple-fm-sdk, fingerprinted (afmd/engine/apple/fm_compat.py).

Run against whichever ``apple_fm_sdk`` is importable: Apple's own on a Mac with the
``system`` extra, else the stand-in (written from the SDK's source at 0.2.1). A new SDK
release that moves or changes these fails here, by name, rather than in a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from afmd.engine.apple import fm_compat as compat
from afmd.engine.apple import framework
from afmd.engine.apple.conversation import Sampling

from helpers.system_model import standin


@pytest.fixture(scope="module")
def fm() -> Iterator[ModuleType]:
    real = framework.sdk()
    if real is not None:  # Apple's SDK on this machine: fingerprint that one
        yield real
        return
    with standin():
        import apple_fm_sdk

        yield apple_fm_sdk


def test_property_builds_generation_schemas(fm: ModuleType) -> None:
    prop = compat.property_class(fm)
    assert list(inspect.signature(prop).parameters)[:4] == ["name", "type_class",
                                                           "description", "guides"]
    params = inspect.signature(fm.GenerationSchema).parameters
    assert {"type_class", "description", "properties", "dynamic_nested_types"} <= set(params)
    kind = type("Thing", (), {})
    schema = fm.GenerationSchema(type_class=kind, properties=[prop(name="a", type_class=str)])
    assert schema.to_dict()["properties"]["a"]["type"] == "string"


def test_options_reach_the_swift_side_as_numbers(fm: ModuleType) -> None:
    sdk_own = fm.GenerationOptions(
        sampling=fm.SamplingMode.random(probability_threshold=0.5, seed=3)).to_dict()
    # apple-fm-sdk 0.2.1 writes these as strings (which its Swift side does not read);
    # a release that fixes it writes numbers. afmd's options write numbers either way.
    assert sdk_own["sampling"]["top_p"] in ("0.5", 0.5)
    ours = compat.options(fm, Sampling(False, 0.7, 0.5, 0, 3), 64).to_dict()
    assert ours == {"sampling": {"mode": "random", "top_p": 0.5, "seed": 3},
                    "temperature": 0.7, "maximum_response_tokens": 64}
    json.dumps(ours)
    greedy = compat.options(fm, Sampling(True, 0.0, 1.0, 0, None), None).to_dict()
    assert greedy == {"sampling": {"mode": "greedy"}}
    top_k = compat.options(fm, Sampling(False, 1.0, 1.0, 8, None), None).to_dict()
    assert top_k["sampling"] == {"mode": "random", "top_k": 8}


def test_the_public_surface_afmd_calls(fm: ModuleType) -> None:
    session = inspect.signature(fm.LanguageModelSession).parameters
    assert {"instructions", "model", "tools"} <= set(session)
    assert {"transcript", "model", "tools"} <= set(
        inspect.signature(fm.LanguageModelSession.from_transcript).parameters)
    respond = inspect.signature(fm.LanguageModelSession.respond).parameters
    assert {"prompt", "json_schema", "options"} <= set(respond)
    assert inspect.isasyncgenfunction(fm.LanguageModelSession.stream_response)
    assert inspect.iscoroutinefunction(fm.Transcript.from_dict)
    assert {"arguments_schema", "call"} <= set(fm.Tool.__abstractmethods__)
    model = fm.SystemLanguageModel()
    assert {r.name for r in fm.SystemLanguageModelUnavailableReason} >= {
        "APPLE_INTELLIGENCE_NOT_ENABLED", "DEVICE_NOT_ELIGIBLE", "MODEL_NOT_READY"}
    available, _ = model.is_available()
    assert isinstance(available, bool)
    assert isinstance(model.context_size, int)
    assert asyncio.run(model.token_count("one two three")) > 0
    for name in ("GuardrailViolationError", "UnsupportedLanguageOrLocaleError",
                 "ExceededContextWindowSizeError", "RateLimitedError", "ConcurrentRequestsError",
                 "RefusalError", "AssetsUnavailableError", "DecodingFailureError",
                 "InvalidGenerationSchemaError", "UnsupportedGuideError", "ImagePromptError"):
        assert issubclass(getattr(fm, name), Exception), name
    assert "path" in inspect.signature(fm.ImageAttachment).parameters


def test_prompts_are_composed_as_the_stream_composes_them(fm: ModuleType,
                                                         tmp_path: Path) -> None:
    """``compose_check`` reaches the SDK's composer and releases what it made; an image is
    either taken (macOS 27) or refused with ``ImagePromptError``, never lost."""
    compat.compose_check(fm, ["one", "two"])
    image = tmp_path / "image.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n")
    with contextlib.suppress(fm.ImagePromptError):
        compat.compose_check(fm, ["look:", fm.ImageAttachment(image)])
