//! The shared engine: a Redis server (or a primary with replicas) that every memproxy replica
//! points at, so they all serve one memory. Synchronous like the contract: the official
//! `redis` crate's blocking connections, pooled with `r2d2`.
//!
//! # Keys
//!
//! Every key starts with the configured prefix `P` (`memproxy:` by default). Every key of one
//! conversation carries the same hash tag `{T}`, `T` being 32 hex digits of a SHA-256 of the
//! conversation's key (tenant, agent, conversation id; hashed because ids may hold `{`, `}`
//! or anything else), so on Redis Cluster a conversation lives in one slot and each of the
//! scripts below touches one slot only:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `P{T}:conv` | hash | `key` (the conversation key's bytes), `id`, `ver` (the version: `id:n`, n counting writes), `meta` ([`ConversationMeta`], JSON), `last` (last activity, ms) |
//! | `P{T}:m:ID` | sorted set | one member per message: score the turn, member the turn (8 bytes BE) then the [`StoredMessage`] (JSON) |
//! | `P{T}:s:ID` | sorted set | summary records: score the number, member the number (8 bytes BE) then the record |
//! | `P{T}:b:ID` | hash | closed branches: field the branch row's key (as in sled's `branches` tree), value its record, message or summary |
//! | `P{T}:k:ID` | string | the conversation's 32-byte key (`keys.rs`, `seal.rs`) |
//! | `P{T}:r:ID` | set | the Responses API ids of the replies written (`Write::response_ids`) |
//! | `P{T}:v:ID` | hash | the messages' vectors (`vectors.rs`, `redis_vectors.rs`): field the turn (decimal), value the sealed vector |
//! | `P{T}:ttl` | string | the [`TtlRecord`] (JSON) |
//! | `P{T}:lease` | string | the summary lease: which replica makes the due summary (`summaries.rs`) |
//! | `P:ids` | string | the counter [`Engine::new_id`] increments |
//! | `P:idx:conv` | sorted set | listing index: every conversation's key bytes, score 0, so in key order (`ZRANGEBYLEX`) |
//! | `P:idx:ttl` | sorted set | the same for TTL records |
//! | `P:rid:H` | string | `T:ID` of the conversation a response id was written in, `H` being 32 hex digits of a SHA-256 of tenant and response id: a hint, checked against `P{T}:r:ID` |
//!
//! `ID` is the conversation's id ([`ConversationMeta::id`]): a conversation deleted and started
//! again gets new keys, so a reader still holding the old id finds nothing.
//!
//! # Atomicity
//!
//! Each change to a conversation is one Lua script over its keys (one slot), which first
//! checks the stored version (a write), the id (a summary, a delete) or the record's absence
//! (dropping an orphan TTL record); Redis runs a script alone, so readers never see half of
//! it. Reads that take several keys run as one `MULTI`/`EXEC` or a script.
//!
//! The two indexes and the response-id hints are in their own slots, so they cannot be part of a conversation's script
//! on a cluster: they are kept *after* it (`ZADD` at each write and TTL record, `ZREM` after a
//! delete) and are hints, the conversation's own keys being the truth. A listing or TTL page
//! that meets an entry whose conversation (or record) is gone, removed by a delete that died
//! half way or expired by Redis, drops the entry and goes on.
//!
//! # TTL
//!
//! A conversation with a TTL record that sets a TTL has every one of its keys expire that long
//! after its last write, plus a minute's grace (each commit, summary and TTL record sets the
//! expiry again), so Redis removes an idle conversation whole even when no sweeper runs (or
//! no replica is left); the sweeper, which deletes it first when it runs, and the index
//! clean-up above do the rest. The grace keeps the sweeper's delete (which counts and logs)
//! the usual path. Without a TTL the keys never expire.
//!
//! # Durability
//!
//! A write is committed once Redis acknowledged it: it is in the server's memory. What a crash
//! of the Redis server loses is decided by its own persistence (`appendonly yes` with
//! `appendfsync always` loses nothing acknowledged; `everysec`, up to a second). With
//! `storage.redis_wait_replicas = N` each write is also acknowledged by N replicas (`WAIT`)
//! before it counts as done. [`Engine::flush`] has nothing to add and returns at once.
//!
//! # Failures
//!
//! A Redis that cannot be reached (refused, timed out, a connection dropped) is
//! [`StoreError::Unreachable`], a failure to write: the store turns memory off and retries
//! ([`Engine::reopen`] pings), so memory comes back on its own when Redis does.

use std::time::Duration;

use redis::{Connection, RedisError, Script};
use sha2::{Digest, Sha256};

use super::StoreError;
use super::engine::{Engine, Loaded, Owners, Page, Refresh, Scope, SharedEngine, Version, Write};
use super::layout::{assemble_branches, branch_rows, decode, encode};
use super::records::{
    ConversationMeta, Deleted, Entry, OwnerKey, OwnerMeta, OwnerRecord, StoredBranch,
    StoredMessage, TtlRecord,
};
use memproxy_base::identity::{ConversationKey, TenantId};

// Owners' records (long-term memory): their keys, scripts and methods.
#[path = "redis_owners.rs"]
mod owner_records;

// Vectors of messages and of owners' records (recall by meaning).
#[path = "redis_vectors.rs"]
mod vectors;

/// How often a read or delete retries when a write changed the conversation under it.
const MAX_ATTEMPTS: usize = 8;

/// How a Redis engine connects.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// `redis://` or `rediss://`, possibly with a user and password.
    pub url: String,
    /// A password that wins over the URL's.
    pub password: Option<String>,
    pub key_prefix: String,
    pub pool_size: u32,
    pub connect_timeout: Duration,
    pub command_timeout: Duration,
    /// Replicas that must acknowledge each write (`WAIT`); 0: none.
    pub wait_replicas: u32,
    pub wait_timeout: Duration,
}

/// Opens pooled connections with the configured time limits.
#[derive(Debug)]
struct Connector {
    client: redis::Client,
    connect_timeout: Duration,
    command_timeout: Duration,
}

impl r2d2::ManageConnection for Connector {
    type Connection = Connection;
    type Error = RedisError;

    fn connect(&self) -> Result<Connection, RedisError> {
        let connection = self
            .client
            .get_connection_with_timeout(self.connect_timeout)?;
        connection.set_read_timeout(Some(self.command_timeout))?;
        connection.set_write_timeout(Some(self.command_timeout))?;
        Ok(connection)
    }

    fn is_valid(&self, connection: &mut Connection) -> Result<(), RedisError> {
        redis::cmd("PING").query(connection)
    }

    fn has_broken(&self, connection: &mut Connection) -> bool {
        !redis::ConnectionLike::is_open(connection)
    }
}

/// r2d2 logs connection failures itself through `log`; they reach the caller as errors here.
#[derive(Debug)]
struct Quiet;

