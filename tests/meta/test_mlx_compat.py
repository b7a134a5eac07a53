"""afmd.engine.mlx_compat: the module that reaches into mlx-lm's and mlx-vlm's privates.

First the upgrade alarm: what it relies on must still read as it did in the versions it
names (an upgrade of mlx-lm or mlx-vlm fails here, naming what to re-read, before it fails
anywhere else). Then each private is exercised on its own, against the real libraries and
the real demo model, and no afmd module but the compat modules (this one and MLX's
launcher's, afmd.engine.sharded.launcher_compat, which tests/meta/test_launcher_compat.py
checks) may reach into MLX's, mlx-lm's or mlx-vlm's privates.
"""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.tokenizer_utils import TokenizerWrapper

from afmd.engine import mlx_compat
from afmd.engine.demo import builtin as demo
from afmd.engine.sharded import launcher_compat

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
#: The modules allowed to reach into MLX's, mlx-lm's and mlx-vlm's privates: the compat
#: modules, and no other.
COMPAT = {Path(mlx_compat.__file__).resolve(), Path(launcher_compat.__file__).resolve()}
#: What the rest of afmd may import from MLX, mlx-lm and mlx-vlm: module -> names (None:
#: any public name). Their documented API; anything else goes through compat.
MLX_PUBLIC: dict[str, set[str] | None] = {
    "mlx.core": None,
    "mlx.nn": None,
    "mlx.utils": None,
    "mlx_lm": {"load"},
    "mlx_lm.generate": {"BatchGenerator", "batch_generate", "generate", "stream_generate",
                        "generate_step"},
    "mlx_lm.models.cache": None,
    "mlx_lm.sample_utils": None,
    "mlx_lm.tokenizer_utils": {"load"},
    "mlx_lm.utils": {"load", "load_model", "load_tokenizer", "save_model", "save_config"},
    "mlx_vlm.generate": {"generate", "stream_generate", "generate_step"},
    "mlx_vlm.models": None,
    "mlx_vlm.models.cache": None,
    "mlx_vlm.utils": {"get_model_path", "load", "prepare_inputs"},
}
MLX_PACKAGES = ("mlx", "mlx_lm", "mlx_vlm")


def test_upstream_is_what_compat_was_written_against() -> None:
    problems = mlx_compat.upstream_problems()
    assert not problems, (
        f"mlx-lm or mlx-vlm changed under afmd/engine/mlx_compat.py (written against "
        f"mlx-lm {mlx_compat.MLX_LM_VERSION}, mlx-vlm {mlx_compat.MLX_VLM_VERSION}): re-read "
        "each of these upstream, adapt compat, then update its fingerprints:\n  "
        + "\n  ".join(problems))


# --------------------------------------------------------------------------- each private


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    root = tmp_path_factory.mktemp("mlx-compat-cache")
    return mlx_lm.load(str(demo.materialize("demo", root)))


class _Plain(mlx_compat.GenerationRows):
    """mlx-lm's own step, through the hook: what the decode step sees of the state."""

    seen: list[tuple[list[int], list[int]]]

    def afmd_step(self) -> tuple[list[int], list[Any]]:
        self.seen.append((list(self.generated), list(self.next_tokens.tolist())))
        return GenerationBatch._step(self)


def test_an_attached_batch_runs_rows_and_shows_their_state(loaded: tuple[Any, Any]) -> None:
    """The generator steps the attached batch through its hook; the state it shows is
    mlx-lm's own (tokens handed out, the next tokens), and its tokens are mlx-lm's."""
    model, tokenizer = loaded
    prompt = tokenizer.encode("record number one please")

    def run(attach: bool) -> tuple[list[int], Any]:
        generator = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
        batch = None
        if attach:
            batch = _Plain.attach(generator)
            batch.seen = []
            assert generator._generation_batch is batch
        (uid,) = generator.insert([prompt], max_tokens=[6])
        tokens: list[int] = []
        while True:
            responses = generator.next_generated()
            tokens += [r.token for r in responses if r.uid == uid]
            if any(r.finish_reason for r in responses):
                break
        generator.close()
        return tokens, batch

    theirs, _ = run(False)
    ours, batch = run(True)
    assert ours == theirs and len(ours) == 6
    # A joining row comes with its first token sampled (by mlx-lm's own batch) and none
    # handed out yet; each step hands out the token sampled before it.
    assert [generated for generated, _ in batch.seen] == [[0], [1], [2], [3], [4], [5]]
    assert [nxt[0] for _, nxt in batch.seen] == ours


def test_next_state_is_writable_and_take_next_feeds_it(loaded: tuple[Any, Any]) -> None:
    model, _ = loaded
    batch = mlx_compat.GenerationRows.empty(model, lambda x: mx.argmax(x, axis=-1))
    batch.next_tokens = mx.array([5, 7], dtype=mx.uint32)
    batch.next_logprobs = ["a", "b"]
    inputs, logprobs = batch.take_next()
    assert inputs.tolist() == [5, 7] and logprobs == ["a", "b"]
    assert batch._current_tokens is inputs and batch._current_logprobs is logprobs
    assert batch.generated is batch._num_tokens and batch.stop_matchers is batch._matchers


