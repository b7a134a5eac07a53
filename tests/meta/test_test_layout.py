"""The test suite's own layout: test files stay independent of one another.

A test file that imports another runs that file's module-level code (its fixtures and
constants, sometimes its parametrized tables) wherever it is imported, ties the two files'
edits together, and makes ``pytest tests/test_a.py`` depend on ``tests/test_b.py``. Shared code
lives in ``tests/helpers/`` (or, for fixtures, ``tests/conftest.py``). Test files
sit by kind: ``tests/unit/<package>/`` runs no server process, ``tests/server/`` does, and
``tests/meta/`` checks the tree itself (layering, lint, compat fingerprints, docs, this layout).
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from helpers.paths import TESTS_DIR

TESTS = TESTS_DIR
HELPERS = TESTS / "helpers"


def _imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every absolute import in ``path``, at any depth of the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _is_test_module(name: str) -> bool:
    return name.split(".")[0].startswith("test_")


def test_no_module_imports_a_test_module() -> None:
    offenders = [
        f"{path.relative_to(TESTS)}:{line} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, name in _imported(path)
        if _is_test_module(name)
    ]
    assert not offenders, "shared code belongs in tests/helpers/:\n" + "\n".join(offenders)


def test_tests_folder_holds_only_test_files_and_the_conftest() -> None:
    strays = [str(path.relative_to(TESTS)) for path in sorted(TESTS.rglob("*.py"))
              if path.parts[len(TESTS.parts)] not in ("helpers", "tools", "data")
              and not path.name.startswith("test_") and path != TESTS / "conftest.py"]
    assert not strays, f"move these into tests/helpers/: {strays}"


#: Where test files live: by kind, and a unit test by the package it tests.
KINDS = ("unit", "server", "meta")


def test_every_test_file_sits_in_its_kind() -> None:
    misplaced = []
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(TESTS).parts
        if rel[0] in ("helpers", "tools", "data"):
            continue
        if rel[0] not in KINDS or (rel[0] == "unit") != (len(rel) == 3) or (
                rel[0] != "unit" and len(rel) != 2):
            misplaced.append("/".join(rel))
    assert not misplaced, (
        "test files go in tests/unit/<package>/, tests/server/ or tests/meta/: "
        + ", ".join(misplaced))


def test_test_file_names_are_unique() -> None:
    """pytest imports a test file by its name (rootdir-less ``prepend`` mode): two files of
    one name in two folders would collide, and the conftest's schedules name files alone."""
    names = Counter(path.name for path in TESTS.rglob("test_*.py")
                    if path.relative_to(TESTS).parts[0] not in ("helpers", "tools", "data"))
    assert [name for name, n in names.items() if n > 1] == []


def test_the_checks_see_an_import_of_a_test_module(tmp_path: Path) -> None:
    """The AST walk finds both import forms, inside functions too."""
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom helpers.raw_http import RawConn\n"
                      "def f():\n    from test_transport import x\n    import test_cli.sub\n")
    found = [name for _, name in _imported(sample) if _is_test_module(name)]
    assert found == ["test_transport", "test_cli.sub"]


def test_the_schedules_file_names_are_test_files() -> None:
    """A renamed or removed file would silently drop out of the conftest's tables."""
    from conftest import LONGEST_FILES, SLOW_FILES
    from helpers.schedule import SPLIT_BY_PARAMETER

    named = {*LONGEST_FILES, *SLOW_FILES, *SPLIT_BY_PARAMETER}
    assert sorted(name for name in named if not list(TESTS.rglob(name))) == []


def test_a_split_file_is_one_unit_per_parameter() -> None:
    from helpers.schedule import unit_of

    split = "tests/server/test_tool_formats_e2e.py"
    assert unit_of(f"{split}::test_a[hermes]") == f"{split}::[hermes]"
    assert unit_of(f"{split}::test_b[hermes]") == f"{split}::[hermes]"
    assert unit_of(f"{split}::test_plain") == split
    assert unit_of("tests/server/test_cli.py::test_version[x]") == "tests/server/test_cli.py"
