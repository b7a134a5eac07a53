"""Grammars for tool calls and structured output, compiled with llguidance.

llguidance was measured here as the only candidate with zero invalid-JSON outputs on a
rich schema, ~2 ms compiles and an explicit warning when it drops a schema feature. Each
schema is compiled strict first; if that fails only because of keywords llguidance cannot
enforce, it is compiled lenient and the response says so (``X-Grammar-Constraints:
downgraded``). A schema llguidance rejects even leniently is the client's error
(400 ``invalid_schema``). Every new grammar text is validated in the compile worker
(:mod:`afmd.grammar.sandbox`) before this process builds a matcher from it, so a text that
crashes or stalls llguidance costs a request, not the server. The per-model tokenizer
setup is cached. A grammar
is built from its own copy of a client's schema (``afmd.grammar.schema_copy``: re-rooted where
it is embedded, objects closed where that is safe); checks use the schema as given.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from afmd.engine.first_import import transformers_ready
from afmd.errors import InvalidRequestError
from afmd.grammar.calls import CallGrammar, JsonObjectCalls
from afmd.grammar.frames import Build, Frame, Thinking, Tool
from afmd.grammar.params import Inexact, kept_patterns, with_options
from afmd.grammar.sandbox import CompileFailed, TokenizerSource, compile_worker
from afmd.grammar.schema_copy import closed, reroot

#: Characters of llguidance's own error an error message repeats (its verbose errors go on
#: with the parser's state).
_MAX_REASON = 300


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled grammar and whether it could only be enforced best-effort."""

    text: str
    tokenizer: LLTokenizer
    downgraded: bool
    warnings: tuple[str, ...] = ()
    #: The request field it came from and what it is, for an error the grammar causes
    #: once decoding has begun (see :meth:`failure`), as for one found at compile time.
    param: str = ""
    what: str = "grammar"

    def failure(self, detail: str) -> InvalidRequestError:
        """The error for a matcher this grammar drove into llguidance's error state.

        Compiling checks the grammar, not every state decoding can reach: a step can
        exceed the parser's resource limits (a schema forcing a long stretch of fixed
        output, as a large ``minItems`` of a ``const`` does), and from then on the matcher
        allows nothing but the end of the output. The client's grammar caused it, so it
        is the client's error, named as a compile failure would be."""
        reason = detail.strip().splitlines()[0][:_MAX_REASON] if detail.strip() else (
            "unknown error")
        return InvalidRequestError(
            f"The {self.what} cannot be used: the grammar engine stopped following it "
            f"during generation ({reason}).",
            code="invalid_schema",
            param=self.param or None,
        )

    def matcher(self) -> LLMatcher:
        """A fresh matcher: a copy of this grammar's prototype (microseconds, where
        building one from the text takes ~2.5 ms of CPU per request)."""
        return _prototype(self.tokenizer, self.text).deep_copy()


@dataclass(frozen=True, slots=True)
class ToolSchema:
    name: str
    parameters: dict[str, Any]
    param: str  # where the schema came from, for error messages
    #: A custom tool, whose input's pattern is its own grammar (Rust's regex syntax, as
    #: OpenAI's): enforced, or the tool refused, never left out as a schema's may be.
    custom: bool = False


@dataclass(slots=True)
class _Known:
    """What the server keeps for one llguidance tokenizer while its model's lives."""

    #: Never reused in this process, where an ``id()`` is once its object is freed: the
    #: compile worker and the verdict cache know the tokenizer by it.
    key: int
    #: What the compile worker needs to rebuild the tokenizer.
    source: TokenizerSource
    #: One unused matcher per grammar text, most recently used last, copied for each
    #: request that needs one (:meth:`Grammar.matcher`).
    prototypes: OrderedDict[str, LLMatcher] = field(default_factory=OrderedDict)


