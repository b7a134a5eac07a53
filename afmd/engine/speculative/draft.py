"""A model's draft model (``[[models.model]] draft``), loaded with it and checked.

A draft proposes token ids for the model to verify, so it must number tokens exactly as
the model does: a tokenizer that differs anywhere would make every proposal wrong (or,
worse, right by accident on some and wrong on others). The check is at load, where the
operator sees it (the load fails, ``/health`` names the reason), not on a request.
"""

from __future__ import annotations

from typing import Any

from afmd.config.sections import Config
from afmd.config.tables import ModelEntry
from afmd.engine.first_import import transformers_ready
from afmd.engine.models.kinds import BUILTIN_PREFIX, load_source


class DraftMismatch(ValueError):
    """The draft's tokenizer is not the model's."""


def load_draft(entry: ModelEntry, config: Config, tokenizer: Any) -> Any:
    """The draft model of ``entry`` (None when it has none), ready to run on this device."""
    if entry.draft is None:
        return None
    transformers_ready()
    from mlx_lm import load as mlx_load

    from afmd.engine.batch.cpu_layout import relayout_for_cpu
    from afmd.engine.demo import builtin as demo

    draft = config.resolve_model(entry.draft)
    if draft is None:  # config validation names unknown ids; an alias is resolved here
        raise DraftMismatch(f"the draft model '{entry.draft}' is not configured")
    if draft.path.startswith(BUILTIN_PREFIX):
        source = str(demo.materialize(draft.path[len(BUILTIN_PREFIX):]))
    else:
        source = load_source(draft.path)
    model, draft_tokenizer = mlx_load(source)  # type: ignore[misc]  # mlx-lm types load() 2- or 3-tuple whatever return_config says
    problem = tokenizer_difference(tokenizer, draft_tokenizer)
    if problem is not None:
        raise DraftMismatch(
            f"the draft model '{draft.id}' does not share the tokenizer of '{entry.id}' "
            f"({problem}); a draft proposes token ids, so it must number tokens exactly "
            "as the model does: pick a draft of the same model family"
        )
    relayout_for_cpu(model)
    return model


def tokenizer_difference(model_tokenizer: Any, draft_tokenizer: Any) -> str | None:
    """What differs between two tokenizers' vocabularies (None: nothing)."""
    mine, theirs = model_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if len(mine) != len(theirs):
        return f"{len(theirs)} tokens against {len(mine)}"
    for token, index in mine.items():
        other = theirs.get(token)
        if other != index:
            where = "absent" if other is None else f"id {other}"
            return f"token {token!r} is id {index} in the model's, {where} in the draft's"
    return None
