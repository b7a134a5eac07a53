"""The vision row: what a vision request running beside them costs text requests.

afmd only. A vision model decodes one sequence at a time on its own thread (mlx-vlm), while
text requests on a text model share that model's continuous batch; the two never batch
together, they share the machine. Each run streams ``STREAMS`` concurrent greedy text
requests on ``demo-32k`` twice: alone, and again with a ``demo-vision`` request (a
112x112 picture, greedy, a long answer) generating beside them from before their first
token to after their last. The row is the text streams' aggregate rate beside the vision
request as % of alone, per run (alone and beside alternate in order, so drift hits both).
The vision request's own time to first token (its picture decoded, processed and
prefilled) and decode rate are kept as figures.

Alone (the row's measurement on its own afmd):

    .venv/bin/python bench/vision.py [--runs 3] [--max-tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from bench import client, servers, workload  # noqa: E402
from bench.measure import HOST, first_error  # noqa: E402
from bench.plan import Ctx  # noqa: E402
from bench.results import VisionCost, fmt, null, stat  # noqa: E402

TEXT_MODEL = "demo-32k"
VISION_MODEL = "demo-vision"
STREAMS = 4
SIDE = 112  # the picture's width and height: 16 image tokens on demo-vision
HEAD_START_S = 0.2  # the vision request's lead over the text streams


def picture_url(seed: int) -> str:
    """A noise picture as a PNG data URL (greedy output on noise runs long)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _vision_body(tag: str, i: int, max_tokens: int) -> dict[str, Any]:
    content = [{"type": "text", "text": workload.prompt(f"{tag}-vision", i)},
               {"type": "image_url", "image_url": {"url": picture_url(10)}}]
    return workload.chat_body([{"role": "user", "content": content}], max_tokens,
                              model=VISION_MODEL)


def _aggregate(results: list[client.StreamResult]) -> float | None:
    """Tokens of every stream over the span from the first send to the last end."""
    if not results or not all(r.ok for r in results):
        return None
    span = max(r.t_end for r in results) - min(r.t_send for r in results)
    return sum(r.tokens for r in results) / span if span > 0 else None


async def m_vision(ctx: Ctx, port: int, tag: str) -> VisionCost:
    p = ctx.plan
    max_tokens = max(64, p.max_tokens)
    n = 0

    async def texts() -> list[client.StreamResult]:
        nonlocal n
        n += 1
        bodies = [workload.chat_body(workload.messages(workload.prompt(f"{tag}-{n}", i)),
                                     max_tokens, model=TEXT_MODEL) for i in range(STREAMS)]
        return list(await asyncio.gather(*(client.stream_chat(HOST, port, b,
                                                              timeout=p.timeout)
                                           for b in bodies)))

    async def vision(i: int, tokens: int) -> client.StreamResult:
        return await client.stream_chat(HOST, port, _vision_body(tag, i, tokens),
                                        timeout=p.timeout)

    await texts()  # warm: both models loaded, their first requests paid
    await vision(0, 8)
    alone: list[float | None] = []
    beside: list[float | None] = []
    pct: list[float | None] = []
    vision_ttft: list[float | None] = []
    vision_tps: list[float | None] = []
    errors: list[client.StreamResult] = []
    for run in range(p.runs):
        solo = beside_rate = None
        for with_vision in ((False, True) if run % 2 == 0 else (True, False)):
            if not with_vision:
                done = await texts()
                solo = _aggregate(done)
                errors += done
                continue
            # Long enough to outlast the text streams: they decode several times faster
            # together than one vision sequence does alone, prefill aside.
            side = asyncio.create_task(vision(run + 1, 8 * max_tokens))
            await asyncio.sleep(HEAD_START_S)  # its picture processed, prefill under way
            done = await texts()
            beside_rate = _aggregate(done)
            errors += done
            picture = await side
            errors.append(picture)
            ok = picture.ok and picture.t_end >= max(r.t_end for r in done)
            beside_rate = beside_rate if ok else None
            vision_ttft.append(picture.t_first - picture.t_send if picture.ok else None)
            vision_tps.append(picture.decode_tps if picture.ok else None)
        alone.append(solo)
        beside.append(beside_rate)
        pct.append(beside_rate / solo if solo and beside_rate else None)
    why = first_error(errors) or "the vision request ended before the text streams"
    return VisionCost(
        text_alone_tps=stat(alone, "tok/s", reason=why),
        text_beside_tps=stat(beside, "tok/s", reason=why),
        pct=stat(pct, "%", scale=100, reason=why),
        vision_ttft_ms=stat(vision_ttft, "ms", scale=1000, reason=why),
        vision_tps=stat(vision_tps, "tok/s", reason=why),
        setup={"text_model": TEXT_MODEL, "vision_model": VISION_MODEL, "streams": STREAMS,
               "max_tokens": max_tokens, "picture": f"{SIDE}x{SIDE} PNG", "runs": p.runs},
    )


async def _served(ctx: Ctx) -> VisionCost:
    srv = servers.afmd_server(ctx.work / "vision", "afmd-vision", cache_root=ctx.cache,
                              default=TEXT_MODEL, max_concurrent=STREAMS + 2)
    srv.start()
    try:
        await srv.ready()
        return await m_vision(ctx, srv.port, "vision")
    finally:
        srv.stop()


async def bench_vision(ctx: Ctx) -> None:
    """The phase in the main benchmark: its own afmd, so nothing else runs beside."""
    ctx.load_note("vision-start")
    try:
        ctx.res.afmd.vision = await _served(ctx)
    except Exception as exc:
        ctx.log(f"  ! afmd vision failed: {exc!r}")
        ctx.res.afmd.errors["vision"] = f"{type(exc).__name__}: {exc}"
        reason = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
        ctx.res.afmd.vision = VisionCost(pct=null(reason, "%"))
        return
    finally:
        ctx.load_note("vision-end")
    v = ctx.res.afmd.vision
    ctx.log(f"  {STREAMS} text streams beside a vision request: {fmt(v.pct)} of alone "
            f"({fmt(v.text_beside_tps)} vs {fmt(v.text_alone_tps)}); the vision request: "
            f"first token {fmt(v.vision_ttft_ms)}, {fmt(v.vision_tps)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    from afmd.engine.demo import builtin as demo
    from bench.plan import Plan
    from bench.run import _parser

    plan = Plan.make(_parser().parse_args(["--quick"]))
    plan.runs, plan.max_tokens = max(1, args.runs), args.max_tokens
    work = Path(tempfile.mkdtemp(prefix="afmd-bench-vision-"))
    for variant in (TEXT_MODEL, VISION_MODEL):
        demo.materialize(variant, work / "cache")
    ctx = Ctx(plan=plan, work=work, cache=work / "cache", folders={}, log=lambda _: None)
    result = asyncio.run(_served(ctx))
    if args.json:
        print(json.dumps(dict(result.items())))
        return 0
    print(f"{STREAMS} greedy text streams on {TEXT_MODEL} ({max(64, plan.max_tokens)} tokens "
          f"each): {fmt(result.text_alone_tps)} alone, {fmt(result.text_beside_tps)} beside "
          f"a {VISION_MODEL} request; per-run ratio {fmt(result.pct)}")
    print(f"the vision request ({SIDE}x{SIDE} PNG): first token {fmt(result.vision_ttft_ms)}, "
          f"decode {fmt(result.vision_tps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
