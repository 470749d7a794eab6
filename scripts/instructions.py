#!/usr/bin/env python3
"""Instructions a request costs memproxy, counted by callgrind: an A/B that noise does not move.

`scripts/perf.sh` times requests on a shared machine, where one round can differ from the next by
a quarter; a change worth 1–3% of a stored exchange's CPU is lost in that. This script runs each
binary under valgrind's callgrind and counts the instructions its threads execute (all of them:
the request's, sled's, the background workers') over a fixed set of requests, the same for every
binary:

  mem-store   a new user message in one of CONVERSATIONS conversations of MESSAGES stored
              messages (round-robin), each exchange stored, as perf.sh's mem-store row
  mem-ro      the same with `X-Memory-Persist: false`, as perf.sh's mem-ro row
  pass        a request without a conversation id, passed through

The conversations are filled first and WARM requests of each memory row are sent before counting,
with the instrumentation off (callgrind's `--instr-atstart=no`; `callgrind_control -i on` starts it
for the counted requests only). The upstream is a constant chat completion served by this script
on 127.0.0.1. Instruction counts are not time (a cache miss costs no instruction, so a change to
memory layout shows in perf.sh only), but they repeat from run to run within a fraction of a
percent, and each row's count is split by function in its callgrind file
(`callgrind_annotate DIR/ROW-NAME.out`) with `--keep`. With `--cache-sim`, callgrind also
simulates the caches and the report adds the first-level and last-level data misses a request:
a model of the machine's caches (valgrind's defaults, the host's sizes where it reads them), not
the machine, but as repeatable as the instructions. Valgrind does not run AVX-512 or the SHA
extensions: their fallbacks run instead (the vectors' products on AVX2, SHA-256 in software), so
those costs are overstated here.

Usage: scripts/instructions.py --binary NEW [--baseline OLD] [--conversations 8] [--messages 200]
                               [--requests 100] [--warm 40] [--keep DIR] [--cache-sim]
                               [--extra FILE] [--baseline-extra FILE]
Needs: valgrind (Debian's `valgrind`: valgrind, callgrind_control), python3; release builds; the
embedding model where memproxy looks for it (else the memory rows recall by words alone and the
script warns). Every address is on 127.0.0.1; every loop is bounded.
"""

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.dont_write_bytecode = True
sys.path.insert(0, str(ROOT / "scripts"))
import perf_seeds  # noqa: E402 (beside this script: perf.sh's conversations)
ANSWER = json.dumps(
    {
        "id": "chatcmpl-perf",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "gpt-4o-mini",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "This is the constant answer of the measurement upstream: the "
                    "garden plan stays as agreed and the budget is unchanged.",
                },
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 24, "completion_tokens": 22, "total_tokens": 46},
    }
).encode()


class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server's name)
        length = int(self.headers.get("content-length", "0"))
        self.rfile.read(length)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def log_message(self, *args):
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def question(n):
    return json.dumps(
        {
            "model": "gpt-4o-mini",
            "messages": [
                {
                    "role": "user",
                    "content": f"Question {n} of thread 0: what did we decide about the "
                    "garden plan, the budget and the tickets?",
                }
            ],
        }
    ).encode()


