"""A round's output plan: which grammar constrains decoding, which tokens are banned, and
how the output is read and checked.

From the request (tools, ``tool_choice``, ``response_format``, ``parallel_tool_calls``,
``reasoning_effort``) and what the model can do (its thinking markers and tool-call
format, as mlx-lm detects them), decide for each round: which grammar constrains
decoding, which tokens are banned, how output text is split into reasoning, content and
tool calls, and how the final output is checked. The pipeline then just runs the plan.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from afmd.core.ids import new_tool_call_id
from afmd.core.request import ChatRequest
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.reasoning_count import ReasoningMarkers
from afmd.errors import InvalidRequestError, ServerError
from afmd.grammar.batch_masks import BanTokens, GrammarProcessor
from afmd.grammar.calls import CallGrammar, for_family
from afmd.grammar.compiler import (
    Grammar,
    ToolSchema,
    json_schema_grammar,
    llg_tokenizer,
    text_grammar,
    tool_grammar,
)
from afmd.grammar.frames import Thinking
from afmd.grammar.limits import schema_limit_param
from afmd.grammar.schema_size import MAX_SUBSCHEMAS, subschemas
from afmd.output.formats import detect
from afmd.output.formats.harmony import ANALYSIS as HARMONY_ANALYSIS
from afmd.output.processor import OutputProcessor, ToolFormat
from afmd.service.hidden_tokens import for_stops, hidden_tokens
from afmd.service.metaschema import metaschema_problem

if TYPE_CHECKING:
    from afmd.engine.batch.penalties import LogitsProcessor

# Tokens a forced call may spend thinking first (the loop must reach the call).
_MAX_FORCED_THINKING = 512
# gpt-oss's reasoning levels, for afmd's reasoning_effort values (gpt-oss has no level
# above high: xhigh and OpenAI's, Anthropic's and Ollama's "max" are its highest, as Ollama
# maps it).
_HARMONY_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium",
                   "high": "high", "xhigh": "high", "max": "high"}


@dataclass(frozen=True, slots=True)
class ModelFormats:
    """How a model writes calls and reasoning, and afmd's grammar for its calls."""

    tool_format: ToolFormat | None
    thinking: tuple[str, str] | None  # markers (None for channels: harmony reads its own)
    syntax: CallGrammar | None  # None: its calls cannot be forced
    #: The reasoning block's tokens, harmony's analysis channel included, for the count.
    reasoning: ReasoningMarkers | None = None
    #: The call format's ``start`` where it is one token: what ``tool_choice: "none"`` bans.
    start_token: int | None = None
    #: The special tokens a chat answer leaves out of its text.
    hidden: frozenset[int] = frozenset()

    @property
    def channels(self) -> bool:
        return self.tool_format is not None and self.tool_format.channels

    @property
    def thinks(self) -> bool:
        return detect.thinks(self.tool_format, self.thinking)


#: By the tokenizer itself, weakly: an entry goes with its tokenizer, which an unloaded
#: model takes with it (a model loaded again has a new one).
_formats: weakref.WeakKeyDictionary[Any, ModelFormats] = weakref.WeakKeyDictionary()
_formats_lock = threading.Lock()


def model_formats(model: LoadedModel) -> ModelFormats:
    """Detected once per tokenizer: reading a large vocabulary costs milliseconds."""
    tokenizer = model.tokenizer
    with _formats_lock:
        hit = _formats.get(tokenizer)
    if hit is not None:
        return hit
    vocab = tokenizer.get_vocab()
    tool_format = detect.call_format(model.tool_format, vocab)
    thinking = detect.thinking_markers(model.thinking, vocab)
    name = tool_format.family if tool_format is not None else None
    channels = tool_format is not None and tool_format.channels
    markers = tool_format.markers if tool_format is not None else ()
    found = ModelFormats(
        tool_format,
        None if channels else thinking,
        for_family(name, array_calls=detect.array_calls(vocab)),
        _reasoning_markers(HARMONY_ANALYSIS if channels else thinking),
        model.single_token(tool_format.start) if tool_format and tool_format.start else None,
        hidden_tokens(model.tokenizer,
                      None if markers is None else (*markers, *(thinking or ())),
                      model.eos_ids),
    )
    with _formats_lock:
        _formats[tokenizer] = found
    return found


def _reasoning_markers(markers: tuple[str, str] | None) -> ReasoningMarkers | None:
    return ReasoningMarkers(*markers) if markers is not None and all(markers) else None


