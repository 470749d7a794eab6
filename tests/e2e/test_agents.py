"""End-to-end tests: the coding agents people run — Claude Code (`claude -p`), the Codex CLI
(`codex exec`) and the Claude Agent SDK (`query()`, TypeScript) — each against the scripted mock
upstream (`examples/mock_upstream.rs`), first directly (the baseline: what the agent does when
nothing is in between) and then through memproxy.

The agents are installed, pinned, by `npm ci` in `tests/e2e/node` (scripts/test.sh). Each test
gets its own HOME (and CODEX_HOME), working directory and conversation id; the agents talk to
127.0.0.1 only. Between the agent and its target (the mock, or memproxy) sits a small recording
front (`Front`, below): it relays every request and answer as they come (streams included) and
records each answer's status and headers, which is how the tests see memproxy's
`X-Memory-History-Tokens`, `X-Memory-Prompt-Tokens` and `X-Memory-Receipt` (the agents do not
show them).

Scenarios, for each agent:
- a tool round (a scripted tool call the agent really runs), then continue/resume asking for a
  fact told on the first turn: the fact is in the prompt that reaches the upstream;
- a 20-step tool loop (20 scripted tool calls in a row, then a text answer);
- the agent's own compaction, forced by a low limit (Claude Code and the SDK:
  `CLAUDE_CODE_AUTO_COMPACT_WINDOW` with a large usage reported by the mock,
  `x-mock-cached-tokens`; Codex: `model_auto_compact_token_limit`), then a turn asking for a fact
  only an answer before the compaction held (the mock's scripted summary does not hold it):
  directly the fact is gone from the prompt, through memproxy it must come back by recall;
  Claude Code's `/compact` too, and Codex with `remote_compaction = "v2"` (the provider answers
  a `compaction_trigger` with an opaque `compaction` item: `Front` answers it in the mock's place,
  once the mock has accepted the request);
- title generation on (Claude Code with `CLAUDE_CODE_ENTRYPOINT=sdk-ts`, the SDK by default;
  Codex makes no such call).

Checked every time: every model call the agent made was answered 200 and the mock refused
nothing (`GET /_mock/refusals` when the mock has it). Through memproxy also: the stored history
(admin API) holds every message exactly once, side calls are not in it, a tool loop's forwarded
requests end with the newest tool result, and `X-Memory-History-Tokens` exceeds
`X-Memory-Prompt-Tokens` once the window has moved.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import platform
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from test_openai_sdk import MEMPROXY_BIN, MOCK_BIN, _start_memproxy, _start_mock, _stop

NODE_DIR = Path(__file__).resolve().parent / "node"
MODULES = NODE_DIR / "node_modules"
ADMIN_TOKEN = "agents-admin-token"
API_KEY = "sk-agents-e2e"
AGENT_TIMEOUT = 120
ROUTES = ("direct", "memproxy")
HEADER = "X-Memory-Conversation-Id"

# What marks each agent's calls (capture report: /work/agents-capture.md).
CC_SUMMARIZER_PREFIX = "CRITICAL: Respond with TEXT ONLY"
CC_CONTINUED_PREFIX = "This session is being continued from a previous conversation"
CODEX_SUMMARIZER_PREFIX = "You are performing a CONTEXT CHECKPOINT COMPACTION"
CODEX_SUMMARY_PREFIX = "Another language model started to solve this problem"
TITLE_PROMPT = "You are naming a coding session"


# ----------------------------------------------------------------------------------------------
# The servers: one mock and one memproxy for the module; a recording front per test.


@dataclass
class Stack:
    mock_url: str  # http://127.0.0.1:P/v1
    proxy_port: int
    # The upstream both routes reach: a relay to the mock that answers compaction triggers.
    upstream: "Front"

    @property
    def mock_root(self) -> str:
        return self.mock_url.removesuffix("/v1")

    @property
    def proxy_root(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    for binary in (MOCK_BIN, MEMPROXY_BIN):
        if not binary.exists():
            pytest.fail(f"{binary} is missing: run `cargo build --bins --examples` first")
    if shutil.which("node") is None or not (MODULES / "@openai" / "codex").exists():
        pytest.fail("node and tests/e2e/node/node_modules are needed: scripts/test.sh installs them (npm ci)")
    workdir = tmp_path_factory.mktemp("memproxy-agents")
    mock, mock_url = _start_mock(workdir)
    proxy = None
    upstream = Front(mock_url.removesuffix("/v1"), answer_compaction=True)
    try:
        proxy, port = _start_memproxy(
            workdir,
            f"{upstream.url}/v1",
            f'[upstream.anthropic]\nbase_url = "{upstream.url}"\n',
            extra_env={"MEMPROXY_ADMIN_TOKEN": ADMIN_TOKEN},
        )
        yield Stack(mock_url=mock_url, proxy_port=port, upstream=upstream)
    finally:
        _stop(proxy)
        _stop(mock)
        upstream.close()


def _http(url: str, body: object | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET", headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Exchange:
    method: str
    path: str
    status: int
    headers: dict[str, str]


def _compaction_answer(request: dict[str, Any], number: int, stream: bool) -> tuple[str, bytes]:
    """A Responses answer of one `compaction` item, as a provider with remote compaction answers
    a request whose last input item is `compaction_trigger` (what Codex's
    `remote_compaction = "v2"` asks for). The mock cannot answer it (yet): the upstream front
    below puts it in place of the mock's own answer, once the mock has accepted the request."""
    item = {"type": "compaction", "id": f"cmp_front_{number}", "encrypted_content": f"opaque-compaction-{number}"}
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    response = {"id": f"resp_front_{number}", "object": "response", "created_at": 1, "status": "completed", "model": request.get("model"), "output": [item], "usage": usage}
    if not stream:
        return "application/json", json.dumps(response).encode()
    events = [
        ("response.created", {"response": {**response, "status": "in_progress", "output": []}}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": response}),
    ]
    text = "".join(f"event: {name}\ndata: {json.dumps({**data, 'type': name, 'sequence_number': i})}\n\n" for i, (name, data) in enumerate(events))
    return "text/event-stream", text.encode()


def _is_compaction_trigger(body: bytes | None) -> dict[str, Any] | None:
    try:
        request = json.loads(body or b"")
    except ValueError:
        return None
    items = request.get("input") if isinstance(request, dict) else None
    if isinstance(items, list) and items and isinstance(items[-1], dict) and items[-1].get("type") == "compaction_trigger":
        return request
    return None


class Front:
    """A recording relay on a free loopback port: every request goes to `target` as it came,
    every answer comes back as it goes (streams chunk by chunk); each answer's status and
    headers are kept in `exchanges`. With `answer_compaction`, a Responses request ending with a
    `compaction_trigger` item, once the target answered it 200, gets a `compaction` item instead
    (`_compaction_answer`)."""

    def __init__(self, target: str, answer_compaction: bool = False) -> None:
        self.target = target  # http://127.0.0.1:P
        self.exchanges: list[Exchange] = []
        self.bodies: list[bytes] = []  # the POST bodies, as the client sent them
        self.compactions = 0
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "POST" and body:
                    front.bodies.append(body)
                host, port = front.target.removeprefix("http://").split(":")
                conn = http.client.HTTPConnection(host, int(port), timeout=AGENT_TIMEOUT)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection", "transfer-encoding")}
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                except OSError as err:
                    front.exchanges.append(Exchange(self.command, self.path, 599, {"error": str(err)}))
                    self.send_error(502)
                    return
                kept = {k.lower(): v for k, v in answer.getheaders()}
                front.exchanges.append(Exchange(self.command, self.path, answer.status, kept))
                trigger = _is_compaction_trigger(body) if answer_compaction and self.command == "POST" else None
                if trigger is not None and answer.status == 200:
                    answer.read()
                    conn.close()
                    front.compactions += 1
                    content_type, data = _compaction_answer(trigger, front.compactions, bool(trigger.get("stream")))
                    self.send_response(200)
                    self.send_header("content-type", content_type)
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                    return
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                if self.command == "HEAD":
                    self.send_header("content-length", kept.get("content-length", "0"))
                    self.end_headers()
                    conn.close()
                    return
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                try:
                    while True:
                        chunk = answer.read1(65536)
                        if not chunk:
                            break
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                finally:
                    conn.close()

            do_GET = do_POST = do_HEAD = do_DELETE = do_PUT = _relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def model_calls(self, api_path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path.split("?")[0] == api_path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ----------------------------------------------------------------------------------------------
# The agents.


def _claude_binary() -> list[str]:
    """The native Claude Code binary of this platform. `.bin/claude` is a stub until the
    package's postinstall copies the native binary over it (npm runs it only when allowed), so
    the platform package is used directly."""
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower(), platform.machine())
    system = {"Linux": "linux", "Darwin": "darwin"}.get(platform.system(), platform.system().lower())
    musl = system == "linux" and not Path("/lib/x86_64-linux-gnu").exists() and not Path("/lib/aarch64-linux-gnu").exists()
    package = MODULES / "@anthropic-ai" / f"claude-code-{system}-{arch}{'-musl' if musl else ''}"
    if (package / "claude").exists():
        return [str(package / "claude")]
    return [str(MODULES / ".bin" / "claude")]


def _node() -> str:
    node = shutil.which("node")
    assert node is not None
    return node


def agent_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """An agent's environment: its own HOME, loopback only, no telemetry, updates or retries,
    and `extra`."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SYSTEMROOT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        {
            "HOME": str(home),
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0",
        }
    )
    env.update(extra or {})
    return env


@dataclass
class Run:
    """One test's agent session: its directories, conversation, front and the mock's controls."""

    agent: str
    route: str
    stack: Stack
    root: Path
    cid: str = field(default_factory=lambda: f"agents-{uuid.uuid4().hex[:16]}")
    front: Front | None = None
    outputs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.home = self.root / "home"
        self.work = self.root / "work"
        self.home.mkdir(parents=True)
        self.work.mkdir(parents=True)
        target = self.stack.upstream.url if self.route == "direct" else self.stack.proxy_root
        self.front = Front(target)

    # The agent's API path and tool call shape.
    @property
    def api_path(self) -> str:
        return "/v1/responses" if self.agent == "codex" else "/v1/messages"

    def tool_call(self, call_id: str, command: str) -> list[str]:
        if self.agent == "codex":
            return [call_id, "exec_command", json.dumps({"cmd": command})]
        return [call_id, "Bash", json.dumps({"command": command, "description": "run a command"})]

    # The mock.
    def script(self, *replies: dict[str, Any]) -> None:
        for reply in replies:
            status, answer = _http(self.stack.mock_root + "/_mock/script", reply)
            assert status == 200, answer

    def mock_requests(self) -> list[dict[str, Any]]:
        """The agent's model calls the mock received (memproxy's own summary and extraction
        calls left out), in order."""
        status, answer = _http(self.stack.mock_root + "/_mock/requests")
        assert status == 200, answer
        return [
            r
            for r in answer
            if r["path"].split("?")[0] == self.api_path
            and "x-memproxy-task" not in {k.lower() for k in r["headers"]}
            and {k.lower(): v for k, v in r["headers"].items()}.get(HEADER.lower()) in (self.cid, None)
            and r["method"] == "POST"
        ]

    # Running the agent.
    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return agent_env(self.home, extra)

    def _anthropic_env(self, cached_tokens: int | None, extra: dict[str, str] | None) -> dict[str, str]:
        headers = f"{HEADER}: {self.cid}"
        if cached_tokens is not None:
            headers += f"\nx-mock-cached-tokens: {cached_tokens}"
        assert self.front is not None
        return self._env(
            {"ANTHROPIC_BASE_URL": self.front.url, "ANTHROPIC_API_KEY": API_KEY, "ANTHROPIC_CUSTOM_HEADERS": headers, **(extra or {})}
        )

    def _codex_config(self, cached_tokens: int | None, compact_limit: int | None, remote_compaction: bool = False) -> None:
        assert self.front is not None
        headers = {HEADER: self.cid}
        if cached_tokens is not None:
            headers["x-mock-cached-tokens"] = str(cached_tokens)
        inline = ", ".join(f'"{k}" = "{v}"' for k, v in headers.items())
        lines = [
            'model = "gpt-5.5"',
            'model_provider = "mock"',
            'approval_policy = "never"',
            'sandbox_mode = "danger-full-access"',
        ]
        if compact_limit is not None:
            lines.append(f"model_auto_compact_token_limit = {compact_limit}")
        lines += [
            "",
            "[model_providers.mock]",
            'name = "mock"',
            f'base_url = "{self.front.url}/v1"',
            'wire_api = "responses"',
            'env_key = "MEMPROXY_E2E_KEY"',
            "request_max_retries = 0",
            "stream_max_retries = 0",
            f"http_headers = {{ {inline} }}",
        ]
        if remote_compaction:
            lines += ["", "[model_providers.mock.capabilities]", 'remote_compaction = "v2"']
        (self.home / "config.toml").write_text("\n".join(lines) + "\n")

    def turn(
        self,
        prompt: str,
        *,
        again: bool = False,
        cached_tokens: int | None = None,
        compact_window: bool = False,
        title: bool = False,
        remote_compaction: bool = False,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """One run of the agent: a new session, or (`again`) the newest one continued."""
        if self.agent == "claude_code":
            extra: dict[str, str] = {}
            if compact_window:
                extra["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = "100000"
            if title:
                extra["CLAUDE_CODE_ENTRYPOINT"] = "sdk-ts"
            command = [*_claude_binary(), "-p", prompt, "--allowedTools", "Bash"]
            if again:
                command.append("--continue")
            env = self._anthropic_env(cached_tokens, extra)
        elif self.agent == "agent_sdk":
            extra = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000"} if compact_window else {}
            args = {"prompt": prompt, "continue": again, "allowedTools": ["Bash"], "title": None if title else "memproxy e2e"}
            command = [_node(), str(NODE_DIR / "agent_sdk.mjs"), json.dumps(args)]
            env = self._anthropic_env(cached_tokens, extra)
        else:
            self._codex_config(cached_tokens, 1000 if compact_window else None, remote_compaction)
            command = [_node(), str(MODULES / "@openai" / "codex" / "bin" / "codex.js"), "exec", "--skip-git-repo-check"]
            if again:
                command += ["resume", "--last"]
            command.append(prompt)
            env = self._env({"CODEX_HOME": str(self.home), "MEMPROXY_E2E_KEY": API_KEY})
        done = subprocess.run(
            command, cwd=self.work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=AGENT_TIMEOUT
        )
        self.outputs.append(f"$ {self.agent} {prompt[:60]!r} -> exit {done.returncode}\n{done.stdout[-800:]}\n{done.stderr[-1500:]}")
        if check:
            assert done.returncode == 0, self.report()
        return done

    def report(self) -> str:
        assert self.front is not None
        lines = [f"agent={self.agent} route={self.route} conversation={self.cid}"]
        lines += [f"  {e.method} {e.path} -> {e.status} {e.headers.get('x-memory-status', '')} {e.headers.get('x-memory-reason', '')}" for e in self.front.exchanges]
        return "\n".join(lines + self.outputs[-4:])

    # memproxy's view.
    def stored_messages(self) -> list[dict[str, Any]]:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        status, listing = _http(f"{self.stack.proxy_root}/admin/v1/conversations?agent=default&limit=1000", headers=admin)
        assert status == 200, listing
        found = [c for c in listing["conversations"] if c["id"] == self.cid]
        assert found, f"conversation {self.cid} is not stored\n{self.report()}"
        c = found[0]
        status, conversation = _http(f"{self.stack.proxy_root}/admin/v1/conversations/{c['tenant']}/{c['agent']}/{c['id']}", headers=admin)
        assert status == 200, conversation
        return conversation["messages"]


@pytest.fixture
def make_run(stack: Stack, tmp_path: Path) -> Iterator[Callable[[str, str], Run]]:
    runs: list[Run] = []
    status, _ = _http(stack.mock_root + "/_mock/clear", {})
    assert status == 200

    def make(agent: str, route: str) -> Run:
        run = Run(agent=agent, route=route, stack=stack, root=tmp_path / f"{agent}-{route}-{len(runs)}")
        runs.append(run)
        return run

    yield make
    for run in runs:
        if run.front is not None:
            run.front.close()


# ----------------------------------------------------------------------------------------------
# What every test checks.


def _text_of(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _answer_is(content: Any, text: str) -> bool:
    """A stored answer's content (a string or text parts) is `text`."""
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return isinstance(content, str) and content.strip() == text


