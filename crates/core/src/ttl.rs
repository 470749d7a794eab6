//! Conversation TTL: the background sweeper that deletes conversations idle for longer than
//! their TTL.
//!
//! A conversation's TTL is the one its last request used (`ttl` setting or `X-Memory-Ttl`,
//! remembered in the store's TTL records by [`Memory::remember_ttl`]), else its agent's
//! configured `ttl`; none means it is kept forever. The sweeper walks the conversations in key
//! order, a bounded slice per pass (`sweeper.max_scanned` looked at, `sweeper.max_deleted`
//! deleted), resuming where the last pass stopped, and deletes through the same path as the
//! admin API's `DELETE`. It only reads time through [`memproxy_store::Clock`] (`Memory::clock`), so tests move
//! time forward instead of sleeping.

use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::memory::Memory;
use memproxy_store::StoreError;

/// Where the sweeper's walk stands between passes.
#[derive(Debug, Default, Clone)]
pub struct Cursor {
    conversations: Option<Vec<u8>>,
    ttl: Option<Vec<u8>>,
    /// Owners of long-term memories (their decayed memories are swept too).
    owners: Option<Vec<u8>>,
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Conversations looked at.
    pub scanned: usize,
    /// Conversations deleted.
    pub deleted: usize,
    /// TTL records dropped whose conversation was never stored.
    pub orphans: usize,
    /// Long-term memories deleted because their decay score fell under `memory_min_decay`.
    pub decayed: usize,
}

/// One bounded pass of the sweeper.
pub fn sweep_pass(
    memory: &Memory,
    config: &Config,
    cursor: &mut Cursor,
) -> Result<Pass, StoreError> {
    let limits = config.sweeper;
    let now = memory.clock.now_ms();
    let store = &memory.store;
    let mut pass = Pass::default();

    let (batch, more) = store.scan(cursor.conversations.as_deref(), limits.max_scanned)?;
    let batch_len = batch.len();
    for (key, meta) in batch {
        if pass.deleted == limits.max_deleted {
            break;
        }
        pass.scanned += 1;
        cursor.conversations = Some(key.to_bytes());
        let ttl = match store.ttl_of(&key)? {
            Some(record) => record.ttl(),
            None => config.profile(&key.agent).ttl,
        };
        let Some(ttl) = ttl else { continue };
        let cutoff = now.saturating_sub(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX));
        if meta.last_activity_ms < cutoff && memory.delete_idle(&key, cutoff)? {
            pass.deleted += 1;
        }
    }
    if !more && pass.scanned == batch_len {
        cursor.conversations = None;
    }

    // TTL records of conversations that were never stored (the request failed upstream, or
    // stored nothing) are dropped once they are older than their TTL.
    let (records, next) = store.scan_ttl(cursor.ttl.as_deref(), limits.max_scanned)?;
    for (key, record) in &records {
        let expired = record.ttl_ms.is_none_or(|ttl| {
            now.saturating_sub(record.set_ms) > i64::try_from(ttl).unwrap_or(i64::MAX)
        });
        if expired && store.drop_orphan_ttl(key)? {
            pass.orphans += 1;
        }
    }
    cursor.ttl = next;

    // Long-term memory: memories decayed under `memory_min_decay` (of the `[memory]` settings).
    let (decayed, next) = crate::longterm::sweep_decayed(
        store,
        cursor.owners.as_deref(),
        limits.max_scanned,
        crate::longterm::decay_of(&config.memory),
        now,
    )?;
    pass.decayed = decayed;
    cursor.owners = next;

    memory.sweeps.record(pass.scanned, pass.deleted);
    if pass.deleted > 0 {
        tracing::info!(
            deleted = pass.deleted,
            scanned = pass.scanned,
            "TTL sweeper deleted idle conversations"
        );
    }
    Ok(pass)
}

/// The running sweeper: a tracked background task.
#[derive(Debug)]
pub struct Sweeper {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Sweeper {
    /// Starts the sweeper: one pass every `sweeper.interval`, the first one interval after
    /// start, each on the blocking pool (store I/O).
    pub fn start(memory: Arc<Memory>, config: Arc<Config>) -> Sweeper {
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let every = config.sweeper.interval;
            let mut cursor = Cursor::default();
            loop {
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    _ = &mut stopped => return,
                }
                let (memory, config) = (Arc::clone(&memory), Arc::clone(&config));
                let mut pass_cursor = cursor.clone();
                let outcome = tokio::task::spawn_blocking(move || {
                    let result = sweep_pass(&memory, &config, &mut pass_cursor);
                    (result, pass_cursor)
                })
                .await;
                match outcome {
                    Ok((Ok(_), next)) => cursor = next,
                    Ok((Err(err), next)) => {
                        cursor = next;
                        tracing::warn!(error = %err, "TTL sweep pass failed");
                    }
                    Err(err) => tracing::warn!(error = %err, "TTL sweep pass panicked"),
                }
            }
        });
        Sweeper { stop, task }
    }

    /// Stops the sweeper, waiting for a pass in progress to finish.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        if let Err(err) = self.task.await {
            tracing::warn!(error = %err, "the TTL sweeper ended abnormally");
        }
    }
}
