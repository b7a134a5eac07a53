"""afmd.service.pillow_compat: the one module that reaches into Pillow's privates.

First the upgrade alarm: what compat relies on must still read as it did in the version it
names. Then what it gives, against the real library: where a JPEG's first scan begins, as
the scan guard's own walk from the file's start finds it, for the JPEGs encoders write
and for hostile and odd ones; and that where Pillow's walk and the guard's part, libjpeg
decodes nothing, so counting from Pillow's first scan loses no scan it would decode.
No other afmd module imports Pillow's plugins.
"""

from __future__ import annotations

import io
import re

import pytest
from PIL import Image

from afmd.service import images, pillow_compat

from helpers.paths import REPO_ROOT
from helpers.pictures import encoded, noise

#: The size of the cases' pictures (they were written with it).
SIZE = (40, 24)


def test_upstream_is_what_compat_was_written_against() -> None:
    problems = pillow_compat.upstream_problems()
    assert not problems, (
        f"Pillow changed under afmd/service/pillow_compat.py (written against Pillow "
        f"{pillow_compat.PILLOW_VERSION}): re-read each of these upstream, adapt compat, "
        "then update its fingerprints:\n  " + "\n  ".join(problems))


def test_no_other_module_reaches_into_pillow_plugins() -> None:
    pattern = re.compile(r"PIL\.\w+Plugin|from PIL import .*Plugin|_afmd_first_scan_end")
    users = [path.relative_to(REPO_ROOT).as_posix()
             for path in (REPO_ROOT / "afmd").rglob("*.py")
             if pattern.search(path.read_text())]
    assert users == ["afmd/service/pillow_compat.py"]




def first_scan_by_walking(data: bytes) -> int:
    """Where the guard's own walk from the start finds the first scan's data."""
    at = 2
    while True:
        marker = images._JPEG_MARKER.search(data, at)
        assert marker is not None and marker[0][1] != 0xD9
        at = marker.end()
        if marker[0][1] in (0x01, 0xD8):
            continue
        length = int.from_bytes(data[at:at + 2], "big")
        if marker[0][1] == 0xDA:
            return at + length
        at += length


def turned() -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = 6
    return exif


def progressive(extra_scans: int) -> bytes:
    data = encoded(Image.new("RGB", (64, 64), (10, 120, 200)), "JPEG", progressive=True)
    last = data.rindex(b"\xff\xda")
    return data[:-2] + data[last:-2] * extra_scans + data[-2:]


BASE = encoded(noise(1, SIZE), "JPEG")

JPEGS = {
    "baseline": BASE,
    "progressive": encoded(noise(2, SIZE), "JPEG", progressive=True),
    "many scans": progressive(150),
    "cmyk": encoded(noise(3, SIZE).convert("CMYK"), "JPEG"),
    "grey, restarts": encoded(noise(4, SIZE).convert("L"), "JPEG", restart_marker_blocks=1),
    "exif, icc": encoded(noise(5, SIZE), "JPEG", exif=turned(),
                         icc_profile=b"\0" * 300),
    "empty segments": BASE[:2] + b"\xff\xe5\x00\x02" * 5000 + BASE[2:],
    "comments": BASE[:2] + b"\xff\xfe\x00\x05abc" * 50 + BASE[2:],
    # between segments: junk, fill bytes, a stuffed zero, a restart marker
    "junk and fill": BASE[:2] + b"\xff\xe5\x00\x02" + b"junk\xff\x00\xff\xff\xff\xd3zz"
    + BASE[2:],
    "mpo": encoded(noise(6, SIZE), "MPO", save_all=True, append_images=[noise(7, SIZE)]),
}


@pytest.mark.parametrize("name", list(JPEGS))
def test_the_first_scan_is_where_the_guard_would_find_it(name: str) -> None:
    data = JPEGS[name]
    with Image.open(io.BytesIO(data), formats=images.FORMATS) as picture:
        assert picture.format in ("JPEG", "MPO")
        at = pillow_compat.first_scan_end(picture)
    assert at == first_scan_by_walking(data)
    assert images._jpeg_scans(data, at) == images._jpeg_scans(data)


def test_other_formats_have_no_first_scan() -> None:
    with Image.open(io.BytesIO(encoded(noise(1, SIZE), "PNG"))) as picture:
        assert pillow_compat.first_scan_end(picture) is None


# Markers before the first scan that Pillow's walk and the guard's read differently.
JPG0 = BASE[:2] + b"\xff\xf0\x00\x04\xff\xda" + BASE[2:]
JPG = BASE[:2] + b"\xff\xc8" + BASE[2:]
EARLY_END = BASE[:2] + b"\xff\xd9" + progressive(150)


def test_where_the_walks_part_no_scan_is_decoded_uncounted() -> None:
    """Pillow takes the JPGn extensions as markers without a length (the guard reads
    one): such a file does not open, or libjpeg refuses it before any scan. Pillow reads
    past an end of image before the first scan, and libjpeg decodes the frame after it:
    counted from Pillow's first scan, its scans are all counted."""
    with pytest.raises(OSError):
        Image.open(io.BytesIO(JPG0), formats=images.FORMATS)
    with Image.open(io.BytesIO(JPG), formats=images.FORMATS) as picture, \
            pytest.raises(OSError):
        picture.load()
    with Image.open(io.BytesIO(EARLY_END), formats=images.FORMATS) as picture:
        at = pillow_compat.first_scan_end(picture)
        picture.load()
    assert images._jpeg_scans(EARLY_END, at) == images.MAX_JPEG_SCANS + 1
    # Walked from the start (where Pillow's first scan is not known), the same.
    assert images._jpeg_scans(EARLY_END) == images.MAX_JPEG_SCANS + 1