def test_stop_sequences_match_a_row_s_own_stops() -> None:
    stops = mlx_compat.stop_sequences([[7], [8, 9]])
    matcher = stops.matcher()
    assert [matcher.advance(t) for t in (1, 8, 2, 8, 9)] == [False, False, False, False, True]
    assert mlx_compat.stop_sequences([[3]]).matcher().advance(3)


def test_hf_tokenizer_is_the_wrapped_one(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    assert isinstance(tokenizer, TokenizerWrapper)
    inner = mlx_compat.hf_tokenizer(tokenizer)
    assert not isinstance(inner, TokenizerWrapper)
    assert inner(["hello there"])["input_ids"][0] == tokenizer.encode("hello there")
    plain = object()
    assert mlx_compat.hf_tokenizer(plain) is plain


def test_unsupported_model_type_answers_as_the_loaders_would() -> None:
    """The model types mlx-lm and mlx-vlm build, found as their loaders find them (through
    their remapping tables), and those they have no module for named."""
    from mlx_lm.utils import MODEL_REMAPPING, _get_classes

    assert mlx_compat.unsupported_model_type({"model_type": "llama"}) is None
    remapped = next(iter(MODEL_REMAPPING))  # a name mlx-lm knows only through the table
    assert mlx_compat.unsupported_model_type({"model_type": remapped}) is None
    _get_classes({"model_type": remapped})  # and the loader agrees
    with pytest.raises(ValueError, match="not supported"):
        _get_classes({"model_type": "no_such_arch"})
    assert "no_such_arch" in (mlx_compat.unsupported_model_type(
        {"model_type": "no_such_arch"}) or "")
    assert mlx_compat.unsupported_model_type({}) == "it has no model_type"
    for odd in ("../llama", "a.b", 5, ""):
        assert mlx_compat.unsupported_model_type({"model_type": odd}) is not None, odd
    assert mlx_compat.unsupported_model_type({"model_type": "qwen2_vl"}, vision=True) is None
    assert mlx_compat.unsupported_model_type({"model_type": "no_such_arch"},
                                             vision=True) is not None


def test_rope_state_is_what_mlx_vlm_keeps() -> None:
    from mlx_vlm.models.qwen2_vl.language import LanguageModel

    source = inspect.getsource(LanguageModel.__init__)
    for attribute in mlx_compat.ROPE_STATE:
        assert f"self.{attribute} = None" in source, attribute

    class Language:
        _position_ids: Any = mx.array([1])
        _rope_deltas: Any = mx.array([2])

    language = Language()
    mlx_compat.reset_rope_state(language)
    assert language._position_ids is None and language._rope_deltas is None
    mlx_compat.reset_rope_state(object())  # a model without the state: nothing to reset


def test_mlx_vlm_load_taken_in_steps_is_mlx_vlm_load(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """vlm_model then vlm_processor give what ``mlx_vlm.load`` gives: the same weights,
    and a processor set up alike (its image processor, end ids, detokenizer) that turns a
    picture and a prompt into the same inputs."""
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load, prepare_inputs
    from PIL import Image

    folder = demo.materialize("demo-vision", tmp_path_factory.mktemp("mlx-compat-vision"))
    model, processor = load(str(folder))
    ours = mlx_compat.vlm_model(folder)
    eos = ours.config.eos_token_id
    assert eos == model.config.eos_token_id
    mine = mlx_compat.vlm_processor(folder, eos)

    theirs_weights = dict(tree_flatten(model.parameters()))
    our_weights = dict(tree_flatten(ours.parameters()))
    assert theirs_weights.keys() == our_weights.keys() and theirs_weights
    assert all(mx.array_equal(theirs_weights[k], our_weights[k]) for k in theirs_weights)
    assert type(mine) is type(processor)
    assert type(mine.image_processor) is type(processor.image_processor)
    assert type(mine.detokenizer) is type(processor.detokenizer)
    assert (mine.tokenizer.stopping_criteria.eos_token_ids
            == processor.tokenizer.stopping_criteria.eos_token_ids)
    assert mine.tokenizer.chat_template == processor.tokenizer.chat_template

    picture = Image.fromarray(np.random.default_rng(2).integers(0, 256, (56, 56, 3),
                                                                dtype=np.uint8))
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        tokenize=False, add_generation_prompt=True)
    index = getattr(model.config, "image_token_index", None)
    a, b = (prepare_inputs(p, images=[picture], prompts=[prompt], image_token_index=index)
            for p in (processor, mine))
    assert a.keys() == b.keys()
    for key in a:
        if a[key] is not None:
            assert np.array_equal(np.array(a[key]), np.array(b[key])), key


# --------------------------------------------------------------------------- no one else


def _class_privates(cls: type) -> set[str]:
    """A class's private names: its methods and class attributes, and the instance
    attributes its methods set (``self._x = ...``)."""
    names = {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
    for node in ast.walk(ast.parse(inspect.getsource(cls).lstrip())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            names.add(node.attr)
    return names


@functools.cache
def _mlx_internals() -> frozenset[str]:
    """Private names of the mlx-lm and mlx-vlm objects afmd handles."""
    names = set(mlx_compat.ROPE_STATE)
    for cls in (GenerationBatch, PromptProcessingBatch, BatchGenerator, TokenizerWrapper):
        names |= _class_privates(cls)
    return frozenset(names)


def _import_problems(node: ast.AST, where: str) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.level == 0:
        module = node.module or ""
        if module.split(".")[0] not in MLX_PACKAGES:
            return []
        if module in MLX_PACKAGES[:1]:  # from mlx import core, nn, utils
            allowed = {f"mlx.{a.name}" for a in node.names} <= set(MLX_PUBLIC)
            return [] if allowed else [f"{where}: from {module} import "
                                       + ", ".join(a.name for a in node.names)]
        public = MLX_PUBLIC.get(module, set())
        bad = [a.name for a in node.names
               if a.name.startswith("_") or module not in MLX_PUBLIC
               or (public is not None and a.name not in public)]
        return [f"{where}: from {module} import {', '.join(bad)}"] if bad else []
    if isinstance(node, ast.Import):
        return [f"{where}: import {a.name}" for a in node.names
                if a.name.split(".")[0] in MLX_PACKAGES and "." in a.name
                and a.name not in MLX_PUBLIC]
    return []


def _problems(path: Path, internals: frozenset[str]) -> list[str]:
    return _problems_of_source(path.read_text(encoding="utf-8"), path, internals)


def _problems_of_source(source: str, path: Path, internals: frozenset[str]) -> list[str]:
    problems = []
    tree = ast.parse(source)
    slots = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets)
             for c in ast.walk(node.value)}
    # ``self`` is an afmd object inside a class (its subclasses of mlx-lm's classes are
    # checked apart); in a function outside one it is a borrowed object.
    in_class = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                for n in ast.walk(c)}
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        problems += _import_problems(node, where)
        on_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
            node.value.id == "self")
        if (isinstance(node, ast.Attribute) and node.attr in internals
                and not (on_self and id(node) in in_class)):
            problems.append(f"{where}: .{node.attr}")
        elif (isinstance(node, ast.Constant) and node.value in internals
              and id(node) not in slots):
            problems.append(f"{where}: {node.value!r}")
    return problems


