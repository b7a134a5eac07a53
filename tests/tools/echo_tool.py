"""Server tool for the tests: reads JSON arguments on stdin, records them, answers JSON.

One line per run is appended to ``$MARK_FILE`` (set through the tool's ``env``) with the
arguments and the bits of the environment the tests check; stdout gets one JSON value
holding ``$TOOL_NONCE``, a string no model could produce by chance.
"""

import json
import os
import sys


def main() -> None:
    raw = sys.stdin.read()
    args = json.loads(raw)
    record = {
        "pid": os.getpid(),
        "args": args,
        "raw": raw,
        "env_keys": sorted(os.environ),
        "secret": os.environ.get("AFMD_TEST_SECRET"),
        "path": os.environ.get("PATH"),
        "nonce": os.environ.get("TOOL_NONCE"),
    }
    with open(os.environ["MARK_FILE"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
    word = args.get("word", "") if isinstance(args, dict) else ""
    json.dump({"result": f"{os.environ.get('TOOL_NONCE', '')}-{str(word).upper()}"}, sys.stdout)


if __name__ == "__main__":
    main()
