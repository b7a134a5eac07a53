"""``GET /metrics``: Prometheus text exposition of what afmd did and what it holds now.

Two kinds of numbers. Events (a request answered, its tokens, its time to first token
and decode speed, a listener restarted) are added up as they happen, once per request
when it ends and never per token, into plain counters and histogram buckets that only
the event loop touches, so recording one is a dict update. State (queue depth, running
generations, per-model loads, unloads and memory) is read at scrape time from the
scheduler and the model registry, so nothing has to be kept in step with them.

``prometheus_client`` renders both at scrape time through one collector, in a registry of
this server's own: the library's default registry is process-wide, and tests run several
servers in one process. The library is imported at the first scrape, not at startup,
because importing it pulls in its HTTP servers and costs every ``afmd serve`` start,
scraped or not.

Labels are bounded by what the server is configured with, never by what clients send:
``endpoint`` is the route's path template (``other`` for a path no route serves, or a
request refused before its head was read), ``dialect`` the route's wire format (``none``
for routes without one), ``model`` a configured model id (aliases resolved).
"""

from __future__ import annotations

import contextlib
import re
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from sanic import Request, Sanic
from sanic.exceptions import MethodNotAllowed
from sanic.response import HTTPResponse

from afmd.config.sections import Config
from afmd.core.events import Usage
from afmd.dialects.dialect import ErrorStyle
from afmd.engine.generation import Finished, Generation
from afmd.engine.models.model_registry import ModelRegistry
from afmd.errors import APIError
from afmd.http.transport.supervisor import RUNNING, ListenerState
from afmd.service.chat_run import ChatRun
from afmd.service.choices import ChoicesRun
from afmd.service.completion_run import CompletionRun
from afmd.service.scheduler import Scheduler

#: A request's run, whichever endpoint started it.
AnyRun = ChatRun | ChoicesRun | CompletionRun

__all__ = ["CONTENT_TYPE", "DECODE_BUCKETS", "TTFT_BUCKETS", "Metrics", "first_token_seconds",
           "generations_of", "metrics"]

#: The classic text format (0.0.4): what every Prometheus version scrapes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Upper bounds (seconds) of the time-to-first-token buckets.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Upper bounds (tokens per second) of the decode-speed buckets.
DECODE_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0,
                  500.0, 1000.0, 2000.0)

OTHER = "other"  # the endpoint of a request no route serves
NONE = "none"  # the dialect of a route without one

_PARAM = re.compile(r"<(\w+)(?::[^>]*)?>")


class Buckets:
    """One histogram series: counts per bucket (not cumulative; the last is +Inf) and the
    sum of what was observed."""

    __slots__ = ("counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, bounds: tuple[float, ...], value: float) -> None:
        self.counts[bisect_left(bounds, value)] += 1  # le: a value on a bound counts in it
        self.total += value

    def cumulative(self, bounds: tuple[float, ...]) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*(_float(b) for b in bounds), "+Inf"), self.counts,
                                strict=True):
            running += count
            out.append((bound, running))
        return out


def _float(value: float) -> str:
    return repr(float(value))


