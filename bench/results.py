"""What the benchmark measured, typed, and serialised to the results document's old keys.

Earlier runs in bench/results/ are compared with new ones key by key, so every field
here serialises under the flat name it has always had (``single_tps``, ``agg_tps_c8``,
``grammar_json_schema_alone_pct``, …): a phase's dataclass names its key prefix once,
and a field left ``None`` (not measured) is absent from the document, as it always was.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from bench import report

SYSTEMS = ("afmd", "mlx_lm_server", "raw")


@dataclass(frozen=True)
class Value:
    """One measured quantity over its runs, or ``median=None`` and why there is none.

    A row never has a silent gap: a value the harness could not measure carries its
    ``reason``, and ``not_applicable`` tells the table to show — rather than n/a.
    """

    median: float | None
    unit: str = ""
    min: float | None = None
    max: float | None = None
    n: int = 0
    runs: tuple[float, ...] = ()
    reason: str | None = None
    not_applicable: bool = False

    def to_json(self) -> dict[str, Any]:
        if self.median is None:
            out: dict[str, Any] = {"median": None, "reason": self.reason, "unit": self.unit}
            if self.not_applicable:
                out["not_applicable"] = True
            return out
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n,
                "runs": list(self.runs), "unit": self.unit}


def stat(values: list[float | None], unit: str, *, scale: float = 1.0,
         reason: str | None = None) -> Value:
    """Median, min and max of the runs that produced a number (``None`` runs failed)."""
    vals = [v * scale for v in values if v is not None]
    if not vals:
        return null(reason or "no successful run", unit)
    return Value(median=statistics.median(vals), unit=unit, min=min(vals), max=max(vals),
                 n=len(vals), runs=tuple(round(v, 4) for v in vals))


def null(reason: str, unit: str = "", *, na: bool = False) -> Value:
    """No value, and why; ``na`` marks a row that does not apply to the system."""
    return Value(median=None, unit=unit, reason=reason, not_applicable=na)


def med(v: Value | None) -> float | None:
    return None if v is None else v.median


def fmt(v: Value | None) -> str:
    """The table's text for a value, for the progress log."""
    return report.fmt_value(v.to_json() if v is not None else None)


class Flat:
    """A phase's results: each field is stored as ``PREFIX + name``, ``None`` left out."""

    PREFIX: ClassVar[str] = ""

    def items(self) -> Iterator[tuple[str, Any]]:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is not None:
                yield self.PREFIX + f.name, v.to_json() if isinstance(v, Value) else v


@dataclass
class SingleStream(Flat):
    """One stream at a time; ``tps`` is the delivered rate (robust to coalesced chunks)."""

    PREFIX: ClassVar[str] = "single_"
    tps: Value | None = None
    decode_interval_tps: Value | None = None
    e2e_tps: Value | None = None
    ttft_ms: Value | None = None
    chunks_per_token: Value | None = None
    reads_per_token: Value | None = None
    tokens: list[int] | None = None


@dataclass
class Ttft(Flat):
    """Short prompts; afmd's phase adds a raw sample per request and its own split."""

    PREFIX: ClassVar[str] = "ttft_"
    ms: Value | None = None
    from_tokens_ms: Value | None = None  # raw: message list already tokenised
    paired_raw_ms: Value | None = None
    paired_diff_ms: Value | None = None
    server_queue_ms: Value | None = None
    server_engine_ms: Value | None = None
    outside_server_ms: Value | None = None


@dataclass
class Level:
    """N streams started together (stored as ``agg_<field>_c<N>``)."""

    tps: Value | None = None
    ttft_ms: Value | None = None
    chunks_per_token: Value | None = None

    def items(self, streams: int) -> Iterator[tuple[str, Any]]:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                yield f"agg_{f.name}_c{streams}", v.to_json()


@dataclass
class Prefix(Flat):
    """A long conversation, then its second turn (the prefix cache's row)."""

    PREFIX: ClassVar[str] = "prefix_"
    first_ms: Value | None = None
    second_ms: Value | None = None
    ratio_pct: Value | None = None
    cached_tokens: list[int | None] | None = None
    shared_tokens: Any = None  # raw: tokens the trimmed KV cache kept
    prompt_tokens: list[Any] | None = None


@dataclass
class GrammarKind(Flat):
    """One kind of request (constrained, or a twin without a grammar) in the grammar rows.

    The ``*_pct`` fields exist for the constrained kinds only: their rate against the
    unconstrained twins held to the same lengths.
    """

    PREFIX: ClassVar[str] = ""  # set per kind by ``Grammar.items``
    alone_tps: Value | None = None
    alone_decode_tps: Value | None = None
    prompt_tokens: list[int | None] | None = None
    alone_tokens: list[int] | None = None
    alone_finish: list[str | None] | None = None
    batch_tps: Value | None = None
    batch_decode_tps: Value | None = None
    alone_pct: Value | None = None
    batch_pct: Value | None = None
    alone_decode_pct: Value | None = None
    batch_decode_pct: Value | None = None


