"""The threads a vision request's images are read, decoded and processed on.

Image work can take seconds a request (a header walked in Python, a large picture decoded
and resized), and requests that each brought such images filled asyncio's default
executor: a text request then waited for a free thread, 14 s behind eight of them on two
cores. On threads of their own (:mod:`afmd.service.own_threads`), image requests wait for
each other, and nothing else waits for them.
"""

from __future__ import annotations

import os

from afmd.service.own_threads import OwnThreads

#: Threads for image work: decoding runs in C without the GIL, so up to a few cores help.
WORKERS = max(2, min(4, os.cpu_count() or 1))

IMAGE_THREADS = OwnThreads(WORKERS, "afmd-images")
