"""The stand-in's "framework": a scripted model on threads of its own, as Swift's is.

It plays the parts of Apple's framework the SDK talks to: availability, token counts,
sessions answering on a native thread (a response through a callback, a stream through a
queue of snapshots), tools called from that thread through the SDK's callback (which, with
no event loop on a native thread, runs ``Tool.call`` on a new thread with a new loop, as
the real SDK does), cancellation, and the framework's errors.

What the model answers is scripted by lines of the prompt that start with ``!`` (for a
prompt that is empty, as after tool outputs, the model reads the tool outputs instead):

``!say TEXT``          the answer (several lines: joined by newlines)
``!words N``           ``w0 w1 … w{N-1}``
``!call NAME JSON``    call a tool (several lines: parallel calls, dispatched together);
                       the answer then reports each output (``NAME said OUTPUT``)
``!json JSON``         a structured answer (checked against the schema), or text
``!raise CLASS [MSG]`` raise one of the SDK's errors (``RefusalError`` too)
``!echo``              the answer is the JSON of what the model was given
``!delay MS``          wait between snapshots
``!sample``            words drawn by the sampling the framework was given (greedy: the
                       same every time; random: by its seed, or unseeded)

Without any, the answer is ``!sample``'s. Tokens are whitespace-led words; snapshots grow
one token at a time; ``maximum_response_tokens`` cuts the answer there.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import errors
from .generation_schema import GeneratedContent

_TOKEN = re.compile(r"\s*\S+")
_WORDS = ("apple", "orchard", "silicon", "river", "lantern", "meadow", "cobalt", "harbor",
          "quartz", "willow", "ember", "summit", "falcon", "prism", "cedar", "nova")
#: The keywords Apple's encoded schemas use: the decoder of the stand-in takes no other.
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "x-order", "title", "description",
    "additionalProperties", "$defs", "$ref", "items", "minItems", "maxItems", "enum",
    "anyOf", "minimum", "maximum", "pattern"})
_TYPES = ("object", "string", "integer", "number", "boolean", "array")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


@dataclass
class State:
    """What tests set (in process) or the environment says (a server process)."""

    availability: str | None = field(
        default_factory=lambda: os.environ.get("AFM_STANDIN_UNAVAILABLE") or None)
    context_size: int = 4096  # the window Apple documents for the on-device model
    max_concurrent: int = field(
        default_factory=lambda: int(os.environ.get("AFM_STANDIN_MAX_CONCURRENT", "64")))
    images_supported: bool = True
    #: Every generation's inputs, as the framework got them (in-process tests read it).
    log: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


STATE = State()


@dataclass
class Job:
    instructions: str | None
    entries: list[dict[str, Any]]
    prompt: list[Any]  # str and ImageAttachment
    tools: list[Any]
    options: dict[str, Any]
    schema: dict[str, Any] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    responding: threading.Event = field(default_factory=threading.Event)

    @property
    def prompt_text(self) -> str:
        return "".join(p for p in self.prompt if isinstance(p, str))

    def seen(self) -> dict[str, Any]:
        return {
            "instructions": self.instructions,
            "entries": self.entries,
            "prompt": self.prompt_text,
            "images": [len(p.data) for p in self.prompt if not isinstance(p, str)],
            "tools": {t.name: {"description": t.description,
                               "arguments": t._arguments_schema.to_dict()} for t in self.tools},
            "options": self.options,
            "schema": self.schema,
        }


class Cancelled(Exception):
    """The native task was cancelled."""


def directives(text: str) -> list[tuple[str, str]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("!"):
            head, _, rest = line[1:].partition(" ")
            out.append((head, rest.strip()))
    return out


def _refused(detail: str) -> errors.GenerationError:
    """A schema the framework's ``JSONDecoder`` refuses, as the SDK reports it:
    ``FMLanguageModelSessionRespondWithSchemaFromJSON`` (apple-fm-sdk 0.2.1) catches the
    decoding error as an unknown one (status 255), a plain ``GenerationError``."""
    return errors.GenerationError(
        f"Generation error (status: 255): Error NSCocoaErrorDomain:4864 - {detail}")


def check_schema(schema: Any, where: str = "schema") -> None:
    """The framework's decoder of a schema (``GenerationSchema`` JSON): Apple's subset."""
    if not isinstance(schema, dict):
        raise _refused(f"{where} is not an object")
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS:
            raise _refused(f"unsupported keyword {key!r} at {where}")
        if key == "type" and value not in _TYPES:
            raise _refused(f"unsupported type {value!r} at {where}")
        if key == "additionalProperties" and value is not False:
            raise _refused(f"additionalProperties must be false at {where}")
        if key == "$ref" and not (value == "#" or str(value).startswith("#/$defs/")):
            raise _refused(f"bad $ref at {where}")
        if key in ("properties", "$defs"):
            for name, sub in value.items():
                check_schema(sub, f"{where}.{key}.{name}")
        elif key == "items":
            check_schema(value, f"{where}.items")
        elif key == "anyOf":
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}.anyOf[{i}]")
        elif key == "enum" and not all(isinstance(v, str) for v in value):
            raise _refused(f"non-string enum at {where}")


def conforms(value: Any, schema: dict[str, Any]) -> str | None:
    import jsonschema

    try:
        jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)
    except jsonschema.ValidationError as exc:
        return exc.message
    return None


def synthesize(schema: dict[str, Any], root: dict[str, Any], depth: int = 0) -> Any:
    """A value of the schema, as a constrained decoder would surely produce one."""
    if "$ref" in schema:
        ref = schema["$ref"]
        target = root if ref == "#" else root["$defs"][ref.rsplit("/", 1)[-1]]
        return synthesize(target, root, depth + 1) if depth < 12 else {}
    if "anyOf" in schema:
        return synthesize(schema["anyOf"][0], root, depth + 1)
    kind = schema.get("type")
    if kind == "object":
        required = set(schema.get("required", []))
        return {k: synthesize(v, root, depth + 1) for k, v in schema.get("properties", {}).items()
                if k in required}
    if kind == "array":
        count = max(schema.get("minItems", 1), 0) if depth < 6 else schema.get("minItems", 0)
        return [synthesize(schema.get("items", {"type": "string"}), root, depth + 1)
                for _ in range(count)]
    if kind == "string":
        return schema["enum"][0] if schema.get("enum") else "text"
    if kind in ("integer", "number"):
        low = schema.get("minimum", 0)
        return int(low) if kind == "integer" else float(low)
    if kind == "boolean":
        return True
    return "text"


def sampled(options: dict[str, Any]) -> str:
    sampling = options.get("sampling")
    if sampling is not None and sampling["mode"] == "greedy":
        return "apple orchard silicon river"
    seed = sampling.get("seed") if sampling else None
    rng = random.Random(seed) if seed is not None else random.Random()
    return " ".join(rng.choice(_WORDS) for _ in range(8))


def invoke_tool(tool: Any, arguments: dict[str, Any],
                entered: threading.Event | None = None) -> str:
    """A tool called from a native thread, as the SDK's C callback does it: no event loop
    runs here, so the tool's coroutine runs on a new thread with a new loop; the native
    side waits for its output (``FMBridgedToolFinishCall``). ``entered`` is set once the
    coroutine has run up to its first wait."""
    done = threading.Event()
    result: list[str] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            task = loop.create_task(tool.call(GeneratedContent(arguments)))
            if entered is not None:
                loop.call_soon(entered.set)  # runs after the task's first step
            output = loop.run_until_complete(task)
            result.append(output if isinstance(output, str) else str(output))
        except Exception as exc:
            result.append(f"Tool error: {exc}")
        finally:
            loop.close()
            done.set()

    threading.Thread(target=run, daemon=True).start()
    done.wait()
    return result[0]


def run(job: Job, on_snapshot: Any = None) -> Any:
    """Generate (blocking, on a native thread): the answer's text, or its structured value
    as ``GeneratedContent``; snapshots to ``on_snapshot`` when streaming."""
    with STATE.lock:
        if STATE.active >= STATE.max_concurrent:
            raise errors.make(errors.ConcurrentRequestsError, "too many sessions responding")
        STATE.active += 1
    job.responding.set()
    try:
        STATE.log.append(job.seen())
        return _generate(job, on_snapshot)
    finally:
        with STATE.lock:
            STATE.active -= 1
        job.responding.clear()


def _generate(job: Job, on_snapshot: Any) -> Any:
    text = job.prompt_text
    script = directives(text)
    if not text.strip() and job.entries:
        last_user = next((e for e in reversed(job.entries) if e["role"] == "user"), None)
        script = [d for d in directives(_entry_text(last_user) if last_user else "")
                  if d[0] in ("raise", "delay")]
    read = tokens((job.instructions or "") + " " + " ".join(_entry_text(e) for e in job.entries)
                  + " " + text)
    if len(read) > STATE.context_size:
        raise errors.make(errors.ExceededContextWindowSizeError,
                          f"{len(read)} tokens exceed {STATE.context_size}")
    delay = 0.0
    for head, rest in script:
        if head == "delay":
            delay = float(rest) / 1000
        if head == "raise":
            name, _, message = rest.partition(" ")
            cls = getattr(errors, name)
            raise errors.make(cls, message or name)
    calls = [(rest.partition(" ")[0], rest.partition(" ")[2]) for head, rest in script
             if head == "call"]
    answer: str | None = None
    if calls:
        answer = _call_tools(job, calls)
    says = [rest for head, rest in script if head == "say"]
    if says:
        answer = "\n".join(says)
    scripted = next((rest for head, rest in script if head == "json"), None)
    if job.schema is not None:
        value = json.loads(scripted) if scripted is not None else synthesize(job.schema,
                                                                             job.schema)
        problem = conforms(value, job.schema)
        if problem is not None:
            raise errors.make(errors.DecodingFailureError, f"scripted value: {problem}")
        _wait(job, delay)
        return GeneratedContent(value)
    if answer is None:
        if any(head == "echo" for head, _ in script):
            answer = json.dumps(job.seen())
        elif any(head == "words" for head, _ in script):
            n = int(next(rest for head, rest in script if head == "words"))
            answer = " ".join(f"w{i}" for i in range(n))
        elif scripted is not None:
            answer = scripted
        elif not text.strip() and job.entries and job.entries[-1]["role"] == "tool":
            outputs = []
            for entry in reversed(job.entries):
                if entry["role"] != "tool":
                    break
                outputs.insert(0, f"{entry['toolName']} said {_entry_text(entry)}")
            answer = "; ".join(outputs)
        else:
            answer = sampled(job.options)
    pieces = tokens(answer)
    limit = job.options.get("maximum_response_tokens")
    if limit is not None:
        pieces = pieces[:limit]
    if on_snapshot is not None:
        for i in range(len(pieces)):
            _wait(job, delay)
            on_snapshot("".join(pieces[: i + 1]))
    else:
        _wait(job, delay * len(pieces))
    return "".join(pieces)


def _wait(job: Job, seconds: float) -> None:
    if job.cancelled.wait(seconds) or job.cancelled.is_set():
        raise Cancelled()


def _call_tools(job: Job, calls: list[tuple[str, str]]) -> str:
    by_name = {t.name: t for t in job.tools}
    outputs: list[str | None] = [None] * len(calls)
    threads = []
    for i, (name, raw) in enumerate(calls):
        tool = by_name.get(name)
        if tool is None:
            raise errors.ToolCallError(name, KeyError(f"no tool {name!r} in the session"))
        arguments = json.loads(raw or "{}")
        problem = conforms(arguments, tool._arguments_schema.to_dict())
        if problem is not None:
            raise errors.make(errors.DecodingFailureError,
                              f"scripted arguments of {name}: {problem}")

        entered = threading.Event()

        def call(i: int = i, tool: Any = tool, arguments: Any = arguments,
                 entered: threading.Event = entered) -> None:
            outputs[i] = invoke_tool(tool, arguments, entered)

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        threads.append(thread)
        # The model writes its calls one after another: the next is made once this one's
        # tool has begun (a fixed pause lost the order on a loaded machine).
        entered.wait(5)
    for thread in threads:
        while thread.is_alive():
            thread.join(0.01)
            if job.cancelled.is_set():
                # A cancelled task still waits for its tools' outputs (a continuation
                # resumes only when the tool finishes), then ends.
                thread.join()
    if job.cancelled.is_set():
        raise Cancelled()
    return "; ".join(f"{name} said {out}" for (name, _), out in zip(calls, outputs,
                                                                   strict=True))


def _entry_text(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return ""
    return " ".join(c.get("text", "") for c in entry.get("contents", [])
                    if isinstance(c, dict))


def count(text: str) -> int:
    return len(tokens(text))


def sleep_cancellable(job: Job, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if job.cancelled.is_set():
            raise Cancelled()
        time.sleep(0.005)