class Proxy:
    """One memproxy under callgrind, instrumentation off until asked."""

    def __init__(self, name, binary, work, upstream_port, cache_sim, extra):
        self.name = name
        self.dir = work / name
        self.dir.mkdir()
        self.port = free_port()
        config = self.dir / "memproxy.toml"
        config.write_text(
            f"""[server]
listen = "127.0.0.1:{self.port}"
shutdown_grace = "PT5S"
memory_budget = "1GiB"

[upstream]
base_url = "http://127.0.0.1:{upstream_port}/v1"
connect_timeout = "PT2S"

[storage]
data_dir = "{self.dir / 'data'}"
"""
            + (extra.read_text() if extra else "")
        )
        env = dict(os.environ, RUST_LOG="warn")
        model = ROOT / "models/all-MiniLM-L6-v2"
        if "MEMPROXY_MODEL_DIR" not in env and (model / "model.safetensors").is_file():
            env["MEMPROXY_MODEL_DIR"] = str(model)
        self.log = open(self.dir / "log", "wb")
        self.process = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--cache-sim={'yes' if cache_sim else 'no'}",
                f"--callgrind-out-file={self.dir / 'callgrind.out'}",
                str(binary),
                "--config",
                str(config),
                "serve",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.connection = None
        self.wait_ready()

    def wait_ready(self):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"instructions.py: memproxy {self.name} exited; see {self.dir / 'log'}")
            try:
                status, body = self.request("GET", "/readyz", None, {})
                if status == 200:
                    ready = json.loads(body)
                    if "embedder_reason" in ready:
                        print(f"warning: memproxy {self.name} recalls by words alone: "
                              f"{ready['embedder_reason']}", file=sys.stderr)
                    return
            except OSError:
                self.connection = None
            time.sleep(0.5)
        sys.exit(f"instructions.py: memproxy {self.name} not ready within 600 s")

    def request(self, method, path, body, headers):
        if self.connection is None:
            self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        self.connection.request(method, path, body=body, headers=headers)
        answer = self.connection.getresponse()
        data = answer.read()
        self.last_status = answer.headers.get("x-memory-status")
        return answer.status, data

    def chat(self, body, conversation=None, persist=True, expect=None):
        headers = {"content-type": "application/json", "authorization": "Bearer sk-perf"}
        if conversation is not None:
            headers["x-memory-conversation-id"] = conversation
            if not persist:
                headers["x-memory-persist"] = "false"
        status, _ = self.request("POST", "/v1/chat/completions", body, headers)
        if status != 200 or (expect and self.last_status != expect):
            sys.exit(
                f"instructions.py: {self.name}: status {status}, x-memory-status "
                f"{self.last_status!r} (expected {expect!r})"
            )

    def control(self, *args):
        subprocess.run(
            ["callgrind_control", *args, str(self.process.pid)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def counted(self, row, send):
        """Instructions over what `send` sends: zeroed, on, sent, dumped, off."""
        before = set(self.dir.glob("callgrind.out*"))
        self.control("-z")
        self.control("-i", "on")
        send()
        self.control("-d", row)
        self.control("-i", "off")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            new = [p for p in self.dir.glob("callgrind.out*") if p not in before]
            for path in new:
                text = path.read_text(errors="replace")
                lines = text.splitlines()
                events = next((l.split()[1:] for l in lines if l.startswith("events:")), None)
                totals = [l for l in lines if l.startswith(("totals:", "summary:"))]
                if events and totals:
                    path.rename(self.dir / f"{row}.out")
                    values = [int(v) for v in totals[-1].split()[1:]]
                    return dict(zip(events, values + [0] * (len(events) - len(values))))
            time.sleep(0.2)
        sys.exit(f"instructions.py: no callgrind dump from {self.name} for {row}")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def measure(name, binary, work, upstream_port, args, seeds, extra):
    proxy = Proxy(name, binary, work, upstream_port, args.cache_sim, extra)
    try:
        for c, body in enumerate(seeds):
            proxy.chat(body, f"st-{c}", expect="stored")
            proxy.chat(body, f"ro-{c}", expect="stored")
        n = 0

        def store(count):
            nonlocal n
            for _ in range(count):
                n += 1
                proxy.chat(question(n), f"st-{n % len(seeds)}", expect="stored")

        def read_only(count):
            nonlocal n
            for _ in range(count):
                n += 1
                proxy.chat(question(n), f"ro-{n % len(seeds)}", persist=False)

        def passed(count):
            nonlocal n
            for _ in range(count):
                n += 1
                proxy.chat(question(n))

        store(args.warm)
        read_only(args.warm)
        passed(args.warm)
        rows = {}
        rows["mem-store"] = proxy.counted("mem-store", lambda: store(args.requests))
        rows["mem-ro"] = proxy.counted("mem-ro", lambda: read_only(args.requests))
        rows["pass"] = proxy.counted("pass", lambda: passed(args.requests))
        return {
            row: {event: total / args.requests for event, total in events.items()}
            for row, events in rows.items()
        }
    finally:
        proxy.stop()


def value(events, key):
    """An event of callgrind's, or a sum of its read and write kinds (`D1m`: D1mr + D1mw)."""
    if key in events:
        return events[key]
    return events.get(key + "r", 0) + events.get(key + "w", 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--binary", required=True, type=Path)
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--keep", type=Path, help="keep the callgrind files in this folder")
    parser.add_argument(
        "--extra",
        type=Path,
        help="TOML added to each memproxy's config after its [storage] section (another "
        "section, or lines of [storage]), e.g. `[embedding]\\nembedder = \"off\"`",
    )
    parser.add_argument(
        "--baseline-extra",
        type=Path,
        help="the same for the baseline only (default: --extra's), so two settings of one "
        "binary can be compared (--baseline the same binary)",
    )
    parser.add_argument(
        "--cache-sim",
        action="store_true",
        help="also simulate the caches (callgrind's --cache-sim=yes): first-level and "
        "last-level misses a request, reads and writes together",
    )
    args = parser.parse_args()
    if not (1 <= args.conversations <= 1000 and 2 <= args.messages <= 5000):
        sys.exit("--conversations must be 1..=1000, --messages 2..=5000")
    if not (1 <= args.requests <= 100_000 and 0 <= args.warm <= 100_000):
        sys.exit("--requests must be 1..=100000, --warm 0..=100000")
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            sys.exit(f"instructions.py: needs {tool} (apt-get install valgrind)")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    upstream_port = server.server_address[1]
    seeds = perf_seeds.bodies(args.conversations, args.messages)
    binaries = [("new", args.binary)] + ([("base", args.baseline)] if args.baseline else [])
    extras = {"new": args.extra, "base": args.baseline_extra or args.extra}
    work = Path(tempfile.mkdtemp(prefix="instructions-"))
    try:
        print(
            f"instructions a request, callgrind: {args.conversations} conversations of "
            f"{args.messages} messages, {args.warm} warm-up and {args.requests} counted "
            "requests a row"
        )
        results = {}
        shown = [("Ir", "instructions")]
        if args.cache_sim:
            shown += [("D1m", "L1 data misses"), ("DLm", "last-level data misses")]
        for name, binary in binaries:
            results[name] = measure(name, binary, work, upstream_port, args, seeds, extras[name])
            setting = f", with {extras[name]}" if extras[name] else ""
            print(f"  {name} ({binary}{setting}), a request:")
            for row, events in results[name].items():
                print(f"    {row:<10}" + "".join(
                    f" {label} {value(events, key):>12,.0f}" for key, label in shown))
        if "base" in results:
            print("  new / base:")
            for row in results["new"]:
                print(f"    {row:<10}" + "".join(
                    f" {label} {value(results['new'][row], key) / max(value(results['base'][row], key), 1e-9):.4f}"
                    for key, label in shown))
    finally:
        server.shutdown()
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for name, _ in binaries:
                for out in (work / name).glob("*.out"):
                    shutil.copy(out, args.keep / f"{name}-{out.name}")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
