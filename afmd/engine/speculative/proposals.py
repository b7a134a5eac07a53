"""Where proposed tokens come from: the client's prediction, the prompt, a draft model.

A source looks at a sequence's history (prompt, then the tokens generated so far) and
proposes what comes next; the decode step checks the proposal against the model in one
forward pass (:mod:`afmd.engine.speculative.verification`), so a wrong proposal costs time, never a
token. Sources are tried best first: a prediction the client wrote for this very output,
then text the prompt (or the output itself) already holds, then a small draft model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

# Output tokens that must match the prediction again before it is followed after a
# divergence: one common token is no evidence of being back in step.
_RESYNC_MIN = 2
# How far back a resync candidate's match is measured (tokens).
_RESYNC_SPAN = 32
_LOOKUP_NGRAMS = (3, 2)


class PredictionSource:
    """The client's ``prediction``, followed where the output agrees with it.

    The output is aligned against the prediction as it grows: while each new token is the
    prediction's next one, the proposal is simply what follows. A model need not split
    text into the tokens the tokenizer would (one token for what the tokenizer writes as
    three, or the reverse), so a token that differs but writes the same text keeps the
    alignment, compared by the tokens' text pieces. When the output really diverges (the
    edit the client asked for), the prediction is searched for the longest run that ends
    like the output's last tokens, so an output that rejoins the prediction further on
    (or after skipping part of it) profits again.

    :attr:`matched` counts the prediction's tokens that appeared in the output this way:
    what ``accepted_prediction_tokens`` reports, whichever steps speculated.
    """

    name = "prediction"
    k_max = 16

    def __init__(self, tokens: Sequence[int],
                 pieces: Callable[[Sequence[int]], Sequence[str]] | None = None) -> None:
        self.tokens = list(tokens)
        self._pieces = pieces  # token ids -> their text pieces (None: compare ids only)
        self._text = list(pieces(self.tokens)) if pieces is not None else []
        self.cursor: int | None = 0  # the prediction's index the next token should match
        self._lag = 0  # characters of tokens[cursor] the output has already written
        self._last = 0  # where the cursor last was (resync prefers going forward from it)
        self._resynced_at: int | None = None
        self._avoid: set[int] = set()  # resync points that failed at once
        self._seen = 0  # output tokens walked so far
        self._hit = bytearray(len(self.tokens))
        self._bigrams: dict[tuple[int, int], list[int]] = {}
        for i in range(len(self.tokens) - 1):
            self._bigrams.setdefault((self.tokens[i], self.tokens[i + 1]), []).append(i + 2)

    @property
    def matched(self) -> int:
        return sum(self._hit)

    @property
    def rejected(self) -> int:
        return len(self.tokens) - self.matched

    def propose(self, history: Sequence[int], start: int, k: int) -> list[int]:
        self._walk(history, start)
        if self.cursor is None or self._lag:
            return []
        return self.tokens[self.cursor : self.cursor + k]

    def _walk(self, history: Sequence[int], start: int) -> None:
        out = len(history) - start
        if self._seen >= out:
            return
        p = self.tokens
        for i in range(start + self._seen, len(history)):
            c = self.cursor
            if c is None:
                continue
            if not self._lag and c < len(p) and p[c] == history[i]:
                self._hit[c] = 1
                self.cursor = c + 1
                self._resynced_at = None
            elif not self._same_text(history[i]):
                if self._resynced_at == c:
                    self._avoid.add(c)
                self._last, self.cursor, self._lag = c, None, 0
        self._seen = out
        if self.cursor is None:
            self._resync(history, start)

    def _same_text(self, token: int) -> bool:
        """Walk the cursor over ``token``'s text if the prediction writes the same."""
        if self._pieces is None or self.cursor is None:
            return False
        rest = self._pieces([token])[0]
        c, lag = self.cursor, self._lag
        while rest:
            if c >= len(self.tokens):
                return False
            piece = self._text[c][lag:]
            if rest.startswith(piece):
                rest = rest[len(piece):]
                self._hit[c] = 1
                c, lag = c + 1, 0
            elif piece.startswith(rest):
                lag += len(rest)
                rest = ""
            else:
                return False
        self.cursor, self._lag = c, lag
        self._resynced_at = None
        return True

    def _resync(self, history: Sequence[int], start: int) -> None:
        if len(history) - start < _RESYNC_MIN:
            return
        ends = self._bigrams.get((history[-2], history[-1]))
        if not ends:
            return
        # Longest match first; then onwards from where the alignment was lost (an edit
        # replaces, inserts or deletes: the output rarely goes back), nearest first.
        best: tuple[int, bool, int, int] | None = None
        for end in ends:
            if end in self._avoid:
                continue
            n = 2
            while (n < _RESYNC_SPAN and end - n > 0 and len(history) - n > start
                   and self.tokens[end - n - 1] == history[-n - 1]):
                n += 1
            key = (n, end >= self._last, -abs(end - self._last), end)
            if best is None or key > best:
                best = key
        if best is not None and best[0] >= _RESYNC_MIN:
            length, _, _, end = best
            self.cursor = self._resynced_at = end
            self._hit[end - length : end] = b"\x01" * length