class Metrics:
    """One server's event counts, and the collector that renders them with its state."""

    def __init__(self) -> None:
        #: (endpoint, dialect, status) -> requests answered.
        self.requests: Counter[tuple[str, str, int]] = Counter()
        self.prompt_tokens: Counter[str] = Counter()
        self.completion_tokens: Counter[str] = Counter()
        #: Generating requests per model, those whose prompt reused the prefix cache, and
        #: the prompt tokens it supplied (the ``cached_tokens`` clients were told).
        self.cache_lookups: Counter[str] = Counter()
        self.cache_hits: Counter[str] = Counter()
        self.cached_tokens: Counter[str] = Counter()
        self.ttft: dict[str, Buckets] = {}
        self.decode: dict[str, Buckets] = {}
        self.listener_restarts: Counter[str] = Counter()
        self.listener_up: dict[str, bool] = {}
        self._endpoints: dict[str, str] = {}  # a route's URI -> its endpoint label
        self._registry: Any = None

    # -- events (on the event loop) --
    def answered(self, request: Request, status: int) -> None:
        """A request Sanic answered (a stream once it ended), with what its handler noted
        on ``request.ctx``: its usage, and the run that generated it."""
        route = getattr(request, "route", None)
        if route is None:
            self.requests[OTHER, NONE, status] += 1
        else:
            dialect = getattr(route.ctx, "dialect", None)
            self.requests[self._endpoint(route.uri), getattr(dialect, "name", NONE),
                          status] += 1
        ctx = request.ctx
        usage = getattr(ctx, "usage", None)
        # The run, from its start: a stream the client left, or that failed after its 200,
        # told no usage, but its generations ran, and their timings are the engine's.
        run = getattr(ctx, "run", None)
        if usage is None and run is None:
            return
        state = request.app.ctx.state
        if run is not None:
            model = run.prepared.model.id
        else:
            # The name as the request gave it, resolved as its model was (Ollama's
            # ``demo:latest`` is ``demo``): a label is a model's id, never a client's text.
            try:
                model = state.registry.resolve(getattr(ctx, "model", None)).id
            except APIError:
                return
        self.generated(model, run, usage)

    def generated(self, model: str, run: AnyRun | None, usage: Usage | None) -> None:
        """What a request generated, counted once as it ended: its answer's, or a
        background response's run, which ends after its POST was answered and counted."""
        if usage is not None:
            self.prompt_tokens[model] += usage.prompt_tokens
            self.completion_tokens[model] += usage.completion_tokens
        if run is not None:
            self._timings(model, run, usage)

    def direct(self, path: str, status: int) -> None:
        """A state route (``/health``, ``/v1/models``) the connection answered itself."""
        self.requests[path, NONE, status] += 1

    def refused(self, app: Sanic, target: tuple[str, str] | None, style: ErrorStyle | None,
                status: int) -> None:
        """A request the gate refused (``target``: its method and path, None when it was
        refused before its head was read); ``style`` is the envelope it went out in."""
        endpoint = OTHER
        if target is not None:
            method, path = target
            try:
                route = app.router.get(path, method, None)[0]
            except MethodNotAllowed as exc:  # a route's path, another method: its template
                allowed = sorted(getattr(exc, "allowed_methods", None) or ())
                with contextlib.suppress(Exception):
                    route = app.router.get(path, str(allowed[0]), None)[0]
                    endpoint = self._endpoint(route.uri)
            except Exception:  # no route: not a label
                pass
            else:
                endpoint = self._endpoint(route.uri)
        self.requests[endpoint, getattr(style, "name", NONE), status] += 1

    def listener_state(self, state: ListenerState) -> None:
        """A listener's transition (a supervisor callback): restarts and whether it is up."""
        if state.state == RUNNING and state.attempt > 0:
            self.listener_restarts[state.listener] += 1
        else:
            self.listener_restarts[state.listener] += 0  # a series from its first state
        self.listener_up[state.listener] = state.state == RUNNING

    def _endpoint(self, uri: str) -> str:
        label = self._endpoints.get(uri)
        if label is None:
            label = self._endpoints[uri] = _PARAM.sub(r"{\1}", uri)
        return label

    def _timings(self, model: str, run: AnyRun, usage: Usage | None) -> None:
        """Time to first token and each generation's decode speed, from the engine's own
        timings."""
        if not generations_of(run):
            return  # cancelled while it waited for a slot: the cache never saw its prompt
        if usage is not None:  # else what the cache gave it is unknown: not counted
            self.cache_lookups[model] += 1
            if usage.cached_tokens:
                self.cache_hits[model] += 1
                self.cached_tokens[model] += usage.cached_tokens
        first = first_token_seconds(run)
        if first is not None:
            ttft = self.ttft.get(model) or self.ttft.setdefault(model, Buckets(TTFT_BUCKETS))
            ttft.observe(TTFT_BUCKETS, first)
        for end in _ends(run):
            seconds = end.timings["finished_at"] - end.timings["first_token_at"]
            if end.completion_tokens > 1 and seconds > 0:
                decode = self.decode.get(model) or self.decode.setdefault(
                    model, Buckets(DECODE_BUCKETS))
                decode.observe(DECODE_BUCKETS, (end.completion_tokens - 1) / seconds)

    # -- the scrape --
    def render(self, config: Config, registry: ModelRegistry, scheduler: Scheduler) -> bytes:
        """The scrape's text: the event counts, and the server's models and slots now."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry(auto_describe=False)
            self._registry.register(_Collector(self, config, registry, scheduler))
        from prometheus_client.exposition import generate_latest

        return bytes(generate_latest(self._registry))


def generations_of(run: AnyRun) -> list[Generation]:
    """A run's engine generations: a Completions run has one per prompt, a chat run its
    current round's."""
    generations = getattr(run, "generations", None)
    if generations is None:
        generation = getattr(run, "generation", None)
        generations = [generation] if generation is not None else []
    return list(generations)


