"""The line of a config file that sets a dotted key, for error messages.

tomllib gives positions only for syntax errors; an unknown key, a wrong type or a value
out of bounds in a long file was named by its key alone, and an operator had to find it.
This reads the file's lines as TOML lays them out (``[table]`` and ``[[array]]`` headers,
``key = value`` lines, dotted keys) closely enough to point at the line, and answers None
where it cannot tell: a wrong line would be worse than none.

Part of afmd's lowest layer: it imports nothing from afmd.
"""

from __future__ import annotations

import re

__all__ = ["key_parts", "line_of"]

_PART = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_DOTTED = rf"{_PART}(?:\s*\.\s*{_PART})*"
_ARRAY_HEADER = re.compile(rf"^\s*\[\[\s*({_DOTTED})\s*\]\]\s*(?:#.*)?$")
_HEADER = re.compile(rf"^\s*\[\s*({_DOTTED})\s*\]\s*(?:#.*)?$")
_KEY_LINE = re.compile(rf"^\s*({_DOTTED})\s*=")
_TOKEN = re.compile(rf"({_PART})|\[(\d+)\]")

Path = tuple[str | int, ...]


def key_parts(dotted: str) -> Path:
    """``models.model[1].path`` -> ``("models", "model", 1, "path")``; quoted parts are
    unquoted, as TOML and :func:`afmd.config.bounds.toml_key` write them."""
    parts: list[str | int] = []
    for name, index in _TOKEN.findall(dotted):
        if index:
            parts.append(int(index))
        elif name.startswith('"'):
            parts.append(name[1:-1].encode().decode("unicode_escape"))
        elif name.startswith("'"):
            parts.append(name[1:-1])
        else:
            parts.append(name)
    return tuple(parts)


def _lines(text: str) -> dict[Path, int]:
    """Every table and key the file names, with the (1-based) line that first names it."""
    found: dict[Path, int] = {}
    arrays: dict[Path, int] = {}  # an array of tables' path -> its last element's index
    table: Path = ()
    in_string = False
    for number, line in enumerate(text.splitlines(), start=1):
        quotes = line.count('"""') + line.count("'''")
        if in_string:
            in_string = quotes % 2 == 0
            continue
        if quotes % 2:
            in_string = True
        if match := _ARRAY_HEADER.match(line):
            plain = key_parts(match.group(1))
            arrays[plain] = arrays.get(plain, -1) + 1
            table = (*_placed(plain[:-1], arrays), plain[-1], arrays[plain])
            found.setdefault(table, number)
        elif match := _HEADER.match(line):
            table = _placed(key_parts(match.group(1)), arrays)
            found.setdefault(table, number)
        elif match := _KEY_LINE.match(line):
            found.setdefault((*table, *key_parts(match.group(1))), number)
    return found


def _placed(plain: Path, arrays: dict[Path, int]) -> Path:
    """A header's path with the index of each array of tables it goes through (a
    ``[models.model.fim]`` belongs to the last ``[[models.model]]``)."""
    placed: list[str | int] = []
    for i, part in enumerate(plain):
        placed.append(part)
        if plain[: i + 1] in arrays:
            placed.append(arrays[plain[: i + 1]])
    return tuple(placed)


def line_of(text: str, dotted: str) -> int | None:
    """The line that sets ``dotted``, or None. A key the file does not name itself is
    found by the nearest enclosing entry only inside an array of tables or an inline
    table (a missing ``path`` is its ``[[models.model]]``'s fault) or as an array's item,
    never by its section: ``server.port`` at its default is not the ``[server]`` line's
    doing."""
    target = key_parts(dotted)
    found = _lines(text)
    if target in found:
        return found[target]
    for end in range(len(target) - 1, 0, -1):
        if target[:end] in found and (end >= 3 or isinstance(target[end], int)):
            return found[target[:end]]
    return None
