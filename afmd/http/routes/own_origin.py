"""Actions taken only from afmd's own page or from a client that is not a browser.

``server.allowed_origins`` lets pages of other origins read the API (a web client, an
editor's webview); what changes what the server holds or keeps on disk beyond a request of
its own (the dashboard's load, unload and pull, clearing the KV cache) is refused from any
origin but the server's own, whatever that list says. A browser always sends ``Origin``
with a POST, and ``Sec-Fetch-Site`` where it knows it; ``afmd`` and other programs send
neither.
"""

from __future__ import annotations

from sanic import Request

from afmd.errors import PermissionDeniedError
from afmd.http.sansio.screen import normalize_origin


def refuse_other_origins(request: Request, refusal: str) -> None:
    """Raise a 403 ``origin_not_allowed`` with ``refusal`` unless ``request`` came from
    a page of the very host and port it was sent to, or from no browser at all."""
    origin = request.headers.get("origin")
    host = request.headers.get("host")
    site = (request.headers.get("sec-fetch-site") or "same-origin").lower()
    if (origin is not None and (host is None or
                                normalize_origin(origin) != "http://" + host.lower())) or (
            site not in ("same-origin", "none")):
        raise PermissionDeniedError(refusal)
