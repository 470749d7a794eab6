//! Vectors in the Redis engine (the [`Vectors`] part of the contract, `engine.rs`): a
//! conversation's in the hash `P{T}:v:ID` (field the turn in decimal), an owner's in the hash
//! `P{O}:ovec` (field the record's field, as in `P{O}:ov`), each under the hash tag of what
//! they describe, so one script touches one slot. A put is one script that checks the
//! conversation's (owner's) id and each message (record) it describes; the conversation's own
//! scripts (`redis_engine.rs`: write, delete, TTL) and the owner's (`redis_owners.rs`) remove
//! and expire them with what they describe. A read is one `HGETALL`.

use redis::Script;

use super::super::StoreError;
use super::super::engine::{SealedVector, Vectors};
use super::super::records::OwnerKey;
use super::RedisEngine;
use super::owner_records::field;
use memproxy_base::identity::ConversationKey;

/// KEYS: conv, m, v, k. ARGV: id, then (turn, value) pairs. Writes each value whose turn is
/// stored, then gives the vectors (and the key they are sealed with, which a put may have
/// made) the conversation's expiry. The count written, -1 when the id is not the
/// conversation's (any more).
const PUT_VECTORS: &str = r"
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then return -1 end
local written = 0
for i = 2, #ARGV, 2 do
  if redis.call('ZCOUNT', KEYS[2], ARGV[i], ARGV[i]) > 0 then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]); written = written + 1
  end
end
local ttl = redis.call('PTTL', KEYS[1])
for j = 3, 4 do
  if ttl > 0 then redis.call('PEXPIRE', KEYS[j], ttl) else redis.call('PERSIST', KEYS[j]) end
end
return written
";

/// KEYS: owner, ov, ovec. ARGV: id, then (field, value) pairs. Writes each value whose record
/// is stored. The count written, -1 when the owner does not have that id.
const PUT_OWNER_VECTORS: &str = r"
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then return -1 end
local written = 0
for i = 2, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]); written = written + 1
  end
end
return written
";

/// The vector scripts, loaded once per engine.
pub(super) struct VectorScripts {
    put: Script,
    put_owner: Script,
}

impl VectorScripts {
    pub(super) fn new() -> VectorScripts {
        VectorScripts {
            put: Script::new(PUT_VECTORS),
            put_owner: Script::new(PUT_OWNER_VECTORS),
        }
    }
}

/// A script's count: `None` for -1 (the id did not match).
fn count(written: i64) -> Option<usize> {
    usize::try_from(written).ok()
}

