"""A model in memory: the handle the pipeline renders prompts, tokenizes and generates with.

Kept apart from loading (:mod:`afmd.engine.models.loading`) and the registry
(:mod:`afmd.engine.models.model_registry`) so the modules above the engine can name the handle
without pulling in either; the workers it drives stay type-only imports, since importing them
imports mlx-lm.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from afmd.config.tables import ModelEntry
from afmd.engine.generation import Generation, GenerationRequest
from afmd.engine.models.kinds import CHAT, EmbeddingSpec
from afmd.engine.models.prompt_bound import encode_prompt
from afmd.output.processor import ToolFormat
from afmd.service.chat_template import continuation_kwargs, folded_system_turns

if TYPE_CHECKING:
    # Apple's model's worker (afmd.engine.apple): its SDK only on a generation.
    from afmd.engine.apple.worker import SystemWorker
    from afmd.engine.batch.generation_thread import BatchWorker

    # The worker imports mlx-lm and with it transformers (~45 MB resident): only a model
    # load may pay for that, not a server that has none (or has not loaded one yet).
    from afmd.engine.embedding_thread import Embedder
    from afmd.engine.kvcache.blocks import BlockCache
    from afmd.engine.sharded.sharding import Shard
    from afmd.engine.vision.vision_model import VisionSupport
    from afmd.engine.vision.vision_thread import VisionWorker

DEFAULT_CONTEXT_LENGTH = 4096


class Cancellable(Protocol):
    """A generation, or a Completions run's generations as one: what a model's worker can
    be told to drop."""

    def cancel(self) -> None: ...


def _rfind(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n, -1, -1):
        if haystack[i: i + n] == needle:
            return i
    return -1


def thinking_of(tokenizer: Any) -> tuple[str, str] | None:
    """The thinking markers mlx-lm found in a tokenizer (None: it found none). A function
    of the tokenizer alone, so that a folder described without loading its weights
    (``/api/show``) says what the loaded model will do."""
    if not getattr(tokenizer, "has_thinking", False) or not tokenizer.think_end:
        return None
    return tokenizer.think_start, tokenizer.think_end


def tool_format_of(tokenizer: Any) -> ToolFormat | None:
    """The call format mlx-lm found in a tokenizer (None: it found none), as
    :func:`thinking_of` for calls."""
    parser = getattr(tokenizer, "tool_parser", None)
    if not getattr(tokenizer, "has_tool_calling", False) or parser is None:
        return None
    module = getattr(parser, "__module__", "")
    return ToolFormat(
        start=tokenizer.tool_call_start,
        end=tokenizer.tool_call_end,
        parse=parser,
        incremental_json=module.endswith(".json_tools"),
    )


def context_length_from(config: Mapping[str, Any]) -> int | None:
    """The context window a model's config.json declares, under whichever of the names
    model families use for it (a multimodal model's under ``text_config``)."""
    text_config = config.get("text_config")
    for source in (config, text_config if isinstance(text_config, Mapping) else {}):
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            value = source.get(key)
            if type(value) is int and value > 0:
                return value
    return None

@dataclass(slots=True)
class LoadedModel:
    """A model in memory with its tokenizer and its thread: generation or embedding."""

    entry: ModelEntry
    folder: Path | None
    model: Any
    tokenizer: Any
    context_length: int
    worker: BatchWorker | VisionWorker | SystemWorker | None  # a chat model's
    is_demo: bool = False
    weights_bytes: int = 0
    kind: str = CHAT
    embedder: Embedder | None = None  # an embedding model's
    #: When a request last got or released the model (Unix time, as /health reports it).
    last_used: float = field(default_factory=time.time)
    vision: VisionSupport | None = None  # a vision model's prompt side (mlx-vlm)
    #: This rank's part of a model sharded over a launched group (kept loaded for good:
    #: the other ranks hold the rest and cannot load it again alone).
    shard: Shard | None = None
    #: Apple's on-device model (afmd.engine.apple): it reads the conversation itself
    #: (``GenerationRequest.conversation``), has no tokenizer here and no weights in afmd.
    reads_conversation: bool = False

    def touch(self) -> None:
        self.last_used = time.time()

    @property
    def id(self) -> str:
        return self.entry.id

    @property
    def memory_bytes(self) -> int:
        """Measured: the weights, the prefix cache's KV state and the running batch's."""
        worker = self.worker
        if worker is None:
            return self.weights_bytes
        return self.weights_bytes + worker.cache_bytes + worker.live_cache_bytes

    @property
    def kv_cache(self) -> BlockCache | None:
        """The block KV cache of a chat model that has one (a vision model's, Apple's, or
        one whose cache does not cut into blocks, has none)."""
        return getattr(self.worker, "blocks", None)

    def kv_cache_bytes(self) -> dict[str, int] | None:
        """The block KV cache's bytes per tier (``None``: no block cache)."""
        cache = self.kv_cache
        if cache is None:
            return None
        return {"ram": cache.ram.nbytes,
                "disk": cache.disk.nbytes if cache.disk is not None else 0}

    def kv_disk_writing(self) -> bool | None:
        """Whether the block KV cache's disk tier writes (False: paused after a full
        disk, or stopped; None: no disk tier)."""
        cache = self.kv_cache
        if cache is None or cache.disk is None:
            return None
        return cache.disk.store.writing

    @property
    def embedding(self) -> EmbeddingSpec:
        assert self.embedder is not None, f"{self.id} is not an embedding model"
        return self.embedder.encoder.spec

    @property
    def hidden_size(self) -> int:
        """The width of the model's hidden states: an embedding's full dimensions."""
        args = getattr(self.model, "args", None)
        size = getattr(args, "hidden_size", None)
        if size is None:
            size = self.model.model.embed_tokens.weight.shape[-1]
        return int(size)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text as the model's tokenizer makes them, its special tokens added
        (an embedding model's tokenizer may append the token its pooling reads)."""
        from afmd.engine.mlx_compat import hf_tokenizer

        hf = hf_tokenizer(self.tokenizer)
        ids = hf(texts, add_special_tokens=True, return_attention_mask=False)["input_ids"]
        return [list(row) for row in ids]

    def appended_ids(self) -> list[int]:
        """What :meth:`tokenize` puts after any text (an embedding model's end-of-text,
        the token last-token pooling reads): an input cut to the context keeps it, as a
        text cut before it is encoded (Ollama's ``truncate``) gets it again."""
        from afmd.engine.mlx_compat import hf_tokenizer

        hf = hf_tokenizer(self.tokenizer)
        plain = list(hf("a", add_special_tokens=False)["input_ids"])
        full = list(hf("a", add_special_tokens=True)["input_ids"])
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[start + len(plain):]
        return []

    @property
    def vocab_size(self) -> int:
        args = getattr(self.model, "args", None)
        size = getattr(args, "vocab_size", None)
        return int(size) if size else len(self.tokenizer.get_vocab())

    @property
    def eos_ids(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)

    @property
    def bos_id(self) -> int | None:
        """The beginning-of-sequence token a chat template opens with, if the tokenizer
        has one (a prompt continued from earlier ids keeps only the first)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if isinstance(bos, int) else None

    @property
    def supports_vision(self) -> bool:
        return self.vision is not None or self.reads_conversation

    @property
    def thinking(self) -> tuple[str, str] | None:
        """The model's thinking markers, when its tokenizer has them."""
        return thinking_of(self.tokenizer)

    def prompt_opens_thinking(self, prompt: list[int]) -> bool:
        """Whether the chat template left a thinking block open at the end of the prompt."""
        tok = self.tokenizer
        start = getattr(tok, "think_start_tokens", None)
        end = getattr(tok, "think_end_tokens", None)
        if not start or not end:
            return False
        tail = prompt[-32:]  # templates open the block in the generation prompt itself
        return _rfind(tail, list(start)) > _rfind(tail, list(end))

    @property
    def tool_format(self) -> ToolFormat | None:
        """How this model family writes tool calls (mlx-lm's detection), if it can."""
        return tool_format_of(self.tokenizer)

    def single_token(self, text: str) -> int | None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def render_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        continue_final: bool = False,
        bound: int | None = None,
    ) -> list[int]:
        """Prompt token ids through the model's own chat template. A template that refuses
        a system turn after the first message (many raise on it) gets those folded into
        the nearest user turn instead (:func:`afmd.service.chat_template.folded_system_turns`).
        ``continue_final``: the last message is an assistant's text the answer continues,
        so the prompt ends inside it, without the end of its turn or a new one. ``bound``:
        the window the prompt must fit, past which a far longer prompt is
        :class:`~afmd.engine.models.prompt_bound.PromptTooLong` before it is encoded whole."""
        kwargs = {**(template_kwargs or {}), **continuation_kwargs(continue_final)}
        if tools:
            kwargs["tools"] = list(tools)
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)
        except Exception:
            folded = folded_system_turns(messages)
            if folded is None:
                raise
            text = self.tokenizer.apply_chat_template(folded, tokenize=False, **kwargs)
        return encode_prompt(self.tokenizer, text, bound)

    def start(self, request: GenerationRequest) -> Generation:
        assert self.worker is not None, f"{self.id} is not a chat model"
        generation = Generation(request, asyncio.get_running_loop())
        self.worker.submit(generation)
        return generation

    def cancel(self, generation: Cancellable) -> None:
        """Stop ``generation`` (or a run's several, as one) and wake the worker to drop it."""
        generation.cancel()
        if self.worker is not None:
            self.worker.wake()


__all__ = ["DEFAULT_CONTEXT_LENGTH", "LoadedModel", "context_length_from", "thinking_of",
           "tool_format_of"]
