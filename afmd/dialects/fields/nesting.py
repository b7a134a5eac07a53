"""How deeply a request body may nest, and the param-style path of a value in it.

Python's repr of a list, jsonschema's metaschema check, Jinja's ``tojson`` and the grammar
compiler all recurse once or more per level of a value, so a value a thousand levels deep
ends in ``RecursionError`` wherever it is touched. Refusing such bodies once, right after
parsing, keeps every later stage within its recursion limit without each stage guarding
itself, and lets the refusal name the exact value.

Every check here is iterative and does its per-value work in C (itertools over the
children's types, numpy over the text): a body near the size cap is checked on the event
loop, and a Python loop over each of its values would hold the loop for seconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from itertools import chain, compress, repeat
from operator import is_
from typing import Any

import orjson

#: Arrays and objects a request body may nest, the body itself counting as one.
#:
#: Real requests stay far below it: messages sit four levels down, a tool's JSON schema
#: starts five levels down and a nested pydantic model adds two levels per model (its
#: ``properties`` and its own schema; shared models become ``$defs`` references, which add
#: none). Twice this would not be safe: jsonschema's metaschema check spends several Python
#: frames per schema level and would approach Python's default recursion limit on the
#: deepest schema allowed, turning a bad request back into a 500.
MAX_NESTING = 64

#: Longest param an error names; longer paths keep their start and end around an ellipsis.
MAX_PARAM_CHARS = 160
_HEAD_CHARS = 100
_TAIL_CHARS = 50
_MAX_KEY_CHARS = 40

_PLAIN_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]*")
_IS_CONTAINER = frozenset((dict, list)).__contains__

Segment = str | int


def _containers_below(lists: list[Any], dicts: list[Any]) -> tuple[list[Any], list[Any]]:
    """The lists and the dicts among the children of ``lists`` and ``dicts``."""

    def children() -> Iterator[Any]:
        return chain(chain.from_iterable(lists), chain.from_iterable(map(dict.values, dicts)))

    found = list(compress(children(), map(_IS_CONTAINER, map(type, children()))))
    types = list(map(type, found))
    return (list(compress(found, map(is_, types, repeat(list)))),
            list(compress(found, map(is_, types, repeat(dict)))))


def nests_deeper_than(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether ``value`` (plain dicts and lists, as orjson makes them) holds a container
    more than ``limit`` levels deep, ``value`` itself being level one.

    Level by level, the children of a whole level gathered and filtered in C.
    """
    lists: list[Any] = [value] if type(value) is list else []
    dicts: list[Any] = [value] if type(value) is dict else []
    level = 1
    while lists or dicts:
        if level > limit:
            return True
        lists, dicts = _containers_below(lists, dicts)
        level += 1
    return False


def _container_children(value: Any) -> Iterator[tuple[Segment, Any]]:
    """The (key or index, child) pairs of a container whose child is a container too."""
    if type(value) is dict:
        pairs: Iterator[tuple[Segment, Any]] = iter(value.items())
        types = map(type, value.values())
    else:
        pairs, types = enumerate(value), map(type, value)
    return compress(pairs, map(_IS_CONTAINER, types))


def nesting_path(value: Any, limit: int = MAX_NESTING) -> list[Segment] | None:
    """The path to the first container (in document order) more than ``limit`` levels
    deep, ``value`` itself being level one; None if there is none.

    Depth first with an explicit stack, so it never recurses itself. Each container on
    the way costs a Python step: :func:`nests_deeper_than` decides, this only names.
    """
    if type(value) not in (dict, list):
        return None
    stack = [_container_children(value)]
    path: list[Segment] = []
    while stack:
        for segment, child in stack[-1]:
            if len(stack) >= limit:
                path.append(segment)
                return path
            path.append(segment)
            stack.append(_container_children(child))
            break
        else:
            stack.pop()
            if path:
                path.pop()
    return None


_CHUNK = 1 << 20
_QUOTE, _OPEN, _CLOSE = 1, 2, 3
_BACKSLASH = 0x5C


