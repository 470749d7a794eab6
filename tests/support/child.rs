//! The built binary as a child process (so a test can kill it with SIGKILL), listening on a
//! free port of 127.0.0.1 with a config the test gives, and the HTTP helpers that tell a
//! killed process's connection error from an answer.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{Answer, TOKEN, body, client, user};

/// `memproxy serve` as a child process.
pub struct ChildProxy {
    pub child: std::process::Child,
    pub url: String,
    config: PathBuf,
}

impl ChildProxy {
    /// Starts the binary in `dir` with `toml` (anything but `[server]`'s `listen` and
    /// `memory_budget`, which this writes) as its config.
    pub fn start(dir: &Path, toml: &str) -> ChildProxy {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.join("memproxy.toml");
        std::fs::write(
            &config,
            format!("{toml}\n[server]\nlisten = \"127.0.0.1:{port}\"\nmemory_budget = \"1GiB\"\n"),
        )
        .unwrap();
        ChildProxy {
            child: spawn(dir, &config),
            url: format!("http://127.0.0.1:{port}"),
            config,
        }
    }

    /// Waits until `/readyz` answers 200 (at most 15 s).
    pub async fn ready(&self) {
        let url = format!("{}/readyz", self.url);
        let started = Instant::now();
        while try_send("GET", &url, &[], String::new())
            .await
            .is_none_or(|a| a.status != 200)
        {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "timed out waiting for the child to be ready"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Starts the binary again with the same config (after [`ChildProxy::kill`]).
    pub fn restart(&mut self) {
        let dir = self.config.parent().unwrap().to_path_buf();
        self.child = spawn(&dir, &self.config);
    }
}

fn spawn(dir: &Path, config: &Path) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_memproxy"))
        .current_dir(dir)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .arg("--config")
        .arg(config)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

impl Drop for ChildProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends one question to `base` in `conversation` (newest-only habit); true when the
/// exchange was acknowledged as stored.
pub async fn ask(base: &str, conversation: &str, question: &str) -> bool {
    let authorization = format!("Bearer {TOKEN}");
    let headers = [
        ("authorization", authorization.as_str()),
        ("content-type", "application/json"),
        ("x-memory-conversation-id", conversation),
    ];
    let body = body(&[user(question)]).to_string();
    // A child killed mid-request is a connection error: not acknowledged.
    let url = format!("{base}/v1/chat/completions");
    let sent = tokio::time::timeout(
        Duration::from_secs(5),
        try_send("POST", &url, &headers, body),
    )
    .await;
    match sent {
        Ok(Some(answer)) => {
            answer.status == 200
                && answer
                    .headers
                    .get("x-memory-status")
                    .is_some_and(|v| v == "stored")
        }
        _ => false,
    }
}

/// Sends `body` to `url`; `None` when the connection failed (a killed child).
pub async fn try_send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: String,
) -> Option<Answer> {
    use http_body_util::BodyExt;
    let mut request = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let request = request
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let response = client().request(request).await.ok()?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.ok()?.to_bytes();
    Some(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}
