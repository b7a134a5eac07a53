"""The import direction inside afmd, enforced statically over every module's AST.

Layers, lowest first; a module may import its own layer and lower ones, never higher
(the table is LAYERS below; docs/architecture.md draws the same per folder):

    0    afmd, afmd.config.*, afmd.errors, afmd.hub.cache, afmd.paths, afmd.ports
    1    afmd.cli.port_owners, afmd.distributed.*, afmd.logs
    1.5  afmd.core.*
    1.7  afmd.dialects.fields.checks, afmd.dialects.fields.nesting
    1.8  afmd.dialects.fields.body, afmd.dialects.fields.messages,
         afmd.dialects.fields.tool_specs
    2    afmd.dialects.fields.*, afmd.dialects.openai.chat_body,
         afmd.dialects.openai.completions_body, afmd.hub.*, afmd.output.*,
         afmd.service.images, afmd.service.pillow_compat, afmd.service.profiling
    3    afmd.engine.*, afmd.grammar.*, afmd.service.*
    3.5  afmd.service.output_plan, afmd.service.toolloop
    3.6  afmd.service.completion_prompts, afmd.service.round_builder
    3.7  afmd.service.chat_run, afmd.service.choices, afmd.service.completion_run,
         afmd.service.round_reader, afmd.service.run_control
    4    afmd.hub.server_pulls, afmd.service.embedding_pipeline, afmd.service.pipeline
    4.5  afmd.dialects.*
    4.91 afmd.http.sansio.*
    4.92 afmd.http.sansio.framing
    4.93 afmd.http.sansio.screen
    4.94 afmd.http.sansio.gate
    5    afmd.http.*
    5.5  afmd.distributed.lead, afmd.distributed.loss
    6    afmd.server
    6.5  afmd.distributed.rank
    7    afmd.__main__, afmd.cli.*, afmd.distributed.launch

Besides: Sanic only in afmd.http.* and afmd.server; MLX / mlx-lm only in afmd.engine.* and
afmd.grammar.*, Apple's apple_fm_sdk only in afmd.engine.apple.*, at module level or inside
functions alike. A module missing from the table fails the test, so a new module has to be
given its place. The modules between the edges (output plan, tool loop, round builder and
reader, chat run, pipeline) import no wire format: not afmd.dialects.fields.*,
afmd.dialects.* or afmd.http.*.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.paths import REPO_ROOT

PACKAGE_DIR = REPO_ROOT / "afmd"

#: (pattern, layer), first match wins: a folder's rule (``x.*``, the package and
#: everything below it) after the modules it places apart.
LAYERS: tuple[tuple[str, float], ...] = (
    ("afmd", 0),
    ("afmd.__main__", 7),
    ("afmd.cli.port_owners", 1),  # the processes listening on a port (/proc, lsof): stdlib
    ("afmd.cli.*", 7),  # the ``afmd`` command and its verbs
    # afmd's configuration: its shape, its layers (file, env, flags) and its rules
    ("afmd.config.*", 0),
    ("afmd.core.*", 1.5),  # the internal request and event model: pure data
    ("afmd.dialects.fields.body", 1.8),  # the JSON body, decoded and depth-checked
    ("afmd.dialects.fields.checks", 1.7),  # typed checks, quoting, scalar tables: no dialect's own
    ("afmd.dialects.fields.messages", 1.8),  # messages, content parts, tool history
    ("afmd.dialects.fields.nesting", 1.7),  # depth limit and param paths
    ("afmd.dialects.fields.tool_specs", 1.8),  # tools, tool_choice, response_format
    ("afmd.dialects.fields.*", 2),  # the field checks every dialect's body parser is built from
    # an OpenAI Chat Completions body checked into a :class:`ChatRequest`
    ("afmd.dialects.openai.chat_body", 2),
    # an OpenAI (legacy) Completions body checked into a :class:`CompletionRequest`
    ("afmd.dialects.openai.completions_body", 2),
    ("afmd.dialects.*", 4.5),  # adapters at the edge: above the pipeline, below HTTP
    ("afmd.distributed.launch", 7),  # `afmd launch`: the ranks' process contract
    ("afmd.distributed.lead", 5.5),  # rank 0's side of the group
    ("afmd.distributed.loss", 5.5),  # what rank 0 does when a rank is lost
    ("afmd.distributed.rank", 6.5),  # `afmd serve` as one rank: lead, or follow as a process
    ("afmd.distributed.*", 1),  # a launched group of ranks (package docstring only)
    ("afmd.engine.*", 3),  # the engine: models in memory, and the threads that generate with them
    ("afmd.errors", 0),  # one exception hierarchy for everything a client can be told
    ("afmd.grammar.*", 3),  # constrained decoding (llguidance, mlx logits processors)
    ("afmd.http.sansio.framing", 4.92),  # request heads and body framings
    ("afmd.http.sansio.gate", 4.94),  # one connection's framer and screen, over the three
    ("afmd.http.sansio.screen", 4.93),  # Host, Origin/CORS, route, key, media type, size
    # the HTTP edge without I/O: bytes in, decisions out (no Sanic, no asyncio)
    ("afmd.http.sansio.*", 4.91),
    ("afmd.http.*", 5),  # the HTTP edge: the strict gate, sockets and connections, Sanic's routes
    ("afmd.hub.cache", 0),  # the Hugging Face cache on disk: which repos, complete or not
    # pulls a running server makes in the background (the dashboard's)
    ("afmd.hub.server_pulls", 4),
    # the Hugging Face hub: verified pulls into the shared cache, and what is on disk
    ("afmd.hub.*", 2),
    # structured logging: one structlog pipeline for afmd's own events and the access log
    ("afmd.logs", 1),
    ("afmd.output.*", 2),  # A model's raw text read into the turn: stops, reasoning, tool calls
    ("afmd.paths", 0),  # where afmd keeps files on disk
    ("afmd.ports", 0),  # ports chosen now for a process that binds them later
    # running afmd: Sanic inside our own event loop, on sockets we bind, with a clean shutdown
    ("afmd.server", 6),
    ("afmd.service.chat_run", 3.7),  # a chat turn's round loop: engine events in, output events out
    ("afmd.service.choices", 3.7),  # a chat turn's n choices, one run each, in one slot
    # a Completions request's prompts as token ids (and FIM)
    ("afmd.service.completion_prompts", 3.6),
    ("afmd.service.completion_run", 3.7),  # a Completions request's generations, one per prompt
    # the embeddings service: model, queue slot, batched encoding
    ("afmd.service.embedding_pipeline", 4),
    ("afmd.service.images", 2),  # a request's image parts decoded (Pillow), for vision models
    ("afmd.service.pillow_compat", 2),  # the Pillow privates afmd.service.images relies on
    # a round's output plan (grammar, bans, how output is read): above engine/grammar
    ("afmd.service.output_plan", 3.5),
    # from a validated request to a running turn, independent of HTTP and of wire formats
    ("afmd.service.pipeline", 4),
    ("afmd.service.profiling", 2),  # pure measurement helpers (stdlib only)
    ("afmd.service.round_builder", 3.6),  # a round's prompt, budget and plan
    # one round's engine output read back into the client's events
    ("afmd.service.round_reader", 3.7),
    # a run's cancel, deadline and retries (chat and completions)
    ("afmd.service.run_control", 3.7),
    ("afmd.service.toolloop", 3.5),  # server tools within one request: hidden, budgeted
    ("afmd.service.*", 3),
)

#: Third-party top-level packages and the afmd modules allowed to import them.
RESTRICTED: dict[str, tuple[str, ...]] = {
    "sanic": ("afmd.http.*", "afmd.server"),
    "mlx": ("afmd.engine.*", "afmd.grammar.*"),
    "mlx_lm": ("afmd.engine.*", "afmd.grammar.*"),
    # Apple's SDK (macOS only, optional): behind the engine boundary, with its model kind.
    "apple_fm_sdk": ("afmd.engine.apple.*",),
}


def matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        base = pattern[:-2]
        return module == base or module.startswith(base + ".")
    return module == pattern


def layer_of(module: str, layers: Sequence[tuple[str, float]] = LAYERS) -> float | None:
    for pattern, layer in layers:
        if matches(module, pattern):
            return layer
    return None


@dataclass(frozen=True)
class Import:
    target: str  # dotted module name as resolved
    line: int


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, name] if name else parts)


@functools.cache
def _import_nodes(source: str) -> tuple[ast.AST, ...]:
    """The nodes of ``source`` that :func:`imports_of` reads, in ``ast.walk``'s order:
    parsed once per source text, as three tests here read every module of the package."""
    return tuple(node for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Import | ast.ImportFrom | ast.Call))


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> Iterator[Import]:
    """Every import anywhere in the module (functions and TYPE_CHECKING blocks included),
    plus ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    for node in _import_nodes(source):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve_relative(module, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # ``from afmd import logs`` imports the module afmd.logs, not just afmd.
                yield Import(sub if sub in known else base, node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (
                func.attr if isinstance(func, ast.Attribute)
                else func.id if isinstance(func, ast.Name) else ""
            )
            arg = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
            ):
                yield Import(arg.value, node.lineno)


def _owner(target: str, known: set[str]) -> str:
    """The afmd module an import names (``afmd.engine.generation.Foo`` →
    ``afmd.engine.generation``)."""
    while target not in known and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def check(
    root: Path,
    layers: Sequence[tuple[str, float]] = LAYERS,
    restricted: dict[str, tuple[str, ...]] = RESTRICTED,
) -> list[str]:
    """All layering violations in the package at ``root``, as readable lines."""
    package = root.name
    modules = discover(root)
    known = set(modules)
    problems: list[str] = []
    for module, path in modules.items():
        rel = path.relative_to(root.parent)
        own = layer_of(module, layers)
        if own is None:
            problems.append(f"{rel}: module {module} has no layer; add it to LAYERS")
        is_package = path.name == "__init__.py"
        for imp in imports_of(path.read_text(encoding="utf-8"), module, is_package, known):
            top = imp.target.split(".", 1)[0]
            if top in restricted and not any(matches(module, p) for p in restricted[top]):
                problems.append(
                    f"{rel}:{imp.line}: {module} imports {imp.target}; only "
                    f"{', '.join(restricted[top])} may import {top}"
                )
            if top != package or own is None:
                continue
            target = _owner(imp.target, known)
            theirs = layer_of(target, layers)
            if theirs is None:
                if target not in known:
                    problems.append(f"{rel}:{imp.line}: {module} imports unknown {imp.target}")
                continue  # reported as unplaced on its own
            if theirs > own:
                problems.append(
                    f"{rel}:{imp.line}: {module} (layer {own}) imports {target} "
                    f"(layer {theirs}); lower layers must not import higher ones"
                )
    return problems


# ---------------------------------------------------------------------------- the real tree


def test_package_found() -> None:
    modules = discover(PACKAGE_DIR)
    for expected in ("afmd", "afmd.cli.main", "afmd.server", "afmd.logs", "afmd.output.stops",
                     "afmd.http.access", "afmd.engine.batch.generation_thread"):
        assert expected in modules


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in discover(PACKAGE_DIR) if layer_of(m) is None]
    assert not unplaced, f"place these modules in LAYERS (tests/meta/test_layering.py): {unplaced}"


