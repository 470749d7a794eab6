"""End-to-end tests: the official OpenAI Python SDK talking to memproxy, in front of the mock
upstream (`examples/mock_upstream.rs`).

The binaries are built beforehand (`cargo build --bins --examples`, done by scripts/test.sh)
and found under target/debug relative to the repository root. A session fixture starts the mock
and memproxy on free loopback ports, with a temporary data directory and an empty config file,
and stops both at the end.

The mock answers every chat completion with `reply to: <last user message text>`. It does not
expose what it received over HTTP, so memory is checked through memproxy's own response headers:
`x-memory-status` and `x-memory-turns` (messages stored for the conversation).

The mock is strict: it refuses, with the provider's own 400, any request the provider's documented
rules refuse. Each fixture that starts one checks at its end that it refused nothing
(`GET /_mock/refusals`), so a forwarded request the provider would refuse fails the run even where
a test reads no answer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import openai
import pytest
from openai import OpenAI

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGET_DIR = Path(os.environ.get("CARGO_TARGET_DIR", REPO_ROOT / "target"))
if not TARGET_DIR.is_absolute():
    TARGET_DIR = REPO_ROOT / TARGET_DIR
MOCK_BIN = TARGET_DIR / "debug" / "examples" / "mock_upstream"
MEMPROXY_BIN = TARGET_DIR / "debug" / "memproxy"

API_KEY = "sk-test-e2e"
MODEL = "gpt-4o-mini"
STARTUP_TIMEOUT = 15.0
CONVERSATION_HEADER = "X-Memory-Conversation-Id"


@dataclass
class Servers:
    mock_url: str
    proxy_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}/v1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env() -> dict[str, str]:
    """The environment for the servers: no MEMPROXY_* settings from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_")}
    env.setdefault("RUST_LOG", "info")
    return env


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-4000:]
    except OSError:
        return "<no log>"