def shows_tools(request: ChatRequest, model: LoadedModel) -> bool:
    """Whether the prompt lists the request's tools. ``tool_choice: "none"`` lists them
    too, as OpenAI and Anthropic do (the model knows of tools it may not call, and the
    prompt keeps the prefix of the turns that could call, for the prefix cache), where
    banning the call format's one start token keeps every call out. Elsewhere they are
    left out, so that nothing draws the model to a call it could still write."""
    if not request.tools:
        return False
    if request.tool_choice.mode != "none":
        return True
    formats = model_formats(model)
    return (formats.start_token is not None and formats.tool_format is not None
            and formats.tool_format.start_alone_opens)


def template_kwargs(request: ChatRequest, model: LoadedModel) -> dict[str, Any]:
    """``reasoning_effort`` mapped onto the template's thinking switch, where it has one
    (gpt-oss: its reasoning level)."""
    if request.reasoning_effort is None:
        return {}
    if model_formats(model).channels:
        return {"reasoning_effort": _HARMONY_EFFORT.get(request.reasoning_effort, "medium")}
    if model.thinking is None:
        return {}
    return {"enable_thinking": request.reasoning_effort not in ("none", "minimal")}


@dataclass(slots=True)
class OutputPlan:
    """What one round decided: its grammar and bans, how its output is read and checked."""

    grammar: Grammar | None = None
    downgraded: bool = False
    ban: tuple[int, ...] = ()
    starts_in_reasoning: bool = False
    # How the output is read back: stop sequences, the model's thinking markers, its call
    # format (None: calls are not parsed) and the tools as its call parsers take them.
    stops: tuple[str, ...] = ()
    thinking: tuple[str, str] | None = None
    reasoning: ReasoningMarkers | None = None  # what the engine counts as reasoning tokens
    tool_format: ToolFormat | None = None
    calls_on: bool = True  # False: the format is only read for its channels
    enforced: bool = False  # the grammar makes every call well formed
    call_offset: int = 0  # calls earlier in the conversation (ids that count them)
    # Special tokens whose text the answer leaves out (afmd.service.hidden_tokens).
    hidden_ids: frozenset[int] = frozenset()
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_calls: int | None = None
    schema: dict[str, Any] | None = None  # response_format schema to check the answer against
    json_answer: bool = False
    _prepared: list[LogitsProcessor] | None = None

    def prepare_processors(self) -> None:
        """Build the first set of processors now (in a worker thread, not on the loop)."""
        self._prepared = self._build_processors()

    def logits_processors(self) -> list[LogitsProcessor]:
        """Fresh per-request processors (grammar matchers hold per-sequence state)."""
        prepared, self._prepared = self._prepared, None
        return prepared if prepared is not None else self._build_processors()

    def _build_processors(self) -> list[LogitsProcessor]:
        out: list[LogitsProcessor] = []
        if self.grammar is not None:
            out.append(GrammarProcessor(self.grammar.matcher(), self.grammar.tokenizer.vocab_size))
        if self.ban:
            out.append(BanTokens(self.ban))
        return out

    def output_processor(self) -> OutputProcessor:
        return OutputProcessor(
            stops=self.stops,
            thinking=self.thinking,
            starts_in_reasoning=self.starts_in_reasoning,
            tool_format=self.tool_format,
            tools=self.tools,
            max_calls=self.max_calls,
            new_id=new_tool_call_id,
            enforced=self.enforced,
            calls_on=self.calls_on,
            call_offset=self.call_offset,
        )

    def check_grammar(self, processors: list[LogitsProcessor]) -> None:
        """A grammar decoding could not follow to the end is the client's error, never an
        answer cut where the matcher gave up (it then allows only the end of output)."""
        if self.grammar is None:
            return
        for processor in processors:
            if isinstance(processor, GrammarProcessor) and (
                    error := processor.failure()) is not None:
                raise self.grammar.failure(error)

    def check_answer(self, content: str | None) -> None:
        """A structured answer that still fails its schema is an error, never silence."""
        if not self.json_answer:
            return
        try:
            value = _loads(content or "")
        except ValueError:
            raise ServerError(
                "The model's output is not valid JSON although a JSON response_format "
                "was requested.",
                code="invalid_json_output",
            ) from None
        if self.schema is not None:
            if self.downgraded:
                # Best effort (X-Grammar-Constraints: downgraded): the grammar could not
                # enforce every keyword, so the answer is not held to them.
                return
            error = _schema_error(self.schema, value)
            if error is not None:
                raise ServerError(
                    f"The model's output does not match the requested JSON schema: {error}",
                    code="invalid_json_output",
                )
        elif not isinstance(value, dict):
            raise ServerError(
                "The model's output is not a JSON object.", code="invalid_json_output"
            )


