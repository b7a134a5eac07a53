"""Server tool that complains on stderr and exits with status 3."""

import sys

sys.stdin.read()
sys.stderr.write("boom-stderr: something broke\n")
sys.exit(3)
