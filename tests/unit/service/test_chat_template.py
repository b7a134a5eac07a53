"""Runs of user turns joined, and late system turns folded, as templates need them: the
same shapes as joining two at a time, in time linear in the conversation."""

from __future__ import annotations

import time
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from afmd.core.request import Message
from afmd.service.chat_template import folded_system_turns, template_messages

SEPARATOR = {"type": "text", "text": "\n\n"}


def joined_pairwise(first: Any, second: Any) -> Any:
    """Two contents as one, as afmd joined them one pair at a time."""
    if isinstance(first, str) and isinstance(second, str):
        return first + "\n\n" + second
    listed = [p if isinstance(p, list) else [{"type": "text", "text": p}]
              for p in (first, second)]
    return [*listed[0], SEPARATOR, *listed[1]]


def folded_one_at_a_time(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    late = [i for i, m in enumerate(messages) if i > 0 and m["role"] == "system"]
    if not late:
        return None
    out = [dict(m) for m in messages]
    for i in late:
        text = out[i]["content"]
        after = next((j for j in range(i + 1, len(out)) if out[j]["role"] == "user"), None)
        if after is not None:
            out[after]["content"] = joined_pairwise(text, out[after]["content"])
            continue
        before = next((j for j in range(i - 1, -1, -1) if out[j]["role"] in ("user", "tool")),
                      None)
        at = before if before is not None else 0
        out[at]["content"] = joined_pairwise(out[at]["content"], text)
    return [m for i, m in enumerate(out) if i not in set(late)]


_parts = st.lists(st.sampled_from([{"type": "text", "text": "t"}, {"type": "image", "image": 1}]),
                  min_size=1, max_size=2)
_content = st.one_of(st.sampled_from(["a", "", "b c"]), _parts)
_turn = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, _content),
    st.builds(lambda c: {"role": "tool", "content": c}, _content),
    st.builds(lambda c: {"role": "system", "content": c}, st.sampled_from(["s", "", "t"])),
    st.builds(lambda c: {"role": "assistant", "content": c}, st.sampled_from(["x", ""])),
)


@given(st.lists(_turn, min_size=1, max_size=9))
def test_folding_matches_folding_one_at_a_time(messages: list[dict[str, Any]]) -> None:
    assert folded_system_turns(messages) == folded_one_at_a_time(messages)


@given(st.lists(st.tuples(st.sampled_from(["user", "user", "assistant", "system"]),
                          st.sampled_from(["a", "", "q r"])), min_size=1, max_size=9),
       st.sampled_from(["", "Be brief."]))
def test_user_runs_join_as_two_at_a_time(turns: list[tuple[str, str]],
                                         instructions: str) -> None:
    messages = tuple(Message(role, content) for role, content in turns)
    expected: list[dict[str, Any]] = []
    system = [instructions] if instructions else []
    system += [content for role, content in turns if role == "system" and content]
    if system:
        expected.append({"role": "system", "content": "\n\n".join(system)})
    for role, content in turns:
        if role == "system":
            continue
        if role == "user" and expected and expected[-1]["role"] == "user":
            expected[-1]["content"] = joined_pairwise(expected[-1]["content"], content)
        else:
            expected.append({"role": role, "content": content})
    assert template_messages(messages, instructions=instructions) == expected


def test_long_runs_take_linear_time() -> None:
    """Joined two at a time, each join copied all joined before it: 300,000 one-letter
    user messages (a 10 MB body) took from seconds to past the server's response timeout
    to render, and 20,000 late system turns took 19 s to fold."""
    started = time.perf_counter()
    users = template_messages(tuple(Message("user", "a") for _ in range(300_000)))
    assert users == [{"role": "user", "content": "\n\n".join(["a"] * 300_000)}]
    folded = folded_system_turns([{"role": "user", "content": "u"},
                                  *[{"role": "system", "content": "s"}] * 30_000,
                                  {"role": "user", "content": "v"}])
    assert folded is not None and len(folded) == 2
    assert folded[1]["content"] == "\n\n".join(["s"] * 30_000 + ["v"])
    assert time.perf_counter() - started < 10