def _mock_refusals(stack: Stack) -> list[Any] | None:
    """The strict mock's refusals (`GET /_mock/refusals`), or None when this mock has no such
    endpoint (it then echoes unknown paths as an object)."""
    status, answer = _http(stack.mock_root + "/_mock/refusals")
    return answer if status == 200 and isinstance(answer, list) else None


def check_accepted(run: Run) -> None:
    """Every model call the agent made was answered 200, and the mock refused nothing."""
    assert run.front is not None
    calls = run.front.model_calls(run.api_path)
    assert calls, f"the agent made no model call\n{run.report()}"
    bad = [c for c in calls if c.status != 200]
    assert not bad, f"{len(bad)} of {len(calls)} model calls were not answered 200\n{run.report()}"
    refusals = _mock_refusals(run.stack)
    if refusals is not None:
        assert refusals == [], f"the strict mock refused: {refusals}\n{run.report()}"
    if run.route == "memproxy":
        statuses = Counter(c.headers.get("x-memory-status", "?") for c in calls)
        assert "degraded" not in statuses, f"memory degraded: {statuses}\n{run.report()}"


def _stored_key(message: dict[str, Any]) -> str:
    inner = message.get("message") or {}
    return _text_of(
        {
            "role": message.get("role"),
            "content": message.get("content"),
            "tool_calls": inner.get("tool_calls"),
            "tool_call_id": inner.get("tool_call_id"),
        }
    )


