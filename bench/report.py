"""Turning a results document into a Markdown table and a PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SYSTEMS = (("afmd", "afmd"), ("mlx_lm_server", "mlx_lm.server"), ("raw", "raw mlx-lm"))


def fmt_value(v: dict[str, Any] | None) -> str:
    if not v:
        return "—"
    if v.get("median") is None:
        if v.get("not_applicable"):
            return "—"
        reason = v.get("reason") or "n/a"
        if len(reason) > 60:
            reason = reason[:57] + "…"
        return f"n/a ({reason})"
    unit = v.get("unit", "")
    digits = 0 if abs(v["median"]) >= 100 else (1 if abs(v["median"]) >= 10 else 2)
    text = f"{v['median']:.{digits}f}"
    if v.get("min") is not None and v.get("max") is not None and v.get("n", 1) > 1:
        text += f" ({v['min']:.{digits}f}–{v['max']:.{digits}f})"
    if unit:
        text += f" {unit}"
    return text


def verdict(row: dict[str, Any]) -> str:
    check = row.get("check") or {}
    ok = check.get("pass")
    mark = "✅" if ok is True else ("❌" if ok is False else "·")
    detail = check.get("detail") or ""
    return f"{mark} {detail}".strip()


def markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    load = meta.get("loadavg", {})
    lines = [
        f"# afmd benchmark — {meta['date']} on {meta['host']}",
        "",
        f"mode: {'quick' if meta['quick'] else 'full'}; model: {meta['model']}; "
        f"{meta['cpus']} CPUs; mlx-lm {meta.get('mlx_lm_version')}, afmd "
        f"{meta.get('afmd_version')}; runs per measurement: {meta['runs']}; "
        f"max_tokens {meta['max_tokens']}, greedy.",
        "",
        f"load average at start {load.get('start')}, at end {load.get('end')}"
        + (" — **provisional: the machine was busy**" if meta.get("provisional") else ""),
        "",
        "Values: median (min–max) over the runs; — where a row does not apply.",
        "",
        "| row | afmd | mlx_lm.server | raw mlx-lm | target | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        cells = [fmt_value(row["values"].get(key)) for key, _ in SYSTEMS]
        lines.append(
            f"| {row['title']} | " + " | ".join(cells) + f" | {row['target']} | "
            f"{verdict(row)} |"
        )
    notes = [r for r in doc["rows"] if r.get("note")]
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"- **{r['title']}**: {r['note']}" for r in notes]
    if doc.get("plot"):
        lines += ["", f"![aggregate tok/s vs concurrency]({Path(doc['plot']).name})"]
    elif doc.get("plot_skipped"):
        lines += ["", f"(plot skipped: {doc['plot_skipped']})"]
    prof = doc.get("profile") or {}
    if prof.get("summary_text"):
        lines += ["", "## Profile (afmd)", "", "```", prof["summary_text"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> str | None:
    """Aggregate tok/s against concurrency for the three; None, or why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    series = doc.get("series", {}).get("aggregate_tps", {})
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    drawn = 0
    for key, label in SYSTEMS:
        points = sorted(
            (int(c), v) for c, v in (series.get(key) or {}).items()
            if v and v.get("median") is not None
        )
        if not points:
            continue
        xs = [c for c, _ in points]
        ys = [v["median"] for _, v in points]
        lo = [v["median"] - v.get("min", v["median"]) for _, v in points]
        hi = [v.get("max", v["median"]) - v["median"] for _, v in points]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return "no aggregate measurements"
    ax.set_xscale("log", base=2)
    levels = sorted({int(c) for v in series.values() if v for c in v})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tok/s")
    meta = doc["meta"]
    model = str(meta.get("model", "")).split(" (")[0]
    ax.set_title(f"{model}, {meta['date']} {meta['host']}"
                 + (" (provisional)" if meta.get("provisional") else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
