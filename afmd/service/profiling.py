"""The ``X-AFM-Profile`` events: where one request's time and memory went.

Numbers here are measured or derived from measurements, never invented: GPU power needs
privileged sampling afmd does not do, so it is ``null``; memory bandwidth is the estimate
"bytes the model reads per decoded token × decode rate" (its weights, which every
decode step reads once), which is what bounds decode speed on unified memory, and
``null`` when there was no decode to measure.
"""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

PROFILE_KEYS = (
    "prompt_tokens",
    "cached_tokens",
    "cached_ram_tokens",
    "cached_disk_tokens",
    "completion_tokens",
    "queue_ms",
    "ttft_ms",
    "total_ms",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "peak_memory_bytes",
    "chip",
    "gpu_power_w",
    "bandwidth_gb_s",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
    "speculation",
)

# Keep a sample at least this often (tokens) for the extended profile.
SAMPLE_EVERY = 8


def parse_profile_header(value: str | None) -> str | None:
    """``"summary"``, ``"extended"`` or ``None`` from the X-AFM-Profile header."""
    if value is None:
        return None
    v = value.strip().lower()
    if v in ("true", "1", "yes", "summary"):
        return "summary"
    if v == "extended":
        return "extended"
    return None


@functools.cache
def chip_name() -> str:
    """The chip (Apple M-series) or CPU model this process runs on."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True, text=True, timeout=2, check=False,
            ).stdout.strip()
            if out:
                return out
        except OSError:
            pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _rate(count: int, seconds: float) -> float | None:
    return round(count / seconds, 2) if count > 0 and seconds > 0 else None


@dataclass(frozen=True, slots=True)
class ProfileInput:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    received_at: float  # perf_counter when the request arrived
    started_at: float  # when it got a slot and entered the engine
    first_token_at: float
    finished_at: float
    peak_memory_bytes: int | None
    bytes_per_token: int | None  # weight bytes read per decoded token, when known
    # The prediction's tokens that appeared in the output and the others (as usage), and
    # per proposal source the tokens speculative verification accepted and rejected.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    speculation: dict[str, dict[str, int]] = field(default_factory=dict)
    cached_disk_tokens: int = 0  # of cached_tokens, those read from the disk tier


def add_speculation(total: dict[str, dict[str, int]], *counts: dict[str, dict[str, int]]
                    ) -> dict[str, dict[str, int]]:
    """``total`` plus each of ``counts`` (per proposal source, per count)."""
    for each in counts:
        for source, numbers in each.items():
            mine = total.setdefault(source, {})
            for key, n in numbers.items():
                mine[key] = mine.get(key, 0) + n
    return total


def summary(p: ProfileInput) -> dict[str, Any]:
    prefill_s = p.first_token_at - p.started_at
    decode_s = p.finished_at - p.first_token_at
    decode_rate = _rate(p.completion_tokens - 1, decode_s)
    bandwidth = None
    if decode_rate is not None and p.bytes_per_token:
        bandwidth = round(p.bytes_per_token * decode_rate / 1e9, 3)
    return {
        "prompt_tokens": p.prompt_tokens,
        "cached_tokens": p.cached_tokens,
        "cached_ram_tokens": p.cached_tokens - p.cached_disk_tokens,
        "cached_disk_tokens": p.cached_disk_tokens,
        "completion_tokens": p.completion_tokens,
        "queue_ms": round(max(p.started_at - p.received_at, 0.0) * 1000, 3),
        "ttft_ms": round(max(p.first_token_at - p.received_at, 0.0) * 1000, 3),
        "total_ms": round(max(p.finished_at - p.received_at, 0.0) * 1000, 3),
        "prefill_tokens_per_s": _rate(p.prompt_tokens - p.cached_tokens, prefill_s),
        "decode_tokens_per_s": decode_rate,
        "peak_memory_bytes": p.peak_memory_bytes,
        "chip": chip_name(),
        "gpu_power_w": None,
        "bandwidth_gb_s": bandwidth,
        "accepted_prediction_tokens": p.accepted_prediction_tokens,
        "rejected_prediction_tokens": p.rejected_prediction_tokens,
        "speculation": {k: dict(v) for k, v in p.speculation.items()},
    }


def samples(raw: tuple[tuple[float, int, int], ...], offset_s: float) -> list[dict[str, Any]]:
    """Samples as ``{"t_ms", "tokens", "memory_bytes"}``, time from the request's arrival."""
    return [
        {"t_ms": round((t + offset_s) * 1000, 3), "tokens": n, "memory_bytes": m}
        for t, n, m in raw
    ]


def payload(
    mode: str, p: ProfileInput, raw_samples: tuple[tuple[float, int, int], ...] = ()
) -> dict[str, Any]:
    """The event a profiled stream ends with: ``{"afm_profile": summary}`` or, extended,
    ``{"afm_profile_extended": {"summary", "samples"}}`` (sample times are seconds since
    the engine started the request, as the engine records them)."""
    data = summary(p)
    if mode == "extended":
        offset = p.started_at - p.received_at
        return {"afm_profile_extended": {"summary": data, "samples": samples(raw_samples, offset)}}
    return {"afm_profile": data}