def _stored_listing(messages: list[dict[str, Any]]) -> str:
    return "\n".join(f"  stored #{m.get('turn')} {m.get('role')}: {_text_of(m.get('content'))[:160]}" for m in messages)


def _plain(value: Any) -> str:
    """The text of a message's content, whatever its shape (a string, blocks, tool results)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_plain(v) for v in value)
    if isinstance(value, dict):
        for key in ("text", "content", "output"):
            if key in value:
                return _plain(value[key])
    return ""


def _client_repeats(run: Run, text: str) -> int:
    """How many times the client itself had a message of this text in one request (Claude Code
    repeats its "The user hasn't heard from you in a while" system message in a long loop)."""
    assert run.front is not None
    most = 0
    for body in run.front.bodies:
        try:
            request = json.loads(body)
        except ValueError:
            continue
        items = request.get("input") if isinstance(request.get("input"), list) else request.get("messages") or []
        most = max(most, sum(1 for item in items if isinstance(item, dict) and _plain(item.get("content", item.get("output"))) == text))
    return most


def check_stored_once(run: Run, texts: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The stored history (admin API) holds no message more often than the client itself sent it
    in one request, and each `(role, text)` (the user's prompts, the tool outputs, the scripted
    answers) is in exactly one message of that role."""
    messages = run.stored_messages()
    # A client may repeat a message itself (Claude Code's "The user hasn't heard from you in a
    # while…" system reminder at several places of its history): each is a message there.
    keys = Counter(_stored_key(m) for m in messages)
    by_key = {_stored_key(m): m for m in messages}
    twice = [k[:300] for k, n in keys.items() if n > 1 and n > _client_repeats(run, _plain(by_key[k].get("content")))]
    assert not twice, f"stored more than once: {twice}\n{_stored_listing(messages)}\n{run.report()}"
    for role, text in texts:
        # An answer is itself; a user message holds the prompt among the client's reminders.
        # (The mock's default answer quotes the last user turn, recalled lines included.)
        holding = [
            m["turn"]
            for m in messages
            if m.get("role") == role
            and (_answer_is(m.get("content"), text) if role == "assistant" else text in _text_of(m.get("content")))
        ]
        assert len(holding) == 1, (
            f"{role} {text!r} is in stored messages {holding}, not exactly one\n{_stored_listing(messages)}\n{run.report()}"
        )
    return messages


