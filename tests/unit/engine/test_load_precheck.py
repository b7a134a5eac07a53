"""afmd.engine.models.precheck: a folder that cannot load is told from its listing and
config.json, and one that may load is never refused by it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from afmd.config.tables import ModelEntry
from afmd.engine.demo import builtin
from afmd.engine.models import precheck


def entry(path: Path | str) -> ModelEntry:
    return ModelEntry(id="m", path=str(path))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(builtin.materialize("demo"), copy)
    return copy


def test_a_loadable_folder_passes(folder: Path) -> None:
    precheck.check(entry(folder))


def test_what_it_leaves_to_the_load(tmp_path: Path) -> None:
    precheck.check(entry("afmd:demo"))  # built in
    precheck.check(entry("owner/not-downloaded"))  # a Hugging Face id


@pytest.mark.parametrize("vocabulary", [
    ["tokenizer.json"], ["tokenizer.model"], ["vocab.txt"], ["vocab.json", "merges.txt"],
    ["qwen.tiktoken"], ["spiece.model"], ["tekken.json"]])
def test_any_vocabulary_file_will_do(folder: Path, vocabulary: list[str]) -> None:
    (folder / "tokenizer.json").unlink()
    for name in vocabulary:
        (folder / name).write_text("x")
    precheck.check(entry(folder))


@pytest.mark.parametrize(("change", "error", "words"), [
    (lambda f: (f / "config.json").unlink(), FileNotFoundError, "no config.json"),
    (lambda f: (f / "config.json").write_text("{"), ValueError, "cannot be read as JSON"),
    (lambda f: (f / "config.json").write_text("[1]"), ValueError, "not a JSON object"),
    (lambda f: (f / "model.safetensors").rename(f / "weights.npz"), FileNotFoundError,
     "no weight files"),
    (lambda f: (f / "tokenizer.json").unlink(), ValueError, "its tokenizer is empty"),
    (lambda f: (f / "config.json").write_text(json.dumps({"model_type": "no_such_arch"})),
     ValueError, "model_type 'no_such_arch' is not one mlx-lm supports"),
    (lambda f: (f / "config.json").write_text("{}"), ValueError, "no model_type"),
])
def test_a_folder_that_cannot_load_is_named(folder: Path, change, error, words) -> None:
    change(folder)
    with pytest.raises(error, match=words) as raised:
        precheck.check(entry(folder))
    assert str(folder) in str(raised.value)


def test_a_missing_folder_is_the_load_s_own_words(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="does not exist"):
        precheck.check(entry(tmp_path / "nowhere"))


def test_a_custom_model_file_is_left_to_the_load(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        {**config, "model_type": "mine", "model_file": "mine.py"}))
    precheck.check(entry(folder))


def test_a_vision_folder_is_asked_of_mlx_vlm(folder: Path) -> None:
    """A folder with a ``vision_config`` loads through mlx-vlm: its architectures, and its
    weights as mlx-vlm looks for them (any ``*.safetensors``)."""
    pytest.importorskip("mlx_vlm")
    config = json.loads((folder / "config.json").read_text())
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    (folder / "config.json").write_text(json.dumps(
        {**config, "model_type": "qwen2_vl", "vision_config": {}}))
    precheck.check(entry(folder))
    (folder / "config.json").write_text(json.dumps(
        {**config, "model_type": "no_such_arch", "vision_config": {}}))
    with pytest.raises(ValueError, match="not one mlx-vlm supports"):
        precheck.check(entry(folder))
