"""Which models exist, which are loaded, and the handle the pipeline uses for each.

Loading is slow (seconds to minutes) and may fail (a Hugging Face id with no network), so
the registry loads off the event loop, remembers the outcome per model, and lets
``/health`` report it truthfully. A request for a model that is not loaded starts its load
and waits for it within its deadline (then 503 ``busy``: it is still loading); which
models stay loaded, within the memory budget, is :mod:`afmd.engine.residency`'s.
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
from afmd.engine import budget, kinds
from afmd.engine.base import Generation, GenerationRequest
from afmd.engine.kinds import BUILTIN_PREFIX, CHAT, EMBEDDING, EmbeddingSpec
from afmd.engine.residency import Lease, Residency, Usage
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
    from afmd.engine.vision import VisionSupport
    from afmd.engine.vision_worker import VisionWorker
    from afmd.engine.worker import BatchWorker

log = logging.getLogger("afmd.engine")

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
    worker: BatchWorker | VisionWorker | None  # a chat model's
    is_demo: bool = False
    weights_bytes: int = 0
    kind: str = CHAT
    embedder: Embedder | None = None  # an embedding model's
    #: When a request last got or released the model (Unix time, as /health reports it).
    last_used: float = field(default_factory=time.time)
    vision: VisionSupport | None = None  # a vision model's prompt side (mlx-vlm)

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
        return self.vision is not None

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
    from afmd.engine.draft import load_draft
    from afmd.engine.embedding import Embedder
    from afmd.engine.layout import relayout_for_cpu
    from afmd.engine.memory import apply_memory_bounds
    from afmd.engine.worker import BatchWorker

    apply_memory_bounds(config.cache.mlx_buffer_cache_bytes)

    is_demo = entry.path.startswith(BUILTIN_PREFIX)
    if kinds.is_vision(entry, kinds.model_folder(entry.path)):
        from afmd.engine import vision

        variant = entry.path[len(BUILTIN_PREFIX):]
        local = demo.materialize(variant) if is_demo else Path(entry.path).expanduser()
        source = str(local) if local.exists() else entry.path
        return vision.load(entry, config, source, is_demo)
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
            prompt_lookup=config.engine.prompt_lookup,
            draft_model=load_draft(entry, config, tokenizer),
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
    """Resolves names to configured models and loads them on demand, one load at a time
    per model, within the memory budget."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}
        self._failed: dict[str, str] = {}
        self._kinds: dict[str, str] = {}  # read from disk once per model until it loads
        self.counts = LoadCounts()
        self.residency = Residency(
            budget.effective_budget(config.models.memory_budget_bytes),
            config.models.max_loaded,
            on_unload=self.counts.unloaded,
        )
        self._loaded = self.residency.loaded  # one dict: the residency adds and removes
        self._ever_loaded: set[str] = set()

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

    def was_loaded(self, model_id: str) -> bool:
        """Whether the model has been loaded since the server started (maybe unloaded
        since: it loads again on demand)."""
        return model_id in self._ever_loaded

    def begin_load(
        self, entry: ModelEntry, deadline: float | None = None, *, evict: bool = True
    ) -> asyncio.Task[LoadedModel]:
        """The model's load, started unless under way; it waits for room in the budget
        until ``deadline`` (default: ``request_timeout`` from now), unloading idle models
        for it unless ``evict`` is false."""
        task = self._loading.get(entry.id)
        if task is None:
            if deadline is None:
                deadline = time.monotonic() + self._config.server.request_timeout
            task = asyncio.get_running_loop().create_task(self._load(entry, deadline, evict))
            self._loading[entry.id] = task
        return task

    async def _load(self, entry: ModelEntry, deadline: float, evict: bool) -> LoadedModel:
        try:
            return await self._load_within_budget(entry, deadline, evict)
        finally:
            self._loading.pop(entry.id, None)

    def _too_large(self, entry: ModelEntry, size: int, when: str) -> InvalidRequestError:
        need, limit = budget.format_bytes(size), budget.format_bytes(self.residency.budget)
        reason = (f"larger than the memory budget: its weights take {need} ({size} bytes) "
                  f"{when}, the whole budget is {limit} ({self.residency.budget} bytes)")
        self._failed[entry.id] = reason
        return InvalidRequestError(
            f"The model '{entry.id}' is {reason}. Raise [models] memory_budget_bytes or "
            "use a smaller (more quantized) model.",
            code="model_too_large",
            param="model",
        )

    async def _load_within_budget(
        self, entry: ModelEntry, deadline: float, evict: bool
    ) -> LoadedModel:
        residency = self.residency
        try:
            size = await asyncio.to_thread(budget.size_before_loading, entry)
        except Exception:  # unreadable: the load itself will say what is wrong
            size = None
        if size is not None and size > residency.budget:
            raise self._too_large(entry, size, "on disk")
        await residency.make_room(entry.id, size or 0, deadline, evict=evict)
        started = time.perf_counter()
        try:
            loaded = await asyncio.to_thread(_load_sync, entry, self._config)
        except Exception as exc:
            residency.unreserve(entry.id)
            reason = kinds.describe_load_failure(entry, exc)
            self._failed[entry.id] = reason
            self.counts.failures[entry.id] += 1
            log.error("model load failed: %s", reason)
            raise ServerError(
                f"The model '{entry.id}' could not be loaded: {reason}",
                code="model_load_failed",
                param="model",
            ) from None
        except BaseException:  # cancelled (the server is stopping)
            residency.unreserve(entry.id)
            raise
        if loaded.weights_bytes > residency.budget:  # its size was not known before
            residency.unreserve(entry.id)
            await asyncio.to_thread(residency.free, loaded)
            raise self._too_large(entry, loaded.weights_bytes, "in memory")
        self._failed.pop(entry.id, None)
        self._kinds.pop(entry.id, None)
        self._ever_loaded.add(entry.id)
        self.counts.loaded(entry.id, time.perf_counter() - started)
        log.info("model loaded: %s (%s)", entry.id, budget.format_bytes(loaded.memory_bytes))
        residency.admit(loaded, self._config.models.keep_alive_of(entry))
        return loaded

    async def lease(
        self,
        entry: ModelEntry,
        kind: str = CHAT,
        *,
        deadline: float | None = None,
        keep_alive: float | None = None,
    ) -> Lease:
        """A hold on the loaded model, if it serves ``kind`` (else 400
        ``invalid_model_kind``), loading it first if need be; release it when the request
        is over. Past ``deadline`` (default: ``request_timeout`` from now) a model still
        loading is 503 ``busy``, and one that found no room 503 ``model_unavailable``,
        both with ``Retry-After``. ``keep_alive``: the request's own (seconds).

        A model of the wrong kind is refused before loading when its folder already says
        what it is.
        """
        if deadline is None:
            deadline = time.monotonic() + self._config.server.request_timeout
        if keep_alive is None:
            keep_alive = self._config.models.keep_alive_of(entry)
        residency = self.residency
        residency.waiting[entry.id] += 1
        try:
            while True:
                loaded = self._loaded.get(entry.id)
                if loaded is not None:
                    # (again: a download may have told more than the folder did)
                    self.check_kind(entry, kind, loaded.kind)
                    return residency.hold(loaded, keep_alive)
                self.check_kind(entry, kind)
                if entry.id in self._failed and entry.id not in self._loading:
                    # Try again: a failure may have been transient (disk, memory, network).
                    log.info("retrying model load after failure: %s",
                             self._failed.pop(entry.id))
                task = self.begin_load(entry, deadline)
                try:
                    await asyncio.wait_for(asyncio.shield(task),
                                           max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise (residency.room_error(entry.id) or self._still_loading(entry)) from None
                except ServiceUnavailableError:
                    # That load gave up waiting for room at its own deadline; ours may be
                    # later (it was started by another request).
                    if time.monotonic() >= deadline:
                        raise
        finally:
            residency.waiting[entry.id] -= 1
            if not residency.waiting[entry.id]:
                del residency.waiting[entry.id]
            residency.settle(entry.id)

    def _still_loading(self, entry: ModelEntry) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            f"The model '{entry.id}' is loading; retry shortly.",
            code="busy",
            headers={"Retry-After": "2"},
        )

    async def get(
        self, entry: ModelEntry, kind: str = CHAT, *, deadline: float | None = None
    ) -> LoadedModel:
        """The loaded model, as :meth:`lease` gets it, held for no request (its
        keep-alive starts at once)."""
        lease = await self.lease(entry, kind, deadline=deadline)
        lease.release()
        return lease.model

    def usage(self, model_id: str) -> Usage | None:
        """A loaded model's memory, requests and idle time (None: not loaded)."""
        return self.residency.usage(model_id)

    def queued(self, model_id: str) -> int:
        """Requests waiting for the model to load."""
        return self.residency.waiting[model_id]

    async def preload(self) -> None:
        """Load the models marked ``preload`` (the default model unless configured),
        the default first; one that does not fit beside the others is left to load on
        demand."""
        models = self._config.models
        log.info("model memory budget: %s, at most %d models loaded",
                 budget.format_bytes(self.residency.budget), models.max_loaded)
        default = self._config.resolve_model(None)
        wanted = [e for e in models.model if models.preloads(e)]
        wanted.sort(key=lambda e: e is not default)
        for entry in wanted:
            try:
                await self.begin_load(entry, deadline=time.monotonic(), evict=False)
            except ServiceUnavailableError as exc:
                log.warning("not preloading %s: %s", entry.id, exc.message)
            except Exception:  # logged by the load; /health reports it
                pass

    def close(self) -> None:
        for loaded in self.residency.close():
            if loaded.worker is not None:
                loaded.worker.stop()
            if loaded.embedder is not None:
                loaded.embedder.stop()
        for task in self._loading.values():
            task.cancel()


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


__all__ = ["BUILTIN_DEMO_PATH", "LoadedModel", "ModelRegistry"]