def _too_deep_offset(raw: bytes, limit: int) -> tuple[int, bytes] | None:
    """Where the first container more than ``limit`` levels deep opens in JSON text, and
    the brackets that close the ``limit`` containers open there, innermost first.

    Vectorised over chunks of the text and, within a chunk, over its quotes and brackets
    only. ``raw`` must be valid JSON up to that point: then brackets outside strings are
    structure, and a quote after an odd run of backslashes is inside a string.
    """
    import numpy as np

    classes = np.zeros(256, dtype=np.int8)
    classes[ord('"')] = _QUOTE
    classes[[ord("["), ord("{")]] = _OPEN
    classes[[ord("]"), ord("}")]] = _CLOSE
    data = np.frombuffer(raw, dtype=np.uint8)
    depth_in = 0  # containers open before the chunk
    in_string = 0  # 1 if the chunk starts inside a string
    slashes_in = 0  # backslashes ending the text before the chunk
    last_open = np.full(limit + 1, -1, dtype=np.int64)  # per level: where it last opened
    for base in range(0, len(data), _CHUNK):
        chunk = data[base:base + _CHUNK]
        kinds = classes[chunk]
        where = np.flatnonzero(kinds)
        kind = kinds[where]
        quote = kind == _QUOTE
        slash = chunk == _BACKSLASH
        last_plain = np.maximum.accumulate(np.where(slash, -1, np.arange(len(chunk))))
        if slash.any() or slashes_in:
            before = where[quote] - 1
            plain = np.where(before >= 0, last_plain[np.maximum(before, 0)], -1)
            run = np.where(plain >= 0, before - plain, before + 1 + slashes_in)
            quote[np.flatnonzero(quote)[run % 2 == 1]] = False
        parity = (np.cumsum(quote, dtype=np.int64) + in_string) % 2
        outside = parity == 0
        step = (outside & (kind == _OPEN)).astype(np.int64) - (outside & (kind == _CLOSE))
        depth = np.cumsum(step) + depth_in
        over = np.flatnonzero(depth > limit)
        end = int(over[0]) if len(over) else len(depth)
        opened = np.flatnonzero((step[:end] == 1) & (depth[:end] >= 1))
        # The last opening at each level wins: unique over the reversed order keeps it.
        levels, first = np.unique(depth[opened][::-1], return_index=True)
        last_open[levels] = where[opened[::-1][first]] + base
        if len(over):
            if (last_open[1:] < 0).any():
                return None
            closers = bytes(0x5D if raw[i] == 0x5B else 0x7D for i in last_open[:0:-1])
            return base + int(where[end]), closers
        if len(where):
            depth_in = int(depth[-1])
            in_string = int(parity[-1])
        tail = len(chunk) - 1 - int(last_plain[-1])
        slashes_in = tail + slashes_in if last_plain[-1] < 0 else tail
    return None


def _last_path(value: Any, limit: int) -> list[Segment] | None:
    """The path that always takes the last child, if it ends at an empty array at level
    ``limit + 1`` (where :func:`nesting_path_in_text` put one); otherwise None."""
    path: list[Segment] = []
    node = value
    for _ in range(limit):
        if type(node) is list and node:
            path.append(len(node) - 1)
            node = node[-1]
        elif type(node) is dict and node:
            key = next(reversed(node))
            path.append(key)
            node = node[key]
        else:
            return None
    return path if node == [] and type(node) is list else None


def nesting_path_in_text(raw: bytes, limit: int = MAX_NESTING) -> list[Segment] | None:
    """:func:`nesting_path` of the JSON text ``raw``; None if nothing there nests deeper
    than ``limit``.

    Works where the parser refused the text as too deep (orjson stops at its own limit),
    and costs nothing per value on the way: the text up to the first too-deep container is
    valid JSON, so that prefix, an empty array in the container's place and the brackets
    closing what is open there parse, and the array is the last child at every level.
    """
    found = _too_deep_offset(raw, limit)
    if found is None:
        return None
    offset, closers = found
    try:
        value = orjson.loads(raw[:offset] + b"[]" + closers)
    except orjson.JSONDecodeError:
        return None
    # A key repeated in an object keeps its first place in the dict: walk instead.
    return _last_path(value, limit) or nesting_path(value, limit)


def _render(segment: Segment) -> str:
    if isinstance(segment, int):
        return f"[{segment}]"
    if len(segment) <= _MAX_KEY_CHARS and _PLAIN_KEY.fullmatch(segment):
        return f".{segment}"
    if len(segment) > _MAX_KEY_CHARS:
        segment = segment[:_MAX_KEY_CHARS] + "…"
    return "[" + orjson.dumps(segment).decode() + "]"


def param_of(path: Sequence[Segment]) -> str:
    """A path in afmd's param style (``messages[0].content[1].type``), at most
    :data:`MAX_PARAM_CHARS` long: a longer one keeps its first and last segments around
    an ellipsis, so the param still says which field of the request and how it ends."""
    parts = [_render(segment) for segment in path]
    if parts and parts[0].startswith("."):
        parts[0] = parts[0][1:]
    if sum(map(len, parts)) <= MAX_PARAM_CHARS:
        return "".join(parts)
    head: list[str] = []
    size = 0
    for part in parts:
        if size + len(part) > _HEAD_CHARS:
            break
        head.append(part)
        size += len(part)
    if not head:  # one enormous first segment
        return parts[0][:_HEAD_CHARS] + "…"
    tail: list[str] = []
    size = 0
    for part in reversed(parts[len(head):]):
        if size + len(part) > _TAIL_CHARS:
            break
        tail.append(part)
        size += len(part)
    return "".join(head) + "…" + "".join(reversed(tail))
