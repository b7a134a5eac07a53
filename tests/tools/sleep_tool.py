"""Server tool that records its pid and then sleeps far past any test's tool timeout."""

import os
import sys
import time

sys.stdin.read()
mark = os.environ.get("MARK_FILE")
if mark:
    with open(mark, "a", encoding="utf-8") as fh:
        fh.write(f"{os.getpid()}\n")
time.sleep(float(os.environ.get("SLEEP_S", "30")))
print("{}")
