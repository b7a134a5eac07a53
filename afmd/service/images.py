"""A request's image parts decoded into pictures a vision model's processor takes.

Decoding runs only for a vision model (a text-only one refuses images before this), off
the event loop, and each failure is the client's 400 naming the part: bytes that are no
image Pillow reads in the formats the API accepts (PNG, JPEG, WebP, GIF) are
``invalid_image``; a picture larger than ``[models] max_image_pixels`` is
``image_too_large``, decided from the header before any pixel is decoded, because the
decoded RGB array is what costs memory (three bytes a pixel, however small the file); so
are a request's pictures past ``[models] max_request_image_pixels`` together, and more
than ``[models] max_request_images`` of them is ``too_many_images``. Time is
bounded the same way: decoding is proportional to the pixels, except a progressive JPEG's,
which passes over them once per scan, so a JPEG of more than :data:`MAX_JPEG_SCANS` is
``invalid_image`` too.

An animated GIF gives its first frame; transparency is flattened onto white, since
vision models take RGB; a picture whose EXIF says it is turned (a phone's photo) is turned
upright; a 16-bit greyscale PNG is read by its high bytes.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageFile

from afmd.core.request import ImageInput
from afmd.errors import InvalidRequestError
from afmd.service import pillow_compat

#: Pillow's names of the formats the image parts may carry.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")

#: The scans a JPEG may have. Each scan of a progressive JPEG passes over every block of
#: the picture, however few bytes it takes: a repeated last scan of a few bytes costs a
#: whole pass each, so a body of them makes a decode of hours on a thread nothing can
#: interrupt (docs/hardening.md). Encoders write about ten (libjpeg's progressive
#: script); NVIDIA's nvImageCodec refuses past 256 for the same reason.
MAX_JPEG_SCANS = 100
# A marker: 0xFF and a code that is none of a stuffed zero, a restart marker (both inside
# a scan's data) or another 0xFF (fill).
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")

# Pillow's own bomb check would raise (past twice its limit) or warn before ours runs;
# afmd's limit is the operator's and is checked first.
Image.MAX_IMAGE_PIXELS = None
# A truncated file is an error, not a picture with a grey bottom.
ImageFile.LOAD_TRUNCATED_IMAGES = False


@dataclass(slots=True)
class Header:
    """An image part as its one open left it, for every later step to go on from: Pillow
    reads a header in Python through all the metadata before the pixels (seconds for a
    body's worth of it), so the pixel total, the size limit, the scan guard and the decode
    each opening the file again multiplied what a hostile one costs the image threads."""

    #: The picture opened, nothing decoded yet (its size and mode read); None: the bytes
    #: are no image Pillow reads in :data:`FORMATS`.
    picture: Image.Image | None
    #: A JPEG's: where its first scan's data begins, the open's walk having reached it
    #: (:func:`afmd.service.pillow_compat.first_scan_end`); None: the guard walks it all.
    first_scan_end: int | None = None


def read_header(image: ImageInput) -> Header:
    """The part opened, or noted as no image: blocking, as :func:`check_total` says."""
    try:
        picture = Image.open(io.BytesIO(image.data), formats=FORMATS)
    except Exception:
        return Header(None)
    return Header(picture, pillow_compat.first_scan_end(picture))


class Headers:
    """A request's image parts as opened for their pixel total, each given once to
    :func:`decode` (:meth:`take`), which decodes from it instead of opening the file again.
    A later round (after server tools ran) opens its pictures anew: the open pictures go
    with their first decode, whose memory is let go after each round."""

    __slots__ = ("_by_part", "pixels")

    def __init__(self) -> None:
        #: The pixels the request's pictures will take decoded.
        self.pixels = 0
        self._by_part: dict[int, Header] = {}

    def add(self, image: ImageInput, header: Header) -> None:
        self._by_part[id(image)] = header

    def take(self, image: ImageInput) -> Header | None:
        """The part's header, once; None after (or for a part not read here)."""
        return self._by_part.pop(id(image), None)


def media_type(data: bytes) -> str | None:
    """The media type of the format whose signature ``data`` starts with, the way Pillow
    picks the decoder for it; None for bytes of none of :data:`FORMATS`, which
    :func:`decode` names when a vision model decodes them.

    Only the first bytes are read: this runs while a body is parsed, on the event loop,
    where opening the file would walk all of its metadata in Python first (a JPEG of a
    few million empty segments took seconds)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def check_total(images: Sequence[ImageInput], max_total: int,
                max_images: int | None = None) -> Headers:
    """The pixels ``images`` will take decoded, read from their headers before any is
    decoded, or the 400 for a request whose pictures together pass ``max_total``: the
    pictures of one request are held at once (the processor takes them together), so the
    per-image limit alone does not bound memory. An image whose header does not read
    counts nothing; :func:`decode` names it. The headers read are kept for :func:`decode`.

    More than ``max_images`` is refused before any header is read: the processor scales
    every picture up to its smallest input and keeps its patches and Python objects, a
    fixed cost per image that no pixel count sees, so a body of one-pixel PNGs (a hundred
    bytes each) cost hundreds of kilobytes of memory and a few milliseconds of a core per
    byte-sized image, and was refused for its context only after all of it.

    Blocking: Pillow reads a header in Python, through whatever metadata comes before
    the pixels, so a body's worth of it takes seconds; call it off the event loop."""
    if max_images is not None and len(images) > max_images:
        raise InvalidRequestError(
            f"This request has {len(images)} images; this server takes at most "
            f"{max_images} in one request ([models] max_request_images), a conversation's "
            "earlier turns included. Send fewer images.",
            code="too_many_images",
            param=images[max_images].param,
        )
    headers = Headers()
    for image in images:
        header = read_header(image)
        headers.add(image, header)
        if header.picture is None:
            continue
        width, height = header.picture.size
        headers.pixels += width * height
        if headers.pixels > max_total:
            raise InvalidRequestError(
                f"The images of this request have {headers.pixels} pixels up to and "
                f"including this one, more than this server's limit of {max_total} for one "
                "request ([models] max_request_image_pixels); send fewer or smaller images.",
                code="image_too_large",
                param=image.param,
            )
    return headers


def decode(image: ImageInput, max_pixels: int, header: Header | None = None) -> Image.Image:
    """The part's picture as RGB, or the 400 that names why it cannot be one; from
    ``header`` when :func:`check_total` read it (taken from its :class:`Headers`), which
    is then used up."""
    if header is None:
        header = read_header(image)
    picture = header.picture
    if picture is None:
        raise _invalid(image, "is not a PNG, JPEG, WebP or GIF image")
    width, height = picture.size
    if width * height > max_pixels:
        raise InvalidRequestError(
            f"The image is {width}x{height} = {width * height} pixels, more than this "
            f"server's limit of {max_pixels} ([models] max_image_pixels); send a smaller "
            "image.",
            code="image_too_large",
            param=image.param,
        )
    if picture.format in ("JPEG", "MPO") \
            and _jpeg_scans(image.data, header.first_scan_end) > MAX_JPEG_SCANS:
        raise _invalid(image, f"is a JPEG of more than {MAX_JPEG_SCANS} scans, which this "
                       "server does not decode (encoders write about ten)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. a PNG's oversized text chunk
            picture.seek(0)  # an animated GIF: its first frame
            picture.load()
            return _upright(picture, _rgb(picture))
    except Exception:
        raise _invalid(image, "could not be decoded (truncated or corrupt data)") from None


def _jpeg_scans(data: bytes, first_scan_end: int | None = None) -> int:
    """The scans (SOS segments) of a JPEG's first picture, counted up to one past
    :data:`MAX_JPEG_SCANS`: its segments walked by their lengths as libjpeg reads them,
    and a scan's data (or junk between segments) skipped to the next marker. From
    ``first_scan_end`` (the first scan counted) when the open's walk reached it: up to
    there Pillow's walk and this one read the same segments by the same lengths, so
    walking that part again would count nothing new. Where they part (a JPGn extension,
    an end of image before any scan) the file does not open, libjpeg refuses it before
    any scan, or the frame libjpeg decodes is the one counted
    (``tests/meta/test_pillow_compat.py``); walked from the start, an end of image before
    any scan is read past as they read it, so the frame they decode is counted too."""
    scans, at = (0, 2) if first_scan_end is None else (1, first_scan_end)  # 2: past SOI
    while scans <= MAX_JPEG_SCANS:
        marker = _JPEG_MARKER.search(data, at)
        if marker is None or (marker[0][1] == 0xD9 and scans):  # the data's or picture's end
            break
        at = marker.end()
        if marker[0][1] == 0xD9:  # an end before any scan: Pillow and libjpeg read past it
            continue
        if marker[0][1] in (0x01, 0xD8):  # markers without a length
            continue
        if marker[0][1] == 0xDA:
            scans += 1
        at += int.from_bytes(data[at:at + 2], "big")
    return scans


#: How a picture whose EXIF orientation is the key is turned upright (ImageOps.exif_transpose's).
_ORIENTATIONS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _upright(picture: Image.Image, rgb: Image.Image) -> Image.Image:
    """``rgb`` as the picture is meant to be seen: a camera stores its pixels as the
    sensor read them and says in EXIF how to turn them (a phone held upright: a quarter
    turn), which browsers, transformers' and mlx-vlm's own image loaders apply. EXIF that
    does not read leaves the picture as stored."""
    try:
        orientation = picture.getexif().get(0x0112)
    except Exception:
        return rgb
    method = _ORIENTATIONS.get(orientation) if isinstance(orientation, int) else None
    return rgb if method is None else rgb.transpose(method)


def _rgb(picture: Image.Image) -> Image.Image:
    if picture.mode == "RGB":
        return picture
    if picture.mode == "P" and "transparency" in picture.info:
        picture = picture.convert("RGBA")
    if picture.mode.startswith("I"):
        picture = _grey_16(picture)
    if picture.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = picture.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return picture.convert("RGB")


def _grey_16(picture: Image.Image) -> Image.Image:
    """A 16-bit greyscale PNG (Pillow's ``I;16``, or ``I`` in older versions) as 8-bit
    grey: its high bytes, as its 16-bit colour siblings are read. Pillow's own conversion
    clips the values to 255 instead, so all but the darkest 1/256 of the range came out
    white."""
    import numpy as np

    values = np.asarray(picture).astype(np.uint32, copy=False)
    return Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8), "L")


def _invalid(image: ImageInput, why: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"The image data {why}.", code="invalid_image", param=image.param
    )