@dataclass
class Grammar:
    """Every kind's results; json_schema's outputs are also checked for valid JSON."""

    kinds: dict[str, GrammarKind] = field(default_factory=dict)
    json_valid: list[bool | None] | None = None

    def kind(self, name: str) -> GrammarKind:
        return self.kinds.get(name) or GrammarKind()

    def items(self) -> Iterator[tuple[str, Any]]:
        for name, kind in self.kinds.items():
            for key, v in kind.items():
                yield f"grammar_{name}_{key}", v
            if name == "json_schema" and self.json_valid is not None:
                yield "grammar_json_valid", self.json_valid


@dataclass
class Flood:
    """Requests/s of one path under keep-alive connections, and each run's counts."""

    rps: Value
    detail: list[dict[str, Any]]


@dataclass
class Footprint(Flat):
    """Start-up time, memory and idle CPU of a server process."""

    cold_start_s: Value | None = None
    rss_idle_32k_mb: Value | None = None
    idle_cpu_pct: Value | None = None
    rss_after_bench_mb: Value | None = None
    rss_idle_demo_mb: Value | None = None
    cold_start_demo_s: Value | None = None
    rss_no_model_mb: Value | None = None
    frozen_cold_start_s: Value | None = None
    frozen_rss_demo_mb: Value | None = None
    frozen_rss_no_model_mb: Value | None = None


@dataclass
class Extras(Flat):
    """The full run's extra rows: access log on, and the compute-bound model."""

    access_log_single_tps: Value | None = None
    access_log_agg_tps_c8: Value | None = None
    big_single_tps: Value | None = None
    big_agg_tps_c8: Value | None = None


@dataclass
class Paired(Flat):
    """The rounds taken in turns: per-system rates, and afmd's per-round comparisons."""

    PREFIX: ClassVar[str] = "paired_"
    single_tps: Value | None = None
    agg_tps_c8: Value | None = None
    ttft_ms: Value | None = None
    single_vs_mlx: Value | None = None
    single_vs_raw: Value | None = None
    c8_vs_mlx: Value | None = None
    ttft_minus_raw_ms: Value | None = None
    ttft_minus_mlx_ms: Value | None = None


@dataclass
class Soak(Flat):
    """Rounds of mixed requests (``bench/soak.py``), RSS after each: does it level off?"""

    PREFIX: ClassVar[str] = "soak_"
    growth_pct: Value | None = None  # RSS over the second half of the rounds, % of the middle
    growth_mib: Value | None = None
    rss_mib: list[float] | None = None  # after each round; [0] before any request
    rounds: list[dict[str, Any]] | None = None  # each round as bench/soak.py reports it
    outcomes: dict[str, int] | None = None  # kind:result → count, over every round
    setup: dict[str, Any] | None = None  # model, rounds, requests, concurrency, settle


@dataclass
class Slowloris(Flat):
    """Legitimate clients against connections trickling a byte a second
    (``bench/slowloris.py``)."""

    PREFIX: ClassVar[str] = "slowloris_"
    legit_success_pct: Value | None = None
    latency_ms_p95: Value | None = None
    summary: dict[str, Any] | None = None  # the attack's shape and bench/slowloris.py's counts


Pick = Callable[["SystemResults"], Value | None]


@dataclass
class LogprobsRate(Flat):
    """Greedy decode with top_logprobs 5 against the same-length requests without."""

    PREFIX: ClassVar[str] = "logprobs_"
    with_tps: Value | None = None
    without_tps: Value | None = None
    pct: Value | None = None  # decode phase, per-pair ratio
    e2e_pct: Value | None = None
    tokens: list[int] | None = None


@dataclass
class ModelSwitch(Flat):
    """Loading a model on demand and switching models (``bench/models.py``): time to first
    token of a request whose model is not loaded, cold and after an unload, and of
    alternating requests for two models within the budget and over it."""

    PREFIX: ClassVar[str] = "models_"
    cold_ttft_ms: Value | None = None  # first load of the model in the process
    warm_ttft_ms: Value | None = None  # loaded again after an unload (page cache warm)
    loaded_ttft_ms: Value | None = None  # the same request, the model already loaded
    within_ttft_ms: Value | None = None  # two models alternating, both stay loaded
    over_ttft_ms: Value | None = None  # two models alternating, max_loaded 1
    loads: dict[str, int] | None = None  # model loads per case, from the servers' logs
    setup: dict[str, Any] | None = None


@dataclass
class VisionCost(Flat):
    """Text streams' aggregate rate beside a vision request against alone
    (``bench/vision.py``), and the vision request's own first token and decode rate."""

    PREFIX: ClassVar[str] = "vision_"
    text_alone_tps: Value | None = None
    text_beside_tps: Value | None = None
    pct: Value | None = None  # beside as % of alone, per run
    vision_ttft_ms: Value | None = None
    vision_tps: Value | None = None
    setup: dict[str, Any] | None = None


