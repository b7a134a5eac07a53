"""The special tokens a chat answer leaves out of its text.

A model's vocabulary has special tokens for the prompt's structure (``<|im_start|>``,
``<|begin_of_text|>``, Mistral's ``[AVAILABLE_TOOLS]``, reserved ones) that the model can
still write, a small or quantised one especially. Their text is not part of an answer:
vLLM leaves special tokens out of chat text (``skip_special_tokens``, turned off for the
tool parsers that read some), and so does afmd, except those its output chain reads: the
markers of the model's call format (each family declares them beside its reader,
:attr:`afmd.output.formats.registry.Family.markers`) and its reasoning markers. A
special token whose text lies inside one of those is kept, since markers are often made
of several tokens (Kimi K3's ``<|open|>tools<|sep|>``). End ids end generation unseen
already. Where an mlx-lm parser afmd has no reader for reads the calls, nothing is
hidden: afmd cannot know which tokens that parser reads.

A client's stop sequence is matched in the answer's text, so a special token a stop
sequence holds (``<|im_start|>``, Gemma's ``<start_of_turn>``: clients stop on the next
turn's opener) is kept for that request: the stop still ends the answer where it did. The
tokenizer finds them, as it splits the prompt, in time linear in the stops' length.

Only the text goes: a hidden token is still a completion token with its
log-probabilities, and the engine leaves it out before its streaming detokenizer, so the
text around it is exact (:meth:`afmd.engine.batch.sequence.Row.take`). ``/v1/completions``
and Ollama's raw ``/api/generate`` hide nothing: their text is the decode of the ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def special_tokens(tokenizer: Any) -> dict[int, str]:
    """A Hugging Face tokenizer's special tokens by id, with their text: the named ones
    (``all_special_ids``) and the added tokens flagged special (mlx-lm's wrapper hands
    both through)."""
    found: dict[int, str] = {}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for i, token in added.items():
        if getattr(token, "special", False) and isinstance(token.content, str):
            found[int(i)] = token.content
    named = [int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()
             if int(i) not in found]
    if named:
        for i, text in zip(named, tokenizer.convert_ids_to_tokens(named), strict=True):
            if isinstance(text, str):
                found[i] = text
    return found


def is_read(text: str, markers: Iterable[str]) -> bool:
    """Whether a special token's text is (part of) a marker the output chain reads."""
    return any(text in marker for marker in markers)


def hidden_tokens(tokenizer: Any, markers: Iterable[str] | None,
                  end_ids: Iterable[int]) -> frozenset[int]:
    """The special tokens of ``tokenizer`` that are neither read (``markers``: every
    literal the model's call format and reasoning markers are read by; None: not known,
    nothing is hidden) nor end ids."""
    if markers is None:
        return frozenset()
    read = tuple(m for m in markers if m)
    ends = set(end_ids)
    return frozenset(i for i, text in special_tokens(tokenizer).items()
                     if i not in ends and not is_read(text, read))


def for_stops(hidden: frozenset[int], tokenizer: Any, stops: Sequence[str]) -> frozenset[int]:
    """``hidden`` less the tokens the request's stop sequences hold."""
    if not stops or not hidden:
        return hidden
    held = {i for stop in stops for i in tokenizer.encode(stop, add_special_tokens=False)}
    return hidden - held
