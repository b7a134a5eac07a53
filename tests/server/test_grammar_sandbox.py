"""The grammar compiler cannot take the server down: the screen, the compile worker, a fuzz.

llguidance 1.9.1 dies of a stack overflow on ``{"enum": [-9223372036854775808]}`` (and on
``const``, or an integer range pinned there). The schema screen refuses such numbers with
a 400 naming the value, in every dialect; whatever gets past it is compiled in a worker
process first, whose death or overrun costs the request a 400 and the worker a restart.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher

from afmd.config.load import load_config
from afmd.engine.models.loaded_model import LoadedModel
from afmd.engine.models.model_registry import ModelRegistry
from afmd.errors import InvalidRequestError
from afmd.grammar.compiler import Grammar, json_schema_grammar, llg_tokenizer
from afmd.grammar.limits import MAX_ENUM, MAX_PROPERTIES, schema_limit_param
from afmd.grammar.sandbox import CompileFailed, CompileWorker, compile_worker

INT64_MIN = -(2**63)
CRASHING = [
    {"enum": [INT64_MIN]},
    {"const": INT64_MIN},
    {"const": -9223372036854775297},  # rounds to -2^63 as a double
    {"type": "integer", "minimum": INT64_MIN + 1, "maximum": INT64_MIN + 1},
    {"type": "integer", "minimum": -1e300, "maximum": -1e300},
]

REPRODUCER = textwrap.dedent("""
    from llguidance import LLMatcher
    g = LLMatcher.grammar_from_json_schema({"enum": [-9223372036854775808]})
    LLMatcher.validate_grammar_with_warnings(g)
