//! The memory core's one value: the store, the recall indexes, the summarizer and the clock.
//! Core functions (the pipeline, the TTL sweeper, the admin operations) take a `&Memory`;
//! nothing here knows HTTP. The HTTP edge holds it in `AppState`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::config::{self, CompressionConfig, Config};
use crate::embedding::Embedding;
use crate::ledger::Ledger;
use crate::longterm::LongTerm;
use crate::recall::Recall;
use crate::summary::Summarizer;
use memproxy_base::identity::{ConversationKey, TenantId};
use memproxy_base::model::ModelCall;
use memproxy_store::{
    Clock, Deleted, OwnerKey, RedisOptions, Scope, Store, StoreError, StoreOptions,
};

/// Counters of the TTL sweeper's passes (mirrored into the metrics at each scrape).
#[derive(Debug, Default)]
pub struct SweepCounters {
    pub passes: AtomicU64,
    pub scanned: AtomicU64,
    pub deleted: AtomicU64,
}

impl SweepCounters {
    pub fn record(&self, scanned: usize, deleted: usize) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.scanned.fetch_add(scanned as u64, Ordering::Relaxed);
        self.deleted.fetch_add(deleted as u64, Ordering::Relaxed);
    }
}

/// What was deleted, as [`OnDelete`] is told.
#[derive(Debug, Clone, Copy)]
pub enum Erased<'a> {
    /// One conversation.
    Conversation(&'a ConversationKey),
    /// Every conversation of a tenant (each was told as a conversation too).
    Tenant(&'a TenantId),
}

/// What holds conversations' text above the core (the edge's receipts): told of every
/// delete, whoever made it (an operator, a user or tenant delete, the TTL sweeper), through
/// the one function set once by the edge. The core cannot call up into the edge's modules;
/// this is how it tells them.
#[derive(Default)]
pub struct OnDelete(OnceLock<Box<Told>>);

/// The function [`OnDelete`] calls.
type Told = dyn Fn(Erased<'_>) + Send + Sync;

impl OnDelete {
    /// Sets the function told of deletes; `false` when one was set already.
    pub fn set(&self, told: impl Fn(Erased<'_>) + Send + Sync + 'static) -> bool {
        self.0.set(Box::new(told)).is_ok()
    }

    fn tell(&self, erased: Erased<'_>) {
        if let Some(told) = self.0.get() {
            told(erased);
        }
    }
}

impl std::fmt::Debug for OnDelete {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnDelete")
            .field("set", &self.0.get().is_some())
            .finish()
    }
}

/// Everything memory is made of.
#[derive(Debug)]
pub struct Memory {
    pub store: Arc<Store>,
    pub recall: Arc<Recall>,
    /// Recall by meaning: the embedder and the job that embeds stored messages.
    pub embedding: Embedding,
    /// Long-term memory per user: archives, their indexes, extracted memories.
    pub longterm: LongTerm,
    pub summarizer: Arc<Summarizer>,
    /// Background tokens per agent and conversation, and the daily budget (`ledger.rs`).
    pub ledger: Arc<Ledger>,
    /// The one clock, the store's (`memproxy_store::Clock`).
    pub clock: Arc<Clock>,
    pub sweeps: SweepCounters,
    /// Branches closed by commits (a client's history left the stored line).
    pub branches_closed: AtomicU64,
    /// Told of every delete (the receipts, above the core).
    pub on_delete: OnDelete,
}

/// The store's options from the config.
/// How the Redis engine connects, from `[storage]`.
pub fn redis_options(redis: &config::RedisConfig) -> RedisOptions {
    RedisOptions {
        url: redis.url.0.clone(),
        password: redis.password.as_ref().map(|p| p.0.clone()),
        key_prefix: redis.key_prefix.clone(),
        pool_size: u32::try_from(redis.pool_size).unwrap_or(u32::MAX),
        connect_timeout: redis.connect_timeout,
        command_timeout: redis.command_timeout,
        wait_replicas: redis.wait_replicas,
        wait_timeout: redis.wait_timeout,
    }
}

pub fn store_options(config: &Config) -> StoreOptions {
    StoreOptions {
        durability: config.durability,
        page_cache_bytes: config.store_cache_bytes,
        state_cache_bytes: config.state_cache_bytes,
    }
}

impl Memory {
    /// The caches that give memory back under pressure (`memory_guard.rs` in the edge
    /// shrinks them): conversation state, recall indexes, users' indexes.
    pub fn caches(&self) -> Vec<Arc<dyn memproxy_base::cache::Shrink>> {
        vec![
            self.store.state_cache(),
            self.recall.cache(),
            self.longterm.cache(),
        ]
    }

    /// Memory over `store`, its summaries made by `model`. Must be called inside a tokio
    /// runtime: the summary worker starts here.
    pub fn new(
        store: Arc<Store>,
        model: Arc<dyn ModelCall>,
        compression: CompressionConfig,
        recall_cache_bytes: u64,
        ledger: Arc<Ledger>,
        embedding: Embedding,
    ) -> Memory {
        let clock = Arc::clone(store.clock());
        // The recall share of the memory budget is split: three quarters for the
        // conversations' indexes, one for the users' (long-term memory), so the caches
        // together stay within `storage.recall_cache_bytes`.
        let recall = Arc::new(
            Recall::new(
                recall_cache_bytes - recall_cache_bytes / 4,
                embedding.space().map(|(id, dims)| (id.to_string(), dims)),
            )
            .deriving(embedding.derived().cloned()),
        );
        let longterm = LongTerm::new(
            recall_cache_bytes / 4,
            Arc::clone(&store),
            Arc::clone(&model),
            Arc::clone(&ledger),
            embedding.embedder().cloned(),
        );
        embedding.start(
            Arc::clone(&store),
            Arc::clone(&recall),
            longterm.owner_catch_up(),
        );
        Memory {
            recall,
            embedding,
            longterm,
            summarizer: Summarizer::start(
                Arc::clone(&store),
                model,
                compression,
                Arc::clone(&ledger),
            ),
            ledger,
            store,
            clock,
            sweeps: SweepCounters::default(),
            branches_closed: AtomicU64::new(0),
            on_delete: OnDelete::default(),
        }
    }

    /// Checks that the store takes writes, reopening it when its writes failed and a retry is
    /// due (`store/health.rs`); after a reopen the recall indexes are dropped too, as they may
    /// cover writes that were never durable. An error means memory is off for now: the
    /// caller goes on without it. Blocks.
    pub fn writable(&self) -> Result<(), StoreError> {
        if self.store.writable()? {
            self.recall.forget_all();
            self.longterm.forget_all();
        }
        Ok(())
    }

    /// Remembers the TTL a chat request ran with; called by the commit once the request's
    /// exchange is stored, so a request that stores nothing writes no TTL either. A failure is
    /// logged, never returned: TTL bookkeeping must not fail a chat request.
    pub fn remember_ttl(&self, key: &ConversationKey, ttl: Option<Duration>) {
        if let Err(err) = self.store.remember_ttl(key, ttl) {
            tracing::warn!(error = %err, "remembering the conversation's TTL failed");
        }
    }

    /// Deletes a conversation completely (store, workspace, cached state, recall index).
    pub fn delete_conversation(
        &self,
        key: &ConversationKey,
    ) -> Result<Option<Deleted>, StoreError> {
        let deleted = self.store.delete_conversation(key)?;
        self.forget_deleted(key);
        Ok(deleted)
    }

    /// Drops what the caches hold of the deleted conversation `key`: its recall index, its
    /// background tokens not yet committed (the ledger), and (told through [`OnDelete`]) its
    /// receipts. Every delete goes through here: admin, user, tenant, TTL.
    pub fn forget_deleted(&self, key: &ConversationKey) {
        self.recall.forget(key);
        self.ledger.forget(key);
        self.on_delete.tell(Erased::Conversation(key));
    }

    /// Drops what the caches hold of the deleted `tenant` (after each of its conversations
    /// was [`Memory::forget_deleted`]): the users' indexes, and whatever [`OnDelete`] holds.
    pub fn forget_deleted_tenant(&self, tenant: &TenantId) {
        self.longterm.forget_tenant(tenant);
        self.on_delete.tell(Erased::Tenant(tenant));
    }

    /// The TTL sweeper's delete: only if the conversation is still idle since before
    /// `cutoff_ms`.
    pub fn delete_idle(&self, key: &ConversationKey, cutoff_ms: i64) -> Result<bool, StoreError> {
        let deleted = self.store.delete_idle_conversation(key, cutoff_ms)?;
        if deleted.is_some() {
            self.forget_deleted(key);
        }
        Ok(deleted.is_some())
    }

    /// Deletes a user of a tenant (long-term memory): every conversation the user's archive
    /// knows, the archive and the user's memories, with the same erasure as a conversation
    /// delete (the user's key file goes last). `None` when the user has nothing stored.
    pub fn delete_user(&self, tenant: &TenantId, user: &str) -> Result<Option<usize>, StoreError> {
        let deleted = delete_user_in(&self.store, tenant, user, |key| self.forget_deleted(key))?;
        self.longterm.forget(&OwnerKey::user(tenant, user));
        Ok(deleted)
    }

    /// Stops the summary worker (waiting up to `grace` for jobs in flight), then flushes and
    /// closes the store: the last steps of shutdown.
    pub async fn shutdown(&self, grace: Duration) -> Result<(), StoreError> {
        self.summarizer.shutdown(grace).await;
        self.embedding.shutdown(grace).await;
        self.longterm.shutdown(grace).await;
        self.store.close().await
    }
}

/// Deletes a user of a tenant in `store` (see [`Memory::delete_user`]), calling `forget` for
/// each conversation deleted. Shared with the offline CLI, which has no caches.
pub fn delete_user_in(
    store: &Store,
    tenant: &TenantId,
    user: &str,
    forget: impl Fn(&ConversationKey),
) -> Result<Option<usize>, StoreError> {
    let owner = OwnerKey::user(tenant, user);
    let Some(handle) = store.owner(&owner, false)? else {
        return Ok(None);
    };
    let mut deleted = 0;
    for key in crate::longterm::archive::conversations(store, &handle)? {
        if store.delete_conversation(&key)?.is_some() {
            deleted += 1;
        }
        forget(&key);
    }
    store.delete_owner(&owner)?;
    Ok(Some(deleted))
}

/// Deletes every conversation of a tenant in `store`, calling `forget` for each, then the
/// tenant's workspace folder with anything left in it. Shared with the offline CLI, which has
/// no recall indexes.
pub fn delete_tenant_in(
    store: &Store,
    tenant: &TenantId,
    forget: impl Fn(&ConversationKey),
) -> Result<usize, StoreError> {
    let scope = Scope {
        tenant: Some(tenant),
        agent: None,
    };
    let mut count = 0;
    loop {
        let (page, _) = store.list(scope, None, 1000)?;
        if page.is_empty() {
            break;
        }
        for summary in page {
            if store.delete_conversation(&summary.key)?.is_some() {
                count += 1;
            }
            forget(&summary.key);
        }
    }
    // Long-term memory: the tenant's users, agents and the tenant's own memories.
    let mut after: Option<Vec<u8>> = None;
    loop {
        let (page, next) = store.owners(after.as_deref(), 1000)?;
        for (owner, _) in page {
            if owner.tenant == *tenant {
                store.delete_owner(&owner)?;
            }
        }
        match next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let probe = ConversationKey {
        tenant: tenant.clone(),
        agent: "probe".to_string(),
        conversation: "probe".to_string(),
    };
    for conversation_dir in [
        memproxy_store::workspace_dir(store.data_dir(), &probe),
        memproxy_store::legacy_workspace_dir(store.data_dir(), &probe),
    ] {
        if let Some(tenant_dir) = conversation_dir.parent().and_then(std::path::Path::parent) {
            match std::fs::remove_dir_all(tenant_dir) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => return Err(StoreError::File(err)),
            }
        }
    }
    Ok(count)
}
