//! Group commit: callers ask for durability and wait; one background task flushes the store
//! and releases every caller whose writes came before that flush began. Concurrent commits so
//! share one flush instead of queueing one each.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Hands out flush tickets and runs the flushing task.
#[derive(Debug)]
pub struct GroupFlusher {
    requested: AtomicU64,
    wake: Notify,
    done: watch::Sender<(u64, Option<FlushError>)>,
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
        });
        let task_flusher = Arc::clone(&flusher);
        let task = tokio::spawn(async move {
            loop {
                task_flusher.wake.notified().await;
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
}
