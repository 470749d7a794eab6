//! Owners' records (long-term memory, `crate::longterm`) in the Redis engine: the owner part
//! of the storage contract (`engine.rs`), kept apart from the conversations' part.
//!
//! # Keys
//!
//! An owner's keys share the hash tag `{O}` of the key its encryption key is filed under
//! (`owners::key_ref`: the owner's tenant and a reserved agent name, hashed like a
//! conversation's key), so an owner lives in one Redis Cluster slot with its encryption key,
//! and each script below touches that slot only:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `P{O}:owner` | hash | `key` (the owner key's bytes), `id`, `meta` ([`OwnerMeta`], JSON) |
//! | `P{O}:ov` | hash | the records: field the space byte then the record id, value the (sealed) record |
//! | `P{O}:oi` | sorted set | the same fields, score 0: the records in (space, id) order (`ZRANGEBYLEX`) |
//! | `P{O}:ovec` | hash | the records' vectors (`vectors.rs`, `redis_vectors.rs`): field as in `ov`, value the sealed vector |
//! | `P{O}:k:ID` | string | the owner's encryption key (`keys.rs`), kept for good once the owner is created |
//! | `P:idx:owner` | sorted set | every owner's key bytes, score 0, in key order: a hint kept after each create and delete, cleaned of owners that are gone |
//!
//! # Atomicity
//!
//! Creating an owner, writing its records (checked against the owner's id in the same
//! script, so a writer that read the owner before a delete writes nothing) and deleting it
//! (record, records and encryption key at once) are each one Lua script. A page of records is
//! one script too (the ids and their values read together). Owners never expire.

use redis::Script;

use super::super::StoreError;
use super::super::engine::Page;
use super::super::layout::{decode, encode};
use super::super::records::{OwnerKey, OwnerMeta, OwnerRecord};
use super::{Keys, MAX_ATTEMPTS, RedisEngine, lex_after};

/// KEYS: owner, the encryption key made for this id. ARGV: owner key bytes, id, meta JSON.
/// The meta stored: this one (then the encryption key is kept for good), or the one another
/// writer stored first.
const CREATE_OWNER: &str = r"
local meta = redis.call('HGET', KEYS[1], 'meta')
if meta then return {0, meta} end
redis.call('HSET', KEYS[1], 'key', ARGV[1], 'id', ARGV[2], 'meta', ARGV[3])
redis.call('PERSIST', KEYS[2])
return {1, ARGV[3]}
";

/// KEYS: owner, ov, oi, ovec. ARGV: id, then counted lists: fields to remove (with their
/// vectors), (field, value) to put. 1 when written, 0 when the owner does not have that id.
const WRITE_OWNER: &str = r"
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then return 0 end
local i = 2
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('HDEL', KEYS[2], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[i])
  redis.call('ZREM', KEYS[3], ARGV[i]); i = i + 1
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[3], 0, ARGV[i]); i = i + 2
end
return 1
";

