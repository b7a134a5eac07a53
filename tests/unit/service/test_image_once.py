"""A vision request's image is opened, and its JPEG segments walked, once on its way to the
model: the pixel total, the size limit, the scan guard and the decode each opened or
walked it again, three passes through what a hostile file hides before its frame (a
JPEG of two million empty segments took about two seconds a pass of the image threads).
Counted through test doubles of what afmd.service.images calls, on a real prepare of a
real vision model (demo-vision), in process."""

from __future__ import annotations

import asyncio
import base64
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from PIL import Image

from afmd.dialects.openai.chat import OPENAI_CHAT
from afmd.engine.models.loaded_model import LoadedModel
from afmd.errors import InvalidRequestError
from afmd.service import images
from afmd.service.pipeline import ChatPipeline
from afmd.service.scheduler import Scheduler

from helpers.one_model import SharedRegistry, loaded
from helpers.pictures import encoded, noise

#: The size of these tests' pictures (they were written with it).
SIZE = (32, 32)

#: Empty segments before the frame: each is a step of any walk that reads them.
SEGMENTS = 20_000


@pytest.fixture(scope="module")
def vision_model() -> Iterator[LoadedModel]:
    yield from loaded("demo-vision")




def padded_jpeg(**options: Any) -> bytes:
    good = encoded(noise(1, SIZE), "JPEG", **options)
    return good[:2] + b"\xff\xe5\x00\x02" * SEGMENTS + good[2:]


class CountingMarkers:
    """The scan guard's marker pattern, counting its searches: one a segment walked."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern = pattern
        self.searches = 0

    def search(self, data: bytes, at: int) -> re.Match[bytes] | None:
        self.searches += 1
        return self.pattern.search(data, at)


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> Counter[bytes]:
    """How many times each image's bytes were opened by Pillow."""
    counted: Counter[bytes] = Counter()
    real = Image.open

    def counting_open(fp: Any, *args: Any, **kwargs: Any) -> Image.Image:
        counted[fp.getvalue()] += 1
        return real(fp, *args, **kwargs)

    monkeypatch.setattr(images.Image, "open", counting_open)
    return counted


@pytest.fixture
def markers(monkeypatch: pytest.MonkeyPatch) -> CountingMarkers:
    counting = CountingMarkers(images._JPEG_MARKER)
    monkeypatch.setattr(images, "_JPEG_MARKER", counting)
    return counting


def prepare(model: LoadedModel, *parts: tuple[bytes, str]) -> None:
    pipeline = ChatPipeline(SharedRegistry(model), Scheduler(2, 2), request_timeout=60)
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is in the picture?"}]
    content += [{"type": "image_url", "image_url": {
        "url": f"data:{media};base64,{base64.b64encode(data).decode()}"}}
        for data, media in parts]
    body = {"model": "demo-vision", "max_tokens": 1,
            "messages": [{"role": "user", "content": content}]}

    async def go() -> None:
        request = OPENAI_CHAT.parse(orjson.dumps(body))
        pipeline.discard(await pipeline.prepare(request, uuid.uuid4().hex))

    asyncio.run(go())


@pytest.mark.parametrize("options", [{}, {"progressive": True}],
                         ids=["baseline", "progressive"])
def test_each_image_is_opened_and_walked_once(vision_model: LoadedModel,
                                              opens: Counter[bytes],
                                              markers: CountingMarkers,
                                              options: dict[str, Any]) -> None:
    jpeg = padded_jpeg(**options)
    png = encoded(noise(2, SIZE), "PNG")
    prepare(vision_model, (jpeg, "image/jpeg"), (png, "image/png"))
    assert opens == {jpeg: 1, png: 1}
    # The scan guard went on from the open's first scan: the segments before it are
    # Pillow's alone to read.
    assert markers.searches < SEGMENTS // 100, markers.searches


def test_an_image_that_does_not_open_is_named_without_opening_it_again(
        vision_model: LoadedModel, opens: Counter[bytes]) -> None:
    broken = b"\xff\xd8\xff\xe5\x00\x02" * 1000
    with pytest.raises(InvalidRequestError) as caught:
        prepare(vision_model, (broken, "image/jpeg"))
    assert (caught.value.code, caught.value.param) == (
        "invalid_image", "messages[0].content[1].image_url")
    assert opens == {broken: 1}


def test_the_scan_guard_refuses_on_the_request_path(vision_model: LoadedModel) -> None:
    """The guard counts from the open's first scan, and refuses as it did walking all."""
    data = encoded(Image.new("RGB", (64, 64), (10, 120, 200)), "JPEG", progressive=True)
    last = data.rindex(b"\xff\xda")
    many = data[:-2] + data[last:-2] * 100 + data[-2:]
    with pytest.raises(InvalidRequestError) as caught:
        prepare(vision_model, (many, "image/jpeg"))
    assert (caught.value.code, caught.value.param) == (
        "invalid_image", "messages[0].content[1].image_url")
    assert "more than 100 scans" in str(caught.value)
    prepare(vision_model, (data[:-2] + data[last:-2] * 80 + data[-2:], "image/jpeg"))
