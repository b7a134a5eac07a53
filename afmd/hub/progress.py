"""Download progress for ``afmd pull``: one bar per file on a terminal, plain lines in logs.

The hub client drives a ``tqdm`` class it is given (``update`` per chunk, ``close`` at the
end, the same bar reused when it resumes a cut connection), so both forms are ``tqdm``
subclasses. On a terminal that is tqdm's own bar (bytes, rate, time left); anywhere else
(``afmd serve`` under launchd, a CI log) carriage-return redraws would be one endless
line, so the line form prints a complete line every few seconds and one when the file ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

from afmd.hub.cache import human_bytes

#: Seconds between two plain progress lines of one file.
LINE_INTERVAL_S = 5.0


def _screen(stream: TextIO | None) -> tuple[int, int]:
    """(columns, rows) of the terminal; one that reports no size (a fresh pty, where tqdm
    would hide every bar as "below the screen") gets a usual one."""
    try:
        size = os.get_terminal_size(stream.fileno()) if stream else None
    except (OSError, ValueError):
        size = None
    return (size.columns if size and size.columns else 100,
            size.lines if size and size.lines else 24)


class _TerminalBar(tqdm):  # tqdm ships no type hints
    label = ""
    stream: TextIO | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs["desc"] = self.label or kwargs.get("desc")
        kwargs["file"] = self.stream
        kwargs.update(unit="B", unit_scale=True, unit_divisor=1024, leave=True,
                      disable=False)
        kwargs["ncols"], kwargs["nrows"] = _screen(self.stream)
        super().__init__(*args, **kwargs)


class _LineBar(tqdm):
    label = ""
    stream: TextIO | None = None
    disable: bool  # tqdm's, set by its __init__
    interval = LINE_INTERVAL_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs["desc"] = self.label or kwargs.get("desc")
        kwargs["file"] = self.stream
        kwargs.update(unit="B", unit_scale=True, unit_divisor=1024, leave=True,
                      disable=False, mininterval=self.interval, maxinterval=self.interval)
        self._last_line = 0.0
        self._ended = False
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        now = time.monotonic()
        done = self.total is not None and self.n >= self.total
        if self._ended or (now - self._last_line < self.interval and not done):
            return True
        self._ended = done
        self._last_line = now
        info = self.format_dict
        elapsed = info.get("elapsed") or 0.0
        rate = info.get("rate") or (self.n / elapsed if elapsed else None)
        parts = [f"{self.desc}: {human_bytes(self.n)}"]
        if self.total:
            parts[0] += f" / {human_bytes(self.total)} ({100 * self.n / self.total:.0f}%)"
        if rate:
            parts.append(f"{human_bytes(rate)}/s")
            if self.total and not done:
                parts.append("ETA " + tqdm.format_interval((self.total - self.n) / rate))
        if done:
            parts.append("done in " + tqdm.format_interval(elapsed))
        if self.fp is not None:
            self.fp.write("  " + ", ".join(parts) + "\n")
            self.fp.flush()
        return True

    def close(self) -> None:
        # A SIGTERM can end a pull inside tqdm's ``__init__``, before ``disable`` is set;
        # ``__del__`` then closes the half-built bar, which tqdm's own close allows for.
        if not getattr(self, "disable", True):
            self._last_line = 0.0  # every file ends with a line, finished or not
            self.display()
            self.disable = True  # tqdm's own close would redraw the bar with \r
        super().close()


#: ``report(bytes done, bytes in all)``: one file's progress for a caller that shows it
#: itself (the dashboard's pulls, Ollama's ``/api/pull``), beside the bar.
FileReport = Callable[[int, int | None], None]


class _Reporting:
    """Mixed into a bar: every update is also reported (the bar's own count, which the
    hub client rewinds when it resumes a cut connection)."""

    report: FileReport | None = None

    def update(self, n: float | None = 1) -> bool | None:
        shown = super().update(n)  # type: ignore[misc]
        if self.report is not None:
            self.report(int(self.n), self.total)  # type: ignore[attr-defined]
        return shown


def bar_class(label: str, stream: TextIO, *, terminal: bool,
              report: FileReport | None = None) -> type[tqdm]:
    """A bar class for one file, as the hub client wants a class, not an instance."""
    base: type[tqdm] = _TerminalBar if terminal else _LineBar
    if report is None:
        return type("FileBar", (base,), {"label": label, "stream": stream})
    return type("FileBar", (_Reporting, base),
                {"label": label, "stream": stream, "report": staticmethod(report)})
