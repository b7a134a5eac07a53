"""The rows of the results table, declared as data: id, title, target, each system's
value (or why it has none) and the verdict rule.

The ids, titles, targets and notes are what earlier results were written with, so a row
here is the same row in every run's document; ``evaluate`` fills them in from the
measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from afmd.config.sections import ServerConfig
from bench import distributed, slowloris, soak, workload
from bench.plan import BIG_MAX_TOKENS, LEVELS, SYSTEMS, Plan
from bench.results import Measurements, Pick, SystemResults, Value, fmt, med, null
from bench.verdicts import (
    NotJudged,
    RatioInTurns,
    Reported,
    Threshold,
    Verdict,
    afmd,
    no_verdict,
    num,
    ratio,
    ratios_detail,
    ttft,
    x,
)


@dataclass(frozen=True)
class Missing:
    """Why a system has no value in a row; ``na``: the row does not apply to it (—)."""

    reason: str
    na: bool = False


NOT_MEASURED = Missing("not measured")
NO_RAW = Missing("not applicable to in-process generation", na=True)
NO_MLX_GRAMMAR = Missing(
    "mlx_lm.server has no response_format/json_schema or tool_choice grammar", na=True)
NO_RAW_GRAMMAR = Missing("raw mlx-lm has no grammar; afmd is compared with itself", na=True)
NO_MLX_MODEL = Missing("mlx_lm.server cannot run without a model", na=True)
NA = Missing("n/a", na=True)
AFMD_ONLY = Missing("afmd only", na=True)
QUICK = Missing("skipped in --quick")
NO_BIG = Missing("skipped (--quick or --no-big)")
MB80 = 80.0 * 1e6 / 2**20  # "≤ 80 MB" in MiB, the unit RSS is measured in


@dataclass(frozen=True)
class Row:
    """One line of the table; ``note`` may read the measurements (TTFT's own split)."""

    id: str
    title: str
    target: str
    values: Mapping[str, Pick | Missing]  # a system left out: NOT_MEASURED
    verdict: Verdict = no_verdict
    note: str | Callable[[Measurements], str] | None = None


def all3(pick: Pick) -> dict[str, Pick | Missing]:
    return dict.fromkeys(SYSTEMS, pick)


def evaluate(rows: list[Row], res: Measurements) -> list[dict[str, Any]]:
    """Each row as the results document stores it."""
    out = []
    for row in rows:
        values: dict[str, Any] = {}
        for system in SYSTEMS:
            entry = row.values.get(system, NOT_MEASURED)
            v = (null(entry.reason, na=entry.na) if isinstance(entry, Missing)
                 else res[system].value(entry, "not measured"))
            values[system] = v.to_json()
        note = row.note(res) if callable(row.note) else row.note
        out.append({"id": row.id, "title": row.title, "target": row.target,
                    "values": values, "check": row.verdict(res).to_json(), "note": note})
    return out


def declare(p: Plan) -> list[Row]:
    """Every row, in the table's order (titles name the plan's token counts)."""
    return [*_speed(p), *_grammar(p), _logprobs(p), *_requests(p), *_footprint(),
            *_resilience(p), *_models(), _vision(), *_extras(p), *distributed_rows(p.big)]


def _speed(p: Plan) -> list[Row]:
    rows = [
        Row("single_stream_decode_tps",
            f"single-stream tok/s, streamed ({p.max_tokens} tokens)",
            "afmd ≥ 1.4× mlx_lm.server and ≥ 0.9× raw", all3(lambda s: s.single.tps),
            RatioInTurns(lambda s: s.single.tps, {"mlx": 1.4, "raw": 0.9},
                         {"mlx": lambda s: s.paired.single_vs_mlx,
                          "raw": lambda s: s.paired.single_vs_raw}),
            note="completion_tokens (usage chunk) / (last delta − request sent); raw: "
                 "tokens / (last token − message list). The verdict uses the median of "
                 "per-round ratios from rounds taken in turns (afmd, mlx_lm.server, raw, "
                 "one request each, same prompt); the columns and the ratios in brackets "
                 "are the separate phases. The first-to-last-delta rate is in "
                 "measurements.*.single_decode_interval_tps (it overstates a server that "
                 "coalesces tokens)"),
        Row("ttft_short_ms", "time to first token, short prompt (ms)",
            "afmd ≤ raw + 3 ms and < mlx_lm.server", all3(lambda s: s.ttft.ms), ttft,
            note=lambda res: "request sent → first content delta; raw: message list → "
                 "first token (template + tokenise + prefill + first step). The verdict "
                 "uses the medians of per-round differences from short-prompt rounds taken "
                 "in turns (afmd, mlx_lm.server, raw; same prompt); the columns are the "
                 "separate phases, and in afmd's phase a raw sample follows each of its "
                 "requests. afmd's own split (X-AFM-Profile): " + _ttft_split(res.afmd)),
    ]
    for c in LEVELS:
        level = _level(c)
        values = all3(level) if c in p.levels else dict.fromkeys(SYSTEMS, QUICK)
        if c != 8:
            rows.append(Row(f"aggregate_tps_c{c}", f"aggregate tok/s, {c} concurrent "
                            "stream(s)", "report", values))
            continue
        rows.append(Row(
            f"aggregate_tps_c{c}", f"aggregate tok/s, {c} concurrent stream(s)",
            "afmd ≥ 1.5× mlx_lm.server", values,
            RatioInTurns(level, {"mlx": 1.5}, {"mlx": lambda s: s.paired.c8_vs_mlx},
                         also=("raw",)),
            note="the verdict uses the median of per-round ratios from rounds of 8 "
                 "streams taken in turns (afmd, mlx_lm.server; same prompts); the "
                 "columns and the ratios in brackets are the separate phases"))

    def prefix_ms(res: Measurements, which: str) -> dict[str, float | None]:
        return {s: med(getattr(res[s].prefix, which)) for s in SYSTEMS}

    rows.append(Row(
        "prefix_second_turn_ttft",
        f"second-turn TTFT, ~{p.prefix_tokens}-token shared prefix (% of first turn)",
        "afmd ≤ 15%", all3(lambda s: s.prefix.ratio_pct),
        Threshold(afmd(lambda s: s.prefix.ratio_pct), "<=", 15.0,
                  figures=lambda res: {"first_turn_ms": prefix_ms(res, "first_ms"),
                                       "second_turn_ms": prefix_ms(res, "second_ms")},
                  detail=lambda res, _: "; ".join(
                      f"{s}: {num(med(res[s].prefix.first_ms), suffix=' ms')} → "
                      f"{num(med(res[s].prefix.second_ms), suffix=' ms')}"
                      for s in SYSTEMS)),
        note=f"~{p.prefix_tokens}-token conversation, then + assistant reply + new user "
             "message; raw = first turn's KV cache trimmed to the shared prefix"))
    return rows


def _level(streams: int) -> Pick:
    def pick(s: SystemResults) -> Value | None:
        return s.level(streams).tps
    return pick


def _grammar(p: Plan) -> list[Row]:
    return [_grammar_row(kind, label, where, key)
            for kind, label in (("json_schema", "response_format json_schema"),
                                ("tool_required", 'tool_choice "required"'))
            for where, key in (("alone", "alone"), (f"batch of {p.grammar_batch}", "batch"))]


def _grammar_row(kind: str, label: str, where: str, key: str) -> Row:
    """afmd's constrained rate as % of its unconstrained twins' (``key``: alone or batch)."""
    base = workload.GRAMMAR_BASELINE[kind]

    def pct(s: SystemResults) -> Value | None:
        return getattr(s.grammar.kind(kind), f"{key}_pct")  # type: ignore[no-any-return]

    def tps(res: Measurements, k: str) -> float | None:
        return med(getattr(res.afmd.grammar.kind(k), f"{key}_tps"))

    def decode(res: Measurements) -> float | None:
        return med(getattr(res.afmd.grammar.kind(kind), f"{key}_decode_pct"))

    def figures(res: Measurements) -> dict[str, Any]:
        return {"constrained_tps": tps(res, kind), "unconstrained_tps": tps(res, base),
                "decode_pct": decode(res)}

    def detail(res: Measurements, _: float) -> str:
        return (f"{num(tps(res, kind))} vs {num(tps(res, base))} tok/s, prompt "
                f"{_prompt(res, kind)} vs {_prompt(res, base)} tokens; decode phase "
                f"{num(decode(res), suffix='%')}")

    return Row(
        f"grammar_{kind}_{key}", f"grammar decode, {label}, {where} (% of unconstrained)",
        "afmd ≥ 90%", {"afmd": pct, "mlx_lm_server": NO_MLX_GRAMMAR, "raw": NO_RAW_GRAMMAR},
        Threshold(afmd(pct), ">=", 90.0, figures=figures, detail=detail),
        note="completion_tokens / (end − send), against the same prompt without a "
             "grammar (for tools: the tool definitions as a system message), each "
             "unconstrained row held to the tokens its constrained twin produced "
             "(a grammar ends early; free text runs to max_tokens). Decode phase: "
             "tokens after the first / (last delta − first delta); in a batch "
             "Σ(tokens − 1) / (last delta of any − first delta of any)")


def _logprobs(p: Plan) -> Row:
    """afmd's greedy decode rate with top_logprobs 5 as % of the same without."""
    def pct(s: SystemResults) -> Value | None:
        return s.logprobs.pct

    def figures(res: Measurements) -> dict[str, Any]:
        lp = res.afmd.logprobs
        return {"with_tps": med(lp.with_tps), "without_tps": med(lp.without_tps),
                "e2e_pct": med(lp.e2e_pct)}

    def detail(res: Measurements, _: float) -> str:
        lp = res.afmd.logprobs
        return (f"decode {num(med(lp.with_tps))} vs {num(med(lp.without_tps))} tok/s; "
                f"end to end {num(med(lp.e2e_pct), suffix='%')}")

    return Row(
        "logprobs_top5_decode", "decode with logprobs, top_logprobs 5 (% of without)",
        "afmd ≥ 85%", {"afmd": pct, "mlx_lm_server": AFMD_ONLY, "raw": NO_RAW},
        Threshold(afmd(pct), ">=", 85.0, figures=figures, detail=detail),
        note=f"{2 * p.runs} pairs of single greedy streams ({p.max_tokens} tokens), unique "
             "prompts of equal length, one asking logprobs with top_logprobs 5 and one "
             "not, the second held to the first's tokens, the order alternating; per-pair "
             "ratio of decode-phase rates (tokens after the first / (last − first delta))")


def _requests(p: Plan) -> list[Row]:
    return [_requests_row(p, "health", "/health"), _requests_row(p, "models", "/v1/models")]


def _rps(name: str) -> Pick:
    def pick(s: SystemResults) -> Value | None:
        flood = s.flood(name)
        return flood.rps if flood is not None else None
    return pick


def _requests_row(p: Plan, name: str, label: str) -> Row:
    """afmd's requests/s on ``label`` against mlx_lm.server's on /health."""
    def vs_mlx_health(res: Measurements) -> float | None:
        return ratio(med(_rps(name)(res.afmd)), med(_rps("health")(res.mlx_lm_server)))

    return Row(
        f"{name}_requests_per_s",
        f"{label} requests/s ({p.rps_connections} keep-alive connections)",
        "afmd ≥ 3× mlx_lm.server /health",
        {"afmd": _rps(name), "mlx_lm_server": _rps(name), "raw": NO_RAW},
        Threshold(vs_mlx_health, ">=", 3.0,
                  figures=lambda res: {"afmd_vs_mlx_health": vs_mlx_health(res)},
                  detail=lambda _, v: x(v, "mlx /health")),
        note="mlx_lm.server speaks HTTP/1.0 and closes every connection, so its "
             "client reconnects per request" if name == "health" else None)


def _footprint() -> list[Row]:
    def mine(pick: Pick) -> dict[str, Pick | Missing]:
        return {"afmd": pick, "mlx_lm_server": NO_RAW, "raw": NO_RAW}

    return [
        Row("idle_rss_demo_mb", "idle RSS, demo model loaded (MiB)", "report",
            {"afmd": lambda s: s.footprint.rss_idle_demo_mb,
             "mlx_lm_server": lambda s: s.footprint.rss_idle_demo_mb, "raw": NO_RAW}),
        Row("idle_rss_32k_mb", "idle RSS, demo-32k loaded, before any request (MiB)",
            "report", {"afmd": lambda s: s.footprint.rss_idle_32k_mb,
                       "mlx_lm_server": lambda s: s.footprint.rss_idle_32k_mb,
                       "raw": NO_RAW}),
        Row("idle_cpu_pct", "idle CPU, model loaded, no requests (% of one core)", "report",
            {"afmd": lambda s: s.footprint.idle_cpu_pct,
             "mlx_lm_server": lambda s: s.footprint.idle_cpu_pct, "raw": NO_RAW},
            note="/proc/<pid>/stat utime+stime over an idle interval right after /health ok"),
        Row("rss_no_model_mb", "afmd RSS without a model (MiB)", "≤ 80 MB",
            {"afmd": lambda s: s.footprint.rss_no_model_mb, "mlx_lm_server": NO_MLX_MODEL,
             "raw": NO_RAW},
            Threshold(afmd(lambda s: s.footprint.rss_no_model_mb), "<=", MB80),
            note="default model's path missing, so the load fails after the serving stack "
                 "(MLX included) is imported"),
        Row("cold_start_s", "cold start to /health ok, demo model (s, python -m)", "report",
            {"afmd": lambda s: s.footprint.cold_start_demo_s,
             "mlx_lm_server": lambda s: s.footprint.cold_start_demo_s, "raw": NO_RAW}),
        Row("frozen_cold_start_s", "frozen binary cold start to /health ok (s)", "≤ 3 s",
            mine(lambda s: s.footprint.frozen_cold_start_s),
            Threshold(afmd(lambda s: s.footprint.frozen_cold_start_s), "<=", 3.0)),
        Row("frozen_rss_demo_mb", "frozen binary idle RSS, demo model (MiB)", "report",
            mine(lambda s: s.footprint.frozen_rss_demo_mb)),
        Row("frozen_rss_no_model_mb", "frozen binary RSS without a model (MiB)", "≤ 80 MB",
            mine(lambda s: s.footprint.frozen_rss_no_model_mb),
            Threshold(afmd(lambda s: s.footprint.frozen_rss_no_model_mb), "<=", MB80)),
    ]


SOAK_GROWTH_PCT = 5.0  # see bench/README.md, "Rows", for why this limit


def _resilience(p: Plan) -> list[Row]:
    """The memory soak and the slowloris: afmd alone, each on a server of its own."""
    def growth(s: SystemResults) -> Value | None:
        return s.soak.growth_pct

    def plateau(res: Measurements) -> soak.Plateau | None:
        flat = (res.afmd.soak.setup or {}).get("plateau")
        return soak.Plateau(**flat) if flat else None

    def soak_figures(res: Measurements) -> dict[str, Any]:
        flat = plateau(res)
        return {"growth_mib": flat.growth_mib if flat else None,
                "rss_mib": res.afmd.soak.rss_mib}

    def soak_detail(res: Measurements, _: float) -> str:
        flat = plateau(res)
        return flat.text() if flat else ""

    rule: Verdict = Threshold(afmd(growth), "<=", SOAK_GROWTH_PCT, figures=soak_figures,
                              detail=soak_detail)
    if p.quick:
        rule = NotJudged(rule, f"{p.soak_rounds} rounds × {p.soak_requests} requests are "
                               "warm-up; the full run judges the plateau")

    def success(s: SystemResults) -> Value | None:
        return s.slowloris.legit_success_pct

    def attack(res: Measurements) -> dict[str, Any]:
        return res.afmd.slowloris.summary or {}

    def attack_figures(res: Measurements) -> dict[str, Any]:
        a = attack(res)
        return {k: a.get(k) for k in ("legit_ok", "legit_tries", "latency_ms_p95",
                                      "attack_connections")}

    def attack_detail(res: Measurements, _: float) -> str:
        a = attack(res)
        return (f"{a.get('legit_ok')}/{a.get('legit_tries')} answered 200, p95 "
                f"{a.get('latency_ms_p95')} ms; {a.get('attack_connections')} attack "
                f"connections")

    limit = (f"max_connections {p.slowloris_max_connections}" if p.slowloris_max_connections
             else f"default max_connections ({ServerConfig().max_connections})")
    return [
        Row("memory_soak_rss_growth",
            f"memory soak: RSS growth over the second half of {p.soak_rounds} rounds × "
            f"{p.soak_requests} mixed requests (% of mid-run RSS)",
            f"afmd ≤ {SOAK_GROWTH_PCT:.0f}%" + (" (full run)" if p.quick else ""),
            {"afmd": growth, "mlx_lm_server": AFMD_ONLY, "raw": NO_RAW}, rule,
            note=f"bench/soak.py on {soak.MODEL}, {p.soak_concurrency} requests in flight: "
                 "streamed and non-streamed completions, streams cancelled and dropped, "
                 "400s, tool_choice required and json_schema (every fourth with a new "
                 "grammar), second turns; VmRSS after each round with the server idle "
                 "(measurements.afmd.soak_rss_mib, round 0 before any request). The "
                 "plateau is the last round's RSS against the middle round's: the first "
                 "rounds pay one-time costs, a per-request leak keeps growing after them"),
        Row("slowloris_legit_success",
            f"slowloris: legitimate requests answered 200 under {p.slowloris_attackers} "
            f"attackers trickling a byte a second, {limit} (%)",
            "afmd ≥ 90%", {"afmd": success, "mlx_lm_server": AFMD_ONLY, "raw": NO_RAW},
            Threshold(afmd(success), ">=", 90.0, figures=attack_figures,
                      detail=attack_detail),
            note=f"bench/slowloris.py: the attackers reconnect at once when shed and hold "
                 f"the slots for {p.slowloris_warmup:g} s, then {p.slowloris_legit} "
                 f"legitimate clients send requests on fresh connections for "
                 f"{p.slowloris_seconds:g} s, one at a time (GET /health; every "
                 f"{slowloris.CHAT_EVERY}th a 2-token chat completion), each with a "
                 f"{slowloris.TIMEOUT:g} s limit"),
    ]


def _vision() -> Row:
    """bench/vision.py: what a vision request beside them costs text streams."""
    def pct(s: SystemResults) -> Value | None:
        return s.vision.pct

    return Row(
        "vision_beside_text_aggregate",
        "aggregate tok/s of 4 text streams (demo-32k) beside a vision request (demo-vision, "
        "a 112x112 picture), % of alone", "report",
        {"afmd": pct, "mlx_lm_server": AFMD_ONLY, "raw": NO_RAW},
        note="a vision model decodes one sequence at a time on its own thread; text "
             "requests never batch with it, they share the cores. Per run, the same four "
             "greedy streams alone and beside the vision request (which starts first and "
             "ends last); its own first token and decode rate: "
             "measurements.afmd.vision_vision_ttft_ms, vision_vision_tps")


def _models() -> list[Row]:
    """bench/models.py: a load's cost in time to first token, and switching models."""
    m = "a request for demo-32k"
    cases = (
        ("model_load_cold_ttft_ms", f"{m} not loaded yet (cold): time to first token (ms)",
         lambda s: s.models.cold_ttft_ms, "the first load in a fresh afmd (its default "
         "demo loaded); the files were just built, so the page cache holds them"),
        ("model_load_warm_ttft_ms", f"{m} after an unload (warm page cache): time to first "
         "token (ms)", lambda s: s.models.warm_ttft_ms,
         "the request before had keep_alive 0; already loaded, the same request takes "
         "measurements.afmd.models_loaded_ttft_ms"),
        ("model_switch_within_ttft_ms", "two models alternating, within the budget (both "
         "stay loaded): time to first token (ms)", lambda s: s.models.within_ttft_ms,
         "max_loaded = 3; loads during the alternation: measurements.afmd.models_loads"),
        ("model_switch_over_ttft_ms", "two models alternating, over the budget (max_loaded "
         "1: a reload each time): time to first token (ms)",
         lambda s: s.models.over_ttft_ms, "each request unloads the other model and "
                                          "loads its own"),
    )
    return [Row(rid, title, "report", {"afmd": pick, "mlx_lm_server": AFMD_ONLY,
                                       "raw": NO_RAW}, note=note)
            for rid, title, pick, note in cases]


def _extras(p: Plan) -> list[Row]:
    def big(pick: Pick) -> dict[str, Pick | Missing]:
        return all3(pick) if p.big else dict.fromkeys(SYSTEMS, NO_BIG)

    def big_single(s: SystemResults) -> Value | None:
        return s.extras.big_single_tps

    def big_c8(s: SystemResults) -> Value | None:
        return s.extras.big_agg_tps_c8

    return [
        Row("access_log_single_tps", "single-stream tok/s, access_log = true", "report",
            {"afmd": lambda s: s.extras.access_log_single_tps, "mlx_lm_server": NA,
             "raw": NA}),
        Row("access_log_aggregate_tps_c8", "aggregate tok/s at 8, access_log = true",
            "report", {"afmd": lambda s: s.extras.access_log_agg_tps_c8,
                       "mlx_lm_server": NA, "raw": NA}),
        Row("big_single_stream_tps",
            f"compute-bound (h512×8L): single-stream tok/s ({BIG_MAX_TOKENS} tokens)",
            "report", big(big_single), ratios_detail(big_single)),
        Row("big_aggregate_tps_c8",
            f"compute-bound (h512×8L): aggregate tok/s at 8 ({BIG_MAX_TOKENS} tokens each)",
            "report", big(big_c8), ratios_detail(big_c8)),
    ]


def distributed_rows(measured: bool = True, max_tokens: int = distributed.MAX_TOKENS,
                     streams: int = distributed.STREAMS,
                     model: str = distributed.BIG_TITLE) -> list[Row]:
    """bench/distributed.py: 2 ranks (tensor, pipeline) against 1, compute-bound model."""
    def pick(key: str) -> Pick:
        return lambda s: s.distributed.get(key)

    def values(key: str) -> dict[str, Pick | Missing]:
        return ({"afmd": pick(key), "mlx_lm_server": AFMD_ONLY, "raw": NO_RAW} if measured
                else dict.fromkeys(SYSTEMS, NO_BIG))

    def got(res: Measurements, key: str) -> str:
        return fmt(res.afmd.distributed.get(key))

    def rate(name: str, kind: str) -> Reported:
        def detail(res: Measurements) -> str:
            if res.afmd.distributed.get(f"{name}_{kind}_x") is None:
                return ""
            idle = (res.afmd.distributed.idle_cpu_pct or {}).get(name)
            return (f"in turns {got(res, f'{name}_{kind}_tps')} against 1 rank "
                    f"{got(res, f'one_{kind}_tps')}; idle, the group takes "
                    f"{num(idle, '.1f', '%')} of a core")
        return Reported(detail)

    def traffic(name: str) -> Reported:
        def detail(res: Measurements) -> str:
            if res.afmd.distributed.get(f"{name}_single_bytes_per_token") is None:
                return ""
            return (f"{streams} streams {got(res, f'{name}_agg_bytes_per_token')}; per "
                    f"position computed (prompt not cached + generated) "
                    f"{got(res, f'{name}_single_bytes_per_position')} / "
                    f"{got(res, f'{name}_agg_bytes_per_position')}; "
                    f"loopback counter {got(res, f'{name}_single_lo_bytes_per_token')} / "
                    f"{got(res, f'{name}_agg_lo_bytes_per_token')} against 1 rank's HTTP "
                    f"{got(res, 'one_single_lo_bytes_per_token')} / "
                    f"{got(res, 'one_agg_lo_bytes_per_token')}")
        return Reported(detail)

    how = ("bench/distributed.py: afmd serve and two afmd launch -n 2 groups (MLX ring "
           "backend over loopback) of the same model up side by side, one working at a "
           "time (the others stopped); each round the same new greedy prompts to each, the "
           "order rotating; the value is the median of per-round ratios. Both ranks share "
           "the cores the one process had alone")
    rows = []
    for name in distributed.STRATEGIES:
        rows += [
            Row(f"distributed_{name}_single_tps", f"2 ranks, {name} split, {model}: "
                f"single-stream tok/s ({max_tokens} tokens), × 1 rank", "report",
                values(f"{name}_single_x"), rate(name, "single"), how),
            Row(f"distributed_{name}_aggregate_tps_c{streams}", f"2 ranks, {name} split, "
                f"{model}: aggregate tok/s at {streams} ({max_tokens} tokens each), × 1 rank",
                "report", values(f"{name}_agg_x"), rate(name, "agg"), how),
            Row(f"distributed_{name}_bytes_per_token", f"2 ranks, {name} split: bytes "
                "between the ranks per generated token, one stream", "report",
                values(f"{name}_single_bytes_per_token"), traffic(name),
                "payload the ranks received from each other over TCP (their sockets' "
                "counters: collectives, step plans, heartbeats) / completion tokens, "
                "prefill included; the loopback counter adds headers, HTTP and the host's "
                "other loopback traffic"),
        ]
    return rows


def _ttft_split(a: SystemResults) -> str:
    q, e, o = (med(v) for v in (a.ttft.server_queue_ms, a.ttft.server_engine_ms,
                                a.ttft.outside_server_ms))
    if q is None or e is None or o is None:
        return "n/a"
    return (f"arrival → engine admission {q:.1f} ms, admission → first token {e:.1f} ms, "
            f"outside those (HTTP in/out, first-token hand-off) {o:.1f} ms")


def _prompt(res: Measurements, kind: str) -> str:
    """A grammar request's prompt tokens as afmd counted them (the longest run's)."""
    seen = [n for n in res.afmd.grammar.kind(kind).prompt_tokens or () if n]
    return str(max(seen)) if seen else "?"
