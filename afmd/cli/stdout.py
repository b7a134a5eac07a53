"""The commands' standard output when it cannot be written.

A command's output goes where its user sends it: a pipe whose reader stopped early
(``afmd version | head -c1``) or a file on a full disk (``afmd list > /Volumes/full/x``).
The first is no failure: the reader took what it wanted, as ``ls | head`` has it. The
second lost the output: one line on stderr says so, exit code 1. Neither is a traceback
from whatever ``print`` the error reached first, nor a second one from the interpreter's
own flush at exit, which writes the same buffer again.

Only a write to standard output is taken for one: the stream is wrapped while a command
runs, so a broken pipe to the server a command talks to stays that command's own error.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO


class OutputClosed(Exception):
    """Standard output's reader went away (a closed pipe)."""


class OutputLost(Exception):
    """Standard output could not take what a command wrote (a full disk, an I/O error)."""


class _Guarded:
    """``sys.stdout`` whose write errors say they are its own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except BrokenPipeError:
            raise OutputClosed from None
        except OSError as exc:
            raise OutputLost(exc.strerror or str(exc)) from None

    def write(self, text: str) -> int:
        written: int = self._call(self._stream.write, text)
        return written

    def flush(self) -> None:
        self._call(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _silence() -> None:
    """Point standard output at the null device, so the interpreter's flush at exit has
    somewhere to put what is still buffered."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def guarded(command: Callable[[], int], name: str) -> int:
    """Run ``command`` and flush its output: a closed pipe is exit code 0 and a write
    that failed otherwise is one line on stderr and exit code 1."""
    real = sys.stdout
    sys.stdout = _Guarded(real)
    try:
        code = command()
        sys.stdout.flush()
    except OutputClosed:
        _silence()
        return 0
    except OutputLost as exc:
        _silence()
        print(f"{name}: cannot write the output: {exc}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = real
    return code
