//! The integration tests, one binary: each module is one suite (`admin` the admin API, `ttl`
//! expiry, `architecture` the layer check, …), all sharing one harness, [`support`]: a test
//! starts from `Harness::new()`, says what it adds to the config, and `start()` gives it a real
//! memproxy started in-process on `127.0.0.1:0`, its temporary data directory and the strict
//! in-process mock upstream it forwards to.
//!
//! One binary rather than a file per suite because Cargo builds and links every `tests/*.rs`
//! on its own, the mock upstream and the helpers compiled again for each; here they are
//! compiled once. A suite is run by its module path:
//!
//! ```sh
//! cargo nextest run --test it -E 'test(/^admin::/)'
//! cargo test --test it admin::
//! ```
//!
//! `cargo nextest` runs each test in a process of its own, `cargo test` runs them all as
//! threads of one process: no test may rely on process-wide state (environment variables, the
//! current directory, the process's real memory: the budget tests pretend it through the
//! memory guard).
//!
//! `tests/support/` stays outside this folder because the examples, the benchmarks and the
//! storage contract tests in `crates/store/src/contract.rs` include its files by `#[path]` too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../support/mod.rs"]
mod support;

mod admin;
mod agents;
mod apis;
mod architecture;
mod branching;
mod cli;
mod client_timeouts;
mod compression;
mod console;
mod crash;
mod disk_full;
mod erasure;
mod forwarding;
mod ledger;
mod limits;
mod longterm;
mod longterm_meaning;
mod mcp;
mod memory;
mod memory_budget;
mod metrics;
mod prompt_cache;
mod recall;
mod recall_meaning;
mod receipts;
mod redis;
mod runtime;
mod shutdown;
mod store_damage;
mod streaming;
mod strict_mock;
mod tenants;
mod ttl;
mod upstream_timeouts;
