"""A prompt that continues an earlier generation: its token ids, then the new rendering.

Ollama's ``/api/generate`` hands a client the ids of the prompt it ran and the answer it
wrote (``context``), and takes them back to carry a conversation on without messages.
Ollama joins them as text (the ids decoded, the new prompt appended, the whole encoded
again); afmd joins ids, which is exact: the earlier run's tokens are the new prompt's
first ones, so the model reads what it read and wrote then, and the prefix cache resumes
them instead of computing them again.
"""

from __future__ import annotations

from collections.abc import Sequence

from afmd.core.request import PROMPT_PREFIX_PARAM
from afmd.engine.models.loaded_model import LoadedModel
from afmd.errors import InvalidRequestError

__all__ = ["check_prompt_prefix", "continued"]


def continued(prefix: Sequence[int], rendered: list[int], bos: int | None) -> list[int]:
    """``prefix`` followed by ``rendered``, less the rendering's leading ``bos`` where a
    prefix comes before it: the template starts every rendering as a new sequence, and
    the prefix (an earlier rendering and its answer) began the sequence already. A
    beginning-of-sequence token in the middle is what Ollama's text join makes of such a
    template; a model is trained with one at the start only, and a conversation
    rendered whole has one."""
    if not prefix:
        return rendered
    if bos is not None and rendered and rendered[0] == bos:
        rendered = rendered[1:]
    return [*prefix, *rendered]


def check_prompt_prefix(prefix: Sequence[int], model: LoadedModel, model_id: str) -> None:
    """A prefix the model can run: ids of its vocabulary, and a model that is prompted
    with ids alone. A vision model's prompt carries its pictures beside the ids, which an
    earlier turn's ids no longer have (its image tokens would stand for nothing), and
    Apple's model reads conversations, not ids: both are refused rather than answering
    without the earlier turn."""
    if not prefix:
        return
    if model.reads_conversation or model.vision is not None:
        kind = "reads conversations, not token ids" if model.reads_conversation else (
            "is a vision model, whose prompts carry their images beside the token ids")
        raise InvalidRequestError(
            f"The model '{model_id}' {kind}: it cannot continue an earlier answer's token "
            "ids. Send the conversation as messages (/api/chat) instead.",
            code="invalid_value", param=PROMPT_PREFIX_PARAM)
    vocab = model.vocab_size
    for i, token in enumerate(prefix):
        if not 0 <= token < vocab:
            raise InvalidRequestError(
                f"Invalid token id {token}: the model '{model_id}' has ids 0-{vocab - 1}.",
                code="invalid_value", param=f"{PROMPT_PREFIX_PARAM}[{i}]")
