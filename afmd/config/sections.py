"""The configuration's shape: one frozen dataclass per TOML table, and the whole :class:`Config`.

Each setting's default, bounds and choices are its field's (``at_least``, ``between``,
``one_of`` metadata, checked by afmd.config.bounds), so a new setting is one line here; a
new table is a dataclass here, a field of :class:`Config` and an entry in
:data:`SECTIONS`. Reading and checking them is afmd.config.load's, the rules across settings
afmd.config.rules'.
"""

from dataclasses import dataclass, field

from afmd.config.bounds import at_least, between, one_of
from afmd.config.tables import ModelEntry, ServerTool

DEMO_MODEL_ID = "demo"
BUILTIN_DEMO_PATH = "afmd:demo"
DEMO_32K_MODEL_ID = "demo-32k"
BUILTIN_DEMO_32K_PATH = "afmd:demo-32k"
DEMO_EMBEDDING_MODEL_ID = "demo-embedding"
BUILTIN_DEMO_EMBEDDING_PATH = "afmd:demo-embedding"
DEMO_VISION_MODEL_ID = "demo-vision"
BUILTIN_DEMO_VISION_PATH = "afmd:demo-vision"
#: Apple's on-device Foundation Model (macOS 26+ with Apple Intelligence), through
#: apple-fm-sdk; unavailable elsewhere (afmd.engine.apple).
SYSTEM_MODEL_ID = "system"
BUILTIN_SYSTEM_PATH = "afmd:system"

_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("json", "console")
_CONTEXT_POLICIES = ("fail", "trim")
_SHARDING = ("auto", "tensor", "pipeline")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP listener and request limits; the limits bound memory per client."""

    host: str = "127.0.0.1"  # "" = no TCP listener
    port: int = field(default=9999, metadata=between(0, 65535))  # 0: the OS picks a port
    unix_socket: str = ""
    api_key: str = ""
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    # At least 1 where 0 would leave the server unable to serve anything at all.
    max_request_body_bytes: int = field(default=16777216, metadata=at_least(1))
    max_header_bytes: int = field(default=65536, metadata=at_least(1))
    max_connections: int = field(default=64, metadata=at_least(1))
    max_buffered_request_bytes: int = field(default=67108864, metadata=at_least(0))
    idle_timeout: float = field(default=30.0, metadata=at_least(0))
    request_timeout: float = field(default=120.0, metadata=at_least(0))
    shutdown_grace: float = field(default=10.0, metadata=at_least(0))
    instructions: str = ""
    instructions_file: str = ""  # read at startup; joined after `instructions`


@dataclass(frozen=True)
class QueueConfig:
    """Admission control: the GPU runs a few generations, the rest wait or are refused."""

    max_concurrent_requests: int = field(default=4, metadata=at_least(1))
    max_queued_requests: int = field(default=64, metadata=at_least(0))


#: Always served, so a fresh install answers requests without downloading anything.
BUILTIN_MODELS: tuple[ModelEntry, ...] = (
    ModelEntry(id=DEMO_MODEL_ID, path=BUILTIN_DEMO_PATH),
    ModelEntry(id=DEMO_32K_MODEL_ID, path=BUILTIN_DEMO_32K_PATH),
    ModelEntry(id=DEMO_EMBEDDING_MODEL_ID, path=BUILTIN_DEMO_EMBEDDING_PATH, kind="embedding"),
    ModelEntry(id=DEMO_VISION_MODEL_ID, path=BUILTIN_DEMO_VISION_PATH, kind="vision"),
    ModelEntry(id=SYSTEM_MODEL_ID, path=BUILTIN_SYSTEM_PATH),
)


@dataclass(frozen=True)
class ModelsConfig:
    """Served models; the default includes the builtins so ``ModelsConfig()`` is usable as is."""

    default: str = DEMO_MODEL_ID
    # Bytes the loaded models may take together (weights and KV caches, measured); 0: a
    # share of physical memory, 60 % on macOS and 50 % on Linux (afmd/engine/models/residency.py).
    memory_budget_bytes: int = field(default=0, metadata=at_least(0))
    # Models loaded at once; one more unloads the least recently used idle one first.
    max_loaded: int = field(default=3, metadata=at_least(1))
    # Seconds an idle model stays loaded: -1 forever, 0 unloaded after each request.
    keep_alive: float = field(default=300.0, metadata=at_least(-1))
    # Pixels (width x height) an image part may have, checked before it is decoded: a
    # decoded picture takes three bytes a pixel, however small its file.
    max_image_pixels: int = field(default=33554432, metadata=at_least(1))
    # Pixels all the image parts of one request may have together, checked before any is
    # decoded: a compressed file can be tiny beside its pixels, so a request's body limit
    # alone lets one request hold more pictures than memory.
    max_request_image_pixels: int = field(default=268435456, metadata=at_least(1))
    # Image parts one request may have (OpenAI's own limit): each costs the processor a
    # fixed amount whatever its pixels, which the pixel limits do not see.
    max_request_images: int = field(default=500, metadata=at_least(1))
    # Pixels the vision requests in flight may hold decoded together (each is decoded when
    # it arrives, before it waits for a slot); one more is 429 while others hold images.
    max_image_pixels_in_flight: int = field(default=1073741824, metadata=at_least(1))
    aliases: dict[str, str] = field(default_factory=dict)
    model: tuple[ModelEntry, ...] = BUILTIN_MODELS

    def keep_alive_of(self, entry: ModelEntry) -> float:
        """The model's own keep-alive, else ``[models] keep_alive``."""
        return self.keep_alive if entry.keep_alive is None else entry.keep_alive

    def preloads(self, entry: ModelEntry) -> bool:
        """Whether ``entry`` loads at start: its ``preload``, else whether it is the
        default model (the built-in demo unless another is configured)."""
        if entry.preload is not None:
            return entry.preload
        return self.aliases.get(self.default, self.default) == entry.id


