"""The embedding thread: one per loaded embedding model, encoding concurrent requests together.

A forward pass over many sequences costs far less than one pass per request, so the
thread takes every job that arrived while it was busy (and, when idle, those arriving
within a short gathering window) and encodes their sequences in as few passes as
possible: sorted by length, cut into groups bounded in rows and in padded tokens, each
group one right-padded batch. Right padding changes nothing a decoder computes for the
real tokens (causal attention never looks ahead), and pooling reads real positions only,
so a sequence's vector does not depend on what it was batched with beyond float
rounding. Sequences longer than one step run through a KV cache step by step, bounding
attention memory the way prefill does.

The model's transformer trunk (``model.model``) gives the final hidden states; the output
projection to the vocabulary is never run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from afmd.engine.generation import EmbeddingJob
from afmd.engine.models.kinds import EmbeddingSpec
from afmd.engine.worker_threads import WorkerThread
from afmd.errors import APIError, ServerError

log = logging.getLogger("afmd.engine")

_STOP = object()
#: A batch holds at most this many sequences and this many tokens, padding included.
MAX_ROWS = 64
MAX_BATCH_TOKENS = 16384
#: Longer sequences are encoded this many tokens at a time through a KV cache.
STEP_TOKENS = 2048
#: When idle, how long the thread waits after a first job for others to join its batch.
GATHER_S = 0.002


def pool(hidden: mx.array, lengths: mx.array, pooling: str) -> mx.array:
    """One vector per row of ``hidden`` (batch, tokens, width) from its real positions."""
    if pooling == "last":
        return hidden[mx.arange(hidden.shape[0]), lengths - 1]
    if pooling == "cls":
        return hidden[:, 0]
    mask = (mx.arange(hidden.shape[1])[None, :] < lengths[:, None]).astype(hidden.dtype)
    total = (hidden * mask[..., None]).astype(mx.float32).sum(axis=1)
    return total / lengths[:, None].astype(mx.float32)


def normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return (vectors / np.maximum(norms, np.float32(1e-12))).astype(np.float32)


def truncate(vectors: np.ndarray, dimensions: int | None, renormalize: bool) -> np.ndarray:
    """The first ``dimensions`` of each vector (a Matryoshka prefix), unit length again."""
    if dimensions is None or dimensions >= vectors.shape[-1]:
        return vectors
    head = np.ascontiguousarray(vectors[:, :dimensions])
    return normalize(head) if renormalize else head


def groups(lengths: Sequence[int]) -> list[list[int]]:
    """Indexes of ``lengths`` in batches: similar lengths together, rows and tokens bounded."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    out: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        width_if = max(width, min(lengths[i], STEP_TOKENS))
        if current and (
            len(current) >= MAX_ROWS or width_if * (len(current) + 1) > MAX_BATCH_TOKENS
        ):
            out.append(current)
            current, width = [], 0
            width_if = min(lengths[i], STEP_TOKENS)
        current.append(i)
        width = width_if
    if current:
        out.append(current)
    return out


