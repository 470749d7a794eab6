//! What one request may add to memory: the per-request limits (413, nothing stored), a commit
//! that never leaves more than `max_messages`, and long trims done in bounded batches.

use std::sync::{Arc, Mutex};

use memproxy::identity::{ConversationKey, TenantId};
use memproxy::memory;
use memproxy::message::Role;
use memproxy::pipeline::commit::TRIM_BATCH;
use memproxy::state::AppState;
use memproxy::store::{
    Backing, Clock, ConversationMeta, Deleted, Engine, ImportMeta, Loaded, Origin, OwnerKey,
    OwnerMeta, OwnerRecord, Owners, Page, Scope, SealedVector, SledEngine, Store, StoreError,
    StoredBranch, StoredMessage, TtlRecord, Vectors, Version, Write,
};
use memproxy::upstream::Upstream;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::support::mock_upstream::MockUpstream;
use crate::support::*;

/// `n` alternating user/assistant messages, numbered.
fn history(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            if i % 2 == 0 {
                user(&format!("question {i}"))
            } else {
                assistant(&format!("answer {i}"))
            }
        })
        .collect()
}

/// `n` alternating user/assistant messages as stored records, numbered from turn 1.
fn stored_history(n: usize) -> Vec<StoredMessage> {
    history(n)
        .iter()
        .enumerate()
        .map(|(i, m)| StoredMessage {
            turn: i as u64 + 1,
            role: if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            },
            origin: Origin::Client,
            at_ms: Clock::default().now_ms(),
            tokens: 3,
            fingerprint: i as u64 + 1,
            message: RawValue::from_string(m.to_string()).unwrap(),
            exchange: None,
        })
        .collect()
}

#[tokio::test]
async fn a_request_over_the_new_message_limit_is_413_and_stores_nothing() {
    let Started { mock, proxy, .. } = Harness::new()
        .config("[limits]\nmax_new_messages = 50\nmax_new_tokens = 100000\n")
        .start()
        .await;
    // Within the limit: stored.
    let mut messages = history(40);
    messages.push(user("the new one"));
    let answer = chat(&proxy, "c", &body(&messages), &[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-turns"), "42");

    // A full-history client re-sending what is stored adds only its new messages: fine.
    messages.push(reply_message(&answer));
    messages.push(user("one more"));
    let answer = chat(&proxy, "c", &body(&messages), &[]).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);

    // 60 new messages at once: refused, naming the limit; nothing stored, nothing forwarded.
    let forwarded = mock.chat_requests().len();
    let mut flood = history(59);
    flood.push(user("flood"));
    let answer = chat(&proxy, "other", &body(&flood), &[]).await;
    assert_eq!(answer.status, 413);
    let error = answer.json();
    assert_eq!(error["error"]["code"], "too_many_new_messages");
    assert_eq!(error["error"]["type"], "invalid_request_error");
    assert_eq!(error["error"]["param"], "messages");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("limits.max_new_messages") && message.contains("60"),
        "{message}"
    );
    assert!(proxy.stored(Some(TOKEN), "other").is_empty());
    assert_eq!(mock.chat_requests().len(), forwarded);
}

#[tokio::test]
async fn a_request_over_the_new_token_limit_is_413() {
    let Started { proxy, .. } = Harness::new()
        .config("[limits]\nmax_new_tokens = 200\n")
        .start()
        .await;
    let long = "word ".repeat(300);
    let answer = chat(&proxy, "c", &body(&[user(&long)]), &[]).await;
    assert_eq!(answer.status, 413);
    assert_eq!(answer.json()["error"]["code"], "too_many_new_tokens");
    assert!(
        answer.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limits.max_new_tokens")
    );
    assert!(proxy.stored(Some(TOKEN), "c").is_empty());
    let answer = chat(&proxy, "c", &body(&[user("short")]), &[]).await;
    assert_eq!(answer.status, 200);
}

#[tokio::test]
async fn a_commit_never_leaves_more_than_max_messages() {
    let Started { proxy, .. } = Harness::new().start().await;
    // 30 new messages into a conversation allowed 10: the exchange's own oldest rounds go.
    let mut messages = history(29);
    messages.push(user("last question"));
    let answer = chat(
        &proxy,
        "c",
        &body(&messages),
        &[("x-memory-max-messages", "10")],
    )
    .await;
    assert_eq!(answer.status, 200);
    let stored = proxy.stored(Some(TOKEN), "c");
    assert!(stored.len() <= 10, "{} stored", stored.len());
    assert_eq!(answer.header("x-memory-turns"), stored.len().to_string());
    assert_eq!(stored[0].role, Role::User, "a whole round first");
    let last = summarize(&stored);
    assert_eq!(
        last[last.len() - 2..],
        ["user:last question", "assistant:reply to: last question"]
    );
}

