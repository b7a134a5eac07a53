"""Every call format end to end: a model per family, the real pipeline, the same cases.

Each family's test model (:mod:`helpers.format_models`: the family's special tokens and a
template in its style, random weights) is loaded the way afmd loads any model, so mlx-lm
detects its format as it would on the real one. Its output is gibberish, but under
afmd's grammar for the family every forced call is well formed and valid against its
tool's schema, whatever the seed; named and allowed_tools choices bind the call; a turn
without parallel calls has one; arguments stream in fragments whose concatenation is the
final ``arguments``; history renders back in the family's markup and reads back as the
same call; thinking comes before the call; a JSON answer or a call, with tools and a
``response_format``. No markup ever reaches content.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest

from afmd.config.load import load_config
from afmd.core.events import (
    Content,
    Event,
    Finish,
    Logprobs,
    Reasoning,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from afmd.core.request import ChatRequest, Message, ToolCall, ToolChoice
from afmd.dialects.ollama.ollama_body import parse_chat
from afmd.dialects.openai.chat import OPENAI_CHAT
from afmd.dialects.responses.client_tools import PARAMETERS
from afmd.dialects.responses.options import custom_parameters
from afmd.engine.models.model_registry import ModelRegistry
from afmd.output.formats.registry import FAMILIES as READERS
from afmd.service.chat_template import template_messages
from afmd.service.hidden_tokens import is_read
from afmd.service.output_plan import model_formats
from afmd.service.pipeline import ChatPipeline
from afmd.service.scheduler import Scheduler

from helpers.format_models import FormatModels
from helpers.formats import SPECS, Spec
from helpers.lark_judge import in_lark

SEEDS = (0, 1, 2, 3)
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 24}},
        "required": ["text"]}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "note": NOTE}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"The {name} tool.",
                                           "parameters": schema}}
         for name, schema in SCHEMAS.items()]
USER = {"role": "user", "content": "What is the weather in Paris?"}
FAMILIES = list(SPECS.values())
THINKING = [s for s in FAMILIES if s.think is not None or s.id == "harmony"]


class Models:
    def __init__(self, root: Path) -> None:
        folders = FormatModels(root)
        config = root / "afmd.toml"
        # Every family stays loaded (tiny models): under the default max_loaded a test
        # going through the families in turn would unload and load one for each.
        config.write_text(f"[models]\nmax_loaded = {len(FAMILIES)}\n" + "".join(
            f'[[models.model]]\nid = "{s.id}"\npath = "{folders.folder(s.id)}"\n'
            for s in FAMILIES))
        self.registry = ModelRegistry(load_config(config, env={}))
        self.pipeline = ChatPipeline(self.registry, Scheduler(8, 8), request_timeout=120)

    def run(self, spec: Spec, **body: Any) -> list[Event]:
        return self.run_seeds(spec, [body.pop("seed", None)], **body)[0]

    def run_seeds(self, spec: Spec, seeds: Any, **body: Any) -> list[list[Event]]:
        """One request per seed, all at once: the engine decodes them in one batch, as
        it would concurrent clients' (and in a fraction of the time of one by one)."""
        return self.run_many(spec, [body if seed is None else {**body, "seed": seed}
                                    for seed in seeds])

    def run_many(self, spec: Spec, bodies: list[dict[str, Any]]) -> list[list[Event]]:
        """These requests all at once, decoded in one batch (see :meth:`run_seeds`)."""
        base = {"model": spec.id, "messages": [USER], "tools": TOOLS, "max_tokens": 200,
                "temperature": 1.0}

        async def go() -> list[list[Event]]:
            return list(await asyncio.gather(*(
                self._events(OPENAI_CHAT.parse(orjson.dumps({**base, **body})))
                for body in bodies)))

        return asyncio.run(go())

    def run_request(self, request: ChatRequest) -> list[Event]:
        """One request already parsed (by any dialect) through the pipeline."""
        return asyncio.run(self._events(request))

    async def _events(self, request: ChatRequest) -> list[Event]:
        run = await self.pipeline.start(await self.pipeline.prepare(request, uuid.uuid4().hex))
        try:
            return [event async for batch in run for event in batch]
        finally:
            self.pipeline.release(run)

    def model(self, spec: Spec) -> Any:
        async def get() -> Any:
            lease = await self.registry.lease(self.registry.resolve(spec.id))
            lease.release()
            return lease.model

        return asyncio.run(get())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Models]:
    built = Models(tmp_path_factory.mktemp("formats"))
    yield built
    built.registry.close()


