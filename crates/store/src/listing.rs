//! Reading the store as an operator does: a conversation's record, all its messages,
//! listing and paging by tenant and agent, the sweeper's walk, cache figures, and the full scan
//! that proves a deletion left no trace.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::engine::{Page, Scope};
use super::records::{ConversationMeta, ConversationSummary, StoredMessage};
use super::seal::{open_message, open_summary};
use super::{Store, StoreError};
use memproxy_base::cache::Shrink;
use memproxy_base::identity::ConversationKey;

/// The most keys one listing call looks at.
const MAX_LIST_SCAN: usize = 10_000;

/// Conversations read per page by a walk over the whole store.
const WALK_PAGE: usize = 1000;

impl Store {
    /// The stored record of a conversation, read from the engine (not the cache).
    pub fn meta(&self, key: &ConversationKey) -> Result<Option<ConversationMeta>, StoreError> {
        self.engine.meta(key)
    }

    /// Every stored message of the conversation `key` with record `meta`, in turn order, their
    /// bodies opened.
    pub fn all_messages(
        &self,
        key: &ConversationKey,
        meta: &ConversationMeta,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        // The record's turns: outside them lie only writes it never took.
        let last = meta.next_turn.saturating_sub(1);
        let mut messages = self.engine.range(key, meta.id, meta.first_turn, last)?;
        self.open_messages(key, meta.id, &mut messages)?;
        Ok(messages)
    }

    /// The stored messages of `conversation` from turn `from` on, in turn order, opened.
    pub fn messages_since(
        &self,
        conversation: &super::Conversation,
        from: u64,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        let Some(meta) = &conversation.meta else {
            return Ok(Vec::new());
        };
        let last = meta.next_turn.saturating_sub(1);
        let from = from.max(meta.first_turn);
        let mut messages = self.engine.range(&conversation.key, meta.id, from, last)?;
        self.open_messages(&conversation.key, meta.id, &mut messages)?;
        Ok(messages)
    }

    /// Lists conversations in `scope` after the cursor `after`, at most `limit`, with their
    /// summary counts and TTL records. Returns the page and the cursor of the next one.
    pub fn list(
        &self,
        scope: Scope<'_>,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<ConversationSummary>, StoreError> {
        let (page, next) = self.engine.list(scope, after, limit, MAX_LIST_SCAN)?;
        Ok((self.summarized(page)?, next))
    }

    /// [`Store::list`] of only the conversations `matches` takes: pages are read until
    /// `limit` match, the listing ends, or [`MAX_LIST_SCAN`] conversations were looked at;
    /// the cursor goes on after the last one looked at (or kept, when a page was cut).
    pub fn search(
        &self,
        scope: Scope<'_>,
        after: Option<&[u8]>,
        limit: usize,
        matches: impl Fn(&ConversationKey) -> bool,
    ) -> Result<Page<ConversationSummary>, StoreError> {
        let (mut found, mut cursor, mut looked) = (Vec::new(), after.map(<[u8]>::to_vec), 0);
        let next = loop {
            let (page, next) =
                self.engine
                    .list(scope, cursor.as_deref(), WALK_PAGE, MAX_LIST_SCAN)?;
            looked += page.len();
            found.extend(page.into_iter().filter(|(key, _)| matches(key)));
            match next {
                Some(next) if found.len() < limit && looked < MAX_LIST_SCAN => cursor = Some(next),
                next if found.len() > limit => {
                    found.truncate(limit);
                    break found.last().map(|(key, _)| key.to_bytes()).or(next);
                }
                next => break next,
            }
        };
        Ok((self.summarized(found)?, next))
    }

    /// Listed conversations with their summary counts and TTL records.
    fn summarized(
        &self,
        page: Vec<(ConversationKey, ConversationMeta)>,
    ) -> Result<Vec<ConversationSummary>, StoreError> {
        let mut out = Vec::with_capacity(page.len());
        for (key, meta) in page {
            out.push(ConversationSummary {
                summary_count: self.engine.summaries(&key, meta.id)?.len(),
                ttl: self.engine.ttl(&key)?,
                key,
                meta,
            });
        }
        Ok(out)
    }

