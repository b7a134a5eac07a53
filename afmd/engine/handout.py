"""Handing a step's tokens out: mlx-lm's responses, one per token, a row ending at its first
finish (length, a stop sequence) with a KV cache and token list that agree.

Functions over :class:`~afmd.engine.decode.DecodeBatch`, used by its plain step and by
speculation (:mod:`afmd.engine.lone_row`), which hands out several tokens a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_lm.models.cache import trim_prompt_cache

if TYPE_CHECKING:
    from afmd.engine.decode import DecodeBatch


def account(
    self: DecodeBatch, handed: list[list[int]], logprobs: list[list[Any]]
) -> list[Any]:
    """Responses for each row's tokens in order, ending a row at its first finish."""
    responses: list[Any] = []
    keep: list[int] = []
    for i, uid in enumerate(self.uids):
        if self._num_tokens[i] == 0:  # its first token is never in its cache yet
            self._prompt_len[uid] = len(self.tokens[i])
        spec = self.spec_rows.get(uid) if self.spec_rows else None
        finish = None
        for token, lp in zip(handed[i], logprobs[i], strict=True):
            self._num_tokens[i] += 1
            if spec is not None:
                spec.history.append(token)
            if self._num_tokens[i] >= self.max_tokens[i]:
                finish = "length"
            if self._matchers[i].advance(token):
                finish = "stop"
            if finish is None:
                responses.append(self.Response(uid, token, lp, None, None, None))
                continue
            cache, tokens = _leaving(self, i)
            responses.append(self.Response(uid, token, lp, finish, cache, tokens))
            break
        if finish is None:
            keep.append(i)
    if len(keep) < len(self.uids):
        self.filter(keep)
    return responses

def _leaving(self: DecodeBatch, i: int) -> tuple[list[Any], list[int]]:
    """A finishing row's KV cache and tokens, cut back to the token it ended on (a
    verification may have fed tokens past it)."""
    if self._verify is not None:  # only a batch of one verifies: this row's pass
        verify, self._verify = self._verify, None
        trim_prompt_cache(self.prompt_cache, verify.k)
        self.tokens[i].append(int(verify.first))
    uid = self.uids[i]
    tokens = self.tokens[i]
    keep = self._prompt_len.pop(uid, 0) + self._num_tokens[i]
    self._backlog.pop(uid, None)
    surplus = len(tokens) - keep
    cache = self.extract_cache(i)
    if surplus > 0:
        trim_prompt_cache(cache, surplus)
        for c in cache:
            if getattr(c, "keys", None) is not None and hasattr(c, "offset"):
                c.keys = c.keys[..., : c.offset, :]
                c.values = c.values[..., : c.offset, :]
        tokens = tokens[:keep]
    return cache, tokens