impl<E> r2d2::HandleError<E> for Quiet {
    fn handle_error(&self, _error: E) {}
}

/// The Redis engine.
pub struct RedisEngine {
    pool: r2d2::Pool<Connector>,
    prefix: String,
    wait_replicas: u32,
    wait_timeout: Duration,
    scripts: Scripts,
    owner_scripts: owner_records::OwnerScripts,
    vector_scripts: vectors::VectorScripts,
}

impl std::fmt::Debug for RedisEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisEngine")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn unreachable(err: impl std::fmt::Display) -> StoreError {
    StoreError::Unreachable(err.to_string())
}

impl From<RedisError> for StoreError {
    fn from(err: RedisError) -> StoreError {
        if err.is_io_error()
            || err.is_timeout()
            || err.is_connection_dropped()
            || err.is_connection_refusal()
            || err.is_unrecoverable_error()
        {
            unreachable(err)
        } else {
            StoreError::Engine(Box::new(err))
        }
    }
}

/// Expires every key the script was given (`KEYS[first..=last]`) as the TTL record in
/// `ttlkey` says: [`EXPIRY_GRACE_MS`] past its `ttl_ms` after now, or never.
const EXPIRE: &str = r"
local function expire_all(ttlkey, first, last)
  local ms = nil
  local t = redis.call('GET', ttlkey)
  if t then
    local ok, rec = pcall(cjson.decode, t)
    if ok and type(rec) == 'table' and type(rec['ttl_ms']) == 'number' then ms = rec['ttl_ms'] end
  end
  for i = first, last do
    if ms and ms >= 1 and ms < 1e15 then
      redis.call('PEXPIRE', KEYS[i], string.format('%d', ms + GRACE_MS))
    else
      redis.call('PERSIST', KEYS[i])
    end
  end
end
";

/// The grace past a conversation's TTL before Redis expires its keys (in the Lua above).
pub const EXPIRY_GRACE_MS: u64 = 60_000;

/// KEYS: conv, m, s, b, k, ttl, r, v. ARGV: expected version ('' = absent), key bytes, meta
/// JSON, id, last activity, then counted lists: turns to remove, (turn, member) to add, summary
/// numbers to remove, (number, member) to add, (field, value) branch rows, response ids,
/// (turn, value) vectors of added turns. A turn removed or written again loses its vector (and
/// takes the one given with it). Returns the new version, or false when stale.
const WRITE: &str = r"
local v = redis.call('HGET', KEYS[1], 'ver')
if (v or '') ~= ARGV[1] then return false end
local i = 6
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('ZREMRANGEBYSCORE', KEYS[2], ARGV[i], ARGV[i])
  redis.call('HDEL', KEYS[8], ARGV[i]); i = i + 1
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('ZREMRANGEBYSCORE', KEYS[2], ARGV[i], ARGV[i])
  redis.call('HDEL', KEYS[8], ARGV[i])
  redis.call('ZADD', KEYS[2], ARGV[i], ARGV[i + 1]); i = i + 2
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('ZREMRANGEBYSCORE', KEYS[3], ARGV[i], ARGV[i]); i = i + 1 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('ZREMRANGEBYSCORE', KEYS[3], ARGV[i], ARGV[i])
  redis.call('ZADD', KEYS[3], ARGV[i], ARGV[i + 1]); i = i + 2
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]); i = i + 2 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('SADD', KEYS[7], ARGV[i]); i = i + 1 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 1]); i = i + 2 end
local count = 1
if v then
  local old = redis.call('HGET', KEYS[1], 'id')
  if old == ARGV[4] then count = tonumber(string.match(v, ':(%d+)$')) + 1 end
end
local ver = ARGV[4] .. ':' .. count
redis.call('HSET', KEYS[1], 'ver', ver, 'key', ARGV[2], 'meta', ARGV[3], 'id', ARGV[4], 'last', ARGV[5])
expire_all(KEYS[6], 1, 5)
expire_all(KEYS[6], 7, 8)
return ver
";

/// KEYS: conv, m. ARGV: the version known, the first turn not known. Returns `{ver}` when
/// unchanged, `{ver, meta, members...}` (messages from that turn on) otherwise, `{}` when the
/// conversation is not stored.
const REFRESH: &str = r"
local v = redis.call('HGET', KEYS[1], 'ver')
if not v then return {} end
if v == ARGV[1] then return {v} end
local out = {v, redis.call('HGET', KEYS[1], 'meta')}
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], ARGV[2], '+inf')) do out[#out + 1] = m end
return out
";

/// KEYS: conv, m, s, b, k, ttl, lease, r, v. ARGV: the id read, idle cutoff ('' = none). Returns
/// `{0}` (not stored, or used since the cutoff), `{-1}` (the id changed: read again) or
/// `{1, messages, summaries, branches}`.
const DELETE: &str = r"
local id = redis.call('HGET', KEYS[1], 'id')
if not id then redis.call('DEL', KEYS[6]); return {0} end
if id ~= ARGV[1] then return {-1} end
if ARGV[2] ~= '' and tonumber(redis.call('HGET', KEYS[1], 'last')) >= tonumber(ARGV[2]) then return {0} end
local branches = 0
for _, f in ipairs(redis.call('HKEYS', KEYS[4])) do
  if string.byte(f, 17) == 0 then branches = branches + 1 end
end
local out = {1, redis.call('ZCARD', KEYS[2]), redis.call('ZCARD', KEYS[3]), branches}
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9])
return out
";

/// KEYS: conv, s. ARGV: id, number, member. 1 when written, 0 when the id is not the
/// conversation's (any more).
const PUT_SUMMARY: &str = r"
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then return 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[2], ARGV[2], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return 1
";

/// KEYS: ttl, conv, m, s, b, k, r, v. ARGV: record, the id read ('' = not stored). Writes the
/// record and expires the conversation's keys by it; -1 when the id changed (read again).
const PUT_TTL: &str = r"
local id = redis.call('HGET', KEYS[2], 'id') or ''
if id ~= ARGV[2] then return -1 end
redis.call('SET', KEYS[1], ARGV[1])
if id == '' then expire_all(KEYS[1], 1, 1) else expire_all(KEYS[1], 1, 8) end
return 1
";

/// KEYS: conv, ttl. 1 when the record was removed, 0 when there was none, -1 when the
/// conversation exists.
const DROP_ORPHAN_TTL: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
return redis.call('DEL', KEYS[2])
";

/// KEYS: k. ARGV: key bytes, provisional expiry (ms). The key stored (this one, or the one
/// another writer stored first).
const CREATE_KEY: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return ARGV[1] end
return redis.call('GET', KEYS[1])
";

/// KEYS: lease, conv. ARGV: holder, id, ms. 1 when taken (free, or held by this holder), 0
/// when another holds it, -1 when the conversation is not that id.
const TAKE_LEASE: &str = r"
if redis.call('HGET', KEYS[2], 'id') ~= ARGV[2] then return -1 end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
";

