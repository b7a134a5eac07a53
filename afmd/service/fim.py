"""Fill-in-the-middle: which markers a model family was trained with, and its prompt.

A code model learns FIM with three special tokens around the code before and after the
cursor, and writes the middle until an end token. Families differ in the marker tokens,
in their order (Mistral's Codestral puts the suffix first and has the model continue
right after the prefix) and in the tokens that end the middle. afmd reads the family
from the tokenizer's vocabulary (each marker must be one token there), or takes the
markers an operator names in a model's ``fim`` setting, and builds the prompt as token
ids: each text part encoded by the model's own tokenizer, each marker as its id.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from afmd.config.tables import FimSetting
from afmd.engine.models.prompt_bound import encode_prompt


@dataclass(frozen=True, slots=True)
class FimFormat:
    """A family's FIM markers; ``middle`` is None where generation follows the prefix."""

    family: str
    prefix: str
    suffix: str
    middle: str | None
    suffix_first: bool = False
    #: Tokens that end the middle besides the model's end-of-sequence ones (those the
    #: vocabulary has); the three markers themselves end it too.
    ends: tuple[str, ...] = ()


#: Known families, in detection order: a tokenizer is of the first whose three markers
#: (two for suffix-first) are all single tokens of its vocabulary.
FAMILIES: tuple[FimFormat, ...] = (
    # Qwen2.5-Coder, StarCoder2-style vocabularies, CodeGemma.
    FimFormat("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
              ends=("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>",
                    "<|file_separator|>")),
    # StarCoder, SantaCoder.
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>",
              ends=("<|endoftext|>", "<fim_pad>", "<file_sep>")),
    # CodeLlama: its tokenizer spells the markers with SentencePiece's word boundary.
    FimFormat("codellama", "\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>",
              ends=("\u2581<EOT>",)),
    FimFormat("codellama", "<PRE>", "<SUF>", "<MID>", ends=("<EOT>",)),
    # DeepSeek-Coder.
    FimFormat("deepseek", "<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
              "<\uff5cfim\u2581end\uff5c>", ends=("<|EOT|>",)),
    # Codestral: [SUFFIX] suffix [PREFIX] prefix, the middle follows.
    FimFormat("codestral", "[PREFIX]", "[SUFFIX]", None, suffix_first=True),
)


@dataclass(frozen=True, slots=True)
class FimPlan:
    """A model's FIM format resolved against its tokenizer: marker and end ids."""

    format: FimFormat
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    middle: tuple[int, ...]
    end_ids: tuple[int, ...]  # single-token ends: the engine stops on them, unseen
    end_texts: tuple[str, ...]  # ends that are not one token: stop sequences instead


def single_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when it is one token of the vocabulary (not an unknown)."""
    try:
        token_id = tokenizer.convert_tokens_to_ids(text)
    except (KeyError, ValueError, TypeError):
        return None
    if not isinstance(token_id, int) or token_id < 0:
        return None
    return token_id if tokenizer.convert_ids_to_tokens(token_id) == text else None


def detect(tokenizer: Any) -> FimFormat | None:
    """The family whose markers the vocabulary has, if any."""
    for fmt in FAMILIES:
        markers = (fmt.prefix, fmt.suffix) + ((fmt.middle,) if fmt.middle else ())
        if all(single_id(tokenizer, m) is not None for m in markers):
            return fmt
    return None


def from_setting(setting: FimSetting) -> FimFormat:
    return FimFormat(
        family="configured",
        prefix=setting.prefix,
        suffix=setting.suffix,
        middle=setting.middle or None,
        suffix_first=setting.suffix_first,
        ends=setting.stop,
    )


_PLANS: weakref.WeakKeyDictionary[Any, dict[FimSetting | None, FimPlan | None]] = (
    weakref.WeakKeyDictionary()
)


def plan_for(tokenizer: Any, setting: FimSetting | None) -> FimPlan | None:
    """The model's FIM plan (its ``fim`` setting wins over detection); None: it has none.

    Cached per tokenizer: lookups in a large vocabulary are not free.
    """
    try:
        cache = _PLANS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: compute every time
        cache = {}
    if setting not in cache:
        fmt = from_setting(setting) if setting is not None else detect(tokenizer)
        cache[setting] = None if fmt is None else _resolve(tokenizer, fmt)
    return cache[setting]


def _resolve(tokenizer: Any, fmt: FimFormat) -> FimPlan:
    configured = fmt.family == "configured"

    def marker(text: str | None) -> tuple[int, ...]:
        if not text:
            return ()
        one = single_id(tokenizer, text)
        if one is not None:
            return (one,)
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    prefix, suffix, middle = marker(fmt.prefix), marker(fmt.suffix), marker(fmt.middle)
    end_ids: list[int] = [m[0] for m in (prefix, suffix, middle) if len(m) == 1]
    end_texts: list[str] = []
    for end in fmt.ends:
        if not configured:  # a family's optional ends may simply be absent
            one = single_id(tokenizer, end)
            if one is not None:
                end_ids.append(one)
            continue
        ids = marker(end)  # an operator's end may be any text the tokenizer makes one token
        if len(ids) == 1:
            end_ids.append(ids[0])
        else:
            end_texts.append(end)
    return FimPlan(fmt, prefix, suffix, middle, tuple(dict.fromkeys(end_ids)),
                   tuple(end_texts))


def leading_ids(tokenizer: Any) -> tuple[int, ...]:
    """What the tokenizer puts before any text it encodes (its BOS, if it adds one)."""
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return tuple(full[:start])
    return ()


def lead_for(tokenizer: Any, text: str) -> list[int]:
    """The ids a raw prompt gets before ``text``: the model's BOS where it adds one, not
    twice when the text already starts with it."""
    lead = list(leading_ids(tokenizer))
    bos = getattr(tokenizer, "bos_token", None)
    if lead and bos and text.startswith(bos):
        return []
    return lead


def encode_text(tokenizer: Any, text: str, bound: int | None = None) -> list[int]:
    """A raw prompt's ids: the text as given, after :func:`lead_for`; nothing the
    tokenizer might append. ``bound``: the window, past which a text far longer is
    :class:`~afmd.engine.models.prompt_bound.PromptTooLong` before it is encoded whole."""
    return lead_for(tokenizer, text) + encode_prompt(tokenizer, text, bound)


def build_prompt(tokenizer: Any, plan: FimPlan, prefix: str, suffix: str,
                 bound: int | None = None) -> list[int]:
    """The FIM prompt's ids: BOS where the model adds one, then the family's order;
    ``bound`` as :func:`encode_text`'s, for each part."""
    def text(part: str) -> list[int]:
        return encode_prompt(tokenizer, part, bound) if part else []

    ids = list(leading_ids(tokenizer))
    if plan.format.suffix_first:
        ids += [*plan.suffix, *text(suffix), *plan.prefix, *text(prefix), *plan.middle]
    else:
        ids += [*plan.prefix, *text(prefix), *plan.suffix, *text(suffix), *plan.middle]
    return ids
