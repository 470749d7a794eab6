//! The command line: the flags, and the modes and scenarios they select.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Parser;

use crate::load::Mode;
use crate::scenarios::{SCENARIOS, Scenario};

#[derive(Debug, Parser)]
#[command(
    name = "loadbench",
    about = "Load benchmark: memproxy vs the mock upstream alone"
)]
pub struct Args {
    /// Measured seconds per run (per scenario and mode).
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Warm-up seconds per run, not measured.
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// Smoke test: 1 s measured, 0.2 s warm-up per run.
    #[arg(long)]
    pub quick: bool,
    /// Scenarios to run, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    pub scenarios: Option<Vec<String>>,
    /// Modes, comma-separated: `cN` (closed loop, N tasks) and `open` (fixed rate).
    #[arg(long, value_delimiter = ',', default_value = "c1,c64,open")]
    pub modes: Vec<String>,
    /// Open-loop rate, requests per second.
    #[arg(long, default_value_t = 500)]
    pub rate: u64,
    /// memproxy's `server.worker_threads` (0: one per CPU, as by default).
    #[arg(long, default_value_t = 0)]
    pub proxy_threads: usize,
    /// memproxy's `server.runtime`: `shared` or `per-thread` (default: not set, so memproxy's
    /// default), for the benchmark and the soak alike.
    #[arg(long, value_parser = ["shared", "per-thread"])]
    pub runtime: Option<String>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Run the memory soak instead of the benchmark: mixed traffic against the memproxy
    /// binary for `--duration` seconds, RSS sampled every second (see `soak.rs`).
    #[arg(long)]
    pub soak: bool,
    /// Soak: seconds of traffic.
    #[arg(long, default_value_t = 600.0)]
    pub duration: f64,
    /// Soak: conversations the traffic is spread over.
    #[arg(long, default_value_t = 10_000)]
    pub conversations: usize,
    /// Soak: clients sending at once (each waits for its answer before the next request).
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Soak: the memproxy binary (default: `memproxy` beside this example's folder, i.e. the
    /// binary of the same build profile).
    #[arg(long)]
    pub memproxy: Option<PathBuf>,
    /// Soak: seconds of oversized requests in the middle of the traffic (0: none), each
    /// one's own estimate passing the high-water mark: they must be refused memory while
    /// they last, and memory must be back for ordinary requests within 5 s after.
    #[arg(long, default_value_t = 10.0)]
    pub burst: f64,
    /// Soak: seconds of quiet after the traffic before 20 new requests, which must all get
    /// memory.
    #[arg(long, default_value_t = 10.0)]
    pub rest: f64,
    /// Soak: memory in a redis-server the soak starts (on a free 127.0.0.1 port).
    #[arg(long)]
    pub redis: bool,
    /// Soak: memory in fjall (`storage.backend = "fjall"`) instead of sled.
    #[arg(long, conflicts_with = "redis")]
    pub fjall: bool,
    /// `server.memory_budget` in MiB (default: not set, so memproxy's default); the soak fails
    /// if RSS ever exceeds it plus 64 MiB.
    #[arg(long)]
    pub budget_mib: Option<u64>,
    /// A TOML file merged into the generated config: for the soak (diagnostics: cache sizes,
    /// say) and for a benchmark run (`[receipts]\nenabled = false` to compare, or
    /// `[server]\nblocking_threads = 32`); its keys replace the generated ones of the same name
    /// (`with_extra`).
    #[arg(long)]
    pub proxy_config: Option<PathBuf>,
    /// Internal: serve memproxy with this config file, print `port N`, serve until stdin closes.
    #[arg(long, hide = true)]
    pub serve_proxy: Option<PathBuf>,
    /// Internal: serve the mock upstream, print `port N`, serve until stdin closes.
    #[arg(long, hide = true)]
    pub serve_mock: bool,
}

pub fn parse_modes(args: &Args) -> Result<Vec<Mode>, String> {
    args.modes
        .iter()
        .map(|m| {
            let m = m.trim();
            if m == "open" {
                return Ok(Mode::Open(args.rate.max(1)));
            }
            m.strip_prefix('c')
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| (1..=4096).contains(&n))
                .map(Mode::Closed)
                .ok_or_else(|| format!("unknown mode `{m}`: use cN (1..=4096) or open"))
        })
        .collect()
}

pub fn select_scenarios(args: &Args) -> Result<Vec<Scenario>, String> {
    let Some(names) = &args.scenarios else {
        return Ok(SCENARIOS.to_vec());
    };
    let wanted: BTreeSet<&str> = names
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect();
    for name in &wanted {
        if !SCENARIOS.iter().any(|s| s.name == *name) {
            let all: Vec<&str> = SCENARIOS.iter().map(|s| s.name).collect();
            return Err(format!(
                "unknown scenario `{name}`; known: {}",
                all.join(", ")
            ));
        }
    }
    Ok(SCENARIOS
        .iter()
        .filter(|s| wanted.contains(s.name))
        .copied()
        .collect())
}

/// The generated config with `--proxy-config`'s TOML merged in: a table of both is merged key by
/// key, any other value of the extra file's replaces the generated one. So the file can set a key
/// of a section the run writes (`[server] blocking_threads`) without repeating the table, which
/// TOML refuses.
pub fn with_extra(generated: &str, extra_path: Option<&Path>) -> Result<String, String> {
    let Some(path) = extra_path else {
        return Ok(generated.to_string());
    };
    let extra = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut base: toml::Table = generated
        .parse()
        .map_err(|e| format!("the generated config: {e}"))?;
    let extra: toml::Table = extra
        .parse()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    merge(&mut base, extra);
    Ok(base.to_string())
}

fn merge(into: &mut toml::Table, from: toml::Table) {
    for (key, value) in from {
        match (into.get_mut(&key), value) {
            (Some(toml::Value::Table(inner)), toml::Value::Table(more)) => merge(inner, more),
            (_, value) => {
                into.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_extra_file_merges_into_the_generated_tables() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("extra.toml");
        std::fs::write(
            &path,
            "[server]\nblocking_threads = 32\n[receipts]\nenabled = false\n",
        )
        .unwrap();
        let merged = with_extra(
            "[server]\nshutdown_grace = \"PT10S\"\nblocking_threads = 8\n",
            Some(&path),
        )
        .unwrap();
        let table: toml::Table = merged.parse().unwrap();
        assert_eq!(table["server"]["blocking_threads"].as_integer(), Some(32));
        assert_eq!(table["server"]["shutdown_grace"].as_str(), Some("PT10S"));
        assert_eq!(table["receipts"]["enabled"].as_bool(), Some(false));
        assert_eq!(with_extra("a = 1\n", None).unwrap(), "a = 1\n");
    }
}
