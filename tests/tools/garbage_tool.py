"""Server tool whose stdout is not JSON."""

import sys

sys.stdin.read()
print("this is not json {")
