"""Python-kind server tools: functions afmd loads by file path and calls with the arguments.

``shout`` appends its arguments to ``$AFMD_PYTOOL_MARK`` (when set) so an end-to-end test
can prove afmd called it.
"""

import json
import os


def shout(word: str) -> dict[str, str]:
    mark = os.environ.get("AFMD_PYTOOL_MARK")
    if mark:
        with open(mark, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"word": word}) + "\n")
    return {"shouted": word.upper()}


def explode(word: str) -> None:
    raise ValueError(f"cannot handle {word}")


def not_json(word: str) -> object:
    return {word}  # a set: not JSON-serialisable


def long_answer(word: str) -> dict[str, str]:
    """An answer long enough to push a small context window over (the trim tests)."""
    return {"entry": " ".join(f"{word} means {i}." for i in range(40))}