def _subclass_problems(path: Path, internals: frozenset[str]) -> list[str]:
    """``self.<mlx-lm internal>`` inside afmd's subclasses of mlx-lm's classes."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    namespace = __import__(module, fromlist=["_"])
    problems = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        cls = getattr(namespace, node.name, None) if isinstance(node, ast.ClassDef) else None
        if not (isinstance(cls, type) and issubclass(cls, GenerationBatch)):
            continue
        for inner in ast.walk(node):
            if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                    and inner.value.id == "self" and inner.attr in internals):
                problems.append(f"{path.relative_to(ROOT)}:{inner.lineno}: self.{inner.attr}")
    return problems


_MODULES = sorted(p for p in (ROOT / "afmd").rglob("*.py") if p.resolve() not in COMPAT)


def test_only_compat_modules_are_exempt() -> None:
    """The exemption names compat modules alone: a module that reaches into MLX's privates
    says so in its name (``*_compat.py``), and has a fingerprint test of its own."""
    assert all(path.name.endswith("_compat.py") for path in COMPAT), COMPAT
    for path in COMPAT:
        assert (ROOT / "tests" / "meta" / f"test_{path.stem}.py").is_file(), path


@pytest.mark.parametrize("path", _MODULES, ids=lambda p: str(p.relative_to(ROOT / "afmd")))
def test_no_private_outside_compat(path: Path) -> None:
    internals = _mlx_internals()
    problems = _problems(path, internals)
    if "engine" in path.relative_to(ROOT).parts:
        problems += _subclass_problems(path, internals)
    assert not problems, ("MLX's, mlx-lm's and mlx-vlm's internals belong in a compat module "
                          "(afmd/engine/mlx_compat.py, afmd/engine/sharded/launcher_compat.py):"
                          "\n  " + "\n  ".join(problems))


def test_the_check_sees_privates() -> None:
    internals = _mlx_internals()
    assert {"_step", "_num_tokens", "_matchers", "_next_tokens", "_generation_batch",
            "_tokenizer", "_rope_deltas"} <= internals
    found = "\n".join(
        problem for path in sorted(COMPAT)
        for problem in _problems(path, internals) + _subclass_problems(path, internals))
    for needle in ("from mlx._distributed_utils import launch",
                   "from mlx_lm.generate import GenerationBatch", "._generation_batch",
                   "self._num_tokens", "self._matchers", "'_tokenizer'", "'_rope_deltas'"):
        assert needle in found, (needle, found)
    handout = "def account(self, batch):\n    self._num_tokens[0] += 1\n"
    tree_path = ROOT / "afmd" / "engine" / "_probe.py"
    problems = [p for p in _problems_of_source(handout, tree_path, internals)]
    assert problems == ["afmd/engine/_probe.py:2: ._num_tokens"], problems
    assert len(_MODULES) > 100
