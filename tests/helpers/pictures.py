"""Pictures for the image tests: random noise (which no codec compresses away, so a file's
size follows its pixels) and a picture's bytes in a format."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image


def noise(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    """An RGB picture of ``size`` (width, height) of random pixels, the same for a seed."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def encoded(picture: Image.Image, fmt: str = "PNG", **options: Any) -> bytes:
    """``picture`` saved as ``fmt`` with Pillow's ``options``."""
    buf = io.BytesIO()
    picture.save(buf, fmt, **options)
    return buf.getvalue()
