"""MLX's own launcher (``mlx.launch``), run from afmd itself: every MLX private afmd relies
on, and nothing else.

A frozen afmd has no ``mlx.launch`` script beside it, so ``afmd launch`` runs this through
a hidden verb of the same binary (``afmd _mlx-launch ARGS``); it is MLX's code, with one
change: its per-rank relay threads wait on each rank's stdin being writable, which a pipe
always is, so they spun a core between them. afmd's ranks read no stdin, so the relay
waits on their output only.

Written against **mlx 0.32.4**, whose launcher is the private module
``mlx._distributed_utils.launch`` (``main``, and the ``select`` it imported by name, which
the relay calls). It stays apart from :mod:`afmd.engine.mlx_compat`, which guards mlx-lm's
and mlx-vlm's privates, because importing that one imports mlx-lm (and transformers) and
the launcher's relay process, alive as long as the group, has no use for either; this one
imports MLX alone. :func:`upstream_problems` names what an upgrade of MLX changed of what is
used here (``tests/meta/test_launcher_compat.py`` fails with its list), and
``tests/meta/test_mlx_compat.py`` checks that no other module reaches into MLX's privates.
"""

from __future__ import annotations

import hashlib
import inspect
import select
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

MLX_VERSION = "0.32.4"

#: ``mlx._distributed_utils.launch``'s code this module relies on, with a fingerprint of its
#: source in mlx 0.32.4: the relay loop calls ``select`` once per turn on each rank's
#: pipes, and ``main`` reads ``sys.argv``.
MLX_CODE: dict[str, str] = {
    "main": "ff6511da26d86937",
    "_launch_with_io": "247625f080c8fcf1",
}


def _outputs_only(rlist: Any, wlist: Any, xlist: Any, timeout: float | None = None) -> Any:
    readable, _, errors = select.select(rlist, [], xlist, timeout)
    return readable, [], errors


def _launch_module() -> ModuleType:
    from mlx._distributed_utils import launch

    return launch


def mlx_launch(argv: Sequence[str]) -> int:
    launch = _launch_module()
    launch.select = _outputs_only  # type: ignore[attr-defined]
    sys.argv = ["mlx.launch", *argv]
    launch.main()
    return 0


def upstream_problems() -> list[str]:
    """What an upgrade of MLX changed of what this module relies on; empty when nothing
    did. Each entry names what to re-read."""
    import mlx.core as mx

    try:
        launch = _launch_module()
    except ImportError as exc:
        return [f"mlx has no mlx._distributed_utils.launch ({exc})"]
    problems = []
    for name, fingerprint in MLX_CODE.items():
        try:
            seen = hashlib.sha256(inspect.getsource(getattr(launch, name)).encode()).hexdigest()
        except (AttributeError, OSError, TypeError):
            problems.append(f"mlx._distributed_utils.launch.{name}: its source cannot be read")
            continue
        if seen[:16] != fingerprint:
            problems.append(f"mlx._distributed_utils.launch.{name} is not the one of mlx "
                            f"{MLX_VERSION} (mlx {mx.__version__} installed; fingerprint "  # type: ignore[attr-defined]  # not in mlx.core's stub
                            f"{seen[:16]})")
    if getattr(launch, "select", None) is not select.select and (
            getattr(launch, "select", None) is not _outputs_only):
        problems.append("mlx._distributed_utils.launch no longer calls select.select by name")
    return problems