    /// Up to `limit` conversations (key and record) after the cursor `after`, in key order:
    /// the sweeper's bounded walk. The second value is false when the walk reached the end.
    pub fn scan(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<(Vec<(ConversationKey, ConversationMeta)>, bool), StoreError> {
        let (page, next) = self
            .engine
            .list(Scope::default(), after, limit, usize::MAX)?;
        Ok((page, next.is_some()))
    }

    /// Conversations whose state is cached in memory.
    pub fn cached_conversations(&self) -> u64 {
        self.cache.entry_count()
    }

    /// The conversation state cache, as the memory guard shrinks it under pressure.
    pub fn state_cache(&self) -> Arc<dyn Shrink> {
        Arc::clone(&self.cache) as Arc<dyn Shrink>
    }

    /// Lookups in the conversation cache so far, and how many missed.
    pub fn cache_counts(&self) -> (u64, u64) {
        (
            self.cache_lookups.load(Ordering::Relaxed),
            self.cache_misses.load(Ordering::Relaxed),
        )
    }

    /// Drops a conversation's cached state (it is read from the engine on next use).
    pub fn invalidate(&self, key: &ConversationKey) {
        self.cache.invalidate(key);
    }

    /// Calls `visit` with every stored conversation (key and record), in key order, a page at
    /// a time, until it returns false.
    pub(super) fn for_each_conversation(
        &self,
        mut visit: impl FnMut(&ConversationKey, &ConversationMeta) -> Result<bool, StoreError>,
    ) -> Result<(), StoreError> {
        let mut after: Option<Vec<u8>> = None;
        loop {
            let (page, next) =
                self.engine
                    .list(Scope::default(), after.as_deref(), WALK_PAGE, usize::MAX)?;
            for (key, meta) in &page {
                if !visit(key, meta)? {
                    return Ok(());
                }
            }
            match next {
                Some(cursor) => after = Some(cursor),
                None => return Ok(()),
            }
        }
    }

    /// True when `needle` can be read anywhere in the store: in any stored key or value as the
    /// engine holds it, or in any message body or summary record once opened with its
    /// conversation's key. A full scan, to prove a deletion left no trace (tests, audits).
    /// Slow on a large store. What the engine holds sealed cannot show `needle`: the bytes on
    /// disk are a separate question, answered by the key's removal.
    pub fn any_trace_of(&self, needle: &[u8]) -> Result<bool, StoreError> {
        if self.engine.any_trace_of(needle)? {
            return Ok(true);
        }
        let found = |bytes: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        let mut seen = false;
        self.for_each_conversation(|key, meta| {
            // A value that cannot be opened (its key is gone) is no readable trace; one stored
            // in plaintext was looked at above.
            let secret = self.keys.get(key, meta.id)?;
            let secret = secret.as_deref();
            seen =
                self.engine
                    .range(key, meta.id, 0, u64::MAX)?
                    .iter()
                    .any(|m| match open_message(secret, meta.id, &m.message) {
                        Ok(Some(body)) => found(body.get().as_bytes()),
                        Ok(None) | Err(_) => false,
                    })
                    || self
                        .engine
                        .summaries(key, meta.id)?
                        .into_iter()
                        .any(|(_, bytes)| {
                            open_summary(secret, meta.id, bytes).is_ok_and(|b| found(&b))
                        });
            Ok(!seen)
        })?;
        if seen {
            return Ok(true);
        }
        // Owners' records (long-term memory), opened with each owner's key.
        let mut after: Option<Vec<u8>> = None;
        loop {
            let (page, next) = self.owners(after.as_deref(), 100)?;
            for (owner, _) in page {
                let Some(handle) = self.owner(&owner, false).ok().flatten() else {
                    continue;
                };
                for space in 0..=u8::MAX {
                    let records = self.all_owner_records(&handle, space).unwrap_or_default();
                    if records.iter().any(|r| found(&r.value) || found(&r.id)) {
                        return Ok(true);
                    }
                }
            }
            match next {
                Some(next) => after = Some(next),
                None => return Ok(false),
            }
        }
    }
}