def check_not_stored(run: Run, texts: list[str]) -> None:
    messages = run.stored_messages()
    for text in texts:
        holding = [m["turn"] for m in messages if text in _text_of(m.get("content"))]
        assert not holding, f"{text!r} is stored (messages {holding}): a side call entered the conversation\n{run.report()}"


def check_ledger_saves(run: Run) -> None:
    """Once the window has moved, X-Memory-History-Tokens exceeds X-Memory-Prompt-Tokens (read
    from memproxy's answers through the front): on the last model call at least."""
    assert run.front is not None
    calls = [c for c in run.front.model_calls(run.api_path) if "x-memory-history-tokens" in c.headers]
    assert calls, f"no answer carried X-Memory-History-Tokens\n{run.report()}"
    figures = [(int(c.headers["x-memory-history-tokens"]), int(c.headers["x-memory-prompt-tokens"])) for c in calls]
    history, prompt = figures[-1]
    assert history > prompt, f"history {history} <= prompt {prompt} on the last call (all: {figures})\n{run.report()}"


def _body_messages(request: dict[str, Any]) -> list[Any]:
    body = request["body"]
    return body.get("input") if "input" in body else body.get("messages", [])


def _last_is_tool_result(request: dict[str, Any], call_id: str) -> bool:
    """The request's newest input is the result of `call_id`. Claude Code itself sometimes
    sends a `system`-role message after it mid-loop ("The user hasn't heard from you in a
    while…"): trailing system messages of the client's are allowed, not memproxy's recalled
    turns (`[earlier turn #N …]`)."""
    items = list(_body_messages(request))
    while items and items[-1].get("role") == "system" and "[earlier turn" not in _text_of(items[-1]):
        items.pop()
    if not items:
        return False
    last = items[-1]
    if last.get("type") == "function_call_output":
        return last.get("call_id") == call_id
    content = last.get("content")
    return (
        last.get("role") == "user"
        and isinstance(content, list)
        and any(b.get("type") == "tool_result" and b.get("tool_use_id") == call_id for b in content)
        and content[-1].get("type") == "tool_result"
    )


