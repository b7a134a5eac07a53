"""A prompt that continues an earlier generation (Ollama's generate ``context``): the
earlier ids first, exactly, one beginning-of-sequence token in all; and the ids an engine
row hands back are every token it wrote, its end-of-sequence token included, cut where a
stop sequence ended the answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from afmd.engine.batch.sequence import Row
from afmd.engine.generation import Finished, Generation, GenerationRequest
from afmd.service.prompt_prefix import continued

BOS = 1


def test_the_prefix_comes_first_with_one_beginning_of_sequence() -> None:
    assert continued((BOS, 5, 6), [BOS, 7, 8], BOS) == [BOS, 5, 6, 7, 8]
    assert continued((BOS, 5, 6), [7, 8], BOS) == [BOS, 5, 6, 7, 8]  # a template without
    assert continued((5, 6), [BOS, 7], None) == [5, 6, BOS, 7]  # no BOS: nothing to drop
    rendered = [BOS, 7, 8]
    assert continued((), rendered, BOS) is rendered  # no earlier turn: the rendering


class _Detokenizer:
    def __init__(self) -> None:
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = f"<{token}>"

    def finalize(self) -> None:
        self.last_segment = ""


def _row(eos: int) -> tuple[Row, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    generation = Generation(GenerationRequest("r", [3, 4], 8), loop)
    return Row(generation, 0, _Detokenizer(), prompt_tokens=2,
               stop_ids=frozenset({eos})), loop


def _finished(row: Row) -> Finished:
    event: Any = row.pending[-1]
    assert isinstance(event, Finished)
    return event


def test_a_row_hands_back_every_token_it_wrote_its_end_included() -> None:
    row, loop = _row(eos=2)
    try:
        for token, reason in ((10, None), (11, None), (2, "stop")):
            row.take(token, reason, None, 0.0)
        row.finish("stop")
    finally:
        loop.close()
    finished = _finished(row)
    assert finished.completion_tokens == 2  # the end is not counted, but it was written
    assert finished.output_ids == (10, 11, 2)
    # A stop sequence that ended the answer after the first token: what came after is no
    # answer's, nor the client's to send back.
    assert finished.stopped_after(1).output_ids == (10,)
    assert finished.stopped_after(5) is finished


def test_an_engine_without_ids_gives_none() -> None:
    assert Finished("stop", 1, 1).output_ids is None
    assert Finished("stop", 1, 3).stopped_after(1).output_ids is None
