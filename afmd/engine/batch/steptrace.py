"""Where a generation thread's iterations go, written out when ``AFMD_STEP_TRACE`` names a
file (a diagnostic for the benchmarks, off by default).

On a GPU the model's step runs on the device while the thread does the host's share: it
builds and starts the next step, waits for this one's tokens, hands them out, admits new
rows. The device idles whenever the host's share is longer than a step, and from the
outside (tokens per second) that looks just like a slow device. One line per iteration
tells them apart: ``wait_ms`` is the time the thread sat waiting for the device's tokens
(none: the host is the bottleneck), ``next_ms`` the whole step call including that wait,
``deliver_ms`` the tokens turned into events and handed to the event loop, ``admit_ms``
the rows joining (their prefill included).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

#: The variable naming the file (appended to: several models' threads may share it).
ENV = "AFMD_STEP_TRACE"
_FLUSH_EVERY = 256


class StepTrace:
    """One generation thread's lines, buffered (written by that thread only)."""

    def __init__(self, path: Path, name: str) -> None:
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._name = name
        self._lines: list[str] = []

    @classmethod
    def from_env(cls, name: str) -> StepTrace | None:
        path = os.environ.get(ENV)
        return cls(Path(path), name) if path else None

    def record(self, *, rows: int, tokens: int, admit_s: float, next_s: float,
               wait_s: float, deliver_s: float) -> None:
        line: dict[str, Any] = {
            "model": self._name, "t": round(time.time(), 6), "rows": rows,
            "tokens": tokens, "admit_ms": round(admit_s * 1e3, 3),
            "next_ms": round(next_s * 1e3, 3), "wait_ms": round(wait_s * 1e3, 3),
            "deliver_ms": round(deliver_s * 1e3, 3),
        }
        self._lines.append(json.dumps(line))
        if len(self._lines) >= _FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines = []

    def close(self) -> None:
        self.flush()
        self._file.close()
