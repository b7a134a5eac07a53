"""The log-probabilities row: greedy decode with ``top_logprobs: 5`` against without.

afmd only (mlx_lm.server's logprobs are another implementation; raw mlx-lm computes them
for every row anyway). Each pair is two single-stream chat completions of equal-length
unique prompts, one with ``logprobs: true, top_logprobs: 5`` and one without, the second
held to the tokens the first produced and the order alternating pair by pair, so drift
and unequal lengths hit both alike. The rate is the decode phase's (tokens after the
first over first → last delta): what asking for log-probabilities costs per token.
"""

from __future__ import annotations

from typing import Any

from bench import client, workload
from bench.measure import HOST, first_error
from bench.plan import Ctx
from bench.results import LogprobsRate, stat

TOP = 5


def _body(tag: str, i: int, max_tokens: int, logprobs: bool) -> dict[str, Any]:
    extra = {"logprobs": True, "top_logprobs": TOP} if logprobs else {}
    return workload.chat_body(workload.messages(workload.prompt(f"{tag}-lp", i)), max_tokens,
                              **extra)


async def m_logprobs(ctx: Ctx, port: int, tag: str) -> LogprobsRate:
    p = ctx.plan
    pairs = 2 * p.runs
    await client.stream_chat(HOST, port, _body(f"{tag}-warm", 0, 8, True), timeout=p.timeout)
    asked: list[client.StreamResult] = []
    plain: list[client.StreamResult] = []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        first = await client.stream_chat(HOST, port, _body(tag, 2 * i, p.max_tokens, order[0]),
                                         timeout=p.timeout)
        held = first.tokens if first.ok and first.tokens > 0 else p.max_tokens
        second = await client.stream_chat(HOST, port, _body(tag, 2 * i + 1, held, order[1]),
                                          timeout=p.timeout)
        with_, without = (first, second) if order[0] else (second, first)
        asked.append(with_)
        plain.append(without)
    why = first_error(asked) or first_error(plain)

    def ratio(attr: str) -> list[float | None]:
        out: list[float | None] = []
        for a, b in zip(asked, plain, strict=True):
            x, y = getattr(a, attr), getattr(b, attr)
            out.append(x / y if a.ok and b.ok and x and y else None)
        return out

    return LogprobsRate(
        with_tps=stat([r.decode_tps if r.ok else None for r in asked], "tok/s", reason=why),
        without_tps=stat([r.decode_tps if r.ok else None for r in plain], "tok/s",
                         reason=why),
        pct=stat(ratio("decode_tps"), "%", scale=100, reason=why),
        e2e_pct=stat(ratio("e2e_tps"), "%", scale=100, reason=why),
        tokens=[r.tokens for r in asked],
    )