#[tokio::test]
async fn a_conversation_far_over_max_messages_is_trimmed_to_it_and_goes_on() {
    let Started { proxy, .. } = Harness::new().start().await;
    // A conversation far over the limit it will be used with (stored before the limit
    // was lowered): 1,500 messages.
    let key = key(Some(TOKEN), "long");
    let messages: Vec<StoredMessage> = stored_history(1500);
    proxy
        .store()
        .import_conversation(&key, messages, vec![], vec![], ImportMeta::default())
        .unwrap();
    let answer = chat(
        &proxy,
        "long",
        &body(&[user("question 4 again")]),
        &[("x-memory-max-messages", "100")],
    )
    .await;
    assert_eq!(answer.status, 200);
    let stored = proxy.stored(Some(TOKEN), "long");
    assert!(stored.len() <= 100, "{} stored", stored.len());
    assert_eq!(stored[0].role, Role::User);
    assert_eq!(
        summarize(&stored[stored.len() - 2..]),
        [
            "user:question 4 again",
            "assistant:reply to: question 4 again"
        ]
    );
    // The conversation goes on as usual, its recall index in step with what is stored.
    let answer = chat(
        &proxy,
        "long",
        &body(&[user("question 1490")]),
        &[("x-memory-max-messages", "100")],
    )
    .await;
    assert_eq!(answer.status, 200);
    assert!(proxy.stored(Some(TOKEN), "long").len() <= 100);
}

/// An engine that records the size of every write (turns removed, messages added) and
/// passes everything to sled.
struct Counting {
    inner: SledEngine,
    writes: Mutex<Vec<(usize, usize)>>,
}

impl Engine for Counting {
    fn name(&self) -> &'static str {
        "counting sled"
    }
    fn load(&self, key: &ConversationKey) -> Result<Loaded, StoreError> {
        self.inner.load(key)
    }
    fn meta(&self, key: &ConversationKey) -> Result<Option<ConversationMeta>, StoreError> {
        self.inner.meta(key)
    }
    fn messages(
        &self,
        key: &ConversationKey,
        id: u64,
        turns: &[u64],
    ) -> Result<Vec<StoredMessage>, StoreError> {
        self.inner.messages(key, id, turns)
    }
    fn range(
        &self,
        key: &ConversationKey,
        id: u64,
        from: u64,
        to: u64,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        self.inner.range(key, id, from, to)
    }
    fn new_id(&self) -> Result<u64, StoreError> {
        self.inner.new_id()
    }
    fn write(
        &self,
        key: &ConversationKey,
        expected: &Version,
        write: Write<'_>,
    ) -> Result<Version, StoreError> {
        self.writes
            .lock()
            .unwrap()
            .push((write.remove_turns.len(), write.add.len()));
        self.inner.write(key, expected, write)
    }
    fn delete(
        &self,
        key: &ConversationKey,
        idle_before_ms: Option<i64>,
    ) -> Result<Option<Deleted>, StoreError> {
        self.inner.delete(key, idle_before_ms)
    }
    fn branches(&self, key: &ConversationKey, id: u64) -> Result<Vec<StoredBranch>, StoreError> {
        self.inner.branches(key, id)
    }
    fn summaries(&self, key: &ConversationKey, id: u64) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        self.inner.summaries(key, id)
    }
    fn latest_summary(
        &self,
        key: &ConversationKey,
        id: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.latest_summary(key, id)
    }
    fn put_summary(
        &self,
        key: &ConversationKey,
        id: u64,
        number: u64,
        record: &[u8],
    ) -> Result<bool, StoreError> {
        self.inner.put_summary(key, id, number, record)
    }
    fn ttl(&self, key: &ConversationKey) -> Result<Option<TtlRecord>, StoreError> {
        self.inner.ttl(key)
    }
    fn put_ttl(&self, key: &ConversationKey, record: &TtlRecord) -> Result<(), StoreError> {
        self.inner.put_ttl(key, record)
    }
    fn ttl_page(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(ConversationKey, TtlRecord)>, StoreError> {
        self.inner.ttl_page(after, limit)
    }
    fn drop_orphan_ttl(&self, key: &ConversationKey) -> Result<bool, StoreError> {
        self.inner.drop_orphan_ttl(key)
    }
    fn list(
        &self,
        scope: Scope<'_>,
        after: Option<&[u8]>,
        limit: usize,
        max_scan: usize,
    ) -> Result<Page<(ConversationKey, ConversationMeta)>, StoreError> {
        self.inner.list(scope, after, limit, max_scan)
    }
    fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush()
    }
    fn reopen(&self) -> Result<(), StoreError> {
        self.inner.reopen()
    }
    fn is_ready(&self) -> bool {
        self.inner.is_ready()
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn response_conversation(
        &self,
        tenant: &TenantId,
        response_id: &str,
    ) -> Result<Option<ConversationKey>, StoreError> {
        self.inner.response_conversation(tenant, response_id)
    }
    fn forget_response(&self, tenant: &TenantId, response_id: &str) -> Result<bool, StoreError> {
        self.inner.forget_response(tenant, response_id)
    }
    fn any_trace_of(&self, needle: &[u8]) -> Result<bool, StoreError> {
        self.inner.any_trace_of(needle)
    }
}