def _is_title_call(request: dict[str, Any]) -> bool:
    return TITLE_PROMPT in _text_of(request["body"].get("system"))


def _main_calls(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in requests if not _is_title_call(r)]


AGENTS = ("claude_code", "codex", "agent_sdk")


def _tag() -> str:
    return uuid.uuid4().hex[:6]


# ----------------------------------------------------------------------------------------------
# A tool round, then continue/resume recalling a fact of the first turn.


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("agent", AGENTS)
def test_tool_round_then_resume_recalls_the_first_turn(make_run: Callable[[str, str], Run], agent: str, route: str) -> None:
    run = make_run(agent, route)
    tag = _tag()
    fact = f"my cat is called Zorblax{tag}"
    echoed = f"tool-ran-{tag}"
    first = f"Remember this: {fact}. Then run echo for me."
    answer = f"Done, the tool ran ({tag})."
    run.script({"tool_calls": [run.tool_call(f"call_{tag}", f"echo {echoed}")]}, {"text": answer})
    run.turn(first)
    later = "What is my cat called?"
    run.turn(later, again=True)

    check_accepted(run)
    main = _main_calls(run.mock_requests())
    assert len(main) == 3, run.report()
    # The agent really ran the tool: its output came back in the second call.
    assert echoed in _text_of(_body_messages(main[1])[-1]), run.report()
    # The fact of the first turn reached the upstream on the later turn.
    assert fact in _text_of(_body_messages(main[2])), run.report()
    assert later in _text_of(_body_messages(main[2])[-1]), run.report()
    if route == "memproxy":
        check_stored_once(run, [("user", fact), ("user", later), ("assistant", answer), ("tool", echoed)])


