"""The shared end-to-end smoke checks (tests/helpers/smoke.py) against the source tree's server.

tests/server/test_frozen_binary.py runs the very same checks against the frozen binary, so the
two stay comparable: a failure only there points at the packaging, not at afmd.
"""

from __future__ import annotations

from conftest import ServerProcess
from helpers.smoke import run_smoke_checks


def test_source_tree_smoke(server: ServerProcess) -> None:
    run_smoke_checks(server.url)
