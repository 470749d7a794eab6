//! Runs the built `memproxy` binary, as an operator would, for the CLI tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Runs `memproxy --data-dir DIR ARGS...` in an empty working directory, with no MEMPROXY_*
/// variables from the environment.
pub fn memproxy(data_dir: &Path, args: &[&str]) -> Output {
    run(tempfile::tempdir().unwrap().path(), data_dir, args)
}

/// [`memproxy`] on a store of the engine `backend` (`storage.backend`, in a config file of its
/// own, given with `--config`).
pub fn memproxy_on(data_dir: &Path, backend: &str, args: &[&str]) -> Output {
    let cwd = tempfile::tempdir().unwrap();
    let config = cwd.path().join("memproxy.toml");
    std::fs::write(&config, format!("[storage]\nbackend = \"{backend}\"\n")).unwrap();
    let mut with_config = vec!["--config", config.to_str().unwrap()];
    with_config.extend_from_slice(args);
    run(cwd.path(), data_dir, &with_config)
}

fn run(cwd: &Path, data_dir: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_memproxy"));
    command
        .current_dir(cwd)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .stdin(Stdio::null());
    command.output().unwrap()
}

/// Standard output as text.
pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}