def test_import_direction() -> None:
    problems = check(PACKAGE_DIR)
    assert not problems, "layering violations:\n" + "\n".join(problems)


#: The modules between the edges, and the wire formats they must not know.
WIRE_FREE = ("afmd.service.output_plan", "afmd.service.toolloop",
             "afmd.service.round_builder", "afmd.service.chat_run", "afmd.service.round_reader",
             "afmd.service.run_control", "afmd.service.pipeline",
             "afmd.service.embedding_pipeline", "afmd.service.completion_prompts",
             "afmd.service.completion_run")
WIRE = ("afmd.dialects.fields.*", "afmd.dialects.*", "afmd.http.*")


def test_the_pipeline_knows_no_wire_format() -> None:
    modules = discover(PACKAGE_DIR)
    known = set(modules)
    for module in WIRE_FREE:
        path = modules[module]
        for imp in imports_of(path.read_text(encoding="utf-8"), module, False, known):
            target = _owner(imp.target, known)
            assert not any(matches(target, w) for w in WIRE), (
                f"{module}:{imp.line} imports {target}: wire formats belong to the "
                "dialect adapters at the edge"
            )


#: The HTTP edge's modules that take bytes and return decisions, tested by feeding bytes.
SANS_IO = ("afmd.http.sansio.wire", "afmd.http.sansio.framing", "afmd.http.sansio.screen",
           "afmd.http.sansio.gate")


