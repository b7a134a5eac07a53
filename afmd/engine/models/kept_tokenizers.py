"""A chat model's tokenizer, kept from one load of the model to the next.

Loading a tokenizer (transformers reading ``tokenizer.json``, mlx-lm reading its
vocabulary) and what is built from it on first use (llguidance's view of it for grammars,
the compile worker's copy, the token tables) runs largely in native code that holds the
GIL, in stretches long enough to stall the event loop while a model loads; with
``keep_alive: 0`` a model loads for every request. A model loaded again from the same
files gets the tokenizer of its previous load instead, with everything weakly keyed by it
(:mod:`afmd.grammar.compiler` and others keep their per-tokenizer state that way).

A tokenizer is known by its folder, the identity of the files mlx-lm reads it from (name,
size, modification time, inode: a file replaced or rewritten is another tokenizer) and the
end-of-sequence ids the model's config gives it. A model's tokenizer is never changed by
afmd, and the models that use it already share it between threads. The last few are kept
whether or not their model is loaded: each holds its vocabulary and what was built from it,
outside any model's share of the memory budget.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

#: Tokenizers kept, most recently loaded last.
KEPT = 2

#: The files mlx-lm's ``load_tokenizer`` fetches for a tokenizer (what it may read).
_SUFFIXES = (".json", ".py", ".tiktoken", ".txt", ".jsonl", ".jinja")
_NAMES = ("tokenizer.model", "tiktoken.model")

_lock = threading.Lock()
_kept: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


def tokenizer_for(folder: Path, eos_token_ids: Any) -> Any:
    """mlx-lm's tokenizer of the model in ``folder``: the one kept from an earlier load
    of the same files, or a new one (blocking)."""
    from mlx_lm.utils import load_tokenizer

    key = _key(folder, eos_token_ids)
    with _lock:
        found = _kept.get(key) if key is not None else None
        if found is not None:
            _kept.move_to_end(key)  # type: ignore[arg-type]  # key is not None here
            return found
    tokenizer = load_tokenizer(folder, eos_token_ids=eos_token_ids)
    if key is not None:
        with _lock:
            # Two loads of one folder at once keep the first to finish; both are right.
            tokenizer = _kept.setdefault(key, tokenizer)
            _kept.move_to_end(key)
            while len(_kept) > KEPT:
                _kept.popitem(last=False)
    return tokenizer


def forget() -> None:
    """Drop every kept tokenizer (tests)."""
    with _lock:
        _kept.clear()


def kept() -> int:
    """How many tokenizers are kept (tests)."""
    with _lock:
        return len(_kept)


def _key(folder: Path, eos_token_ids: Any) -> tuple[Any, ...] | None:
    """What tells this tokenizer from another; None when the folder cannot be read (the
    load will say why)."""
    try:
        files = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith(_SUFFIXES) or entry.name in _NAMES:
                    info = entry.stat()  # through a link, as the load reads it
                    files.append((entry.name, info.st_size, info.st_mtime_ns, info.st_ino,
                                  info.st_dev))
    except OSError:
        return None
    eos = json.dumps(eos_token_ids, sort_keys=True, default=str)
    return (str(Path(folder).resolve()), eos, tuple(sorted(files)))


__all__ = ["KEPT", "forget", "kept", "tokenizer_for"]
