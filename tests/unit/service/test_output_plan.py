"""How a request's ``reasoning_effort`` reaches a model's chat template."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from afmd.core.request import ChatRequest
from afmd.service import output_plan


@pytest.mark.parametrize(("effort", "level"), [
    ("none", "low"), ("minimal", "low"), ("low", "low"), ("medium", "medium"),
    ("high", "high"), ("xhigh", "high"), ("max", "high"),
])
def test_every_effort_is_a_gpt_oss_level(monkeypatch: pytest.MonkeyPatch, effort: str,
                                         level: str) -> None:
    """gpt-oss has no level above ``high``: the highest efforts are it. OpenAI's ``max``
    (the Responses API's and chat's) was ``medium``, the level for an unknown effort."""
    harmony: Any = SimpleNamespace(channels=True)
    monkeypatch.setattr(output_plan, "model_formats", lambda model: harmony)
    request = ChatRequest(messages=(), reasoning_effort=effort)
    assert output_plan.template_kwargs(request, None) == {"reasoning_effort": level}  # type: ignore[arg-type]