impl Owners for Counting {
    fn owner(&self, owner: &OwnerKey) -> Result<Option<OwnerMeta>, StoreError> {
        self.inner.owner(owner)
    }

    fn create_owner(&self, owner: &OwnerKey, meta: OwnerMeta) -> Result<OwnerMeta, StoreError> {
        self.inner.create_owner(owner, meta)
    }

    fn write_owner(
        &self,
        owner: &OwnerKey,
        id: u64,
        put: &[OwnerRecord],
        remove: &[(u8, Vec<u8>)],
    ) -> Result<bool, StoreError> {
        self.inner.write_owner(owner, id, put, remove)
    }

    fn owner_record(
        &self,
        owner: &OwnerKey,
        space: u8,
        id: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.owner_record(owner, space, id)
    }

    fn owner_records(
        &self,
        owner: &OwnerKey,
        space: u8,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<OwnerRecord>, StoreError> {
        self.inner.owner_records(owner, space, after, limit)
    }

    fn delete_owner(&self, owner: &OwnerKey) -> Result<Option<u64>, StoreError> {
        self.inner.delete_owner(owner)
    }

    fn owners(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(OwnerKey, OwnerMeta)>, StoreError> {
        self.inner.owners(after, limit)
    }
}

impl Vectors for Counting {
    fn put_vectors(
        &self,
        key: &ConversationKey,
        id: u64,
        vectors: &[(u64, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError> {
        self.inner.put_vectors(key, id, vectors)
    }

    fn vectors(
        &self,
        key: &ConversationKey,
        id: u64,
    ) -> Result<Vec<SealedVector<u64>>, StoreError> {
        self.inner.vectors(key, id)
    }

    fn put_owner_vectors(
        &self,
        owner: &OwnerKey,
        id: u64,
        vectors: &[(u8, Vec<u8>, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError> {
        self.inner.put_owner_vectors(owner, id, vectors)
    }

    fn owner_vectors(
        &self,
        owner: &OwnerKey,
        space: u8,
    ) -> Result<Vec<SealedVector<Vec<u8>>>, StoreError> {
        self.inner.owner_vectors(owner, space)
    }

    fn vector_count(&self) -> Result<u64, StoreError> {
        self.inner.vector_count()
    }
}

#[tokio::test]
async fn a_long_trim_is_written_in_batches_none_larger_than_the_batch() {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = test_config(&mock, dir.path(), "", "");
    let engine = Arc::new(Counting {
        inner: SledEngine::open(&dir.path().join("store"), 8 << 20, None).unwrap(),
        writes: Mutex::new(Vec::new()),
    });
    let store = Store::with_engine(
        Backing::Own(Arc::clone(&engine) as Arc<dyn Engine>),
        dir.path(),
        memory::store_options(&config),
    )
    .unwrap();
    let upstream = Upstream::new(&config.upstream).unwrap();
    let state = AppState::new(Arc::new(config), Ok(Arc::new(store)), upstream);
    let proxy = Proxy::start_state(Arc::new(state)).await;
    // 3,000 messages stored before the limit was lowered to 100.
    let key = key(Some(TOKEN), "long");
    let messages: Vec<StoredMessage> = stored_history(3000);
    proxy
        .store()
        .import_conversation(&key, messages, vec![], vec![], ImportMeta::default())
        .unwrap();
    engine.writes.lock().unwrap().clear();

    let answer = chat(
        &proxy,
        "long",
        &body(&[user("one more question")]),
        &[("x-memory-max-messages", "100")],
    )
    .await;
    assert_eq!(answer.status, 200);
    let writes = engine.writes.lock().unwrap().clone();
    let removed: usize = writes.iter().map(|(removed, _)| removed).sum();
    assert!(removed >= 2902, "{removed} removed by {writes:?}");
    assert!(
        writes.iter().all(|(removed, _)| *removed <= TRIM_BATCH),
        "a write removed more than {TRIM_BATCH}: {writes:?}"
    );
    // The trim went in several writes; the exchange itself (2 messages) in the last.
    assert!(writes.len() >= removed.div_ceil(TRIM_BATCH), "{writes:?}");
    assert_eq!(writes.last().unwrap().1, 2, "{writes:?}");
    assert!(
        writes[..writes.len() - 1]
            .iter()
            .all(|(_, added)| *added == 0)
    );
    assert!(proxy.stored(Some(TOKEN), "long").len() <= 100);
    proxy.stop().await;
}
