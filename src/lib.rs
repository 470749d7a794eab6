//! memproxy: an OpenAI-compatible proxy that gives an agent a memory.
//!
//! # Layout
//!
//! The request path, in order (see `ARCHITECTURE.md` for the full map):
//!
//! - [`server`] accepts connections and shuts down gracefully;
//! - [`router`] answers health checks, checks client keys, and picks the memory pipeline for
//!   `POST /v1/chat/completions` or pass-through for everything else;
//! - [`pipeline`] runs the memory stages: identify → reconcile → (recall, summary) → assemble →
//!   forward → capture → commit, one file each;
//! - [`upstream`] is the pooled HTTP/HTTPS client and the header rules;
//! - [`store`] keeps conversations in sled, with an in-memory index per conversation;
//! - [`recall`] keeps a BM25 index per conversation for relevance recall;
//! - [`summary`] makes progressive summaries of old history in the background.
//!
//! Operations: [`admin`] (the `/admin/v1/` API and what the offline CLI shares with it),
//! [`metrics`] (`GET /metrics`), [`ttl`] (idle conversations deleted by a background sweeper).
//!
//! Supporting pieces: [`config`] and [`settings`] (configuration and per-request settings),
//! [`identity`] (tenants and ids), [`message`] (the request's messages), [`reply`] and [`sse`]
//! (reading the upstream's answer), [`tokens`] (tiktoken counts), [`error`] (the OpenAI-shaped
//! error), [`body`] (body types), [`state`] (what requests share), [`cli`] (flags).

pub mod admin;
pub mod body;
pub mod cli;
pub mod config;
pub mod error;
pub mod identity;
pub mod message;
pub mod metrics;
pub mod pipeline;
pub mod recall;
pub mod reply;
pub mod router;
pub mod server;
pub mod settings;
pub mod sse;
pub mod state;
pub mod store;
pub mod summary;
pub mod tokens;
pub mod ttl;
pub mod upstream;