# ----------------------------------------------------------------------------------------------
# A 20-step tool loop.

LOOP_STEPS = 20
# Each step's output is long enough for the history to outgrow the window.
FILLER = " ".join(f"w{i}" for i in range(120))
# A first exchange of words no later message shares: once the window has left it behind, recall
# does not bring it back, and the history is larger than the prompt.
BACKGROUND = "Background notes for the archive: " + " ".join(f"zq{i}x" for i in range(300))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("agent", AGENTS)
def test_twenty_step_tool_loop(make_run: Callable[[str, str], Run], agent: str, route: str) -> None:
    run = make_run(agent, route)
    tag = _tag()
    run.turn(BACKGROUND)
    calls = [f"call_{tag}_{i}" for i in range(1, LOOP_STEPS + 1)]
    run.script(*({"tool_calls": [run.tool_call(c, f"echo step-{i}-{tag} {FILLER}")]} for i, c in enumerate(calls, 1)))
    final = f"All {LOOP_STEPS} steps ran ({tag})."
    run.script({"text": final})
    prompt = f"Run the {LOOP_STEPS} steps of the build, one command at a time ({tag})."
    done = run.turn(prompt, again=True)
    assert final in done.stdout, run.report()
    after = "Thanks. Which step comes next?"
    run.turn(after, again=True)

    check_accepted(run)
    main = _main_calls(run.mock_requests())
    assert len(main) == 1 + (LOOP_STEPS + 1) + 1, run.report()
    loop = main[1 : LOOP_STEPS + 2]
    for i, request in enumerate(loop[1:], 1):
        assert f"step-{i}-{tag}" in _text_of(_body_messages(request)), run.report()
        # While the newest input is a tool result, nothing comes after it.
        assert _last_is_tool_result(request, calls[i - 1]), f"step {i}: the forwarded request does not end with the tool result\n{run.report()}"
        # The loop's user question stays in the prompt.
        assert prompt in _text_of(_body_messages(request)), f"step {i}: the loop's question is gone\n{run.report()}"
    assert after in _text_of(_body_messages(main[-1])), run.report()
    if route == "memproxy":
        check_stored_once(
            run,
            [("user", prompt), ("user", after), ("assistant", final), *(("tool", f"step-{i}-{tag}") for i in range(1, LOOP_STEPS + 1))],
        )
        check_ledger_saves(run)


