"""A Completions request made ready to run: its prompts as token ids, no chat template.

Each prompt is tokenized as given, after the model's BOS where its tokenizer adds one
(token-id prompts are used as they are); with a ``suffix`` it becomes the model family's
fill-in-the-middle prompt (:mod:`afmd.service.fim`), and the family's end markers end it unseen.
Every prompt must fit the context with ``max_tokens`` and every token id must exist,
checked before anything is queued, each refusal naming its prompt. A text far past the
window is refused without being encoded whole (:mod:`afmd.engine.models.prompt_bound`),
and the tokenizing is given up at the request's deadline, as a chat round's is.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from afmd.config.tables import ModelEntry
from afmd.core.request import CONTEXT_WINDOW_PARAM, CompletionRequest, context_limit
from afmd.engine.batch.penalties import check_logit_bias
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.prompt_bound import PromptTooLong
from afmd.errors import ContextLengthError, InvalidRequestError, request_timeout_error
from afmd.service import fim
from afmd.service.output_plan import OutputPlan


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """One choice's prompt: the ids the model sees and what ``echo`` shows of them."""

    ids: list[int]
    echo: str | None  # the prompt's text when echoed (None: not echoed)
    lead: int = 0  # ids afmd put before the client's text (the BOS): echoed as nothing
    max_tokens: int = 16  # the request's, or what the context leaves when that is a cap
    choice: int = 0  # which of the prompt's ``n`` completions (its seed's offset)


@dataclass(slots=True)
class PreparedCompletion:
    """A Completions request ready to queue: one slot, one generation per prompt."""

    request_id: str
    request: CompletionRequest
    model: LoadedModel
    prompts: list[CompletionPrompt]
    stop_ids: tuple[int, ...]  # fill-in-the-middle end tokens
    stops: tuple[str, ...]  # the client's stop sequences (and multi-token FIM ends)
    model_name: str
    fingerprint: str
    deadline: float  # time.monotonic()
    received_at: float  # time.perf_counter()
    profile: str | None = None
    load_seconds: float = 0.0  # as PreparedChat's
    # What the response headers read of a chat turn's plan: nothing is ever downgraded.
    plan: OutputPlan = field(default_factory=OutputPlan)
    trimmed: int = 0

    @property
    def prompt(self) -> list[int]:
        return self.prompts[0].ids

    @property
    def prompt_tokens(self) -> int:
        """Each prompt once, however many completions it has (as OpenAI counts ``n``)."""
        return sum(len(p.ids) for p in self.prompts if p.choice == 0)


async def prepare_completion(
    model: LoadedModel,
    entry: ModelEntry,
    request: CompletionRequest,
    request_id: str,
    *,
    fingerprint: str,
    deadline: float,
    received_at: float | None,
    profile: str | None,
) -> PreparedCompletion:
    check_logit_bias(request.logit_bias, model.vocab_size, entry.id)
    stop_ids: tuple[int, ...] = ()
    stops = request.stop
    plan = None
    if request.suffix is not None:
        plan = fim.plan_for(model.tokenizer, entry.fim)
        # An empty suffix (an editor completing at the end of a file, a client that always
        # sends the field) asks nothing a plain completion does not: a model without a
        # fill-in-the-middle format answers it as one, where the 400 failed every such
        # request.
        if plan is None and request.suffix != "":
            raise InvalidRequestError(
                f"The model '{entry.id}' has no fill-in-the-middle format: its tokenizer "
                "has no FIM marker tokens and its configuration names none (the model's "
                "'fim' setting). Send the prompt without 'suffix', or use a code model.",
                code="fim_not_supported",
                param="suffix",
            )
        if plan is not None:
            stop_ids = plan.end_ids
            stops = tuple(dict.fromkeys((*request.stop, *plan.end_texts)))
    prompts = await _tokenized(model, request, plan, deadline)
    return PreparedCompletion(
        request_id=request_id,
        request=request,
        model=model,
        prompts=prompts,
        stop_ids=stop_ids,
        stops=stops,
        model_name=request.model or entry.id,
        fingerprint=fingerprint,
        deadline=deadline,
        received_at=received_at if received_at is not None else time.perf_counter(),
        profile=profile,
    )


