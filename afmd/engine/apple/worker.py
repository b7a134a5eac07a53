"""Apple's model's generations: each on threads of its own, read back into engine events.

The SDK is asyncio code, but not all of it is the server's kind: its stream of snapshots
waits on a thread queue between snapshots, blocking whatever loop runs it, and a tool call
arrives on a framework thread with a loop of its own. So every generation's framework work
runs in a thread of its own with its own loop (:class:`_Session`), and a controller on the
server's loop (:class:`_Job`) reads what it reports: text snapshots (the full text so far)
become :class:`~afmd.engine.generation.Text` deltas, structured answers (``json_schema``, forced
calls) one text or :class:`~afmd.engine.generation.ToolCalled` events, the client's tool calls
are collected for ``tool_call_debounce`` after the latest one (or at once when
``parallel_tool_calls`` is false) and then end the turn, a refusal is a
:class:`~afmd.engine.generation.Refused`, and the framework's errors are afmd's
(:mod:`afmd.engine.apple.failures`). A cancel (the client's, a stop sequence, the deadline,
a shutdown) ends the generation at once; the framework is stopped behind it.

Usage is the framework's count of tokens where it gives one (``token_count``, apple-fm-sdk
0.2.1 and later), else an estimate of a token per four characters. With counts, a
conversation that cannot fit the context window with its ``max_tokens`` is refused before
anything is generated, and an answer whose count reaches ``max_tokens`` ended by ``length``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import aclosing
from pathlib import Path
from types import ModuleType
from typing import Any

from afmd.engine.apple import failures, framework, schemas
from afmd.engine.apple import fm_compat as compat
from afmd.engine.apple.conversation import SystemTurn, ToolDef
from afmd.engine.apple.tools import Capture, CapturedCall, framework_tools
from afmd.engine.generation import Finished, Generation, Refused, Text, ToolCalled
from afmd.errors import APIError, ContextLengthError, ServerError
from afmd.logs import get_logger

log = get_logger("afmd.engine.apple")

#: Characters per token where the framework gives no count (OpenAI's rule of thumb).
CHARS_PER_TOKEN = 4


def estimate(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN) if text else 0


class SystemWorker:
    """The generations of Apple's model under way (the engine's worker for it)."""

    cache_bytes = 0  # no prefix cache and no batch: the framework keeps its own state
    live_cache_bytes = 0

    def __init__(self, name: str, *, debounce: float) -> None:
        self.name = name
        self.debounce = debounce
        self._jobs: set[_Job] = set()
        self._lock = threading.Lock()

    def submit(self, generation: Generation) -> None:
        job = _Job(self, generation, asyncio.get_running_loop())
        with self._lock:
            self._jobs.add(job)
        job.start()

    def wake(self) -> None:
        """A generation was asked to stop (``Generation.cancel``): stop it."""
        for job in self._running():
            if job.generation.cancel_requested:
                job.cancel()

    def stop(self) -> None:
        """Stop every generation (the model is unloaded or the server stops); from any
        thread."""
        for job in self._running():
            job.cancel()

    def done(self, job: _Job) -> None:
        with self._lock:
            self._jobs.discard(job)

    def _running(self) -> list[_Job]:
        with self._lock:
            return list(self._jobs)

    def prompt_tokens(self, turn: SystemTurn) -> int:
        """What the conversation takes of the context window (blocking: the
        token-counting endpoints run it in a thread)."""
        return count_prompt(turn)[0]


def count_prompt(turn: SystemTurn) -> tuple[int, bool]:
    """(tokens, counted by the framework) of what the model reads (blocking)."""
    fm = framework.sdk()
    if fm is None:
        return estimate(turn.estimate_text()), False
    try:
        model = framework.system_model()
        if not hasattr(model, "token_count"):
            return estimate(turn.estimate_text()), False
        return asyncio.run(_count(fm, model, turn)), True
    except Exception as exc:  # an SDK without counts for some input: estimated
        log.debug("token count failed", error=str(exc))
        return estimate(turn.estimate_text()), False


async def _count(fm: ModuleType, model: Any, turn: SystemTurn) -> int:
    total = 0
    if turn.history:
        transcript = await fm.Transcript.from_dict(turn.transcript())
        total += await model.token_count(transcript)
    elif turn.instructions:
        total += await model.token_count(instructions=turn.instructions)
    if turn.tools:
        tools = framework_tools(fm, turn.tools, Capture(lambda call: None), None)
        total += await model.token_count(tools)
    if turn.prompt_text:
        total += await model.token_count(turn.prompt_text)
    schema = turn.forced.schema if turn.forced is not None else turn.answer_schema
    if schema is not None:
        total += estimate(json.dumps(schema))  # the SDK counts only its own schema objects
    return total


def count_completion(text: str) -> int:
    """The answer's tokens: the framework's count, else an estimate (blocking)."""
    fm = framework.sdk()
    if fm is not None and text:
        try:
            model = framework.system_model()
            if hasattr(model, "token_count"):
                return int(asyncio.run(model.token_count(text)))
        except Exception as exc:
            log.debug("token count failed", error=str(exc))
    return estimate(text)


class _Session:
    """One generation's framework side, on a thread of its own with its own event loop.

    It reports to its job through ``report(kind, payload)`` (thread-safe): ``snapshot``
    (the text so far), ``answer`` (a structured answer's JSON), ``text`` (a whole answer),
    ``done``, ``error``.
    """

    def __init__(self, fm: ModuleType, turn: SystemTurn, report: Any, capture: Capture,
                 run_server: Callable[[str, str], Future[str]] | None,
                 max_tokens: int | None) -> None:
        self.fm = fm
        self.turn = turn
        self.max_tokens = max_tokens
        self.report = report
        self.capture = capture
        self.run_server = run_server
        self.stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready = threading.Lock()
        self.thread = threading.Thread(target=self._main, name="afmd-system", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop the framework's work (its cancellation may take it a moment)."""
        with self._ready:
            self.stopped = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                loop.call_soon_threadsafe(task.cancel)

    def _main(self) -> None:
        try:
            asyncio.run(self._drive())
        except BaseException as exc:
            if not self.stopped and not isinstance(exc, asyncio.CancelledError):
                self.report("error", exc)

    async def _drive(self) -> None:
        with self._ready:
            if self.stopped:
                return
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
        folder = tempfile.mkdtemp(prefix="afmd-system-") if self.turn.images else None
        try:
            await self._generate(folder)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            if not self.stopped:
                self.report("error", exc)
        finally:
            if folder is not None:
                for name in os.listdir(folder):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))
                with contextlib.suppress(OSError):
                    os.rmdir(folder)

    async def _generate(self, folder: str | None) -> None:
        fm, turn = self.fm, self.turn
        model = framework.system_model()
        offered = turn.tools if turn.forced is None else ()
        try:
            tools = framework_tools(fm, offered, self.capture, self.run_server) if offered \
                else []
        except Exception as exc:  # a schema the framework would not build: the tools' fault
            raise _Failure("tools", exc) from None
        if turn.history:
            transcript = await fm.Transcript.from_dict(turn.transcript())
            session = fm.LanguageModelSession.from_transcript(transcript, model=model,
                                                              tools=tools or None)
        else:
            session = fm.LanguageModelSession(instructions=turn.instructions or None,
                                              model=model, tools=tools or None)
        prompt = self._prompt(folder)
        options = compat.options(fm, turn.sampling, self.max_tokens)
        schema = turn.forced.schema if turn.forced is not None else turn.answer_schema
        if schema is not None:
            content = await session.respond(prompt, json_schema=schema, options=options)
            if not self.stopped:
                self.report("answer", content.to_json())
            return
        if turn.json_object:
            text = await session.respond(prompt, options=options)
            if not self.stopped:
                self.report("text", text)
            return
        if not isinstance(prompt, str):
            compat.compose_check(fm, prompt)  # the stream would hang on its error
        async with aclosing(session.stream_response(prompt, options=options)) as stream:
            async for snapshot in stream:
                if self.stopped:
                    return
                self.report("snapshot", snapshot)
                await asyncio.sleep(0)  # a cancel gets its turn between snapshots
        if not self.stopped:
            self.report("done", None)

    def _prompt(self, folder: str | None) -> Any:
        """The prompt as the SDK takes it: a string, or text and image attachments."""
        if folder is None:
            return self.turn.prompt_text
        parts: list[Any] = []
        for n, part in enumerate(self.turn.prompt):
            if isinstance(part, str):
                if part:
                    parts.append(part)
                continue
            path = Path(folder) / f"image-{n}"
            path.write_bytes(part.data)
            try:
                parts.append(self.fm.ImageAttachment(path))
            except Exception as exc:
                raise _Failure(part.param, exc) from None
        return parts