#: Per model tokenizer, weakly held: each load of a model has its own tokenizer, and an
#: unloaded model's goes with everything built from it (its matchers, the worker's copy),
#: where holding them by ``id()`` kept them for the process's life, one set a load.
_tokenizers: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()
#: By the llguidance tokenizer's ``id()``, while a model tokenizer it was built for lives
#: (and so while it does: that id is not reused meanwhile).
_known: dict[int, _Known] = {}
_keys = itertools.count(1)
#: Prototypes kept per tokenizer: agents resend the same few tool sets.
_PROTOTYPES = 64
#: llguidance tokenizers kept by what they were built from, most recently used last, so
#: that a model loaded again (``keep_alive: 0`` reloads it for every request) finds its
#: own: building one runs in llguidance's native code without letting go of the GIL, and
#: for as long as it takes every other thread (the event loop's included) waits. Each
#: holds tens of megabytes at a 32k vocabulary, more at a larger one, outside any model's
#: share of the budget: only the last few are kept.
_built: OrderedDict[tuple[bytes, int, tuple[int, ...]], LLTokenizer] = OrderedDict()
_BUILT = 2


def llg_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> LLTokenizer:
    """The llguidance view of a model's tokenizer, built once per tokenizer's content
    (an earlier load's, if it had the same)."""
    # transformers (~45 MB resident) comes with mlx-lm's tokenizer; only a loaded model
    # needs it, so a server without one stays small.
    transformers_ready()
    from afmd.engine.mlx_compat import hf_tokenizer

    with _tokenizers_lock:
        cached = _tokenizers.get(tokenizer)
        if cached is not None and id(cached) in _known:
            return cached
        text = _serialized(hf_tokenizer(tokenizer))
        eos = tuple(sorted(eos_ids))
        if cached is None:  # else its entry went with another model's tokenizer (below)
            content = (hashlib.sha256(text.encode()).digest(), vocab_size, eos)
            cached = _built.pop(content, None)
            if cached is None:
                cached = LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos))
            _built[content] = cached
            while len(_built) > _BUILT:
                _built.popitem(last=False)
        # An entry of its own even where a live tokenizer of the same content has one
        # (two models on the same files): each entry goes with its tokenizer.
        known = _Known(next(_keys), TokenizerSource(text, vocab_size, eos))
        _tokenizers[tokenizer] = cached
        _known[id(cached)] = known
        weakref.finalize(tokenizer, _forget, id(cached), known.key)
        return cached


def _forget(llg_id: int, key: int) -> None:
    """A model tokenizer was freed: drop what was built from it. Runs wherever the last
    reference went (any thread, maybe under :data:`_tokenizers_lock`), so it takes no
    lock: a dict's ``pop`` is atomic, and the worker is told at its next exchange."""
    known = _known.get(llg_id)
    if known is not None and known.key == key:  # not a newer tokenizer at that address
        _known.pop(llg_id, None)
    compile_worker().forget(key)


def _serialized(hf: Any) -> str:
    """The tokenizer as llguidance.hf serializes it (with the added tokens of
    ``tokenizer_config.json``, which ``tokenizer.json`` may lack), without padding or
    truncation. Copying the Rust tokenizer to strip those holds the GIL longer than
    serializing it does, so it is copied only when it has either."""
    import transformers

    if not isinstance(hf, transformers.PreTrainedTokenizerFast):
        raise ValueError("Only fast tokenizers are supported")  # as llguidance.hf says
    backend = hf.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
    text: str = backend.to_str()
    return text


def _validate(grammar: str, tokenizer: LLTokenizer) -> tuple[bool, tuple[str, ...]]:
    """The verdict on a grammar text, reached in the compile worker."""
    known = _known.get(id(tokenizer))
    if known is None:  # a tokenizer made elsewhere (tests): the worker compiles without it
        return compile_worker().validate(grammar, None, None)
    return compile_worker().validate(grammar, known.key, known.source)


