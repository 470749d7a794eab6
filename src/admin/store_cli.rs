//! The offline CLI's `memproxy store check` and `memproxy store repair --into NEW_DIR [--engine
//! fjall]`, on the data directory of a stopped memproxy (a sled store). The work is
//! `store/salvage.rs`'s; this prints the report and chooses the exit code.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

use crate::config::{Backend, Config};
use crate::store::Embedded;
use crate::store::salvage::{self, Report, SalvageError};

/// `memproxy store ...`.
#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Read everything in the data directory (conversation records, messages, summaries, TTL
    /// records, key files) and report what cannot be read. Changes nothing. Exit code 0: all
    /// readable; 1: something is not; 2: the check could not run.
    Check {
        /// Where the store's files are copied while they are read (they are removed after).
        /// Default: the system's temporary directory.
        #[arg(long, value_name = "DIR")]
        scratch: Option<PathBuf>,
    },
    /// Salvage what can be read into a fresh data directory, keeping conversations, turn
    /// numbers, summaries, TTL records and keys; the damaged directory is never changed. Prints
    /// what was salvaged and what was lost. Exit code 0 once the new store is written.
    Repair {
        /// The new data directory (must not exist, or be empty). Start memproxy on it after.
        #[arg(long, value_name = "NEW_DIR")]
        into: PathBuf,
        /// The engine the new store is written with: "sled", or "fjall" to move the store to
        /// fjall (then start memproxy with storage.backend = "fjall").
        #[arg(long, value_name = "ENGINE", default_value = "sled", value_parser = ["sled", "fjall"])]
        engine: String,
    },
}

/// Runs one command; the report goes to standard output, errors to standard error.
pub fn run(config: &Config, command: StoreCommand) -> ExitCode {
    let data_dir = &config.data_dir;
    if !matches!(config.backend, Backend::Sled) {
        let _ = writeln!(
            std::io::stderr(),
            "memproxy: `memproxy store check` and `repair` read a sled store (storage.backend = \"sled\"); fjall checks its own files as it opens them, and Redis keeps its own"
        );
        return ExitCode::from(2);
    }
    let (result, title, repaired) = match command {
        StoreCommand::Check { scratch } => {
            let scratch = scratch
                .unwrap_or_else(std::env::temp_dir)
                .join(format!("memproxy-check-{}", std::process::id()));
            (
                salvage::check(data_dir, &scratch),
                format!("memproxy store check: {}", data_dir.display()),
                false,
            )
        }
        StoreCommand::Repair { into, engine } => {
            let engine = Embedded::named(&engine).unwrap_or(Embedded::Sled);
            let title = format!(
                "memproxy store repair: {} into {} ({})",
                data_dir.display(),
                into.display(),
                engine.name()
            );
            (salvage::repair(data_dir, &into, engine), title, true)
        }
    };
    match result {
        Ok(report) => print(&title, &report, repaired),
        Err(err) => {
            let _ = writeln!(std::io::stderr(), "memproxy: {err}");
            match err {
                SalvageError::NoStore(_) | SalvageError::InUse(_) | SalvageError::NotEmpty(_) => {
                    ExitCode::from(2)
                }
                _ => ExitCode::FAILURE,
            }
        }
    }
}

fn print(title: &str, report: &Report, repaired: bool) -> ExitCode {
    let verdict = match (repaired, report.damaged()) {
        (false, false) => "the store is whole: everything can be read",
        (false, true) => {
            "the store is damaged: what is listed cannot be read (`memproxy store repair --into NEW_DIR` salvages the rest)"
        }
        (true, false) => "repaired: everything was salvaged; start memproxy on the new directory",
        (true, true) => {
            "repaired: what is listed above was lost, the rest was salvaged; start memproxy on the new directory"
        }
    };
    let text = format!("{title}\n{}{verdict}\n", report.render(repaired));
    if writeln!(std::io::stdout().lock(), "{text}").is_err() {
        return ExitCode::FAILURE;
    }
    if report.damaged() && !repaired {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
