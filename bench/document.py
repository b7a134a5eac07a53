"""The results document (JSON), its table (Markdown) and its plot (PNG), and where they go.

The JSON's shape is what earlier runs in bench/results/ were written with (meta, rows,
series, measurements, profile), so runs stay comparable with a plain diff of their keys.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import report, rows
from bench.plan import SYSTEMS, Ctx


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    from importlib import metadata

    for name in ("afmd", "mlx-lm", "mlx", "sanic"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def build(ctx: Ctx, args: argparse.Namespace | None, today: str, host: str, seconds: float,
          binary: Path | None) -> dict[str, Any]:
    """The whole document: the run's meta, the rows with verdicts, every measurement."""
    plan = ctx.plan
    v = versions()
    cpus = os.cpu_count() or 1
    load = ctx.loads
    busiest = max((x[0] for x in load.values()), default=0.0)
    prof = ctx.res.afmd.pyspy or {}
    straces = {s: ctx.res[s].strace for s in ("afmd", "mlx_lm_server") if ctx.res[s].strace}
    return {
        "meta": {
            "date": today,
            "host": host,
            "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1),
            "quick": plan.quick,
            "cpus": cpus,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "afmd_version": v["afmd"],
            "mlx_lm_version": v["mlx-lm"],
            "mlx_version": v["mlx"],
            "sanic_version": v["sanic"],
            "model": "demo-32k (Qwen2, hidden 64 × 2 layers, 32k vocab, random weights)",
            "runs": plan.runs,
            "max_tokens": plan.max_tokens,
            "plan": asdict(plan),
            "loadavg": {"start": load.get("start"), "end": load.get("end"), "by_phase": load},
            "provisional": busiest > 0.5 * cpus,
            "provisional_reason": (
                f"load average reached {busiest:.1f} on {cpus} CPUs: other work shared the "
                "machine, numbers are provisional" if busiest > 0.5 * cpus else None),
            "binary": str(binary) if binary else None,
            "argv": sys.argv[1:] if args else [],
        },
        "rows": rows.evaluate(rows.declare(plan), ctx.res),
        "series": {"aggregate_tps": {
            s: {str(c): _json(ctx.res[s].level(c).tps) for c in plan.levels} for s in SYSTEMS
        }},
        "measurements": ctx.res.to_json(),
        "profile": {"pyspy": prof, "strace": straces,
                    "summary_text": _profile_text(prof, straces)},
    }


def _json(v: Any) -> Any:
    return None if v is None else v.to_json()


def _profile_text(prof: dict[str, Any], straces: dict[str, Any]) -> str:
    """py-spy's per-scenario summaries, then syscalls per token, for the table's footer."""
    text = "\n\n".join(v.get("text", "") for v in prof.values() if isinstance(v, dict))
    if straces:
        lines = []
        for s, by in straces.items():
            for n, v in by.items():
                if "per_token" in v:
                    top = ", ".join(f"{k} {x}" for k, x in list(v["per_token"].items())[:6])
                    lines.append(f"[{s}, {n} stream(s)] syscalls/token "
                                 f"{v['total_per_token']}: {top}")
        text = (text + "\n\nstrace -c -f:\n" + "\n".join(lines)).strip()
    return text


def write(doc: dict[str, Any], out_dir: Path, stem: str, log: Callable[[str], None]
          ) -> Path:
    """``<stem>.png`` (or why not), ``<stem>.json`` (atomically), ``<stem>.md``; the table
    is also printed."""
    json_path = out_dir / f"{stem}.json"
    png_path = out_dir / f"{stem}.png"
    skipped = report.plot(doc, png_path)
    if skipped:
        doc["plot_skipped"] = skipped
        log(f"plot skipped: {skipped}")
    else:
        doc["plot"] = str(png_path)
    tmp_json = json_path.with_suffix(".json.tmp")
    tmp_json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp_json.replace(json_path)
    md = report.markdown(doc)
    (out_dir / f"{stem}.md").write_text(md)
    print()
    print(md)
    log(f"wrote {json_path}")
    return json_path
