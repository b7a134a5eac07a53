"""How long a server's event loop is held by one request: /health asked again and again
while the request runs. /health is answered from the server's state on the loop, so its
slowest answer is the longest the loop was kept from every other client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx


def worst_health_while(url: str, send: Callable[[], httpx.Response]
                       ) -> tuple[httpx.Response, float]:
    """``send()``'s response, and the slowest /health answer of the server at ``url``
    while it ran (the connection made first, so that its setup is not counted)."""
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(send()))
    worst = 0.0
    with httpx.Client(timeout=60) as http:
        assert http.get(url + "/health").status_code == 200
        sender.start()
        while sender.is_alive():
            started = time.monotonic()
            assert http.get(url + "/health").status_code == 200
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.02)
    sender.join()
    return answer[0], worst
