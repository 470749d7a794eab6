"""End-to-end: the official OpenAI Python SDK alternating between two memproxy processes that
share one memory in Redis (a real redis-server started here on a free loopback port, in a
temporary directory; `scripts/test.sh` installs it when missing).

Thirty turns of one conversation, each on the other replica, with the SDK's habit of sending
the whole history: 60 messages stored exactly once, and the fact told at turn 3 is in the prompt
the replica serving turn 30 builds (read through the admin API's preview, since the mock does
not expose what it received).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from openai import OpenAI

from test_openai_sdk import (
    API_KEY,
    CONVERSATION_HEADER,
    MEMPROXY_BIN,
    MOCK_BIN,
    MODEL,
    STARTUP_TIMEOUT,
    _assert_no_refusals,
    _free_port,
    _start_memproxy,
    _start_mock,
    _stop,
)

ADMIN_TOKEN = "admin-token-e2e"


def _start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is missing: scripts/test.sh installs it")
    for _ in range(3):
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(workdir),
             "--logfile", str(workdir / "redis.log")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return proc, port
            except OSError:
                time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=5)
    raise RuntimeError("redis-server did not start")


def _start_replica(workdir: Path, upstream: str, redis_url: str, name: str) -> tuple[subprocess.Popen[bytes], int]:
    home = workdir / name
    home.mkdir()
    return _start_memproxy(
        home,
        upstream,
        extra_args=("--redis-url", redis_url),
        extra_env={"MEMPROXY_ADMIN_TOKEN": ADMIN_TOKEN},
    )


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    for binary in (MOCK_BIN, MEMPROXY_BIN):
        if not binary.exists():
            pytest.fail(f"{binary} is missing: run `cargo build --bins --examples` first")
    for name in ("NO_PROXY", "no_proxy"):
        current = os.environ.get(name, "")
        os.environ[name] = ",".join(p for p in (current, "127.0.0.1", "localhost") if p)
    workdir = tmp_path_factory.mktemp("memproxy-redis-e2e")
    redis, redis_port = _start_redis(workdir)
    mock, mock_url = _start_mock(workdir)
    started: list[subprocess.Popen[bytes]] = []
    try:
        ports = []
        for name in ("a", "b"):
            proc, port = _start_replica(workdir, mock_url, f"redis://127.0.0.1:{redis_port}", name)
            started.append(proc)
            ports.append(port)
        yield ports[0], ports[1]
        _assert_no_refusals(mock_url)
    finally:
        for proc in started:
            _stop(proc)
        _stop(mock)
        _stop(redis)


def _admin(port: int, method: str, path: str, body: object | None = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/admin/v1{path}",
        data=data,
        method=method,
        headers={"authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=10) as response:
        return json.loads(response.read())


def test_an_sdk_client_alternating_between_two_replicas_for_30_turns(replicas: tuple[int, int]) -> None:
    cid = f"e2e-redis-{uuid.uuid4().hex}"
    clients = [
        OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=10.0)
        for port in replicas
    ]
    fact = "My locker code is 7291 and my cat is called Quillfeather."
    history: list[dict[str, object]] = [{"role": "system", "content": "be brief"}]
    try:
        for turn in range(1, 31):
            if turn == 3:
                text = fact
            elif turn == 30:
                text = "What is my cat called?"
            else:
                text = f"Small talk number {turn} about the weather"
            history.append({"role": "user", "content": text})
            client = clients[turn % 2]
            if turn == 30:
                # What this replica forwards for the last question: the turn-3 fact is recalled.
                listing = _admin(replicas[turn % 2], "GET", "/conversations?agent=default&limit=100")
                tenant = next(c["tenant"] for c in listing["conversations"] if c["id"] == cid)
                preview = _admin(
                    replicas[turn % 2],
                    "POST",
                    f"/conversations/{tenant}/default/{cid}/preview",
                    {"model": MODEL, "messages": history},
                )
                assert "Quillfeather" in json.dumps(preview["messages"])
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=history,  # type: ignore[arg-type]
                extra_headers={CONVERSATION_HEADER: cid},
            )
            assert raw.headers["x-memory-status"] == "stored", turn
            assert raw.headers["x-memory-turns"] == str(2 * turn)
            reply = raw.parse().choices[0].message.content
            assert reply == f"reply to: {text}"
            history.append({"role": "assistant", "content": reply})
        # Both replicas read the same 60 messages.
        for port in replicas:
            listing = _admin(port, "GET", "/conversations?agent=default&limit=100")
            shown = next(c for c in listing["conversations"] if c["id"] == cid)
            assert shown["message_count"] == 60
    finally:
        for client in clients:
            client.close()