class Encoder:
    """An embedding model's forward passes, kept apart from the thread so that they can be
    run and measured directly (tests, the bench)."""

    def __init__(self, model: Any, spec: EmbeddingSpec) -> None:
        self._model = model
        self._trunk = model.model  # hidden states, without the projection to the vocabulary
        self.spec = spec
        self.batches = 0  # forward passes run

    def encode_jobs(self, jobs: Sequence[EmbeddingJob]) -> list[np.ndarray]:
        """Every job's vectors, from as few forward passes as their sequences allow.

        A job cancelled meanwhile (its deadline passed, its client left, a cancel by its
        id) is encoded no further from the next forward pass on, and its rows stay zero:
        its result is dropped, and a large one went on for minutes after its request was
        answered, holding this thread and every embeddings request of the model queued
        behind it."""
        sequences = [seq for job in jobs for seq in job.inputs]
        owners = [job for job in jobs for _ in job.inputs]
        vectors = self.encode(sequences, skip=lambda i: owners[i].cancelled)
        out: list[np.ndarray] = []
        start = 0
        for job in jobs:
            rows = vectors[start: start + len(job.inputs)]
            start += len(job.inputs)
            out.append(truncate(rows, job.dimensions, self.spec.normalize))
        return out

    def encode(
        self, sequences: Sequence[Sequence[int]], skip: Callable[[int], bool] | None = None
    ) -> np.ndarray:
        """One pooled (and, as the model says, normalized) float32 vector per sequence.

        ``skip(i)``, asked before each forward pass, leaves sequence ``i`` out of it and its
        row zero; with every sequence skipped the rows have no columns."""
        lengths = [len(s) for s in sequences]
        vectors: np.ndarray | None = None
        for group in groups(lengths):
            if skip is not None:
                group = [i for i in group if not skip(i)]
                if not group:
                    continue
            pooled = self._forward([sequences[i] for i in group])
            if vectors is None:
                vectors = np.zeros((len(sequences), pooled.shape[-1]), dtype=np.float32)
            vectors[group] = pooled
        if vectors is None:
            assert sequences and skip is not None, "no sequences"
            return np.zeros((len(sequences), 0), dtype=np.float32)
        return normalize(vectors) if self.spec.normalize else vectors

    def _forward(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        self.batches += 1
        lengths = np.array([len(r) for r in rows], dtype=np.int32)
        width = int(lengths.max())
        ids = np.zeros((len(rows), width), dtype=np.int32)  # padding: after every real token
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        if width <= STEP_TOKENS:
            hidden = self._trunk(mx.array(ids))
            pooled = pool(hidden, mx.array(lengths), self.spec.pooling).astype(mx.float32)
            mx.eval(pooled)
            return np.array(pooled)
        return self._forward_in_steps(ids, lengths)

    def _forward_in_steps(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Long rows: one step of tokens at a time, earlier steps kept as a KV cache."""
        cache = make_prompt_cache(self._model)
        pooling = self.spec.pooling
        rows, width = ids.shape
        out = np.zeros((rows, 0), dtype=np.float32)
        total: mx.array | None = None
        for start in range(0, width, STEP_TOKENS):
            chunk = ids[:, start: start + STEP_TOKENS]
            hidden = self._trunk(mx.array(chunk), cache=cache)
            span = chunk.shape[1]
            if pooling == "mean":
                local = np.clip(lengths - start, 0, span)
                part = pool(hidden, mx.array(np.maximum(local, 1)), "mean")
                part = part * mx.array(local.astype(np.float32))[:, None]
                total = part if total is None else total + part
                mx.eval(total, [c.state for c in cache])
                continue
            if start == 0:
                out = np.zeros((rows, hidden.shape[-1]), dtype=np.float32)
            if pooling == "cls" and start == 0:
                out[:] = np.array(hidden[:, 0].astype(mx.float32))
            if pooling == "last":
                ends = lengths - 1 - start
                here = np.nonzero((ends >= 0) & (ends < span))[0]
                if len(here):
                    picked = hidden[mx.array(here), mx.array(ends[here])].astype(mx.float32)
                    out[here] = np.array(picked)
            mx.eval([c.state for c in cache])
        if pooling == "mean":
            assert total is not None
            return np.array(total / mx.array(lengths.astype(np.float32))[:, None])
        return out


class Embedder:
    """Owns an embedding model's forward passes and the thread that runs them."""

    def __init__(
        self, model: Any, spec: EmbeddingSpec, *, name: str, gather_s: float = GATHER_S
    ) -> None:
        #: The forward passes (its ``spec``, and the ``batches`` run so far).
        self.encoder = Encoder(model, spec)
        self._gather_s = gather_s
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = WorkerThread(self._run, f"afmd-embed-{name}")
        self._started = False

    # -- event-loop side --
    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, job: EmbeddingJob) -> None:
        self._inbox.put(job)

    def stop(self, timeout: float = 5.0) -> None:
        if self._started:
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    # -- thread side --
    def _run(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                break
            live = [job for job in jobs if not job.cancelled]
            if not live:
                continue
            try:
                results = self.encoder.encode_jobs(live)
            except Exception:  # a model failure must not kill the thread
                log.exception("embedding batch failed")
                error = ServerError("The model failed while embedding.", code="generation_failed")
                for job in live:
                    _post(job, error)
                continue
            for job, vectors in zip(live, results, strict=True):
                _post(job, vectors)
        self._fail_inbox()

    def _take(self) -> list[EmbeddingJob] | None:
        first = self._inbox.get()
        if first is _STOP:
            return None
        jobs: list[EmbeddingJob] = [first]
        deadline = time.perf_counter() + self._gather_s
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return jobs
                try:
                    item = self._inbox.get(timeout=remaining)
                except queue.Empty:
                    return jobs
            if item is _STOP:
                self._inbox.put(_STOP)  # stop after this batch
                return jobs
            jobs.append(item)

    def _fail_inbox(self) -> None:
        error = ServerError("The server is shutting down.", code="shutting_down")
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, EmbeddingJob):
                _post(item, error)


def _post(job: EmbeddingJob, result: np.ndarray | APIError) -> None:
    with contextlib.suppress(RuntimeError):  # that loop closed (shutdown, tests)
        job.loop.call_soon_threadsafe(_settle, job.future, result)


def _settle(future: asyncio.Future[np.ndarray], result: np.ndarray | APIError) -> None:
    if future.done():
        return  # the request gave up (deadline, disconnect, cancel)
    if isinstance(result, APIError):
        future.set_exception(result)
    else:
        future.set_result(result)
