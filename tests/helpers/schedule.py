"""How pytest-xdist's ``--dist loadfile`` hands the suite to its workers (tests/conftest.py
installs it).

Each file goes to one worker, as with xdist's own loadfile, so a module's server starts
once. Two differences. Files are handed out in collection order (the conftest puts the
longest first and the frozen build's last), not by their number of tests: xdist's order
would start a file with one long test (the quick benchmark) last, with the other workers
idle meanwhile. And a file whose tests share nothing costly across parameters is split
into one unit per parameter, so that one long file does not keep a worker busy while the
others have finished.
"""

from __future__ import annotations

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

#: Files split into a unit per parametrization id: their module fixture builds and loads
#: each parameter's model on first use, so a worker pays only for the parameters it runs.
SPLIT_BY_PARAMETER = frozenset({"test_tool_formats_e2e.py"})


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its file, or for SPLIT_BY_PARAMETER its file and
    parametrization id (``tests/f.py::[id]``)."""
    path, _, name = nodeid.partition("::")
    if path.rsplit("/", 1)[-1] in SPLIT_BY_PARAMETER and name.endswith("]") and "[" in name:
        return f"{path}::{name[name.index('['):]}"
    return path


class FileSchedule(LoadScopeScheduling):
    """xdist's loadfile, in collection order, with SPLIT_BY_PARAMETER's files split."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # hand units out in collection order

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)