@dataclass(frozen=True)
class LogConfig:
    """Logging; json is the default because logs are usually read by tools."""

    level: str = field(default="info", metadata=one_of(*_LOG_LEVELS))
    format: str = field(default="json", metadata=one_of(*_LOG_FORMATS))
    access_log: bool = True


@dataclass(frozen=True)
class CacheConfig:
    """Memory bounds of the prefix KV cache and of MLX's buffer pool (memory, not entry
    count, is what runs out first)."""

    prompt_cache_bytes: int = field(default=1073741824, metadata=at_least(0))  # 0: no cache
    # The most blocks the RAM tier holds (a whole-sequence model's cache: entries); 0: no cache.
    prompt_cache_entries: int = field(default=65536, metadata=at_least(0))
    # Tokens per block of the block KV cache (docs/kv-cache.md says why 256).
    block_tokens: int = field(default=256, metadata=at_least(1))
    # The disk tier's folder ("": <afmd cache>/kv) and bound (0 turns the disk tier off).
    disk_dir: str = ""
    disk_bytes: int = field(default=10737418240, metadata=at_least(0))
    # Free space the disk tier leaves on its volume, in bytes (None: the larger of 2 GiB and
    # 5 % of the volume; 0: no margin, disk_bytes alone bounds it).
    disk_min_free: int | None = field(default=None, metadata=at_least(0))
    # MLX's pool of freed buffers kept for reuse (mx.set_cache_limit); 0 keeps none.
    mlx_buffer_cache_bytes: int = field(default=268435456, metadata=at_least(0))


@dataclass(frozen=True)
class EngineConfig:
    """Engine resilience knobs."""

    retries: int = field(default=2, metadata=at_least(0))
    # Seconds before the first retry; doubles each time.
    retry_backoff: float = field(default=0.2, metadata=at_least(0))
    # Speculate with n-grams of the prompt (and the output so far) for a request decoding
    # alone: verified, so it changes no token; it stops itself where it does not pay.
    prompt_lookup: bool = True


@dataclass(frozen=True)
class ToolsConfig:
    """Budgets for server tools, and the tools themselves."""

    # Generation rounds per request that run server tools, and server tool calls.
    max_rounds: int = field(default=4, metadata=at_least(1))
    max_calls: int = field(default=16, metadata=at_least(1))
    server: tuple[ServerTool, ...] = ()


@dataclass(frozen=True)
class SystemConfig:
    """Apple's on-device model (``system``), which calls tools itself mid-generation."""

    # Seconds afmd waits after the model calls one of the client's tools for the calls it
    # makes beside it (parallel calls), before it ends the turn with all of them.
    tool_call_debounce: float = field(default=0.04, metadata=between(0, 10))


@dataclass(frozen=True)
class ContextConfig:
    """What to do when a prompt does not fit the model's context window."""

    policy: str = field(default="fail", metadata=one_of(*_CONTEXT_POLICIES))


