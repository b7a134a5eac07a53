"""Vision models: loaded through mlx-vlm, prompted with images, generated one at a time.

mlx-lm serves text only; a vision model's images go through its own processor (resizing,
patching) and vision tower, whose features replace the image placeholder tokens of the
prompt. This module is the only one that imports mlx-vlm, and only when such a model
loads, so text-only servers never pay for it.

What stays the same as for a text model: the tokenizer is loaded by mlx-lm (so the tool
call format, thinking markers and streaming detokenizer are detected exactly as for a
text model), the chat template renders the prompt, and the engine emits the same
:class:`~afmd.engine.base.Text` / :class:`~afmd.engine.base.Finished` events through the
same :class:`~afmd.engine.base.Generation` handle, so output parsing, grammars, cancel,
deadlines and profiles work unchanged.

What differs: a vision model decodes one sequence at a time on its own thread (mlx-vlm's
``generate_step``), in arrival order, instead of joining mlx-lm's continuous batch: an
image prompt's multimodal rotary positions and vision features do not fit that batch.
A request waiting for its turn can be cancelled while it waits. Text models keep their
own threads and batches, so a vision request never blocks them; they share only the
machine's compute.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from afmd import images as image_decoding
from afmd.core.request import ImageInput
from afmd.engine.base import (
    Event,
    Finished,
    Generation,
    PromptLogprobs,
    Text,
    TokenLogprob,
)
from afmd.engine.detokenize import ExactDetokenizer
from afmd.errors import InvalidRequestError, ServerError

if TYPE_CHECKING:
    from afmd.config import Config, ModelEntry
    from afmd.engine.models import LoadedModel

log = logging.getLogger("afmd.engine")

_WAKE = object()
_STOP = object()
_FLUSH_INTERVAL_S = 0.008

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
    ) -> tuple[list[int], dict[str, Any] | None]:
        """Prompt ids (image placeholders expanded to the image's tokens) and the vision
        inputs to generate with (None: no image in the prompt).

        ``messages`` are chat-template messages whose content may be a list of parts;
        an image part carries its :class:`ImageInput` under ``image``. ``decoded``
        keeps decoded pictures across the renders of one request (trimming renders
        several times).
        """
        from mlx_vlm.utils import prepare_inputs

        pictures: list[Any] = []
        plain: list[dict[str, Any]] = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        pictures.append(self._picture(part["image"], decoded))
                        parts.append({"type": "image"})
                    else:
                        parts.append(part)
                message = {**message, "content": parts}
            plain.append(dict(message))
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = list(tools)
        text = self.tokenizer.apply_chat_template(
            plain, add_generation_prompt=True, tokenize=False, **kwargs
        )
        if not pictures:
            return list(self.tokenizer.encode(text, add_special_tokens=False)), None
        inputs = prepare_inputs(
            self.processor,
            images=pictures,
            prompts=[text],
            image_token_index=getattr(self.model.config, "image_token_index", None),
            add_special_tokens=False,
        )
        ids = [int(t) for t in np.array(inputs["input_ids"]).reshape(-1)]
        vision = {k: v for k, v in inputs.items() if k not in _TEXT_KEYS and v is not None}
        return ids, vision

    def _picture(self, image: ImageInput, decoded: dict[int, Any] | None) -> Any:
        if decoded is not None and id(image) in decoded:
            return decoded[id(image)]
        picture = image_decoding.decode(image, self.max_pixels)
        if decoded is not None:
            decoded[id(image)] = picture
        return picture


def load(entry: ModelEntry, config: Config, source: str, is_demo: bool) -> LoadedModel:
    """Load a vision model with mlx-vlm and start its generation thread."""
    try:
        from mlx_vlm.utils import get_model_path
        from mlx_vlm.utils import load as vlm_load
    except ImportError:
        raise RuntimeError(
            "this is a vision model, and vision support is not installed: "
            "pip install 'afmd[vision]'"
        ) from None
    from mlx.utils import tree_flatten
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from afmd.engine.models import DEFAULT_CONTEXT_LENGTH, LoadedModel, _context_length_from

    folder = Path(get_model_path(source))
    model, processor = vlm_load(str(folder))
    model_config = model.config
    eos = getattr(model_config, "eos_token_id", None)
    tokenizer = load_tokenizer(folder, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    mx.clear_cache()
    raw = _config_json(folder)
    context_length = (
        entry.context_length or _context_length_from(raw) or DEFAULT_CONTEXT_LENGTH
    )
    worker = VisionWorker(model, tokenizer, name=entry.id)
    worker.start()
    return LoadedModel(
        entry=entry,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        context_length=context_length,
        worker=worker,  # type: ignore[arg-type]  # the same interface as BatchWorker's
        is_demo=is_demo,
        weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        vision=VisionSupport(model, processor, tokenizer, config.models.max_image_pixels),
    )


def _config_json(folder: Path) -> dict[str, Any]:
    """The folder's config.json (its text side may sit under ``text_config``)."""
    import json

    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class VisionWorker:
    """Generates one request at a time for a vision model, on its own thread.

    Offers the pipeline what :class:`afmd.engine.worker.BatchWorker` does (``submit``,
    ``wake``, ``stop``, the KV bytes it holds), so a vision model is driven like any.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: list[Generation] = []
        self._cache: list[Any] | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"afmd-vision-{name}",
                                        daemon=True)
        self._started = False

    # -- event-loop side --
    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, generation: Generation) -> None:
        self._inbox.put(generation)

    def wake(self) -> None:
        self._inbox.put(_WAKE)

    def stop(self, timeout: float = 5.0) -> None:
        if self._started:
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    @property
    def cache_bytes(self) -> int:
        return 0  # no prefix cache: image prompts rarely share one

    @property
    def live_cache_bytes(self) -> int:
        cache = self._cache
        try:
            return sum(c.nbytes for c in cache) if cache else 0
        except Exception:  # swapped under the read: right next time
            return 0

    # -- thread side --
    def _run(self) -> None:
        while not self._stopping:
            self._drain(block=not self._waiting)
            self._reap_waiting()
            if self._waiting and not self._stopping:
                generation = self._waiting.pop(0)
                try:
                    self._generate(generation)
                except Exception:
                    log.exception("vision generation failed")
                    _fail(generation, ServerError("The model failed while generating.",
                                                  code="generation_failed"))
                finally:
                    self._cache = None
        error = ServerError("The server is shutting down.", code="shutting_down")
        self._drain(block=False)
        for generation in self._waiting:
            _fail(generation, error)

    def _drain(self, *, block: bool) -> None:
        items = [self._inbox.get()] if block else []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if item is _STOP:
                self._stopping = True
            elif isinstance(item, Generation):
                self._waiting.append(item)

    def _reap_waiting(self) -> None:
        """Requests cancelled while they waited end now, not when their turn comes."""
        for generation in [g for g in self._waiting if g.cancel_requested]:
            self._waiting.remove(generation)
            _push(generation, [_finished(generation, "cancelled", 0, 0, 0, time.perf_counter(),
                                         0.0)])

    def _generate(self, generation: Generation) -> None:
        from mlx_vlm.generate.ar import generate_step
        from mlx_vlm.models.cache import make_prompt_cache

        from afmd.engine.worker import make_sampler

        request = generation.request
        started = time.perf_counter()
        pending: list[Event] = []
        if request.prompt_logprobs is not None:
            pending.append(PromptLogprobs(self._prompt_logprobs(request.prompt,
                                                                request.prompt_logprobs)))
        if request.max_tokens <= 0:
            pending.append(_finished(generation, "length", 0, 0, 0, started, started))
            _push(generation, pending)
            return
        vision = dict(request.vision or {})
        pixel_values = vision.pop("pixel_values", None)
        language = self._model.language_model
        for attr in ("_position_ids", "_rope_deltas"):  # multimodal rotary state
            if hasattr(language, attr):
                setattr(language, attr, None)
        self._cache = make_prompt_cache(language)
        processors = list(request.logits_processors)
        if request.sampling.repetition_penalty:
            from mlx_lm.sample_utils import make_logits_processors

            processors.extend(make_logits_processors(
                repetition_penalty=request.sampling.repetition_penalty))
        sampler = make_sampler(request.sampling) or _argmax
        stop_ids = self._eos.union(request.stop_ids)
        detokenizer = (ExactDetokenizer(self._tokenizer) if request.verbatim
                       else self._tokenizer.detokenizer)
        think = request.think_ids
        in_reasoning = request.starts_in_reasoning
        completion = reasoning = 0
        first_token_at = 0.0
        last_flush = started
        reason = "length"
        steps = generate_step(
            mx.array([request.prompt]), self._model, pixel_values, None,
            max_tokens=request.max_tokens, sampler=sampler,
            logits_processors=processors or None, prompt_cache=self._cache, **vision,
        )
        try:
            for token, logprobs in steps:
                now = time.perf_counter()
                first_token_at = first_token_at or now
                if generation.cancel_requested:
                    reason = "cancelled"
                    break
                if token in stop_ids:
                    reason = "stop"
                    break
                completion += 1
                if think is not None:
                    in_reasoning = in_reasoning or token == think[0]
                    reasoning += in_reasoning
                    in_reasoning = in_reasoning and token != think[1]
                detokenizer.add_token(token)
                segment = detokenizer.last_segment
                if request.logprobs is not None:
                    pending.append(Text(segment, 1, (_logprob(logprobs, token,
                                                              request.logprobs),)))
                else:
                    _append_text(pending, segment)
                if completion == 1 or now - last_flush >= _FLUSH_INTERVAL_S:
                    _push(generation, pending)
                    pending = []
                    last_flush = now
                self._drain(block=False)
                self._reap_waiting()
                if self._stopping:
                    raise _Stopping
        except _Stopping:
            _fail(generation, ServerError("The server is shutting down.",
                                          code="shutting_down"))
            return
        finally:
            steps.close()
        detokenizer.finalize()
        if detokenizer.last_segment:
            pending.append(Text(detokenizer.last_segment, 0))
        pending.append(_finished(generation, reason, len(request.prompt), completion,
                                 reasoning, started, first_token_at))
        _push(generation, pending)

    def _prompt_logprobs(self, prompt: list[int], top: int) -> tuple[TokenLogprob, ...]:
        """The prompt's own tokens' log-probabilities (echo), text prompts only."""
        logits = self._model.language_model(mx.array([prompt])).logits[0].astype(mx.float32)
        rows = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        out = [TokenLogprob(prompt[0], None)]
        for i in range(1, len(prompt)):
            out.append(_entry(rows[i - 1], prompt[i], top))
        return tuple(out)


class _Stopping(Exception):
    """The server stops while a request is generating."""


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _append_text(pending: list[Event], segment: str) -> None:
    if segment:
        pending.append(Text(segment, 1))
    elif pending and isinstance(pending[-1], Text):
        pending[-1] = Text(pending[-1].text, pending[-1].tokens + 1)
    else:
        pending.append(Text("", 1))


def _entry(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        index = np.argpartition(-row, top)[:top]
        index = index[np.argsort(-row[index], kind="stable")]
        best = tuple((int(i), float(row[i])) for i in index)
    return TokenLogprob(token, float(row[token]), best)


def _logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    return _entry(np.array(logprobs.astype(mx.float32)).reshape(-1), token, top)


def _finished(generation: Generation, reason: str, prompt: int, completion: int,
              reasoning: int, started: float, first_token_at: float) -> Finished:
    now = time.perf_counter()
    return Finished(
        finish_reason=reason,
        prompt_tokens=prompt,
        completion_tokens=completion,
        reasoning_tokens=reasoning,
        timings={
            "queued_at": generation.created_at,
            "started_at": started,
            "first_token_at": first_token_at or now,
            "finished_at": now,
        },
        peak_memory_bytes=mx.get_peak_memory(),
    )


def _push(generation: Generation, events: list[Event]) -> None:
    if events:
        with contextlib.suppress(RuntimeError):  # that loop closed (shutdown, tests)
            generation._loop.call_soon_threadsafe(generation.push, events)


def _fail(generation: Generation, error: InvalidRequestError | ServerError) -> None:
    with contextlib.suppress(RuntimeError):
        generation._loop.call_soon_threadsafe(generation.fail, error)
