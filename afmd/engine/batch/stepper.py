"""The model side of a generation thread: mlx-lm's ``BatchGenerator`` and the prefix cache.

Split from :class:`afmd.engine.batch.generation_thread.BatchWorker` because two owners drive it: the
worker (one process, or rank 0 of a distributed group, which also turns tokens into
events) and a follower rank (:mod:`afmd.engine.sharded.follower`), which must do exactly the
same model work in the same order and nothing else. Everything that runs the model or
decides what the model runs on (which cached prefix a prompt resumes from) lives here, so
both owners take the same path by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import (
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from afmd.engine.batch.decode import DecodeBatch
from afmd.engine.kvcache import kv_compat
from afmd.engine.kvcache.blocks import NOTHING, BlockCache, Resume
from afmd.engine.kvcache.disk import DiskStore, DiskTier
from afmd.engine.kvcache.identity import model_identity
from afmd.engine.kvcache.ram import RamTier
from afmd.engine.mlx_compat import stop_sequences
from afmd.engine.sharded.lockstep import Lockstep, ShardedDecodeBatch


class Stepper:
    """Owns a model's ``BatchGenerator`` (rebuilt after a failure) and its prefix cache:
    the block cache (:mod:`afmd.engine.kvcache`) where the model's cache cuts into blocks,
    else mlx-lm's whole-sequence ``LRUPromptCache``.

    Used from one thread only: the generation thread of the worker or the follower.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str,
        max_batch: int = 8,
        prefill_step_size: int = 2048,
        prompt_cache_bytes: int = 1 << 30,
        prompt_cache_entries: int = 16,
        lockstep: Lockstep | None = None,
        identity: bytes | None = None,
        block_tokens: int = 256,
        disk_dir: Path | None = None,
        disk_bytes: int = 0,
        disk_min_free: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos = sorted(tokenizer.eos_token_ids)
        self.lockstep = lockstep
        self._max_batch = max(1, max_batch)
        self._prefill_step_size = prefill_step_size
        self._generator: BatchGenerator | None = None
        self.batch: DecodeBatch | None = None  # the generator's running batch
        # KV states of finished requests, reused for shared prefixes.
        self.prompt_cache: LRUPromptCache | None = None
        self.blocks: BlockCache | None = None
        if prompt_cache_bytes > 0 and prompt_cache_entries > 0:
            if kv_compat.cuts_into_blocks(model):
                identity = identity or model_identity(None, name)
                disk = None
                if disk_dir is not None and disk_bytes > 0:
                    store = DiskStore.at(disk_dir, disk_bytes, disk_min_free)
                    disk = DiskTier(store, identity, name, lambda: kv_compat.layer_shapes(model))
                self.blocks = BlockCache(
                    identity, block_tokens, RamTier(prompt_cache_bytes, prompt_cache_entries),
                    disk,
                )
            else:
                self.prompt_cache = LRUPromptCache(
                    max_size=prompt_cache_entries, max_bytes=prompt_cache_bytes
                )
        self._cache_key = name

    # -- read from the event loop (plain counters or a list read once) --
    @property
    def cache_bytes(self) -> int:
        """The prefix cache's bytes in memory (its disk tier's are on disk)."""
        if self.blocks is not None:
            return self.blocks.ram.nbytes
        return self.prompt_cache.nbytes if self.prompt_cache is not None else 0

    @property
    def live_cache_bytes(self) -> int:
        batch = self.batch
        try:
            return sum(c.nbytes for c in batch.prompt_cache) if batch is not None else 0
        except Exception:  # a list resized under the read: 0 now, right next time
            return 0

    # -- the generation thread --
    def reset(self) -> BatchGenerator:
        """A fresh generator (at start, and after a failed step left the old one unusable)."""
        self.close()
        generator = BatchGenerator(
            self.model,
            max_tokens=256,
            stop_tokens=[[t] for t in self.eos],
            completion_batch_size=self._max_batch,
            prefill_batch_size=self._max_batch,
            prefill_step_size=self._prefill_step_size,
        )
        if self.lockstep is not None:
            self.batch = ShardedDecodeBatch.install(generator, self.lockstep)
        else:
            self.batch = DecodeBatch.install(generator)
        self._generator = generator
        return generator

    def close(self) -> None:
        if self._generator is not None:
            try:
                self._generator.close()
            finally:
                self._generator = None

    def cached_prefix(self, prompt: list[int]) -> tuple[Any, list[int]]:
        """The longest cached KV state for a prefix of ``prompt``, and the tokens left."""
        resume = self.resume(prompt)
        return resume.cache, prompt[resume.tokens:]

    def resume(self, prompt: list[int]) -> Resume:
        """Where ``prompt`` resumes from: the longest cached prefix, and its tiers."""
        if self.blocks is not None:
            return self.blocks.lookup(prompt)
        if self.prompt_cache is None:
            return NOTHING
        cache, rest = self.prompt_cache.fetch_nearest_cache(self._cache_key, prompt)
        if cache is None:
            return NOTHING
        if not rest:
            # An exact hit still needs one token to compute the next logits from.
            if not can_trim_prompt_cache(cache):
                return NOTHING
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        cached = len(prompt) - len(rest)
        return Resume(cache, cached, ram_tokens=cached)

    def remember(self, tokens: list[int] | None, cache: Any) -> None:
        if self.blocks is not None and tokens and cache is not None:
            self.blocks.store(list(tokens), cache)
        elif self.prompt_cache is not None and tokens and cache is not None:
            # mlx-lm hands a finished row's KV state out as a lazy slice of the whole
            # batch's buffers: unevaluated, each entry kept every row's keys and values
            # alive while the cache counted only its own bytes, so prompt_cache_bytes
            # bounded a fraction of what it held. Evaluating copies the row out now.
            mx.eval([c.state for c in cache])
            self.prompt_cache.insert_cache(self._cache_key, list(tokens), cache)

    def warm(self, prompt: list[int], rest: list[int], cache: Any) -> None:
        """Run the prompt's ``rest`` after its ``cache``d prefix and keep the whole prompt
        in the prefix cache, generating nothing: a request with no tokens to write asks
        for this (Anthropic's ``max_tokens: 0``), so a later request that shares the
        prompt starts from it. All at once: a sharded model's other ranks do it so,
        in step with rank 0 (rank 0 alone runs it a chunk at a time, :meth:`prefill`)."""
        if not rest or not self.keeps_prompts:
            return
        if cache is None:
            cache = make_prompt_cache(self.model)
        for start in range(0, len(rest), self._prefill_step_size):
            self.prefill(rest[start : start + self._prefill_step_size], cache)
        self.remember(prompt, cache)

    @property
    def keeps_prompts(self) -> bool:
        """Whether a prompt run into a cache has anywhere to be kept (a warm-up without
        one would be work for nothing)."""
        return self.prompt_cache is not None or self.blocks is not None

    @property
    def prefill_step_size(self) -> int:
        return self._prefill_step_size

    def prefill(self, tokens: list[int], cache: Any) -> None:
        """Run ``tokens`` into ``cache`` (made by :func:`make_prompt_cache`)."""
        self.model(mx.array([tokens]), cache=cache)
        mx.eval([c.state for c in cache])

    def new_cache(self) -> Any:
        return make_prompt_cache(self.model)

    def insert(
        self,
        prompt: list[int],
        rest: list[int],
        cache: Any,
        *,
        max_tokens: int,
        sampler: Callable[[mx.array], mx.array] | None,
        processors: list[Any],
        stop_ids: Iterable[int] = (),
    ) -> int:
        """Queue one row (its prompt ``rest`` after the ``cache``d prefix); its uid.

        ``stop_ids`` are the request's own ending tokens besides the model's; with none,
        the generator's end-of-sequence stops apply.
        """
        assert self._generator is not None
        stops = sorted(set(self.eos).union(stop_ids)) if stop_ids else None
        if self.lockstep is not None:
            sampler = self.lockstep.row_sampler(sampler)
        (uid,) = self._generator.insert(
            [rest],
            max_tokens=[max_tokens],
            caches=[cache],
            all_tokens=[prompt[: len(prompt) - len(rest)]],
            samplers=[sampler],  # type: ignore[list-item]  # mlx-lm takes None (its own sampler) though List[Sampler] says not
            logits_processors=[processors],
            stop_sequences=[stop_sequences([t] for t in stops)] if stops else None,
        )
        return int(uid)

    def forget(self, uid: int) -> None:
        """A row left: drop what the decode step kept for it (log-probabilities wanted,
        its speculation)."""
        if self.batch is not None:
            self.batch.logprob_rows.pop(uid, None)
            self.batch.spec_rows.pop(uid, None)

    def remove(self, uids: list[int]) -> None:
        assert self._generator is not None
        if uids:
            self._generator.remove(uids)

    def next(self) -> list[Any]:
        """One step of every running row: mlx-lm's responses."""
        assert self._generator is not None
        _, responses = self._generator.next()
        return responses
