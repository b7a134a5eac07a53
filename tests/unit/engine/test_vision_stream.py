"""A vision request's tokens into events (afmd.engine.vision.vision_stream), as the text
model's rows make them: a hidden token counts and keeps its log-probability but adds no
text (the batch path's own test is in tests/server/test_logprobs.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from afmd.engine.generation import Finished, Generation, GenerationRequest, Text
from afmd.engine.vision.vision_stream import VisionStream

from helpers.format_models import build
from helpers.formats import SPECS


def run(tokenizer: Any, tokens: list[int], **fields: Any) -> list[Any]:
    loop = asyncio.new_event_loop()
    try:
        request = GenerationRequest(request_id="v", prompt=[1, 2], max_tokens=len(tokens),
                                    **fields)
        generation = Generation(request, loop)
        stream = VisionStream(generation, tokenizer, frozenset(tokenizer.eos_token_ids),
                              time.perf_counter(), [])
        scores = mx.zeros((len(tokenizer.get_vocab()),))
        for token in tokens:
            assert stream.step(token, scores)
        stream.finish()
        loop.run_until_complete(asyncio.sleep(0))  # the pushes, scheduled on the loop
        return list(generation._events)
    finally:
        loop.close()


def test_hidden_tokens_count_and_score_but_add_no_text(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(build(SPECS["hermes"], tmp_path / "hermes"))
    start = tokenizer.get_vocab()["<|im_start|>"]
    words = tokenizer.encode("Hello there, world", add_special_tokens=False)
    tokens = [*words[:2], start, *words[2:]]
    for logprobs in (None, 0):
        shown = run(tokenizer, tokens, logprobs=logprobs)
        hidden = run(tokenizer, tokens, logprobs=logprobs, hidden_ids=frozenset({start}))
        text = "".join(e.text for e in hidden if isinstance(e, Text))
        assert "<|im_start|>" in "".join(e.text for e in shown if isinstance(e, Text))
        assert text == "Hello there, world"
        (finished,) = [e for e in hidden if isinstance(e, Finished)]
        assert finished.completion_tokens == len(tokens)
        if logprobs is not None:
            scored = [lp.token for e in hidden if isinstance(e, Text) for lp in e.logprobs]
            assert scored == tokens
