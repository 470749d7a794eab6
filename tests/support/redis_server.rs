//! A real `redis-server` for tests: started on a free 127.0.0.1 port in a temporary directory
//! (no snapshots; the append-only file with `appendfsync always`, so a `kill -9` loses nothing
//! it acknowledged), killed when dropped. Shared by the library's tests (included with
//! `#[path]`), the integration tests and the load benchmark. `scripts/test.sh` installs
//! `redis-server` when the machine lacks it.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running redis-server, killed on drop.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

/// A port the kernel says is free now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port on 127.0.0.1")
}

/// Sends one inline command and reads the first reply line.
fn command(port: u16, line: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream.write_all(format!("{line}\r\n").as_bytes()).ok()?;
    let mut buf = [0u8; 512];
    let n = stream.read(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

impl RedisServer {
    /// Starts a fresh server.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts a fresh server with `extra` arguments (`--requirepass`, …).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        for _ in 0..5 {
            let mut server = RedisServer {
                child: None,
                port: free_port(),
                dir: tempfile::tempdir().expect("a temporary directory"),
                extra: extra.iter().map(|a| a.to_string()).collect(),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("redis-server did not start (is it installed? scripts/test.sh installs it)");
    }

    /// Starts the server process on this server's port and directory; true once it answers.
    fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "yes"])
            .args(["--appendfsync", "always"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.dir.path().join("redis.log"))
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let Ok(mut child) = child else {
            panic!(
                "redis-server could not be started: is it installed? (scripts/test.sh installs it)"
            );
        };
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            // With `--requirepass` an unauthenticated PING is refused, which says it is up too.
            if command(self.port, "PING")
                .is_some_and(|r| r.starts_with("+PONG") || r.starts_with("-NOAUTH"))
            {
                self.child = Some(child);
                return true;
            }
            if child.try_wait().ok().flatten().is_some() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server with SIGKILL (what it acknowledged is in its append-only file).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and directory (after [`RedisServer::kill`]).
    pub fn restart(&mut self) {
        self.kill();
        assert!(self.spawn(), "redis-server did not start again");
    }

    /// Sends a command (inline form) and returns the raw reply.
    pub fn command(&self, line: &str) -> String {
        command(self.port, line).unwrap_or_default()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