def _loads(text: str) -> Any:
    """JSON as the grammar allows it: orjson refuses numbers beyond a double's range
    (``6e99999``), which JSON permits and a JSON grammar emits; the stdlib reads them.
    Output nested deeper than orjson reads recurses past the stdlib's limit too: that is
    the same unreadable answer as any other invalid JSON, never a crash."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def _schema_error(schema: dict[str, Any], value: Any) -> str | None:
    import jsonschema

    validator_cls = _answer_validator(
        jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator))
    try:  # a recursive schema lets the answer nest deeper than the validator recurses
        error = jsonschema.exceptions.best_match(validator_cls(schema).iter_errors(value))
    except RecursionError:
        return "it nests too deeply to be checked"
    return None if error is None else error.message


def _held_by_the_grammar(*_args: Any) -> Iterator[Any]:
    return iter(())


@functools.cache
def _answer_validator(validator_cls: Any) -> Any:
    """``validator_cls`` without the keywords it would check with Python's ``re``:
    ``pattern``, ``patternProperties``, and ``additionalProperties`` beside them (which
    keys are additional is a search of the patterns).

    The grammar that wrote the answer already held it to them, with llguidance's regular
    expressions, whose matcher is linear; ``re`` backtracks, and a client's pattern such
    as ``^(a|a)*a{40}$`` takes it hours on the very answer the grammar let through, on
    the event loop, so the server stopped answering anyone. ``re`` also reads a pattern
    otherwise than the grammar did (``\\d``, ``$``), which would fail an answer the
    grammar wrote to the pattern. Every other keyword is still checked."""
    import jsonschema

    additional = validator_cls.VALIDATORS.get("additionalProperties")

    def additional_properties(validator: Any, value: Any, instance: Any,
                              schema: Any) -> Iterator[Any]:
        if additional is not None and "patternProperties" not in schema:
            yield from additional(validator, value, instance, schema)

    return jsonschema.validators.extend(validator_cls, {
        "pattern": _held_by_the_grammar,
        "patternProperties": _held_by_the_grammar,
        "additionalProperties": additional_properties,
    })


def _check_schema(schema: dict[str, Any], param: str) -> None:
    # First what the grammar compiler cannot take (named down to the value), then the
    # metaschema: a number the compiler would die on is a valid JSON Schema.
    limit = schema_limit_param(schema, param)
    if limit is not None:
        raise InvalidRequestError(
            f"Unsupported JSON schema: {limit[0]}", code="invalid_schema", param=limit[1]
        )
    problem = _schema_problem(schema)
    if problem is not None:
        raise InvalidRequestError(
            f"Invalid JSON schema: {problem}", code="invalid_schema", param=param
        )


def _schema_problem(schema: dict[str, Any]) -> str | None:
    """Why a JSON schema is invalid, or None."""
    try:  # json, not orjson: NaN stays NaN and big integers stay exact in the key
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):  # not plain JSON data: checked every time
        return metaschema_problem(schema)
    return _schema_text_problem(text)


@functools.lru_cache(maxsize=256)
def _schema_text_problem(text: str) -> str | None:
    """Verdicts cached by canonical schema text: checking against the metaschema is pure
    Python (holding the GIL) at a cost per subschema, and agents send the same tool
    schemas with every request."""
    return metaschema_problem(json.loads(text))


def check_schemas(request: ChatRequest) -> None:
    """400 ``invalid_schema`` for a tool's parameters or a ``json_schema`` that is not a
    JSON Schema, whichever model serves the request; and for schemas that together hold
    more subschemas than the compiler takes in one (:mod:`afmd.grammar.schema_size`),
    counted before any of them is checked, naming the one the count passed the bound in."""
    schemas = [(tool.parameters, tool.parameters_param(i))
               for i, tool in enumerate(request.tools) if tool.parameters is not None]
    response_format = request.response_format
    if response_format is not None and response_format.schema is not None:
        schemas.append((response_format.schema, "response_format.json_schema.schema"))
    left = MAX_SUBSCHEMAS
    for schema, param in schemas:
        left -= subschemas(schema, left)
        if left < 0:
            holds = ("the request's schemas hold more than {} subschemas together, "
                     "counted up to this one" if len(schemas) > 1
                     else "it holds more than {} subschemas").format(MAX_SUBSCHEMAS)
            raise InvalidRequestError(
                f"Unsupported JSON schema: {holds} (objects where a schema may be); the "
                f"grammar compiler takes at most {MAX_SUBSCHEMAS} in one.",
                code="invalid_schema", param=param)
    for schema, param in schemas:
        _check_schema(schema, param)


def _answer_schema(response_format: Any) -> dict[str, Any] | None:
    if response_format is None:
        return None
    return response_format.schema if response_format.schema is not None else {"type": "object"}


def plan_output(
    request: ChatRequest,
    model: LoadedModel,
    prompt: list[int],
    max_tokens: int,
    *,
    first_step: bool = True,
    template_tools: list[dict[str, Any]] | None = None,
) -> OutputPlan:
    """The plan of one generation step.

    ``first_step``: the request's first generation, which obeys ``required`` and a named
    ``tool_choice`` whatever the history holds (a request whose history ends in tool
    results starts with a first step too, as OpenAI enforces ``tool_choice`` on every
    request). Only the rounds afmd adds itself after running server tools are free.
    ``template_tools``: the request's tools as the model's call parser takes them.
    """
    formats = model_formats(model)
    plan = OutputPlan(stops=request.stop, thinking=formats.thinking,
                      reasoning=formats.reasoning,
                      tools=template_tools if template_tools is not None else [],
                      hidden_ids=for_stops(formats.hidden, model.tokenizer, request.stop))
    plan.starts_in_reasoning = model.prompt_opens_thinking(prompt)
    choice = request.tool_choice
    tool_format = formats.tool_format
    syntax = formats.syntax
    tools_on = bool(request.tools) and choice.mode != "none"
    mode = choice.mode if first_step else "auto"
    # After the first step a named choice no longer narrows the tools; allowed_tools do.
    allowed_names = choice.allowed if (first_step or not choice.named) else None
    thinking_off = request.reasoning_effort in ("none", "minimal")

    check_schemas(request)
    response_format = request.response_format

    thinking = None
    if formats.thinks and not (thinking_off and not plan.starts_in_reasoning):
        budget = request.thinking_budget
        if mode == "required" or response_format is not None:
            forced = max(16, min(_MAX_FORCED_THINKING, max_tokens // 4))
            budget = forced if budget is None else min(budget, forced)
        start, end = formats.thinking or ("", "")
        # gpt-oss reasons on its analysis channel before every answer: expected, bounded.
        thinking = Thinking(start, end, plan.starts_in_reasoning, budget,
                            required=formats.channels)

    if not tools_on:
        if request.tools and formats.start_token is not None:
            plan.ban = (formats.start_token,)
        if formats.channels:
            plan.tool_format, plan.calls_on = tool_format, False
    else:
        plan.tool_format = tool_format
        plan.max_calls = None if request.parallel_tool_calls else 1
        plan.call_offset = sum(len(m.tool_calls) for m in request.messages)

    tokenizer = None

    def llg() -> Any:
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = llg_tokenizer(model.tokenizer, model.vocab_size, model.eos_ids)
        return tokenizer

    if tools_on and syntax is not None:
        allowed = set(allowed_names) if allowed_names is not None else None
        schemas = [
            ToolSchema(t.name, t.parameters or {"type": "object"},
                       t.parameters_param(i), custom=t.custom)
            for i, t in enumerate(request.tools)
            if allowed is None or t.name in allowed
        ]
        assert tool_format is not None
        plan.grammar = tool_grammar(
            llg(),
            schemas,
            start=tool_format.start,
            end=tool_format.end,
            required=mode == "required",
            parallel=request.parallel_tool_calls,
            thinking=thinking,
            answer_schema=_answer_schema(response_format) if mode != "required" else None,
            syntax=syntax,
        )
        plan.enforced = True
        if response_format is not None and mode != "required":
            plan.json_answer = True
            plan.schema = response_format.schema
    elif tools_on and mode == "required":
        # This model family's call format has no grammar here: best effort only.
        plan.downgraded = True
    elif response_format is not None:
        param = (
            "response_format.json_schema.schema"
            if response_format.kind == "json_schema"
            else "response_format"
        )
        plan.grammar = json_schema_grammar(
            llg(), response_format.schema, thinking=thinking, param=param, syntax=syntax
        )
        plan.json_answer = True
        plan.schema = response_format.schema
    elif thinking is not None and thinking.budget is not None and not (
        tools_on and tool_format is not None
    ):
        # Only a grammar can close the thinking block at the budget. (Where the model's
        # call format has no grammar here, the budget is not enforced.)
        plan.grammar = text_grammar(llg(), thinking, syntax)
    if plan.grammar is not None and plan.grammar.downgraded:
        plan.downgraded = True
    return plan
