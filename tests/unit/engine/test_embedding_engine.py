"""The embedding engine on the real demo-embedding model, and how a model's kind is read."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from afmd.config.load import load_config
from afmd.config.tables import ModelEntry
from afmd.engine import embedding_thread as embedding
from afmd.engine.demo import builtin as demo
from afmd.engine.embedding_thread import Embedder, groups, truncate
from afmd.engine.generation import EmbeddingJob
from afmd.engine.models import kinds
from afmd.engine.models.kinds import CHAT, EMBEDDING, EmbeddingSpec
from afmd.engine.models.model_registry import ModelRegistry
from afmd.errors import InvalidRequestError

from helpers.numerics import tolerance

# -- kinds ---------------------------------------------------------------------------------


def _folder(root: Path, name: str, config: dict[str, Any], files: dict[str, Any]) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    for rel, content in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(json.dumps(content))
    return folder


def _sentence_transformers(root: Path, name: str, pooling: dict[str, bool],
                           normalize: bool) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    return _folder(root, name, {}, {"modules.json": modules,
                                    "1_Pooling/config.json": pooling})


def test_kind_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marked = _folder(tmp_path, "marked", {"afmd_embedding": {"pooling": "mean",
                                                             "normalize": False}}, {})
    last = _sentence_transformers(tmp_path, "st-last", {"pooling_mode_lasttoken": True}, True)
    cls = _sentence_transformers(tmp_path, "st-cls", {"pooling_mode_cls_token": True}, False)
    mean = _sentence_transformers(tmp_path, "st-mean", {"pooling_mode_mean_tokens": True}, True)
    plain = _folder(tmp_path, "plain", {}, {})

    def resolved(path: Path, kind: str | None = None) -> tuple[str, EmbeddingSpec | None]:
        return kinds.resolve(ModelEntry("m", str(path), kind=kind), path)

    assert resolved(marked) == (EMBEDDING, EmbeddingSpec("mean", False, False))
    assert resolved(last) == (EMBEDDING, EmbeddingSpec("last", True, False))
    assert resolved(cls) == (EMBEDDING, EmbeddingSpec("cls", False, False))
    assert resolved(mean) == (EMBEDDING, EmbeddingSpec("mean", True, False))
    assert resolved(plain) == (CHAT, None)
    assert resolved(plain, "embedding") == (EMBEDDING, EmbeddingSpec())  # Qwen3-Embedding
    assert resolved(marked, "chat") == (CHAT, None)  # the entry's kind wins
    bad = _folder(tmp_path, "bad", {"afmd_embedding": {"pooling": "max"}}, {})
    with pytest.raises(ValueError, match="pooling"):
        resolved(bad)
    assert kinds.declared_kind(ModelEntry("m", str(bad))) == EMBEDDING

    assert kinds.declared_kind(ModelEntry("m", "afmd:demo-embedding")) == EMBEDDING
    assert kinds.declared_kind(ModelEntry("m", "afmd:demo")) == CHAT
    assert kinds.declared_kind(ModelEntry("m", str(last))) == EMBEDDING
    assert kinds.declared_kind(ModelEntry("m", str(plain))) == CHAT

    # A Hugging Face repo is read from its downloaded snapshot, when there is one.
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    repo = hub / "models--org--emb"
    _sentence_transformers(repo / "snapshots", "abc123", {"pooling_mode_lasttoken": True}, True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert kinds.declared_kind(ModelEntry("m", "org/emb")) == EMBEDDING
    assert kinds.declared_kind(ModelEntry("m", "org/not-downloaded")) == CHAT
    assert kinds.declared_kind(ModelEntry("m", "org/not-downloaded", kind="embedding")) == (
        EMBEDDING)


def test_wrong_kind_is_refused_before_any_load(tmp_path: Path) -> None:
    folder = _sentence_transformers(tmp_path, "st", {"pooling_mode_lasttoken": True}, True)
    path = tmp_path / "config.toml"
    path.write_text(f'[[models.model]]\nid = "emb"\npath = "{folder}"\n')
    registry = ModelRegistry(load_config(path, env={}))

    async def ask(name: str, kind: str) -> InvalidRequestError:
        with pytest.raises(InvalidRequestError) as info:
            await registry.get(registry.resolve(name), kind)
        return info.value

    chat = asyncio.run(ask("emb", CHAT))
    assert (chat.code, chat.param) == ("invalid_model_kind", "model")
    assert "'emb' is an embedding model" in chat.message
    embed = asyncio.run(ask("demo", EMBEDDING))
    assert "'demo' is a chat model" in embed.message
    assert not registry.loads.is_loading("emb") and not registry.is_ready("emb")
    assert registry.default_for(EMBEDDING) == registry.resolve("emb")


# -- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Any:
    loaded, _ = mlx_lm.load(str(demo.materialize("demo-embedding")))
    return loaded


def hidden(model: Any, ids: list[int]) -> np.ndarray:
    return np.array(model.model(mx.array([ids]))[0].astype(mx.float32))


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def sequences(lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [list(map(int, rng.integers(0, 2000, n))) for n in lengths]


def test_concurrent_jobs_share_one_forward_pass(model: Any) -> None:
    embedder = Embedder(model, EmbeddingSpec(), name="t", gather_s=0.2)
    embedder.start()
    jobs_inputs = [sequences([3 + i, 11]) for i in range(6)]

    async def run() -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        jobs = [EmbeddingJob(inputs, loop.create_future()) for inputs in jobs_inputs]
        for job in jobs:
            embedder.submit(job)
        return list(await asyncio.gather(*(job.future for job in jobs)))

    try:
        results = asyncio.run(run())
    finally:
        embedder.stop()
    assert embedder.encoder.batches == 1
    for inputs, vectors in zip(jobs_inputs, results, strict=True):
        assert vectors.shape == (2, 64) and vectors.dtype == np.float32
        for ids, vector in zip(inputs, vectors, strict=True):
            np.testing.assert_allclose(vector, unit(hidden(model, ids)[-1]),
                                       atol=tolerance(2e-5))


def test_a_cancelled_job_is_skipped(model: Any) -> None:
    embedder = Embedder(model, EmbeddingSpec(), name="t", gather_s=0.2)
    embedder.start()

    async def run() -> tuple[bool, np.ndarray]:
        loop = asyncio.get_running_loop()
        gone = EmbeddingJob(sequences([5]), loop.create_future())
        kept = EmbeddingJob(sequences([6]), loop.create_future())
        embedder.submit(gone)
        gone.cancel()
        embedder.submit(kept)
        vectors = await kept.future
        await asyncio.sleep(0.05)
        return gone.future.done(), vectors

    try:
        gone_done, vectors = asyncio.run(run())
    finally:
        embedder.stop()
    assert not gone_done and vectors.shape == (1, 64)


def test_a_job_cancelled_while_encoding_stops_at_the_next_forward_pass(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large job whose request ended (deadline, client gone, cancel) is not encoded to
    its end: it held the thread, and the requests queued behind it, for minutes."""
    monkeypatch.setattr(embedding, "MAX_ROWS", 2)
    encoder = Embedder(model, EmbeddingSpec(), name="t").encoder
    loop = asyncio.new_event_loop()
    try:
        big = EmbeddingJob(sequences([9] * 20), loop.create_future())
        small = EmbeddingJob(sequences([3]), loop.create_future())
        forward = encoder._forward

        def first_then_cancel(rows: Any) -> np.ndarray:
            big.cancel()  # the request ends while its first rows are encoded
            return forward(rows)

        monkeypatch.setattr(encoder, "_forward", first_then_cancel)
        big_vectors, small_vectors = encoder.encode_jobs([big, small])
    finally:
        loop.close()
    assert encoder.batches == 2  # its first pass, then the small job's alone
    assert big_vectors.shape == (20, 64) and small_vectors.shape == (1, 64)
    np.testing.assert_allclose(small_vectors[0], unit(hidden(model, small.inputs[0])[-1]),
                               atol=tolerance(2e-5))
    gone = EmbeddingJob(sequences([4, 5]), asyncio.Future(loop=loop))
    gone.cancel()
    assert encoder.encode_jobs([gone])[0].shape == (2, 0)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooling_and_padding_match_each_sequence_alone(model: Any, pooling: str) -> None:
    embedder = Embedder(model, EmbeddingSpec(pooling, normalize=False), name="t")
    seqs = sequences([1, 4, 9, 30])
    got = embedder.encoder.encode(seqs)  # one right-padded batch
    for ids, vector in zip(seqs, got, strict=True):
        states = hidden(model, ids)
        expected = {"last": states[-1], "mean": states.mean(axis=0), "cls": states[0]}[pooling]
        np.testing.assert_allclose(vector, expected, rtol=tolerance(1e-4),
                                   atol=tolerance(1e-4))


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_long_inputs_stepped_through_a_cache_match_one_pass(
    model: Any, pooling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs = sequences([37, 20, 3])
    embedder = Embedder(model, EmbeddingSpec(pooling), name="t")
    whole = embedder.encoder.encode(seqs)
    monkeypatch.setattr(embedding, "STEP_TOKENS", 8)
    stepped = embedder.encoder.encode(seqs)
    np.testing.assert_allclose(stepped, whole, atol=tolerance(1e-4))


def test_groups_bound_rows_and_padded_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedding, "MAX_ROWS", 4)
    monkeypatch.setattr(embedding, "MAX_BATCH_TOKENS", 100)
    lengths = [5, 50, 7, 30, 6, 5, 8, 9, 10, 60]
    batches = groups(lengths)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) <= 4
        assert max(lengths[i] for i in batch) * len(batch) <= 100 or len(batch) == 1
    assert [lengths[i] for i in batches[0]] == [60]  # longest first, alone past the budget


def test_truncate_renormalizes_a_prefix() -> None:
    vectors = np.array([[3.0, 4.0, 12.0]], dtype=np.float32)
    np.testing.assert_allclose(truncate(vectors, 2, True), [[0.6, 0.8]])
    np.testing.assert_allclose(truncate(vectors, 2, False), [[3.0, 4.0]])
    assert truncate(vectors, None, True) is vectors
