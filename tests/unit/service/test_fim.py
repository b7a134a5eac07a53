"""Fill-in-the-middle prompts per family, on tokenizers built here with each family's
markers, and the ``fim`` setting of a model entry.

Each tokenizer is byte-level (every text encodes, nothing is unknown) plus the family's
marker tokens and, for families whose tokenizer adds one, a BOS; the FIM prompt must be
the family's documented layout, token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from afmd.config.bounds import ConfigError
from afmd.config.load import load_config
from afmd.config.tables import FimSetting
from afmd.service import fim

PREFIX = "def area(r):\n    return "
SUFFIX = "\n\nprint(area(2))\n"


def tokenizer(markers: list[str], *, bos: str | None = None,
              special: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    t = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    controls = [bos] if bos else []
    t.add_special_tokens([AddedToken(x, special=True, normalized=False)
                          for x in [*controls, *special]])
    t.add_tokens([AddedToken(x, special=False, normalized=False) for x in markers])
    if bos:
        t.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, t.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token=bos)


def ids(tok: Any, *parts: str) -> list[int]:
    """Marker parts (wrapped in ``@``) as their ids, text parts encoded as text."""
    out: list[int] = []
    for part in parts:
        if part.startswith("@"):
            out.append(tok.convert_tokens_to_ids(part[1:]))
        elif part:
            out += tok.encode(part, add_special_tokens=False)
    return out


FAMILIES = [
    pytest.param(
        ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|endoftext|>",
         "<|file_sep|>", "<|repo_name|>"], None, "qwen",
        ("@<|fim_prefix|>", PREFIX, "@<|fim_suffix|>", SUFFIX, "@<|fim_middle|>"),
        "<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>",
        {"<|fim_pad|>", "<|endoftext|>", "<|file_sep|>", "<|repo_name|>"},
        id="qwen2.5-coder"),
    pytest.param(
        ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|endoftext|>"], None,
        "starcoder",
        ("@<fim_prefix>", PREFIX, "@<fim_suffix>", SUFFIX, "@<fim_middle>"),
        "<fim_prefix>" + PREFIX + "<fim_suffix>" + SUFFIX + "<fim_middle>",
        {"<fim_pad>", "<|endoftext|>"}, id="starcoder"),
    pytest.param(
        ["\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>"], "<s>", "codellama",
        ("@<s>", "@\u2581<PRE>", PREFIX, "@\u2581<SUF>", SUFFIX, "@\u2581<MID>"),
        "<s>\u2581<PRE>" + PREFIX + "\u2581<SUF>" + SUFFIX + "\u2581<MID>",
        {"\u2581<EOT>"}, id="codellama"),
    pytest.param(
        ["<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
         "<\uff5cfim\u2581end\uff5c>", "<|EOT|>"],
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "deepseek",
        ("@<\uff5cbegin\u2581of\u2581sentence\uff5c>", "@<\uff5cfim\u2581begin\uff5c>", PREFIX,
         "@<\uff5cfim\u2581hole\uff5c>", SUFFIX, "@<\uff5cfim\u2581end\uff5c>"),
        "<\uff5cbegin\u2581of\u2581sentence\uff5c><\uff5cfim\u2581begin\uff5c>" + PREFIX
        + "<\uff5cfim\u2581hole\uff5c>" + SUFFIX + "<\uff5cfim\u2581end\uff5c>",
        {"<|EOT|>"}, id="deepseek-coder"),
    pytest.param(
        # Mistral's FIM puts the suffix first; the middle follows the prefix directly.
        ["[PREFIX]", "[SUFFIX]", "[MIDDLE]"], "<s>", "codestral",
        ("@<s>", "@[SUFFIX]", SUFFIX, "@[PREFIX]", PREFIX),
        "<s>[SUFFIX]" + SUFFIX + "[PREFIX]" + PREFIX,
        set(), id="codestral"),
]


@pytest.mark.parametrize(("markers", "bos", "family", "layout", "text", "ends"), FAMILIES)
def test_family_prompt(markers: list[str], bos: str | None, family: str,
                       layout: tuple[str, ...], text: str, ends: set[str]) -> None:
    tok = tokenizer(markers, bos=bos)
    fmt = fim.detect(tok)
    assert fmt is not None and fmt.family == family
    plan = fim.plan_for(tok, None)
    assert plan is not None
    prompt = fim.build_prompt(tok, plan, PREFIX, SUFFIX)
    assert prompt == ids(tok, *layout)
    assert tok.decode(prompt) == text
    # The middle ends at the family's end tokens (those its vocabulary has) and at any
    # marker the model writes; never at ordinary text.
    end_tokens = set(tok.convert_ids_to_tokens(list(plan.end_ids)))
    assert ends <= end_tokens
    assert end_tokens - ends <= {fmt.prefix, fmt.suffix, fmt.middle}
    assert plan.end_texts == ()


def test_empty_parts_add_no_tokens() -> None:
    tok = tokenizer(["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"])
    plan = fim.plan_for(tok, None)
    assert plan is not None
    assert tok.decode(fim.build_prompt(tok, plan, "", "")) == \
        "<|fim_prefix|><|fim_suffix|><|fim_middle|>"


def test_no_markers_no_format() -> None:
    assert fim.detect(tokenizer(["<tool_call>"])) is None
    assert fim.plan_for(tokenizer([]), None) is None
    # Two of three markers are not a format.
    assert fim.detect(tokenizer(["<|fim_prefix|>", "<|fim_suffix|>"])) is None


def test_configured_markers_win_and_may_span_tokens() -> None:
    tok = tokenizer(["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<END>"])
    setting = FimSetting(prefix="<PRE>", suffix="<SUF>", middle="<MID>",
                         stop=("<END>", "// end"))
    plan = fim.plan_for(tok, setting)
    assert plan is not None and plan.format.family == "configured"
    prompt = fim.build_prompt(tok, plan, "a", "b")
    assert tok.decode(prompt) == "<PRE>a<SUF>b<MID>"
    # A one-token end stops the engine; a longer one is a stop sequence on the text.
    assert tok.convert_ids_to_tokens(list(plan.end_ids)) == ["<END>"]
    assert plan.end_texts == ("// end",)


def test_configured_suffix_first_without_middle() -> None:
    tok = tokenizer([])
    setting = FimSetting(prefix="<P>", suffix="<S>", suffix_first=True)
    plan = fim.plan_for(tok, setting)
    assert plan is not None
    assert tok.decode(fim.build_prompt(tok, plan, "pre", "suf")) == "<S>suf<P>pre"


def test_raw_prompt_gets_the_models_bos_once() -> None:
    with_bos = tokenizer([], bos="<s>")
    assert fim.encode_text(with_bos, "hi") == ids(with_bos, "@<s>", "hi")
    assert fim.encode_text(with_bos, "<s>hi") == ids(with_bos, "@<s>", "hi")
    without = tokenizer([])
    assert fim.encode_text(without, " hi") == ids(without, " hi")


def _config(tmp_path: Path, fim_line: str) -> Any:
    path = tmp_path / "afmd.toml"
    path.write_text(f'[[models.model]]\nid = "coder"\npath = "afmd:demo"\nfim = {fim_line}\n')
    return load_config(path, env={})


def test_fim_setting_in_config(tmp_path: Path) -> None:
    config = _config(tmp_path, '{ prefix = "<PRE>", suffix = "<SUF>", middle = "<MID>", '
                               'stop = ["<EOT>"] }')
    (entry,) = [m for m in config.models.model if m.id == "coder"]
    assert entry.fim == FimSetting("<PRE>", "<SUF>", "<MID>", False, ("<EOT>",))
    config = _config(tmp_path, '{ prefix = "[PREFIX]", suffix = "[SUFFIX]", '
                               "suffix_first = true }")
    (entry,) = [m for m in config.models.model if m.id == "coder"]
    assert entry.fim == FimSetting("[PREFIX]", "[SUFFIX]", "", True, ())


@pytest.mark.parametrize(("line", "key"), [
    ('"<PRE>"', "models.model[0].fim"),
    ('{ prefix = "a", suffix = "b" }', "models.model[0].fim.middle"),
    ('{ prefix = "a", middle = "m" }', "models.model[0].fim.suffix"),
    ('{ prefix = "", suffix = "b", middle = "m" }', "models.model[0].fim.prefix"),
    ('{ prefix = "a", suffix = "b", middle = "m", sufix_first = true }',
     "models.model[0].fim.sufix_first"),
    ('{ prefix = "a", suffix = "b", middle = "m", stop = "x" }', "models.model[0].fim.stop"),
    ('{ prefix = "a", suffix = 1, middle = "m" }', "models.model[0].fim.suffix"),
])
def test_bad_fim_setting_names_the_key(tmp_path: Path, line: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, line)
    assert info.value.key == key