def _start_mock(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    log = workdir / "mock_upstream.log"
    proc = subprocess.Popen(
        [str(MOCK_BIN), "--listen", "127.0.0.1:0"],
        cwd=workdir,
        env=_clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    prefix = "listening on "
    if not line.startswith(prefix):
        _stop(proc)
        raise RuntimeError(f"mock_upstream did not start: stdout={line!r}\n{_read_log(log)}")
    return proc, line[len(prefix):]


def _assert_no_refusals(mock_url: str) -> None:
    """Fails when the strict mock refused a request (each listed with its reason)."""
    root = mock_url.removesuffix("/v1")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(root + "/_mock/refusals", timeout=5) as response:
        refusals = json.loads(response.read())
    assert refusals == [], f"the strict mock refused forwarded requests: {refusals}"


def _healthy(port: int) -> bool:
    # No proxies: the request must go straight to the loopback address.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _start_memproxy(
    workdir: Path,
    upstream: str,
    config_text: str = "",
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    config = workdir / "memproxy.toml"
    config.write_text(config_text)
    last_error = ""
    # A port picked free can be taken before memproxy binds it: try a few.
    for attempt in range(3):
        port = _free_port()
        log = workdir / f"memproxy-{attempt}.log"
        proc = subprocess.Popen(
            [
                str(MEMPROXY_BIN),
                "--config",
                str(config),
                "--listen",
                f"127.0.0.1:{port}",
                "--upstream",
                upstream,
                "--data-dir",
                str(workdir / "data"),
                *extra_args,
            ],
            cwd=workdir,
            env={**_clean_env(), **(extra_env or {})},
            stdin=subprocess.DEVNULL,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if _healthy(port):
                return proc, port
            time.sleep(0.05)
        _stop(proc)
        last_error = _read_log(log)
    raise RuntimeError(f"memproxy did not become healthy:\n{last_error}")


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    for binary in (MOCK_BIN, MEMPROXY_BIN):
        if not binary.exists():
            pytest.fail(f"{binary} is missing: run `cargo build --bins --examples` first")
    # The SDK's HTTP client honours proxy variables; loopback must never go through a proxy.
    for name in ("NO_PROXY", "no_proxy"):
        current = os.environ.get(name, "")
        os.environ[name] = ",".join(p for p in (current, "127.0.0.1", "localhost") if p)
    workdir = tmp_path_factory.mktemp("memproxy-e2e")
    mock, mock_url = _start_mock(workdir)
    proxy = None
    try:
        proxy, port = _start_memproxy(workdir, mock_url)
        yield Servers(mock_url=mock_url, proxy_port=port)
        _assert_no_refusals(mock_url)
    finally:
        _stop(proxy)
        _stop(mock)


def _client(servers: Servers, **kwargs: object) -> OpenAI:
    options: dict[str, object] = {
        "base_url": servers.base_url,
        "api_key": API_KEY,
        "max_retries": 0,
        "timeout": 10.0,
    }
    options.update(kwargs)
    return OpenAI(**options)  # type: ignore[arg-type]


@pytest.fixture
def client(servers: Servers) -> Iterator[OpenAI]:
    c = _client(servers)
    yield c
    c.close()


@pytest.fixture
def cid() -> str:
    return f"e2e-{uuid.uuid4().hex}"


def _chat_raw(client: OpenAI, cid: str | None, messages: list[dict[str, object]], **kwargs: object):
    headers = {CONVERSATION_HEADER: cid} if cid else {}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        extra_headers=headers,
        **kwargs,  # type: ignore[arg-type]
    )
    return raw, raw.parse()


def test_plain_chat_is_stored(client: OpenAI, cid: str) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        extra_headers={CONVERSATION_HEADER: cid},
    )
    assert completion.choices[0].message.content == "reply to: hello there"

    other = f"{cid}-raw"
    raw, completion = _chat_raw(client, other, [{"role": "user", "content": "second hello"}])
    assert completion.choices[0].message.content == "reply to: second hello"
    assert raw.headers["x-memory-status"] == "stored"
    assert raw.headers["x-memory-turns"] == "2"
    assert raw.headers["x-memory-conversation-id"] == other


def test_newest_only_habit_builds_memory(client: OpenAI, cid: str) -> None:
    raw, completion = _chat_raw(client, cid, [{"role": "user", "content": "my name is Ada"}])
    assert completion.choices[0].message.content == "reply to: my name is Ada"
    assert raw.headers["x-memory-turns"] == "2"

    raw, completion = _chat_raw(client, cid, [{"role": "user", "content": "what is my name?"}])
    assert completion.choices[0].message.content == "reply to: what is my name?"
    assert raw.headers["x-memory-status"] == "stored"
    assert raw.headers["x-memory-turns"] == "4"


def test_full_resend_habit_stores_each_message_once(client: OpenAI, cid: str) -> None:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "You are a terse assistant."},
    ]
    for i in range(1, 6):
        text = f"question number {i}"
        messages.append({"role": "user", "content": text})
        raw, completion = _chat_raw(client, cid, messages)
        message = completion.choices[0].message
        assert message.content == f"reply to: {text}"
        assert raw.headers["x-memory-status"] == "stored"
        assert raw.headers["x-memory-turns"] == str(2 * i)
        messages.append(message.model_dump(exclude_none=True))
    assert raw.headers["x-memory-turns"] == "10"


