//! The benchmark's two child processes, both this same binary in a hidden mode: the mock
//! upstream (`--serve-mock`) and memproxy (`--serve-proxy CONFIG`). Each prints `port N` on
//! stdout and serves until its stdin closes; [`ChildProc`] is the parent's handle, which kills
//! the child if it is dropped while the child still runs.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

use crate::mock_upstream::{MockOptions, MockUpstream};

pub fn child_runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => Some(runtime),
        Err(err) => {
            eprintln!("loadbench child: cannot start the runtime: {err}");
            None
        }
    }
}

pub fn announce_port(port: u16) -> bool {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "port {port}")
        .and_then(|()| stdout.flush())
        .is_ok()
}

/// Completes when stdin closes (the parent ended or asked us to stop) or on SIGINT/SIGTERM.
pub async fn parent_gone() {
    let stdin_closed = async {
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 64];
        loop {
            match stdin.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = stdin_closed => {}
        () = terminate => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

pub fn serve_mock() -> ExitCode {
    let Some(runtime) = child_runtime() else {
        return ExitCode::FAILURE;
    };
    let code = runtime.block_on(async {
        let options = MockOptions {
            record: false,
            stream_chunks: 8,
            chunk_delay: Duration::ZERO,
            strict: true,
        };
        let mock = match MockUpstream::start_with(options, None).await {
            Ok(mock) => mock,
            Err(err) => {
                eprintln!("loadbench mock: cannot listen: {err}");
                return ExitCode::FAILURE;
            }
        };
        if !announce_port(mock.addr.port()) {
            return ExitCode::FAILURE;
        }
        parent_gone().await;
        drop(mock);
        ExitCode::SUCCESS
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    code
}

pub fn serve_proxy(config_path: &Path) -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let text = match std::fs::read_to_string(config_path) {
        Ok(text) => text,
        Err(err) => {
            eprintln!(
                "loadbench proxy: cannot read {}: {err}",
                config_path.display()
            );
            return ExitCode::FAILURE;
        }
    };
    let config = match memproxy::config::from_toml(&text, &|_| None) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("loadbench proxy: {err}");
            return ExitCode::FAILURE;
        }
    };
    // The runtime the memproxy binary builds from the same config.
    let runtime = match memproxy::server::runtime(&config) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("loadbench proxy: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async {
        let state = match memproxy::state::AppState::build(config) {
            Ok(state) => state,
            Err(err) => {
                eprintln!("loadbench proxy: cannot start: {err}");
                return ExitCode::FAILURE;
            }
        };
        let local = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let listeners = match memproxy::server::Listeners::bind(&state.config, local).await {
            Ok(listeners) => listeners,
            Err(err) => {
                eprintln!("loadbench proxy: cannot listen: {err}");
                return ExitCode::FAILURE;
            }
        };
        let port = match listeners.local_addr() {
            Ok(addr) => addr.port(),
            Err(err) => {
                eprintln!("loadbench proxy: no local address: {err}");
                return ExitCode::FAILURE;
            }
        };
        if !announce_port(port) {
            return ExitCode::FAILURE;
        }
        match listeners.serve(state, parent_gone()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("loadbench proxy: shutdown failed to flush the store: {err}");
                ExitCode::FAILURE
            }
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    code
}

/// A child process of this benchmark; killed when dropped if still running.
pub struct ChildProc {
    pub name: &'static str,
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub pid: u32,
    pub port: u16,
    pub log: PathBuf,
}

impl ChildProc {
    /// Starts this binary with `args` (a hidden mode), and reads the port it announces.
    pub fn spawn(
        name: &'static str,
        args: &[&std::ffi::OsStr],
        log: &Path,
    ) -> Result<ChildProc, String> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let (mut proc, stdout) = ChildProc::launch(name, &exe, args, &[], log)?;
        let stdout = stdout.ok_or_else(|| format!("{name}: no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let read = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(read.map(|_| line));
        });
        let line = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Ok(line)) => line,
            Ok(Err(err)) => return Err(format!("{name}: reading its port: {err}")),
            Err(_) => return Err(format!("{name}: no port announced within 60 s")),
        };
        proc.port = line
            .trim()
            .strip_prefix("port ")
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| {
                let log = std::fs::read_to_string(&proc.log).unwrap_or_default();
                format!("{name}: expected `port N`, got {line:?}; its stderr: {log}")
            })?;
        Ok(proc)
    }

    /// Starts the mock upstream (this binary, `--serve-mock`), its log in `dir`.
    pub fn mock(dir: &Path) -> Result<ChildProc, String> {
        ChildProc::spawn("mock", &["--serve-mock".as_ref()], &dir.join("mock.log"))
    }

    /// Starts `exe` with `args` and `envs` added to the environment, its stderr into `log`;
    /// `port` is left 0 for the caller to set.
    pub fn launch(
        name: &'static str,
        exe: &Path,
        args: &[&std::ffi::OsStr],
        envs: &[(&str, &str)],
        log: &Path,
    ) -> Result<(ChildProc, Option<ChildStdout>), String> {
        let log_file =
            File::create(log).map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let mut child = Command::new(exe)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .map_err(|e| format!("cannot start the {name} process ({}): {e}", exe.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let pid = child.id();
        // From here on the guard kills the child on any error.
        let proc = ChildProc {
            name,
            child,
            stdin,
            pid,
            port: 0,
            log: log.to_path_buf(),
        };
        Ok((proc, stdout))
    }

    pub fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: String = log
                    .lines()
                    .rev()
                    .take(20)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                Err(format!(
                    "the {} process exited ({status}); last stderr lines:\n{tail}",
                    self.name
                ))
            }
            Err(err) => Err(format!("{}: {err}", self.name)),
        }
    }

    /// Closes its stdin (it shuts down gracefully), waits up to `grace`, then kills it.
    pub fn stop(&mut self, grace: Duration) -> String {
        self.stdin = None;
        self.wait_or_kill(grace)
    }

    /// Sends SIGTERM (the memproxy binary shuts down gracefully on it), waits up to `grace`,
    /// then kills it.
    pub fn terminate(&mut self, grace: Duration) -> String {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        self.wait_or_kill(grace)
    }

    fn wait_or_kill(&mut self, grace: Duration) -> String {
        let deadline = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return format!("exited: {status}"),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return format!(
                        "killed: no exit within {} s of being asked to stop",
                        grace.as_secs()
                    );
                }
                Err(err) => return format!("unknown: {err}"),
            }
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