# ----------------------------------------------------------------------------------------------
# The agent's own compaction, then a fact from before it.


def _summarizer_call(agent: str, request: dict[str, Any]) -> bool:
    items = _body_messages(request)
    if not items:
        return False
    prefix = CODEX_SUMMARIZER_PREFIX if agent == "codex" else CC_SUMMARIZER_PREFIX
    return prefix in _text_of(items[-1])


def _compacted_call(agent: str, request: dict[str, Any]) -> bool:
    prefix = CODEX_SUMMARY_PREFIX if agent == "codex" else CC_CONTINUED_PREFIX
    return prefix in _text_of(_body_messages(request))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("agent", AGENTS)
def test_own_compaction_then_recall_from_before_it(make_run: Callable[[str, str], Run], agent: str, route: str) -> None:
    run = make_run(agent, route)
    tag = _tag()
    code = f"{tag}-7781"
    # The fact is in an answer: both agents drop answers when they compact (Codex keeps the
    # user's messages), and the scripted summary does not hold it.
    noted = f"Noted: the vault code is {code}."
    run.script({"text": noted})
    run.turn("Please take note of the vault code for later.", compact_window=True)
    # A second exchange, whose answer reports a large usage: the next turn starts by compacting.
    run.turn("Now let us talk about something else: the weather today.", again=True, compact_window=True, cached_tokens=190000 if agent != "codex" else 5000)
    summary = "<analysis>ok</analysis><summary>The user talked about the weather.</summary>" if agent != "codex" else "The user talked about the weather."
    # The last answer is scripted: the mock's default one would quote the prompt, recalled turns
    # included, and be stored with them.
    run.script({"text": summary}, {"text": f"Let me look ({tag})."})
    question = "What is the vault code you noted?"
    run.turn(question, again=True, compact_window=True)

    check_accepted(run)
    main = _main_calls(run.mock_requests())
    summarizers = [r for r in main if _summarizer_call(agent, r)]
    assert len(summarizers) == 1, f"expected one compaction call\n{run.report()}"
    last = main[-1]
    assert _compacted_call(agent, last), f"the last call does not carry the agent's compacted history\n{run.report()}"
    assert question in _text_of(_body_messages(last)), run.report()
    if route == "direct":
        # The baseline: the agent compacted the fact away; only a memory can bring it back.
        assert code not in _text_of(last["body"]), run.report()
    else:
        assert code in _text_of(last["body"]), f"the fact from before the compaction did not reach the upstream\n{run.report()}"
        check_stored_once(run, [("assistant", noted), ("user", question)])
        check_not_stored(run, [CC_SUMMARIZER_PREFIX, CODEX_SUMMARIZER_PREFIX])


