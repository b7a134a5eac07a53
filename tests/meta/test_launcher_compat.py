"""afmd.engine.sharded.launcher_compat: MLX's own launcher, the one MLX private afmd uses.

First the upgrade alarm: the launcher's code afmd patches must still read as it did in the
MLX version the module names (an upgrade of mlx fails here, naming what to re-read). Then
the patch itself, against the real module, and the reason the module stands apart from
afmd.engine.mlx_compat: the relay process that imports it, alive as long as the group,
never imports mlx-lm (nor transformers through it).
"""

from __future__ import annotations

import select
import subprocess
import sys

from afmd.engine.sharded import launcher_compat

from helpers.paths import REPO_ROOT


def test_upstream_is_what_compat_was_written_against() -> None:
    problems = launcher_compat.upstream_problems()
    assert not problems, (
        f"mlx changed under afmd/engine/sharded/launcher_compat.py (written against mlx "
        f"{launcher_compat.MLX_VERSION}): re-read each of these upstream, adapt compat, then "
        "update its fingerprints:\n  " + "\n  ".join(problems))


def test_the_launcher_relays_outputs_only() -> None:
    readable, writable, errors = launcher_compat._outputs_only([], [0], [], 0)
    assert (readable, writable, errors) == ([], [], [])
    from mlx._distributed_utils import launch

    assert launch.select is select.select  # what mlx_launch replaces, by that name


def test_the_relay_process_imports_no_mlx_lm() -> None:
    """What ``afmd _mlx-launch`` imports before MLX's launcher runs: MLX's launcher module,
    never mlx-lm. A fresh interpreter: this process has imported everything long since."""
    probe = ("import sys\n"
             "from afmd.engine.sharded import launcher_compat\n"
             "launcher_compat._launch_module()\n"
             "print(sorted(m for m in ('mlx_lm', 'transformers', 'afmd.engine.mlx_compat')"
             " if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