async def _tokenized(model: LoadedModel, request: CompletionRequest,
                     plan: fim.FimPlan | None, deadline: float) -> list[CompletionPrompt]:
    """:func:`_prompts` off the event loop, given up at the deadline with the request's
    504: a body of many prompts, each just within the window, is seconds of a tokenizer,
    and was answered long past the deadline. The thread's prompt in progress ends by
    itself, and the thread looks at the deadline before each prompt."""
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
            return await asyncio.to_thread(_prompts, model, request, plan, deadline)
    except TimeoutError:
        raise request_timeout_error() from None


def _prompts(
    model: LoadedModel, request: CompletionRequest, plan: fim.FimPlan | None, deadline: float,
) -> list[CompletionPrompt]:
    """Every prompt tokenized and checked (CPU work: run off the event loop)."""
    tokenizer = model.tokenizer
    several = len(request.prompts) > 1
    limit, _ = context_limit(model.context_length, request.context_window)
    out: list[CompletionPrompt] = []
    for i, prompt in enumerate(request.prompts):
        if time.monotonic() >= deadline:
            raise request_timeout_error()
        param = f"prompt[{i}]" if several else "prompt"
        if not isinstance(prompt, str):
            _check_ids(model, prompt, param)
        lead = 0
        try:
            if plan is not None:
                prefix = prompt if isinstance(prompt, str) else tokenizer.decode(list(prompt))
                ids = fim.build_prompt(tokenizer, plan, prefix, request.suffix or "",
                                       bound=limit)
            elif isinstance(prompt, str):
                lead = len(fim.lead_for(tokenizer, prompt))
                ids = fim.encode_text(tokenizer, prompt, bound=limit)
            else:
                ids = list(prompt)
        except PromptTooLong as exc:
            raise _too_long(model, request, exc.at_least, param) from None
        if not ids:
            raise InvalidRequestError(
                f"'{param}' is empty: the model needs at least one token to continue from.",
                code="invalid_value",
                param=param,
            )
        max_tokens = _fitted(model, request, len(ids), param)
        echo = None
        if request.echo:
            echo = prompt if isinstance(prompt, str) else tokenizer.decode(list(prompt))
        out.extend(CompletionPrompt(ids, echo, lead, max_tokens, choice)
                   for choice in range(request.n))
    return out


def _check_ids(model: LoadedModel, ids: tuple[int, ...], param: str) -> None:
    vocab = model.vocab_size
    for j, token in enumerate(ids):
        if token >= vocab:
            raise InvalidRequestError(
                f"Invalid token id {token} in '{param}': the model's vocabulary has ids "
                f"0-{vocab - 1}.",
                code="invalid_value",
                param=f"{param}[{j}]",
            )


def _fitted(model: LoadedModel, request: CompletionRequest, prompt: int, param: str) -> int:
    """The completion's token budget: the request's, which must fit the context window
    with the prompt, or when it is only a cap, what the window leaves (at least one)."""
    limit, own = context_limit(model.context_length, request.context_window)
    if own:  # the request's own window is what the prompt is too long for
        param = CONTEXT_WINDOW_PARAM
    if request.max_tokens_shrinks:
        left = limit - prompt
        if left < 1:
            _check_fits(limit, prompt, 1, param)
        return min(request.max_tokens, left)
    _check_fits(limit, prompt, request.max_tokens, param)
    return request.max_tokens


def _too_long(model: LoadedModel, request: CompletionRequest, at_least: int,
              param: str) -> ContextLengthError:
    """The refusal of a prompt far past the window, counted only until it clearly was:
    the usual one, its counts said to be lower bounds."""
    limit, own = context_limit(model.context_length, request.context_window)
    completion = 1 if request.max_tokens_shrinks else request.max_tokens
    return _context_error(limit, at_least, completion,
                          CONTEXT_WINDOW_PARAM if own else param, at_least=True)


def _check_fits(limit: int, prompt: int, completion: int, param: str) -> None:
    if prompt + completion > limit:
        raise _context_error(limit, prompt, completion, param)


def _context_error(limit: int, prompt: int, completion: int, param: str, *,
                   at_least: bool = False) -> ContextLengthError:
    """OpenAI's legacy Completions wording; ``at_least``: ``prompt`` is what was counted
    before counting stopped, not the whole prompt's count."""
    some = "at least " if at_least else ""
    return ContextLengthError(
        f"This model's maximum context length is {limit} tokens, however you requested "
        f"{some}{prompt + completion} tokens ({some}{prompt} in your prompt; {completion} "
        "for the completion). Please reduce your prompt; or completion length.",
        prompt_tokens=prompt, limit=limit, param=param,
    )
