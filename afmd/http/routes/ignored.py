"""``X-AFM-Ignored-Fields``: the top-level fields of a body afmd accepted without knowing.

A client whose field was ignored should be able to tell (a misspelt ``temprature`` looks
like a working request otherwise), so every response to such a body names them, and the
debug log does too. The names are the client's own JSON keys, any string at all (``"\\r\\n"``
decodes to a real line break in a key), so the header carries them percent-encoded:
letters, digits and the other token characters of RFC 9110 (``!#$&'*+-.^_`|~``) as they
are, every other byte of the UTF-8 name (``%``, ``,``, spaces, controls, anything
non-ASCII) as ``%XX``. A value is then one line of visible ASCII whatever was sent, and
the commas between names are unambiguous. At most :data:`MAX_NAMES` names are listed, each
cut to at most :data:`MAX_NAME_CHARS` characters of its encoded form, between two of the
name's characters (``...`` marks a cut, and a last ``...`` entry says more names were
ignored).
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from afmd.logs import get_logger

HEADER = "X-AFM-Ignored-Fields"
#: Names listed at most; the rest are counted in the debug log line, not listed.
MAX_NAMES = 16
#: Characters of one encoded name at most.
MAX_NAME_CHARS = 64
_CUT = "..."
# RFC 9110 tchar, less "%", which introduces an escape here.
_KEEP = frozenset((string.ascii_letters + string.digits + "!#$&'*+-.^_`|~").encode())

_log = get_logger("afmd.request")


def _encoded(name: str) -> str:
    """``name`` percent-encoded, cut between characters (never inside one's escapes, so
    what is shown still decodes) when it is too long."""
    parts: list[str] = []
    length = 0
    for ch in name:
        # surrogatepass: a lone surrogate (JSON's "\ud800") is still some bytes to show.
        part = "".join(chr(b) if b in _KEEP else f"%{b:02X}"
                       for b in ch.encode("utf-8", "surrogatepass"))
        parts.append(part)
        length += len(part)
        if length > MAX_NAME_CHARS:
            break
    else:
        return "".join(parts)
    while length > MAX_NAME_CHARS - len(_CUT):
        length -= len(parts.pop())
    return "".join(parts) + _CUT


def header_value(names: Sequence[str]) -> str:
    """The header's value for ``names`` (at least one): safe in any HTTP header."""
    listed = [_encoded(name) for name in names[:MAX_NAMES]]
    if len(names) > MAX_NAMES:
        listed.append(_CUT)
    return ", ".join(listed)


def ignored_headers(names: Sequence[str], request_id: str | None) -> dict[str, str]:
    """The header naming ``names`` ({} when none), the ignored fields logged at debug."""
    if not names:
        return {}
    value = header_value(names)
    # The log's own sanitizer encodes what could forge a line; the header's form is short.
    _log.debug("ignored_fields", request_id=request_id, fields=value, count=len(names))
    return {HEADER: value}
