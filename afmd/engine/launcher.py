"""MLX's own launcher (``mlx.launch``), run from afmd itself.

A frozen afmd has no ``mlx.launch`` script beside it, so ``afmd launch`` runs this through
a hidden verb of the same binary (``afmd _mlx-launch ARGS``); it is MLX's code, with one
change: its per-rank relay threads wait on each rank's stdin being writable, which a pipe
always is, so they spun a core between them. afmd's ranks read no stdin, so the relay
waits on their output only.
"""

from __future__ import annotations

import select
import sys
from collections.abc import Sequence
from typing import Any


def _outputs_only(rlist: Any, wlist: Any, xlist: Any, timeout: float | None = None) -> Any:
    readable, _, errors = select.select(rlist, [], xlist, timeout)
    return readable, [], errors


def mlx_launch(argv: Sequence[str]) -> int:
    from mlx._distributed_utils import launch

    launch.select = _outputs_only
    sys.argv = ["mlx.launch", *argv]
    launch.main()
    return 0
