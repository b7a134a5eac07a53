"""The request's tools as the framework's tool objects: the client's captured, the
operator's run.

The framework calls a tool itself mid-generation (``Tool.call``, from a thread of its own,
on an event loop it makes for the call) and waits for its output before going on. For a
tool of the operator (a server tool) afmd runs it on the server's loop and hands the
output back, and the model goes on. A client's tool cannot run here: its call is recorded
(:class:`Capture`) and left waiting; the generation's controller collects the calls made
together (``tool_call_debounce``), then releases the waiting calls and ends the turn, and
the client gets ``tool_calls``.

A tool's arguments schema is a ``GenerationSchema`` built from properties (the framework
takes no JSON Schema for tools): strings (with ``enum``), integers and numbers (with
bounds), booleans, arrays of those or of objects, objects as named types, optional where
not required. What properties cannot express (a union, an array of booleans or arrays) is
asked for as JSON text, and :func:`restore_arguments` reads it back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Optional

from afmd.engine.apple import fm_compat as compat
from afmd.engine.apple import schemas
from afmd.engine.apple.conversation import ToolDef

#: The arrays the framework has a property type of its own for.
_ELEMENTS = {"string": str, "integer": int, "number": float}


@dataclass(slots=True)
class Shape:
    """Where a tool's generated arguments hold JSON text to read back: per named type, its
    properties asked for as text, and those holding other named types (one or a list)."""

    root: str = ""
    text: dict[str, set[str]] = field(default_factory=dict)
    nested: dict[str, dict[str, str]] = field(default_factory=dict)


def _named_type(name: str) -> type:
    """The Python type whose ``__name__`` the framework takes as a type's name. The SDK
    tells an optional property by ``"Optional" in str(type_class)`` (apple-fm-sdk 0.2.1,
    ``generation_property.py``), and ``str`` of a type shows its qualified name: that one
    is neutral, so a required property whose type is named ``...Optional...`` (from a key
    or a definition such as ``OptionalSettings``) stays required."""
    return type(name, (), {"__qualname__": "NamedType"})


class _SchemaBuilder:
    """One tool's arguments schema from its (converted) JSON Schema."""

    def __init__(self, fm: ModuleType, tool: str, defs: dict[str, Any]) -> None:
        self.fm = fm
        self.property = compat.property_class(fm)
        self.defs = defs
        self.prefix = schemas.type_name(tool, "Tool")
        self.shape = Shape()
        self.built: dict[str, Any] = {}  # name -> GenerationSchema (nested types)
        self.classes: dict[str, type] = {}

    def named(self, name: str) -> type:
        """The Python stand-in type whose name the framework resolves to a nested type."""
        cls = self.classes.get(name)
        if cls is None:
            cls = self.classes[name] = _named_type(name)
            self.built[name] = None  # building: a recursive reference finds the name
            self.built[name] = self.schema(name, self.defs[name])
        return cls

    def schema(self, name: str, node: dict[str, Any], nested: list[Any] | None = None) -> Any:
        cls = self.classes.get(name) or self.classes.setdefault(name, _named_type(name))
        required = set(node.get("required") or ())
        properties = []
        for key in node.get("x-order") or list(node.get("properties") or {}):
            sub = node["properties"][key]
            kind, guides = self._kind(name, key, sub)
            if key not in required:
                kind = Optional[kind]  # noqa: UP045 (the SDK reads typing.Optional)
            properties.append(self.property(name=key, type_class=kind,
                                            description=sub.get("description"),
                                            guides=guides))
        if nested is None:
            return self.fm.GenerationSchema(type_class=cls, description=node.get("description"),
                                            properties=properties)
        # The root: the framework resolves every named type from the root's list.
        nested += [s for n, s in self.built.items() if n != name and s is not None]
        return self.fm.GenerationSchema(type_class=cls, description=node.get("description"),
                                        properties=properties, dynamic_nested_types=nested)

    def _kind(self, owner: str, key: str, node: dict[str, Any]) -> tuple[Any, list[Any]]:
        guide = self.fm.GenerationGuide
        ref = node.get("$ref")
        if isinstance(ref, str):
            self._nest(owner, key, ref.rsplit("/", 1)[-1])
            return self.named(ref.rsplit("/", 1)[-1]), []
        kind = node.get("type")
        if kind == "object":
            inline = self._inline(owner, key, node)
            self._nest(owner, key, inline)
            return self.named(inline), []
        if kind == "string":
            enum = node.get("enum")
            return str, [guide.anyOf(list(enum))] if enum else []
        if kind in ("integer", "number"):
            return (int if kind == "integer" else float), self._bounds(node)
        if kind == "boolean":
            return bool, []
        if kind == "array":
            return self._array(owner, key, node)
        self.shape.text.setdefault(owner, set()).add(key)  # anyOf: JSON text
        return str, []

    def _array(self, owner: str, key: str, node: dict[str, Any]) -> tuple[Any, list[Any]]:
        guide = self.fm.GenerationGuide
        items = node.get("items") or {}
        counts = self._counts(node)
        ref = items.get("$ref")
        if isinstance(ref, str) or items.get("type") == "object":
            name = ref.rsplit("/", 1)[-1] if isinstance(ref, str) \
                else self._inline(owner, key, items)
            self._nest(owner, key, name)
            return list[self.named(name)], counts  # type: ignore[misc]
        element = _ELEMENTS.get(items.get("type", ""))
        if element is None:  # booleans, arrays, unions: the framework has no such array
            self.shape.text.setdefault(owner, set()).add(key)
            return str, []
        guides = list(counts)
        if element is str and items.get("enum"):
            guides.append(guide.element(guide.anyOf(list(items["enum"]))))
        elif element is not str:
            guides += [guide.element(g) for g in self._bounds(items)]
        return list[element], guides  # type: ignore[valid-type]

    def _counts(self, node: dict[str, Any]) -> list[Any]:
        guide = self.fm.GenerationGuide
        low, high = node.get("minItems"), node.get("maxItems")
        if low is not None and low == high and low > 0:
            return [guide.count(low)]
        out = []
        if low:
            out.append(guide.min_items(low))
        if high is not None:
            out.append(guide.max_items(high))
        return out

    def _bounds(self, node: dict[str, Any]) -> list[Any]:
        guide = self.fm.GenerationGuide
        low, high = node.get("minimum"), node.get("maximum")
        if low is not None and high is not None:
            return [guide.range((low, high))]
        if low is not None:
            return [guide.minimum(low)]
        if high is not None:
            return [guide.maximum(high)]
        return []

    def _inline(self, owner: str, key: str, node: dict[str, Any]) -> str:
        name = schemas.type_name(f"{self.prefix}_{owner}_{key}")
        while name in self.defs and self.defs[name] is not node:
            name += "_"
        self.defs[name] = node
        return name

    def _nest(self, owner: str, key: str, name: str) -> None:
        self.shape.nested.setdefault(owner, {})[key] = name


