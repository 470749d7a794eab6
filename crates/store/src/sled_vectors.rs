//! Vectors in the sled engine (the [`Vectors`] part of the contract, `engine.rs`): the
//! `vectors` tree keyed like `messages` (conversation id, turn) and the `owner_vectors` tree
//! keyed like `owner_records` (owner key bytes `\0` space, id). A conversation's put checks
//! its record and writes each vector beside its message without a transaction (see
//! `put_vectors`); an owner's is one transaction that checks the owner's record and each record
//! it describes. What removes a message or a record removes its vector with it or after it
//! (`sled_engine.rs`).

use sled::Transactional;

use super::super::StoreError;
use super::super::engine::{SealedVector, Vectors};
use super::super::records::{ConversationMeta, OwnerKey, OwnerMeta};
use super::{
    SledEngine, done_or_count, holding, message_key, owner_prefix, owner_record_key, turn_of,
};
use memproxy_base::identity::ConversationKey;

impl Vectors for SledEngine {
    fn put_vectors(
        &self,
        key: &ConversationKey,
        id: u64,
        vectors: &[(u64, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError> {
        let t = self.trees()?;
        let key_bytes = key.to_bytes();
        let same_life = || -> Result<bool, StoreError> {
            let current = t
                .conversations
                .get(&key_bytes)?
                .and_then(|bytes| serde_json::from_slice::<ConversationMeta>(&bytes).ok());
            Ok(current.is_some_and(|m| m.id == id))
        };
        if !same_life()? {
            return Ok(None);
        }
        // Single-key writes, not a transaction (each of which rolls sled's log buffer to
        // disk): each vector is written beside its message as read before, and taken back when
        // the message is no longer that one afterwards. Whatever removes a message removes its
        // vector after it, so a vector written before a removal goes with it, and one written
        // after finds its message gone.
        let mut written = 0;
        for (turn, value) in vectors {
            // The value that holds the message: its own, or its exchange's batch.
            let Some((at, message)) = holding(&t.messages, id, *turn)? else {
                continue;
            };
            let k = message_key(id, *turn);
            t.vectors.insert(k, value.as_slice())?;
            if t.messages.get(at)?.as_ref() == Some(&message) {
                written += 1;
            } else {
                t.vectors.remove(k)?;
            }
        }
        if !same_life()? {
            return Ok(None);
        }
        Ok(Some(written))
    }

    fn vectors(
        &self,
        _key: &ConversationKey,
        id: u64,
    ) -> Result<Vec<SealedVector<u64>>, StoreError> {
        let t = self.trees()?;
        let mut out = Vec::new();
        for item in t.vectors.scan_prefix(id.to_be_bytes()) {
            let (key, value) = item?;
            let turn = turn_of(&key)
                .ok_or_else(|| StoreError::Corrupt("a vector key is malformed".into()))?;
            out.push((turn, value.to_vec()));
        }
        Ok(out)
    }

    fn put_owner_vectors(
        &self,
        owner: &OwnerKey,
        id: u64,
        vectors: &[(u8, Vec<u8>, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError> {
        let t = self.trees()?;
        let owner_bytes = owner.to_bytes();
        let result = (&t.owners, &t.owner_records, &t.owner_vectors).transaction(
            |(owners, records, vecs)| {
                let current = owners
                    .get(&owner_bytes)?
                    .and_then(|bytes| serde_json::from_slice::<OwnerMeta>(&bytes).ok());
                if current.map(|m| m.id) != Some(id) {
                    return Ok(None);
                }
                let mut written = 0;
                for (space, record_id, value) in vectors {
                    let k = owner_record_key(owner, *space, record_id);
                    if records.get(&k)?.is_some() {
                        vecs.insert(k, value.as_slice())?;
                        written += 1;
                    }
                }
                Ok(Some(written))
            },
        );
        done_or_count(result)
    }

    fn owner_vectors(
        &self,
        owner: &OwnerKey,
        space: u8,
    ) -> Result<Vec<SealedVector<Vec<u8>>>, StoreError> {
        let t = self.trees()?;
        let prefix = owner_prefix(owner, Some(space));
        let mut out = Vec::new();
        for item in t.owner_vectors.scan_prefix(&prefix) {
            let (key, value) = item?;
            let id = key.get(prefix.len()..).unwrap_or_default();
            out.push((id.to_vec(), value.to_vec()));
        }
        Ok(out)
    }

    fn vector_count(&self) -> Result<u64, StoreError> {
        let t = self.trees()?;
        let mut count = 0;
        for tree in [&t.vectors, &t.owner_vectors] {
            for key in tree.iter().keys() {
                key?;
                count += 1;
            }
        }
        Ok(count)
    }
}
