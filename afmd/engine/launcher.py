"""MLX's own launcher (``mlx.launch``), run from afmd itself.

A frozen afmd has no ``mlx.launch`` script beside it, so ``afmd launch`` runs this through
a hidden verb of the same binary (``afmd _mlx-launch ARGS``); it is MLX's code, unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def mlx_launch(argv: Sequence[str]) -> int:
    from mlx._distributed_utils.launch import main

    sys.argv = ["mlx.launch", *argv]
    main()
    return 0
