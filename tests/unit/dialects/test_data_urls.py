"""Image data URLs in Chat and Responses bodies, as RFC 2397 writes them: a media type in
any case, parameters before ``;base64``; still only base64 payloads of image types."""

from __future__ import annotations

from typing import Any

import pytest

from afmd.core.request import ChatRequest
from afmd.dialects.openai.chat_body import parse_chat_request
from afmd.dialects.responses.responses_body import parse_responses_request
from afmd.errors import InvalidRequestError

PAYLOAD = "iVBORw0KGgo="  # a PNG signature
SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHAT_PARAM = "messages[0].content[1].image_url.url"
RESPONSES_PARAM = "input[0].content[1].image_url"


def chat(url: str) -> ChatRequest:
    return parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": url}}]}]})


def responses(url: str) -> ChatRequest:
    return parse_responses_request({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": url}]}]},
        lookup=lambda _: None)


PARSERS = [(chat, CHAT_PARAM), (responses, RESPONSES_PARAM)]


@pytest.mark.parametrize("prefix", [
    "data:image/png;base64,",
    "data:IMAGE/PNG;base64,",
    "data:Image/Png;BASE64,",
    "DATA:image/png;base64,",
    "data:image/png;charset=utf-8;base64,",
    "data:image/png;name=x.png;base64,",
    "data:image/svg+xml;name=\"a b\";charset=US-ASCII;base64,",
])
@pytest.mark.parametrize(("parse", "param"), PARSERS, ids=["chat", "responses"])
def test_rfc_2397_image_data_urls_are_read(parse: Any, param: str, prefix: str) -> None:
    request = parse(prefix + PAYLOAD)
    (image,) = request.messages[0].images
    assert image.data == SIGNATURE


@pytest.mark.parametrize("url", [
    "data:image/png," + PAYLOAD,  # not base64
    "data:image/png;charset=utf-8," + PAYLOAD,
    "data:text/plain;base64," + PAYLOAD,  # not an image
    "data:TEXT/PLAIN;charset=utf-8;base64," + PAYLOAD,
    "data:;base64," + PAYLOAD,  # no media type
    "data:image/;base64," + PAYLOAD,
    "data:image/png;charset;base64," + PAYLOAD,  # a parameter without a value
    "data:image/png;base64;base64," + PAYLOAD,
    "data:image/png;base64,@@@",
])
@pytest.mark.parametrize(("parse", "param"), PARSERS, ids=["chat", "responses"])
def test_other_data_urls_are_still_refused(parse: Any, param: str, url: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse(url)
    assert (info.value.code, info.value.param, info.value.status) == (
        "invalid_image_url", param, 400), repr(info.value)
