"""Server tool that writes more JSON than the test's max_output_bytes."""

import json
import sys

sys.stdin.read()
json.dump({"blob": "x" * 5000}, sys.stdout)
