"""The built-in demo models: deterministic, loadable by mlx-lm, wired for tools and thinking."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

mlx_lm = pytest.importorskip("mlx_lm")

from afmd.engine.demo import builtin as demo  # noqa: E402
from afmd.paths import cache_dir  # noqa: E402

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rainy"}]},
    {"role": "assistant", "content": "Sunny and rainy."},
    {"role": "user", "content": "Thanks"},
]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("afmd-cache")


@pytest.fixture(scope="module")
def loaded(cache_root: Path):
    return mlx_lm.load(str(demo.materialize("demo", cache_root)))


def test_materialize_is_cached_and_deterministic(cache_root: Path, tmp_path: Path) -> None:
    first = demo.materialize("demo", cache_root)
    second = demo.materialize("demo", cache_root)
    assert first == second
    assert first.parent == cache_root / "models"
    assert first.name.startswith("demo-")
    assert [p.name for p in (cache_root / "models").iterdir() if p.name.startswith(".")] == []

    elsewhere = demo.materialize("demo", tmp_path / "other-root")
    assert elsewhere.name == first.name
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha(first / name) == _sha(elsewhere / name), name

    built = tmp_path / "built"
    demo.build("demo", built)
    assert _sha(built / "model.safetensors") == _sha(first / "model.safetensors")


def test_concurrent_materialize_agrees(tmp_path: Path) -> None:
    barrier = threading.Barrier(4)

    def race() -> Path:
        barrier.wait()
        return demo.materialize("demo", tmp_path)

    with ThreadPoolExecutor(4) as pool:
        folders = set(pool.map(lambda _: race(), range(4)))
    assert len(folders) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [folders.pop().name]


def test_damaged_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    folder = demo.materialize("demo", tmp_path)
    reference = _sha(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    assert demo.materialize("demo", tmp_path) == folder
    assert _sha(folder / "model.safetensors") == reference


def test_unknown_variant_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        demo.materialize("nope", tmp_path)


def test_cache_dir_honours_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AFMD_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("AFMD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    expected = tmp_path / "xdg" / "afmd"
    if sys.platform == "darwin":
        expected = Path.home() / "Library" / "Caches" / "afmd"
    assert cache_dir() == expected


def test_config(cache_root: Path) -> None:
    folder = demo.materialize("demo", cache_root)
    config = json.loads((folder / "config.json").read_text())
    vocab = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert config["model_type"] == "qwen2"
    assert config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == 131072
    assert config["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]


def test_load_detects_tools_and_thinking(loaded) -> None:
    _, tokenizer = loaded
    assert tokenizer.has_tool_calling
    assert tokenizer.tool_call_start == "<tool_call>"
    assert tokenizer.has_thinking
    assert tokenizer.think_start == "<think>"
    assert type(tokenizer._tokenizer).__name__ == "Qwen2Tokenizer"
    call = tokenizer.tool_parser('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n')
    assert call == {"name": "get_weather", "arguments": {"city": "Paris"}}


def test_special_tokens_are_single_ids(loaded) -> None:
    _, tokenizer = loaded
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids), ids
    assert len({i[0] for i in ids}) == len(SPECIAL_TOKENS)
    assert tokenizer.eos_token_ids == {ids[2][0], ids[0][0]}
    text = "x<tool_call>{}</tool_call><think>y</think>"
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(encoded, skip_special_tokens=True) == text


def test_chat_template_with_tools(loaded) -> None:
    _, tokenizer = loaded
    text = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert "</tools>\n" in text
    expected_tail = (
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrainy\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nSunny and rainy.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text.endswith("<|im_end|>\n" + expected_tail)


def test_chat_template_plain_and_thinking_switch(loaded) -> None:
    _, tokenizer = loaded
    messages = [{"role": "user", "content": "hi"}]
    plain = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    render = tokenizer.apply_chat_template
    assert render(messages, add_generation_prompt=True, tokenize=False) == plain
    assert (
        render(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
        == plain + "<think>\n\n</think>\n\n"
    )
    assert render(messages, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_greedy_generation_is_deterministic_and_varied(loaded) -> None:
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello, who are you?"}], add_generation_prompt=True
    )

    def run() -> list[int]:
        return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=40)]

    first = run()
    assert len(first) == 40
    assert first == run()
    assert len(set(first)) > 5


def test_sampling_varies(loaded) -> None:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True
    )
    outputs = set()
    for seed in range(3):
        mx.random.seed(seed)
        stream = mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=12, sampler=make_sampler(temp=1.0)
        )
        outputs.add(tuple(r.token for r in stream))
    assert len(outputs) == 3


@pytest.mark.slow
def test_32k_variant_loads(cache_root: Path) -> None:
    folder = demo.materialize("demo-32k", cache_root)
    assert folder.name.startswith("demo-32k-")
    model, tokenizer = mlx_lm.load(str(folder))
    assert len(tokenizer.vocab) >= 30000
    assert model.args.vocab_size == len(tokenizer.vocab)
    assert tokenizer.has_tool_calling and tokenizer.has_thinking
    assert all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in SPECIAL_TOKENS)
