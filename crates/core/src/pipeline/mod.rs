//! The memory pipeline, one stage per file, with nothing of HTTP: the edge (`memproxy::proxy`)
//! reads the request, calls [`plan::plan`] before forwarding and [`commit::Exchange::commit`]
//! after. [`plan::plan`] runs the stages in order under the conversation's lock, each file
//! named as the stage's function there:
//!
//! 1. [`reconcile`] — which of the request's messages are new;
//! 2. [`window`] — the recent window; [`summarized`] — the summary slot of the prompt, and a
//!    new summary when due; [`recalled`] — relevant older turns; [`budget`] — the token budget;
//! 3. [`assemble`] — the forwarded `messages`;
//! 4. [`commit`] — new messages and the reply, stored atomically and durably.
//!
//! [`catch_up`] brings a cached conversation to the stored version when other replicas share
//! the store (before planning, and after a commit found it stale).
//!
//! Invariant: a memory failure never fails the chat request. Every function here returns a
//! typed error; the edge decides what the client sees (the request goes upstream with its own
//! messages and `X-Memory-Status: degraded`).

pub mod assemble;
pub mod budget;
pub mod catch_up;
pub mod commit;
pub mod plan;
pub mod recalled;
pub mod reconcile;
pub mod summarized;
pub mod window;