class LookupSource:
    """Prompt lookup: the output's last few tokens found earlier in the history (the
    prompt, or the output itself), and what followed them there proposed."""

    name = "prompt_lookup"
    k_max = 8

    def __init__(self) -> None:
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are indexed

    def propose(self, history: Sequence[int], start: int, k: int) -> list[int]:
        # Index every n-gram but the one ending at the very end (the one looked up).
        for end in range(max(self._indexed, 1), len(history)):
            for n in _LOOKUP_NGRAMS:
                if end >= n:
                    self._index[tuple(history[end - n : end])] = end
        self._indexed = max(self._indexed, len(history))
        for n in _LOOKUP_NGRAMS:
            if len(history) < n:
                continue
            found = self._index.get(tuple(history[-n:]))
            if found is not None and found < len(history):
                return list(history[found : found + k])
        return []


class DraftSource:
    """A smaller model with the same tokenizer drafting greedily, with its own KV cache
    kept in step with the sequence (trimmed back to what the sequence kept)."""

    name = "draft"
    k_max = 4

    def __init__(self, model: Any, prefill_step: int = 512) -> None:
        self._model = model
        self._cache = make_prompt_cache(model)
        self._fed: list[int] = []  # what the draft's cache holds
        self._unsettled: mx.array | None = None  # drafted tokens fed but not yet read
        self._prefill_step = prefill_step

    def propose(self, history: Sequence[int], start: int, k: int) -> mx.array | list[int]:
        """``k`` drafted tokens, as a lazy array: the verification evaluates them with
        the target model's pass."""
        if k <= 0:
            return []
        self._settle()
        common = 0
        limit = min(len(self._fed), len(history) - 1)  # keep one token to feed
        while common < limit and self._fed[common] == history[common]:
            common += 1
        if common < len(self._fed):
            trim_prompt_cache(self._cache, len(self._fed) - common)
            del self._fed[common:]
        rest = list(history[common:])
        while len(rest) > self._prefill_step:
            self._model(mx.array([rest[: self._prefill_step]]), cache=self._cache)
            mx.eval([c.state for c in self._cache])
            self._fed += rest[: self._prefill_step]
            rest = rest[self._prefill_step :]
        self._fed += rest
        logits = self._model(mx.array([rest]), cache=self._cache)[:, -1, :]
        token = mx.argmax(logits, axis=-1)
        drafted = [token]
        for _ in range(k - 1):
            token = mx.argmax(self._model(token[:, None], cache=self._cache)[:, -1, :], axis=-1)
            drafted.append(token)
        out = mx.concatenate(drafted)
        # All but the last drafted token went through the draft's cache.
        self._unsettled = out[:-1] if k > 1 else None
        return out

    def _settle(self) -> None:
        if self._unsettled is not None:
            self._fed += cast("list[int]", self._unsettled.tolist())
            self._unsettled = None
