//! memproxy's memory without HTTP: what the edge calls around the forward and nothing of hyper,
//! http or bodies (statuses are chosen at the edge). From the top:
//!
//! - [`memory`] is the memory core's one value (store, recall, summaries, long-term memory,
//!   the clock); [`ttl`] its sweeper;
//! - [`pipeline`] plans a prompt and commits an exchange, one stage per file; [`tools`] is
//!   what the memory tools read (a user's memories and turns, a conversation's turns);
//! - [`summary`] makes summaries in the background; [`longterm`] is what a user said in any
//!   of their conversations (the archive and index per user, extracted memories); [`ledger`]
//!   counts and caps the tokens of memproxy's own calls;
//! - [`config`] the configuration file and [`settings`] the memory settings in effect;
//! - [`recall`] keeps BM25 indexes (with the messages' vectors: hybrid recall); [`embedding`]
//!   makes the vectors (the new message's on the request path, stored messages' in the
//!   background);
//! - [`worker`] the one background worker (summaries, extraction) and the one back-off.
//!
//! Below it: `memproxy_store` (the storage engines) and `memproxy_base` (messages, identities,
//! the wire formats, tokens, the model-call trait).

pub mod config;
pub mod embedding;
pub mod ledger;
pub mod longterm;
pub mod memory;
pub mod pipeline;
pub mod recall;
pub mod settings;
pub mod summary;
pub mod tools;
pub mod ttl;
pub mod worker;
