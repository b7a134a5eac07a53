"""Which models exist, which are loaded, and the handle the pipeline uses for each.

Loading is slow (seconds to minutes) and may fail (a Hugging Face id with no network), so
the registry loads off the event loop, remembers the outcome per model, and lets
``/health`` report it truthfully while requests for a model that is still loading get a
clear 503 instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from afmd.config import BUILTIN_DEMO_PATH, Config, ModelEntry
from afmd.engine import kinds
from afmd.engine.base import Generation, GenerationRequest
from afmd.engine.kinds import BUILTIN_PREFIX, CHAT, EMBEDDING, EmbeddingSpec
from afmd.errors import (
    InvalidRequestError,
    NotFoundError,
    ServerError,
    ServiceUnavailableError,
)
from afmd.output.processor import ToolFormat

if TYPE_CHECKING:
    # The worker imports mlx-lm and with it transformers (~45 MB resident): only a model
    # load may pay for that, not a server that has none (or has not loaded one yet).
    from afmd.engine.embedding import Embedder
    from afmd.engine.worker import BatchWorker

log = logging.getLogger("afmd.engine")

_LOAD_WAIT_S = 1.0
DEFAULT_CONTEXT_LENGTH = 4096


def _rfind(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n, -1, -1):
        if haystack[i: i + n] == needle:
            return i
    return -1


def _context_length_from(config: Mapping[str, Any]) -> int | None:
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
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
    worker: BatchWorker | None  # a chat model's
    is_demo: bool = False
    weights_bytes: int = 0
    kind: str = CHAT
    embedder: Embedder | None = None  # an embedding model's
    #: When a request last got or released the model (Unix time, as /health reports it).
    last_used: float = field(default_factory=time.time)

    def touch(self) -> None:
        self.last_used = time.time()

    @property
    def id(self) -> str:
        return self.entry.id

    @property
    def embedding(self) -> EmbeddingSpec:
        assert self.embedder is not None, f"{self.id} is not an embedding model"
        return self.embedder.spec

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
        hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        ids = hf(texts, add_special_tokens=True, return_attention_mask=False)["input_ids"]
        return [list(row) for row in ids]

    @property
    def vocab_size(self) -> int:
        args = getattr(self.model, "args", None)
        size = getattr(args, "vocab_size", None)
        return int(size) if size else len(self.tokenizer.get_vocab())

    @property
    def eos_ids(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)

    @property
    def supports_vision(self) -> bool:
        return False  # mlx-lm serves text models; vision needs mlx-vlm

    @property
    def thinking(self) -> tuple[str, str] | None:
        """The model's thinking markers, when its tokenizer has them."""
        tok = self.tokenizer
        if not getattr(tok, "has_thinking", False) or not tok.think_end:
            return None
        return tok.think_start, tok.think_end

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
    def think_ids(self) -> tuple[int, int] | None:
        tok = self.tokenizer
        if self.thinking is None:
            return None
        start, end = tok.think_start_tokens, tok.think_end_tokens
        if start and end and len(start) == 1 and len(end) == 1:
            return start[0], end[0]
        return None

    @property
    def tool_format(self) -> ToolFormat | None:
        """How this model family writes tool calls (mlx-lm's detection), if it can."""
        tok = self.tokenizer
        parser = getattr(tok, "tool_parser", None)
        if not getattr(tok, "has_tool_calling", False) or parser is None:
            return None
        module = getattr(parser, "__module__", "")
        return ToolFormat(
            start=tok.tool_call_start,
            end=tok.tool_call_end,
            parse=parser,
            incremental_json=module.endswith(".json_tools"),
        )

    def single_token(self, text: str) -> int | None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def render_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids through the model's own chat template."""
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = list(tools)
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False, **kwargs
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def start(self, request: GenerationRequest) -> Generation:
        assert self.worker is not None, f"{self.id} is not a chat model"
        generation = Generation(request, asyncio.get_running_loop())
        self.worker.submit(generation)
        return generation

    def cancel(self, generation: Generation) -> None:
        generation.cancel()
        if self.worker is not None:
            self.worker.wake()


