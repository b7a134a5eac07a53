"""``SystemLanguageModel``, ``LanguageModelSession``, ``Transcript`` and ``Tool`` as
apple-fm-sdk 0.2.1 has them (signatures, availability, sessions, transcripts, tools, how
``respond`` and ``stream_response`` wait and cancel), over the stand-in's native model."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import queue
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from enum import IntEnum
from typing import Any

from . import errors, native
from .generation_options import GenerationOptions, native_options
from .generation_schema import GeneratedContent, GenerationSchema
from .prompt import Prompt, _composed_prompt_from_prompt


class SystemLanguageModelUnavailableReason(IntEnum):
    APPLE_INTELLIGENCE_NOT_ENABLED = 0
    DEVICE_NOT_ELIGIBLE = 1
    MODEL_NOT_READY = 2
    UNKNOWN = 0xFF


class SystemLanguageModelUseCase(IntEnum):
    GENERAL = 0
    CONTENT_TAGGING = 1


class SystemLanguageModelGuardrails(IntEnum):
    DEFAULT = 0
    PERMISSIVE_CONTENT_TRANSFORMATIONS = 1


class SystemLanguageModel:
    def __init__(self, use_case: SystemLanguageModelUseCase = SystemLanguageModelUseCase.GENERAL,
                 guardrails: SystemLanguageModelGuardrails =
                 SystemLanguageModelGuardrails.DEFAULT, _ptr: Any = None) -> None:
        self.use_case = use_case
        self.guardrails = guardrails

    def is_available(self) -> tuple[bool, SystemLanguageModelUnavailableReason | None]:
        reason = native.STATE.availability
        if reason is None:
            return True, None
        return False, SystemLanguageModelUnavailableReason[reason.upper()]

    @property
    def context_size(self) -> int:
        return native.STATE.context_size

    async def token_count(self, value: Any = None, *, instructions: str | None = None) -> int:
        await asyncio.sleep(0)  # answered through a callback, as the framework's
        if instructions is not None:
            if value is not None:
                raise ValueError("Provide either a value or instructions to token_count(), "
                                 "not both")
            return native.count(instructions)
        if value is None:
            raise ValueError("token_count() requires either a value or instructions")
        if isinstance(value, GenerationSchema):
            return native.count(json.dumps(value.to_dict()))
        if isinstance(value, Transcript):
            entries = value.entries
            return native.count(" ".join(native._entry_text(e) for e in entries))
        if isinstance(value, list) and all(isinstance(t, Tool) for t in value):
            return native.count(" ".join(json.dumps(t._arguments_schema.to_dict())
                                         for t in value))
        return native.count(" ".join(p for p in _composed_prompt_from_prompt(value)
                                     if isinstance(p, str)))


_ROLES = ("instructions", "user", "response", "tool")


def _check_entry(entry: Any, i: int) -> None:
    """What the framework's ``Transcript`` decoder requires of an entry (a failure is
    ``DecodingFailureError``, as ``FMTranscriptCreateFromJSONString`` reports it)."""
    where = f"entries[{i}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
        raise errors.make(errors.DecodingFailureError, f"{where}: an entry needs a string id")
    role = entry.get("role")
    if role not in _ROLES:
        raise errors.make(errors.DecodingFailureError, f"{where}: unknown role {role!r}")
    contents = entry.get("contents")
    if role == "response" and "toolCalls" in entry:
        # Transcript.ToolCalls: the framework encodes it as id, role and toolCalls only
        # (apple-fm-sdk 0.2.1, tests/tester_schemas/test_transcript_full.json); whether its
        # decoder keeps a response's text beside the calls is unknown: refused here.
        if contents is not None or "assets" in entry:
            raise errors.make(errors.DecodingFailureError,
                              f"{where}: tool calls with a response's contents")
    elif contents is None:
        raise errors.make(errors.DecodingFailureError, f"{where}: missing contents")
    for j, content in enumerate(contents or []):
        if not isinstance(content, dict) or not isinstance(content.get("id"), str):
            raise errors.make(errors.DecodingFailureError,
                              f"{where}.contents[{j}]: needs a string id")
        if content.get("type") == "text" and not isinstance(content.get("text"), str):
            raise errors.make(errors.DecodingFailureError,
                              f"{where}.contents[{j}]: text must be a string")
        if content.get("type") not in ("text", "structure"):
            raise errors.make(errors.DecodingFailureError,
                              f"{where}.contents[{j}]: unknown type")
    if role == "tool" and not (isinstance(entry.get("toolName"), str)
                               and isinstance(entry.get("toolCallID"), str)):
        raise errors.make(errors.DecodingFailureError,
                          f"{where}: a tool entry needs toolName and toolCallID")
    for call in entry.get("toolCalls") or []:
        if not all(isinstance(call.get(k), str) for k in ("id", "name", "arguments")):
            raise errors.make(errors.DecodingFailureError,
                              f"{where}: a tool call needs id, name, arguments "
                                         "(a JSON string)")
        json.loads(call["arguments"])
    if role == "instructions" and i != 0:
        raise errors.make(errors.DecodingFailureError, f"{where}: instructions come first")


class Transcript:
    def __init__(self, _ptr: Any) -> None:
        self.session_ptr = _ptr  # here: the entries themselves

    @property
    def entries(self) -> list[dict[str, Any]]:
        return self.session_ptr

    async def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "type": "FoundationModels.Transcript",
                "transcript": {"entries": copy.deepcopy(self.session_ptr)}}

    @classmethod
    async def from_dict(cls, dict: dict[str, Any]) -> Transcript:  # the SDK's parameter name
        await asyncio.sleep(0)
        if not isinstance(dict, type({})) or not isinstance(dict.get("transcript"), type({})):
            raise errors.make(errors.DecodingFailureError,
                              "Failed to create transcript from dictionary")
        entries = dict["transcript"].get("entries")
        if not isinstance(entries, list):
            raise errors.make(errors.DecodingFailureError,
                              "Failed to create transcript from dictionary")
        for i, entry in enumerate(entries):
            _check_entry(entry, i)
        return cls(_ptr=copy.deepcopy(entries))


class Tool(ABC):
    name: str
    description: str

    @property
    @abstractmethod
    def arguments_schema(self) -> GenerationSchema: ...

    @abstractmethod
    async def call(self, args: GeneratedContent) -> str: ...

    def __init__(self) -> None:
        self._verify_subclass_()
        self._arguments_schema = self.arguments_schema
        self._arguments_schema.to_dict()  # FMBridgedToolCreate builds it: errors now

    def _verify_subclass_(self) -> None:
        assert hasattr(self, "name"), "Tool subclass must have a 'name' property."
        assert hasattr(self, "description"), "Tool subclass must have a 'description' property."
        assert hasattr(self, "arguments_schema"), \
            "Tool subclass must have an 'arguments_schema' property."
        assert hasattr(self, "call"), "Tool subclass must implement the 'call' method."
        if not isinstance(self.name, str):
            raise TypeError("Tool name must be a string.")
        if not isinstance(self.description, str):
            raise TypeError("Tool description must be a string.")
        if not isinstance(self.arguments_schema, GenerationSchema):
            raise TypeError("Tool arguments_schema must be a GenerationSchema instance.")
        if not asyncio.iscoroutinefunction(self.call):
            raise TypeError("Tool call method must be an async function.")


def _id() -> str:
    return str(uuid.uuid4()).upper()


class LanguageModelSession:
    def __init__(self, instructions: str | None = None,
                 model: SystemLanguageModel | None = None, tools: list[Tool] | None = None,
                 _ptr: Any = None) -> None:
        self._model = model or SystemLanguageModel()
        self._tools = list(tools or [])
        self._request_lock = threading.Lock()
        self._job: native.Job | None = None
        if _ptr is None:
            entry: dict[str, Any] = {"id": _id(), "role": "instructions", "contents": (
                [{"type": "text", "id": _id(), "text": instructions}] if instructions else [])}
            _ptr = [entry]
        self.transcript = Transcript(_ptr)

    @classmethod
    def from_transcript(cls, transcript: Transcript, model: SystemLanguageModel | None = None,
                        tools: list[Tool] | None = None) -> LanguageModelSession:
        return cls(model=model, tools=tools, _ptr=transcript.session_ptr)

    @property
    def is_responding(self) -> bool:
        job = self._job
        return job is not None and job.responding.is_set()

    def _job_for(self, prompt: list[Any], options: GenerationOptions | None,
                 schema: dict[str, Any] | None) -> native.Job:
        """``prompt``: as composed (:func:`~.prompt._composed_prompt_from_prompt`)."""
        if options is not None and not isinstance(options, GenerationOptions):
            raise TypeError("options must be GenerationOptions")
        # The SDK sends options as JSON; the Swift side reads them (numbers only).
        sent = json.loads(json.dumps(options.to_dict())) if options is not None else None
        entries = self.transcript.entries
        first = entries[0] if entries and entries[0]["role"] == "instructions" else None
        instructions = native._entry_text(first) if first else None
        return native.Job(instructions=instructions or None,
                          entries=[e for e in entries if e is not first],
                          prompt=prompt, tools=self._tools,
                          options=native_options(sent), schema=schema)

    async def respond(self, prompt: Prompt, generating: Any = None, *,
                      schema: GenerationSchema | None = None,
                      json_schema: dict[str, Any] | None = None,
                      options: GenerationOptions | None = None) -> Any:
        if generating is not None or schema is not None:
            raise NotImplementedError("the stand-in answers json_schema and text only")
        if json_schema is not None:
            native.check_schema(json_schema)
        # The SDK composes the prompt here, in the coroutine: its errors reach the caller.
        job = self._job_for(_composed_prompt_from_prompt(prompt), options, json_schema)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any = None, error: BaseException | None = None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def work() -> None:
            try:
                result = native.run(job)
            except native.Cancelled:
                result, error = None, errors.GenerationError("Operation cancelled")
            except BaseException as exc:
                result, error = None, exc
            else:
                error = None
                self._record(job, result)
            with contextlib.suppress(RuntimeError):  # the loop is gone
                loop.call_soon_threadsafe(settle, result, error)

        with self._request_lock:
            self._job = job
        threading.Thread(target=work, daemon=True).start()
        try:
            return await future
        except asyncio.CancelledError:
            job.cancelled.set()
            waited = 0.0
            while self.is_responding and waited < 1.0:  # as the SDK polls is_responding
                await asyncio.sleep(0.01)
                waited += 0.01
            raise

    async def stream_response(self, prompt: Prompt,
                              options: GenerationOptions | None = None) -> AsyncIterator[str]:
        """As the SDK streams (``session.py`` ``_stream_response_basic``, apple-fm-sdk 0.2.1
        at e868e60): a thread composes the prompt and starts the native iteration, which
        runs detached (``FMLanguageModelSessionResponseStreamIterate`` starts a Swift task
        and returns) and feeds a queue that this generator reads with a blocking ``get``
        (0.1 s timeout) between yields. An error while composing (an image the OS cannot
        take) ends that thread without ending the stream: the generator then waits for
        ever, as the SDK's does. Closing the generator joins the thread (up to 2 s) and
        releases the stream, which cancels the iteration."""
        snapshots: queue.Queue[str | None] = queue.Queue()
        failure: list[BaseException] = []
        started: list[native.Job] = []

        def iterate(job: native.Job) -> None:
            try:
                text = native.run(job, on_snapshot=snapshots.put)
                self._record(job, text)
            except native.Cancelled:
                failure.append(errors.GenerationError("Stream cancelled"))
            except BaseException as exc:
                failure.append(exc)
            finally:
                snapshots.put(None)

        def start() -> None:
            job = self._job_for(_composed_prompt_from_prompt(prompt), options, None)
            started.append(job)
            self._job = job
            threading.Thread(target=iterate, args=(job,), daemon=True).start()

        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        try:
            while True:
                try:
                    snapshot = snapshots.get(timeout=0.1)
                except queue.Empty:
                    continue
                if snapshot is None:
                    break
                yield snapshot
            if failure:
                raise failure[0]
        finally:
            if thread.is_alive():
                thread.join(timeout=2.0)
            for job in started:  # FMRelease of the stream: its iteration is cancelled
                job.cancelled.set()

    def _record(self, job: native.Job, result: Any) -> None:
        entries = self.transcript.entries
        entries.append({"id": _id(), "role": "user", "options": {},
                        "contents": [{"type": "text", "id": _id(), "text": job.prompt_text}]})
        text = result.to_json() if isinstance(result, GeneratedContent) else str(result)
        entries.append({"id": _id(), "role": "response", "assets": [],
                        "contents": [{"type": "text", "id": "0", "text": text}]})