@pytest.mark.parametrize("route", ROUTES)
def test_claude_code_compact_command_then_recall(make_run: Callable[[str, str], Run], route: str) -> None:
    run = make_run("claude_code", route)
    tag = _tag()
    code = f"{tag}-5150"
    noted = f"Noted: the locker code is {code}."
    run.script({"text": noted})
    run.turn("Please take note of the locker code for later.")
    run.turn("Now let us talk about something else: the weather today.", again=True)
    run.script({"text": "<analysis>ok</analysis><summary>The user talked about the weather.</summary>"})
    run.turn("/compact", again=True)
    question = "What is the locker code you noted?"
    run.script({"text": f"Let me look ({tag})."})
    run.turn(question, again=True)

    check_accepted(run)
    main = _main_calls(run.mock_requests())
    assert sum(_summarizer_call("claude_code", r) for r in main) == 1, run.report()
    last = main[-1]
    assert _compacted_call("claude_code", last), run.report()
    if route == "direct":
        assert code not in _text_of(last["body"]), run.report()
    else:
        assert code in _text_of(last["body"]), f"the fact from before /compact did not reach the upstream\n{run.report()}"
        check_stored_once(run, [("assistant", noted), ("user", question)])
        check_not_stored(run, [CC_SUMMARIZER_PREFIX])


@pytest.mark.parametrize("route", ROUTES)
def test_codex_remote_compaction_then_recall(make_run: Callable[[str, str], Run], route: str) -> None:
    """Codex with `remote_compaction = "v2"`: the provider compacts (a request ending with a
    `compaction_trigger` item, answered with one opaque `compaction` item), and the history
    after it carries that item in place of the answers."""
    run = make_run("codex", route)
    tag = _tag()
    code = f"{tag}-2468"
    noted = f"Noted: the vault code is {code}."
    run.script({"text": noted})
    run.turn("Please take note of the vault code for later.", compact_window=True, remote_compaction=True)
    run.turn("Now let us talk about something else: the weather today.", again=True, compact_window=True, cached_tokens=5000, remote_compaction=True)
    question = "What is the vault code you noted?"
    # The compaction call takes the first (the relay replaces the mock's answer), the turn the second.
    run.script({"text": "(replaced by the compaction item)"}, {"text": f"Let me look ({tag})."})
    done = run.turn(question, again=True, compact_window=True, remote_compaction=True, check=False)

    main = run.mock_requests()
    triggers = [r for r in main if _is_compaction_trigger(json.dumps(r["body"]).encode()) is not None]
    assert len(triggers) == 1, f"no request reached the upstream ending with the compaction_trigger item\n{run.report()}"
    assert done.returncode == 0, run.report()
    check_accepted(run)
    last = main[-1]
    items = _body_messages(last)
    assert any(i.get("type") == "compaction" for i in items), f"the last call does not carry the compaction item\n{run.report()}"
    assert question in _text_of(items[-1]), run.report()
    if route == "direct":
        assert code not in _text_of(last["body"]), run.report()
    else:
        assert code in _text_of(last["body"]), f"the fact from before the compaction did not reach the upstream\n{run.report()}"
        check_stored_once(run, [("assistant", noted), ("user", question)])


# ----------------------------------------------------------------------------------------------
# Title generation on.


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("agent", ("claude_code", "agent_sdk"))
def test_title_generation_stays_out_of_the_conversation(make_run: Callable[[str, str], Run], agent: str, route: str) -> None:
    run = make_run(agent, route)
    tag = _tag()
    first = f"My hamster is called Pip{tag}. Say hello to him."
    run.turn(first, title=True)
    later = "What is my hamster called?"
    run.turn(later, again=True, title=True)

    check_accepted(run)
    requests = run.mock_requests()
    titles = [r for r in requests if _is_title_call(r)]
    assert titles, f"no title call was made\n{run.report()}"
    for title in titles:
        assert title["body"].get("tools") == [], run.report()
        assert len(title["body"]["messages"]) == 1, f"the title call was forwarded with more than its own message\n{run.report()}"
    main = _main_calls(requests)
    assert main, run.report()
    for request in main:
        assert "<session>" not in _text_of(_body_messages(request)), f"the title call's prompt is in a turn's prompt\n{run.report()}"
    assert f"Pip{tag}" in _text_of(_body_messages(main[-1])), run.report()
    if route == "memproxy":
        check_stored_once(run, [("user", first), ("user", later)])
        check_not_stored(run, ["<session>", TITLE_PROMPT])