@dataclass
class Distributed:
    """One model over two ranks against one process, in turns (``bench/distributed.py``).

    ``values`` by ``<system>_<kind>_<what>``: system ``one`` (the one process), ``tensor``
    or ``pipeline``; kind ``single`` (one stream) or ``agg`` (several at once); what
    ``tps``, ``x`` (median of per-round ratios to ``one``), ``bytes_per_token`` between
    the ranks (socket counters; ``bytes_per_position``: over the positions the forward
    passes computed, prompt included) or ``lo_bytes_per_token`` (loopback's, with HTTP).
    """

    values: dict[str, Value] = field(default_factory=dict)
    idle_cpu_pct: dict[str, float | None] | None = None  # each system alone, serving nothing
    setup: dict[str, Any] | None = None

    def get(self, key: str) -> Value | None:
        return self.values.get(key)

    def items(self) -> Iterator[tuple[str, Any]]:
        for key, v in self.values.items():
            yield f"distributed_{key}", v.to_json()
        for key in ("idle_cpu_pct", "setup"):
            if getattr(self, key) is not None:
                yield f"distributed_{key}", getattr(self, key)


@dataclass
class SystemResults:
    """Everything measured for one system, and what went wrong while measuring it."""

    footprint: Footprint = field(default_factory=Footprint)
    single: SingleStream = field(default_factory=SingleStream)
    ttft: Ttft = field(default_factory=Ttft)
    levels: dict[int, Level] = field(default_factory=dict)
    prefix: Prefix = field(default_factory=Prefix)
    grammar: Grammar = field(default_factory=Grammar)
    floods: dict[str, Flood] = field(default_factory=dict)  # "health", "models"
    strace: dict[str, Any] | None = None
    pyspy: dict[str, Any] | None = None
    extras: Extras = field(default_factory=Extras)
    paired: Paired = field(default_factory=Paired)
    soak: Soak = field(default_factory=Soak)
    slowloris: Slowloris = field(default_factory=Slowloris)
    logprobs: LogprobsRate = field(default_factory=LogprobsRate)
    models: ModelSwitch = field(default_factory=ModelSwitch)
    vision: VisionCost = field(default_factory=VisionCost)
    distributed: Distributed = field(default_factory=Distributed)
    errors: dict[str, str] = field(default_factory=dict)  # phase label → traceback
    fatal: str | None = None  # the server (or raw process) could not be measured at all

    def level(self, streams: int) -> Level:
        return self.levels.get(streams) or Level()

    def flood(self, name: str) -> Flood | None:
        return self.floods.get(name)

    def value(self, pick: Pick, default_reason: str) -> Value:
        """``pick``'s value, else a null whose reason says why it is missing."""
        v = pick(self)
        if v is not None:
            return v
        reason = self.fatal and f"server failed: {self.fatal.splitlines()[0]}"
        if not reason and self.errors:
            reason = "measurement failed: " + next(iter(self.errors.values())).splitlines()[0]
        return null(reason or default_reason)

    def to_json(self, *, big_first: bool = False) -> dict[str, Any]:
        """The flat keys, in the order the phases ran (as earlier documents have them);
        ``big_first``: the big model was measured before the rounds in turns (raw)."""
        fp = dict(self.footprint.items())
        out = {k: fp.pop(k) for k in ("cold_start_s", "rss_idle_32k_mb", "idle_cpu_pct")
               if k in fp}
        out.update(self.single.items())
        out.update(self.ttft.items())
        for streams, level in self.levels.items():
            out.update(level.items(streams))
        out.update(self.prefix.items())
        out.update(self.grammar.items())
        for name, flood in self.floods.items():
            out[f"{name}_rps"] = flood.rps.to_json()
            out[f"{name}_rps_detail"] = flood.detail
        if "rss_after_bench_mb" in fp:
            out["rss_after_bench_mb"] = fp.pop("rss_after_bench_mb")
        for key in ("strace", "pyspy"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        extras = dict(self.extras.items())
        big = {k: extras.pop(k) for k in ("big_single_tps", "big_agg_tps_c8") if k in extras}
        out.update(extras)  # access log on
        out.update(fp)  # fresh processes: demo model, no model, frozen binary
        for part in ((big, dict(self.paired.items())) if big_first
                     else (dict(self.paired.items()), big)):
            out.update(part)
        out.update(self.soak.items())  # newer rows: their keys come after the older ones
        out.update(self.slowloris.items())
        out.update(self.logprobs.items())
        out.update(self.models.items())
        out.update(self.vision.items())
        out.update(self.distributed.items())
        if self.errors:
            out["_errors"] = self.errors
        if self.fatal is not None:
            out["_fatal"] = self.fatal
        return out


@dataclass
class Measurements:
    """The three systems' results, by the names the document uses."""

    afmd: SystemResults = field(default_factory=SystemResults)
    mlx_lm_server: SystemResults = field(default_factory=SystemResults)
    raw: SystemResults = field(default_factory=SystemResults)

    def __getitem__(self, system: str) -> SystemResults:
        if system not in SYSTEMS:
            raise KeyError(system)
        return getattr(self, system)  # type: ignore[no-any-return]

    def to_json(self) -> dict[str, dict[str, Any]]:
        # raw measures the big model in its own phase, before the rounds in turns.
        return {s: self[s].to_json(big_first=s == "raw") for s in SYSTEMS}