def calls_of(spec: Spec, events: list[Event]) -> list[ToolCallEnd]:
    """Each call starts, streams and ends before the next; the content and reasoning carry
    no markup; every call's arguments are valid against its tool's schema (but the last
    when max_tokens cut the turn: it is sent as far as it was written)."""
    ends: list[ToolCallEnd] = []
    open_call: tuple[ToolCallStart, list[str]] | None = None
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_call is None and event.index == len(ends)
            open_call = (event, [event.arguments] if event.arguments else [])
        elif isinstance(event, ToolCallArguments):
            assert open_call is not None and event.index == open_call[0].index
            open_call[1].append(event.fragment)
        elif isinstance(event, ToolCallEnd):
            assert open_call is not None
            start, fragments = open_call
            assert (event.call.id, event.call.name) == (start.id, start.name)
            assert "".join(fragments) == event.call.arguments
            ends.append(event)
            open_call = None
        elif isinstance(event, Content | Reasoning):
            for token in spec.tokens:
                assert token not in event.text, (token, event.text)
    assert open_call is None
    for end in ends[:-1] if finish(events) == "length" else ends:
        jsonschema.validate(json.loads(end.call.arguments), SCHEMAS[end.call.name])
    return ends


def finish(events: list[Event]) -> str:
    return next(e.reason for e in events if isinstance(e, Finish))


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_format_is_detected_and_forced(models: Models, spec: Spec) -> None:
    formats = model_formats(models.model(spec))
    assert formats.tool_format is not None and formats.tool_format.family == spec.reader
    assert formats.syntax is not None  # afmd has a grammar for it


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_special_tokens_no_reader_needs_never_reach_the_text(models: Models,
                                                             spec: Spec) -> None:
    """The family's special tokens that are neither read (its call markers, its reasoning
    markers, as mlx-lm detects them on this model) nor end ids are hidden; a free turn (no
    tools, so no grammar) pushed to write them between words counts and scores them but
    never shows them."""
    model = models.model(spec)
    vocab = model.tokenizer.get_vocab()
    markers = READERS[spec.reader].markers + (spec.think or ())
    hidden = {vocab[t] for t in spec.tokens
              if vocab[t] not in model.eos_ids and not is_read(t, markers)}
    assert model_formats(model).hidden == hidden
    if not hidden:
        return  # harmony and Kimi K3: every token is read or ends the turn
    word = model.tokenizer.encode(" ok", add_special_tokens=False)[0]  # a plain token
    # Greedy, the biased tokens on top, the penalty taking turns among them.
    events = models.run(spec, tools=None, max_tokens=24, temperature=0, logprobs=True,
                        frequency_penalty=2.0, reasoning_effort="none",
                        logit_bias={str(t): 100 for t in (*hidden, word)})
    text = "".join(e.text for e in events if isinstance(e, Content | Reasoning))
    scored = [t.token for e in events if isinstance(e, Logprobs) for t in e.tokens]
    shown = {model.tokenizer.convert_ids_to_tokens(t) for t in hidden}
    assert model.tokenizer.decode([word]).strip() in text, text
    assert not any(token in text for token in shown), text
    assert usage(events).completion_tokens == len(scored) == 24
    assert shown & set(scored)


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_forced_call_is_valid_every_time(models: Models, spec: Spec) -> None:
    runs = models.run_seeds(spec, SEEDS, tool_choice="required", parallel_tool_calls=False,
                            reasoning_effort="none")
    for seed, events in zip(SEEDS, runs, strict=True):
        (call,) = calls_of(spec, events)
        assert finish(events) == "tool_calls"
        arguments = json.loads(call.call.arguments)
        fragments = [e for e in events if isinstance(e, ToolCallArguments)]
        if arguments:  # streamed as written, not in one piece at the end
            assert len(fragments) >= 2, (seed, call)
        assert not [e for e in events if isinstance(e, Content)]


