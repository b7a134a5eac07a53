"""Images on a vision model: the built-in demo-vision (a tiny random Qwen2-VL that mlx-vlm
serves) through the real server, the official openai client and the other dialects.

The model's output is gibberish, but greedy output is a function of the pixels: two
different pictures give different text for the same question, the same picture the same
text, whatever wire format or file format carried it. Decoding failures and limits are
the client's 400s naming the image part; a text-only model still refuses images.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from afmd.core.request import ImageInput
from afmd.errors import InvalidRequestError

from conftest import ServerProcess, parse_sse, start_server
from helpers.openai_schemas import validate_error
from helpers.pictures import encoded, noise
from helpers.smoke import Running

MODEL = "demo-vision"
QUESTION = "What is in the picture?"
MAX_PIXELS = 112 * 112  # the server's [models] max_image_pixels below
MAX_REQUEST_PIXELS = 3 * MAX_PIXELS  # and its max_request_image_pixels
MAX_IMAGES = 8  # and its max_request_images
CHAT = "/v1/chat/completions"


# -- pictures ----------------------------------------------------------------------------



def solid(color: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> Image.Image:
    return Image.new("RGB", size, color)



def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png_url(picture: Image.Image) -> str:
    return data_url(encoded(picture))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims a size and whose pixel data is a few bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


# -- the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision_folder() -> Path:
    from afmd.engine.demo import builtin as demo

    return demo.materialize("demo-vision")  # the server (same AFMD_CACHE_DIR) reuses it


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, vision_folder: Path
        ) -> Iterator[ServerProcess]:
    config = (
        f'[models]\ndefault = "{MODEL}"\nmax_image_pixels = {MAX_PIXELS}\n'
        f'max_request_image_pixels = {MAX_REQUEST_PIXELS}\n'
        f'max_request_images = {MAX_IMAGES}\n'
        f'max_image_pixels_in_flight = {MAX_REQUEST_PIXELS}\n'
        # The same folder with no kind: detected as a vision model from its config.json.
        f'[[models.model]]\nid = "vision-auto"\npath = "{vision_folder}"\n'
    )
    proc = start_server(tmp_path_factory.mktemp("vision"), config=config)
    yield proc
    proc.stop()


@pytest.fixture()
def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def parts(url: str, text: str = QUESTION) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]


def ask(client: openai.OpenAI, url: str, *, model: str = MODEL, text: str = QUESTION,
        max_tokens: int = 12) -> Any:
    return client.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": parts(url, text)}],  # type: ignore[misc]
    )


def answer(client: openai.OpenAI, url: str, **kwargs: Any) -> str:
    content = ask(client, url, **kwargs).choices[0].message.content
    assert content
    return content


def post(srv: ServerProcess, body: dict[str, Any], path: str = CHAT,
         **headers: str) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=120)


def assert_error(r: httpx.Response, code: str, param: str | None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error"
    return error


# -- the picture decides the output ------------------------------------------------------


def test_different_images_give_different_outputs(client: openai.OpenAI) -> None:
    first, second = png_url(noise(1)), png_url(noise(2))
    a, b = answer(client, first), answer(client, second)
    assert a != b
    assert answer(client, first) == a  # greedy: the same picture, the same text
    assert answer(client, png_url(solid((255, 0, 0)))) != answer(
        client, png_url(solid((0, 0, 255))))


def test_formats_decode_to_the_same_pixels(client: openai.OpenAI) -> None:
    picture = noise(3)
    reference = answer(client, png_url(picture))
    lossless_webp = data_url(encoded(picture, "WEBP", lossless=True), "image/webp")
    assert answer(client, lossless_webp) == reference
    # An animated GIF is its first frame; flat colours survive its palette exactly.
    red, blue = solid((255, 0, 0)), solid((0, 0, 255))
    gif = data_url(encoded(red, "GIF", save_all=True, append_images=[blue], duration=100,
                           loop=0), "image/gif")
    assert Image.open(io.BytesIO(base64.b64decode(gif.split(",")[1]))).n_frames == 2
    assert answer(client, gif) == answer(client, png_url(red))
    # Transparency is flattened onto white.
    clear = Image.new("RGBA", (64, 64), (10, 200, 30, 0))
    assert answer(client, png_url(clear)) == answer(client, png_url(solid((255, 255, 255))))
    # JPEG is lossy: the same size of picture, so the same prompt.
    jpeg = ask(client, data_url(encoded(picture, "JPEG", quality=90), "image/jpeg"))
    assert jpeg.usage.prompt_tokens == ask(client, png_url(picture)).usage.prompt_tokens


def test_usage_counts_the_image_tokens(client: openai.OpenAI) -> None:
    text_only = client.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": QUESTION}])
    base = text_only.usage.prompt_tokens
    # Qwen2-VL: a 28x28 cell is one token; the picture sits between two markers.
    small = ask(client, png_url(noise(4, (56, 56))), max_tokens=1).usage.prompt_tokens
    large = ask(client, png_url(noise(4, (112, 112))), max_tokens=1).usage.prompt_tokens
    assert small == base + 2 * 2 + 2
    assert large == base + 4 * 4 + 2
    two = client.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
            *parts(png_url(noise(4, (56, 56)))),
            {"type": "image_url", "image_url": {"url": png_url(noise(5, (112, 112)))}},
        ]}])  # type: ignore[misc]
    assert two.usage.prompt_tokens == base + (4 + 2) + (16 + 2)


def test_configured_folder_is_detected_as_vision(client: openai.OpenAI) -> None:
    url = png_url(noise(6))
    assert answer(client, url, model="vision-auto") == answer(client, url)


# -- the same picture in every dialect ---------------------------------------------------


def test_anthropic_and_responses_images_match_chat(client: openai.OpenAI,
                                                   srv: ServerProcess) -> None:
    data = encoded(noise(7))
    expected = answer(client, data_url(data), max_tokens=16)  # Responses' least
    b64 = base64.b64encode(data).decode()
    messages = post(srv, {"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64}},
        ]}]}, "/v1/messages")
    assert messages.status_code == 200, messages.text
    assert messages.json()["content"][0]["text"] == expected
    responses = post(srv, {"model": MODEL, "max_output_tokens": 16, "temperature": 0,
                           "input": [{"role": "user", "content": [
                               {"type": "input_text", "text": QUESTION},
                               {"type": "input_image", "image_url": data_url(data)},
                           ]}]}, "/v1/responses")
    assert responses.status_code == 200, responses.text
    output = [i for i in responses.json()["output"] if i["type"] == "message"]
    assert output[0]["content"][0]["text"] == expected
    # The image's tokens are counted the same way by Anthropic's token counter.
    counted = post(srv, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": b64}},
    ]}]}, "/v1/messages/count_tokens")
    assert counted.json()["input_tokens"] == messages.json()["usage"]["input_tokens"]


def test_bad_images_name_their_part_in_every_dialect(srv: ServerProcess) -> None:
    corrupt = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40).decode()
    r = post(srv, {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": corrupt}}]}]}, "/v1/messages")
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[1].source" in r.json()["error"]["message"]
    r = post(srv, {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION},
        {"type": "input_image", "image_url": f"data:image/png;base64,{corrupt}"}]}]},
        "/v1/responses")
    assert_error(r, "invalid_image", "input[0].content[1].image_url")


# -- what is refused ---------------------------------------------------------------------


@pytest.mark.parametrize("data", [
    b"\x89PNG\r\n\x1a\n" + b"\x00" * 64,  # a PNG signature and garbage
    encoded(noise(8))[:200],  # a real PNG cut short
    b"GIF89a" + b"\xff" * 10,
    b"not an image at all",
], ids=["garbage", "truncated", "bad-gif", "text"])
def test_undecodable_image_is_invalid_image(srv: ServerProcess, data: bytes) -> None:
    r = post(srv, {"model": MODEL, "max_tokens": 4,
                   "messages": [{"role": "user", "content": parts(data_url(data))}]})
    assert_error(r, "invalid_image", "messages[0].content[1].image_url")


def test_corrupt_png_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64))
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("invalid_image",
                                               "messages[0].content[1].image_url")


def test_rfc_2397_data_urls_are_the_same_picture(client: openai.OpenAI,
                                                  srv: ServerProcess) -> None:
    """A media type in capitals and parameters before ``;base64`` (RFC 2397) are the same
    picture as the plain URL, in Chat and Responses; a data URL that is not base64, or not
    an image, is still the 400 naming the part."""
    payload = png_url(noise(21)).partition(",")[2]
    plain = answer(client, "data:image/png;base64," + payload)
    for prefix in ("data:IMAGE/PNG;base64,", "data:image/png;charset=utf-8;base64,",
                   "data:image/png;name=x.png;base64,"):
        assert answer(client, prefix + payload) == plain, prefix
        r = post(srv, {"model": MODEL, "max_output_tokens": 16, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                         {"type": "input_image", "image_url": prefix + payload}]}]},
            "/v1/responses")
        assert r.status_code == 200, r.text
    for url in ("data:image/png;charset=utf-8," + payload, "data:text/plain;base64," + payload):
        r = post(srv, {"model": MODEL, "messages": [{"role": "user", "content": parts(url)}]})
        assert_error(r, "invalid_image_url", "messages[0].content[1].image_url.url")


def test_remote_url_is_refused_without_fetching(srv: ServerProcess) -> None:
    r = post(srv, {"model": MODEL, "messages": [
        {"role": "user", "content": parts("http://127.0.0.1:9/never-fetched.png")}]})
    assert_error(r, "unsupported_image_url", "messages[0].content[1].image_url.url")


def test_image_over_max_image_pixels(srv: ServerProcess) -> None:
    r = post(srv, {"model": MODEL, "messages": [
        {"role": "user", "content": parts(png_url(noise(9, (113, 112))))}]})
    error = assert_error(r, "image_too_large", "messages[0].content[1].image_url")
    assert "max_image_pixels" in error["message"] and str(MAX_PIXELS) in error["message"]
    ok = post(srv, {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": parts(png_url(noise(9, (112, 112))))}]})
    assert ok.status_code == 200, ok.text


def test_a_requests_images_together_stay_under_max_request_image_pixels(
        srv: ServerProcess) -> None:
    """Each image under its own limit, but a request's pictures are held together: a
    body limit's worth of flat PNGs (a hundred kilobytes for 33 megapixels) took more
    memory than the machine has. The image that crosses the total is named, in every
    dialect, and an earlier turn's images count (a conversation is sent whole)."""
    full = png_url(noise(10, (112, 112)))
    three = [{"type": "text", "text": QUESTION}] + [
        {"type": "image_url", "image_url": {"url": full}}] * 3
    ok = post(srv, {"model": MODEL, "max_tokens": 1,
                    "messages": [{"role": "user", "content": three}]})
    assert ok.status_code == 200, ok.text
    four = [*three, {"type": "image_url", "image_url": {"url": full}}]
    r = post(srv, {"model": MODEL, "messages": [{"role": "user", "content": four}]})
    error = assert_error(r, "image_too_large", "messages[0].content[4].image_url")
    assert "max_request_image_pixels" in error["message"]
    assert f"{4 * MAX_PIXELS} pixels" in error["message"]
    history = post(srv, {"model": MODEL, "messages": [
        {"role": "user", "content": three}, {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": parts(full)}]})
    assert_error(history, "image_too_large", "messages[2].content[1].image_url")
    b64 = full.split(",", 1)[1]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64}}
    messages = httpx.post(srv.url + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": [block] * 4}]})
    assert messages.status_code == 400
    assert "max_request_image_pixels" in messages.json()["error"]["message"]
    assert messages.json()["error"]["message"].startswith("messages[0].content[3].source")
    ollama = httpx.post(srv.url + "/api/chat", timeout=60, json={
        "model": MODEL, "stream": False,
        "messages": [{"role": "user", "content": QUESTION, "images": [b64] * 4}]})
    assert ollama.status_code == 400 and "max_request_image_pixels" in ollama.json()["error"]


def test_a_requests_images_are_counted_against_max_request_images(
        srv: ServerProcess) -> None:
    """One-pixel pictures pass every pixel limit, but the processor scales each up to its
    smallest input: ten thousand of them (1.6 MB of body) took the server past 2 GB for a
    400 about the context. One past the count is refused before any is read, naming it,
    in every dialect, and an earlier turn's images count."""
    dot = encoded(solid((200, 10, 10), (1, 1)))
    b64 = base64.b64encode(dot).decode()
    url = data_url(dot)
    image = {"type": "image_url", "image_url": {"url": url}}
    ok = post(srv, {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}] + [image] * MAX_IMAGES}]})
    assert ok.status_code == 200, ok.text
    r = post(srv, {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]
         + [image] * (MAX_IMAGES + 1)}]})
    error = assert_error(r, "too_many_images", f"messages[0].content[{MAX_IMAGES + 1}].image_url")
    validate_error(r.json())
    assert "max_request_images" in error["message"]
    history = post(srv, {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [image] * MAX_IMAGES},
        {"role": "assistant", "content": "dots"},
        {"role": "user", "content": parts(url)}]})
    assert_error(history, "too_many_images", "messages[2].content[1].image_url")
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64}}
    messages = httpx.post(srv.url + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": [block] * (MAX_IMAGES + 1)}]})
    assert messages.status_code == 400, messages.text
    assert messages.json()["error"]["message"].startswith(
        f"messages[0].content[{MAX_IMAGES}].source")
    responses = httpx.post(srv.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "max_output_tokens": 16, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}] * (MAX_IMAGES + 1)}]})
    assert responses.status_code == 400, responses.text
    assert (responses.json()["error"]["code"], responses.json()["error"]["param"]) == (
        "too_many_images", f"input[0].content[{MAX_IMAGES}].image_url")
    ollama = httpx.post(srv.url + "/api/chat", timeout=60, json={
        "model": MODEL, "stream": False,
        "messages": [{"role": "user", "content": QUESTION, "images": [b64] * (MAX_IMAGES + 1)}]})
    assert ollama.status_code == 400, ollama.text
    assert "max_request_images" in ollama.json()["error"]
    assert ollama.json()["error"].startswith(f"messages[0].images[{MAX_IMAGES}]")
    generate = httpx.post(srv.url + "/api/generate", timeout=60, json={
        "model": MODEL, "stream": False, "prompt": QUESTION, "images": [b64] * (MAX_IMAGES + 1)})
    assert generate.status_code == 400, generate.text
    assert generate.json()["error"].startswith(f"images[{MAX_IMAGES}]")
    counted = httpx.post(srv.url + "/v1/messages/count_tokens", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": [block] * (MAX_IMAGES + 1)}]})
    assert counted.status_code == 400, counted.text
    assert "max_request_images" in counted.json()["error"]["message"]


def test_vision_requests_in_flight_share_max_image_pixels_in_flight(
        srv: ServerProcess) -> None:
    """A request's pictures are decoded when it arrives, before it queues, and counted
    until it ends: past the budget, another image request is 429 with Retry-After while a text
    one goes on, and the budget comes back when the holder ends (here, disconnects)."""
    full = png_url(noise(15, (112, 112)))
    holder = {"model": MODEL, "stream": True, "max_tokens": 6000, "temperature": 0,
              "messages": [{"role": "user", "content": [
                  {"type": "text", "text": QUESTION},
                  *[{"type": "image_url", "image_url": {"url": full}}] * 3]}]}
    small = {"model": MODEL, "max_tokens": 1,
             "messages": [{"role": "user", "content": parts(png_url(noise(16)))}]}
    with httpx.Client(timeout=60) as http, http.stream("POST", srv.url + CHAT,
                                                       json=holder) as stream:
        assert stream.status_code == 200
        # Generating: its pictures are held. The iterator is kept: one dropped closes the
        # connection (httpcore closes a stream left unread), and the holder would leave.
        chunks = stream.iter_text()
        next(chunks)
        busy = post(srv, small)
        assert busy.status_code == 429, busy.text
        validate_error(busy.json())
        error = busy.json()["error"]
        assert (error["code"], error["type"]) == ("rate_limited", "rate_limit_error")
        assert busy.headers["Retry-After"].isdigit()
        assert "max_image_pixels_in_flight" in error["message"]
        assert f"hold {MAX_REQUEST_PIXELS} image pixels" in error["message"]
        text = post(srv, {"model": "demo", "max_tokens": 1,
                          "messages": [{"role": "user", "content": "hi"}]})
        assert text.status_code == 200, text.text
    deadline = time.monotonic() + 30
    while (after := post(srv, small)).status_code == 429:  # the disconnect ends the holder
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert after.status_code == 200, after.text


def test_the_request_total_is_read_from_headers_before_decoding() -> None:
    from afmd.service import images

    parts_ = [ImageInput(png_header_only(100_000, 100_000), f"p{i}", i) for i in range(2)]
    with pytest.raises(InvalidRequestError) as caught:
        images.check_total(parts_, 2 * 10**10 - 1)  # only headers: nothing to decode
    assert (caught.value.code, caught.value.param) == ("image_too_large", "p1")
    images.check_total(parts_, 2 * 10**10)
    with pytest.raises(InvalidRequestError) as many:
        images.check_total(parts_, 2 * 10**10, max_images=1)
    assert (many.value.code, many.value.param) == ("too_many_images", "p1")
    images.check_total([ImageInput(b"not an image", "bad", 0)], 1)  # decode() names it


def test_size_is_checked_before_decoding() -> None:
    from afmd.service import images

    huge = ImageInput(png_header_only(100_000, 100_000), "messages[0].content[0].image_url", 0)
    with pytest.raises(InvalidRequestError) as caught:
        images.decode(huge, 33554432)
    assert caught.value.code == "image_too_large"  # not a 30 GB allocation, not a bomb
    small = ImageInput(png_header_only(8, 8), "p", 0)
    with pytest.raises(InvalidRequestError) as caught:
        images.decode(small, 33554432)
    assert (caught.value.code, caught.value.param) == ("invalid_image", "p")


def test_text_only_model_refuses_images(srv: ServerProcess) -> None:
    r = post(srv, {"model": "demo", "messages": [
        {"role": "user", "content": parts(png_url(noise(1)))}]})
    assert_error(r, "image_input_not_supported", "messages[0].content[1].image_url")


# -- queue and cancel --------------------------------------------------------------------


class Streamed:
    """One streamed chat request on its own thread; its chunks land in ``events``."""

    def __init__(self, srv: ServerProcess, rid: str, url: str, max_tokens: int) -> None:
        self.events: list[Any] = []
        self.first = threading.Event()
        # Greedy: the pictures used here run thousands of tokens without an end token.
        self.body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                     "temperature": 0, "messages": [{"role": "user", "content": parts(url)}]}
        self._thread = threading.Thread(target=self._run, args=(srv.url, rid), daemon=True)
        self._thread.start()

    def _run(self, base: str, rid: str) -> None:
        with httpx.stream("POST", base + CHAT, json=self.body, timeout=120,
                          headers={"X-Request-ID": rid}) as r:
            buf = ""
            for text in r.iter_text():
                buf += text
                while "\n\n" in buf:
                    block, buf = buf.split("\n\n", 1)
                    self.events.extend(parse_sse(block + "\n\n"))
                    if self.events:
                        self.first.set()
        self.first.set()

    def join(self, timeout: float = 60) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive()

    @property
    def finish(self) -> str | None:
        reasons = [c["finish_reason"] for e in self.events if isinstance(e, dict)
                   for c in e.get("choices", []) if c.get("finish_reason")]
        return reasons[-1] if reasons else None


