"""Block keys: a hash chain over the model's identity and each block's tokens.

A block's key covers every token before it, not only its own: the same tokens after a
different history have different KV state (attention mixed the history in), so only a
chained key may be reused. Chaining also makes the longest reusable run the longest run
of leading keys found, and a conversation changed in its middle keeps every key before
the change.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

#: Bumped when what a key covers changes (old files then simply never match).
KEY_VERSION = b"afmd-kv-chain-1"


def chain_root(identity: bytes, block_tokens: int) -> bytes:
    """The chain's start for one model and block size: two models (or two block sizes)
    never produce the same key, whatever their tokens."""
    return hashlib.sha256(KEY_VERSION + identity + block_tokens.to_bytes(4, "little")).digest()


def block_keys(root: bytes, tokens: Sequence[int], block_tokens: int,
               limit: int | None = None) -> list[bytes]:
    """The keys of the whole blocks of ``tokens`` (at most ``limit`` of them)."""
    count = len(tokens) // block_tokens
    if limit is not None:
        count = min(count, limit)
    keys: list[bytes] = []
    key = root
    for i in range(count):
        chunk = array("q", tokens[i * block_tokens:(i + 1) * block_tokens]).tobytes()
        key = hashlib.sha256(key + chunk).digest()
        keys.append(key)
    return keys
