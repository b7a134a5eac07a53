"""One built-in model loaded in the test process, and a registry that leases it to every
request: for tests that drive :class:`~afmd.service.pipeline.ChatPipeline` itself (what a
run emits, what preparing a request opens) without a server, a load or the residency
rules between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from afmd.config.load import load_config
from afmd.config.tables import ModelEntry
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.model_registry import ModelRegistry
from afmd.engine.models.residency import Lease


class SharedRegistry(ModelRegistry):
    """Every lease is ``model``'s, whatever the request names."""

    def __init__(self, model: LoadedModel) -> None:
        super().__init__(load_config(None, env={}))
        self._model = model

    async def lease(self, entry: ModelEntry, *args: Any, **kwargs: Any) -> Lease:
        return Lease.detached(self._model)


def loaded(model_id: str) -> Iterator[LoadedModel]:
    """``model_id`` (a built-in) loaded for as long as the generator lives: a fixture's
    body."""
    registry = ModelRegistry(load_config(None, env={}))
    entry = registry.resolve(model_id)

    async def load() -> LoadedModel:
        return await registry.begin_load(entry)

    yield asyncio.run(load())
    registry.close()
