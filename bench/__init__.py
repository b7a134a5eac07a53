"""afmd's benchmark harness: afmd vs mlx_lm.server vs raw in-process mlx-lm.

Run ``python bench/run.py`` (see bench/README.md).
"""
