"""Where the repository and the test suite are, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

#: tests/, the folder holding the conftest, helpers/, data/ and tools/.
TESTS_DIR = Path(__file__).resolve().parent.parent
#: The repository's root: afmd/, bench/, docs/, pyproject.toml.
REPO_ROOT = TESTS_DIR.parent
#: What test runs keep for later runs, of this checkout or another (the agents' installs,
#: mypy's cache): each entry is keyed by what it was made from, so a fresh clone reuses
#: it instead of paying minutes of CPU again.
USER_CACHE = Path.home() / ".cache" / "afmd-tests"