impl Vectors for RedisEngine {
    fn put_vectors(
        &self,
        key: &ConversationKey,
        id: u64,
        vectors: &[(u64, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError> {
        let keys = self.keys(key);
        let mut invocation = self.vector_scripts.put.prepare_invoke();
        invocation
            .key(&keys.conv)
            .key(keys.messages(id))
            .key(keys.vectors(id))
            .key(keys.secret(id))
            .arg(id);
        for (turn, value) in vectors {
            invocation.arg(turn).arg(value.as_slice());
        }
        let mut c = self.connection()?;
        let written: i64 = invocation.invoke(&mut *c)?;
        if written > 0 {
            self.wait(&mut c)?;
        }
        Ok(count(written))
    }

    fn vectors(
        &self,
        key: &ConversationKey,
        id: u64,
    ) -> Result<Vec<SealedVector<u64>>, StoreError> {
        let mut c = self.connection()?;
        let fields: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(self.keys(key).vectors(id))
            .query(&mut *c)?;
        let mut out = fields
            .into_iter()
            .map(|(turn, value)| match turn.parse::<u64>() {
                Ok(turn) => Ok((turn, value)),
                Err(_) => Err(StoreError::Corrupt("a vector's turn is malformed".into())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.sort_unstable_by_key(|(turn, _)| *turn);
        Ok(out)
    }

    fn put_owner_vectors(
        &self,
        owner: &OwnerKey,
        id: u64,
        vectors: &[(u8, Vec<u8>, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError> {
        let keys = self.owner_keys(owner);
        let mut invocation = self.vector_scripts.put_owner.prepare_invoke();
        invocation
            .key(keys.owner())
            .key(keys.values())
            .key(keys.vectors())
            .arg(id);
        for (space, record_id, value) in vectors {
            invocation
                .arg(field(*space, record_id))
                .arg(value.as_slice());
        }
        let mut c = self.connection()?;
        let written: i64 = invocation.invoke(&mut *c)?;
        if written > 0 {
            self.wait(&mut c)?;
        }
        Ok(count(written))
    }

    fn owner_vectors(
        &self,
        owner: &OwnerKey,
        space: u8,
    ) -> Result<Vec<SealedVector<Vec<u8>>>, StoreError> {
        let mut c = self.connection()?;
        let fields: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(self.owner_keys(owner).vectors())
            .query(&mut *c)?;
        let mut out: Vec<SealedVector<Vec<u8>>> = fields
            .into_iter()
            .filter_map(|(field, value)| match field.split_first() {
                Some((&s, id)) if s == space => Some((id.to_vec(), value)),
                _ => None,
            })
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    fn vector_count(&self) -> Result<u64, StoreError> {
        let mut c = self.connection()?;
        let mut count = 0;
        for key in self.all_keys(&mut c)? {
            let name = String::from_utf8_lossy(&key);
            let Some((_, suffix)) = name.rsplit_once('}') else {
                continue;
            };
            if suffix.starts_with(":v:") || suffix == ":ovec" {
                let fields: u64 = redis::cmd("HLEN").arg(&key).query(&mut *c)?;
                count += fields;
            }
        }
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::tests::{key, message};
    use crate::{Backing, Change, Store, lock};
    use memproxy_base::message::Role;

    fn pttl(engine: &RedisEngine, name: &str) -> i64 {
        let mut c = engine.connection().unwrap();
        redis::cmd("PTTL").arg(name).query(&mut *c).unwrap()
    }

    #[tokio::test]
    async fn vectors_expire_with_their_conversation_whichever_is_written_first() {
        let server = crate::contract::redis_server::RedisServer::start();
        let engine =
            Arc::new(RedisEngine::open(&crate::contract::redis_options(&server.url())).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let store = Store::with_engine(
            Backing::Shared(engine.clone()),
            dir.path(),
            crate::tests::options(),
        )
        .unwrap();
        let k = key("c");
        let handle = store.conversation(&k).unwrap();
        let mut conv = lock(&handle);
        let change = Change {
            add: vec![message(Role::User, "q"), message(Role::Assistant, "a")],
            ..Change::default()
        };
        store.commit(&mut conv, change).unwrap();
        let id = conv.meta.as_ref().unwrap().id;
        let keys = engine.keys(&k);
        let put = |conv: &crate::Conversation| {
            store
                .put_vectors(conv, "s", &[(1, vec![1.0, 0.0]), (2, vec![0.0, 1.0])])
                .unwrap()
        };
        // Without a TTL nothing expires.
        assert_eq!(put(&conv), 2);
        assert_eq!(pttl(&engine, &keys.vectors(id)), -1);
        // A TTL set after the vectors expires them with the rest.
        store
            .remember_ttl(&k, Some(Duration::from_secs(3600)))
            .unwrap();
        let messages = pttl(&engine, &keys.messages(id));
        assert!(messages > 3_600_000, "{messages}");
        let vectors = pttl(&engine, &keys.vectors(id));
        assert!((messages - vectors).abs() < 5_000, "{messages} {vectors}");
        // Vectors written after the TTL get the conversation's expiry, and so does the key
        // they are sealed with.
        store.refresh(&mut conv).unwrap();
        assert_eq!(put(&conv), 2);
        let vectors = pttl(&engine, &keys.vectors(id));
        assert!(vectors > 3_600_000, "{vectors}");
        assert!(pttl(&engine, &keys.secret(id)) > 3_600_000);
        // The TTL lifted: nothing expires again.
        store.remember_ttl(&k, None).unwrap();
        assert_eq!(pttl(&engine, &keys.vectors(id)), -1);
    }
}