#: Tool names as MCP servers give them (dots and slashes), which Ollama's clients pass on.
NAMESPACED = ("calendar.read", "docs/search_v2")


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_namespaced_tool_names_from_ollama_clients_are_called_by_name(
        models: Models, spec: Spec) -> None:
    """Ollama takes any tool name; afmd takes what every family's call reader reads back,
    and a forced call to such a tool comes back under its name, its arguments valid."""
    body = {"model": spec.id, "stream": False, "think": False,
            "options": {"num_predict": 200, "temperature": 1.0, "seed": 3},
            "messages": [{"role": "user", "content": "Note this down."}],
            "tools": [{"type": "function", "function": {
                "name": name, "description": "Writes a note.", "parameters": NOTE}}
                for name in NAMESPACED]}
    parsed = parse_chat(orjson.dumps(body))
    assert [t.name for t in parsed.tools] == list(NAMESPACED)
    forced = dataclasses.replace(parsed, tool_choice=ToolChoice(
        "required", allowed=(NAMESPACED[0],)), parallel_tool_calls=False)
    events = models.run_request(forced)
    calls = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [c.call.name for c in calls] == [NAMESPACED[0]], events
    jsonschema.validate(json.loads(calls[0].call.arguments), NOTE)
    assert finish(events) == "tool_calls"


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_named_choice_and_allowed_tools_bind_the_call(models: Models, spec: Spec) -> None:
    named = models.run(spec, tool_choice={"type": "function", "function": {"name": "add"}},
                       seed=5, reasoning_effort="none", parallel_tool_calls=False)
    assert [e.call.name for e in calls_of(spec, named)][:1] == ["add"]
    allowed = models.run(spec, seed=6, reasoning_effort="none", parallel_tool_calls=False,
                         tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "note"}}]}})
    names = {e.call.name for e in calls_of(spec, allowed)}
    assert names == {"note"}


@pytest.mark.parametrize("spec", [s for s in FAMILIES if s.parallel], ids=lambda s: s.id)
def test_parallel_calls_all_valid(models: Models, spec: Spec) -> None:
    for events in models.run_seeds(spec, SEEDS[:2], tool_choice="required",
                                   parallel_tool_calls=True, reasoning_effort="none",
                                   max_tokens=300):
        ends = calls_of(spec, events)
        assert ends and len({e.call.id for e in ends}) == len(ends)


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_free_turns_keep_markup_out_of_content(models: Models, spec: Spec) -> None:
    for events in models.run_seeds(spec, SEEDS[:2], reasoning_effort="none", max_tokens=60):
        calls_of(spec, events)
        assert finish(events) in ("stop", "length", "tool_calls")


