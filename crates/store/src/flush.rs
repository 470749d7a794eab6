//! Group commit: callers ask for durability and wait; one background task flushes the store
//! and releases every caller whose writes came before that flush began. Concurrent commits so
//! share one flush instead of queueing one each.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use super::StoreError;
use super::engine::Engine;

/// Why a flush failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the store could not be flushed to disk: {message}")]
pub struct FlushError {
    pub message: String,
    /// A failure to write to disk (see [`StoreError::is_write_failure`]).
    pub disk: bool,
}

impl FlushError {
    fn of(err: &StoreError) -> FlushError {
        FlushError {
            message: err.to_string(),
            disk: err.is_write_failure(),
        }
    }

    fn other(message: String) -> FlushError {
        FlushError {
            message,
            disk: false,
        }
    }
}

/// The least time from one flush's start to the next's. Under a steady stream of commits the
/// flushes would follow each other at once, each making one or two commits durable: every flush
/// is a log write and a `sync_file_range` on sled's IO threads, which wake all of them. A
/// flush asked for within this time of the last one's start waits for the rest of it, and so
/// takes along every commit that came meanwhile; one asked for after a quiet moment starts at
/// once.
const FLUSH_GAP: Duration = Duration::from_millis(2);

/// Hands out flush tickets and runs the flushing task.
#[derive(Debug)]
pub struct GroupFlusher {
    requested: AtomicU64,
    wake: Notify,
    done: watch::Sender<(u64, Option<FlushError>)>,
    /// Flushes started.
    flushes: AtomicU64,
}

impl GroupFlusher {
    /// Starts the flushing task over `engine`. The task ends when the returned flusher is dropped
    /// by every holder and the task is aborted by the store's shutdown.
    pub fn start(engine: Arc<dyn Engine>) -> (Arc<GroupFlusher>, JoinHandle<()>) {
        let (done, _) = watch::channel((0, None));
        let flusher = Arc::new(GroupFlusher {
            requested: AtomicU64::new(0),
            wake: Notify::new(),
            done,
            flushes: AtomicU64::new(0),
        });
        let task_flusher = Arc::clone(&flusher);
        let task = tokio::spawn(async move {
            let mut last_start: Option<Instant> = None;
            loop {
                task_flusher.wake.notified().await;
                if let Some(last) = last_start {
                    let since = last.elapsed();
                    if since < FLUSH_GAP {
                        tokio::time::sleep(FLUSH_GAP - since).await;
                    }
                }
                last_start = Some(Instant::now());
                task_flusher.flushes.fetch_add(1, Ordering::Relaxed);
                // Every ticket up to `target` was taken after its writes were applied, so one
                // flush starting now makes all of them durable.
                let target = task_flusher.requested.load(Ordering::Acquire);
                let engine = Arc::clone(&engine);
                let result = tokio::task::spawn_blocking(move || engine.flush()).await;
                let error = match result {
                    Ok(Ok(_)) => None,
                    Ok(Err(err)) => Some(FlushError::of(&err)),
                    Err(err) => Some(FlushError::other(err.to_string())),
                };
                task_flusher.done.send_replace((target, error));
            }
        });
        (flusher, task)
    }

    /// How many flushes have started.
    pub fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }

    /// Waits until everything written before this call is on disk.
    pub async fn sync(&self) -> Result<(), FlushError> {
        let ticket = self.requested.fetch_add(1, Ordering::AcqRel) + 1;
        let mut done = self.done.subscribe();
        self.wake.notify_one();
        match done.wait_for(|(flushed, _)| *flushed >= ticket).await {
            Ok(state) => match &state.1 {
                None => Ok(()),
                Some(err) => Err(err.clone()),
            },
            Err(_) => Err(FlushError::other(
                "the flushing task has stopped".to_string(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn concurrent_syncs_all_complete() {
        let dir = tempfile::tempdir().unwrap();
        let engine: Arc<dyn Engine> =
            Arc::new(crate::SledEngine::open(dir.path(), 1 << 20, None).unwrap());
        let (flusher, task) = GroupFlusher::start(Arc::clone(&engine));
        let mut joins = Vec::new();
        for _ in 0..32 {
            let flusher = Arc::clone(&flusher);
            let engine = Arc::clone(&engine);
            joins.push(tokio::spawn(async move {
                engine.new_id().unwrap();
                flusher.sync().await
            }));
        }
        for join in joins {
            join.await.unwrap().unwrap();
        }
        task.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flushes_asked_for_back_to_back_are_spaced_and_each_takes_many_commits() {
        let dir = tempfile::tempdir().unwrap();
        let engine: Arc<dyn Engine> =
            Arc::new(crate::SledEngine::open(dir.path(), 1 << 20, None).unwrap());
        let (flusher, task) = GroupFlusher::start(Arc::clone(&engine));
        let started = Instant::now();
        let mut writers = Vec::new();
        for _ in 0..8 {
            let flusher = Arc::clone(&flusher);
            let engine = Arc::clone(&engine);
            writers.push(tokio::spawn(async move {
                for _ in 0..25 {
                    engine.new_id().unwrap();
                    flusher.sync().await.unwrap();
                }
            }));
        }
        for writer in writers {
            writer.await.unwrap();
        }
        let elapsed = started.elapsed();
        let flushes = flusher.flushes();
        // Each flush starts at least FLUSH_GAP after the one before.
        let most = elapsed.as_micros() / FLUSH_GAP.as_micros() + 1;
        assert!(
            u128::from(flushes) <= most,
            "{flushes} flushes in {elapsed:?}"
        );
        // 200 syncs, eight at a time: they share flushes.
        assert!(flushes < 200 / 2, "{flushes} flushes for 200 syncs");
        task.abort();
    }
}