/// KEYS: lease. ARGV: holder. Releases the lease if this holder has it.
const RELEASE_LEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

/// A provisional expiry for a conversation key made before its first write: a writer that
/// dies in between leaves nothing for longer (the write sets the real expiry).
const KEY_PROVISIONAL_MS: u64 = 24 * 3600 * 1000;

struct Scripts {
    write: Script,
    refresh: Script,
    delete: Script,
    put_summary: Script,
    put_ttl: Script,
    drop_orphan_ttl: Script,
    create_key: Script,
    take_lease: Script,
    release_lease: Script,
}

impl Scripts {
    fn new() -> Scripts {
        let expire = EXPIRE.replace("GRACE_MS", &EXPIRY_GRACE_MS.to_string());
        Scripts {
            write: Script::new(&format!("{expire}{WRITE}")),
            refresh: Script::new(REFRESH),
            delete: Script::new(DELETE),
            put_summary: Script::new(PUT_SUMMARY),
            put_ttl: Script::new(&format!("{expire}{PUT_TTL}")),
            drop_orphan_ttl: Script::new(DROP_ORPHAN_TTL),
            create_key: Script::new(CREATE_KEY),
            take_lease: Script::new(TAKE_LEASE),
            release_lease: Script::new(RELEASE_LEASE),
        }
    }
}

/// The keys of one conversation.
struct Keys {
    conv: String,
    tag_prefix: String,
}

impl Keys {
    fn of(prefix: &str, key: &ConversationKey) -> Keys {
        Keys::of_bytes(prefix, &key.to_bytes())
    }

    fn of_bytes(prefix: &str, key: &[u8]) -> Keys {
        Keys::of_tag(prefix, &hex32(key))
    }

    fn of_tag(prefix: &str, tag: &str) -> Keys {
        let tag_prefix = format!("{prefix}{{{tag}}}:");
        Keys {
            conv: format!("{tag_prefix}conv"),
            tag_prefix,
        }
    }

    /// The hash tag `T`.
    fn tag(&self) -> &str {
        let inner = self.tag_prefix.rsplit_once('{').map_or("", |(_, t)| t);
        inner.split_once('}').map_or("", |(t, _)| t)
    }

    fn responses(&self, id: u64) -> String {
        format!("{}r:{id}", self.tag_prefix)
    }

    fn messages(&self, id: u64) -> String {
        format!("{}m:{id}", self.tag_prefix)
    }
    fn summaries(&self, id: u64) -> String {
        format!("{}s:{id}", self.tag_prefix)
    }
    fn branches(&self, id: u64) -> String {
        format!("{}b:{id}", self.tag_prefix)
    }
    fn secret(&self, id: u64) -> String {
        format!("{}k:{id}", self.tag_prefix)
    }
    fn vectors(&self, id: u64) -> String {
        format!("{}v:{id}", self.tag_prefix)
    }
    fn ttl(&self) -> String {
        format!("{}ttl", self.tag_prefix)
    }
    fn lease(&self) -> String {
        format!("{}lease", self.tag_prefix)
    }
}

