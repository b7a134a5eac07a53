"""transformers' first import, made on one thread before any other thread can begin one.

afmd imports mlx-lm, mlx-vlm and transformers lazily, on whichever thread first needs
them (a model's load, ``/api/tags`` describing a model or building the vision demo, a
grammar's tokenizer), so that a server that has loaded no model stays small. All three
are or import transformers, and transformers' package initialisation is not safe from two threads
at once: the second thread sees the package half set up and gets ``ImportError: cannot
import name 'AutoProcessor' from 'transformers'``, which reached clients as a 500 on a
fresh server (the default model loading while ``/api/tags`` built the vision demo). Once
the package is initialised, its lazy submodules import safely from any thread, so every
lazy entry to those libraries calls :func:`transformers_ready` first.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_ready = False


def transformers_ready() -> None:
    """Import transformers unless this process already has (blocking: about a second)."""
    global _ready
    if _ready:
        return
    with _lock:
        if not _ready:
            import transformers  # noqa: F401

            _ready = True


__all__ = ["transformers_ready"]
