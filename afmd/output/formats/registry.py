"""Every call format afmd reads, by the name mlx-lm gives its tool parser.

mlx-lm detects a model's call format from its chat template or vocabulary and names a
module of ``mlx_lm.tool_parsers``; afmd keys its own readers (and, in
``afmd.grammar.calls``, its grammars) by the same name, so a model is read the way mlx-lm
recognises it. ``harmony`` (gpt-oss) and ``llama3_json`` (Llama 3.1-3.3) are afmd's own:
mlx-lm has no parser for them, afmd recognises them from the vocabulary. A name missing
here is read by the generic reader: markers, then mlx-lm's parser on the whole block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from afmd.output.formats import gemma, harmony, kimi, llama, mistral, pythonic, tagged
from afmd.output.formats.base import CallContext, MarkupReader


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    start: str  # what opens the calls ("": nothing to ban when tools are hidden)
    end: str
    # Every literal the family's reader reads in the model's text (``start`` and ``end``
    # among them): the special tokens these are made of reach the reader, every other
    # special token is kept out of a chat answer (afmd.service.hidden_tokens).
    markers: tuple[str, ...]
    # The family's own reader; None: the generic one (markers and mlx-lm's parser, or
    # the Hermes JSON stream with ``incremental_json``).
    reader: Callable[[CallContext], MarkupReader] | None = None
    incremental_json: bool = False
    channels: bool = False  # the markup carries reasoning too (no thinking markers)
    call_id: Callable[[str, int], str] | None = None  # ids the family's template expects
    # No call opens without ``start``, so banning it (one token) keeps every call out:
    # ``tool_choice: "none"`` can then leave the tools in the prompt, as OpenAI does.
    # Llama 3.1's JSON calls also open as plain text (``{"name": …``).
    start_alone_opens: bool = True


def _tagged(name: str, syntax: tagged.TagSyntax) -> Family:
    return Family(name, syntax.section[0], syntax.section[1], syntax.markers,
                  tagged.reader(syntax))


def _gemma(name: str, syntax: gemma.GemmaSyntax) -> Family:
    return Family(name, syntax.start, syntax.end, syntax.markers, gemma.reader(syntax))


_HERMES = ("<tool_call>", "</tool_call>")

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("json_tools", *_HERMES, _HERMES, incremental_json=True),
        _tagged("qwen3_coder", tagged.QWEN3_CODER),
        _tagged("glm47", tagged.GLM47),
        _tagged("laguna", tagged.GLM47),
        _tagged("longcat", tagged.LONGCAT),
        _tagged("minimax_m2", tagged.MINIMAX_M2),
        _tagged("muse_spark", tagged.MUSE_SPARK),
        _tagged("minicpm5", tagged.MINICPM5),
        _tagged("kimi_k3", tagged.KIMI_K3),
        Family("kimi_k2", kimi.SECTION[0], kimi.SECTION[1], kimi.MARKERS, kimi.KimiReader,
               call_id=kimi.call_id),
        Family("mistral", mistral.MARKER, "", mistral.MARKERS, mistral.MistralReader,
               call_id=mistral.call_id),
        Family("pythonic", pythonic.START, pythonic.END, pythonic.MARKERS,
               pythonic.PythonicReader),
        _gemma("gemma4", gemma.GEMMA4),
        _gemma("function_gemma", gemma.FUNCTION_GEMMA),
        Family("harmony", "", "", harmony.MARKERS, harmony.reader, channels=True,
               start_alone_opens=False),
        Family("llama3_json", llama.PYTHON_TAG, "", llama.MARKERS, llama.reader,
               start_alone_opens=False),
    )
}


def family(name: str | None) -> Family | None:
    return FAMILIES.get(name) if name else None