def _ends(run: AnyRun) -> list[Finished]:
    return [g.finish for g in generations_of(run) if g.finish is not None]


def first_token_seconds(run: AnyRun) -> float | None:
    """From the request's arrival to its first generated token (as ``X-AFM-Profile`` has
    it: queue and prefill included); None when it generated nothing. A generation not
    ended yet (its client gone, or failed after its first token) has no engine timings:
    its first token's arrival on the event loop stands for them."""
    first = [e.timings["first_token_at"] for e in _ends(run) if e.completion_tokens > 0]
    if not first:
        first = [g.first_token_seen_at for g in generations_of(run)
                 if g.finish is None and g.first_token_seen_at is not None]
    return max(0.0, min(first) - run.prepared.received_at) if first else None


class _Collector:
    """What a scrape reads: the event counts, and the server's state as it is now."""

    def __init__(
        self, metrics: Metrics, config: Config, registry: ModelRegistry, scheduler: Scheduler
    ) -> None:
        self._metrics = metrics
        self._config = config
        self._registry = registry
        self._scheduler = scheduler

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        m = self._metrics
        requests = CounterMetricFamily(
            "afmd_http_requests", "HTTP requests answered, by route, wire format and status.",
            labels=("endpoint", "dialect", "status"))
        for (endpoint, dialect, status), count in sorted(m.requests.items()):
            requests.add_metric((endpoint, dialect, str(status)), count)
        yield requests

        models = [entry.id for entry in self._config.models.model]
        for name, doc, counts in (
            ("afmd_prompt_tokens", "Prompt tokens of answered requests (tokens in).",
             m.prompt_tokens),
            ("afmd_completion_tokens", "Generated tokens of answered requests (tokens out).",
             m.completion_tokens),
            ("afmd_prefix_cache_lookups", "Generating requests (each looks its prompt up in "
             "the prefix cache).", m.cache_lookups),
            ("afmd_prefix_cache_hits", "Generating requests whose prompt reused KV state from "
             "the prefix cache.", m.cache_hits),
            ("afmd_cached_prompt_tokens", "Prompt tokens taken from the prefix cache instead "
             "of being computed.", m.cached_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=("model",))
            for model in _union(models, counts):
                family.add_metric((model,), counts[model])
            yield family

        for name, doc, series, bounds in (
            ("afmd_time_to_first_token_seconds", "From a request's arrival to its first "
             "generated token (queue and prefill included).", m.ttft, TTFT_BUCKETS),
            ("afmd_decode_tokens_per_second", "Decode speed of each generation, after its "
             "first token.", m.decode, DECODE_BUCKETS),
        ):
            histogram = HistogramMetricFamily(name, doc, labels=("model",))
            for model in sorted(series):
                buckets = series[model]
                histogram.add_metric((model,), buckets.cumulative(bounds), buckets.total)
            yield histogram

        scheduler = self._scheduler
        yield GaugeMetricFamily("afmd_queue_depth", "Requests waiting for a generation slot.",
                                value=scheduler.queued)
        yield GaugeMetricFamily("afmd_active_generations",
                                "Requests holding a generation slot.", value=scheduler.active)
        yield from _model_families(self._registry, models)

        restarts = CounterMetricFamily("afmd_listener_restarts",
                                       "Listening sockets recreated after they broke.",
                                       labels=("listener",))
        up = GaugeMetricFamily("afmd_listener_up", "1 while the listener accepts connections.",
                               labels=("listener",))
        for listener in sorted(m.listener_restarts):
            restarts.add_metric((listener,), m.listener_restarts[listener])
            up.add_metric((listener,), 1.0 if m.listener_up.get(listener) else 0.0)
        yield restarts
        yield up


def _model_families(registry: ModelRegistry, models: list[str]) -> Iterator[Any]:
    """Per configured model: whether it is loaded, its memory, its loads and unloads."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    counts = registry.counts
    loaded = GaugeMetricFamily("afmd_model_loaded", "1 while the model is in memory.",
                               labels=("model",))
    memory = GaugeMetricFamily("afmd_model_memory_bytes", "Memory a loaded model holds, "
                               "measured: weights and KV caches (prefix cache, running batch).",
                               labels=("model",))
    for model in models:
        handle = registry.loaded(model)
        loaded.add_metric((model,), 0.0 if handle is None else 1.0)
        if handle is not None:
            memory.add_metric((model,), handle.memory_bytes)
    yield loaded
    yield memory
    # A refusal of a model larger than the whole budget is a load that failed too (the
    # series keeps its labels: scrapes select it by model), and is counted on its own.
    failed = counts.failures + counts.too_large
    for name, doc, series in (
        ("afmd_model_loads", "Completed model loads.", counts.loads),
        ("afmd_model_load_failures", "Model loads that failed (model_load_failed), and "
         "refusals of a model larger than the whole budget (model_too_large).", failed),
        ("afmd_model_too_large", "Refusals of a model larger than the whole memory "
         "budget (model_too_large), also counted in afmd_model_load_failures.",
         counts.too_large),
        ("afmd_model_unloads", "Unloads (idle past keep_alive, or making room).",
         counts.unloads),
        ("afmd_model_load_seconds", "Time spent in completed model loads.", counts.seconds),
    ):
        family = CounterMetricFamily(name, doc, labels=("model",))
        for model in _union(models, series):
            family.add_metric((model,), series.get(model, 0))
        yield family
    yield from _kv_cache_families(registry, models)


def _kv_cache_families(registry: ModelRegistry, models: list[str]) -> Iterator[Any]:
    """Per loaded model and tier (``ram``, ``disk``): the block KV cache's block hits,
    misses and evictions, and the bytes it holds."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ("model", "tier")
    hits = CounterMetricFamily("afmd_kv_cache_hits", "Blocks of a prompt found in the "
                               "tier (KV state reused, not computed).", labels=labels)
    misses = CounterMetricFamily("afmd_kv_cache_misses", "Blocks of a prompt looked for in "
                                 "the tier and not found there.", labels=labels)
    evictions = CounterMetricFamily("afmd_kv_cache_evictions", "Blocks the tier dropped "
                                    "to stay within its bytes (least recently used first; "
                                    "the disk tier's count is its folder's).", labels=labels)
    held = GaugeMetricFamily("afmd_kv_cache_bytes", "Bytes of KV blocks the tier holds.",
                             labels=labels)
    counted = {model for model, _ in registry.counts.kv}
    for model in _union(models, counted):
        handle = registry.loaded(model)
        cache = handle.kv_cache if handle is not None else None
        live = cache.stats() if cache is not None else None
        # The counters run from the server's start, across the model's loads; the bytes
        # are the loaded model's.
        for tier, numbers in registry.counts.kv_counts(model, live).items():
            hits.add_metric((model, tier), numbers["hits"])
            misses.add_metric((model, tier), numbers["misses"])
            evictions.add_metric((model, tier), numbers["evictions"])
        for tier, numbers in (live or {}).items():
            held.add_metric((model, tier), numbers["bytes"])
    yield hits
    yield misses
    yield evictions
    yield held
    yield from _kv_disk_families()


def _kv_disk_families() -> Iterator[Any]:
    """The disk tier's folder, whichever models use it: the files it refused on read, the
    writes that failed and the blocks it did not write, by reason (every reason from 0),
    and whether it writes (while a disk tier is open)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from afmd.engine.kvcache import disk_counts

    totals = disk_counts.totals()
    for name, doc, counts in (
        ("afmd_kv_cache_disk_rejected", "Block files the disk tier refused on read "
         "(deleted, or left and not read again), by reason.", totals.rejected),
        ("afmd_kv_cache_disk_write_failures", "Block writes to the disk tier that failed, "
         "by reason (full: it pauses and retries; denied, other: it stops writing).",
         totals.write_failures),
        ("afmd_kv_cache_disk_dropped", "Blocks the disk tier did not write, by reason "
         "(its queue full, no room above the free-space margin, writing paused or "
         "stopped).", totals.dropped),
    ):
        family = CounterMetricFamily(name, doc, labels=("reason",))
        for reason, value in counts.items():
            family.add_metric((reason,), value)
        yield family
    if totals.writing is not None:
        yield GaugeMetricFamily("afmd_kv_cache_disk_writing", "1 while the disk tier writes "
                                "blocks; 0 while paused after a full disk, or stopped.",
                                value=1.0 if totals.writing else 0.0)


def _union(models: list[str], counts: Iterable[str]) -> list[str]:
    """Every configured model (a counter starts at 0), then any other the counts name."""
    return [*models, *sorted(k for k in counts if k not in models)]


async def metrics(request: Request) -> HTTPResponse:
    state = request.app.ctx.state
    return HTTPResponse(
        state.metrics.render(state.config, state.registry, state.pipeline.scheduler),
        content_type=CONTENT_TYPE,
    )
