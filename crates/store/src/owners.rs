//! Owners' records above the engine: long-term memory (`crate::longterm`) keeps its records
//! per owner (a user, an agent, a tenant), each owner with its own key file, exactly as a
//! conversation has one, and every value sealed with it here. Deleting an owner removes its
//! records in one step, flushes, then removes the key: what the engine's files still hold of
//! it can no longer be read.
//!
//! Record ids are stored in the clear (they are numbers, or names already in the clear in
//! conversation keys); values never are.

use super::keys::Key;
use super::records::{OwnerKey, OwnerMeta, OwnerRecord};
use super::seal::{self, Kind, SEALED_PREFIX};
use super::{Page, Store, StoreError};

/// An owner as a writer holds it: the id its records are fenced by, and its key.
#[derive(Clone)]
pub struct OwnerHandle {
    pub owner: OwnerKey,
    pub id: u64,
    pub(super) key: Key,
}

impl std::fmt::Debug for OwnerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerHandle")
            .field("owner", &self.owner)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// A number never handed out before (the sequence of conversation ids): ids of records
    /// that must stay unique across owners (memories).
    pub fn new_id(&self) -> Result<u64, StoreError> {
        self.engine.new_id()
    }

    /// The owner's handle; with `create`, the owner is created when missing (its key durable
    /// before its record is written). `None`: no such owner (and `create` not asked).
    pub fn owner(&self, owner: &OwnerKey, create: bool) -> Result<Option<OwnerHandle>, StoreError> {
        let meta = match self.engine.owner(owner)? {
            Some(meta) => meta,
            None if create => {
                let id = self.engine.new_id()?;
                self.keys.get_or_create(&key_ref(owner), id)?;
                let stored = self.watch(self.engine.create_owner(
                    owner,
                    OwnerMeta {
                        id,
                        created_ms: self.clock.now_ms(),
                    },
                ))?;
                if stored.id != id {
                    // Another writer created it first: this key sealed nothing.
                    self.keys.remove(&key_ref(owner), id)?;
                }
                stored
            }
            None => return Ok(None),
        };
        let key = self
            .keys
            .get(&key_ref(owner), meta.id)?
            .ok_or(StoreError::KeyMissing(meta.id))?;
        Ok(Some(OwnerHandle {
            owner: owner.clone(),
            id: meta.id,
            key,
        }))
    }

    /// Seals and puts `put` (space, id, plaintext) and removes `remove` among the owner's
    /// records, atomically; false when the owner was deleted since `handle` was read.
    pub fn write_owner(
        &self,
        handle: &OwnerHandle,
        put: Vec<(u8, Vec<u8>, Vec<u8>)>,
        remove: &[(u8, Vec<u8>)],
    ) -> Result<bool, StoreError> {
        let mut sealed = Vec::with_capacity(put.len());
        for (space, id, plaintext) in put {
            let value = seal::seal(&handle.key, Kind::Record, &plaintext)?.into_bytes();
            sealed.push(OwnerRecord { space, id, value });
        }
        self.watch(
            self.engine
                .write_owner(&handle.owner, handle.id, &sealed, remove),
        )
    }

    /// One record of the owner, opened.
    pub fn owner_record(
        &self,
        handle: &OwnerHandle,
        space: u8,
        id: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.engine
            .owner_record(&handle.owner, space, id)?
            .map(|value| open_record(handle, &value))
            .transpose()
    }

    /// Up to `limit` records of the owner in `space` after `after`, in id order, opened.
    pub fn owner_records(
        &self,
        handle: &OwnerHandle,
        space: u8,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<OwnerRecord>, StoreError> {
        let (mut page, next) = self
            .engine
            .owner_records(&handle.owner, space, after, limit)?;
        for record in &mut page {
            record.value = open_record(handle, &record.value)?;
        }
        Ok((page, next))
    }

    /// Every record of the owner in `space`, opened (a page of `page` at a time).
    pub fn all_owner_records(
        &self,
        handle: &OwnerHandle,
        space: u8,
    ) -> Result<Vec<OwnerRecord>, StoreError> {
        let mut out = Vec::new();
        let mut after: Option<Vec<u8>> = None;
        loop {
            let (page, next) = self.owner_records(handle, space, after.as_deref(), 1000)?;
            out.extend(page);
            match next {
                Some(next) => after = Some(next),
                None => return Ok(out),
            }
        }
    }

    /// Deletes the owner and all its records, flushes, and removes its key file: nothing of
    /// it is readable afterwards, in the engine or on disk. False when there was no owner.
    pub fn delete_owner(&self, owner: &OwnerKey) -> Result<bool, StoreError> {
        let Some(id) = self.watch(self.engine.delete_owner(owner))? else {
            return Ok(false);
        };
        self.watch(self.engine.flush())?;
        self.keys.remove(&key_ref(owner), id)?;
        Ok(true)
    }

    /// Up to `limit` owners after `after`, in key order (the sweeper and admin listings).
    pub fn owners(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(OwnerKey, OwnerMeta)>, StoreError> {
        self.engine.owners(after, limit)
    }
}

/// The conversation key an owner's key is filed under: key files go by id alone; an engine
/// that keeps keys itself places them by this key (the owner's tenant, a reserved agent name
/// no request can use, since ids never hold `/`).
pub(super) fn key_ref(owner: &OwnerKey) -> memproxy_base::identity::ConversationKey {
    memproxy_base::identity::ConversationKey {
        tenant: owner.tenant.clone(),
        agent: "memproxy/owner".to_string(),
        conversation: String::from_utf8_lossy(&owner.to_bytes()).replace('\0', "/"),
    }
}

fn open_record(handle: &OwnerHandle, value: &[u8]) -> Result<Vec<u8>, StoreError> {
    let sealed = std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.strip_prefix(SEALED_PREFIX))
        .ok_or_else(|| StoreError::Corrupt("an owner record is not sealed".into()))?;
    seal::open(&handle.key, Kind::Record, sealed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::options;
    use memproxy_base::identity::TenantId;

    #[tokio::test]
    async fn records_are_sealed_and_a_delete_removes_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), options()).unwrap();
        let owner = OwnerKey::user(&TenantId::from_token(Some("t")), "bob");
        assert!(store.owner(&owner, false).unwrap().is_none());
        let handle = store.owner(&owner, true).unwrap().unwrap();
        assert_eq!(store.owner(&owner, true).unwrap().unwrap().id, handle.id);
        assert!(
            store
                .write_owner(
                    &handle,
                    vec![(1, b"a".to_vec(), b"I live in Lisbon".to_vec())],
                    &[]
                )
                .unwrap()
        );
        assert!(!store.engine.any_trace_of(b"Lisbon").unwrap());
        assert_eq!(
            store.owner_record(&handle, 1, b"a").unwrap().as_deref(),
            Some(b"I live in Lisbon".as_slice())
        );
        let key_file = dir
            .path()
            .join("keys")
            .join(format!("{:016x}.key", handle.id));
        assert!(key_file.exists());
        store.close().await.unwrap();
        // A reopen keeps the owner's key (it is live).
        drop(store);
        let store = Store::open(dir.path(), options()).unwrap();
        assert!(key_file.exists());
        let handle = store.owner(&owner, false).unwrap().unwrap();
        assert_eq!(store.all_owner_records(&handle, 1).unwrap().len(), 1);
        assert!(store.delete_owner(&owner).unwrap());
        assert!(!key_file.exists());
        assert!(!store.delete_owner(&owner).unwrap());
        assert!(
            !store
                .write_owner(&handle, vec![(1, b"b".to_vec(), b"late".to_vec())], &[])
                .unwrap()
        );
        assert!(store.owner(&owner, false).unwrap().is_none());
    }
}
