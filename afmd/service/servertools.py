"""Server tools: tools afmd runs itself, configured by the operator.

A server tool is a command (run without a shell, the call's JSON arguments on stdin, one
JSON value read from stdout) or a Python function loaded by file path (so it works in the
frozen binary, which has no site-packages of the user's). Whatever goes wrong — arguments
that do not match the schema, a timeout, a non-zero exit, output that is not JSON or is too
large — becomes an error message the model reads as the tool's output, and a log line;
never a crash and never a failed request. The child's environment is built from an
allow-list, so afmd's own secrets (API keys in its environment) do not leak into tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import orjson

from afmd.config.tables import ServerTool
from afmd.core.request import ToolSpec
from afmd.logs import get_logger

log = get_logger("afmd.tools")

# What a tool process inherits from afmd's environment; everything else it gets from `env`.
ENV_ALLOWLIST = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ")


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    content: str  # what the model reads as the tool's output
    ok: bool


def _error(message: str) -> ToolOutcome:
    return ToolOutcome(orjson.dumps({"error": message}).decode(), ok=False)


class ServerTools:
    """The configured server tools and how to run them."""

    def __init__(self, tools: tuple[ServerTool, ...]) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._modules: dict[str, ModuleType] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __bool__(self) -> bool:
        return bool(self._tools)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._tools)

    def specs(self) -> tuple[ToolSpec, ...]:
        return tuple(
            ToolSpec(t.name, t.description or None, dict(t.parameters))
            for t in self._tools.values()
        )

    async def run(self, name: str, arguments: str) -> ToolOutcome:
        tool = self._tools[name]
        started = time.perf_counter()
        outcome = await self._run(tool, arguments)
        log.info(
            "server tool",
            tool=name,
            ok=outcome.ok,
            duration_ms=round((time.perf_counter() - started) * 1000, 2),
            **({} if outcome.ok else {"error": outcome.content[:500]}),
        )
        return outcome

    async def _run(self, tool: ServerTool, arguments: str) -> ToolOutcome:
        try:
            args = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError as exc:
            return _error(f"the arguments are not valid JSON: {exc}")
        problem = _schema_problem(tool.parameters, args)
        if problem is not None:
            return _error(f"invalid arguments for {tool.name}: {problem}")
        if tool.command:
            return await self._run_command(tool, arguments)
        return await self._run_python(tool, args)

    async def _run_command(self, tool: ServerTool, arguments: str) -> ToolOutcome:
        env = {k: os.environ[k] for k in ENV_ALLOWLIST if k in os.environ}
        env.update(tool.env)
        try:
            proc = await asyncio.create_subprocess_exec(
                *tool.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=tool.cwd or None,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            return _error(f"{tool.name} could not be started: {exc.strerror or exc}")
        try:
            async with asyncio.timeout(tool.timeout):
                stdout, stderr = await _communicate(proc, arguments.encode(), tool.max_output_bytes)
        except TimeoutError:
            _kill(proc)
            await proc.wait()
            return _error(f"{tool.name} timed out after {tool.timeout:g} s")
        except _TooLarge:
            _kill(proc)
            await proc.wait()
            return _error(f"{tool.name} wrote more than {tool.max_output_bytes} bytes")
        except BaseException:
            # The request ended while its tool ran (its client cancelled or left, its
            # deadline passed, the server stops): the tool goes with it, as at its own
            # timeout, which no longer runs to stop it.
            _kill(proc)
            raise
        if proc.returncode != 0:
            tail = stderr.decode(errors="replace").strip()[-300:]
            return _error(f"{tool.name} exited with status {proc.returncode}: {tail}")
        try:
            value = orjson.loads(stdout)
        except orjson.JSONDecodeError:
            return _error(f"{tool.name} did not write one JSON value to stdout")
        return ToolOutcome(orjson.dumps(value).decode(), ok=True)

    def _function(self, tool: ServerTool) -> Callable[..., Any]:
        path, _, attr = tool.python.rpartition(":")
        module = self._modules.get(path)
        if module is None:
            spec = importlib.util.spec_from_file_location(f"afmd_tool_{tool.name}", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            self._modules[path] = module
        return getattr(module, attr)

    async def _run_python(self, tool: ServerTool, args: Any) -> ToolOutcome:
        try:
            function = self._function(tool)
        except Exception as exc:  # the operator's file: report, don't crash
            return _error(f"{tool.name} could not be loaded: {type(exc).__name__}: {exc}")
        call = (lambda: function(**args)) if isinstance(args, dict) else (lambda: function(args))
        try:
            async with asyncio.timeout(tool.timeout):
                value = await asyncio.to_thread(call)
        except TimeoutError:
            return _error(f"{tool.name} timed out after {tool.timeout:g} s")
        except Exception as exc:
            return _error(f"{tool.name} failed: {type(exc).__name__}: {exc}")
        try:
            text = orjson.dumps(value).decode()
        except TypeError:
            return _error(f"{tool.name} returned a value that is not JSON")
        if len(text) > tool.max_output_bytes:
            return _error(f"{tool.name} returned more than {tool.max_output_bytes} bytes")
        return ToolOutcome(text, ok=True)


class _TooLarge(Exception):
    pass


async def _communicate(
    proc: asyncio.subprocess.Process, data: bytes, limit: int
) -> tuple[bytes, bytes]:
    """Like ``communicate`` but stops reading stdout past ``limit`` bytes."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data)
        await proc.stdin.drain()
    proc.stdin.close()

    async def read_out() -> bytes:
        assert proc.stdout is not None
        chunks: list[bytes] = []
        size = 0
        while chunk := await proc.stdout.read(65536):
            size += len(chunk)
            if size > limit:
                raise _TooLarge()
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_err() -> bytes:
        # Drain stderr to the end (keeping its tail): a tool that logs more than a pipe
        # buffer would otherwise block on write and look like a timeout.
        assert proc.stderr is not None
        tail = b""
        while chunk := await proc.stderr.read(65536):
            tail = (tail + chunk)[-65536:]
        return tail

    out, err = await asyncio.gather(read_out(), read_err())
    await proc.wait()
    return out, err


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)


def _schema_problem(schema: dict[str, Any], value: Any) -> str | None:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    return None if error is None else error.message