def test_streaming_is_stored(client: OpenAI, cid: str) -> None:
    text = "tell me a story"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={CONVERSATION_HEADER: cid},
    )
    assert raw.headers["x-memory-status"] == "stored"
    assert raw.headers["content-type"].startswith("text/event-stream")
    pieces: list[str] = []
    usage = None
    with raw.parse() as stream:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
    assert "".join(pieces) == f"reply to: {text}"
    assert len(pieces) > 1, "the answer should arrive in several chunks"
    assert usage is not None and usage.total_tokens == 2

    follow, completion = _chat_raw(client, cid, [{"role": "user", "content": "and then?"}])
    assert completion.choices[0].message.content == "reply to: and then?"
    assert follow.headers["x-memory-status"] == "stored"
    assert follow.headers["x-memory-turns"] == "4"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tools_param_and_tool_call_history(client: OpenAI, cid: str) -> None:
    question = {"role": "user", "content": "what is the weather in Paris?"}
    raw, completion = _chat_raw(client, cid, [question], tools=[WEATHER_TOOL])
    assert completion.choices[0].message.content == f"reply to: {question['content']}"
    assert raw.headers["x-memory-status"] == "stored"
    assert raw.headers["x-memory-turns"] == "2"

    # A conversation the way an SDK tool loop sends it: the assistant's tool call, then the
    # tool's result.
    history: list[dict[str, object]] = [
        question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_weather_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_weather_1", "content": '{"sky": "sunny", "c": 21}'},
    ]
    tool_cid = f"{cid}-tools"
    raw, completion = _chat_raw(client, tool_cid, history, tools=[WEATHER_TOOL])
    assert completion.choices[0].message.content == f"reply to: {question['content']}"
    assert raw.headers["x-memory-status"] == "stored"
    assert raw.headers["x-memory-turns"] == "4"


def test_default_headers_client(servers: Servers, cid: str) -> None:
    with _client(servers, default_headers={CONVERSATION_HEADER: cid}) as client:
        first = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "one"}]
        )
        assert first.parse().choices[0].message.content == "reply to: one"
        assert first.headers["x-memory-status"] == "stored"
        assert first.headers["x-memory-turns"] == "2"
        second = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "two"}]
        )
        assert second.parse().choices[0].message.content == "reply to: two"
        assert second.headers["x-memory-turns"] == "4"
        assert second.headers["x-memory-conversation-id"] == cid


def test_bad_memory_header_is_a_bad_request(client: OpenAI, cid: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={CONVERSATION_HEADER: cid, "X-Memory-Recent-N": "lots"},
        )
    err = caught.value
    assert err.status_code == 400
    body = err.body
    assert isinstance(body, dict)
    error = body.get("error", body)
    assert error["param"] == "x-memory-recent-n"
    assert error["type"] == "invalid_request_error"
    assert err.param == "x-memory-recent-n"


def test_models_pass_through(client: OpenAI) -> None:
    models = client.models.list()
    assert "mock-model" in [m.id for m in models.data]


def test_path_form_needs_no_headers(servers: Servers, cid: str) -> None:
    base_url = f"http://127.0.0.1:{servers.proxy_port}/agents/support/conversations/{cid}/v1"
    with _client(servers, base_url=base_url) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "via the path"}]
        )
        assert raw.parse().choices[0].message.content == "reply to: via the path"
        assert raw.headers["x-memory-conversation-id"] == cid
        assert raw.headers["x-memory-status"] == "stored"
        assert raw.headers["x-memory-turns"] == "2"


def test_a_users_other_conversations_are_recalled(client: OpenAI, cid: str) -> None:
    """Long-term memory: what a user said in one conversation is recalled in their next one,
    never for another user of the tenant."""
    user = {"X-Memory-User-Id": f"{cid}-user"}
    fact = "my favourite harbour town is Cascais"
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": fact}],
        extra_headers={CONVERSATION_HEADER: f"{cid}-first", **user},
    )
    question = [{"role": "user", "content": "which harbour town is my favourite?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=question,
        extra_headers={CONVERSATION_HEADER: f"{cid}-second", **user},
    )
    assert raw.headers["x-memory-status"] == "stored"
    assert int(raw.headers["x-memory-retrieved-elsewhere"]) >= 1
    other = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=question,
        extra_headers={CONVERSATION_HEADER: f"{cid}-third", "X-Memory-User-Id": f"{cid}-other"},
    )
    assert "x-memory-retrieved-elsewhere" not in other.headers
