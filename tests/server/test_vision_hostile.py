"""Hostile images against a real server on demo-vision, at the default limits: files whose
cost is out of proportion to their size (in time, in memory), that must neither stall the
event loop nor outlive their request, and pictures whose meaning hides in their metadata.

tests/server/test_vision.py holds the ordinary cases (formats, limits, every dialect);
what was probed and found already right is listed in docs/hardening.md.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import ServerProcess, start_server
from helpers.loop_watch import worst_health_while
from helpers.pictures import encoded, noise
from helpers.smoke import vm_rss_kib

MODEL = "demo-vision"
CHAT = "/v1/chat/completions"




def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chat_body(data: bytes, media: str = "image/png", *, model: str = MODEL,
              max_tokens: int = 2) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "What is in the picture?"},
            {"type": "image_url", "image_url": {"url": f"data:{media};base64,{b64(data)}"}},
        ]}]}


def messages_body(data: bytes, media: str = "image/png") -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image", "source": {"type": "base64", "media_type": media,
                                     "data": b64(data)}}]}]}


def jpeg_with_empty_segments(count: int) -> bytes:
    """A small valid JPEG with ``count`` empty APP5 segments before its frame: Pillow's
    header reader walks them one by one in Python (about a microsecond each)."""
    good = encoded(noise(1, (8, 8)), "JPEG")
    return good[:2] + b"\xff\xe5\x00\x02" * count + good[2:]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from afmd.engine.demo import builtin as demo

    demo.materialize(MODEL)  # the server (same AFMD_CACHE_DIR) reuses it
    proc = start_server(tmp_path_factory.mktemp("hostile"),
                        config=f'[models]\ndefault = "{MODEL}"\n')
    yield proc
    proc.stop()


def post(srv: ServerProcess, body: dict[str, Any], path: str = CHAT) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=300)


# -- the event loop ----------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/v1/messages"], ids=["chat", "messages"])
def test_a_slow_header_does_not_stall_the_event_loop(srv: ServerProcess, path: str) -> None:
    """The pixels a request's images will take are read from their headers before any is
    decoded, and Pillow reads a header in Python through all the metadata before the
    frame: this JPEG's took about two seconds, on the event loop (twice for Anthropic's
    Messages, whose media type check opened it too), and /health waited as long."""
    data = jpeg_with_empty_segments(2_000_000)
    body = (chat_body(data, "image/jpeg") if path == CHAT
            else messages_body(data, "image/jpeg"))
    response, worst = worst_health_while(srv.url, lambda: post(srv, body, path))
    assert response.status_code == 200, response.text
    assert worst < 1.0, f"/health took {worst:.2f} s while the image was read"


def test_image_work_does_not_hold_up_text_requests(srv: ServerProcess) -> None:
    """Image requests' blocking work (headers, decoding) ran on asyncio's default
    executor, as every request's prompt rendering does: six of these at once filled its
    threads, and a text request to another model waited 12 s for one."""
    data = jpeg_with_empty_segments(300_000)
    answers: list[int] = []

    def send() -> None:
        answers.append(post(srv, chat_body(data, "image/jpeg")).status_code)

    text = {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert post(srv, text).status_code == 200  # loaded: what follows waits for nothing else
    senders = [threading.Thread(target=send) for _ in range(6)]
    began = time.monotonic()
    for sender in senders:
        sender.start()
    time.sleep(0.3)  # their bodies are in, their headers being read
    waits: list[float] = []
    with httpx.Client(timeout=120) as http:
        while any(sender.is_alive() for sender in senders):
            started = time.monotonic()
            r = http.post(srv.url + CHAT, json=text)
            assert r.status_code == 200, r.text
            waits.append(time.monotonic() - started)
            time.sleep(0.1)
    for sender in senders:
        sender.join()
    took = time.monotonic() - began
    assert answers == [200] * 6
    # Held up, a text request waited for a thread for seconds at a time (a third to a half
    # of the image work's length); beside it, the work is on threads of its own.
    assert max(waits) < took / 4, (
        f"text requests waited {[round(w, 1) for w in waits]} s beside image requests "
        f"that took {took:.1f} s")


def test_anthropic_media_type_is_read_from_the_signature() -> None:
    from afmd.service import images

    for fmt, media in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"),
                       ("WEBP", "image/webp")):
        assert images.media_type(encoded(noise(2, (4, 4)), fmt)) == media
    assert images.media_type(jpeg_with_empty_segments(3)) == "image/jpeg"
    for other in ("BMP", "TIFF", "ICO"):
        assert images.media_type(encoded(noise(2, (4, 4)), other)) is None
    assert images.media_type(b"") is None
    assert images.media_type(b"RIFF\x00\x00\x00\x00WAVEfmt ") is None


# -- decoding time -----------------------------------------------------------------------


def progressive_jpeg(size: tuple[int, int], extra_scans: int) -> bytes:
    """A flat progressive JPEG whose last scan is repeated ``extra_scans`` more times:
    libjpeg warns of the repeated refinement and decodes each one all the same, a pass
    over every block of the picture for 14 bytes of file."""
    data = encoded(Image.new("RGB", size, (10, 120, 200)), "JPEG", progressive=True)
    last = data.rindex(b"\xff\xda")
    assert data.endswith(b"\xff\xd9")
    return data[:-2] + data[last:-2] * extra_scans + data[-2:]


def test_a_jpeg_of_thousands_of_scans_is_refused_before_decoding(srv: ServerProcess) -> None:
    """This JPEG (84 KB) took 10 s of a core to decode before; the largest picture
    allowed, with a body's worth of scans, would have taken hours, on an executor
    thread nothing can interrupt."""
    data = progressive_jpeg((2000, 2000), 6000)
    started = time.monotonic()
    r = post(srv, chat_body(data, "image/jpeg"))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_image",
                                               "messages[0].content[1].image_url")
    assert "more than 100 scans" in error["message"]
    assert time.monotonic() - started < 5
    r = post(srv, messages_body(data, "image/jpeg"), "/v1/messages")
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages[0].content[1].source: ")
    # What encoders write passes: libjpeg's own progressive scans, and a few more.
    for fine in (progressive_jpeg((64, 64), 0), progressive_jpeg((64, 64), 90),
                 encoded(noise(3).convert("CMYK"), "JPEG", progressive=True)):
        assert post(srv, chat_body(fine, "image/jpeg")).status_code == 200


# -- memory after the request ------------------------------------------------------------


def flat_png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    """A picture of ``size`` whose file is tiny: 25 megapixels are 75 MB decoded."""
    return encoded(Image.new("RGB", size, color), "PNG")


def rss_mib(srv: ServerProcess) -> float:
    return vm_rss_kib(srv.proc.pid) / 1024


def test_decoded_pictures_do_not_outlive_their_request(srv: ServerProcess) -> None:
    """A vision request's pictures (three bytes a pixel) are let go when its prompt is
    built, and its processed image inputs when it ends, whether it was answered or
    refused. A finished run's objects, and a failed request's traceback with the request,
    refer to each other, so they wait for the garbage collector, which came every five
    or six requests: each of these requests left 150 MB resident behind it, and the
    requests' pixels, given back to ``max_image_pixels_in_flight`` as they ended, were
    still in memory, several requests' worth."""
    big = [flat_png((5000, 5000), (10 * i, 120, 200)) for i in range(2)]
    corrupt = b"\x89PNG\r\n\x1a\n" + bytes(40)

    def body(*pictures: bytes, max_tokens: int = 1) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": max_tokens, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What?"}, *(
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(p)}"}}
                for p in pictures)]}]}

    assert post(srv, body(encoded(noise(4)))).status_code == 200  # warm: the model loaded
    baseline = rss_mib(srv)
    cases = [
        (body(*big), 200),  # answered
        (body(*big, corrupt), 400),  # refused after two were decoded
        (body(*big, max_tokens=10**6), 400),  # refused once its prompt was built
        (body(*big), 200),
    ]
    for sent, status in cases:
        r = post(srv, sent)
        assert r.status_code == status, r.text
        grown = rss_mib(srv) - baseline
        assert grown < 100, f"{grown:.0f} MiB still resident after a {status}"


