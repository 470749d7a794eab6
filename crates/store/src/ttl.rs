//! TTL records: the TTL a conversation's requests asked for, as last seen, which the sweeper
//! reads to find idle conversations.

use std::time::Duration;

use super::engine::Page;
use super::records::TtlRecord;
use super::{Store, StoreError};
use memproxy_base::identity::ConversationKey;

impl Store {
    /// The TTL last asked for by the conversation's requests, if any.
    pub fn ttl_of(&self, key: &ConversationKey) -> Result<Option<TtlRecord>, StoreError> {
        self.engine.ttl(key)
    }

    /// Remembers the TTL a request used. Writes only when it changed, so a steady client costs
    /// one read per request; a request without TTL (`None`) on a conversation that never had
    /// one writes nothing.
    pub fn remember_ttl(
        &self,
        key: &ConversationKey,
        ttl: Option<Duration>,
    ) -> Result<(), StoreError> {
        let ttl_ms = ttl.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        match self.ttl_of(key)? {
            Some(record) if record.ttl_ms == ttl_ms => return Ok(()),
            None if ttl_ms.is_none() => return Ok(()),
            _ => {}
        }
        let record = TtlRecord {
            ttl_ms,
            set_ms: self.clock.now_ms(),
        };
        self.watch(self.engine.put_ttl(key, &record))
    }

    /// Up to `limit` TTL records after the cursor `after`: the sweeper drops those whose
    /// conversation was never stored.
    pub fn scan_ttl(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(ConversationKey, TtlRecord)>, StoreError> {
        self.engine.ttl_page(after, limit)
    }

    /// Removes a TTL record whose conversation does not exist (checked atomically).
    pub fn drop_orphan_ttl(&self, key: &ConversationKey) -> Result<bool, StoreError> {
        self.engine.drop_orphan_ttl(key)
    }
}
