"""What the grammar compile worker costs: compiles in process vs in the worker.

Every new grammar text is validated in a separate process before the server builds a
matcher from it (``afmd.grammar.sandbox``). This measures, on the demo model's tokenizer
(``--variant demo-32k`` for a 32k vocabulary), for distinct schemas (never a cache hit):
the compile in this process, the same compile through the worker, the worker's start
(spawn + import + the tokenizer set up), and the recovery after a crash (the refused
compile, then the next compile on a fresh worker). Rounds alternate in-process and worker.

    python -m bench.compile_sandbox --schemas 200 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llguidance import LLMatcher

from afmd.engine.demo import builtin as demo
from afmd.grammar.compiler import _sources, llg_tokenizer
from afmd.grammar.sandbox import CompileFailed, CompileWorker


def _schema(i: int) -> dict[str, Any]:
    return {"type": "object", "properties": {
        f"name_{i}": {"type": "string", "maxLength": 8 + i % 5},
        "kind": {"enum": [f"k{i}", "other"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99 + i},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": [f"name_{i}", "kind", "count"], "additionalProperties": False}


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_ms": round(statistics.median(ordered) * 1000, 2),
            "p90_ms": round(ordered[int(len(ordered) * 0.9) - 1] * 1000, 2)}


def _rss_mib(pid: int | None) -> float | None:
    """The worker's VmRSS (Linux /proc; None elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError):
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", default="demo")
    args = parser.parse_args(argv)

    import mlx_lm

    folder = demo.materialize(args.variant, Path(tempfile.mkdtemp(prefix="afmd-sandbox-")))
    model, wrapper = mlx_lm.load(str(folder))
    tokenizer = llg_tokenizer(wrapper, model.args.vocab_size, sorted(wrapper.eos_token_ids))
    source = _sources[id(tokenizer)]
    key = id(tokenizer)

    worker = CompileWorker()
    started = time.perf_counter()
    worker.validate(LLMatcher.grammar_from_json_schema({"type": "integer"}), key, source)
    start_s = time.perf_counter() - started

    inproc: list[float] = []
    sandboxed: list[float] = []
    serial = 0
    for _ in range(args.rounds):
        for target in (inproc, sandboxed):
            for _ in range(args.schemas):
                serial += 1
                grammar = LLMatcher.grammar_from_json_schema(_schema(serial))
                t = time.perf_counter()
                if target is inproc:
                    LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
                else:
                    worker.validate(grammar, key, source)
                target.append(time.perf_counter() - t)

    worker_rss_mib = _rss_mib(worker.pid)
    crash = LLMatcher.grammar_from_json_schema({"enum": [-(2**63)]})  # unscreened
    recoveries: list[float] = []
    for _ in range(3):
        t = time.perf_counter()
        with contextlib.suppress(CompileFailed):
            worker.validate(crash, key, source)
        serial += 1
        worker.validate(LLMatcher.grammar_from_json_schema(_schema(serial)), key, source)
        recoveries.append(time.perf_counter() - t)
    worker.close()

    print(json.dumps({
        "variant": args.variant, "vocab": model.args.vocab_size,
        "compiles_each": len(inproc),
        "in_process": _ms(inproc), "worker": _ms(sandboxed),
        "overhead_median_ms": round(
            (statistics.median(sandboxed) - statistics.median(inproc)) * 1000, 2),
        "worker_start_s": round(start_s, 2),
        "worker_rss_mib": worker_rss_mib,
        "crash_to_next_compile_s": [round(r, 2) for r in recoveries],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