def arguments_schema(fm: ModuleType, tool: ToolDef) -> tuple[Any, Shape]:
    """``tool``'s arguments as the framework's ``GenerationSchema`` (its parameters are an
    object schema, converted by :func:`afmd.engine.apple.schemas.convert_parameters`)."""
    root = tool.schema
    builder = _SchemaBuilder(fm, tool.name, dict(root.get("$defs") or {}))
    name = schemas.type_name(f"{builder.prefix}_Arguments")
    builder.shape.root = name
    return builder.schema(name, root, nested=[]), builder.shape


def restore_arguments(value: Any, shape: Shape, tool: ToolDef) -> Any:
    """Generated arguments as the client's schema asked: JSON text read back, nulls."""
    value = _read_text(value, shape, shape.root, 0)
    return schemas.restore(value, tool.parameters) if tool.parameters is not None else value


def _read_text(value: Any, shape: Shape, owner: str, depth: int) -> Any:
    if depth > schemas.MAX_DEPTH:
        return value
    if isinstance(value, list):
        return [_read_text(v, shape, owner, depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for key in shape.text.get(owner, ()):
        if isinstance(out.get(key), str):
            with contextlib.suppress(ValueError):
                out[key] = json.loads(out[key])
    for key, name in shape.nested.get(owner, {}).items():
        if key in out:
            out[key] = _read_text(out[key], shape, name, depth + 1)
    return out


@dataclass(frozen=True, slots=True)
class CapturedCall:
    order: int  # in the order the framework called them
    name: str
    arguments: str  # JSON, as the client's schema asked


class Capture:
    """The client's calls of one generation, each left waiting until :meth:`release`.

    ``notify`` is called from the framework's threads with each call (it must be
    thread-safe: the controller hands it to its own loop)."""

    def __init__(self, notify: Callable[[CapturedCall], None]) -> None:
        self._notify = notify
        self._lock = threading.Lock()
        self._waiting: list[concurrent.futures.Future[str]] = []  # the client's calls
        self._held: list[concurrent.futures.Future[str]] = []  # server tools running
        self._count = 0
        self.released = False

    def record(self, name: str, arguments: str) -> concurrent.futures.Future[str]:
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        with self._lock:
            if self.released:  # the turn is over: the framework is being stopped anyway
                future.set_result("")
                return future
            self._waiting.append(future)
            order = self._count
            self._count += 1
        self._notify(CapturedCall(order, name, arguments))
        return future

    def hold(self, future: concurrent.futures.Future[str]) -> None:
        """A server tool running for the framework: cancelled if the turn ends first."""
        with self._lock:
            if not self.released:
                self._held.append(future)
                return
        future.cancel()

    def release(self) -> None:
        """The turn is over: every waiting call returns (with no output), so the framework,
        which is being cancelled, is not left waiting on it; server tools still running
        are cancelled."""
        with self._lock:
            self.released = True
            waiting, self._waiting = self._waiting, []
            held, self._held = self._held, []
        for future in waiting:
            if not future.done():
                future.set_result("")
        for future in held:
            future.cancel()


def framework_tools(
    fm: ModuleType,
    defs: tuple[ToolDef, ...],
    capture: Capture,
    run_server: Callable[[str, str], concurrent.futures.Future[str]] | None,
) -> list[Any]:
    """The framework's tool objects for ``defs``."""
    base = fm.Tool

    class FrameworkTool(base):  # type: ignore[misc, valid-type]
        def __init__(self, tool: ToolDef) -> None:
            self.afmd_tool = tool
            self.name = tool.name
            self.description = tool.description or tool.name
            self.afmd_schema, self.afmd_shape = arguments_schema(fm, tool)
            super().__init__()

        @property
        def arguments_schema(self) -> Any:
            return self.afmd_schema

        async def call(self, args: Any) -> str:
            try:
                value = json.loads(args.to_json())
            except (ValueError, TypeError):
                value = args.value() if hasattr(args, "value") else {}
            tool = self.afmd_tool
            arguments = json.dumps(restore_arguments(value, self.afmd_shape, tool),
                                   ensure_ascii=False, separators=(",", ":"))
            try:
                if tool.server and run_server is not None:
                    future = run_server(tool.name, arguments)
                    capture.hold(future)
                else:
                    future = capture.record(tool.name, arguments)
                return await asyncio.wrap_future(future)
            except BaseException:  # cancelled: the framework must still get an output
                return ""

    return [FrameworkTool(d) for d in defs]


__all__ = ["Capture", "CapturedCall", "Shape", "arguments_schema", "framework_tools",
           "restore_arguments"]