def usage(events: list[Event]) -> Usage:
    return next(e for e in events if isinstance(e, Usage))


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_tool_choice_none_lists_the_tools_where_no_call_can_open(
    models: Models, spec: Spec
) -> None:
    """``none`` keeps the tools in the prompt (as OpenAI does; the prefix of the turns that
    could call stays cached) in every family whose calls open only with one start token,
    which is then banned. Harmony's and Llama 3.1's calls can open without one, and
    MiniCPM5's and Kimi K3's open with text over several tokens: there the tools are left
    out. Either way no call is made."""
    body: dict[str, Any] = {"seed": 0, "max_tokens": 1, "reasoning_effort": "none"}
    listed = usage(models.run(spec, **body)).prompt_tokens
    bare = usage(models.run(spec, **body, tools=None)).prompt_tokens
    assert listed > bare
    hidden = spec.id in ("harmony", "llama3", "minicpm5", "kimi_k3")
    start = model_formats(models.model(spec)).tool_format.start  # type: ignore[union-attr]
    for events in models.run_seeds(spec, SEEDS[:2], reasoning_effort="none", max_tokens=60,
                                   tool_choice="none"):
        assert not [e for e in events if isinstance(e, ToolCallStart)]
        assert finish(events) in ("stop", "length")
        assert usage(events).prompt_tokens == (bare if hidden else listed)
        if not hidden:
            assert start not in "".join(e.text for e in events if isinstance(e, Content))


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_tool_loop_renders_history_in_the_family_markup(models: Models, spec: Spec) -> None:
    first = models.run(spec, tool_choice="required", parallel_tool_calls=False, seed=7,
                       reasoning_effort="none")
    (end,) = calls_of(spec, first)
    call = end.call
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'}]
    # The template writes the call back exactly as the family writes calls.
    model = models.model(spec)
    rendered = model.tokenizer.apply_chat_template(
        template_messages((Message("user", USER["content"]),
                           Message("assistant", None, tool_calls=(call,)),
                           Message("tool", '{"ok": true}', tool_call_id=call.id))),
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    written = spec.calls([(call.name, json.loads(call.arguments))])
    if spec.id == "mistral_v3":  # the writer's placeholder id: the template has the call's
        written = written.replace("abcdefgh0", call.id)
    assert written in rendered
    second = models.run(spec, messages=history, tool_choice="required",
                        parallel_tool_calls=False, seed=8, reasoning_effort="none")
    (again,) = calls_of(spec, second)
    if spec.id == "kimi_k2":  # ids count the conversation's calls, as Kimi's template does
        assert (call.id, again.call.id) == (f"functions.{call.name}:0",
                                            f"functions.{again.call.name}:1")


@pytest.mark.parametrize("spec", THINKING, ids=lambda s: s.id)
def test_thinking_comes_before_the_call(models: Models, spec: Spec) -> None:
    thought = 0
    for events in models.run_seeds(spec, (*SEEDS, 4, 5, 6, 7), tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=160):
        calls_of(spec, events)
        kinds = [type(e) for e in events if isinstance(e, Reasoning | ToolCallStart)]
        first_call = kinds.index(ToolCallStart) if ToolCallStart in kinds else len(kinds)
        assert Reasoning not in kinds[first_call:], "reasoning after the call"
        thought += Reasoning in kinds
        # The thought is counted in usage as reasoning, in every family's markup.
        (usage,) = [e for e in events if isinstance(e, Usage)]
        assert (usage.reasoning_tokens > 0) == (Reasoning in kinds), usage
        assert usage.reasoning_tokens < usage.completion_tokens, usage
    assert thought, "no seed thought first"
    if spec.id == "harmony":  # gpt-oss always reasons first
        assert thought == len(SEEDS) + 4


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_response_format_with_tools_is_an_answer_or_calls(models: Models, spec: Spec) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16}},
              "required": ["answer"], "additionalProperties": False}
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    for events in models.run_seeds(spec, SEEDS[:3], reasoning_effort="none", max_tokens=200,
                                   parallel_tool_calls=False, response_format=answer):
        ends = calls_of(spec, events)
        content = "".join(e.text for e in events if isinstance(e, Content))
        if ends:
            assert finish(events) == "tool_calls"
        else:
            jsonschema.validate(json.loads(content), schema)


def test_history_reasoning_renders_for_harmony(models: Models) -> None:
    """gpt-oss's template reads a call turn's reasoning as ``thinking``."""
    spec = SPECS["harmony"]
    call = ToolCall("call_1", "add", '{"a": 1, "b": 2}')
    messages = template_messages((
        Message("user", "Add."), Message("assistant", None, tool_calls=(call,),
                                         reasoning="I should add."),
        Message("tool", "3", tool_call_id="call_1")))
    rendered = models.model(spec).tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<|channel|>analysis<|message|>I should add.<|end|>" in rendered


PICK = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "dark blue"]},
    "code": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    "word": {"type": "string", "minLength": 2, "maxLength": 5}},
    "required": ["color", "code", "word"], "additionalProperties": False}
PER_PARAMETER = [s for s in FAMILIES if s.id in (
    "qwen3_coder", "glm47", "longcat", "minimax_m2", "muse_spark", "minicpm5", "kimi_k3",
    "gemma4", "function_gemma")]