def test_the_gate_does_no_io() -> None:
    modules = discover(PACKAGE_DIR)
    known = set(modules)
    for module in SANS_IO:
        for imp in imports_of(modules[module].read_text(encoding="utf-8"), module, False, known):
            top = imp.target.split(".", 1)[0]
            assert top not in ("sanic", "asyncio"), f"{module}:{imp.line} imports {imp.target}"


def test_heavy_imports_are_confined() -> None:
    modules = discover(PACKAGE_DIR)
    known = set(modules)
    for module, path in modules.items():
        tops = {
            imp.target.split(".", 1)[0]
            for imp in imports_of(path.read_text(), module, path.name == "__init__.py", known)
        }
        if "sanic" in tops:
            assert matches(module, "afmd.http.*") or module == "afmd.server", module
        if tops & {"mlx", "mlx_lm"}:
            assert matches(module, "afmd.engine.*") or matches(module, "afmd.grammar.*"), module


def import_circles(root: Path) -> list[list[str]]:
    """Groups of afmd modules that import one another, directly or around a loop, counting
    every import (inside functions and ``TYPE_CHECKING`` blocks too): each is one concept
    split in two, or a piece that belongs lower."""
    modules = discover(root)
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        found = imports_of(path.read_text(encoding="utf-8"), module,
                           path.name == "__init__.py", known)
        graph[module] = {t for t in (_owner(i.target, known) for i in found)
                         if t in known and t != module}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = [stack.pop()]
            while group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return circles


