"""Every Pillow private afmd depends on, and nothing else.

Written against **Pillow 13.0.0** (``PIL/JpegImagePlugin.py``). No other afmd module
reaches into it, and :func:`upstream_problems` names whatever an upgrade moved or rewrote
of what is used here; ``tests/meta/test_pillow_compat.py`` fails loudly with its list.

What afmd needs from it, and how:

* **Where a JPEG's first scan begins** (:func:`first_scan_end`). Opening a JPEG walks its
  segments in Python up to the first scan's header (``JpegImageFile._open``), which is
  where a hostile file hides millions of them; the scan guard
  (:func:`afmd.service.images.decode`) counts the scans after that point, so it goes on
  from where the open stopped instead of walking the same segments again. Pillow keeps no
  note of that point (an MPO even rewinds its file), so the handler its marker table names
  for the start of scan (``MARKER[0xFFDA]``) is wrapped to note it on the picture.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

import PIL
from PIL import Image, JpegImagePlugin

PILLOW_VERSION = "13.0.0"

_Handler = Callable[[JpegImagePlugin.JpegImageFile, int], None]

#: The start-of-scan marker, whose handler is wrapped.
_SOS = 0xFFDA
#: The attribute the wrapped handler sets on the picture it opens.
_NOTE = "_afmd_first_scan_end"

# What the wrapper relies on: _open calls the table's handler for a start of scan and
# stops there; Skip reads the segment's length and leaves the file past it.
UPSTREAM_CODE: dict[str, tuple[Callable[..., Any], str]] = {
    "JpegImageFile._open": (JpegImagePlugin.JpegImageFile._open, "7866238a94401acc"),
    "Skip": (JpegImagePlugin.Skip, "90c1c4b1e52fec44"),
}


def _fingerprint(obj: Callable[..., Any]) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def _noting(handler: _Handler) -> _Handler:
    def start_of_scan(picture: JpegImagePlugin.JpegImageFile, marker: int) -> None:
        handler(picture, marker)
        if picture.fp is not None:
            setattr(picture, _NOTE, picture.fp.tell())

    start_of_scan.afmd_wraps = handler  # type: ignore[attr-defined]
    return start_of_scan


def _install() -> bool:
    """Wrap the start-of-scan handler once; False where the table is not as written
    against (then :func:`first_scan_end` knows nothing, and the guard walks it all)."""
    entry = getattr(JpegImagePlugin, "MARKER", {}).get(_SOS)
    if not (isinstance(entry, tuple) and len(entry) == 3 and entry[0] == "SOS"
            and callable(entry[2])):
        return False
    name, description, handler = entry
    if not hasattr(handler, "afmd_wraps"):
        table: dict[int, Any] = JpegImagePlugin.MARKER  # its handlers' parameters are named
        table[_SOS] = (name, description, _noting(handler))
    return True


INSTALLED = _install()


def first_scan_end(picture: Image.Image) -> int | None:
    """Where the data of the JPEG's first scan begins in the bytes it was opened from (its
    start-of-scan header read), as its open found it; None for a picture of another format
    or one Pillow opened without reaching a scan."""
    if not isinstance(picture, JpegImagePlugin.JpegImageFile):
        return None
    at = getattr(picture, _NOTE, None)
    return at if isinstance(at, int) else None


def upstream_problems() -> list[str]:
    """What an upgrade of Pillow changed of what this module relies on; empty when nothing
    did. Each entry names what to re-read."""
    problems = []
    for name, (obj, fingerprint) in UPSTREAM_CODE.items():
        try:
            seen = _fingerprint(obj)
        except (OSError, TypeError) as exc:
            problems.append(f"Pillow {name}: its source cannot be read ({exc})")
            continue
        if seen != fingerprint:
            problems.append(f"Pillow {name} is not the one of Pillow {PILLOW_VERSION} "
                            f"(Pillow {PIL.__version__} installed; fingerprint {seen})")
    if not INSTALLED:
        problems.append("Pillow JpegImagePlugin.MARKER[0xFFDA] is not ('SOS', ..., handler)")
    return problems
