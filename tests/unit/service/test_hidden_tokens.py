"""Which special tokens a chat answer leaves out (afmd.service.hidden_tokens), on the
tokenizers of the call-format suite's models: the family's markers, its reasoning
markers and its end ids stay; the prompt's structure tokens go."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from afmd.output.formats.registry import FAMILIES
from afmd.service.hidden_tokens import for_stops, hidden_tokens, special_tokens

from helpers.format_models import build
from helpers.formats import SPECS

# What each model's chat answer hides: its tokens that are neither an end id nor read.
HIDDEN = {
    "hermes": {"<|im_start|>"},
    "mistral": {"<unk>", "<s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"},
    "llama3": {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"},
    "harmony": set(),  # every token is read or ends the turn
    "kimi_k3": set(),  # <|open|>, <|close|>, <|sep|> make up its markers
    "gemma4": {"<|im_start|>"},  # <|channel>, <channel|> make up its thinking markers
    "glm47": {"[gMASK]", "<sop>", "<|system|>", "<|assistant|>"},
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hidden")
    return {name: load_tokenizer(build(SPECS[name], root / name)) for name in HIDDEN}


def ids_of(tokenizer: Any, texts: Any) -> set[int]:
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in texts}


@pytest.mark.parametrize("name", list(HIDDEN))
def test_only_tokens_nothing_reads_are_hidden(tokenizers: dict[str, Any], name: str) -> None:
    spec, tokenizer = SPECS[name], tokenizers[name]
    markers = FAMILIES[spec.reader].markers + (spec.think or ())
    hidden = hidden_tokens(tokenizer, markers, ids_of(tokenizer, spec.eos))
    assert hidden == ids_of(tokenizer, HIDDEN[name])


def test_an_unknown_parser_hides_nothing(tokenizers: dict[str, Any]) -> None:
    """Where an mlx-lm parser afmd has no reader for reads the calls, afmd cannot tell
    which special tokens it reads."""
    assert hidden_tokens(tokenizers["mistral"], None, ()) == frozenset()


def test_a_token_a_stop_sequence_holds_is_kept(tokenizers: dict[str, Any]) -> None:
    """A client's stop sequence must still match where the token's text was."""
    tokenizer = tokenizers["mistral"]
    hidden = hidden_tokens(tokenizer, FAMILIES["mistral"].markers, ())
    inst = ids_of(tokenizer, ["[INST]", "[/INST]"])
    assert for_stops(hidden, tokenizer, ()) is hidden
    assert for_stops(hidden, tokenizer, ["\n\n", "</x>"]) == hidden
    assert for_stops(hidden, tokenizer, ["x[/INST]", "[INST]"]) == hidden - inst


def test_named_special_tokens_count_too() -> None:
    """``all_special_ids`` (a SentencePiece tokenizer's ``<s>``, ``<unk>``) besides the
    added tokens flagged special; added tokens that are not special are text."""
    added = {7: SimpleNamespace(content="<|im_start|>", special=True),
             8: SimpleNamespace(content="<think>", special=False)}
    tokenizer = SimpleNamespace(added_tokens_decoder=added, all_special_ids=[0, 1, 7],
                                convert_ids_to_tokens=lambda ids: [["<unk>", "<s>"][i]
                                                                   for i in ids])
    assert special_tokens(tokenizer) == {0: "<unk>", 1: "<s>", 7: "<|im_start|>"}
    assert hidden_tokens(tokenizer, (), [1]) == {0, 7}


def test_a_tokenizer_without_special_tokens_hides_nothing() -> None:
    assert hidden_tokens(SimpleNamespace(), ("<tool_call>",), ()) == frozenset()

