"""Unloads under way: a model out of the loaded set is freed off the event loop.

Freeing blocks (stopping the model's thread, dropping its arrays), so it runs in a thread;
until it is done the model's memory still counts against the budget, or a load making room
would take more than there is.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from afmd.engine.budget import format_bytes

if TYPE_CHECKING:
    from afmd.engine.loaded import LoadedModel

log = logging.getLogger("afmd.engine")


def free_model(model: LoadedModel) -> None:
    """Stop the model's thread and drop its arrays, so that MLX frees them now (blocking).

    The handle itself may outlive this (a finished request's objects, a log line): its
    references to the weights, the batch and the prefix cache are cut so they cannot pin
    them.
    """
    import mlx.core as mx

    if model.worker is not None:
        model.worker.stop()
    if model.embedder is not None:
        model.embedder.stop()
    model.worker = None
    model.embedder = None
    model.vision = None  # a vision model's image side
    model.model = None
    gc.collect()  # the model's modules hold cycles (parents and children)
    mx.clear_cache()  # and MLX's pool of freed buffers gives them back


class Unloads:
    """The models being freed, and the bytes they still hold."""

    def __init__(
        self,
        free: Callable[[LoadedModel], None],
        on_unload: Callable[[str], None],
        freed: Callable[[], None],
    ) -> None:
        self.free = free  # blocking: run off the event loop
        self._on_unload = on_unload
        self._freed = freed  # loads waiting for room look again
        self._held: dict[int, int] = {}  # per model object: bytes still held
        self._tasks: set[asyncio.Task[None]] = set()

    def count(self) -> int:
        return len(self._held)

    def held_bytes(self) -> int:
        return sum(self._held.values())

    def start(self, model: LoadedModel, reason: str) -> asyncio.Task[None]:
        held = model.memory_bytes
        self._held[id(model)] = held
        task = asyncio.get_running_loop().create_task(self._free_later(model, held, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _free_later(self, model: LoadedModel, held: int, reason: str) -> None:
        try:
            # Callbacks already scheduled (a finished request's last events) may still hold
            # the model: let them run before its arrays are dropped.
            await asyncio.sleep(0)
            await asyncio.to_thread(self.free, model)
        except Exception:
            log.exception("unloading %s failed", model.id)
        finally:
            self._held.pop(id(model), None)
            self._on_unload(model.id)
            log.info("model unloaded: %s (%s; %s freed)", model.id, reason,
                     format_bytes(held))
            self._freed()

    async def drain(self) -> None:
        """Wait for the unloads under way (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


__all__ = ["Unloads", "free_model"]