class _Failure(Exception):
    """A framework error about one part of the request: the param it is about."""

    def __init__(self, param: str, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.param = param
        self.error = exc


class _Job:
    """One generation's controller, on the server's loop."""

    def __init__(self, worker: SystemWorker, generation: Generation,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.generation = generation
        self.loop = loop
        self.turn: SystemTurn = generation.request.conversation
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._session: _Session | None = None
        self._capture = Capture(lambda call: self._report("call", call))
        self._calls: list[CapturedCall] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sent = ""  # the text delivered so far
        self._prompt_tokens = 0
        self._max_tokens = self.turn.max_tokens  # the response's limit
        self._started = time.perf_counter()
        self._first: float | None = None
        self._ended = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        # Held here (the worker holds the job until it is done): the loop keeps only a
        # weak reference to a task.
        self._task = self.loop.create_task(self._run())

    def cancel(self) -> None:
        """From any thread."""
        self._report("cancel", None)

    def _report(self, kind: str, payload: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(self._queue.put_nowait, (kind, payload))

    # -- the run --
    async def _run(self) -> None:
        try:
            fm = framework.sdk()
            found = framework.availability()
            if fm is None or found.reason is not None:
                raise framework.unavailable_error(self.worker.name, found)
            tokens, counted = await asyncio.to_thread(count_prompt, self.turn)
            self._prompt_tokens = tokens
            if self.generation.cancel_requested:
                return self._end("cancelled")
            if counted:
                self._max_tokens = self._fit(tokens)
            if self._max_tokens == 0:  # nothing to write, and the framework keeps no
                return self._end("length")  # prefix cache a prompt alone could fill
            self._session = _Session(fm, self.turn, self._report, self._capture,
                                     self._server_runner(), self._max_tokens)
            self._session.start()
            while not self._ended:
                kind, payload = await self._queue.get()
                await self._handle(fm, kind, payload)
        except APIError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug of ours: the request fails, the server goes on
            log.exception("system model generation failed")
            self._fail(ServerError(f"The system model failed: {type(exc).__name__}: {exc}",
                                   code="generation_failed"))
        finally:
            self._stop_framework()
            self.worker.done(self)

    async def _handle(self, fm: ModuleType, kind: str, payload: Any) -> None:
        if kind == "cancel":
            self._end("cancelled")
        elif kind == "snapshot":
            self._snapshot(payload)
        elif kind == "call":
            self._calls.append(payload)
            if not self.turn.parallel_calls:
                self._end_with_calls()
            else:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = self.loop.call_later(self.worker.debounce, self._report,
                                                   "collected", None)
        elif kind == "collected":
            self._end_with_calls()
        elif kind == "answer":
            self._answer(payload)
            await self._finish()
        elif kind == "text":
            self._deliver(_json_object(payload))
            await self._finish()
        elif kind == "done":
            await self._finish()
        elif kind == "error":
            self._error(fm, payload)

    def _fit(self, tokens: int) -> int | None:
        """The response's limit once the prompt is counted: ``max_tokens``, lowered to the
        room left where it is only a cap; 400 ``context_length_exceeded`` when the prompt
        leaves no room, or not the room a demanded ``max_tokens`` needs, worded as the MLX
        models' refusal (``round_builder``) for the clients that read the wording."""
        limit = framework.context_length()
        wanted = self.turn.max_tokens
        room = limit - tokens
        if wanted is not None and self.turn.max_tokens_shrinks and room >= 1:
            return min(wanted, room)
        if tokens + (wanted or 1) <= limit:
            return wanted
        # A ContextLengthError carries its numbers, which each dialect words its own way
        # (Anthropic's "prompt is too long", the phrase Claude Code compacts on).
        if wanted is not None and not self.turn.max_tokens_shrinks and tokens < limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {tokens + wanted} tokens ({tokens} in the messages, {wanted} in "
                "the completion). Please reduce the length of the messages or completion.",
                prompt_tokens=tokens, limit=limit)
        raise ContextLengthError(
            f"Input tokens exceed the configured limit of {limit} tokens. Your messages "
            f"resulted in {tokens} tokens. Please reduce the length of the messages.",
            prompt_tokens=tokens, limit=limit)

    def _server_runner(self) -> Callable[[str, str], Future[str]] | None:
        run_tool = self.generation.request.run_tool
        if run_tool is None:
            return None
        loop = self.loop

        def run(name: str, arguments: str) -> Future[str]:
            return asyncio.run_coroutine_threadsafe(run_tool(name, arguments), loop)

        return run

    # -- output --
    def _snapshot(self, text: str) -> None:
        if text.startswith(self._sent):
            self._deliver(text[len(self._sent):])
        # A snapshot that rewrote text already sent cannot unsend it: only what follows
        # the text sent is new (the framework's snapshots of plain text only grow).

    def _deliver(self, text: str) -> None:
        if not text or self._ended:
            return
        if self._first is None:
            self._first = time.perf_counter()
        self._sent += text
        self.generation.push([Text(text, estimate(text))])

    def _answer(self, raw: str) -> None:
        value = json.loads(raw)
        forced = self.turn.forced
        if forced is not None:
            calls = value.get("tool_calls", []) if isinstance(value, dict) else []
            by_name = {t.name: t for t in forced.tools}
            events: list[Any] = []
            for call in calls:
                name = call.get("name") if isinstance(call, dict) else None
                tool = by_name.get(name) if isinstance(name, str) else None
                if tool is None:
                    continue
                events.append(ToolCalled(tool.name, _arguments(tool, call.get("arguments"))))
            self._mark_first()
            self.generation.push(events)
            self._sent += raw
            return
        if self.turn.answer_parameters is not None:
            value = schemas.restore(value, self.turn.answer_parameters)
        self._deliver(json.dumps(value, ensure_ascii=False, separators=(",", ":")))

    def _mark_first(self) -> None:
        if self._first is None:
            self._first = time.perf_counter()

    async def _finish(self) -> None:
        if self._ended:
            return
        completion = await asyncio.to_thread(count_completion, self._sent)
        wanted = self._max_tokens
        reason = "length" if wanted is not None and completion >= wanted \
            and self.turn.forced is None else "stop"
        self._end(reason, completion)

    def _end_with_calls(self) -> None:
        if self._ended:
            return
        self._stop_framework()  # the waiting calls return: the framework is cancelled
        calls = sorted(self._calls, key=lambda c: c.order)
        self._mark_first()
        self.generation.push([ToolCalled(c.name, c.arguments) for c in calls])
        text = "".join(c.name + c.arguments for c in calls)
        self._end("stop", estimate(self._sent) + estimate(text))

    def _error(self, fm: ModuleType, exc: BaseException) -> None:
        if self._ended:
            return
        if failures.is_refusal(fm, exc):
            self._mark_first()
            text = failures.refusal_text(exc)
            self.generation.push([Refused(text)])
            self._end("stop", estimate(self._sent) + estimate(text))
            return
        if isinstance(exc, _Failure):
            self._fail(failures.api_error(fm, exc.error, image_param=exc.param,
                                          schema_param=exc.param))
            return
        if self._calls and self.turn.parallel_calls:
            # The framework gave up while the client's calls waited: they are the answer.
            self._end_with_calls()
            return
        param = "tool_choice" if self.turn.forced is not None else \
            "response_format.json_schema.schema"
        images = self.turn.images  # refused as one (an OS without image prompts): the first
        error = failures.api_error(fm, exc, schema_param=param,
                                   image_param=images[0].param if images else None)
        if error.code == "generation_failed":
            log.warning("system model error", error=f"{type(exc).__name__}: {exc}")
        self._fail(error)

    def _end(self, reason: str, completion: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self._stop_framework()
        now = time.perf_counter()
        self.generation.push([Finished(
            finish_reason=reason,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=estimate(self._sent) if completion is None else completion,
            timings={"started_at": self._started,
                     "first_token_at": self._first if self._first is not None else now,
                     "finished_at": now},
        )])

    def _fail(self, error: APIError) -> None:
        if self._ended:
            return
        self._ended = True
        self._stop_framework()
        self.generation.fail(error)

    def _stop_framework(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._capture.release()
        if self._session is not None:
            self._session.stop()


def _arguments(tool: ToolDef, value: Any) -> str:
    """A forced call's arguments as the client's schema asked, as JSON text."""
    if isinstance(value, str):  # asked for as JSON text (parameters the subset lacks)
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    if tool.parameters is not None:
        value = schemas.restore(value, tool.parameters)
    if not isinstance(value, dict):
        value = {}
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _json_object(text: str) -> str:
    """A ``json_object`` answer without what models wrap JSON in (code fences, a sentence
    before it): its outermost object, when there is one; the text as it was otherwise (the
    answer's check says what is wrong with it)."""
    start, end = text.find("{"), text.rfind("}")
    if start == -1 or end <= start:
        return text.strip()
    candidate = text[start:end + 1]
    try:
        json.loads(candidate)
    except ValueError:
        return text.strip()
    return candidate


__all__ = ["CHARS_PER_TOKEN", "SystemWorker", "count_completion", "count_prompt", "estimate"]
