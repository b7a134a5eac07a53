"""The token table a model's tokenizer shares with every request that asks for
log-probabilities, and what it keeps once that model is unloaded."""

from __future__ import annotations

import gc
import weakref

from afmd.engine.batch import tokens
from afmd.engine.batch.tokens import token_table


class _Tokenizer:
    """A decode-kind tokenizer: the table asks it for a token's text."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_the_table_goes_with_its_tokenizer() -> None:
    # Each load of a model has its own tokenizer; a table holding it strongly, stored
    # under it in a weak-keyed map, kept every unloaded model's tokenizer for good.
    tokenizer = _Tokenizer()
    table = token_table(tokenizer)
    assert table.bytes_of(2) == b"c"
    assert token_table(tokenizer) is table
    gone = weakref.ref(tokenizer)
    del tokenizer, table
    gc.collect()
    assert gone() is None
    assert not any(isinstance(key, _Tokenizer) for key in tokens._TABLES)