""")


def test_the_upstream_fault_is_still_there() -> None:
    """The reason for all of this, run bare. If it stops crashing, llguidance fixed it and
    the screen (``afmd.grammar.limits``) may be relaxed."""
    done = subprocess.run([sys.executable, "-c", REPRODUCER], capture_output=True,
                          timeout=120)
    # SIGSEGV here (-11); a stack overflow may be SIGBUS elsewhere: killed by a signal.
    assert done.returncode < 0, (done.returncode, done.stderr[-500:])


# --------------------------------------------------------------------------- the screen


@pytest.mark.parametrize("schema", CRASHING, ids=["enum", "const", "const-rounds",
                                                  "pinned-range", "pinned-float"])
def test_the_screen_refuses_every_known_crash(schema: dict[str, Any]) -> None:
    found = schema_limit_param(schema, "s")
    assert found is not None
    assert found[1].startswith("s.") and found[1] != "s.type"


@pytest.mark.parametrize(
    ("schema", "param"),
    [
        ({"properties": {"a": {"enum": [1, 2**64]}}}, "s.properties.a.enum[1]"),
        ({"anyOf": [{"const": float("inf")}]}, "s.anyOf[0].const"),
        ({"default": 10**5000}, "s.default"),
        ({"enum": list(range(MAX_ENUM + 1))}, "s.enum"),
        ({"properties": {"o": {"properties": {
            f"p{i}": {} for i in range(MAX_PROPERTIES + 1)}}}}, "s.properties.o.properties"),
        ({"const": {"deep": [-1e300]}}, "s.const.deep[0]"),
        # An integral multipleOf is an automaton with as many states: 999983 took the
        # matcher's build 11 s and 465 MB, 239823047 ran out of memory.
        ({"type": "integer", "multipleOf": 239823047}, "s.multipleOf"),
        ({"items": {"type": "number", "multipleOf": 10_001}}, "s.items.multipleOf"),
        ({"type": "integer", "multipleOf": 99991000}, "s.multipleOf"),
        ({"type": "integer", "multipleOf": -5}, "s.multipleOf"),
        ({"type": "number", "multipleOf": 0}, "s.multipleOf"),
    ],
)
def test_the_screen_names_the_value(schema: dict[str, Any], param: str) -> None:
    found = schema_limit_param(schema, "s")
    assert found is not None and found[1] == param


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
        {"type": "integer", "minimum": INT64_MIN + 2048},
        {"type": "number", "minimum": -1e18, "maximum": 1e-300, "multipleOf": 0.5},
        {"enum": [True, False, None, "x", 1.5, -3]},
        {"enum": list(range(MAX_ENUM))},
        {"properties": {f"p{i}": {"type": "integer"} for i in range(MAX_PROPERTIES)}},
        {"type": "integer", "multipleOf": 10_000},
        {"type": "integer", "multipleOf": 10**12},
        {"properties": {"multipleOf": {"type": "string"}}},
    ],
)
def test_the_screen_passes_ordinary_schemas(schema: dict[str, Any]) -> None:
    assert schema_limit_param(schema, "s") is None


# --------------------------------------------------------------------------- the worker


def test_a_worker_death_is_one_refused_compile_then_a_fresh_worker() -> None:
    worker = CompileWorker()
    try:
        good = LLMatcher.grammar_from_json_schema({"type": "integer"})
        assert worker.validate(good, None, None) == (False, ())
        first = worker.pid
        bad = LLMatcher.grammar_from_json_schema({"enum": [INT64_MIN]})  # unscreened
        with pytest.raises(CompileFailed, match="crashed"):
            worker.validate(bad, None, None)
        assert worker.restarts == 1
        assert worker.validate(good, None, None) == (False, ())
        assert worker.pid != first
    finally:
        worker.close()


def test_an_overrun_is_a_refused_compile_and_the_worker_is_replaced() -> None:
    worker = CompileWorker()
    try:
        worker.validate(LLMatcher.grammar_from_json_schema({"type": "integer"}), None, None)
        worker.timeout_s = 0.05  # once started: the bound is per compile
        slow = LLMatcher.grammar_from_json_schema(
            {"enum": [f"value-{i}" for i in range(200_000)]})
        with pytest.raises(CompileFailed, match="longer than"):
            worker.validate(slow, None, None)
        assert worker.restarts == 1
        worker.timeout_s = 30.0
        assert worker.validate(LLMatcher.grammar_from_json_schema({"type": "string"}),
                               None, None) == (False, ())
    finally:
        worker.close()


def test_a_grammar_llguidance_refuses_by_raising_is_a_verdict_not_a_death() -> None:
    worker = CompileWorker()
    try:
        is_error, messages = worker.validate("{ not json", None, None)
        assert is_error and messages
        assert worker.restarts == 0
    finally:
        worker.close()


@pytest.fixture(scope="module")
def demo_model() -> Iterator[LoadedModel]:
    config = load_config(None, env={})
    registry = ModelRegistry(config)
    entry = registry.resolve("demo")

    async def load() -> LoadedModel:
        return await registry.begin_load(entry)

    yield asyncio.run(load())
    registry.close()


@pytest.fixture(scope="module")
def tokenizer(demo_model: LoadedModel) -> Any:
    return llg_tokenizer(demo_model.tokenizer, demo_model.vocab_size, demo_model.eos_ids)


def test_what_is_built_from_a_tokenizer_goes_with_it(demo_model: LoadedModel) -> None:
    """Each load of a model has a tokenizer of its own: once it is freed, so are its
    llguidance tokenizer, its matchers and the worker's copy. They were kept by ``id()``
    for the process's life, one set a load (a ``keep_alive: 0`` client with a schema grew
    the server and the worker by megabytes a request)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    assert demo_model.folder is not None
    fresh = load_tokenizer(demo_model.folder)
    gone = weakref.ref(fresh)
    worker = compile_worker()
    gc.collect()  # earlier tests' models, freed but not yet collected, are forgotten first
    before = worker.tokenizers
    grammar = json_schema_grammar(
        llg_tokenizer(fresh, demo_model.vocab_size, demo_model.eos_ids),
        {"type": "object", "properties": {"forgotten": {"type": "integer"}}},
        thinking=None, param="response_format")
    grammar.matcher()
    assert worker.tokenizers == before + 1  # the worker compiled with its own copy
    del fresh, grammar
    gc.collect()
    assert gone() is None
    assert worker.tokenizers == before


@pytest.mark.parametrize("schema", CRASHING[:3], ids=["enum", "const", "const-rounds"])
def test_the_compiler_unscreened_refuses_what_kills_the_worker(tokenizer: Any,
                                                               schema: dict[str, Any]) -> None:
    """The compiler behind the screen, fed what the screen would stop: this test's own
    process survives, the request is a 400, and the next grammar compiles."""
    restarts = compile_worker().restarts
    with pytest.raises(InvalidRequestError) as caught:
        json_schema_grammar(tokenizer, schema, thinking=None, param="response_format")
    assert caught.value.param == "response_format"
    assert "crashed" in caught.value.message
    assert compile_worker().restarts == restarts + 1
    ok = json_schema_grammar(tokenizer, {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9}}}, thinking=None, param="p")
    assert isinstance(ok, Grammar)
    # The same text again is remembered: no second death.
    with pytest.raises(InvalidRequestError):
        json_schema_grammar(tokenizer, schema, thinking=None, param="response_format")
    assert compile_worker().restarts == restarts + 1


# --------------------------------------------------------------------------- the fuzz

