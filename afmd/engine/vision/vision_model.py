"""Vision models: loaded through mlx-vlm, prompted with images, generated one at a time.

mlx-lm serves text only; a vision model's images go through its own processor (resizing,
patching) and vision tower, whose features replace the image placeholder tokens of the
prompt. This module, its generation thread (:mod:`afmd.engine.vision.vision_thread`) and the
vision branch of loading (:mod:`afmd.engine.models.loading`) are the only ones that import
mlx-vlm, and only when such a model loads, so text-only servers never pay for it.

What stays the same as for a text model: the tokenizer is loaded by mlx-lm (so the tool
call format, thinking markers and streaming detokenizer are detected exactly as for a
text model), the chat template renders the prompt, and the engine emits the same
:class:`~afmd.engine.generation.Text` / :class:`~afmd.engine.generation.Finished` events through the
same :class:`~afmd.engine.generation.Generation` handle, so output parsing, grammars, cancel,
deadlines and profiles work unchanged.

What differs: a vision model decodes one sequence at a time on its own thread, in
arrival order, instead of joining mlx-lm's continuous batch. Text models keep their own
threads and batches, so a vision request never blocks them; they share only the
machine's compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from afmd.core.request import ImageInput
from afmd.errors import InvalidRequestError
from afmd.service import images as image_decoding
from afmd.service.chat_template import continuation_kwargs

#: Processor outputs that are the prompt itself rather than inputs of the vision side.
_TEXT_KEYS = ("input_ids", "attention_mask")


class VisionSupport:
    """A loaded vision model's prompt side: chat template, images, processor."""

    def __init__(self, model: Any, processor: Any, tokenizer: Any, max_pixels: int) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = tokenizer  # mlx-lm's wrapper around the same tokenizer
        self.max_pixels = max_pixels

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        decoded: dict[int, Any] | None = None,
        headers: image_decoding.Headers | None = None,
        continue_final: bool = False,
    ) -> tuple[list[int], dict[str, Any] | None]:
        """Prompt ids (image placeholders expanded to the image's tokens) and the vision
        inputs to generate with (None: no image in the prompt).

        ``messages`` are chat-template messages whose content may be a list of parts;
        an image part carries its :class:`ImageInput` under ``image``. ``decoded``
        keeps decoded pictures across the renders of one request (trimming renders
        several times). ``headers``: the pictures as opened for the request's pixel total,
        decoded from instead of opened again. ``continue_final``: as
        :meth:`~afmd.engine.models.loaded_model.LoadedModel.render_prompt`'s.
        """
        from mlx_vlm.utils import prepare_inputs

        pictures: list[Any] = []
        sent: list[ImageInput] = []
        plain: list[dict[str, Any]] = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        sent.append(part["image"])
                        pictures.append(self._picture(part["image"], decoded, headers))
                        parts.append({"type": "image"})
                    else:
                        parts.append(part)
                message = {**message, "content": parts}
            plain.append(dict(message))
        kwargs = {**(template_kwargs or {}), **continuation_kwargs(continue_final)}
        if tools:
            kwargs["tools"] = list(tools)
        text = self.tokenizer.apply_chat_template(plain, tokenize=False, **kwargs)
        if not pictures:
            return list(self.tokenizer.encode(text, add_special_tokens=False)), None
        try:
            inputs = prepare_inputs(
                self.processor,
                images=pictures,
                prompts=[text],
                image_token_index=getattr(self.model.config, "image_token_index", None),
                add_special_tokens=False,
            )
        except ValueError as exc:
            raise self._refused(exc, pictures, sent) from None
        ids = [int(t) for t in np.array(inputs["input_ids"]).reshape(-1)]
        vision = {k: v for k, v in inputs.items() if k not in _TEXT_KEYS and v is not None}
        return ids, vision

    def _refused(self, exc: ValueError, pictures: list[Any],
                 sent: list[ImageInput]) -> InvalidRequestError:
        """The client's error for a picture the model's processor will not take (a shape
        outside what it resizes, as an aspect ratio over Qwen2-VL's 200), naming the
        image: the one sent, or the first its image processor refuses alone."""
        reason = str(exc).removeprefix("Failed to process inputs with error: ")
        culprit = sent[0] if len(sent) == 1 else next(
            (image for picture, image in zip(pictures, sent, strict=True)
             if self._refuses(picture)), None)
        return InvalidRequestError(
            f"The model's image processor cannot take this image: {reason}",
            code="invalid_image",
            param=culprit.param if culprit is not None else "messages",
        )

    def _refuses(self, picture: Any) -> bool:
        try:
            self.processor.image_processor(images=[picture])
        except Exception:  # whatever it raises, this picture is the one it will not take
            return True
        return False

    def _picture(self, image: ImageInput, decoded: dict[int, Any] | None,
                 headers: image_decoding.Headers | None) -> Any:
        if decoded is not None and id(image) in decoded:
            return decoded[id(image)]
        picture = image_decoding.decode(image, self.max_pixels,
                                        headers.take(image) if headers is not None else None)
        if decoded is not None:
            decoded[id(image)] = picture
        return picture