# -- what the metadata says --------------------------------------------------------------


def with_orientation(picture: Image.Image, fmt: str, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(picture, fmt, exif=exif.tobytes(), **({"lossless": True}
                                                          if fmt == "WEBP" else {}))


def answer(srv: ServerProcess, data: bytes, media: str = "image/png") -> str:
    r = post(srv, chat_body(data, media, max_tokens=12))
    assert r.status_code == 200, r.text
    content: str = r.json()["choices"][0]["message"]["content"]
    return content


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_a_picture_is_turned_as_its_exif_orientation_says(srv: ServerProcess,
                                                          fmt: str) -> None:
    """A phone stores a photo taken upright as the sensor read it, a quarter turn off, and
    says so in EXIF (orientation 6): browsers, transformers' load_image and mlx-vlm's
    turn it upright, and afmd gave the model the picture on its side. Lossless formats
    here, so that the upright picture sent as such is the same pixels."""
    media = "image/png" if fmt == "PNG" else "image/webp"
    stored = noise(5, (84, 56))
    for orientation, upright in ((6, stored.transpose(Image.Transpose.ROTATE_270)),
                                 (3, stored.transpose(Image.Transpose.ROTATE_180)),
                                 (2, stored.transpose(Image.Transpose.FLIP_LEFT_RIGHT))):
        turned = answer(srv, with_orientation(stored, fmt, orientation), media)
        assert turned == answer(srv, encoded(upright)), orientation
        assert turned != answer(srv, encoded(stored)), orientation
    assert answer(srv, with_orientation(stored, fmt, 1), media) == answer(srv, encoded(stored))


# -- a model that cannot see -------------------------------------------------------------


def _tool_turns(dialect: str) -> tuple[str, dict[str, Any]]:
    """A conversation whose image is in a tool's result, in ``dialect``'s shape."""
    png = b64(encoded(noise(6, (16, 16))))
    if dialect == "chat":
        return CHAT, {"model": "demo", "max_tokens": 2, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "look"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shot",
                                                              "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "text", "text": "here"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}]}
    if dialect == "messages":
        return "/v1/messages", {"model": "demo", "max_tokens": 2, "system": "s", "messages": [
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "here"}, {
                                              "type": "image", "source": {
                                                  "type": "base64", "media_type": "image/png",
                                                  "data": png}}]}]}]}
    return "/v1/responses", {"model": "demo", "instructions": "s", "input": [
        {"role": "user", "content": "look"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "here"},
            {"type": "input_image", "image_url": f"data:image/png;base64,{png}"}]}]}


