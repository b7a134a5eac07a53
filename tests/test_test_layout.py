"""The test suite's own layout: test files stay independent of one another.

A test file that imports another runs that file's module-level code (its fixtures and
constants, sometimes its parametrized tables) wherever it is imported, ties the two files'
edits together, and makes ``pytest tests/test_a.py`` depend on ``tests/test_b.py``. Shared
code lives in ``tests/helpers/`` (or, for fixtures, ``tests/conftest.py``), and every
module in ``tests/`` is either a test file or the conftest.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
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
        for path in sorted([*TESTS.glob("*.py"), *HELPERS.rglob("*.py")])
        for line, name in _imported(path)
        if _is_test_module(name)
    ]
    assert not offenders, "shared code belongs in tests/helpers/:\n" + "\n".join(offenders)


def test_tests_folder_holds_only_test_files_and_the_conftest() -> None:
    strays = [path.name for path in sorted(TESTS.glob("*.py"))
              if not path.name.startswith("test_") and path.name != "conftest.py"]
    assert not strays, f"move these into tests/helpers/: {strays}"


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
    assert sorted(name for name in named if not (TESTS / name).is_file()) == []


def test_a_split_file_is_one_unit_per_parameter() -> None:
    from helpers.schedule import unit_of

    split = "tests/test_tool_formats_e2e.py"
    assert unit_of(f"{split}::test_a[hermes]") == f"{split}::[hermes]"
    assert unit_of(f"{split}::test_b[hermes]") == f"{split}::[hermes]"
    assert unit_of(f"{split}::test_plain") == split
    assert unit_of("tests/test_cli.py::test_version[x]") == "tests/test_cli.py"
