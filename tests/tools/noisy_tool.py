"""Server tool that writes far more than a pipe buffer to stderr, then valid JSON."""

import json
import sys

sys.stdin.read()
for _ in range(40):
    sys.stderr.write("progress " * 1000 + "\n")  # ~360 KB in all
sys.stderr.flush()
json.dump({"ok": True}, sys.stdout)
