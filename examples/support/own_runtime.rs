//! A real memproxy in this process, on a runtime of its own as the binary runs it, so a
//! measuring example's client and mock do not share its threads. Included by the examples
//! that measure through the real server (`#[path]`).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use memproxy::state::AppState;

/// A memproxy serving on `127.0.0.1` until [`Served::stop`].
pub struct Served {
    pub state: Arc<AppState>,
    pub addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    server: std::thread::JoinHandle<Result<(), memproxy::store::StoreError>>,
}

impl Served {
    /// Serves `config` (a memproxy config file's text) on a free port.
    pub fn start(config_text: &str) -> Served {
        let config = memproxy::config::from_toml(config_text, &|_| None).unwrap();
        let (ready, started) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = std::thread::spawn(move || {
            let runtime = memproxy::server::runtime(&config).unwrap();
            runtime.block_on(async move {
                let state = AppState::build(config).unwrap();
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                ready
                    .send((Arc::clone(&state), listener.local_addr().unwrap()))
                    .unwrap();
                memproxy::server::run(listener, state, async {
                    let _ = stopped.await;
                })
                .await
            })
        });
        let (state, addr) = started.recv().unwrap();
        Served {
            state,
            addr,
            stop,
            server,
        }
    }

    /// Stops the server and waits for it to drain.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let server = self.server;
        let _ = tokio::task::spawn_blocking(move || server.join()).await;
    }
}
