"""Cold start and idle memory of fresh processes: afmd (demo model, no model, frozen
binary) and mlx_lm.server with the demo model.

Each is a fresh process measured alone right after /health is ok, so the numbers are
what a user sees at start-up, not after the load rows warmed anything.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from bench import servers
from bench.plan import ROOT, Ctx
from bench.results import null, stat

FROZEN = ("frozen_cold_start_s", "frozen_rss_demo_mb", "frozen_rss_no_model_mb")


async def idle_rss(ctx: Ctx, name: str, *, binary: Path | None = None,
                   no_model: bool = False) -> tuple[float, float | None]:
    """Cold start to /health (s) and idle RSS (MiB) of a fresh afmd (demo model, or none)."""
    extra = ""
    default = "demo"
    if no_model:
        extra = ('\n[[models.model]]\nid = "absent"\n'
                 'path = "/nonexistent/afmd-bench-no-model"\n')
        default = "absent"
    srv = servers.afmd_server(ctx.work, name, cache_root=ctx.cache, binary=binary,
                              default=default, extra_models=extra)
    srv.env["HF_HUB_OFFLINE"] = "1"
    srv.start()
    try:
        if no_model:
            seconds = await srv.ready(want_status=503, reason="model_load_failed")
        else:
            seconds = await srv.ready()
        await asyncio.sleep(0.5)
        return seconds, servers.rss_mb(srv.pid)
    finally:
        srv.stop()


def find_binary(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    # build/build.py writes build/dist/afmd-<version>-<platform>/afmd (the onedir bundle).
    candidates = sorted((ROOT / "build" / "dist").glob("afmd-*/afmd"), reverse=True)
    candidates += [ROOT / "build/dist/afmd/afmd", ROOT / "dist/afmd/afmd"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


async def bench_footprint(ctx: Ctx, binary: Path | None) -> None:
    a = ctx.res.afmd.footprint
    try:
        if not ctx.plan.soak_footprint:  # else bench_soak's fresh demo server is measured
            seconds, rss = await idle_rss(ctx, "afmd-demo")
            a.rss_idle_demo_mb = stat([rss], "MiB")
            a.cold_start_demo_s = stat([seconds], "s")
        if ctx.plan.quick:
            a.rss_no_model_mb = null("skipped in --quick")
        else:
            _, rss = await idle_rss(ctx, "afmd-no-model", no_model=True)
            a.rss_no_model_mb = stat([rss], "MiB")
    except Exception as exc:
        ctx.log(f"  ! afmd footprint failed: {exc}")
        for k in ("rss_idle_demo_mb", "cold_start_demo_s", "rss_no_model_mb"):
            if getattr(a, k) is None:
                setattr(a, k, null(f"failed: {exc}"))
    if binary is None:
        for k in FROZEN:
            setattr(a, k, null("not built (no build/dist/afmd-*/afmd: run build/build.py, "
                               "or pass --binary PATH)"))
        return
    try:
        seconds, rss = await idle_rss(ctx, "afmd-frozen-demo", binary=binary)
        a.frozen_cold_start_s = stat([seconds], "s")
        a.frozen_rss_demo_mb = stat([rss], "MiB")
        _, rss = await idle_rss(ctx, "afmd-frozen-no-model", binary=binary, no_model=True)
        a.frozen_rss_no_model_mb = stat([rss], "MiB")
    except Exception as exc:
        ctx.log(f"  ! frozen binary failed: {exc}")
        for k in FROZEN:
            if getattr(a, k) is None:
                setattr(a, k, null(f"{binary}: {exc}"))


async def bench_mlx_demo_rss(ctx: Ctx) -> None:
    folder = ctx.folders.get("demo")
    if not folder:
        return
    m = ctx.res.mlx_lm_server.footprint
    srv = servers.mlx_server(ctx.work, "mlx-demo", Path(folder))
    srv.start()
    try:
        seconds = await srv.ready()
        await asyncio.sleep(0.5)
        m.rss_idle_demo_mb = stat([servers.rss_mb(srv.pid)], "MiB")
        m.cold_start_demo_s = stat([seconds], "s")
    except Exception as exc:
        m.rss_idle_demo_mb = null(f"failed: {exc}")
    finally:
        srv.stop()
