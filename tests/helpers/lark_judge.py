"""llguidance as the judge of a lark grammar: whether a text is in it, byte by byte.

A tokenizer of one token per byte (and an end token) makes the matcher judge text, whatever
a model's own tokenizer would have made of it.
"""

from __future__ import annotations

from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper


class _Bytes:
    eos_token_id = 256
    bos_token_id = None
    tokens = tuple([bytes([i]) for i in range(256)] + [b"<eos>"])
    special_token_ids = (256,)

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


BYTES = LLTokenizer(TokenizerWrapper(_Bytes()))


def accepts(lark: str, text: str) -> bool:
    """Whether llguidance's lark matcher takes ``text`` whole under the grammar ``lark``."""
    matcher = LLMatcher(BYTES, LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(list(text.encode()))) and matcher.is_accepting()


def in_lark(definition: str, text: str) -> bool:
    """Whether ``text`` is in a user's lark grammar, as llguidance reads it."""
    return accepts(definition, text)
