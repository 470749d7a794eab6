//! The memory pipeline, one stage per file, with nothing of HTTP: the edge (`crate::proxy`)
//! reads the request, calls [`plan::plan`] before forwarding and [`commit::Exchange::commit`]
//! after.
//!
//! 1. [`reconcile`] — which of the request's messages are new;
//! 2. [`window`] — the recent window; [`recall`] — relevant older turns; [`budget`] — the
//!    token budget; [`summary`] — the summary slot of the prompt, and a new summary when due;
//! 3. [`assemble`] — the forwarded `messages` ([`plan`] runs stages 1–3 under the
//!    conversation's lock);
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
pub mod recall;
pub mod reconcile;
pub mod summary;
pub mod window;