@pytest.mark.parametrize("spec", PER_PARAMETER, ids=lambda s: s.id)
def test_raw_strings_obey_their_schema(models: Models, spec: Spec) -> None:
    """Strings written raw (no JSON quotes to hang a JSON grammar on) still keep to their
    enum, pattern and lengths: the grammar writes those as terminals of their own."""
    tools = [{"type": "function", "function": {"name": "pick", "parameters": PICK}}]
    for events in models.run_seeds(spec, SEEDS[:2], tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, reasoning_effort="none"):
        (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
        jsonschema.validate(json.loads(end.call.arguments), PICK)


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_what_a_format_cannot_express_is_downgraded(models: Models, spec: Spec) -> None:
    """A top-level anyOf is enforced inside a JSON object, not by a sequence of tagged
    parameters: those families generate it best-effort and say so."""
    from afmd.service.output_plan import plan_output

    either = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "integer"}},
              "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
    request = OPENAI_CHAT.parse(orjson.dumps({
        "messages": [USER], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": either}}]}))
    plan = plan_output(request, models.model(spec), [], 100)
    assert plan.grammar is not None
    assert plan.downgraded == (spec in PER_PARAMETER or spec.id == "pythonic")


# Quotes, backslashes and newlines (escaped in JSON families), never at either end (which
# families that trim values would cut) nor a '<' (which could spell a closing tag).
RECURSIVE = r'''start: item
item: "(" item ")" | "\"" item "\\" | "[" item "\n" item "]" | ATOM
ATOM: /[a-c]{1,3}/
'''


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_a_custom_tools_recursive_grammar_is_enforced(models: Models, spec: Spec) -> None:
    """A Responses custom tool whose lark grammar recurses (offered as a function of one
    string): each family's call grammar writes the grammar as rules, escaped where the
    input is a JSON string, so the turn is not downgraded and every forced call's input,
    as the family's reader decodes it, is in the grammar as llguidance's matcher reads it."""
    from afmd.service.output_plan import plan_output

    parameters = custom_parameters({"type": "grammar", "syntax": "lark",
                                    "definition": RECURSIVE})
    tools = [{"type": "function", "function": {"name": "shape", "parameters": parameters}}]
    request = OPENAI_CHAT.parse(orjson.dumps({
        "messages": [USER], "tools": tools, "tool_choice": "required"}))
    plan = plan_output(request, models.model(spec), [], 100)
    assert plan.grammar is not None and not plan.downgraded
    for events in models.run_seeds(spec, SEEDS, tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, reasoning_effort="none",
                                   max_tokens=400):
        (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
        assert finish(events) == "tool_calls", end
        text = json.loads(end.call.arguments)["input"]
        assert in_lark(RECURSIVE, text), text


TRIMMING = ("glm47", "longcat", "minimax_m2", "muse_spark")


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_a_recursive_grammar_a_raw_reader_would_cut_is_downgraded(
        models: Models, spec: Spec) -> None:
    """Its text may end with a newline: where the family trims raw values, that newline
    would be read away, so the input is generated best-effort and says so; JSON strings
    and untrimmed raw values carry it whole."""
    from afmd.service.output_plan import plan_output

    definition = 'start: "(" start ")" | /[a-c]+/ "\\n"\n'
    parameters = custom_parameters({"type": "grammar", "syntax": "lark",
                                    "definition": definition})
    request = OPENAI_CHAT.parse(orjson.dumps({
        "messages": [USER], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}))
    plan = plan_output(request, models.model(spec), [], 100)
    assert plan.grammar is not None
    assert plan.downgraded == (spec.id in TRIMMING)


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_the_client_run_tools_schemas_are_enforced(models: Models, spec: Spec) -> None:
    """The Responses API's ``shell``, ``local_shell`` and ``apply_patch`` are offered as
    functions of fixed schemas: every family enforces them whole (never downgraded), and
    each forced call is valid against its schema (but one max_tokens cut)."""
    from afmd.service.output_plan import plan_output

    tools = [{"type": "function", "function": {"name": kind, "parameters": schema}}
             for kind, schema in PARAMETERS.items()]
    request = OPENAI_CHAT.parse(orjson.dumps({
        "messages": [USER], "tools": tools, "tool_choice": "required"}))
    plan = plan_output(request, models.model(spec), [], 100)
    assert plan.grammar is not None and not plan.downgraded
    asked = [(kind, seed) for kind in PARAMETERS for seed in SEEDS[:2]]
    runs = models.run_many(spec, [
        {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
         "reasoning_effort": "none", "max_tokens": 300, "seed": seed}
        for (kind, seed) in asked for tool in tools if tool["function"]["name"] == kind])
    for (kind, _), events in zip(asked, runs, strict=True):
        (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
        assert end.call.name == kind
        if finish(events) == "tool_calls":
            jsonschema.validate(json.loads(end.call.arguments), PARAMETERS[kind])
