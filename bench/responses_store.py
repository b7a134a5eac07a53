"""What the Responses store costs in memory: a server's RSS as stored responses pile up.

Each request stores a response that echoes a large ``user`` field (as a client may send
one); the store keeps it whole. Run once with no byte bound (``max_stored_bytes = 0``:
only the count bounds it) and once with a bound, on the same machine in the same run.

Requests this size leave the allocator holding memory after they are answered, stored or
not, so each server first answers the same requests with ``store: false``: RSS after that
is the baseline the stored phase is compared with (``store_mib``: what storing added).

    python -m bench.responses_store --responses 300 --user-kb 900 --bound-mib 32

RSS is read from /proc (Linux). Prints one JSON line per server.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.servers import rss_mb
from bench.soak import start_server


def measure(bound_bytes: int, responses: int, user_kb: int, work: Path) -> dict[str, Any]:
    """RSS before and after ``responses`` stored responses, and what the store kept."""
    server = start_server(work, model="demo", concurrency=4,
                          settings={"responses.max_stored_bytes": str(bound_bytes)},
                          launcher=None, cache_dir=work.parent / "cache")
    try:
        user = "u" * (user_kb * 1000)
        ids: list[str] = []
        with httpx.Client(base_url=server.url, timeout=120) as http:
            # One response first, so the model is loaded and warm before the baseline.
            http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 16,
                                             "store": False}).raise_for_status()
            time.sleep(0.5)
            start = rss_mb(server.pid)
            for _ in range(responses):
                http.post("/v1/responses", json={"input": "hi", "user": user, "store": False,
                                                 "max_output_tokens": 16}).raise_for_status()
            time.sleep(0.5)
            before = rss_mb(server.pid)
            started = time.perf_counter()
            for _ in range(responses):
                answer = http.post("/v1/responses", json={"input": "hi", "user": user,
                                                          "max_output_tokens": 16})
                answer.raise_for_status()
                ids.append(answer.json()["id"])
            seconds = time.perf_counter() - started
            time.sleep(0.5)
            after = rss_mb(server.pid)
            kept = sum(http.get(f"/v1/responses/{i}").status_code == 200 for i in ids)
        return {"max_stored_bytes": bound_bytes, "responses": responses, "user_kb": user_kb,
                "kept": kept, "rss_start_mib": round(start or 0, 1),
                "rss_unstored_mib": round(before or 0, 1), "rss_stored_mib": round(after or 0, 1),
                "store_mib": round((after or 0) - (before or 0), 1),
                "seconds": round(seconds, 1)}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=300)
    parser.add_argument("--user-kb", type=int, default=900)
    parser.add_argument("--bound-mib", type=int, default=32)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="afmd-store-"))
    for bound in (0, args.bound_mib << 20):
        print(json.dumps(measure(bound, args.responses, args.user_kb,
                                 work / f"bound-{bound}")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