def test_no_import_circles() -> None:
    circles = import_circles(PACKAGE_DIR)
    assert not circles, "modules importing one another:\n" + "\n".join(map(str, circles))


# ---------------------------------------------------------------------------- the checker


#: The checker's own tests run on small trees of these names, whatever the real
#: layout: they test the checker, not afmd.
SAMPLE_LAYERS: tuple[tuple[str, float], ...] = (
    ("afmd", 0),
    ("afmd.errors", 0),
    ("afmd.config", 0),
    ("afmd.logs", 1),
    ("afmd.protocol.nesting", 1.7),
    ("afmd.protocol.fields", 1.7),
    ("afmd.protocol.body", 1.8),
    ("afmd.protocol.messages", 1.8),
    ("afmd.protocol.tools", 1.8),
    ("afmd.protocol.*", 2),
    ("afmd.output.*", 2),
    ("afmd.chat", 3),
    ("afmd.engine.*", 3),
    ("afmd.grammar.*", 3),
    ("afmd.turn", 3.5),
    ("afmd.pipeline", 4),
    ("afmd.http.*", 5),
    ("afmd.server", 6),
    ("afmd.cli", 7),
)
SAMPLE_RESTRICTED: dict[str, tuple[str, ...]] = {
    "sanic": ("afmd.http.*", "afmd.server"),
    "mlx": ("afmd.engine.*", "afmd.grammar.*"),
    "mlx_lm": ("afmd.engine.*", "afmd.grammar.*"),
}


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "afmd"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_accepts_a_clean_tree(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "errors.py": "import json\n",
        "logs.py": "from afmd.errors import X\n",
        "output/__init__.py": "",
        "output/stops.py": "from afmd import logs\nfrom . import __name__ as n\n",
        "engine/__init__.py": "",
        "engine/worker.py": "import mlx.core as mx\nfrom ..output.stops import S\n",
        "http/__init__.py": "",
        "http/app.py": "from sanic import Sanic\nfrom afmd.engine import worker\n",
        "cli.py": "def main():\n    from afmd.http.app import create_app\n",
    })
    assert check(root, SAMPLE_LAYERS) == []


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        # a lower layer importing a higher one, in every spelling
        ({"logs.py": "import afmd.pipeline\n", "pipeline.py": ""}, "afmd.logs (layer 1)"),
        ({"logs.py": "from afmd.pipeline import X\n", "pipeline.py": ""}, "imports afmd.pipeline"),
        ({"logs.py": "from afmd import cli\n", "cli.py": ""}, "imports afmd.cli"),
        ({"output/__init__.py": "", "output/x.py": "from .. import server\n", "server.py": ""},
         "afmd.output.x (layer 2) imports afmd.server"),
        ({"config.py": "def f():\n    import afmd.logs\n", "logs.py": ""}, "imports afmd.logs"),
        ({"engine/__init__.py": "", "engine/m.py": "from afmd.http.app import A\n",
          "http/__init__.py": "", "http/app.py": ""}, "lower layers must not import higher"),
        ({"pipeline.py": "import importlib\nimportlib.import_module('afmd.server')\n",
          "server.py": ""}, "imports afmd.server"),
        # heavy imports outside their layer
        ({"pipeline.py": "from sanic import Request\n"}, "only afmd.http.*, afmd.server"),
        ({"cli.py": "def f():\n    import sanic\n"}, "may import sanic"),
        ({"pipeline.py": "import mlx.core as mx\n"}, "may import mlx"),
        ({"chat.py": "def f():\n    from mlx_lm import load\n"}, "may import mlx_lm"),
        # a module nobody placed
        ({"newthing.py": ""}, "afmd.newthing has no layer"),
        ({"tooling/__init__.py": "import mlx\n"}, "afmd.tooling has no layer"),
        ({"tooling/__init__.py": "import mlx\n"}, "may import mlx"),
        ({"grammar/__init__.py": "import afmd.turn\n", "turn.py": ""},
         "afmd.grammar (layer 3) imports afmd.turn (layer 3.5)"),
        # the primitives every dialect's parser shares import no parser of a body
        ({"protocol/__init__.py": "", "protocol/request.py": "",
          "protocol/fields.py": "from afmd.protocol.request import KNOWN_FIELDS\n"},
         "afmd.protocol.fields (layer 1.7) imports afmd.protocol.request (layer 2)"),
        ({"protocol/__init__.py": "", "protocol/tools.py": "",
          "protocol/fields.py": "from afmd.protocol import tools\n"},
         "afmd.protocol.fields (layer 1.7) imports afmd.protocol.tools (layer 1.8)"),
    ],
)
def test_checker_catches_violations(tmp_path: Path, files: dict[str, str], needle: str) -> None:
    problems = check(_tree(tmp_path, files), SAMPLE_LAYERS, SAMPLE_RESTRICTED)
    assert any(needle in p for p in problems), problems


def test_circles_are_found_however_imported(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "engine/__init__.py": "",
        "engine/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                       "    from afmd.engine.b import B\n",
        "engine/b.py": "def f():\n    from afmd.engine import c\n",
        "engine/c.py": "from . import a\n",
        "engine/d.py": "from afmd.engine import a\n",
    })
    assert import_circles(root) == [["afmd.engine.a", "afmd.engine.b", "afmd.engine.c"]]