def test_queued_and_running_vision_requests_cancel(srv: ServerProcess) -> None:
    stamp = time.monotonic_ns()
    running = Streamed(srv, f"vis-run-{stamp}", png_url(noise(10)), 6000)
    assert running.first.wait(60)
    # One sequence at a time: the second waits behind the first, and its cancel ends it
    # there while the first goes on.
    queued = Streamed(srv, f"vis-queued-{stamp}", png_url(noise(11)), 6000)
    time.sleep(0.3)
    r = httpx.post(f"{srv.url}{CHAT}/vis-queued-{stamp}/cancel", timeout=10)
    assert r.status_code == 200 and r.json()["cancelled"] is True
    queued.join(30)
    assert queued.finish == "cancelled"
    assert running.finish is None  # still generating
    r = httpx.post(f"{srv.url}{CHAT}/vis-run-{stamp}/cancel", timeout=10)
    assert r.status_code == 200
    running.join(30)
    assert running.finish == "cancelled"
    assert running.events[-1] == "[DONE]"
    # The model serves the next request normally.
    after = post(srv, {"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": parts(png_url(noise(12)))}]})
    assert after.status_code == 200, after.text


def test_streamed_image_answer_equals_the_whole_one(srv: ServerProcess,
                                                    client: openai.OpenAI) -> None:
    url = png_url(noise(13))
    whole = answer(client, url)
    r = post(srv, {"model": MODEL, "temperature": 0, "max_tokens": 12, "stream": True,
                   "messages": [{"role": "user", "content": parts(url)}]})
    chunks = [e for e in parse_sse(r.text) if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])
    assert text == whole
    assert json.dumps(chunks)  # plain JSON all the way


