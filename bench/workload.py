"""What every system is asked to do: prompts, request bodies, schemas, conversations.

Everything is deterministic so that afmd, mlx_lm.server and raw mlx-lm see the same
token sequences. Decoding is greedy (``temperature: 0``) with a fixed ``max_tokens``;
the random-weight demo models rarely emit an end-of-sequence token, so streams run to
``max_tokens`` (token counts come from the usage chunk all the same).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

_TOPICS = (
    "a lighthouse keeper", "a clockmaker", "a river pilot", "a mountain courier",
    "a city gardener", "a night baker", "a museum guard", "a radio operator",
    "a glass blower", "a ferry captain", "a bee keeper", "a cartographer",
    "a violin maker", "a snow plough driver", "a librarian", "a train conductor",
)

_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from his her they this be are "
    "have had not but one all were when there can an which their said if do will each "
    "about how up out them then she many some so these would other into has more two "
    "time could go see no way people my than first water been call who oil its now find "
    "long down day did get come made may part over new sound take only little work know "
    "place year live me back give most very after thing our just name good sentence man "
    "think say great where help through much before line right too mean old any same tell "
    "boy follow came want show also around form three small set put end does another well "
    "large must big even such because turn here why ask went men read need land different "
    "home us move try kind hand picture again change off play spell air away animal house "
    "point page letter mother answer found study still learn should world high every near "
    "add food between own below country plant last school father keep tree never start city "
    "earth eye light thought head under story saw left few while along might close something "
    "seem next hard open example begin life always those both paper together got group often"
)
_WORDS = _WORDS_TEXT.split(" ")


def prompt(tag: str, i: int = 0) -> str:
    """A short prompt unique to (tag, i), so that no server's prefix cache can answer it.

    The unique part comes first; every prompt has about the same number of tokens.
    """
    topic = _TOPICS[i % len(_TOPICS)]
    return f"[{tag} {i}] Write a long story about {topic} who collects old maps."


def messages(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def chat_body(msgs: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "messages": msgs,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }


# A schema whose output is long and fully constrained: bounded strings, enums, integers.
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["alpha", "beta", "gamma", "delta", "omega"]},
            "minItems": 8,
            "maxItems": 8,
        },
        "count": {"type": "integer", "minimum": 0, "maximum": 100000},
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 8,
            "maxItems": 8,
        },
    },
    "required": ["title", "tags", "count", "notes"],
    "additionalProperties": False,
}

RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "record", "schema": JSON_SCHEMA, "strict": True},
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "record",
            "description": "Record a catalogue entry.",
            "parameters": JSON_SCHEMA,
        },
    }
]


#: What each constrained request is compared with: the same prompt, no grammar. A tools
#: request's prompt carries the tool definitions (~280 more tokens with the demo
#: template), so its twin carries the same text as its system message instead.
GRAMMAR_BASELINE = {"json_schema": "unconstrained", "tool_required": "tools_as_text"}


#: The tool block a ChatML/Qwen2 template writes into the system message (the demo's).
TOOLS_AS_TEXT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def grammar_bodies(text: str, max_tokens: int) -> dict[str, dict[str, Any]]:
    """The constrained requests and their unconstrained twins."""
    msgs = messages(text)
    tools_text = TOOLS_AS_TEXT.format(tools="\n".join(json.dumps(t) for t in TOOLS))
    return {
        "unconstrained": chat_body(msgs, max_tokens),
        "json_schema": chat_body(msgs, max_tokens, response_format=RESPONSE_FORMAT),
        "tools_as_text": chat_body([{"role": "system", "content": tools_text}, *msgs],
                                   max_tokens),
        "tool_required": chat_body(msgs, max_tokens, tools=TOOLS, tool_choice="required"),
    }


# -- the shared-prefix conversation ------------------------------------------------------


class TokenCounter:
    """Counts tokens with the model's own tokenizer.json (the ``tokenizers`` package)."""

    def __init__(self, model_folder: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(Path(model_folder) / "tokenizer.json"))

    def __call__(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


def _paragraph(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    return " ".join(words).capitalize() + "."


def prefix_conversation(seed: str, target_tokens: int, count: TokenCounter
                        ) -> list[dict[str, Any]]:
    """A first-turn conversation of about ``target_tokens`` tokens, unique to ``seed``.

    The seed text opens the system message, so no two runs share more than a handful of
    leading tokens and the first turn is never a prefix-cache hit.
    """
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": f"Session {seed}. You are a helpful archivist."}
    ]
    total = count(msgs[0]["content"]) + 8
    turn = 0
    while total < target_tokens:
        role = "user" if turn % 2 == 0 else "assistant"
        text = _paragraph(rng, 120)
        msgs.append({"role": role, "content": text})
        total += count(text) + 5
        turn += 1
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "Please continue the catalogue."})
    return msgs


def second_turn(first: list[dict[str, Any]], reply: str) -> list[dict[str, Any]]:
    return [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Thank you. Now list three more entries."},
    ]
