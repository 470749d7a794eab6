//! memproxy: an OpenAI-compatible proxy that gives an agent a memory.
//!
//! # Layout
//!
//! From the edge down to the leaves (see `ARCHITECTURE.md` for the layers and the request
//! path mapped to files):
//!
//! - [`server`] accepts connections (at most `server.max_connections`), times out clients
//!   that stall, tracks the connections and shuts down gracefully; [`cli`] the flags;
//! - [`router`] answers health checks, checks client keys, and picks memory for the three
//!   APIs it serves (`POST /v1/chat/completions`, `/v1/responses`, `/v1/messages`) or
//!   pass-through for everything else;
//! - [`admin`] is the `/admin/v1/` API (and what the offline CLI shares with it); [`mcp`] the
//!   memory tools over the Model Context Protocol (`/mcp`, `memproxy mcp` over stdio);
//! - [`proxy`] is the HTTP edge of memory: identify, the `before`/`after` steps around the one
//!   forward path, the SSE tee, the `X-Memory-*` headers;
//! - [`state`] is what the edge shares: config, memory, upstream, metrics, the memory guard;
//! - [`upstream`] (the client, header rules, the forward path, memproxy's model calls),
//!   [`metrics`], [`error`] (every error response), [`body`], [`reply`] and [`sse`] are the
//!   HTTP parts; [`memory_guard`] admits memory requests under `server.memory_budget`;
//!   [`models`] sends memproxy's own model calls to the model's family (OpenAI-compatible or
//!   Anthropic);
//! - [`memory`] is the memory core's one value (store, recall, summaries, clock); [`ttl`] its
//!   sweeper;
//! - [`pipeline`] plans a prompt and commits an exchange, one stage per file; [`tools`] what
//!   the memory tools read;
//! - [`summary`] makes summaries in the background; [`longterm`] is what a user said in any
//!   of their conversations (the archive and index per user, extracted memories);
//!   [`recall`] keeps BM25 indexes and the messages' vectors (hybrid recall); [`embedding`]
//!   makes the vectors, with the embedder [`embedder`] loads at start (in process, or the
//!   upstream's `/v1/embeddings`);
//! - [`store`] keeps conversations behind a storage contract (sled by default); [`embed`]
//!   turns texts into vectors (all-MiniLM-L6-v2 in process, and a static table from it);
//! - leaves: [`config`], [`model`] (the model-call trait), [`settings`], [`identity`],
//!   [`message`], [`tokens`], [`heap`] (what cached values really take), [`wire`] (the three
//!   request formats memory serves, read into and written from the one message model).

pub mod admin;
pub mod allocator;
pub mod body;
pub mod cli;
pub mod embedder;
pub mod error;
pub mod mcp;
pub mod memory_guard;
pub mod metrics;
pub mod models;
pub mod proxy;
pub mod receipts;
pub mod reply;
pub mod router;
pub mod server;
pub mod sse;
pub mod state;
pub mod upstream;

// The layers below, each a crate of its own (`crates/`), named here as modules so that the edge,
// the tests and the tools read `memproxy::store::…`, `memproxy::pipeline::…` as before.
pub use memproxy_base::{cache, heap, identity, message, model, tokens, wire};
pub use memproxy_core::{
    config, embedding, ledger, longterm, memory, pipeline, recall, settings, summary, tools, ttl,
};
pub use memproxy_embed as embed;
pub use memproxy_store as store;
