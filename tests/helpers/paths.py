"""Where the repository and the test suite are, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

#: tests/, the folder holding the conftest, helpers/, data/ and tools/.
TESTS_DIR = Path(__file__).resolve().parent.parent
#: The repository's root: afmd/, bench/, docs/, pyproject.toml.
REPO_ROOT = TESTS_DIR.parent