/// 32 hex digits of a SHA-256 of `bytes`.
fn hex32(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(32);
    for b in &digest[..16] {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// A sorted-set member: `n` (8 bytes BE) then `payload`, unique per `n`.
fn member(n: u64, payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(8 + payload.len());
    bytes.extend_from_slice(&n.to_be_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// The number and payload of a sorted-set member.
fn split_member(bytes: &[u8]) -> Result<(u64, &[u8]), StoreError> {
    if bytes.len() < 8 {
        return Err(StoreError::Corrupt("a stored member is too short".into()));
    }
    let (n, payload) = bytes.split_at(8);
    let n = u64::from_be_bytes(
        n.try_into()
            .map_err(|_| StoreError::Corrupt("a stored member is too short".into()))?,
    );
    Ok((n, payload))
}

fn message_of(bytes: &[u8]) -> Result<StoredMessage, StoreError> {
    decode(split_member(bytes)?.1)
}

/// The exclusive lower bound of a lex range after `after` (inclusive `[prefix` without one).
fn lex_after(after: Option<&[u8]>, prefix: &[u8]) -> Vec<u8> {
    match after {
        Some(after) if after >= prefix => {
            let mut bound = b"(".to_vec();
            bound.extend_from_slice(after);
            bound
        }
        _ if prefix.is_empty() => b"-".to_vec(),
        _ => {
            let mut bound = b"[".to_vec();
            bound.extend_from_slice(prefix);
            bound
        }
    }
}

/// The exclusive upper bound of the members starting with `prefix` (which ends in a 0 byte,
/// so its successor is that byte plus one).
fn lex_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.split_last() {
        None => b"+".to_vec(),
        Some((last, head)) => {
            let mut bound = b"(".to_vec();
            bound.extend_from_slice(head);
            bound.push(last.saturating_add(1));
            bound
        }
    }
}

/// Whether `url` is a Redis URL the engine can connect with (`redis://` or `rediss://`, a
/// host): what `[storage] redis_url` is checked against.
pub fn is_redis_url(url: &str) -> bool {
    redis::parse_redis_url(url)
        .is_some_and(|parsed| parsed.host_str().is_some_and(|h| !h.is_empty()))
}

impl RedisEngine {
    /// An engine for the Redis server at `options.url`. Connects lazily: a server that is down
    /// now is no error here (every call fails until it is up).
    pub fn open(options: &RedisOptions) -> Result<RedisEngine, StoreError> {
        let mut info = redis::IntoConnectionInfo::into_connection_info(options.url.as_str())
            .map_err(|_| StoreError::Engine("the Redis URL is not valid".into()))?;
        if let Some(password) = &options.password {
            let redis_settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(redis_settings);
        }
        let client = redis::Client::open(info)?;
        let pool = r2d2::Pool::builder()
            .max_size(options.pool_size.max(1))
            .min_idle(Some(0))
            .connection_timeout(options.connect_timeout)
            .test_on_check_out(false)
            .error_handler(Box::new(Quiet))
            .build_unchecked(Connector {
                client,
                connect_timeout: options.connect_timeout,
                command_timeout: options.command_timeout,
            });
        Ok(RedisEngine {
            pool,
            prefix: options.key_prefix.clone(),
            wait_replicas: options.wait_replicas,
            wait_timeout: options.wait_timeout,
            scripts: Scripts::new(),
            owner_scripts: owner_records::OwnerScripts::new(),
            vector_scripts: vectors::VectorScripts::new(),
        })
    }

    fn connection(&self) -> Result<r2d2::PooledConnection<Connector>, StoreError> {
        self.pool
            .get()
            .map_err(|err| unreachable(format!("no connection to Redis: {err}")))
    }

    fn keys(&self, key: &ConversationKey) -> Keys {
        Keys::of(&self.prefix, key)
    }

    /// The hint key of `tenant`'s `response_id`.
    fn response_hint(&self, tenant: &TenantId, response_id: &str) -> String {
        let bytes = [tenant.as_str().as_bytes(), b"\0", response_id.as_bytes()].concat();
        format!("{}rid:{}", self.prefix, hex32(&bytes))
    }

    /// The conversation `tenant`'s `response_id` was written in, and its id, checked against
    /// the conversation's own keys; a hint that finds nothing is dropped.
    fn response_target(
        &self,
        c: &mut Connection,
        tenant: &TenantId,
        response_id: &str,
    ) -> Result<Option<(ConversationKey, Keys, u64)>, StoreError> {
        let hint = self.response_hint(tenant, response_id);
        let target: Option<String> = redis::cmd("GET").arg(&hint).query(c)?;
        let Some((tag, id)) = target.as_deref().and_then(|t| t.split_once(':')) else {
            return Ok(None);
        };
        let (Ok(id), true) = (
            id.parse::<u64>(),
            tag.len() == 32 && tag.bytes().all(|b| b.is_ascii_hexdigit()),
        ) else {
            return Err(StoreError::Corrupt(
                "a response id hint is malformed".into(),
            ));
        };
        let keys = Keys::of_tag(&self.prefix, tag);
        let (key_bytes, stored_id, member): (Option<Vec<u8>>, Option<u64>, bool) = redis::pipe()
            .cmd("HGET")
            .arg(&keys.conv)
            .arg("key")
            .cmd("HGET")
            .arg(&keys.conv)
            .arg("id")
            .cmd("SISMEMBER")
            .arg(keys.responses(id))
            .arg(response_id)
            .query(c)?;
        let key = key_bytes.as_deref().and_then(ConversationKey::from_bytes);
        match key {
            Some(key) if stored_id == Some(id) && member && key.tenant == *tenant => {
                Ok(Some((key, keys, id)))
            }
            _ => {
                let _: i64 = redis::cmd("DEL").arg(&hint).query(c)?;
                Ok(None)
            }
        }
    }

    fn index_conversations(&self) -> String {
        format!("{}idx:conv", self.prefix)
    }

    fn index_ttl(&self) -> String {
        format!("{}idx:ttl", self.prefix)
    }

    /// After a write on `connection`: waits for the configured replicas.
    fn wait(&self, connection: &mut Connection) -> Result<(), StoreError> {
        if self.wait_replicas == 0 {
            return Ok(());
        }
        let acknowledged: u64 = redis::cmd("WAIT")
            .arg(self.wait_replicas)
            .arg(u64::try_from(self.wait_timeout.as_millis()).unwrap_or(u64::MAX))
            .query(connection)?;
        if acknowledged < u64::from(self.wait_replicas) {
            return Err(StoreError::Unreachable(format!(
                "{acknowledged} of {} Redis replicas acknowledged the write in time",
                self.wait_replicas
            )));
        }
        Ok(())
    }

    /// The conversation's record, id and version, or `None`.
    fn head(
        &self,
        connection: &mut Connection,
        keys: &Keys,
    ) -> Result<Option<(ConversationMeta, Vec<u8>)>, StoreError> {
        let (ver, meta): (Option<Vec<u8>>, Option<Vec<u8>>) = redis::cmd("HMGET")
            .arg(&keys.conv)
            .arg("ver")
            .arg("meta")
            .query(connection)?;
        match (ver, meta) {
            (Some(ver), Some(meta)) => Ok(Some((decode(&meta)?, ver))),
            _ => Ok(None),
        }
    }

    /// A page of the index `index` (key bytes, score 0): up to `limit` members after
    /// `after`, each parsed and read by `read` (one command of a pipeline) and kept as `keep`
    /// makes it. Members that do not parse or whose value is gone (expired by Redis, or left
    /// by a delete that stopped half way) are removed from the index.
    fn index_page<K, T>(
        &self,
        index: &str,
        after: Option<&[u8]>,
        limit: usize,
        read: impl Fn(&[u8]) -> Option<(K, redis::Cmd)>,
        keep: impl Fn(K, Vec<u8>) -> Result<T, StoreError>,
    ) -> Result<Page<T>, StoreError> {
        let mut c = self.connection()?;
        let members: Vec<Vec<u8>> = redis::cmd("ZRANGEBYLEX")
            .arg(index)
            .arg(lex_after(after, b""))
            .arg("+")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query(&mut *c)?;
        let mut pipe = redis::pipe();
        let mut asked = Vec::new();
        let mut gone = Vec::new();
        for bytes in &members {
            match read(bytes) {
                Some((parsed, command)) => {
                    pipe.add_command(command);
                    asked.push((bytes, parsed));
                }
                None => gone.push(bytes),
            }
        }
        let values: Vec<Option<Vec<u8>>> = if asked.is_empty() {
            Vec::new()
        } else {
            pipe.query(&mut *c)?
        };
        let mut out = Vec::new();
        for ((bytes, parsed), value) in asked.into_iter().zip(values) {
            match value {
                Some(value) => out.push(keep(parsed, value)?),
                None => gone.push(bytes),
            }
        }
        if !gone.is_empty() {
            let _: i64 = redis::cmd("ZREM").arg(index).arg(gone).query(&mut *c)?;
        }
        let cursor = (members.len() == limit)
            .then(|| members.last().cloned())
            .flatten();
        Ok((out, cursor))
    }

    /// Entries of what `ZRANGE` gave, in turn order.
    fn entries(members: &[Vec<u8>]) -> Result<Vec<Entry>, StoreError> {
        let mut entries: Vec<Entry> = Vec::with_capacity(members.len());
        for bytes in members {
            let message = message_of(bytes)?;
            let before = entries.last().map_or(0, |e| e.cum_tokens);
            entries.push(Entry::new(&message, before));
        }
        Ok(entries)
    }
}

impl Engine for RedisEngine {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn load(&self, key: &ConversationKey) -> Result<Loaded, StoreError> {
        let keys = self.keys(key);
        let mut c = self.connection()?;
        for _ in 0..MAX_ATTEMPTS {
            let Some((meta, ver)) = self.head(&mut c, &keys)? else {
                return Ok(Loaded::default());
            };
            // The messages and the version again in one step: equal, they belong together.
            let (again, members): (Option<Vec<u8>>, Vec<Vec<u8>>) = redis::pipe()
                .atomic()
                .cmd("HGET")
                .arg(&keys.conv)
                .arg("ver")
                .cmd("ZRANGE")
                .arg(keys.messages(meta.id))
                .arg(0)
                .arg(-1)
                .query(&mut *c)?;
            if again.as_deref() != Some(ver.as_slice()) {
                continue;
            }
            return Ok(Loaded {
                entries: Self::entries(&members)?,
                meta: Some(meta),
                version: Version::of(ver),
            });
        }
        Err(StoreError::Stale)
    }

    fn meta(&self, key: &ConversationKey) -> Result<Option<ConversationMeta>, StoreError> {
        let mut c = self.connection()?;
        let meta: Option<Vec<u8>> = redis::cmd("HGET")
            .arg(self.keys(key).conv)
            .arg("meta")
            .query(&mut *c)?;
        meta.map(|bytes| decode(&bytes)).transpose()
    }

    fn messages(
        &self,
        key: &ConversationKey,
        id: u64,
        turns: &[u64],
    ) -> Result<Vec<StoredMessage>, StoreError> {
        if turns.is_empty() {
            return Ok(Vec::new());
        }
        let set = self.keys(key).messages(id);
        let mut pipe = redis::pipe();
        for turn in turns {
            pipe.cmd("ZRANGEBYSCORE").arg(&set).arg(turn).arg(turn);
        }
        let mut c = self.connection()?;
        let found: Vec<Vec<Vec<u8>>> = pipe.query(&mut *c)?;
        turns
            .iter()
            .zip(found)
            .map(|(turn, members)| match members.first() {
                Some(bytes) => message_of(bytes),
                None => Err(StoreError::Corrupt(format!("turn {turn} is missing"))),
            })
            .collect()
    }

    fn range(
        &self,
        key: &ConversationKey,
        id: u64,
        from: u64,
        to: u64,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        if from > to {
            return Ok(Vec::new());
        }
        let mut c = self.connection()?;
        let members: Vec<Vec<u8>> = redis::cmd("ZRANGEBYSCORE")
            .arg(self.keys(key).messages(id))
            .arg(from)
            .arg(to)
            .query(&mut *c)?;
        members.iter().map(|bytes| message_of(bytes)).collect()
    }

    fn new_id(&self) -> Result<u64, StoreError> {
        let mut c = self.connection()?;
        Ok(redis::cmd("INCR")
            .arg(format!("{}ids", self.prefix))
            .query(&mut *c)?)
    }

    fn write(
        &self,
        key: &ConversationKey,
        expected: &Version,
        write: Write<'_>,
    ) -> Result<Version, StoreError> {
        let keys = self.keys(key);
        let id = write.meta.id;
        let key_bytes = key.to_bytes();
        let mut invocation = self.scripts.write.prepare_invoke();
        invocation
            .key(&keys.conv)
            .key(keys.messages(id))
            .key(keys.summaries(id))
            .key(keys.branches(id))
            .key(keys.secret(id))
            .key(keys.ttl())
            .key(keys.responses(id))
            .key(keys.vectors(id))
            .arg(expected.token().unwrap_or_default())
            .arg(key_bytes.as_slice())
            .arg(encode(write.meta)?)
            .arg(id)
            .arg(write.meta.last_activity_ms);
        invocation.arg(write.remove_turns.len());
        for turn in write.remove_turns {
            invocation.arg(turn);
        }
        invocation.arg(write.add.len());
        for message in write.add {
            invocation
                .arg(message.turn)
                .arg(member(message.turn, &encode(message)?));
        }
        invocation.arg(write.remove_summaries.len());
        for number in write.remove_summaries {
            invocation.arg(number);
        }
        invocation.arg(write.summaries.len());
        for (number, record) in write.summaries {
            invocation.arg(number).arg(member(*number, record));
        }
        let rows = branch_rows(id, write.branches)?;
        invocation.arg(rows.len());
        for (field, value) in &rows {
            invocation.arg(&field[..]).arg(value.as_slice());
        }
        invocation.arg(write.response_ids.len());
        for response_id in write.response_ids {
            invocation.arg(response_id);
        }
        invocation.arg(write.vectors.len());
        for (turn, value) in write.vectors {
            invocation.arg(turn).arg(value.as_slice());
        }
        let mut c = self.connection()?;
        let version: Option<Vec<u8>> = invocation.invoke(&mut *c)?;
        let Some(version) = version else {
            return Err(StoreError::Stale);
        };
        let _: i64 = redis::cmd("ZADD")
            .arg(self.index_conversations())
            .arg(0)
            .arg(key_bytes.as_slice())
            .query(&mut *c)?;
        if !write.response_ids.is_empty() {
            // The hints live as long as the conversation would if left idle from now.
            let ttl: i64 = redis::cmd("PTTL").arg(&keys.conv).query(&mut *c)?;
            let target = format!("{}:{id}", keys.tag());
            let mut pipe = redis::pipe();
            for response_id in write.response_ids {
                let set = pipe
                    .cmd("SET")
                    .arg(self.response_hint(&key.tenant, response_id))
                    .arg(&target);
                if ttl > 0 {
                    set.arg("PX").arg(ttl);
                }
                set.ignore();
            }
            let _: () = pipe.query(&mut *c)?;
        }
        self.wait(&mut c)?;
        Ok(Version::of(version))
    }

    fn delete(
        &self,
        key: &ConversationKey,
        idle_before_ms: Option<i64>,
    ) -> Result<Option<Deleted>, StoreError> {
        let keys = self.keys(key);
        let key_bytes = key.to_bytes();
        let mut c = self.connection()?;
        for _ in 0..MAX_ATTEMPTS {
            let id: Option<u64> = redis::cmd("HGET")
                .arg(&keys.conv)
                .arg("id")
                .query(&mut *c)?;
            let id = id.unwrap_or(0);
            // Read before the delete: an id a write adds in between leaves a hint that finds
            // nothing, and is dropped when looked up.
            let response_ids: Vec<String> = redis::cmd("SMEMBERS")
                .arg(keys.responses(id))
                .query(&mut *c)?;
            let reply: Vec<i64> = self
                .scripts
                .delete
                .key(&keys.conv)
                .key(keys.messages(id))
                .key(keys.summaries(id))
                .key(keys.branches(id))
                .key(keys.secret(id))
                .key(keys.ttl())
                .key(keys.lease())
                .key(keys.responses(id))
                .key(keys.vectors(id))
                .arg(id)
                .arg(idle_before_ms.map(|ms| ms.to_string()).unwrap_or_default())
                .invoke(&mut *c)?;
            match reply.as_slice() {
                [-1] => continue,
                [1, messages, summaries, branches] => {
                    let mut pipe = redis::pipe();
                    pipe.cmd("ZREM")
                        .arg(self.index_conversations())
                        .arg(key_bytes.as_slice())
                        .ignore()
                        .cmd("ZREM")
                        .arg(self.index_ttl())
                        .arg(key_bytes.as_slice())
                        .ignore();
                    for response_id in &response_ids {
                        pipe.cmd("DEL")
                            .arg(self.response_hint(&key.tenant, response_id))
                            .ignore();
                    }
                    let _: () = pipe.query(&mut *c)?;
                    self.wait(&mut c)?;
                    let count = |n: &i64| usize::try_from(*n).unwrap_or(0);
                    return Ok(Some(Deleted {
                        messages: count(messages),
                        summaries: count(summaries),
                        branches: count(branches),
                    }));
                }
                _ => {
                    if idle_before_ms.is_none() {
                        // Not stored: its TTL record went (in the script), its index entries go.
                        let _: () = redis::pipe()
                            .cmd("ZREM")
                            .arg(self.index_ttl())
                            .arg(key_bytes.as_slice())
                            .ignore()
                            .query(&mut *c)?;
                    }
                    return Ok(None);
                }
            }
        }
        Err(StoreError::Stale)
    }

    fn branches(&self, key: &ConversationKey, id: u64) -> Result<Vec<StoredBranch>, StoreError> {
        let mut c = self.connection()?;
        let mut rows: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(self.keys(key).branches(id))
            .query(&mut *c)?;
        rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        assemble_branches(rows.into_iter().map(Ok))
    }

    fn summaries(&self, key: &ConversationKey, id: u64) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let mut c = self.connection()?;
        let members: Vec<Vec<u8>> = redis::cmd("ZRANGE")
            .arg(self.keys(key).summaries(id))
            .arg(0)
            .arg(-1)
            .query(&mut *c)?;
        members
            .iter()
            .map(|bytes| split_member(bytes).map(|(n, record)| (n, record.to_vec())))
            .collect()
    }

    fn latest_summary(
        &self,
        key: &ConversationKey,
        id: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let mut c = self.connection()?;
        let members: Vec<Vec<u8>> = redis::cmd("ZRANGE")
            .arg(self.keys(key).summaries(id))
            .arg(-1)
            .arg(-1)
            .query(&mut *c)?;
        members
            .first()
            .map(|bytes| split_member(bytes).map(|(_, record)| record.to_vec()))
            .transpose()
    }

    fn put_summary(
        &self,
        key: &ConversationKey,
        id: u64,
        number: u64,
        record: &[u8],
    ) -> Result<bool, StoreError> {
        let keys = self.keys(key);
        let mut c = self.connection()?;
        let written: i64 = self
            .scripts
            .put_summary
            .key(&keys.conv)
            .key(keys.summaries(id))
            .arg(id)
            .arg(number)
            .arg(member(number, record))
            .invoke(&mut *c)?;
        if written == 1 {
            self.wait(&mut c)?;
        }
        Ok(written == 1)
    }

    fn ttl(&self, key: &ConversationKey) -> Result<Option<TtlRecord>, StoreError> {
        let mut c = self.connection()?;
        let record: Option<Vec<u8>> = redis::cmd("GET").arg(self.keys(key).ttl()).query(&mut *c)?;
        record.map(|bytes| decode(&bytes)).transpose()
    }

    fn put_ttl(&self, key: &ConversationKey, record: &TtlRecord) -> Result<(), StoreError> {
        let keys = self.keys(key);
        let key_bytes = key.to_bytes();
        let record = encode(record)?;
        let mut c = self.connection()?;
        for _ in 0..MAX_ATTEMPTS {
            let id: Option<u64> = redis::cmd("HGET")
                .arg(&keys.conv)
                .arg("id")
                .query(&mut *c)?;
            let n = id.unwrap_or(0);
            let done: i64 = self
                .scripts
                .put_ttl
                .key(keys.ttl())
                .key(&keys.conv)
                .key(keys.messages(n))
                .key(keys.summaries(n))
                .key(keys.branches(n))
                .key(keys.secret(n))
                .key(keys.responses(n))
                .key(keys.vectors(n))
                .arg(record.as_slice())
                .arg(id.map(|id| id.to_string()).unwrap_or_default())
                .invoke(&mut *c)?;
            if done == 1 {
                let _: i64 = redis::cmd("ZADD")
                    .arg(self.index_ttl())
                    .arg(0)
                    .arg(key_bytes.as_slice())
                    .query(&mut *c)?;
                return self.wait(&mut c);
            }
        }
        Err(StoreError::Stale)
    }

    fn ttl_page(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(ConversationKey, TtlRecord)>, StoreError> {
        self.index_page(
            &self.index_ttl(),
            after,
            limit,
            |bytes| {
                let mut get = redis::cmd("GET");
                get.arg(Keys::of_bytes(&self.prefix, bytes).ttl());
                ConversationKey::from_bytes(bytes).map(|key| (key, get))
            },
            |key, record| Ok((key, decode(&record)?)),
        )
    }

    fn drop_orphan_ttl(&self, key: &ConversationKey) -> Result<bool, StoreError> {
        let keys = self.keys(key);
        let mut c = self.connection()?;
        let dropped: i64 = self
            .scripts
            .drop_orphan_ttl
            .key(&keys.conv)
            .key(keys.ttl())
            .invoke(&mut *c)?;
        if dropped >= 0 {
            let _: i64 = redis::cmd("ZREM")
                .arg(self.index_ttl())
                .arg(key.to_bytes())
                .query(&mut *c)?;
        }
        Ok(dropped == 1)
    }

    fn list(
        &self,
        scope: Scope<'_>,
        after: Option<&[u8]>,
        limit: usize,
        max_scan: usize,
    ) -> Result<Page<(ConversationKey, ConversationMeta)>, StoreError> {
        let mut prefix = Vec::new();
        if let Some(tenant) = scope.tenant {
            prefix.extend_from_slice(tenant.as_str().as_bytes());
            prefix.push(0);
            if let Some(agent) = scope.agent {
                prefix.extend_from_slice(agent.as_bytes());
                prefix.push(0);
            }
        }
        let end = lex_end(&prefix);
        let chunk = limit.saturating_add(1).clamp(1, 512);
        let mut c = self.connection()?;
        let mut out: Vec<(ConversationKey, ConversationMeta)> = Vec::new();
        let mut last: Option<Vec<u8>> = after.map(<[u8]>::to_vec);
        let mut scanned = 0;
        loop {
            let want = chunk.min(max_scan - scanned);
            if want == 0 {
                // The scan budget is spent: the page ends early, with a cursor.
                return Ok((out, last));
            }
            let members: Vec<Vec<u8>> = redis::cmd("ZRANGEBYLEX")
                .arg(self.index_conversations())
                .arg(lex_after(last.as_deref(), &prefix))
                .arg(end.as_slice())
                .arg("LIMIT")
                .arg(0)
                .arg(want)
                .query(&mut *c)?;
            let mut pipe = redis::pipe();
            for bytes in &members {
                pipe.cmd("HGET")
                    .arg(Keys::of_bytes(&self.prefix, bytes).conv)
                    .arg("meta");
            }
            let metas: Vec<Option<Vec<u8>>> = if members.is_empty() {
                Vec::new()
            } else {
                pipe.query(&mut *c)?
            };
            let mut gone = Vec::new();
            for (bytes, meta) in members.iter().zip(metas) {
                let key = ConversationKey::from_bytes(bytes);
                let (Some(key), Some(meta)) = (key, meta) else {
                    gone.push(bytes.clone());
                    last = Some(bytes.clone());
                    continue;
                };
                if !scope.covers(&key) {
                    last = Some(bytes.clone());
                    continue;
                }
                if out.len() == limit {
                    let cursor = out.last().map(|(k, _)| k.to_bytes());
                    return Ok((out, cursor));
                }
                last = Some(bytes.clone());
                out.push((key, decode(&meta)?));
            }
            if !gone.is_empty() {
                // Expired by Redis, or left by a delete that stopped half way.
                let _: i64 = redis::cmd("ZREM")
                    .arg(self.index_conversations())
                    .arg(gone)
                    .query(&mut *c)?;
            }
            scanned += members.len();
            if members.len() < want {
                return Ok((out, None));
            }
        }
    }

    fn flush(&self) -> Result<(), StoreError> {
        // Acknowledged writes are as durable as Redis makes them (see the module
        // documentation); WAIT, when configured, ran with each write.
        Ok(())
    }

    fn reopen(&self) -> Result<(), StoreError> {
        let mut c = self.connection()?;
        let _: String = redis::cmd("PING").query(&mut *c)?;
        Ok(())
    }

    fn is_ready(&self) -> bool {
        self.reopen().is_ok()
    }

    fn size_bytes(&self) -> u64 {
        let Ok(mut c) = self.connection() else {
            return 0;
        };
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query(&mut *c)
            .unwrap_or_default();
        info.lines()
            .find_map(|line| line.strip_prefix("used_memory:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    fn response_conversation(
        &self,
        tenant: &TenantId,
        response_id: &str,
    ) -> Result<Option<ConversationKey>, StoreError> {
        let mut c = self.connection()?;
        Ok(self
            .response_target(&mut c, tenant, response_id)?
            .map(|(key, _, _)| key))
    }

    fn forget_response(&self, tenant: &TenantId, response_id: &str) -> Result<bool, StoreError> {
        let mut c = self.connection()?;
        let Some((_, keys, id)) = self.response_target(&mut c, tenant, response_id)? else {
            return Ok(false);
        };
        let _: () = redis::pipe()
            .cmd("SREM")
            .arg(keys.responses(id))
            .arg(response_id)
            .ignore()
            .cmd("DEL")
            .arg(self.response_hint(tenant, response_id))
            .ignore()
            .query(&mut *c)?;
        self.wait(&mut c)?;
        Ok(true)
    }

    fn any_trace_of(&self, needle: &[u8]) -> Result<bool, StoreError> {
        if needle.is_empty() {
            return Ok(true);
        }
        let found = |bytes: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        let mut c = self.connection()?;
        for key in self.all_keys(&mut c)? {
            if found(&key) {
                return Ok(true);
            }
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut *c)?;
            let values: Vec<Vec<u8>> = match kind.as_str() {
                "string" => redis::cmd("GET").arg(&key).query(&mut *c)?,
                "hash" => redis::cmd("HGETALL").arg(&key).query(&mut *c)?,
                "set" => redis::cmd("SMEMBERS").arg(&key).query(&mut *c)?,
                "zset" => redis::cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .query(&mut *c)?,
                _ => Vec::new(),
            };
            if values.iter().any(|v| found(v)) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    // Owners' records (long-term memory): `redis_owners.rs`.
}

impl SharedEngine for RedisEngine {
    fn refresh(
        &self,
        key: &ConversationKey,
        known: &Version,
        known_meta: Option<&ConversationMeta>,
        known_count: usize,
    ) -> Result<Refresh, StoreError> {
        let keys = self.keys(key);
        let (id, from) = known_meta.map_or((0, 1), |m| (m.id, m.next_turn));
        let mut c = self.connection()?;
        let reply: Vec<Vec<u8>> = self
            .scripts
            .refresh
            .key(&keys.conv)
            .key(keys.messages(id))
            .arg(known.token().unwrap_or_default())
            .arg(from)
            .invoke(&mut *c)?;
        let mut reply = reply.into_iter();
        let Some(ver) = reply.next() else {
            return Ok(if known_meta.is_none() {
                Refresh::Unchanged
            } else {
                Refresh::Changed
            });
        };
        if known.token() == Some(ver.as_slice()) {
            return Ok(Refresh::Unchanged);
        }
        let Some(meta) = reply.next() else {
            return Ok(Refresh::Changed);
        };
        let meta: ConversationMeta = decode(&meta)?;
        let added = reply
            .map(|bytes| message_of(&bytes))
            .collect::<Result<Vec<_>, _>>()?;
        // Turns only grow: the known messages are all still there exactly when the count is
        // theirs plus the new ones (a trim or a closed branch removes some).
        if known_meta.is_none_or(|m| m.id != meta.id)
            || meta.message_count != (known_count + added.len()) as u64
        {
            return Ok(Refresh::Changed);
        }
        Ok(Refresh::Appended {
            meta,
            version: Version::of(ver),
            added,
        })
    }

    fn key_bytes(&self, key: &ConversationKey, id: u64) -> Result<Option<Vec<u8>>, StoreError> {
        let mut c = self.connection()?;
        Ok(redis::cmd("GET")
            .arg(self.keys(key).secret(id))
            .query(&mut *c)?)
    }

    fn create_key(
        &self,
        key: &ConversationKey,
        id: u64,
        bytes: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let mut c = self.connection()?;
        let stored: Vec<u8> = self
            .scripts
            .create_key
            .key(self.keys(key).secret(id))
            .arg(bytes)
            .arg(KEY_PROVISIONAL_MS)
            .invoke(&mut *c)?;
        self.wait(&mut c)?;
        Ok(stored)
    }

    fn remove_key(&self, key: &ConversationKey, id: u64) -> Result<(), StoreError> {
        let mut c = self.connection()?;
        let _: i64 = redis::cmd("DEL")
            .arg(self.keys(key).secret(id))
            .query(&mut *c)?;
        Ok(())
    }

    fn take_lease(
        &self,
        key: &ConversationKey,
        id: u64,
        holder: &str,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let keys = self.keys(key);
        let mut c = self.connection()?;
        let taken: i64 = self
            .scripts
            .take_lease
            .key(keys.lease())
            .key(&keys.conv)
            .arg(holder)
            .arg(id)
            .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1))
            .invoke(&mut *c)?;
        Ok(taken == 1)
    }

    fn release_lease(&self, key: &ConversationKey, holder: &str) -> Result<(), StoreError> {
        let mut c = self.connection()?;
        let _: i64 = self
            .scripts
            .release_lease
            .key(self.keys(key).lease())
            .arg(holder)
            .invoke(&mut *c)?;
        Ok(())
    }
}

impl Owners for RedisEngine {
    fn owner(&self, owner: &OwnerKey) -> Result<Option<OwnerMeta>, StoreError> {
        self.owner_meta(owner)
    }

    fn create_owner(&self, owner: &OwnerKey, meta: OwnerMeta) -> Result<OwnerMeta, StoreError> {
        self.create_owner_record(owner, meta)
    }

    fn write_owner(
        &self,
        owner: &OwnerKey,
        id: u64,
        put: &[OwnerRecord],
        remove: &[(u8, Vec<u8>)],
    ) -> Result<bool, StoreError> {
        self.write_owner_records(owner, id, put, remove)
    }

    fn owner_record(
        &self,
        owner: &OwnerKey,
        space: u8,
        id: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.one_owner_record(owner, space, id)
    }

    fn owner_records(
        &self,
        owner: &OwnerKey,
        space: u8,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<OwnerRecord>, StoreError> {
        self.owner_record_page(owner, space, after, limit)
    }

    fn delete_owner(&self, owner: &OwnerKey) -> Result<Option<u64>, StoreError> {
        self.delete_owner_records(owner)
    }

    fn owners(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(OwnerKey, OwnerMeta)>, StoreError> {
        self.owner_page(after, limit)
    }
}

impl RedisEngine {
    /// Every key under the prefix (`SCAN`, a page at a time): audits and tests.
    pub fn all_keys(&self, c: &mut Connection) -> Result<Vec<Vec<u8>>, StoreError> {
        let mut cursor: u64 = 0;
        let mut out = Vec::new();
        loop {
            let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", self.prefix))
                .arg("COUNT")
                .arg(1000)
                .query(c)?;
            out.extend(keys);
            if next == 0 {
                return Ok(out);
            }
            cursor = next;
        }
    }

    /// Every key under the prefix, as text (tests).
    pub fn key_names(&self) -> Result<Vec<String>, StoreError> {
        let mut c = self.connection()?;
        Ok(self
            .all_keys(&mut c)?
            .into_iter()
            .map(|k| String::from_utf8_lossy(&k).into_owned())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_a_conversation_shares_one_hash_tag() {
        let key = crate::tests::key("a{b}c");
        let keys = Keys::of("p:", &key);
        let tag = |name: &str| {
            let open = name.find('{').unwrap();
            let close = name[open..].find('}').unwrap() + open;
            name[open..=close].to_string()
        };
        let all = [
            keys.conv.clone(),
            keys.messages(7),
            keys.summaries(7),
            keys.branches(7),
            keys.secret(7),
            keys.vectors(7),
            keys.ttl(),
            keys.lease(),
        ];
        for name in &all {
            assert!(name.starts_with("p:{"), "{name}");
            assert_eq!(tag(name), tag(&keys.conv), "{name}");
            assert_eq!(tag(name).len(), 34, "{name}");
        }
        assert_ne!(
            tag(&Keys::of("p:", &crate::tests::key("other")).conv),
            tag(&keys.conv)
        );
    }

    #[test]
    fn lex_bounds_cover_exactly_a_prefix() {
        assert_eq!(lex_after(None, b""), b"-");
        assert_eq!(lex_after(None, b"t\0"), b"[t\0");
        assert_eq!(lex_after(Some(b"t\0a"), b"t\0"), b"(t\0a");
        assert_eq!(lex_after(Some(b"a"), b"t\0"), b"[t\0");
        assert_eq!(lex_end(b""), b"+");
        assert_eq!(lex_end(b"t\0"), b"(t\x01");
    }

    use crate::contract::{redis_options, redis_server::RedisServer};

    #[test]
    fn a_password_from_the_configuration_wins_over_none_in_the_url() {
        let server = RedisServer::start_with(&["--requirepass", "s3cret-pw"]);
        let without = RedisEngine::open(&redis_options(&server.url())).unwrap();
        let err = without.new_id().unwrap_err();
        assert!(!err.to_string().contains("s3cret-pw"), "{err}");
        let mut options = redis_options(&server.url());
        options.password = Some("s3cret-pw".to_string());
        let with = RedisEngine::open(&options).unwrap();
        assert_eq!(with.new_id().unwrap(), 1);
        // The password in the URL works too.
        let url = server.url().replace("redis://", "redis://:s3cret-pw@");
        assert_eq!(
            RedisEngine::open(&redis_options(&url))
                .unwrap()
                .new_id()
                .unwrap(),
            2
        );
    }

    #[test]
    fn rediss_speaks_tls_and_a_server_without_it_is_unreachable_not_a_panic() {
        let server = RedisServer::start();
        let url = server.url().replace("redis://", "rediss://");
        let engine = RedisEngine::open(&redis_options(&url)).unwrap();
        // A plain server does not answer the TLS handshake: the engine reports it, the
        // ring provider is in place (no panic choosing one).
        let err = engine.new_id().unwrap_err();
        assert!(err.is_write_failure(), "{err}");
        assert!(!engine.is_ready());
    }

    #[test]
    fn an_unreachable_server_is_a_failure_to_write_and_the_engine_opens_anyway() {
        let mut server = RedisServer::start();
        let engine = RedisEngine::open(&redis_options(&server.url())).unwrap();
        assert!(engine.reopen().is_ok());
        server.kill();
        let err = engine.load(&crate::tests::key("c")).unwrap_err();
        assert!(matches!(err, StoreError::Unreachable(_)), "{err:?}");
        assert!(engine.reopen().is_err());
        server.restart();
        assert!(engine.reopen().is_ok());
        assert!(engine.load(&crate::tests::key("c")).is_ok());
    }

    #[test]
    fn with_wait_replicas_a_write_counts_once_the_replicas_have_it() {
        let primary = RedisServer::start();
        let mut options = redis_options(&primary.url());
        options.wait_replicas = 1;
        options.wait_timeout = Duration::from_millis(200);
        let engine = RedisEngine::open(&options).unwrap();
        let key = crate::tests::key("c");
        let ttl = TtlRecord {
            ttl_ms: None,
            set_ms: 1,
        };
        // No replica: the write is on the primary, but not acknowledged as asked.
        let err = engine.put_ttl(&key, &ttl).unwrap_err();
        assert!(err.to_string().contains("0 of 1"), "{err}");
        let port = primary.port().to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
        options.wait_timeout = Duration::from_secs(5);
        let engine = RedisEngine::open(&options).unwrap();
        let started = std::time::Instant::now();
        loop {
            match engine.put_ttl(&key, &ttl) {
                Ok(()) => break,
                Err(err) => {
                    assert!(started.elapsed() < Duration::from_secs(20), "{err}");
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        assert!(replica.command("GET x").starts_with("$-1"));
    }

    #[test]
    fn members_keep_their_number_first() {
        let bytes = member(258, b"{}");
        assert_eq!(split_member(&bytes).unwrap(), (258, b"{}".as_slice()));
        assert!(split_member(b"short").is_err());
    }
}
