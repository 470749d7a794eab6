//! The Responses API ids memproxy answered, per tenant: `response id → conversation`, so a
//! request chained with `previous_response_id` finds its conversation without a conversation
//! header, and `GET`/`DELETE /v1/responses/{id}` find the stored reply.
//!
//! Held in memory, bounded ([`DEFAULT_CAPACITY`] ids, the oldest forgotten first): after a
//! restart, or for an id forgotten, a chained request is forwarded as sent with memory off
//! (the client's conversation header, when it sends one, still finds the conversation).
//! A tenant only ever finds the ids it was answered: the tenant is part of the key.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::identity::{ConversationKey, TenantId};

/// How many ids are remembered: about 300 bytes each (the tenant hash twice, the id, the agent
/// and conversation ids), so at most about 3 MiB. A client chains to its latest ids.
pub const DEFAULT_CAPACITY: usize = 10_000;

#[derive(Debug)]
pub struct ResponseIds {
    inner: Mutex<Inner>,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<(TenantId, String), ConversationKey>,
    order: VecDeque<(TenantId, String)>,
}

impl Default for ResponseIds {
    fn default() -> ResponseIds {
        ResponseIds::with_capacity(DEFAULT_CAPACITY)
    }
}

impl ResponseIds {
    pub fn with_capacity(capacity: usize) -> ResponseIds {
        ResponseIds {
            inner: Mutex::new(Inner::default()),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers that `id` was answered in `key`'s conversation (for `key`'s tenant).
    pub fn insert(&self, id: String, key: ConversationKey) {
        let mut inner = self.lock();
        let entry = (key.tenant.clone(), id);
        if inner.map.insert(entry.clone(), key).is_none() {
            inner.order.push_back(entry);
        }
        while inner.map.len() > self.capacity {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            inner.map.remove(&oldest);
        }
    }

    /// The conversation `tenant` was answered `id` in.
    pub fn get(&self, tenant: &TenantId, id: &str) -> Option<ConversationKey> {
        self.lock()
            .map
            .get(&(tenant.clone(), id.to_string()))
            .cloned()
    }

    /// Forgets `id`; true when `tenant` had it.
    pub fn remove(&self, tenant: &TenantId, id: &str) -> bool {
        let mut inner = self.lock();
        let entry = (tenant.clone(), id.to_string());
        let had = inner.map.remove(&entry).is_some();
        if had {
            inner.order.retain(|e| e != &entry);
        }
        had
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(token: &str, conversation: &str) -> ConversationKey {
        ConversationKey {
            tenant: TenantId::from_token(Some(token)),
            agent: "default".into(),
            conversation: conversation.into(),
        }
    }

    #[test]
    fn ids_are_per_tenant_and_bounded() {
        let ids = ResponseIds::with_capacity(2);
        ids.insert("r1".into(), key("a", "c1"));
        let other = TenantId::from_token(Some("b"));
        assert!(ids.get(&other, "r1").is_none());
        assert!(!ids.remove(&other, "r1"));
        let tenant = key("a", "x").tenant;
        assert_eq!(ids.get(&tenant, "r1").unwrap().conversation, "c1");
        ids.insert("r2".into(), key("a", "c1"));
        ids.insert("r3".into(), key("a", "c2"));
        assert!(ids.get(&tenant, "r1").is_none());
        assert!(ids.remove(&tenant, "r3"));
        assert!(ids.get(&tenant, "r3").is_none());
        assert!(ids.get(&tenant, "r2").is_some());
    }
}