def _load_sync(entry: ModelEntry, config: Config) -> LoadedModel:
    # Fail before the heavy imports: mlx-lm drags in transformers (~45 MB resident, a second
    # or two), which a server whose model folder is missing would otherwise carry forever.
    if kinds.missing_local_path(entry.path):
        raise FileNotFoundError(f"'{entry.path}' does not exist")

    # Heavy imports stay here so `afmd --help`, `check-config` and a server that has not
    # loaded a model yet start fast and small; PyInstaller still sees them statically.
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load as mlx_load

    from afmd.engine import demo
    from afmd.engine.embedding import Embedder
    from afmd.engine.layout import relayout_for_cpu
    from afmd.engine.memory import apply_memory_bounds
    from afmd.engine.worker import BatchWorker

    apply_memory_bounds(config.cache.mlx_buffer_cache_bytes)

    is_demo = entry.path.startswith(BUILTIN_PREFIX)
    if is_demo:
        variant = entry.path[len(BUILTIN_PREFIX):]
        folder: Path | None = demo.materialize(variant)
        source = str(folder)
    else:
        candidate = Path(entry.path).expanduser()
        folder = candidate if candidate.exists() else None
        source = str(candidate) if folder else entry.path
    model, tokenizer, model_config = mlx_load(source, return_config=True)
    # A repo's files are on disk now: its folder can say what kind of model it is.
    kind, spec = kinds.resolve(entry, folder or kinds.model_folder(entry.path), model_config)
    if kind == CHAT:
        relayout_for_cpu(model)  # an embedding model never runs its output projection
    # Loading and re-laying out weights freed buffers a serving process never reuses.
    mx.clear_cache()
    context_length = (
        entry.context_length or _context_length_from(model_config) or DEFAULT_CONTEXT_LENGTH
    )
    worker: BatchWorker | None = None
    embedder: Embedder | None = None
    if spec is not None:
        embedder = Embedder(model, spec, name=entry.id)
        embedder.start()
    else:
        worker = BatchWorker(
            model,
            tokenizer,
            name=entry.id,
            max_batch=config.queue.max_concurrent_requests,
            prompt_cache_bytes=config.cache.prompt_cache_bytes,
            prompt_cache_entries=config.cache.prompt_cache_entries,
        )
        worker.start()
    return LoadedModel(
        entry=entry,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        context_length=context_length,
        worker=worker,
        is_demo=is_demo,
        weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        kind=kind,
        embedder=embedder,
    )


@dataclass(slots=True)
class LoadCounts:
    """Per model id since the server started: completed loads, failed ones, unloads and
    seconds spent in completed loads (``/metrics`` reads them; they outlive an unload)."""

    loads: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    unloads: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=dict)

    def loaded(self, model_id: str, seconds: float) -> None:
        self.loads[model_id] += 1
        self.seconds[model_id] = self.seconds.get(model_id, 0.0) + seconds

    def unloaded(self, model_id: str) -> None:
        self.unloads[model_id] += 1