@pytest.mark.parametrize(("dialect", "named"), [
    ("chat", "messages[3].content[1].image_url"),
    ("messages", "messages[2].content[0].content[1].source"),
    ("responses", "input[2].output[1].image_url"),
])
def test_a_text_model_names_the_image_it_cannot_take(srv: ServerProcess, dialect: str,
                                                     named: str) -> None:
    """An image in a tool's result, for the text-only demo: the refusal names that image
    as the body did. It named afmd's message (``messages[3].content``), which Anthropic's
    and Responses' bodies do not number the same way, so they said only ``messages`` and
    ``input``."""
    path, body = _tool_turns(dialect)
    r = post(srv, body, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if dialect == "messages":
        assert error["message"].startswith(f"{named}: "), error
    else:
        assert (error["code"], error["param"]) == ("image_input_not_supported", named)


# -- base64 as clients write it ----------------------------------------------------------


def test_ollama_takes_base64_wrapped_in_lines_as_ollama_does(srv: ServerProcess) -> None:
    """``base64 picture.png`` writes 76 columns a line, and Go's base64 decoder, which
    reads Ollama's ``images``, skips line breaks: Ollama answers such an image, afmd said
    it was not base64. Other characters are still refused, naming the image."""
    encoded_png = b64(encoded(noise(7)))
    wrapped = "\n".join(encoded_png[i:i + 76] for i in range(0, len(encoded_png), 76)) + "\n"

    def chat(image: str) -> httpx.Response:
        return post(srv, {"model": MODEL, "stream": False,
                          "options": {"temperature": 0, "num_predict": 8},
                          "messages": [{"role": "user", "content": "What?", "images": [image]}]},
                    "/api/chat")

    plain = chat(encoded_png)
    assert plain.status_code == 200, plain.text
    for image in (wrapped, wrapped.replace("\n", "\r\n")):
        r = chat(image)
        assert r.status_code == 200, r.text
        assert r.json()["message"]["content"] == plain.json()["message"]["content"]
    generated = post(srv, {"model": MODEL, "stream": False, "prompt": "What?",
                           "images": [wrapped], "options": {"num_predict": 1}}, "/api/generate")
    assert generated.status_code == 200, generated.text
    for bad in (encoded_png[:40] + " " + encoded_png[40:], encoded_png.rstrip("=") + "\t"):
        r = chat(bad)
        assert r.status_code == 400
        assert r.json()["error"].startswith("'messages[0].images[0]' is not base64")
    # A data: URL that is not base64 is named as such (it was said to be empty).
    r = chat("data:image/png,abcd")
    assert r.status_code == 400
    assert r.json()["error"].startswith(
        "'messages[0].images[0]' is a data: URL without a base64 payload")


def test_a_16_bit_grey_png_is_its_picture_not_white(srv: ServerProcess) -> None:
    """A 16-bit greyscale PNG (a scan, a depth map, a scientific plot) is read by its high
    bytes, as a 16-bit colour PNG is: Pillow's conversion to RGB clips each value to 255,
    so all but the darkest 1/256 of its range reached the model as white."""
    rng = np.random.default_rng(8)
    wide = rng.integers(0, 65536, (56, 84), dtype=np.uint16)
    sixteen = encoded(Image.fromarray(wide))
    assert Image.open(io.BytesIO(sixteen)).mode.startswith("I")
    eight = encoded(Image.fromarray((wide >> 8).astype(np.uint8), "L"))
    assert answer(srv, sixteen) == answer(srv, eight)
    white = encoded(Image.new("L", (84, 56), 255))
    assert answer(srv, sixteen) != answer(srv, white)
