"""Which configured model a request names, and which kind of model it is.

A request for a model of the wrong kind is refused before a load that may take minutes, so
a model not loaded yet has its kind read from its folder (once: reading it costs disk
I/O); once loaded the model's own word wins, since a download may tell more than the folder
did, and after an unload the folder is read again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from afmd import hubcache
from afmd.config import Config, ModelEntry
from afmd.engine import kinds
from afmd.engine.kinds import EMBEDDING
from afmd.errors import InvalidRequestError, NotFoundError

if TYPE_CHECKING:
    from afmd.engine.loaded import LoadedModel


class ModelCatalog:
    """The configured models by name and kind, for the registry to refuse early."""

    def __init__(self, config: Config, loaded: Mapping[str, LoadedModel]) -> None:
        self._config = config
        self._loaded = loaded  # the residency's own dict: always current
        self._kinds: dict[str, str] = {}  # read from disk once per model until it loads
        self._repos: dict[str, ModelEntry] = {}  # downloaded models named by repo id

    def resolve(self, name: str | None) -> ModelEntry:
        entry = self._config.resolve_model(name)
        if entry is None and name is not None:
            # Ollama's clients name a model's default tag (``demo:latest``); a model pulled
            # into the Hugging Face cache serves under its repo id without configuring it.
            base = name.removesuffix(":latest")
            entry = self._config.resolve_model(base) if base != name else None
            entry = entry or self._downloaded(base)
        if entry is None:
            raise NotFoundError(
                f"The model '{name}' does not exist. Available models: "
                + ", ".join(self.listed_ids())
                + ".",
                code="model_not_found",
                param="model",
            )
        return entry

    def _downloaded(self, repo: str) -> ModelEntry | None:
        """The entry a complete download of ``repo`` serves under (one per repo, so that
        its loads and leases are one model's)."""
        entry = self._repos.get(repo)
        if entry is None and hubcache.REPO_ID.match(repo) and hubcache.complete_snapshot(repo):
            entry = self._repos[repo] = ModelEntry(id=repo, path=repo)
        return entry

    def listed_ids(self) -> list[str]:
        return [*self._config.model_ids(), *self._config.models.aliases]

    def kind_of(self, entry: ModelEntry) -> str:
        """``chat`` or ``embedding``: the loaded model's, else what its folder says."""
        loaded = self._loaded.get(entry.id)
        if loaded is not None:
            return loaded.kind
        kind = self._kinds.get(entry.id)
        if kind is None:
            kind = self._kinds[entry.id] = kinds.declared_kind(entry)
        return kind

    def forget_kind(self, model_id: str) -> None:
        """A load has told the model's kind; after an unload its folder is read again."""
        self._kinds.pop(model_id, None)

    def default_for(self, kind: str) -> ModelEntry | None:
        """The model a request of ``kind`` that names none gets: the default model when it
        is of that kind, else the first configured one that is."""
        default = self._config.resolve_model(None)
        if default is not None and self.kind_of(default) == kind:
            return default
        return next((e for e in self._config.models.model if self.kind_of(e) == kind), None)

    def check_kind(self, entry: ModelEntry, kind: str, actual: str | None = None) -> None:
        """400 ``invalid_model_kind`` unless ``entry`` serves ``kind``."""
        actual = actual or self.kind_of(entry)
        if actual == kind:
            return
        serves = "/v1/embeddings" if actual == EMBEDDING else "chat and completions"
        wanted = "embeddings" if kind == EMBEDDING else "chat or completions"
        raise InvalidRequestError(
            f"The model '{entry.id}' is {_article(actual)} {actual} model: it serves "
            f"{serves}, not {wanted}. Use {_article(kind)} {kind} model.",
            code="invalid_model_kind",
            param="model",
        )


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


__all__ = ["ModelCatalog"]
