"""Embedding throughput: afmd serving concurrent requests against in-process encoding.

Each afmd round sends ``--requests`` concurrent ``POST /v1/embeddings`` requests (32 by
default) of ``--inputs`` texts each (8), ``encoding_format: "base64"`` as the openai SDK
asks by default, to an ``afmd serve`` this script starts on the built-in
``demo-embedding`` model. Each in-process round encodes the very same texts in this
process with mlx-lm alone (tokenize, right-pad, run ``model.model``, take the last token's
hidden state, L2-normalize), one call per request's inputs, as an application embedding
its own batches would; a second in-process figure encodes all the texts in one call. The
rounds run in turns (afmd, in-process, afmd, …; one warm-up round each first) so both
see the same machine, and each figure is the median over ``--rounds``.

    .venv/bin/python bench/embeddings.py                  # 5 rounds each, ~1 minute here
    .venv/bin/python bench/embeddings.py --rounds 2 --json
    .venv/bin/python bench/embeddings.py --max-concurrent 16

The verdict is afmd's inputs/s over the per-request in-process inputs/s (target ≥ 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import client
from bench.servers import HOST, afmd_server

MODEL = "demo-embedding"
TARGET = 0.8
_WORDS = (
    "model", "vector", "search", "query", "document", "local", "server", "token", "batch",
    "embed", "text", "context", "apple", "silicon", "memory", "fast", "small", "cache",
    "layer", "weight", "random",
)


def make_texts(requests: int, inputs: int, seed: int = 0) -> list[list[str]]:
    """Sentences of 6-40 words, different per request, the same every run."""
    rng = np.random.default_rng(seed)
    return [
        [" ".join(rng.choice(_WORDS, int(rng.integers(6, 41)))) for _ in range(inputs)]
        for _ in range(requests)
    ]


@dataclass
class Result:
    requests: int
    inputs: int
    max_concurrent_requests: int
    rounds: int
    tokens: int = 0
    afmd_inputs_per_s: list[float] = field(default_factory=list)
    in_process_inputs_per_s: list[float] = field(default_factory=list)
    in_process_one_call_inputs_per_s: list[float] = field(default_factory=list)
    max_abs_difference: float = 0.0

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))

    @property
    def ratio(self) -> float:
        return self.median("afmd_inputs_per_s") / self.median("in_process_inputs_per_s")


class InProcess:
    """mlx-lm alone, in this process: what afmd's throughput is measured against."""

    def __init__(self, folder: Path) -> None:
        import mlx_lm

        self.model, self.tokenizer = mlx_lm.load(str(folder))

    def encode(self, texts: list[str]) -> np.ndarray:
        import mlx.core as mx

        ids = [self.tokenizer.encode(t) for t in texts]
        lengths = np.array([len(i) for i in ids])
        padded = np.zeros((len(ids), int(lengths.max())), dtype=np.int32)
        for row, seq in enumerate(ids):
            padded[row, : len(seq)] = seq
        hidden = self.model.model(mx.array(padded))
        last = hidden[mx.arange(len(ids)), mx.array(lengths - 1)].astype(mx.float32)
        vectors = np.array(last)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    def tokens(self, batches: list[list[str]]) -> int:
        return sum(len(self.tokenizer.encode(t)) for texts in batches for t in texts)


async def afmd_round(port: int, batches: list[list[str]]) -> tuple[float, list[np.ndarray]]:
    async def one(texts: list[str]) -> np.ndarray:
        status, body = await client.request(
            HOST, port, "POST", "/v1/embeddings",
            {"model": MODEL, "input": texts, "encoding_format": "base64"}, timeout=120.0,
        )
        if status != 200:
            raise RuntimeError(f"afmd answered {status}: {body}")
        rows = sorted(body["data"], key=lambda d: d["index"])
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in rows])

    start = time.perf_counter()
    vectors = await asyncio.gather(*(one(texts) for texts in batches))
    return time.perf_counter() - start, list(vectors)


def in_process_round(engine: InProcess, batches: list[list[str]]) -> tuple[float, float]:
    start = time.perf_counter()
    for texts in batches:
        engine.encode(texts)
    per_request = time.perf_counter() - start
    start = time.perf_counter()
    engine.encode([t for texts in batches for t in texts])
    return per_request, time.perf_counter() - start


async def run(args: argparse.Namespace) -> Result:
    from afmd.engine.demo import builtin as demo

    result = Result(args.requests, args.inputs, args.max_concurrent, args.rounds)
    batches = make_texts(args.requests, args.inputs)
    count = args.requests * args.inputs
    with tempfile.TemporaryDirectory(prefix="afmd-bench-embeddings-") as tmp:
        root = Path(tmp)
        folder = demo.materialize(MODEL, root / "cache")
        engine = InProcess(folder)
        result.tokens = engine.tokens(batches)
        server = afmd_server(root, "afmd-embeddings", cache_root=root / "cache",
                             default=MODEL, max_concurrent=args.max_concurrent).start()
        try:
            await server.ready()
            _, warm = await afmd_round(server.port, batches)  # loads the model
            expected = [engine.encode(texts) for texts in batches]
            result.max_abs_difference = float(max(
                np.abs(a - b).max() for a, b in zip(warm, expected, strict=True)))
            for _ in range(args.rounds):
                seconds, _ = await afmd_round(server.port, batches)
                result.afmd_inputs_per_s.append(count / seconds)
                per_request, one_call = in_process_round(engine, batches)
                result.in_process_inputs_per_s.append(count / per_request)
                result.in_process_one_call_inputs_per_s.append(count / one_call)
        finally:
            server.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--inputs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-concurrent", type=int, default=4,
                        help="afmd's [queue] max_concurrent_requests (its default: 4)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    summary: dict[str, Any] = {
        **asdict(result),
        "median_afmd_inputs_per_s": round(result.median("afmd_inputs_per_s"), 1),
        "median_in_process_inputs_per_s": round(result.median("in_process_inputs_per_s"), 1),
        "median_in_process_one_call_inputs_per_s": round(
            result.median("in_process_one_call_inputs_per_s"), 1),
        "ratio": round(result.ratio, 3),
        "target": TARGET,
        "passed": result.ratio >= TARGET,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{args.requests} concurrent requests × {args.inputs} inputs "
              f"({result.tokens} tokens), {args.rounds} rounds in turns, "
              f"max_concurrent_requests = {args.max_concurrent}")
        for label, key in (("afmd (HTTP, batched)", "median_afmd_inputs_per_s"),
                           ("in process, one call per request", "median_in_process_inputs_per_s"),
                           ("in process, all in one call",
                            "median_in_process_one_call_inputs_per_s")):
            print(f"  {label:36s} {summary[key]:10.1f} inputs/s")
        print(f"  afmd / in process: {summary['ratio']:.2f} (target ≥ {TARGET}); "
              f"largest difference between their vectors {result.max_abs_difference:.1e}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