class _CompileCache:
    """Compile verdicts by source text: agents resend the same tools every turn. A text
    that killed or overran the compile worker is remembered as such too, so a client
    repeating it costs one worker restart, not one per request."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._items: OrderedDict[tuple[int, str], tuple[bool, tuple[str, ...]] | str] = (
            OrderedDict())
        self._lock = threading.Lock()

    def validate(self, grammar: str, tokenizer: LLTokenizer) -> tuple[bool, tuple[str, ...]]:
        known = _known.get(id(tokenizer))
        # A tokenizer made elsewhere (tests) is known by its id, negated apart from keys.
        key = (known.key if known is not None else -id(tokenizer), grammar)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
        if isinstance(hit, str):
            raise CompileFailed(hit)
        if hit is not None:
            return hit
        result: tuple[bool, tuple[str, ...]] | str
        try:
            result = _validate(grammar, tokenizer)
        except CompileFailed as exc:
            result = str(exc)
        with self._lock:
            self._items[key] = result
            if len(self._items) > self._size:
                self._items.popitem(last=False)
        if isinstance(result, str):
            raise CompileFailed(result)
        return result


_cache = _CompileCache()


def _prototype(tokenizer: LLTokenizer, text: str) -> LLMatcher:
    """One unused matcher per grammar, copied for each request that needs one.

    Eight concurrent json_schema requests used to spend ~20 ms of CPU building matchers
    before the first token (the same grammar each time, as agents resend their tools).
    A prototype is never advanced, so its copies start where a new matcher does. They are
    kept with their tokenizer's entry, which goes with its model: a matcher holds its
    tokenizer, so a cache of its own would keep unloaded models' tokenizers.
    """
    known = _known.get(id(tokenizer))
    if known is None:  # a tokenizer made elsewhere (tests): nothing to keep it with
        return LLMatcher(tokenizer, text, log_level=0)
    with _tokenizers_lock:
        found = known.prototypes.get(text)
        if found is not None:
            known.prototypes.move_to_end(text)
            return found
    made = LLMatcher(tokenizer, text, log_level=0)
    with _tokenizers_lock:
        known.prototypes[text] = made
        if len(known.prototypes) > _PROTOTYPES:
            known.prototypes.popitem(last=False)
    return made


_ARGUMENTS = ("properties", "arguments")  # where a call's grammar holds the parameters


def _grammar_copy(schema: dict[str, Any], embedded: bool = False) -> dict[str, Any]:
    """The grammar's copy of a client's schema (closed; re-rooted under a call's
    arguments when ``embedded``), cached by the schema's text: the walk is pure Python
    on the request path, and agents resend the same schemas with every request."""
    try:  # key order kept: it is the order the grammar generates keys in
        text = json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError):  # not plain JSON data: llguidance will say so
        return _transformed(schema, embedded)
    return _cached_copy(text, embedded)


@functools.lru_cache(maxsize=256)
def _cached_copy(text: str, embedded: bool) -> dict[str, Any]:
    return _transformed(json.loads(text), embedded)


def _transformed(schema: dict[str, Any], embedded: bool) -> dict[str, Any]:
    copy = closed(schema)
    return reroot(copy, _ARGUMENTS) if embedded else copy


def _with_options(schema: dict[str, Any], lenient: bool) -> dict[str, Any]:
    return with_options(schema, lenient)


def _compile(
    build: Any, tokenizer: LLTokenizer, *, param: str, what: str
) -> Grammar:
    """Compile strict, else lenient (downgraded), else reject as the client's error."""
    try:
        strict_text: str | None = LLMatcher.grammar_from_lark(build(False))
    except Inexact:  # the family's format cannot express a keyword: lenient, downgraded
        strict_text = None
    messages: Sequence[str] = ()
    try:
        if strict_text is not None:
            is_error, messages = _cache.validate(strict_text, tokenizer)
            if not is_error and not messages:
                return Grammar(strict_text, tokenizer, downgraded=False, param=param,
                               what=what)
        lenient_text = LLMatcher.grammar_from_lark(build(True))
        lenient_error, lenient_messages = _cache.validate(lenient_text, tokenizer)
    except CompileFailed as exc:
        raise InvalidRequestError(
            f"The {what} cannot be used: {exc}.", code="invalid_schema", param=param
        ) from None
    if lenient_error:
        detail = (lenient_messages or messages or ("unknown error",))[0]
        raise InvalidRequestError(
            f"The {what} cannot be used: {detail.strip().splitlines()[0]}",
            code="invalid_schema",
            param=param,
        )
    return Grammar(
        lenient_text, tokenizer, downgraded=True, warnings=tuple(lenient_messages or messages),
        param=param, what=what,
    )


