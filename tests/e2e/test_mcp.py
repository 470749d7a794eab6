"""End-to-end tests: the memory tools over MCP with the official MCP Python SDK (`mcp`), against
the running memproxy binary and the mock upstream (`examples/mock_upstream.rs`):

- Streamable HTTP at `/mcp`: initialize, the tools listed with their titles and hints, each
  tool's round trip, what a tool remembers is in the next chat request's prompt (as the mock
  received it) and forgetting takes it out, calls across tenants and users refused, bad
  arguments answered with MCP errors naming the argument;
- stdio, `memproxy mcp` on a data directory of its own: what one session remembers the next
  one finds, and another tenant does not;
- Claude Code (`claude mcp add --transport http`, then `claude -p` against the scripted mock,
  which answers with a `tool_use` of `mcp__memproxy__memory_search`): Claude Code calls the tool
  on memproxy and sends its result, holding the memory, back to the model.

Everything listens on 127.0.0.1; Claude Code gets a temporary HOME, so its configuration
(the MCP server it is told of) stays in the test's directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from test_agents import AGENT_TIMEOUT, MODULES, _claude_binary, _http, agent_env
from test_openai_sdk import MEMPROXY_BIN, MOCK_BIN, _start_memproxy, _start_mock, _stop

API_KEY = "sk-mcp-e2e"
OTHER_KEY = "sk-mcp-e2e-other"
TOOLS = ["memory_search", "memory_remember", "memory_correct", "memory_forget", "conversation_recall"]


@dataclass
class Stack:
    """The mock (`mock_root`: http://127.0.0.1:P, its API under /v1) and memproxy in front of
    it (`proxy_root`)."""

    mock_root: str
    proxy_root: str

    @property
    def mcp_url(self) -> str:
        return self.proxy_root + "/mcp"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    for binary in (MOCK_BIN, MEMPROXY_BIN):
        if not binary.exists():
            pytest.fail(f"{binary} is missing: run `cargo build --bins --examples` first")
    workdir = tmp_path_factory.mktemp("memproxy-mcp")
    mock, mock_url = _start_mock(workdir)
    proxy = None
    try:
        proxy, port = _start_memproxy(workdir, mock_url)
        yield Stack(mock_root=mock_url.removesuffix("/v1"), proxy_root=f"http://127.0.0.1:{port}")
        status, refusals = _http(mock_url.removesuffix("/v1") + "/_mock/refusals")
        assert status == 200 and refusals == [], refusals
    finally:
        _stop(proxy)
        _stop(mock)


def _user() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


def _run(test: Any) -> Any:
    return anyio.run(test)


class _Session:
    """An MCP client session over Streamable HTTP with `key` and, if any, `user` in its
    headers (as an agent configured with them sends on every request)."""

    def __init__(self, stack: Stack, key: str = API_KEY, user: str | None = None) -> None:
        self.headers = {"Authorization": f"Bearer {key}"}
        if user is not None:
            self.headers["X-Memory-User-Id"] = user
        self.url = stack.mcp_url
        self._stack: Any = None

    async def __aenter__(self) -> ClientSession:
        from contextlib import AsyncExitStack

        self._stack = AsyncExitStack()
        http = await self._stack.enter_async_context(create_mcp_http_client(headers=self.headers))
        streams = await self._stack.enter_async_context(streamable_http_client(self.url, http_client=http))
        session = await self._stack.enter_async_context(ClientSession(streams[0], streams[1]))
        await session.initialize()
        return session

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()


async def _call(session: ClientSession, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, result
    structured = result.structured_content
    assert structured is not None, result
    # The text content is the same JSON, for clients that read only text.
    assert json.loads(result.content[0].text) == structured
    return structured


async def _refused(session: ClientSession, tool: str, arguments: dict[str, Any]) -> MCPError:
    with pytest.raises(MCPError) as refused:
        await session.call_tool(tool, arguments)
    return refused.value


def _chat(stack: Stack, user: str, conversation: str, text: str) -> None:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}
    request = urllib.request.Request(
        stack.proxy_root + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {API_KEY}",
            "Content-Type": "application/json",
            "X-Memory-Conversation-Id": conversation,
            "X-Memory-User-Id": user,
        },
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as response:
        assert response.status == 200


def _last_prompt(stack: Stack, said: str) -> str:
    """The last chat completion the mock received whose last message is `said` (memproxy's
    own calls left out), as JSON text."""
    status, requests = _http(stack.mock_root + "/_mock/requests")
    assert status == 200, requests
    chats = [
        r
        for r in requests
        if r["path"].split("?")[0] == "/v1/chat/completions"
        and "x-memproxy-task" not in {k.lower() for k in r["headers"]}
        and r["body"]["messages"][-1].get("content") == said
    ]
    assert chats, f"the mock received no chat request ending with {said!r}"
    return json.dumps(chats[-1]["body"])


# ----------------------------------------------------------------------------------------------
# Streamable HTTP.


def test_initialize_lists_the_tools_with_titles_and_hints(stack: Stack) -> None:
    async def test() -> None:
        async with _Session(stack, user=_user()) as session:
            listed = await session.list_tools()
        names = [tool.name for tool in listed.tools]
        assert names == TOOLS
        for tool in listed.tools:
            assert tool.title, tool
            assert tool.input_schema["type"] == "object", tool
            assert tool.annotations is not None and tool.annotations.read_only_hint is not None, tool
            assert tool.annotations.destructive_hint is not None, tool
        hints = {tool.name: tool.annotations for tool in listed.tools}
        assert hints["memory_search"].read_only_hint and not hints["memory_search"].destructive_hint
        assert hints["memory_forget"].destructive_hint and not hints["memory_forget"].read_only_hint

    _run(test)


def test_each_tool_round_trips_and_the_chat_path_sees_what_it_changed(stack: Stack) -> None:
    user = _user()
    tag = uuid.uuid4().hex[:6]
    conversation = f"mcp-{tag}"

    async def test() -> None:
        async with _Session(stack, user=user) as session:
            kept = await _call(session, "memory_remember", {"text": f"The user's cat is called Zorblax{tag}", "type": "profile", "tags": ["pets"]})
            assert kept["kept"] == "added"
            assert kept["memory"]["source"] == "explicit_user_input"
            memory_id = kept["memory"]["id"]
            again = await _call(session, "memory_remember", {"text": f"The user's cat is called Zorblax{tag}", "type": "profile"})
            assert again["kept"] == "already_known" and again["memory"]["id"] == memory_id

            # The next chat request of the user carries it in its prompt.
            said = f"I need a name tag for my pet, with its name and my flat number 12B ({tag})"
            await anyio.to_thread.run_sync(_chat, stack, user, conversation, said)
            assert f"Zorblax{tag}" in _last_prompt(stack, said)

            found = await _call(session, "memory_search", {"query": f"cat Zorblax{tag} pet name"})
            assert found["memories"][0]["id"] == memory_id, found
            assert found["memories"][0]["score"] > 0 and found["memories"][0]["created_at"].endswith("Z")
            assert found["turns"][0]["conversation"] == conversation, found
            assert "flat number" in found["turns"][0]["text"]

            recalled = await _call(session, "conversation_recall", {"conversation": conversation, "query": "flat number"})
            assert recalled["turns"][0]["turn"] == 1 and "12B" in recalled["turns"][0]["text"], recalled

            corrected = await _call(session, "memory_correct", {"id": memory_id, "text": f"The user's cat is called Quix{tag}"})
            assert corrected["memory"]["version"] == 2
            assert corrected["memory"]["history"][0]["text"] == f"The user's cat is called Zorblax{tag}"
            said = f"What should the pet tag say? ({tag})"
            await anyio.to_thread.run_sync(_chat, stack, user, conversation, said)
            memories = [m for m in json.loads(_last_prompt(stack, said))["messages"] if str(m.get("content", "")).startswith("[What you know")]
            assert len(memories) == 1 and f"Quix{tag}" in memories[0]["content"], memories
            assert f"Zorblax{tag}" not in memories[0]["content"], memories

            forgotten = await _call(session, "memory_forget", {"id": memory_id})
            assert forgotten == {"forgotten": memory_id}
            said = f"Thanks, that is all ({tag})"
            await anyio.to_thread.run_sync(_chat, stack, user, conversation, said)
            assert "What you know about this user" not in _last_prompt(stack, said)

    _run(test)


def test_calls_across_tenants_and_users_are_refused(stack: Stack) -> None:
    ana, bob = _user(), _user()

    async def test() -> None:
        async with _Session(stack, user=ana) as session:
            kept = await _call(session, "memory_remember", {"text": "The user is allergic to peanuts", "type": "profile"})
        memory_id = kept["memory"]["id"]
        async with _Session(stack, user=bob) as session:
            assert (await _call(session, "memory_search", {"query": "peanuts allergic"}))["memories"] == []
            refused = await _refused(session, "memory_forget", {"id": memory_id})
            assert refused.error.code == -32602 and refused.error.data == {"argument": "id"}, refused.error
            refused = await _refused(session, "memory_search", {"query": "peanuts", "user": ana})
            assert refused.error.data == {"argument": "user"}, refused.error
        async with _Session(stack, key=OTHER_KEY, user=ana) as session:
            assert (await _call(session, "memory_search", {"query": "peanuts allergic"}))["memories"] == []
            refused = await _refused(session, "memory_correct", {"id": memory_id, "text": "Nothing"})
            assert refused.error.data == {"argument": "id"}, refused.error
        async with _Session(stack, user=ana) as session:
            found = await _call(session, "memory_search", {"query": "peanuts allergic"})
            assert [m["id"] for m in found["memories"]] == [memory_id]

    _run(test)


def test_bad_arguments_are_mcp_errors_naming_the_argument(stack: Stack) -> None:
    async def test() -> None:
        async with _Session(stack, user=_user()) as session:
            for tool, arguments, named in [
                ("memory_search", {}, "query"),
                ("memory_search", {"query": "x", "limit": 500}, "limit"),
                ("memory_remember", {"text": "x", "type": "feeling"}, "type"),
                ("memory_remember", {"text": "x", "type": "profile", "importance": 3}, "importance"),
                ("memory_correct", {"id": "seven", "text": "x"}, "id"),
                ("conversation_recall", {"query": "x"}, "conversation"),
            ]:
                refused = await _refused(session, tool, arguments)
                assert refused.error.code == -32602, (tool, refused.error)
                assert refused.error.data == {"argument": named}, (tool, refused.error)
                assert f"`{named}`" in refused.error.message, (tool, refused.error)
        # Without the header, the user is a required argument.
        async with _Session(stack) as session:
            refused = await _refused(session, "memory_search", {"query": "x"})
            assert refused.error.data == {"argument": "user"}, refused.error

    _run(test)


def test_a_request_without_a_credential_is_refused(stack: Stack) -> None:
    status, answer = _http(stack.mcp_url, {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"})
    assert status == 401, answer


# ----------------------------------------------------------------------------------------------
# stdio: `memproxy mcp` on a data directory of its own.


def _stdio(data_dir: Path, key: str, user: str | None) -> StdioServerParameters:
    args = ["mcp", "--data-dir", str(data_dir), "--credential-env", "MCP_E2E_KEY"]
    if user is not None:
        args += ["--user", user]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_")}
    env["MCP_E2E_KEY"] = key
    return StdioServerParameters(command=str(MEMPROXY_BIN), args=args, env=env)


async def _stdio_session(params: StdioServerParameters) -> AsyncIterator[ClientSession]:
    async with stdio_client(params) as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            yield session


def test_stdio_serves_the_tools_on_a_data_directory(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"

    async def test() -> None:
        from contextlib import asynccontextmanager

        session_of = asynccontextmanager(_stdio_session)
        async with session_of(_stdio(data_dir, API_KEY, "ana")) as session:
            assert [t.name for t in (await session.list_tools()).tools] == TOOLS
            kept = await _call(session, "memory_remember", {"text": "The user prefers window seats", "type": "preference"})
            assert kept["kept"] == "added"
        # A later session on the same directory finds it; the user may be an argument.
        async with session_of(_stdio(data_dir, API_KEY, None)) as session:
            found = await _call(session, "memory_search", {"query": "window seats", "user": "ana"})
            assert found["memories"][0]["text"] == "The user prefers window seats", found
            refused = await _refused(session, "memory_search", {"query": "window seats"})
            assert refused.error.data == {"argument": "user"}
        # Another credential is another tenant.
        async with session_of(_stdio(data_dir, OTHER_KEY, "ana")) as session:
            assert (await _call(session, "memory_search", {"query": "window seats"}))["memories"] == []

    _run(test)


# ----------------------------------------------------------------------------------------------
# Claude Code: memproxy added as an HTTP MCP server, the model's tool_use answered by memproxy.


def test_claude_code_calls_memory_search_on_memproxy_in_a_tool_round(stack: Stack, tmp_path: Path) -> None:
    if shutil.which("node") is None or not (MODULES / "@anthropic-ai").exists():
        pytest.fail("node and tests/e2e/node/node_modules are needed: scripts/test.sh installs them (npm ci)")
    user = _user()
    tag = uuid.uuid4().hex[:6]
    fact = f"The user's favourite tea is Lapsang{tag}"

    async def remember() -> None:
        async with _Session(stack, user=user) as session:
            await _call(session, "memory_remember", {"text": fact, "type": "preference"})

    _run(remember)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = agent_env(
        home,
        {
            # MCP tools listed with the others (not deferred behind Claude Code's tool search),
            # so the test sees memproxy's tool offered to the model with its schema.
            "ENABLE_TOOL_SEARCH": "false",
            "ANTHROPIC_BASE_URL": stack.mock_root,
            "ANTHROPIC_API_KEY": API_KEY,
        },
    )
    added = subprocess.run(
        [*_claude_binary(), "mcp", "add", "--scope", "user", "--transport", "http", "memproxy", stack.mcp_url,
         "--header", f"Authorization: Bearer {API_KEY}", "--header", f"X-Memory-User-Id: {user}"],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=AGENT_TIMEOUT,
    )
    assert added.returncode == 0, added.stdout + added.stderr

    status, _ = _http(stack.mock_root + "/_mock/clear", {})
    assert status == 200
    call_id = f"toolu_{tag}"
    for reply in (
        {"tool_calls": [[call_id, "mcp__memproxy__memory_search", json.dumps({"query": "favourite tea"})]]},
        {"text": f"Your favourite tea is Lapsang{tag}."},
    ):
        status, answer = _http(stack.mock_root + "/_mock/script", reply)
        assert status == 200, answer
    done = subprocess.run(
        [*_claude_binary(), "-p", "Which tea do I like?", "--allowedTools", "mcp__memproxy__memory_search"],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=AGENT_TIMEOUT,
    )
    report = f"exit {done.returncode}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
    assert done.returncode == 0, report

    status, requests = _http(stack.mock_root + "/_mock/requests")
    assert status == 200
    calls = [r for r in requests if r["path"].split("?")[0] == "/v1/messages" and r["method"] == "POST"]
    # The model was told of memproxy's tool, and the tool's result came back to it.
    assert calls, report
    report += "\n" + json.dumps([[t.get("name") for t in r["body"].get("tools", [])] for r in calls])[:3000]
    offered = [r for r in calls if any(t.get("name") == "mcp__memproxy__memory_search" for t in r["body"].get("tools", []))]
    assert offered, report
    answered = [r for r in calls if call_id in json.dumps(r["body"].get("messages", [])) and "tool_result" in json.dumps(r["body"]["messages"][-1])]
    assert answered, report
    result = json.dumps(answered[-1]["body"]["messages"][-1])
    assert f"Lapsang{tag}" in result, result
    assert f"Lapsang{tag}" in done.stdout, report
