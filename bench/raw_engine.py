"""The ceiling: mlx-lm generation in-process, no server (run as a subprocess by run.py).

``python bench/raw_engine.py materialize CACHE_ROOT [--big]`` builds the models and prints
their folders as JSON; ``python bench/raw_engine.py measure SPEC.json OUT.json`` runs the
raw measurements the spec asks for. Raw timings start at the message list (the chat
template and tokenisation are inside, as every server must do them too); the
``*_from_tokens`` twins start at the token ids.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

perf = time.perf_counter
MAX_BATCH = 16  # afmd's bench config: [queue] max_concurrent_requests = 16

# The optional compute-bound model: demo-32k (its config and tokenizer) made larger.
BIG_SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "intermediate_size": 1408,
}


def build_big(base: Path, cache_root: Path) -> Path:
    """A random hidden-512 × 8-layer Qwen2 with demo-32k's tokenizer, built once."""
    import mlx.core as mx
    import numpy as np

    base_config = json.loads((base / "config.json").read_text())
    arch = {**base_config, **BIG_SHAPE}
    arch.pop("afmd_demo", None)
    digest = hashlib.sha256(
        json.dumps([BIG_SHAPE, base.name, 1], sort_keys=True).encode()
    ).hexdigest()[:12]
    target = cache_root / "models" / f"bench-big-{digest}"
    if (target / "model.safetensors").is_file():
        return target
    tmp = cache_root / "models" / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = base_config["vocab_size"]
    h, inter = arch["hidden_size"], arch["intermediate_size"]
    head_dim = h // arch["num_attention_heads"]
    kv = arch["num_key_value_heads"] * head_dim
    rng = np.random.default_rng(0)

    def uniform(shape: tuple[int, ...], fan_in: int) -> mx.array:
        bound = fan_in ** -0.5
        return mx.array(rng.uniform(-bound, bound, size=shape).astype(np.float32))

    weights: dict[str, mx.array] = {
        "model.embed_tokens.weight": mx.array(
            rng.normal(0, h ** -0.5, size=(vocab, h)).astype(np.float32)),
        "model.norm.weight": mx.ones((h,)),
        "lm_head.weight": mx.array(rng.normal(0, 0.4 / h ** 0.5 * 8, size=(vocab, h))
                                   .astype(np.float32)),
    }
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights.update({
            f"{p}.input_layernorm.weight": mx.ones((h,)),
            f"{p}.post_attention_layernorm.weight": mx.ones((h,)),
            f"{p}.self_attn.q_proj.weight": uniform((h, h), h),
            f"{p}.self_attn.q_proj.bias": uniform((h,), h),
            f"{p}.self_attn.k_proj.weight": uniform((kv, h), h),
            f"{p}.self_attn.k_proj.bias": uniform((kv,), h),
            f"{p}.self_attn.v_proj.weight": uniform((kv, h), h),
            f"{p}.self_attn.v_proj.bias": uniform((kv,), h),
            f"{p}.self_attn.o_proj.weight": uniform((h, h), h),
            f"{p}.mlp.gate_proj.weight": uniform((inter, h), h),
            f"{p}.mlp.up_proj.weight": uniform((inter, h), h),
            f"{p}.mlp.down_proj.weight": uniform((h, inter), inter),
        })
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(arch, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, tmp / name)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def materialize(cache_root: Path, big: bool) -> dict[str, str | None]:
    from afmd.engine.demo import builtin as demo

    out: dict[str, str | None] = {}
    for variant in ("demo", "demo-32k"):
        out[variant] = str(demo.materialize(variant, cache_root))
    out["big"] = str(build_big(Path(out["demo-32k"] or ""), cache_root)) if big else None
    return out


# -- measurements ------------------------------------------------------------------------


