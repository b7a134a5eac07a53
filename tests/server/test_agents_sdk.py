"""OpenAI's Agents SDK (``openai-agents``) against the real server: its Responses model,
its session kept in afmd's Conversations API (``OpenAIConversationsSession``), a
conversation by id, ``previous_response_id``, a function tool, a streamed run, and a pending
async call in a session's history. The model is the agents' quick one
(``helpers.agents.quick_model``: it ends its turns soon, as the SDK treats a response cut at
``max_output_tokens`` as a failure)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from openai import AsyncOpenAI

from helpers import agents as agent_tools
from helpers.servers import ServerProcess, start_server

if TYPE_CHECKING:
    from agents import Agent

pytestmark = pytest.mark.slow  # a server of its own, on a model built for it

# The SDK is imported where it is used, not at the top: importing it (and the MCP package
# it brings) is a large share of collecting the whole suite, which every pytest-xdist
# worker does, while only the worker that runs this file uses it.

MODEL = "demo-agent"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = agent_tools.quick_model(tmp_path_factory.mktemp("model"))
    proc = start_server(tmp_path_factory.mktemp("server"),
                        config=f'[[models.model]]\nid = "{MODEL}"\npath = "{model}"\n')
    from agents import set_tracing_disabled

    set_tracing_disabled(True)  # its traces would go to OpenAI
    yield proc
    proc.stop()


def _agent(client: AsyncOpenAI, **settings: Any) -> Agent[Any]:
    from agents import Agent, ModelSettings, OpenAIResponsesModel

    return Agent(name="helper", instructions="Be brief.",
                 model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                 model_settings=ModelSettings(max_tokens=256, **settings))


def _client(server: ServerProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_session_kept_in_a_conversation(server: ServerProcess) -> None:
    from agents import OpenAIConversationsSession, Runner

    async def run() -> None:
        client = _client(server)
        conversation = (await client.conversations.create()).id
        session = OpenAIConversationsSession(conversation_id=conversation,
                                             openai_client=client)
        agent = _agent(client)
        first = await Runner.run(agent, "Hello there", session=session, max_turns=2)
        second = await Runner.run(agent, "And again", session=session, max_turns=2)
        # The second turn's prompt held the first: the session's history came from afmd.
        assert (second.raw_responses[0].usage.input_tokens
                > first.raw_responses[0].usage.input_tokens
                + first.raw_responses[0].usage.output_tokens)
        items = await session.get_items()
        assert [(i.get("role"), i.get("type")) for i in items] == [
            ("user", "message"), ("assistant", "message")] * 2
        listed = [i async for i in client.conversations.items.list(conversation, order="asc")]
        assert [i.id for i in listed] == [i["id"] for i in items]
        popped = await session.pop_item()
        assert popped is not None and popped["id"] == items[-1]["id"]
        assert len(await session.get_items()) == 3
        await session.clear_session()
        with pytest.raises(Exception) as gone:
            await client.conversations.retrieve(conversation)
        assert getattr(gone.value, "status_code", None) == 404

    asyncio.run(run())


def test_a_conversation_by_id_and_a_previous_response(server: ServerProcess) -> None:
    from agents import Runner

    async def run() -> None:
        client = _client(server)
        agent = _agent(client)
        conversation = await client.conversations.create()
        await Runner.run(agent, "Hi", conversation_id=conversation.id, max_turns=2)
        await Runner.run(agent, "Hi again", conversation_id=conversation.id, max_turns=2)
        listed = [i async for i in client.conversations.items.list(conversation.id)]
        assert len(listed) == 4
        first = await Runner.run(agent, "Hi", max_turns=2)
        chained = await Runner.run(agent, "More", previous_response_id=first.last_response_id,
                                   max_turns=2)
        assert (chained.raw_responses[0].usage.input_tokens
                > first.raw_responses[0].usage.input_tokens)

    asyncio.run(run())


def test_a_function_tool_and_a_streamed_run(server: ServerProcess) -> None:
    from agents import Runner, function_tool

    calls: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    async def run() -> None:
        client = _client(server)
        agent = _agent(client, tool_choice="required").clone(
            tools=[add], tool_use_behavior="stop_on_first_tool")
        result = await Runner.run(agent, "Add 2 and 3.", max_turns=2)
        assert len(calls) == 1 and result.final_output == str(sum(calls[0]))
        streamed = Runner.run_streamed(_agent(client), "Say hi.", max_turns=2)
        kinds = [event.type async for event in streamed.stream_events()]
        assert "raw_response_event" in kinds and streamed.is_complete
        assert isinstance(streamed.final_output, str) and streamed.final_output

    asyncio.run(run())


def test_a_pending_async_call_in_the_session(server: ServerProcess) -> None:
    """A call marked ``async`` waits for its output across responses. The SDK keeps such a
    pending call in the history it reads from the conversation (0.25; 0.24 dropped every
    unanswered call), so the conversation must give the flag back and a response must
    take the call without its output, as OpenAI's API does."""
    import httpx
    from agents import OpenAIConversationsSession, Runner

    sent: list[dict[str, Any]] = []

    async def record(request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/responses"):
            sent.append(json.loads(request.content))

    async def run() -> None:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                             http_client=httpx.AsyncClient(event_hooks={"request": [record]}))
        conversation = (await client.conversations.create(items=[
            {"type": "message", "role": "user", "content": "Look it up."},
            {"type": "function_call", "call_id": "call_later", "name": "lookup",
             "arguments": "{}", "async": True}])).id
        session = OpenAIConversationsSession(conversation_id=conversation,
                                             openai_client=client)
        await Runner.run(_agent(client), "Anything else?", session=session, max_turns=2)
        (body,) = sent
        assert [(i.get("type"), i.get("async")) for i in body["input"]][1] == (
            "function_call", True), body["input"]

    asyncio.run(run())
