"""What a model's load keeps from the previous load of the same files: its tokenizer, and
a vision model's processor.

Loading a tokenizer (transformers reading ``tokenizer.json``, mlx-lm reading its
vocabulary) and what is built from it on first use (llguidance's view of it for grammars,
the compile worker's copy, the token tables) runs largely in native code that holds the
GIL, in stretches long enough to stall the event loop while a model loads; with
``keep_alive: 0`` a model loads for every request. A model loaded again from the same
files gets the tokenizer of its previous load instead, with everything weakly keyed by it
(:mod:`afmd.grammar.compiler` and others keep their per-tokenizer state that way). A
vision model's processor (mlx-vlm's, with a Hugging Face tokenizer of its own and the
image processor) is as slow to build, and is kept the same way.

A tokenizer or processor is known by its folder, the identity of the files it may be read
from (name, size, modification time, inode: a file replaced or rewritten is another one)
and the end-of-sequence ids the model's config gives it. Neither is changed per model by
afmd or by mlx-vlm (what mlx-vlm sets on a processor, its pad token, is the same for every
load of the files), and the requests of one model already share them between threads, so
two loads may share them too. The last few of each are kept whether or not their model is
loaded: each holds its vocabulary and what was built from it, outside any model's share of
the memory budget.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Tokenizers kept, and processors kept, most recently loaded last.
KEPT = 2

#: The files a tokenizer or a processor may be read from: what mlx-lm's ``load_tokenizer``
#: and mlx-vlm's ``get_model_path`` fetch, less the weights.
_SUFFIXES = (".json", ".py", ".tiktoken", ".txt", ".jsonl", ".jinja", ".model")


class _Kept:
    """The last :data:`KEPT` objects built, by key; built anew for a key not kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def get(self, key: tuple[Any, ...] | None, build: Callable[[], Any]) -> Any:
        if key is not None:
            with self._lock:
                found = self._kept.get(key)
                if found is not None:
                    self._kept.move_to_end(key)
                    return found
        built = build()  # blocking, outside the lock: other folders' loads go on
        if key is not None:
            with self._lock:
                # Two loads of one folder at once keep the first to finish; both are right.
                built = self._kept.setdefault(key, built)
                self._kept.move_to_end(key)
                while len(self._kept) > KEPT:
                    self._kept.popitem(last=False)
        return built

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


_tokenizers = _Kept()
_processors = _Kept()


def tokenizer_for(folder: Path, eos_token_ids: Any) -> Any:
    """mlx-lm's tokenizer of the model in ``folder``: the one kept from an earlier load
    of the same files, or a new one (blocking)."""
    from mlx_lm.utils import load_tokenizer

    return _tokenizers.get(_key(folder, eos_token_ids),
                           lambda: load_tokenizer(folder, eos_token_ids=eos_token_ids))


def processor_for(folder: Path, eos_token_ids: Any) -> Any:
    """mlx-vlm's processor of the vision model in ``folder``, as ``mlx_vlm.load`` builds
    it: the one kept from an earlier load of the same files, or a new one (blocking)."""
    from afmd.engine.mlx_compat import vlm_processor

    return _processors.get(_key(folder, eos_token_ids),
                           lambda: vlm_processor(folder, eos_token_ids))


def forget() -> None:
    """Drop every kept tokenizer and processor (tests)."""
    _tokenizers.clear()
    _processors.clear()


def kept() -> int:
    """How many tokenizers are kept (tests)."""
    return len(_tokenizers)


def kept_processors() -> int:
    """How many processors are kept (tests)."""
    return len(_processors)


def _key(folder: Path, eos_token_ids: Any) -> tuple[Any, ...] | None:
    """What tells this tokenizer or processor from another; None when the folder cannot
    be read (the load will say why)."""
    try:
        files = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith(_SUFFIXES):
                    info = entry.stat()  # through a link, as the load reads it
                    files.append((entry.name, info.st_size, info.st_mtime_ns, info.st_ino,
                                  info.st_dev))
    except OSError:
        return None
    eos = json.dumps(eos_token_ids, sort_keys=True, default=str)
    return (str(Path(folder).resolve()), eos, tuple(sorted(files)))


__all__ = ["KEPT", "forget", "kept", "kept_processors", "processor_for", "tokenizer_for"]