class Raw:
    def __init__(self, folder: str) -> None:
        from mlx_lm import load
        from mlx_lm.sample_utils import make_sampler

        self.model, self.tok = load(folder)
        self.greedy = make_sampler(0.0)
        self.eos = sorted(self.tok.eos_token_ids)
        self._gen: Any = None

    def prompt(self, msgs: list[dict[str, Any]]) -> list[int]:
        return list(self.tok.apply_chat_template(msgs, add_generation_prompt=True))

    def stream(self, msgs: list[dict[str, Any]], max_tokens: int, *, cache: Any = None,
               prompt: list[int] | None = None, stop_after: int | None = None
               ) -> dict[str, Any]:
        from mlx_lm import stream_generate

        t0 = perf()
        ids = prompt if prompt is not None else self.prompt(msgs)
        t_tok = perf()
        first = last = 0.0
        n = 0
        text: list[str] = []
        tokens: list[int] = []
        kwargs = {"prompt_cache": cache} if cache is not None else {}
        for resp in stream_generate(self.model, self.tok, ids, max_tokens=max_tokens,
                                    sampler=self.greedy, **kwargs):
            now = perf()
            if resp.finish_reason != "stop" or resp.token not in self.eos:
                n += 1
                tokens.append(resp.token)
            text.append(resp.text)
            if not first:
                first = now
            last = now
            if stop_after is not None and n >= stop_after:
                break
        return {
            "t_first": first,
            "ttft": first - t0,
            "ttft_from_tokens": first - t_tok,
            "tokens": n,
            "decode_tps": (n - 1) / (last - first) if n > 1 and last > first else None,
            "e2e_tps": n / (last - t0) if last > t0 else None,
            "stream_tps": n / (last - t0) if last > t0 else None,
            "text": "".join(text),
            "prompt": ids,
            "generated": tokens,
        }

    def batch(self, prompts: list[list[dict[str, Any]]], max_tokens: int) -> dict[str, Any]:
        """All prompts inserted at once into one long-lived BatchGenerator (as a server
        keeps one), run until every sequence is done."""
        from mlx_lm.generate import BatchGenerator

        n = len(prompts)
        if self._gen is None:
            self._gen = BatchGenerator(self.model, max_tokens=max_tokens,
                                       stop_tokens=[[t] for t in self.eos],
                                       completion_batch_size=MAX_BATCH,
                                       prefill_batch_size=MAX_BATCH)
        gen = self._gen
        t0 = perf()
        ids = [self.prompt(m) for m in prompts]
        uids = gen.insert(ids, max_tokens=[max_tokens] * n)
        detok = {uid: self.tok.detokenizer for uid in uids}
        first: dict[int, float] = {}
        left = set(uids)
        total = 0
        while left:
            _, responses = gen.next()
            now = perf()
            for r in responses:
                if r.uid not in left:
                    continue
                if not (r.finish_reason == "stop" and r.token in self.eos):
                    total += 1
                    detok[r.uid].add_token(r.token)
                    _ = detok[r.uid].last_segment
                first.setdefault(r.uid, now)
                if r.finish_reason is not None:
                    left.discard(r.uid)
        wall = perf() - t0
        ttfts = sorted(t - t0 for t in first.values())
        return {"tokens": total, "seconds": wall, "agg_tps": total / wall,
                "ttft_median": statistics.median(ttfts) if ttfts else None}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Lists of per-run values (seconds, tok/s); run.py turns them into statistics."""
    from bench import workload

    out: dict[str, Any] = {}
    raw = Raw(spec["folder"])
    runs = spec["runs"]
    tag = spec.get("tag", "raw")
    # Warm up: the first calls compile kernels and fill the allocator's caches.
    raw.stream(workload.messages(workload.prompt(f"{tag}-warm")), 16)
    raw.batch([workload.messages(workload.prompt(f"{tag}-warm", i)) for i in range(4)], 8)

    if "single" in spec:
        mt = spec["single"]["max_tokens"]
        res = [raw.stream(workload.messages(workload.prompt(f"{tag}-single", i)), mt)
               for i in range(runs)]
        out["single"] = {k: [r[k] for r in res]
                         for k in ("decode_tps", "e2e_tps", "stream_tps", "tokens")}
    if "ttft" in spec:
        res = [raw.stream(workload.messages(workload.prompt(f"{tag}-ttft", i)),
                          spec["ttft"]["max_tokens"], stop_after=1)
               for i in range(spec["ttft"]["runs"])]
        out["ttft"] = {k: [r[k] for r in res] for k in ("ttft", "ttft_from_tokens")}
    if "batch" in spec:
        mt = spec["batch"]["max_tokens"]
        out["batch"] = {}
        for c in spec["batch"]["levels"]:
            res = [raw.batch([workload.messages(workload.prompt(f"{tag}-c{c}-{r}", i))
                              for i in range(c)], mt)
                   for r in range(spec["batch"].get("runs", runs))]
            out["batch"][str(c)] = {
                "agg_tps": [r["agg_tps"] for r in res],
                "ttft": [r["ttft_median"] for r in res],
                "tokens": [r["tokens"] for r in res],
            }
    if "prefix" in spec:
        p = spec["prefix"]
        count = workload.TokenCounter(Path(spec["folder"]))
        res = [_prefix_run(raw, workload.prefix_conversation(f"{tag}-prefix-{i}", p["tokens"],
                                                            count), p["max_tokens"])
               for i in range(p.get("runs", runs))]
        out["prefix"] = {k: [r[k] for r in res] for k in res[0]} if res else {}
    return out


def _prefix_run(raw: Raw, conv: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """Turn one from scratch; turn two (template included) on the first turn's KV cache,
    trimmed to the longest prefix it shares with the second prompt (what a perfect
    prefix cache does)."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from bench import workload

    cache = make_prompt_cache(raw.model)
    one = raw.stream(conv, max_tokens, cache=cache)
    held = (one["prompt"] + one["generated"])[: cache[0].offset]
    second_msgs = workload.second_turn(conv, one["text"])
    t0 = perf()
    ids2 = raw.prompt(second_msgs)
    shared = 0
    for a, b in zip(held, ids2, strict=False):
        if a != b:
            break
        shared += 1
    shared = min(shared, len(ids2) - 1)
    trim_prompt_cache(cache, cache[0].offset - shared)
    two = raw.stream([], max_tokens, cache=cache, prompt=ids2[shared:], stop_after=1)
    return {
        "first_ttft": one["ttft"],
        "second_ttft": two["t_first"] - t0,
        "prompt_tokens": len(one["prompt"]),
        "second_prompt_tokens": len(ids2),
        "shared_tokens": shared,
    }


def serve_samples(folder: str) -> None:
    """One raw generation per stdin line (a prompt and a token budget), timed on stdout.

    run.py interleaves these with servers' own requests, one at a time, so a burst of
    noise on a shared machine hits both sides of a comparison alike.
    """
    from bench import workload

    raw = Raw(folder)
    raw.stream(workload.messages("warm up"), 2, stop_after=1)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        res = raw.stream(workload.messages(request["prompt"]), request["max_tokens"],
                         stop_after=request.get("stop_after"))
        print(json.dumps({k: res[k] for k in ("ttft", "stream_tps", "decode_tps", "tokens")}),
              flush=True)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "materialize":
        print(json.dumps(materialize(Path(argv[1]), "--big" in argv)))
        return 0
    if argv and argv[0] == "sample-server":
        serve_samples(argv[1])
        return 0
    if argv and argv[0] == "measure":
        spec = json.loads(Path(argv[1]).read_text())
        result = measure(spec)
        Path(argv[2]).write_text(json.dumps(result))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
