"""End-to-end tests: the clients agents are built on, each through the real memproxy in front
of the mock upstream (`examples/mock_upstream.rs`), which speaks chat completions, the Responses
API and the Anthropic Messages API.

For each client, a multi-turn run: the fact told at turn 3 is in the prompt memproxy forwards at
turn 12 (read from the mock's record, `GET /_mock/requests`), the history is stored exactly once
(`x-memory-turns`), and streaming works. Tool calls are scripted on the mock
(`POST /_mock/script`).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import anthropic
import pytest
from openai import AsyncOpenAI, OpenAI

from test_openai_sdk import (
    API_KEY,
    MEMPROXY_BIN,
    MOCK_BIN,
    Servers,
    _assert_no_refusals,
    _start_mock,
    _start_memproxy,
    _stop,
)

# A model the pinned Anthropic SDK calls deprecated (it warns) is one the real API retires:
# the tests name current models, and a warning of it fails them.
pytestmark = pytest.mark.filterwarnings("error:The model .* is deprecated:DeprecationWarning")

FACT = "the locker code is 4417"
TURNS = 12
HEADER = "X-Memory-Conversation-Id"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    for binary in (MOCK_BIN, MEMPROXY_BIN):
        if not binary.exists():
            pytest.fail(f"{binary} is missing: run `cargo build --bins --examples` first")
    workdir = tmp_path_factory.mktemp("memproxy-clients")
    mock, mock_url = _start_mock(workdir)
    proxy = None
    try:
        anthropic_url = mock_url.removesuffix("/v1")
        proxy, port = _start_memproxy(
            workdir, mock_url, f'[upstream.anthropic]\nbase_url = "{anthropic_url}"\n'
        )
        yield Servers(mock_url=mock_url, proxy_port=port)
        _assert_no_refusals(mock_url)
    finally:
        _stop(proxy)
        _stop(mock)


def _mock(servers: Servers, path: str, body: object | None = None) -> object:
    root = servers.mock_url.removesuffix("/v1")
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(root + path, data=data, method="POST" if data else "GET")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=5) as response:
        return json.loads(response.read())


def _last_request(servers: Servers, path: str) -> dict:
    requests = [r for r in _mock(servers, "/_mock/requests") if r["path"].endswith(path)]  # type: ignore[union-attr]
    assert requests, f"no request to {path}"
    return requests[-1]


def _turn_text(i: int) -> str:
    if i == 3:
        return FACT
    if i == TURNS:
        return "what was the locker code again?"
    return f"turn {i}: small talk about item {i}"


@pytest.fixture
def cid() -> str:
    return f"clients-{uuid.uuid4().hex}"


def _openai(servers: Servers, cid: str | None = None) -> OpenAI:
    headers = {HEADER: cid} if cid else {}
    return OpenAI(base_url=servers.base_url, api_key=API_KEY, max_retries=0, timeout=10.0, default_headers=headers)


def test_openai_responses_chained_with_previous_response_id(servers: Servers, cid: str) -> None:
    client = _openai(servers)
    previous = None
    turns = None
    for i in range(1, TURNS + 1):
        extra = {HEADER: cid} if previous is None else {}
        raw = client.responses.with_raw_response.create(
            model="gpt-4.1", instructions="Be brief.", input=_turn_text(i),
            previous_response_id=previous, extra_headers=extra, store=False,
        )
        assert raw.headers["x-memory-status"] == "stored"
        assert raw.headers["x-memory-conversation-id"] == cid
        turns = raw.headers["x-memory-turns"]
        previous = raw.parse().id
    assert turns == str(2 * TURNS), "each turn stored exactly once"
    forwarded = _last_request(servers, "/v1/responses")["body"]
    assert "previous_response_id" not in forwarded
    assert FACT in json.dumps(forwarded["input"])
    assert forwarded["instructions"] == "Be brief."

    # A function-call round, chained.
    _mock(servers, "/_mock/script", {"tool_calls": [["call_w1", "get_weather", '{"city": "Oslo"}']]})
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    response = client.responses.create(model="gpt-4.1", input="weather in Oslo?", tools=tools, previous_response_id=previous)
    call = next(item for item in response.output if item.type == "function_call")
    assert call.call_id == "call_w1"
    response = client.responses.create(
        model="gpt-4.1", previous_response_id=response.id, tools=tools,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "cold and clear"}],
    )
    assert response.output_text == "reply to: tool said: cold and clear"
    forwarded = _last_request(servers, "/v1/responses")["body"]["input"]
    kinds = [item.get("type", "message") for item in forwarded]
    assert kinds[-2:] == ["function_call", "function_call_output"]

    # Streaming, chained.
    with client.responses.stream(model="gpt-4.1", input="stream the answer", previous_response_id=response.id) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "reply to: stream the answer" == final.output_text
    raw = client.responses.with_raw_response.create(model="gpt-4.1", input="count", previous_response_id=final.id)
    assert raw.headers["x-memory-turns"] == str(2 * TURNS + 4 + 4)


def test_openai_chat_completions_twelve_turns(servers: Servers, cid: str) -> None:
    client = _openai(servers, cid)
    history: list[dict[str, object]] = []
    turns = None
    for i in range(1, TURNS + 1):
        history.append({"role": "user", "content": _turn_text(i)})
        raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=history)  # type: ignore[arg-type]
        completion = raw.parse()
        history.append({"role": "assistant", "content": completion.choices[0].message.content})
        turns = raw.headers["x-memory-turns"]
    assert turns == str(2 * TURNS)
    assert FACT in json.dumps(_last_request(servers, "/v1/chat/completions")["body"]["messages"])
    chunks = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "stream"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "reply to: stream"


def test_anthropic_sdk_system_prompt_tool_round_and_stream(servers: Servers, cid: str) -> None:
    client = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{servers.proxy_port}", api_key="sk-ant-e2e",
        default_headers={HEADER: cid}, max_retries=0, timeout=10.0,
    )
    history: list[dict[str, object]] = []
    for i in range(1, TURNS + 1):
        history.append({"role": "user", "content": _turn_text(i)})
        raw = client.messages.with_raw_response.create(model="claude-sonnet-4-6", max_tokens=100, system="Be brief.", messages=history)  # type: ignore[arg-type]
        message = raw.parse()
        history.append({"role": "assistant", "content": message.content})
        assert raw.headers["x-memory-status"] == "stored"
    assert raw.headers["x-memory-turns"] == str(2 * TURNS)
    forwarded = _last_request(servers, "/v1/messages")
    sent = forwarded["headers"]
    assert sent.get("x-api-key") == "sk-ant-e2e" or sent.get("authorization") == "Bearer sk-ant-e2e", sent
    assert "anthropic-version" in forwarded["headers"]
    # The client's system prompt comes first, as sent (a string while memproxy adds no summary
    # or memories block); recalled turns open the newest user turn, out of the cached prefix.
    system = forwarded["body"]["system"]
    assert system == "Be brief." or system[0] == {"type": "text", "text": "Be brief."}, system
    assert FACT in json.dumps(forwarded["body"]["system"][1:]) + json.dumps(forwarded["body"]["messages"])

    # A tool round.
    _mock(servers, "/_mock/script", {"tool_calls": [["toolu_e2e", "get_weather", '{"city": "Oslo"}']]})
    tools = [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    history.append({"role": "user", "content": "weather in Oslo?"})
    message = client.messages.create(model="claude-sonnet-4-6", max_tokens=100, tools=tools, messages=history)  # type: ignore[arg-type]
    use = next(block for block in message.content if block.type == "tool_use")
    assert use.input == {"city": "Oslo"}
    history.append({"role": "assistant", "content": message.content})
    history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "cold"}]})
    message = client.messages.create(model="claude-sonnet-4-6", max_tokens=100, tools=tools, messages=history)  # type: ignore[arg-type]
    assert message.content[0].text == "reply to: tool said: cold"  # type: ignore[union-attr]
    history.append({"role": "assistant", "content": message.content})

    # Streaming.
    history.append({"role": "user", "content": "stream it"})
    with client.messages.stream(model="claude-sonnet-4-6", max_tokens=100, messages=history) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "reply to: stream it" == final.content[0].text  # type: ignore[union-attr]
    history.append({"role": "assistant", "content": final.content})
    history.append({"role": "user", "content": "count"})
    raw = client.messages.with_raw_response.create(model="claude-sonnet-4-6", max_tokens=100, messages=history)  # type: ignore[arg-type]
    assert raw.headers["x-memory-turns"] == str(2 * TURNS + 2 + 2 + 2 + 2)


def test_openai_agents_sdk_runner_with_a_function_tool(servers: Servers, cid: str) -> None:
    import asyncio

    from agents import Agent, Runner, function_tool, set_default_openai_api, set_default_openai_client, set_tracing_disabled

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    set_tracing_disabled(True)
    set_default_openai_api("responses")
    set_default_openai_client(
        AsyncOpenAI(base_url=servers.base_url, api_key=API_KEY, max_retries=0, default_headers={HEADER: cid}),
        use_for_tracing=False,
    )
    agent = Agent(name="helper", instructions="Be brief.", tools=[get_weather], model="gpt-4.1")

    async def run() -> None:
        items: list = []
        for i in range(1, TURNS + 1):
            if i == 5:
                _mock(servers, "/_mock/script", {"tool_calls": [["call_agent", "get_weather", '{"city": "Rome"}']]})
            result = await Runner.run(agent, items + [{"role": "user", "content": _turn_text(i)}])
            items = result.to_input_list()
            if i == 5:
                assert result.final_output == "reply to: tool said: sunny in Rome"
        assert FACT in json.dumps(_last_request(servers, "/v1/responses")["body"]["input"])

    asyncio.run(run())
    client = _openai(servers, cid)
    raw = client.responses.with_raw_response.create(model="gpt-4.1", input="count")
    # 12 turns of user + reply, and the tool round's call and output: stored once each.
    assert raw.headers["x-memory-turns"] == str(2 * TURNS + 2 + 2)


def test_langchain_chat_openai_with_default_headers(servers: Servers, cid: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="gpt-4o-mini", base_url=servers.base_url, api_key=API_KEY, default_headers={HEADER: cid}, max_retries=0)  # type: ignore[arg-type]
    history: list = []
    for i in range(1, TURNS + 1):
        history.append(HumanMessage(_turn_text(i)))
        reply = llm.invoke(history)
        history.append(AIMessage(reply.content))
    assert FACT in json.dumps(_last_request(servers, "/v1/chat/completions")["body"]["messages"])
    streamed = "".join(chunk.content for chunk in llm.stream(history + [HumanMessage("stream")]))  # type: ignore[misc]
    assert streamed == "reply to: stream"
    raw = _openai(servers, cid).chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "count"}])
    assert raw.headers["x-memory-turns"] == str(2 * TURNS + 2 + 2)


def test_openai_node_sdk(servers: Servers, cid: str) -> None:
    import shutil
    import subprocess

    package = Path(__file__).resolve().parent / "node"
    node = shutil.which("node")
    if node is None or not (package / "node_modules" / "openai").exists():
        pytest.fail("node and tests/e2e/node/node_modules are needed: scripts/test.sh installs them")
    env = {"PATH": str(Path(node).parent), "BASE_URL": servers.base_url, "CONVERSATION": cid, "MOCK_URL": servers.mock_url, "NO_PROXY": "127.0.0.1"}
    done = subprocess.run([node, str(package / "clients.mjs")], cwd=package, env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode() + done.stdout.decode()