def test_a_vision_model_loaded_again_answers_as_before(srv: ServerProcess,
                                                       client: openai.OpenAI) -> None:
    """``keep_alive: 0`` unloads the model after each answer, and its next load takes
    the previous load's tokenizer and processor (and the grammar state built from them):
    the same picture still gets the same answer and the same count of prompt tokens, and
    a schema still shapes it."""
    url = png_url(noise(15))
    expected = ask(client, url)
    schema = {"type": "object", "properties": {"n": {"type": "boolean"}},
              "required": ["n"], "additionalProperties": False}
    for _ in range(3):
        r = post(srv, {"model": MODEL, "temperature": 0, "max_tokens": 12, "keep_alive": 0,
                       "messages": [{"role": "user", "content": parts(url)}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected.choices[0].message.content
        assert r.json()["usage"]["prompt_tokens"] == expected.usage.prompt_tokens
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/health", timeout=10).json()[
                "model_details"][MODEL]["state"] != "available":
            assert time.monotonic() < deadline, f"{MODEL} stayed loaded"
            time.sleep(0.02)
        shaped = post(srv, {"model": MODEL, "max_tokens": 40, "keep_alive": 0,
                            "messages": [{"role": "user", "content": parts(url)}],
                            "response_format": {"type": "json_schema", "json_schema": {
                                "name": "n", "schema": schema, "strict": True}}})
        assert shaped.status_code == 200, shaped.text
        assert set(json.loads(shaped.json()["choices"][0]["message"]["content"])) == {"n"}


def test_grammar_and_logprobs_on_a_vision_model(client: openai.OpenAI) -> None:
    url = png_url(noise(14))
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
              "required": ["colour"], "additionalProperties": False}
    shaped = client.chat.completions.create(
        model=MODEL, max_tokens=60, messages=[{"role": "user", "content": parts(url)}],
        response_format={"type": "json_schema",  # type: ignore[misc,typeddict-item]
                         "json_schema": {"name": "c", "schema": schema, "strict": True}})
    assert set(json.loads(shaped.choices[0].message.content or "")) == {"colour"}
    scored = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": parts(url)}])  # type: ignore[misc]
    entries = scored.choices[0].logprobs.content
    assert len(entries) == scored.usage.completion_tokens
    for entry in entries:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


@pytest.mark.parametrize("count", [1, 2], ids=["alone", "after-a-good-one"])
def test_an_image_the_processor_will_not_take_is_named(srv: ServerProcess, count: int) -> None:
    # Qwen2-VL's processor refuses an aspect ratio over 200: the client's image, so a 400
    # naming that image part (it read as a chat-template failure of "messages").
    content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    if count == 2:
        content.append({"type": "image_url", "image_url": {"url": png_url(noise(3))}})
    content.append({"type": "image_url", "image_url": {"url": png_url(solid((9, 9, 9),
                                                                          (1, 300)))}})
    r = post(srv, {"model": MODEL, "max_tokens": 4,
                   "messages": [{"role": "user", "content": content}]})
    error = assert_error(r, "invalid_image", f"messages[0].content[{count}].image_url")
    assert "image processor cannot take this image" in error["message"]
    assert "aspect ratio" in error["message"]


def test_a_scored_prompt_is_run_in_chunks_with_mlx_vlm_s_numbers(
        tmp_path: Path, vision_folder: Path) -> None:
    """``echo`` with ``logprobs`` on a vision model ran the whole prompt in one forward
    pass: its attention and its logits (the prompt's length times the vocabulary, in
    float32, several times over) held at once, gigabytes for one long prompt on a real
    model. It is scored a chunk at a time through a KV cache: the server's peak MLX
    memory stays under what the whole prompt's logits alone take, its numbers are
    mlx-vlm's over the whole prompt, and the prompt's tokens count in the usage."""
    import mlx.core as mx
    from mlx_vlm import load

    from helpers.numerics import LOGPROB_TOLERANCE

    srv = start_server(tmp_path, config=f'[models]\ndefault = "{MODEL}"\n')
    try:
        long = "the weather in Rome is mild today. " * 300
        streamed = httpx.post(srv.url + "/v1/completions", timeout=300,
                              headers={"X-AFM-Profile": "true"},
                              json={"prompt": long, "echo": True, "logprobs": 1,
                                    "max_tokens": 0, "stream": True,
                                    "stream_options": {"include_usage": True}})
        events = parse_sse(streamed.text)
        usage = next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))
        peak = next(e["afm_profile"]["peak_memory_bytes"] for e in events
                    if isinstance(e, dict) and "afm_profile" in e)
        vocab = json.loads((vision_folder / "config.json").read_text())["vocab_size"]
        assert usage["prompt_tokens"] > 4000
        assert peak < usage["prompt_tokens"] * vocab * 4, peak

        short = "one two three four five six seven eight nine ten " * 20
        scored = post(srv, {"prompt": short, "echo": True, "logprobs": 2, "max_tokens": 0},
                      path="/v1/completions").json()
        got = scored["choices"][0]["logprobs"]["token_logprobs"]
        assert scored["usage"]["prompt_tokens"] == len(got)
        model, processor = load(str(vision_folder))
        ids = processor.tokenizer.encode(short, add_special_tokens=False)
        logits = model.language_model(mx.array([ids])).logits[0].astype(mx.float32)
        want = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        assert got[0] is None and len(got) == len(ids)
        for i in range(1, len(ids)):
            assert abs(got[i] - float(want[i - 1, ids[i]])) <= LOGPROB_TOLERANCE, i

        # A cancel by its X-Request-ID ends the scoring between two chunks.
        rid = f"vision-score-{time.monotonic_ns()}"
        scoring = Running(srv.url, lambda: httpx.post(
            srv.url + "/v1/completions", timeout=300, headers={"X-Request-ID": rid},
            json={"prompt": long, "echo": True, "logprobs": 1, "max_tokens": 0})).under_way()
        cancelled = httpx.post(f"{srv.url}/v1/completions/{rid}/cancel", timeout=10)
        answer = scoring.answer()
        assert cancelled.json()["cancelled"] is True, "the scoring ended before its cancel"
        assert answer.json()["choices"][0]["finish_reason"] == "cancelled", answer.text
    finally:
        srv.stop()