class ModelRegistry:
    """Resolves names to configured models and loads them on demand, once."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}
        self._failed: dict[str, str] = {}
        self._kinds: dict[str, str] = {}  # read from disk once per model until it loads
        self.counts = LoadCounts()

    @property
    def config(self) -> Config:
        return self._config

    def resolve(self, name: str | None) -> ModelEntry:
        entry = self._config.resolve_model(name)
        if entry is None:
            raise NotFoundError(
                f"The model '{name}' does not exist. Available models: "
                + ", ".join(self.listed_ids())
                + ".",
                code="model_not_found",
                param="model",
            )
        return entry

    def kind_of(self, entry: ModelEntry) -> str:
        """``chat`` or ``embedding``: the loaded model's, else what its folder says."""
        loaded = self._loaded.get(entry.id)
        if loaded is not None:
            return loaded.kind
        kind = self._kinds.get(entry.id)
        if kind is None:
            kind = self._kinds[entry.id] = kinds.declared_kind(entry)
        return kind

    def default_for(self, kind: str) -> ModelEntry | None:
        """The model a request of ``kind`` that names none gets: the default model when it
        is of that kind, else the first configured one that is."""
        default = self._config.resolve_model(None)
        if default is not None and self.kind_of(default) == kind:
            return default
        return next((e for e in self._config.models.model if self.kind_of(e) == kind), None)

    def check_kind(self, entry: ModelEntry, kind: str, actual: str | None = None) -> None:
        """400 ``invalid_model_kind`` unless ``entry`` serves ``kind``."""
        actual = actual or self.kind_of(entry)
        if actual == kind:
            return
        serves = "/v1/embeddings" if actual == EMBEDDING else "chat and completions"
        wanted = "embeddings" if kind == EMBEDDING else "chat or completions"
        raise InvalidRequestError(
            f"The model '{entry.id}' is {_article(actual)} {actual} model: it serves "
            f"{serves}, not {wanted}. Use {_article(kind)} {kind} model.",
            code="invalid_model_kind",
            param="model",
        )

    def listed_ids(self) -> list[str]:
        return [*self._config.model_ids(), *self._config.models.aliases]

    def status(self) -> dict[str, str]:
        """Per model: ``available``, or ``unavailable: <reason>``."""
        result: dict[str, str] = {}
        for entry in self._config.models.model:
            if entry.id in self._loaded:
                result[entry.id] = "available"
            elif entry.id in self._failed:
                result[entry.id] = f"unavailable: {self._failed[entry.id]}"
            elif entry.id in self._loading:
                result[entry.id] = "unavailable: loading"
            else:
                result[entry.id] = "available"  # loads on first use
        return result

    def loaded(self, model_id: str) -> LoadedModel | None:
        return self._loaded.get(model_id)

    def is_ready(self, model_id: str) -> bool:
        return model_id in self._loaded

    def is_loading(self, model_id: str) -> bool:
        return model_id in self._loading

    def failure(self, model_id: str) -> str | None:
        return self._failed.get(model_id)

    def begin_load(self, entry: ModelEntry) -> asyncio.Task[LoadedModel]:
        task = self._loading.get(entry.id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(entry))
            self._loading[entry.id] = task
        return task

    async def _load(self, entry: ModelEntry) -> LoadedModel:
        started = time.perf_counter()
        try:
            loaded = await asyncio.to_thread(_load_sync, entry, self._config)
        except Exception as exc:
            reason = kinds.describe_load_failure(entry, exc)
            self._failed[entry.id] = reason
            self.counts.failures[entry.id] += 1
            log.error("model load failed: %s", reason)
            raise ServerError(
                f"The model '{entry.id}' could not be loaded: {reason}",
                code="model_load_failed",
                param="model",
            ) from None
        finally:
            self._loading.pop(entry.id, None)
        self._failed.pop(entry.id, None)
        self._loaded[entry.id] = loaded
        self._kinds.pop(entry.id, None)
        self.counts.loaded(entry.id, time.perf_counter() - started)
        return loaded

    async def get(self, entry: ModelEntry, kind: str = CHAT) -> LoadedModel:
        """The loaded model, if it serves ``kind`` (else 400 ``invalid_model_kind``); while
        it loads, 503 ``busy`` with ``Retry-After``.

        Loading can take minutes (a download on first use), far longer than a client
        should hold a request open; the first request starts the load. A model of the
        wrong kind is refused before that when its folder already says what it is.
        """
        loaded = self._loaded.get(entry.id)
        if loaded is not None:
            self.check_kind(entry, kind, loaded.kind)
            loaded.touch()
            return loaded
        self.check_kind(entry, kind)
        if entry.id in self._failed and entry.id not in self._loading:
            # Try again: a failure may have been transient (disk, memory, network).
            reason = self._failed.pop(entry.id)
            log.info("retrying model load after failure: %s", reason)
        task = self.begin_load(entry)
        try:
            # A small model (the demo) is ready within moments: spare the client a retry.
            loaded = await asyncio.wait_for(asyncio.shield(task), timeout=_LOAD_WAIT_S)
        except TimeoutError:
            raise ServiceUnavailableError(
                f"The model '{entry.id}' is loading; retry shortly.",
                code="busy",
                headers={"Retry-After": "2"},
            ) from None
        self.check_kind(entry, kind, loaded.kind)  # a download may have told us more
        return loaded

    def close(self) -> None:
        for loaded in self._loaded.values():
            if loaded.worker is not None:
                loaded.worker.stop()
            if loaded.embedder is not None:
                loaded.embedder.stop()
        for task in self._loading.values():
            task.cancel()


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


__all__ = ["BUILTIN_DEMO_PATH", "LoadedModel", "ModelRegistry"]