EXTREME = st.sampled_from([
    INT64_MIN, INT64_MIN + 1, INT64_MIN + 511, INT64_MIN + 1024, INT64_MIN - 1, 2**63 - 1,
    2**63, 2**64, 10**30, -(10**30), -1e300, 1e300, -1e20, 1e20, -9.3e18, 9.2e18, 1e-300,
    -0.0, 0.5, float("inf"), float("-inf"), float("nan"), 0, -1, 7,
])
NUMBER = st.one_of(EXTREME, st.integers(), st.floats(allow_nan=False, allow_infinity=False))
LEAF = st.one_of(
    st.fixed_dictionaries({"const": NUMBER}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(NUMBER, st.text(max_size=5)),
                                            min_size=1, max_size=4)}),
    st.fixed_dictionaries({"type": st.just("integer")},
                          optional={"minimum": NUMBER, "maximum": NUMBER,
                                    "exclusiveMinimum": NUMBER, "exclusiveMaximum": NUMBER,
                                    "multipleOf": NUMBER}),
    st.fixed_dictionaries({"type": st.just("number")},
                          optional={"minimum": NUMBER, "maximum": NUMBER,
                                    "multipleOf": NUMBER}),
    st.fixed_dictionaries({"type": st.just("string")},
                          optional={"minLength": NUMBER, "maxLength": NUMBER,
                                    "pattern": st.sampled_from(
                                        ["^a+$", "\\d{1,3}", "(", "x{2,1}"])}),
    st.fixed_dictionaries({"type": st.just("array")},
                          optional={"minItems": NUMBER, "maxItems": NUMBER}),
)
SCHEMA = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(st.sampled_from("abc"), inner,
                                                             max_size=3)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
    ),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=SCHEMA)
def test_fuzzed_schemas_compile_or_are_refused(tokenizer: Any, schema: dict[str, Any]) -> None:
    """Through the screen and the compiler as a request goes: a grammar or a clean 400,
    never a dead test process (this very process would be the casualty)."""
    pid = os.getpid()
    if schema_limit_param(schema, "s") is not None:
        return
    try:
        grammar = json_schema_grammar(tokenizer, schema, thinking=None, param="s")
    except InvalidRequestError as exc:
        assert exc.param == "s"
        return
    assert isinstance(grammar, Grammar)
    assert grammar.matcher() is not None
    assert os.getpid() == pid


# --------------------------------------------------------------------------- every dialect

BAD = {"enum": [INT64_MIN]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"const": INT64_MIN}}}}}
HI = [{"role": "user", "content": "hi"}]

# (path, body, where the error names the field)
REQUESTS = [
    ("/v1/chat/completions",
     {"messages": HI, "max_tokens": 8, "response_format": {
         "type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}},
     "response_format.json_schema.schema.enum[0]"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 8, "tools": [TOOL]},
     "tools[0].function.parameters.properties.n.const"),
    ("/v1/responses",
     {"input": "hi", "max_output_tokens": 16, "text": {"format": {
         "type": "json_schema", "name": "x", "schema": BAD}}},
     "text.format.schema.enum[0]"),
    ("/v1/responses",
     {"input": "hi", "max_output_tokens": 16, "tools": [{
         "type": "function", "name": "f", "parameters": TOOL["function"]["parameters"]}]},
     "tools[0].parameters.properties.n.const"),
    ("/v1/messages",
     {"model": "demo", "messages": HI, "max_tokens": 8, "output_config": {
         "format": {"type": "json_schema", "schema": BAD}}},
     "output_config.format.schema.enum[0]"),
    ("/v1/messages",
     {"model": "demo", "messages": HI, "max_tokens": 8, "tools": [{
         "name": "f", "input_schema": TOOL["function"]["parameters"]}]},
     "tools[0].input_schema.properties.n.const"),
    ("/api/chat", {"model": "demo", "messages": HI, "stream": False, "format": BAD},
     "enum[0]"),
    ("/api/generate", {"model": "demo", "prompt": "hi", "stream": False, "format": BAD},
     "enum[0]"),
]


@pytest.mark.parametrize(("path", "body", "field"), REQUESTS,
                         ids=["chat", "chat-tool", "responses", "responses-tool", "messages",
                              "messages-tool", "ollama-chat", "ollama-generate"])
def test_every_dialect_refuses_the_crash_naming_the_field(http: Any, path: str,
                                                          body: dict[str, Any],
                                                          field: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    if path.startswith("/api/"):  # Ollama's errors are one message
        assert field in error["error"]
    elif path == "/v1/messages":
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(field + ": ")
    else:
        assert error["error"]["param"] == field
        assert error["error"]["code"] == "invalid_schema"
    alive = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert alive.status_code == 200