/// KEYS: oi, ov. ARGV: lex min, lex max, how many. `{field, value, field, value...}`.
const OWNER_RECORDS: &str = r"
local out = {}
for _, f in ipairs(redis.call('ZRANGEBYLEX', KEYS[1], ARGV[1], ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))) do
  out[#out + 1] = f
  out[#out + 1] = redis.call('HGET', KEYS[2], f) or ''
end
return out
";

/// KEYS: owner, ov, oi, the encryption key of the id read, ovec. ARGV: the id read. 1 when
/// deleted, 0 when there is no owner, -1 when its id changed (read again).
const DELETE_OWNER: &str = r"
local id = redis.call('HGET', KEYS[1], 'id')
if not id then return 0 end
if id ~= ARGV[1] then return -1 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return 1
";

/// The owner scripts, loaded once per engine.
pub(super) struct OwnerScripts {
    create: Script,
    write: Script,
    records: Script,
    delete: Script,
}

impl OwnerScripts {
    pub(super) fn new() -> OwnerScripts {
        OwnerScripts {
            create: Script::new(CREATE_OWNER),
            write: Script::new(WRITE_OWNER),
            records: Script::new(OWNER_RECORDS),
            delete: Script::new(DELETE_OWNER),
        }
    }
}

/// The keys of one owner.
pub(super) struct OwnerKeys {
    tagged: Keys,
}

impl OwnerKeys {
    pub(super) fn owner(&self) -> String {
        format!("{}owner", self.tagged.tag_prefix)
    }
    pub(super) fn values(&self) -> String {
        format!("{}ov", self.tagged.tag_prefix)
    }
    pub(super) fn vectors(&self) -> String {
        format!("{}ovec", self.tagged.tag_prefix)
    }
    fn order(&self) -> String {
        format!("{}oi", self.tagged.tag_prefix)
    }
    fn secret(&self, id: u64) -> String {
        self.tagged.secret(id)
    }
}

/// A record's field: its space, then its id.
pub(super) fn field(space: u8, id: &[u8]) -> Vec<u8> {
    let mut field = Vec::with_capacity(1 + id.len());
    field.push(space);
    field.extend_from_slice(id);
    field
}

/// The exclusive upper bound of the fields of `space`.
fn space_end(space: u8) -> Vec<u8> {
    match space.checked_add(1) {
        Some(next) => vec![b'(', next],
        None => b"+".to_vec(),
    }
}

impl RedisEngine {
    pub(super) fn owner_keys(&self, owner: &OwnerKey) -> OwnerKeys {
        OwnerKeys {
            tagged: Keys::of(&self.prefix, &super::super::owners::key_ref(owner)),
        }
    }

    fn index_owners(&self) -> String {
        format!("{}idx:owner", self.prefix)
    }

    pub(super) fn owner_meta(&self, owner: &OwnerKey) -> Result<Option<OwnerMeta>, StoreError> {
        let mut c = self.connection()?;
        let meta: Option<Vec<u8>> = redis::cmd("HGET")
            .arg(self.owner_keys(owner).owner())
            .arg("meta")
            .query(&mut *c)?;
        meta.map(|bytes| decode(&bytes)).transpose()
    }

    pub(super) fn create_owner_record(
        &self,
        owner: &OwnerKey,
        meta: OwnerMeta,
    ) -> Result<OwnerMeta, StoreError> {
        let keys = self.owner_keys(owner);
        let owner_bytes = owner.to_bytes();
        let mut c = self.connection()?;
        let (created, stored): (i64, Vec<u8>) = self
            .owner_scripts
            .create
            .key(keys.owner())
            .key(keys.secret(meta.id))
            .arg(owner_bytes.as_slice())
            .arg(meta.id)
            .arg(encode(&meta)?)
            .invoke(&mut *c)?;
        if created == 1 {
            let _: i64 = redis::cmd("ZADD")
                .arg(self.index_owners())
                .arg(0)
                .arg(owner_bytes.as_slice())
                .query(&mut *c)?;
            self.wait(&mut c)?;
        }
        decode(&stored)
    }

    pub(super) fn write_owner_records(
        &self,
        owner: &OwnerKey,
        id: u64,
        put: &[OwnerRecord],
        remove: &[(u8, Vec<u8>)],
    ) -> Result<bool, StoreError> {
        let keys = self.owner_keys(owner);
        let mut invocation = self.owner_scripts.write.prepare_invoke();
        invocation
            .key(keys.owner())
            .key(keys.values())
            .key(keys.order())
            .key(keys.vectors())
            .arg(id)
            .arg(remove.len());
        for (space, record_id) in remove {
            invocation.arg(field(*space, record_id));
        }
        invocation.arg(put.len());
        for record in put {
            invocation
                .arg(field(record.space, &record.id))
                .arg(record.value.as_slice());
        }
        let mut c = self.connection()?;
        let written: i64 = invocation.invoke(&mut *c)?;
        if written == 1 {
            self.wait(&mut c)?;
        }
        Ok(written == 1)
    }

    pub(super) fn one_owner_record(
        &self,
        owner: &OwnerKey,
        space: u8,
        id: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let mut c = self.connection()?;
        Ok(redis::cmd("HGET")
            .arg(self.owner_keys(owner).values())
            .arg(field(space, id))
            .query(&mut *c)?)
    }

    pub(super) fn owner_record_page(
        &self,
        owner: &OwnerKey,
        space: u8,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<OwnerRecord>, StoreError> {
        let keys = self.owner_keys(owner);
        let prefix = [space];
        let after = after.map(|id| field(space, id));
        let mut c = self.connection()?;
        let flat: Vec<Vec<u8>> = self
            .owner_scripts
            .records
            .key(keys.order())
            .key(keys.values())
            .arg(lex_after(after.as_deref(), &prefix))
            .arg(space_end(space))
            .arg(limit.saturating_add(1))
            .invoke(&mut *c)?;
        let mut out = Vec::with_capacity(limit.min(flat.len() / 2));
        let mut pairs = flat.chunks_exact(2);
        for pair in pairs.by_ref() {
            let [name, value] = pair else { continue };
            if out.len() == limit {
                let cursor = out.last().map(|r: &OwnerRecord| r.id.clone());
                return Ok((out, cursor));
            }
            let id = name.strip_prefix(&prefix).ok_or_else(|| {
                StoreError::Corrupt("an owner record's field is malformed".into())
            })?;
            out.push(OwnerRecord {
                space,
                id: id.to_vec(),
                value: value.clone(),
            });
        }
        Ok((out, None))
    }

    pub(super) fn delete_owner_records(&self, owner: &OwnerKey) -> Result<Option<u64>, StoreError> {
        let keys = self.owner_keys(owner);
        let mut c = self.connection()?;
        for _ in 0..MAX_ATTEMPTS {
            let id: Option<u64> = redis::cmd("HGET")
                .arg(keys.owner())
                .arg("id")
                .query(&mut *c)?;
            let Some(id) = id else {
                let _: i64 = redis::cmd("ZREM")
                    .arg(self.index_owners())
                    .arg(owner.to_bytes())
                    .query(&mut *c)?;
                return Ok(None);
            };
            let deleted: i64 = self
                .owner_scripts
                .delete
                .key(keys.owner())
                .key(keys.values())
                .key(keys.order())
                .key(keys.secret(id))
                .key(keys.vectors())
                .arg(id)
                .invoke(&mut *c)?;
            match deleted {
                -1 => continue,
                0 => return Ok(None),
                _ => {
                    let _: i64 = redis::cmd("ZREM")
                        .arg(self.index_owners())
                        .arg(owner.to_bytes())
                        .query(&mut *c)?;
                    self.wait(&mut c)?;
                    return Ok(Some(id));
                }
            }
        }
        Err(StoreError::Stale)
    }

    pub(super) fn owner_page(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(OwnerKey, OwnerMeta)>, StoreError> {
        self.index_page(
            &self.index_owners(),
            after,
            limit.max(1),
            |bytes| {
                let owner = OwnerKey::from_bytes(bytes)?;
                let mut get = redis::cmd("HGET");
                get.arg(self.owner_keys(&owner).owner()).arg("meta");
                Some((owner, get))
            },
            |owner, meta| Ok((owner, decode(&meta)?)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Engine;
    use memproxy_base::identity::TenantId;

    #[test]
    fn an_owners_keys_share_the_hash_tag_of_its_encryption_key() {
        let owner = OwnerKey::user(&TenantId::from_token(Some("t")), "a{b}c");
        let keys = OwnerKeys {
            tagged: Keys::of("p:", &super::super::super::owners::key_ref(&owner)),
        };
        let tag = |name: &str| {
            let open = name.find('{').unwrap();
            let close = name[open..].find('}').unwrap() + open;
            name[open..=close].to_string()
        };
        for name in [keys.values(), keys.order(), keys.secret(9), keys.vectors()] {
            assert_eq!(tag(&name), tag(&keys.owner()), "{name}");
        }
        assert_eq!(space_end(3), b"(\x04");
        assert_eq!(space_end(255), b"+");
    }

    #[tokio::test]
    async fn an_owners_encryption_key_is_kept_for_good_and_goes_with_its_delete() {
        let server = crate::contract::redis_server::RedisServer::start();
        let engine = std::sync::Arc::new(
            RedisEngine::open(&crate::contract::redis_options(&server.url())).unwrap(),
        );
        let dir = tempfile::tempdir().unwrap();
        let store = crate::Store::with_engine(
            crate::Backing::Shared(engine.clone()),
            dir.path(),
            crate::tests::options(),
        )
        .unwrap();
        let owner = OwnerKey::user(&TenantId::from_token(Some("t")), "ana");
        let handle = store.owner(&owner, true).unwrap().unwrap();
        assert!(
            store
                .write_owner(&handle, vec![(1, b"a".to_vec(), b"Lisbon".to_vec())], &[])
                .unwrap()
        );
        assert!(!engine.any_trace_of(b"Lisbon").unwrap());
        let secret = engine.owner_keys(&owner).secret(handle.id);
        // The provisional expiry of a key made before its first write is gone.
        assert_eq!(server.command(&format!("PTTL {secret}")), ":-1\r\n");
        assert!(store.delete_owner(&owner).unwrap());
        assert_eq!(server.command("KEYS mp:*"), "*1\r\n$6\r\nmp:ids\r\n");
    }
}