def json_schema_grammar(
    tokenizer: LLTokenizer,
    schema: dict[str, Any] | None,
    *,
    thinking: Thinking | None,
    param: str,
    syntax: CallGrammar | None = None,
) -> Grammar:
    """Output that is one JSON value matching ``schema`` (an object when None), framed as
    the model's family frames an answer (after its thinking; harmony: on ``final``)."""
    base = _grammar_copy(schema) if schema is not None else {"type": "object"}
    frame = syntax.frame if syntax is not None else Frame()

    def build(lenient: bool) -> str:
        b = Build(tokenizer, lenient)
        prefix = frame.prefix(b, thinking)
        answer = frame.answer(b, base)
        return "\n".join([f"start: {prefix}{answer}", *b.rules.lines])

    return _compile(build, tokenizer, param=param, what="JSON schema")


def text_grammar(
    tokenizer: LLTokenizer, thinking: Thinking, syntax: CallGrammar | None = None
) -> Grammar:
    """Free text after an optional thinking block: only there to bound the thinking
    (``thinking.budget``), which no other grammar of the turn would."""
    frame = syntax.frame if syntax is not None else Frame()

    def build(lenient: bool) -> str:
        b = Build(tokenizer, lenient)
        prefix = frame.prefix(b, thinking)
        text = frame.text(b)
        return "\n".join([f"start: {prefix}{text}?", *b.rules.lines])

    return _compile(build, tokenizer, param="thinking", what="thinking budget")


def tool_grammar(
    tokenizer: LLTokenizer,
    tools: Sequence[ToolSchema],
    *,
    start: str,
    end: str,
    required: bool,
    parallel: bool,
    thinking: Thinking | None,
    answer_schema: dict[str, Any] | None = None,
    syntax: CallGrammar | None = None,
) -> Grammar:
    """Calls in the family's markup (``syntax``; by default Hermes-style JSON between
    ``start`` and ``end``).

    ``required``: the turn is one or more calls (after optional thinking); otherwise free
    text, optionally followed by calls whose arguments obey their schemas — or, with
    ``answer_schema`` (a ``response_format``), either calls or a JSON answer.
    """
    family = syntax if syntax is not None else JsonObjectCalls(start, end)
    frame = family.frame
    # Each call's parameters are the grammar's closed copy; a family that embeds them in
    # a larger object re-roots their pointers there itself.
    copies = [Tool(tool.name, _grammar_copy(tool.parameters or {"type": "object"}))
              if not tool.custom
              else Tool(tool.name, kept_patterns(_grammar_copy(tool.parameters)))
              for tool in tools]
    answer = _grammar_copy(answer_schema) if answer_schema is not None else None

    def build(lenient: bool) -> str:
        b = Build(tokenizer, lenient)
        prefix = frame.prefix(b, thinking)
        calls = family.calls(b, copies, parallel)
        if required:
            body = calls
        elif answer is not None:
            body = f"{frame.answer(b, answer)} | {calls}"
        else:
            body = family.text_or_calls(b, calls)
        return "\n".join([f"start: {prefix}{body}", *b.rules.lines])

    try:
        return _compile(build, tokenizer, param="tools", what="tool schema")
    except InvalidRequestError as exc:
        # Name the tool whose schema failed, when one alone does.
        for tool in tools:
            single = tool_grammar_probe(tokenizer, tool)
            if single is not None:
                raise InvalidRequestError(
                    f"The parameters schema of tool '{tool.name}' cannot be used: {single}",
                    code="invalid_schema",
                    param=tool.param,
                ) from None
        raise exc


def tool_grammar_probe(tokenizer: LLTokenizer, tool: ToolSchema) -> str | None:
    """The error that one tool's parameters schema alone causes, if any."""
    text = LLMatcher.grammar_from_json_schema(
        _grammar_copy(tool.parameters or {"type": "object"}),
        defaults={"whitespace_flexible": False, "lenient": True},
    )
    try:
        is_error, messages = _cache.validate(text, tokenizer)
    except CompileFailed as exc:
        return f"{exc}."
    if is_error:
        return _one_line((messages or ("invalid schema",))[0])
    return None


def _one_line(message: str) -> str:
    """llguidance's message in one line: a regex error's first line only announces it
    ("regex parse error:"), then quotes the pattern; what is wrong is on its last."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[-1].removeprefix('error: ')}"
    return lines[0] if lines else message


__all__ = [
    "Grammar",
    "ToolSchema",
    "json_schema_grammar",
    "llg_tokenizer",
    "text_grammar",
    "tool_grammar",
]
