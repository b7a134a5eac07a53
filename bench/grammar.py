"""The grammar rows: constrained requests against unconstrained twins of equal length.

Only afmd has these rows (mlx_lm.server has no response_format or tool_choice grammar,
raw mlx-lm no grammar at all), so afmd is compared with itself on the same prompts.
"""

from __future__ import annotations

import json
from typing import Any

from bench import client, workload
from bench.measure import HOST, Batch, concurrent, first_error
from bench.plan import GRAMMAR_KINDS, Ctx
from bench.results import Grammar, GrammarKind, stat


async def m_grammar(ctx: Ctx, port: int, tag: str) -> Grammar:
    """Each constrained request, then its unconstrained twin held to the same length.

    A grammar ends its output when the value is complete (a json_schema record here is
    100-256 tokens), while free text runs to max_tokens; a batch whose rows finish early
    decodes its tail with fewer rows, so unequal lengths alone made a constrained batch
    look ~10% slower. Each twin (for tools, the tool block as text) gets, row
    by row, max_tokens = the tokens its constrained request produced, and a prompt of its
    own (see ``_bodies``). The order of the two grammar kinds alternates run by run so
    drift hits both alike.
    """
    p = ctx.plan
    mt = p.grammar_max_tokens
    kinds = ("unconstrained", "tools_as_text", *GRAMMAR_KINDS)
    # Warm-up: the first constrained request builds llguidance's tokenizer view.
    for k in kinds:
        await client.stream_chat(HOST, port, workload.grammar_bodies(
            workload.prompt(f"{tag}-gwarm"), 16)[k], timeout=p.timeout)
    alone: dict[str, list[client.StreamResult]] = {k: [] for k in kinds}
    batch: dict[str, list[Batch]] = {k: [] for k in kinds}
    for r in range(p.grammar_runs):
        order = GRAMMAR_KINDS if r % 2 == 0 else GRAMMAR_KINDS[::-1]
        for a in range(p.grammar_alone):
            for k in order:
                i = r * p.grammar_alone + a
                twin = workload.GRAMMAR_BASELINE[k]
                body = _bodies(tag, "g", k, i, mt)[k]
                done = await client.stream_chat(HOST, port, body, timeout=p.timeout)
                alone[k].append(done)
                body = _held_to(_bodies(tag, "u", k, i, mt)[twin], done, mt)
                alone[twin].append(await client.stream_chat(HOST, port, body,
                                                            timeout=p.timeout))
        for k in order:
            twin = workload.GRAMMAR_BASELINE[k]
            n = p.grammar_batch
            done_batch = await concurrent(
                port, [_bodies(tag, f"gb{r}", k, i, mt)[k] for i in range(n)], p.timeout)
            batch[k].append(done_batch)
            rows: list[client.StreamResult | None] = (
                list(done_batch.results) if done_batch.results else [None] * n)
            batch[twin].append(await concurrent(
                port, [_held_to(_bodies(tag, f"ub{r}", k, i, mt)[twin], d, mt)
                       for i, d in enumerate(rows)], p.timeout))
    out = Grammar()
    for k in kinds:
        out.kinds[k] = _kind(alone, batch, k)
        if k == "json_schema":
            out.json_valid = [_valid_json(r) for r in alone[k] if r.ok]
    return out


def _kind(alone: dict[str, list[client.StreamResult]], batch: dict[str, list[Batch]],
          k: str) -> GrammarKind:
    """One kind's rates; for a constrained kind also its rate against its twins."""
    why = first_error(alone[k])
    bwhy = next((x.error for x in batch[k] if x.error is not None), None)
    out = GrammarKind(
        alone_tps=stat([r.e2e_tps if r.ok else None for r in alone[k]], "tok/s", reason=why),
        alone_decode_tps=stat([r.decode_tps if r.ok else None for r in alone[k]], "tok/s",
                              reason=why),
        prompt_tokens=[r.prompt_tokens for r in alone[k]],
        alone_tokens=[r.tokens for r in alone[k]],
        alone_finish=[r.finish_reason for r in alone[k]],
        batch_tps=stat([x.agg_tps for x in batch[k]], "tok/s", reason=bwhy),
        batch_decode_tps=stat([x.decode_agg_tps for x in batch[k]], "tok/s", reason=bwhy),
    )
    if k not in GRAMMAR_KINDS:
        return out
    # Against the same prompt without a grammar (workload.GRAMMAR_BASELINE): end to
    # end, the verdict, and the decode phase alone (prefill excluded), for the detail.
    base_alone = alone[workload.GRAMMAR_BASELINE[k]]
    base_batch = batch[workload.GRAMMAR_BASELINE[k]]
    for suffix, attr, agg in (("", "e2e_tps", "agg_tps"),
                              ("_decode", "decode_tps", "decode_agg_tps")):
        pairs = [(getattr(c, attr), getattr(u, attr))
                 for c, u in zip(alone[k], base_alone, strict=True) if c.ok and u.ok]
        setattr(out, f"alone{suffix}_pct", stat(
            [c / u for c, u in pairs if c and u], "%", scale=100,
            reason=why or first_error(base_alone)))
        bpairs = [(getattr(c, agg), getattr(u, agg))
                  for c, u in zip(batch[k], base_batch, strict=True)]
        setattr(out, f"batch{suffix}_pct", stat(
            [c / u for c, u in bpairs if c and u], "%", scale=100, reason=bwhy))
    return out


def _bodies(tag: str, group: str, kind: str, i: int, max_tokens: int
            ) -> dict[str, dict[str, Any]]:
    """``workload.grammar_bodies`` for a prompt unique to (group, kind, i).

    A constrained request and its twin get different prompts of the same length: with
    one prompt, the twin (sent second) would be a full prefix-cache hit.
    """
    return workload.grammar_bodies(workload.prompt(f"{tag}-{group}-{kind}", i), max_tokens)


def _held_to(body: dict[str, Any], done: client.StreamResult | None, default: int
             ) -> dict[str, Any]:
    """``body`` limited to as many tokens as ``done`` (its constrained twin) produced."""
    n = done.tokens if done is not None and done.ok and done.tokens > 0 else default
    return {**body, "max_tokens": n}


def _valid_json(r: client.StreamResult) -> bool | None:
    if r.finish_reason != "stop":
        return None  # cut by max_tokens: incomplete by design
    try:
        json.loads(r.text)
    except ValueError:
        return False
    return True