@dataclass(frozen=True)
class ResponsesConfig:
    """The Responses API's store of responses (``store``, ``previous_response_id``) and
    of conversations (the Conversations API, ``conversation``)."""

    # Responses kept, the oldest leaving first; 0 keeps none.
    max_stored: int = field(default=1000, metadata=at_least(0))
    # Bytes the kept responses may hold together (each counted as its stored JSON: its
    # echoed request fields, input, output and conversation; in memory, an item the
    # responses of one conversation share counted once), the oldest leaving first;
    # 0: no limit but max_stored.
    max_stored_bytes: int = field(default=256 * 1024 * 1024, metadata=at_least(0))
    # Seconds a response is kept after it was made; 0: no limit.
    ttl: float = field(default=86400.0, metadata=at_least(0))
    persist: bool = False  # also under the cache folder, so a restart keeps them
    # Seconds a background response (``background: true``) may take from its arrival to
    # its end, its wait for a slot included, in place of [server] request_timeout: that
    # one bounds what a client waits for, and background mode is for runs longer than that.
    background_timeout: float = field(default=3600.0, metadata=at_least(1))
    # The Conversations API's conversations, held apart from responses: a long-lived
    # conversation must not be pushed out by the responses of its own turns. The least
    # recently changed leaves first; ``ttl`` counts from a conversation's last change.
    max_conversations: int = field(default=1000, metadata=at_least(1))
    # Bytes the kept conversations may hold together (each counted as its stored JSON);
    # 0: no limit but max_conversations.
    max_conversations_bytes: int = field(default=256 * 1024 * 1024, metadata=at_least(0))


@dataclass(frozen=True)
class ApiConfig:
    """How request bodies are read."""

    # Unknown top-level fields: False ignores them (listed in X-AFM-Ignored-Fields), as
    # IDE plugins sending other servers' fields need; True refuses them, as OpenAI does,
    # and unknown keys inside the objects of chat, Responses and Anthropic bodies too
    # (which False ignores unnamed: clients echo back fields of what they were sent).
    strict: bool = False


@dataclass(frozen=True)
class OllamaConfig:
    """Ollama's native API (``/api/...``), which every listener serves."""

    # Also listen on 127.0.0.1:<port> (Ollama's own is 11434), for apps that only know
    # Ollama's address; the same app, screening and limits. 0: no such listener.
    port: int = field(default=0, metadata=between(0, 65535))


@dataclass(frozen=True)
class DistributedConfig:
    """How a model sharded over several ranks (``afmd launch``) is split and watched.

    Read only by a rank of a launched group; a plain ``afmd serve`` ignores it.
    """

    # "tensor": every layer split across ranks; "pipeline": each rank a run of layers;
    # "auto": tensor where the model supports it, else pipeline.
    strategy: str = field(default="auto", metadata=one_of(*_SHARDING))
    # Seconds without a heartbeat before a rank counts as lost.
    heartbeat_timeout: float = field(default=10.0, metadata=at_least(0.5))
    # Seconds one step of the group may take before a rank counts as lost (a hung rank
    # still sends heartbeats if only its model thread is stuck).
    step_timeout: float = field(default=120.0, metadata=at_least(1))
    # Seconds the other ranks may take to come up (load their shard) and check in.
    startup_timeout: float = field(default=600.0, metadata=at_least(1))


@dataclass(frozen=True)
class UiConfig:
    """The dashboard in the browser (``/ui/``): served by afmd itself, screened like the API."""

    enabled: bool = True


@dataclass(frozen=True)
class Config:
    """The whole, validated configuration; ``source`` says which file (if any) fed it."""

    server: ServerConfig = field(default_factory=ServerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    ollama: OllamaConfig = field(default_factory=OllamaConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    ui: UiConfig = field(default_factory=UiConfig)
    source: str | None = None

    def model_ids(self) -> tuple[str, ...]:
        """Model ids in configuration order (aliases excluded: they are not distinct models)."""
        return tuple(entry.id for entry in self.models.model)

    def resolve_model(self, name: str | None = None) -> ModelEntry | None:
        """Map a request's ``model`` field to an entry; None means "use the default"."""
        target = self.models.default if name is None else name
        target = self.models.aliases.get(target, target)
        for entry in self.models.model:
            if entry.id == target:
                return entry
        return None


#: The TOML tables by name, each with its dataclass; ``AFMD_<TABLE>_<KEY>`` env vars and
#: dotted flags are named after them.
SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "queue": QueueConfig,
    "models": ModelsConfig,
    "log": LogConfig,
    "cache": CacheConfig,
    "engine": EngineConfig,
    "context": ContextConfig,
    "tools": ToolsConfig,
    "responses": ResponsesConfig,
    "api": ApiConfig,
    "ollama": OllamaConfig,
    "distributed": DistributedConfig,
    "system": SystemConfig,
    "ui": UiConfig,
}
