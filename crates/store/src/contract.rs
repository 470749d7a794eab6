//! The storage contract (`engine.rs`), tested once for every engine: each test is a function of
//! `&dyn Engine`, and `contract_tests!` runs all of them against one engine. A new engine adds
//! one line at the bottom.

use serde_json::value::RawValue;

use super::engine::{Engine, Scope, Version, Write};
use super::records::{
    BranchRecord, ConversationMeta, Origin, OwnerKey, OwnerMeta, OwnerRecord, StoredBranch,
    StoredMessage, TtlRecord,
};
use super::{Durability, StoreError};
use memproxy_base::identity::{ConversationKey, TenantId};
use memproxy_base::message::Role;

fn key(tenant: &str, agent: &str, conversation: &str) -> ConversationKey {
    ConversationKey {
        tenant: TenantId::from_token(Some(tenant)),
        agent: agent.into(),
        conversation: conversation.into(),
    }
}

fn message(turn: u64, text: &str) -> StoredMessage {
    StoredMessage {
        turn,
        role: if turn % 2 == 1 {
            Role::User
        } else {
            Role::Assistant
        },
        origin: Origin::Client,
        at_ms: 1_000 + turn as i64,
        tokens: 2,
        fingerprint: turn * 7,
        message: RawValue::from_string(
            serde_json::json!({"role": "user", "content": text}).to_string(),
        )
        .unwrap(),
        exchange: None,
    }
}

fn meta(id: u64, next_turn: u64, count: u64) -> ConversationMeta {
    let mut meta = ConversationMeta::new(id, 1_000);
    meta.next_turn = next_turn;
    meta.message_count = count;
    meta.total_tokens = count * 2;
    meta
}

/// Stores turns `1..=n` in a new conversation at `key`; returns its id and version.
fn create(engine: &dyn Engine, key: &ConversationKey, n: u64) -> (u64, Version) {
    let id = engine.new_id().unwrap();
    let messages: Vec<StoredMessage> = (1..=n).map(|t| message(t, &format!("m{t}"))).collect();
    let version = engine
        .write(
            key,
            &Version::absent(),
            Write {
                meta: &meta(id, n + 1, n),
                remove_turns: &[],
                add: &messages,
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: &[],
                response_ids: &[],
            },
        )
        .unwrap();
    (id, version)
}

fn texts(messages: &[StoredMessage]) -> Vec<String> {
    messages
        .iter()
        .map(|m| {
            let value: serde_json::Value = serde_json::from_str(m.message.get()).unwrap();
            value["content"].as_str().unwrap().to_string()
        })
        .collect()
}

pub fn a_write_is_checked_against_the_version(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    assert!(engine.load(&k).unwrap().meta.is_none());
    let (id, v1) = create(engine, &k, 2);
    // Creating again against `absent` is stale: it exists now.
    let again = engine.write(
        &k,
        &Version::absent(),
        Write {
            meta: &meta(id, 3, 2),
            remove_turns: &[],
            add: &[message(1, "other")],
            vectors: &[],
            summaries: &[],
            remove_summaries: &[],
            branches: &[],
            response_ids: &[],
        },
    );
    assert!(matches!(again, Err(StoreError::Stale)));
    let v2 = engine
        .write(
            &k,
            &v1,
            Write {
                meta: &meta(id, 4, 3),
                remove_turns: &[],
                add: &[message(3, "m3")],
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: &[],
                response_ids: &[],
            },
        )
        .unwrap();
    assert_ne!(v1, v2);
    // A writer that planned on v1 is refused and changes nothing.
    let stale = engine.write(
        &k,
        &v1,
        Write {
            meta: &meta(id, 5, 2),
            remove_turns: &[1, 2],
            add: &[message(4, "lost")],
            vectors: &[],
            summaries: &[(1, b"{}")],
            remove_summaries: &[],
            branches: &[],
            response_ids: &[],
        },
    );
    assert!(matches!(stale, Err(StoreError::Stale)));
    let loaded = engine.load(&k).unwrap();
    assert_eq!(loaded.version, v2);
    assert_eq!(loaded.meta.as_ref().unwrap().next_turn, 4);
    assert_eq!(
        loaded.entries.iter().map(|e| e.turn).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert!(engine.summaries(&k, id).unwrap().is_empty());
    assert!(!engine.any_trace_of(b"lost").unwrap());
}

pub fn a_write_removes_adds_and_counts_atomically(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, v1) = create(engine, &k, 4);
    engine
        .write(
            &k,
            &v1,
            Write {
                meta: &meta(id, 6, 3),
                remove_turns: &[1, 2],
                add: &[message(5, "m5")],
                vectors: &[],
                summaries: &[(1, br#"{"n":1}"#)],
                remove_summaries: &[],
                branches: &[],
                response_ids: &[],
            },
        )
        .unwrap();
    let loaded = engine.load(&k).unwrap();
    let entries = &loaded.entries;
    assert_eq!(
        entries.iter().map(|e| e.turn).collect::<Vec<_>>(),
        [3, 4, 5]
    );
    assert_eq!(
        entries.iter().map(|e| e.cum_tokens).collect::<Vec<_>>(),
        [2, 4, 6]
    );
    assert_eq!(entries[0].fingerprint, 21);
    assert_eq!(entries[2].role, Role::User);
    assert_eq!(engine.summaries(&k, id).unwrap().len(), 1);
    assert!(!engine.any_trace_of(b"\"m1\"").unwrap());
}

pub fn reads_are_ordered(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, _) = create(engine, &k, 6);
    let asked = engine.messages(&k, id, &[5, 2, 3]).unwrap();
    assert_eq!(texts(&asked), ["m5", "m2", "m3"]);
    assert_eq!(asked[0].turn, 5);
    assert!(matches!(
        engine.messages(&k, id, &[2, 99]),
        Err(StoreError::Corrupt(_))
    ));
    assert_eq!(
        texts(&engine.range(&k, id, 2, 4).unwrap()),
        ["m2", "m3", "m4"]
    );
    assert_eq!(engine.range(&k, id, 0, u64::MAX).unwrap().len(), 6);
    assert!(engine.range(&k, id, 5, 4).unwrap().is_empty());
    // Another conversation's id reads nothing of this one.
    let d = key("t", "a", "d");
    let (other, _) = create(engine, &d, 1);
    assert_eq!(
        texts(&engine.range(&d, other, 0, u64::MAX).unwrap()),
        ["m1"]
    );
}

pub fn ids_are_never_reused(engine: &dyn Engine) {
    let a = engine.new_id().unwrap();
    let b = engine.new_id().unwrap();
    assert_ne!(a, b);
    let k = key("t", "a", "c");
    let (first, _) = create(engine, &k, 1);
    engine.delete(&k, None).unwrap().unwrap();
    let (second, _) = create(engine, &k, 1);
    assert_ne!(first, second);
}

pub fn summaries_are_fenced_by_the_conversation_id(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, _) = create(engine, &k, 2);
    assert!(engine.latest_summary(&k, id).unwrap().is_none());
    assert!(engine.put_summary(&k, id, 1, b"{\"n\":1}").unwrap());
    assert!(engine.put_summary(&k, id, 2, b"{\"n\":2}").unwrap());
    assert!(!engine.put_summary(&k, id + 1_000, 3, b"{}").unwrap());
    assert!(
        !engine
            .put_summary(&key("t", "a", "nothing"), id, 1, b"{}")
            .unwrap()
    );
    let all = engine.summaries(&k, id).unwrap();
    assert_eq!(
        all.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        [1, 2],
        "oldest first"
    );
    assert_eq!(
        engine.latest_summary(&k, id).unwrap().unwrap(),
        b"{\"n\":2}".to_vec()
    );
    engine.delete(&k, None).unwrap().unwrap();
    assert!(!engine.put_summary(&k, id, 3, b"{}").unwrap());
    assert!(engine.summaries(&k, id).unwrap().is_empty());
}

pub fn ttl_records_page_and_orphans_go(engine: &dyn Engine) {
    let record = |ms| TtlRecord {
        ttl_ms: Some(ms),
        set_ms: 5,
    };
    let stored = key("t", "a", "stored");
    create(engine, &stored, 1);
    engine.put_ttl(&stored, &record(10)).unwrap();
    for i in 0..5 {
        engine
            .put_ttl(&key("t", "a", &format!("orphan{i}")), &record(20))
            .unwrap();
    }
    assert_eq!(engine.ttl(&stored).unwrap(), Some(record(10)));
    engine.put_ttl(&stored, &record(11)).unwrap();
    assert_eq!(engine.ttl(&stored).unwrap(), Some(record(11)));
    let mut seen = Vec::new();
    let mut cursor: Option<Vec<u8>> = None;
    for _ in 0..10 {
        let (page, next) = engine.ttl_page(cursor.as_deref(), 2).unwrap();
        assert!(page.len() <= 2);
        seen.extend(page.into_iter().map(|(k, _)| k.conversation));
        match next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    seen.sort();
    assert_eq!(seen.len(), 6, "{seen:?}");
    assert!(!engine.drop_orphan_ttl(&stored).unwrap());
    assert!(engine.drop_orphan_ttl(&key("t", "a", "orphan0")).unwrap());
    assert!(!engine.drop_orphan_ttl(&key("t", "a", "orphan0")).unwrap());
    assert!(engine.ttl(&key("t", "a", "orphan0")).unwrap().is_none());
}

pub fn listing_filters_and_pages(engine: &dyn Engine) {
    for conversation in ["c1", "c2", "c3"] {
        create(engine, &key("t1", "a", conversation), 1);
    }
    create(engine, &key("t1", "b", "c1"), 1);
    create(engine, &key("t2", "a", "c1"), 1);
    let t1 = TenantId::from_token(Some("t1"));
    let scope = |agent| Scope {
        tenant: Some(&t1),
        agent,
    };
    let (all, next) = engine.list(scope(None), None, 100, 10_000).unwrap();
    assert_eq!(all.len(), 4);
    assert!(next.is_none());
    assert!(all.iter().all(|(k, _)| k.tenant == t1));
    let (agent_a, _) = engine.list(scope(Some("a")), None, 100, 10_000).unwrap();
    assert_eq!(agent_a.len(), 3);
    let (anyone, _) = engine.list(Scope::default(), None, 100, 10_000).unwrap();
    assert_eq!(anyone.len(), 5);
    // Pages of two, in key order, nothing seen twice.
    let mut seen = Vec::new();
    let mut cursor: Option<Vec<u8>> = None;
    loop {
        let (page, next) = engine
            .list(scope(Some("a")), cursor.as_deref(), 2, 10_000)
            .unwrap();
        assert!(page.len() <= 2);
        seen.extend(page.into_iter().map(|(k, _)| k.conversation));
        match next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, ["c1", "c2", "c3"]);
    // A page that looked at its most keys ends early, with a cursor to go on from.
    let (few, next) = engine.list(Scope::default(), None, 100, 2).unwrap();
    assert!(few.len() <= 2);
    assert!(next.is_some());
}

pub fn a_delete_leaves_nothing(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, _) = create(engine, &k, 3);
    assert!(engine.put_summary(&k, id, 1, b"{\"secret\":1}").unwrap());
    engine
        .put_ttl(
            &k,
            &TtlRecord {
                ttl_ms: None,
                set_ms: 1,
            },
        )
        .unwrap();
    let kept = key("t", "a", "kept");
    create(engine, &kept, 1);
    // Not idle since before 0: kept.
    assert!(engine.delete(&k, Some(0)).unwrap().is_none());
    let deleted = engine.delete(&k, None).unwrap().unwrap();
    assert_eq!((deleted.messages, deleted.summaries), (3, 1));
    assert!(engine.load(&k).unwrap().meta.is_none());
    assert!(engine.meta(&k).unwrap().is_none());
    assert!(engine.ttl(&k).unwrap().is_none());
    assert!(engine.range(&k, id, 0, u64::MAX).unwrap().is_empty());
    for needle in [&b"\"m2\""[..], b"secret", b"\0c\0"] {
        assert!(!engine.any_trace_of(needle).unwrap(), "{needle:?}");
    }
    assert!(engine.delete(&k, None).unwrap().is_none());
    assert!(engine.meta(&kept).unwrap().is_some());
    // Idle since before the cutoff: deleted.
    assert!(engine.delete(&kept, Some(i64::MAX)).unwrap().is_some());
}

/// The token ledger rides in the conversation's record: written with an exchange, read back by
/// `meta`, `load` and the listing, listed per tenant, and gone with a delete.
pub fn the_ledger_is_kept_in_the_record(engine: &dyn Engine) {
    let k = key("t", "a", "ledgered");
    let (id, version) = create(engine, &k, 1);
    let mut record = meta(id, 3, 2);
    record.tokens_forwarded = 40;
    record.ledger = crate::LedgerTotals {
        exchanges: 1,
        history_tokens: 100,
        cached_tokens: 32,
        background_tokens: 7,
    };
    engine
        .write(
            &k,
            &version,
            Write {
                meta: &record,
                remove_turns: &[],
                add: &[message(2, "reply")],
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: &[],
                response_ids: &[],
            },
        )
        .unwrap();
    let stored = engine.meta(&k).unwrap().unwrap();
    assert_eq!(
        (stored.tokens_forwarded, stored.ledger),
        (40, record.ledger)
    );
    assert_eq!(engine.load(&k).unwrap().meta.unwrap().ledger, record.ledger);
    let tenant = k.tenant.clone();
    let scope = Scope {
        tenant: Some(&tenant),
        agent: None,
    };
    let (page, _) = engine.list(scope, None, 10, 10_000).unwrap();
    let (_, listed) = page.iter().find(|(key, _)| *key == k).unwrap();
    assert_eq!(listed.ledger, record.ledger);
    engine.delete(&k, None).unwrap().unwrap();
    assert!(engine.meta(&k).unwrap().is_none());
}

/// Response ids named by a write are found for the conversation's tenant only, for as long as
/// the conversation lives with that id; forgetting or deleting takes them away.
pub fn response_ids_follow_their_conversation(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, version) = create(engine, &k, 1);
    let reply = message(2, "answer");
    let ids = ["resp_1".to_string(), "resp_2".to_string()];
    engine
        .write(
            &k,
            &version,
            Write {
                meta: &meta(id, 3, 2),
                remove_turns: &[],
                add: std::slice::from_ref(&reply),
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: &[],
                response_ids: &ids,
            },
        )
        .unwrap();
    let tenant = k.tenant.clone();
    let other = TenantId::from_token(Some("u"));
    assert_eq!(
        engine.response_conversation(&tenant, "resp_1").unwrap(),
        Some(k.clone())
    );
    assert_eq!(
        engine.response_conversation(&other, "resp_1").unwrap(),
        None
    );
    assert_eq!(
        engine.response_conversation(&tenant, "resp_9").unwrap(),
        None
    );
    // Another tenant cannot forget it either.
    assert!(!engine.forget_response(&other, "resp_1").unwrap());
    assert!(engine.forget_response(&tenant, "resp_1").unwrap());
    assert!(!engine.forget_response(&tenant, "resp_1").unwrap());
    assert_eq!(
        engine.response_conversation(&tenant, "resp_1").unwrap(),
        None
    );
    assert!(engine.delete(&k, None).unwrap().is_some());
    assert_eq!(
        engine.response_conversation(&tenant, "resp_2").unwrap(),
        None
    );
    assert!(!engine.any_trace_of(b"resp_2").unwrap());
    // The same conversation key started again is a new life: the old ids stay gone.
    create(engine, &k, 1);
    assert_eq!(
        engine.response_conversation(&tenant, "resp_2").unwrap(),
        None
    );
}

/// A closed branch numbered `number` that forked after `forked_after_turn`, holding `turns`.
fn branch(number: u64, forked_after_turn: u64, turns: &[u64], text: &str) -> StoredBranch {
    StoredBranch {
        record: BranchRecord {
            number,
            forked_after_turn,
            closed_ms: 2_000,
        },
        messages: turns
            .iter()
            .map(|&t| message(t, &format!("{text}{t}")))
            .collect(),
        summaries: Vec::new(),
    }
}

pub fn a_branch_closes_with_its_write(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, v1) = create(engine, &k, 6);
    let v2 = engine
        .write(
            &k,
            &v1,
            Write {
                meta: &meta(id, 7, 6),
                remove_turns: &[],
                add: &[],
                vectors: &[],
                summaries: &[(1, br#"{"to_turn":2}"#), (2, br#"{"to_turn":5}"#)],
                remove_summaries: &[],
                branches: &[],
                response_ids: &[],
            },
        )
        .unwrap();
    assert!(engine.branches(&k, id).unwrap().is_empty());
    // Turns 4-6 and the summary that reached them leave the main line as branch 1, in the
    // same write as the new turn 7.
    let mut closed = branch(1, 3, &[], "");
    closed.messages = engine.messages(&k, id, &[4, 5, 6]).unwrap();
    closed.summaries = vec![(2, br#"{"to_turn":5}"#.to_vec())];
    let v3 = engine
        .write(
            &k,
            &v2,
            Write {
                meta: &meta(id, 8, 4),
                remove_turns: &[4, 5, 6],
                add: &[message(7, "m7")],
                vectors: &[],
                summaries: &[],
                remove_summaries: &[2],
                branches: std::slice::from_ref(&closed),
                response_ids: &[],
            },
        )
        .unwrap();
    the_first_branch_left_the_main_line(engine, &k, id, &closed);
    a_stale_write_closes_nothing(engine, &k, id, &v2);
    a_second_branch_follows_the_first(engine, &k, id, &v3);
    // Another conversation has none.
    let (other, _) = create(engine, &key("t", "a", "d"), 2);
    assert!(
        engine
            .branches(&key("t", "a", "d"), other)
            .unwrap()
            .is_empty()
    );
}

/// After `a_branch_closes_with_its_write` closed turns 4-6 of `k` as `closed`.
fn the_first_branch_left_the_main_line(
    engine: &dyn Engine,
    k: &ConversationKey,
    id: u64,
    closed: &StoredBranch,
) {
    // The main line reads as if the branch were never there.
    let loaded = engine.load(k).unwrap();
    assert_eq!(
        loaded.entries.iter().map(|e| e.turn).collect::<Vec<_>>(),
        [1, 2, 3, 7]
    );
    assert_eq!(
        texts(&engine.range(k, id, 0, u64::MAX).unwrap()),
        ["m1", "m2", "m3", "m7"]
    );
    assert!(matches!(
        engine.messages(k, id, &[5]),
        Err(StoreError::Corrupt(_))
    ));
    assert_eq!(
        engine
            .summaries(k, id)
            .unwrap()
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>(),
        [1]
    );
    assert_eq!(
        engine.latest_summary(k, id).unwrap().unwrap(),
        br#"{"to_turn":2}"#.to_vec()
    );
    // The branch holds them, as they were stored.
    let branches = engine.branches(k, id).unwrap();
    assert_eq!(branches.len(), 1);
    assert_eq!(branches[0].record, closed.record);
    assert_eq!(texts(&branches[0].messages), ["m4", "m5", "m6"]);
    assert_eq!(
        branches[0]
            .messages
            .iter()
            .map(|m| (m.turn, m.fingerprint))
            .collect::<Vec<_>>(),
        [(4, 28), (5, 35), (6, 42)]
    );
    assert_eq!(branches[0].summaries, closed.summaries);
}

/// A write against `v2`, a version the first branch's write moved past.
fn a_stale_write_closes_nothing(engine: &dyn Engine, k: &ConversationKey, id: u64, v2: &Version) {
    let stale = engine.write(
        k,
        v2,
        Write {
            meta: &meta(id, 9, 2),
            remove_turns: &[2, 3],
            add: &[],
            vectors: &[],
            summaries: &[],
            remove_summaries: &[1],
            branches: &[branch(2, 1, &[2, 3], "lost")],
            response_ids: &[],
        },
    );
    assert!(matches!(stale, Err(StoreError::Stale)));
    assert_eq!(engine.branches(k, id).unwrap().len(), 1);
    assert_eq!(engine.summaries(k, id).unwrap().len(), 1);
    assert!(!engine.any_trace_of(b"lost").unwrap());
}

/// A second branch, numbered after the first; branches come oldest first, each with only its
/// own messages.
fn a_second_branch_follows_the_first(
    engine: &dyn Engine,
    k: &ConversationKey,
    id: u64,
    v3: &Version,
) {
    let mut second = branch(2, 3, &[], "");
    second.messages = engine.messages(k, id, &[7]).unwrap();
    engine
        .write(
            k,
            v3,
            Write {
                meta: &meta(id, 9, 4),
                remove_turns: &[7],
                add: &[message(8, "m8")],
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: std::slice::from_ref(&second),
                response_ids: &[],
            },
        )
        .unwrap();
    let branches = engine.branches(k, id).unwrap();
    assert_eq!(
        branches.iter().map(|b| b.record.number).collect::<Vec<_>>(),
        [1, 2]
    );
    assert_eq!(texts(&branches[0].messages), ["m4", "m5", "m6"]);
    assert_eq!(texts(&branches[1].messages), ["m7"]);
    assert!(branches[1].summaries.is_empty());
}

pub fn a_delete_leaves_no_branch(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, v1) = create(engine, &k, 2);
    let mut closed = branch(1, 1, &[], "");
    closed.messages = vec![message(2, "branch-secret")];
    closed.summaries = vec![(1, b"{\"summary-secret\":1}".to_vec())];
    engine
        .write(
            &k,
            &v1,
            Write {
                meta: &meta(id, 4, 2),
                remove_turns: &[2],
                add: &[message(3, "m3")],
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: &[closed],
                response_ids: &[],
            },
        )
        .unwrap();
    let kept = key("t", "a", "kept");
    let (kept_id, kept_version) = create(engine, &kept, 2);
    engine
        .write(
            &kept,
            &kept_version,
            Write {
                meta: &meta(kept_id, 3, 1),
                remove_turns: &[2],
                add: &[],
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: &[branch(1, 1, &[2], "kept-branch")],
                response_ids: &[],
            },
        )
        .unwrap();
    let deleted = engine.delete(&k, None).unwrap().unwrap();
    assert_eq!((deleted.messages, deleted.branches), (2, 1));
    assert!(engine.branches(&k, id).unwrap().is_empty());
    for needle in [&b"branch-secret"[..], b"summary-secret"] {
        assert!(!engine.any_trace_of(needle).unwrap(), "{needle:?}");
    }
    // Another conversation's branch is not touched.
    assert_eq!(engine.branches(&kept, kept_id).unwrap().len(), 1);
}

pub fn flush_and_readiness(engine: &dyn Engine) {
    create(engine, &key("t", "a", "c"), 2);
    engine.flush().unwrap();
    assert!(engine.is_ready());
    assert!(!engine.name().is_empty());
}

pub fn a_reopen_keeps_what_was_flushed(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, version) = create(engine, &k, 2);
    engine.flush().unwrap();
    engine.reopen().unwrap();
    let loaded = engine.load(&k).unwrap();
    assert_eq!(loaded.version, version);
    assert_eq!(loaded.entries.len(), 2);
    assert_eq!(engine.range(&k, id, 0, u64::MAX).unwrap().len(), 2);
    // It writes on, and never hands out an id again.
    let (other, _) = create(engine, &key("t", "a", "d"), 1);
    assert!(other > id);
    assert!(engine.is_ready());
}

fn record(space: u8, id: &[u8], value: &str) -> OwnerRecord {
    OwnerRecord {
        space,
        id: id.to_vec(),
        value: value.as_bytes().to_vec(),
    }
}

pub fn owners_are_created_once_and_fence_their_writes(engine: &dyn Engine) {
    let tenant = TenantId::from_token(Some("t"));
    let user = OwnerKey::user(&tenant, "bob");
    assert_eq!(engine.owner(&user).unwrap(), None);
    let id = engine.new_id().unwrap();
    let meta = OwnerMeta { id, created_ms: 5 };
    assert_eq!(engine.create_owner(&user, meta).unwrap(), meta);
    // A second creation keeps the first record.
    let other = OwnerMeta {
        id: engine.new_id().unwrap(),
        created_ms: 6,
    };
    assert_eq!(engine.create_owner(&user, other).unwrap(), meta);
    assert_eq!(engine.owner(&user).unwrap(), Some(meta));
    assert!(
        engine
            .write_owner(
                &user,
                id,
                &[record(1, b"a", "one"), record(2, b"a", "two")],
                &[]
            )
            .unwrap()
    );
    // A writer holding another id writes nothing.
    assert!(
        !engine
            .write_owner(&user, other.id, &[record(1, b"b", "stale")], &[])
            .unwrap()
    );
    assert_eq!(engine.owner_record(&user, 1, b"b").unwrap(), None);
    assert_eq!(
        engine.owner_record(&user, 2, b"a").unwrap().as_deref(),
        Some(b"two".as_slice())
    );
    // Puts and removes in one write.
    assert!(
        engine
            .write_owner(
                &user,
                id,
                &[record(1, b"c", "three")],
                &[(1, b"a".to_vec())]
            )
            .unwrap()
    );
    assert_eq!(engine.owner_record(&user, 1, b"a").unwrap(), None);
    // Another owner of the tenant, and the same name in another tenant, see nothing of it.
    for stranger in [
        OwnerKey::user(&tenant, "bo"),
        OwnerKey::user(&TenantId::from_token(Some("u")), "bob"),
        OwnerKey::agent(&tenant, "bob"),
    ] {
        assert_eq!(engine.owner(&stranger).unwrap(), None);
        assert!(
            engine
                .owner_records(&stranger, 1, None, 10)
                .unwrap()
                .0
                .is_empty()
        );
        assert!(
            !engine
                .write_owner(&stranger, id, &[record(1, b"x", "x")], &[])
                .unwrap()
        );
    }
}

pub fn owner_records_page_in_id_order(engine: &dyn Engine) {
    let tenant = TenantId::from_token(Some("t"));
    let user = OwnerKey::user(&tenant, "ann");
    let id = engine.new_id().unwrap();
    engine
        .create_owner(&user, OwnerMeta { id, created_ms: 0 })
        .unwrap();
    let put: Vec<OwnerRecord> = (0u64..7)
        .rev()
        .map(|n| record(3, &n.to_be_bytes(), &format!("v{n}")))
        .collect();
    assert!(engine.write_owner(&user, id, &put, &[]).unwrap());
    engine
        .write_owner(&user, id, &[record(4, b"zz", "other space")], &[])
        .unwrap();
    let mut seen = Vec::new();
    let mut after: Option<Vec<u8>> = None;
    loop {
        let (page, next) = engine.owner_records(&user, 3, after.as_deref(), 3).unwrap();
        assert!(page.len() <= 3);
        seen.extend(
            page.into_iter()
                .map(|r| (r.space, String::from_utf8(r.value).unwrap())),
        );
        match next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let expected: Vec<(u8, String)> = (0..7).map(|n| (3, format!("v{n}"))).collect();
    assert_eq!(seen, expected);
}

pub fn an_owner_delete_leaves_nothing(engine: &dyn Engine) {
    let tenant = TenantId::from_token(Some("t"));
    let owners = [
        OwnerKey::user(&tenant, "gone"),
        OwnerKey::user(&tenant, "kept"),
        OwnerKey::agent(&tenant, "support"),
        OwnerKey::tenant(&tenant),
    ];
    let mut ids = Vec::new();
    for owner in &owners {
        let id = engine.new_id().unwrap();
        engine
            .create_owner(owner, OwnerMeta { id, created_ms: 0 })
            .unwrap();
        let secret = format!("secret-of-{}-{:?}", owner.name, owner.kind);
        engine
            .write_owner(
                owner,
                id,
                &[record(1, b"r", &secret), record(2, b"s", &secret)],
                &[],
            )
            .unwrap();
        ids.push(id);
    }
    let mut listed = Vec::new();
    let mut after: Option<Vec<u8>> = None;
    loop {
        let (page, next) = engine.owners(after.as_deref(), 2).unwrap();
        listed.extend(page.into_iter().map(|(owner, meta)| (owner, meta.id)));
        match next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(listed.len(), 4);
    assert!(
        listed
            .windows(2)
            .all(|w| w[0].0.to_bytes() < w[1].0.to_bytes())
    );

    assert_eq!(engine.delete_owner(&owners[0]).unwrap(), Some(ids[0]));
    assert_eq!(engine.delete_owner(&owners[0]).unwrap(), None);
    assert_eq!(engine.owner(&owners[0]).unwrap(), None);
    assert!(
        engine
            .owner_records(&owners[0], 1, None, 10)
            .unwrap()
            .0
            .is_empty()
    );
    assert!(
        !engine
            .write_owner(&owners[0], ids[0], &[record(1, b"late", "late")], &[])
            .unwrap()
    );
    assert!(!engine.any_trace_of(b"secret-of-gone").unwrap());
    assert!(!engine.any_trace_of(b"late").unwrap());
    assert!(engine.any_trace_of(b"secret-of-kept").unwrap());
    assert!(engine.owner_record(&owners[1], 2, b"s").unwrap().is_some());
    assert!(engine.owner(&owners[2]).unwrap().is_some());
    assert!(engine.owner(&owners[3]).unwrap().is_some());
}

/// The vectors of conversation `id`, as (turn, text of the value).
fn vector_texts(engine: &dyn Engine, k: &ConversationKey, id: u64) -> Vec<(u64, String)> {
    engine
        .vectors(k, id)
        .unwrap()
        .into_iter()
        .map(|(turn, value)| (turn, String::from_utf8(value).unwrap()))
        .collect()
}

fn values(turns: &[u64], text: &str) -> Vec<(u64, Vec<u8>)> {
    turns
        .iter()
        .map(|&t| (t, format!("{text}{t}").into_bytes()))
        .collect()
}

pub fn vectors_are_kept_for_stored_turns_only_and_read_by_turn(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, version) = create(engine, &k, 4);
    assert_eq!(engine.vector_count().unwrap(), 0);
    // Turn 9 is not stored: not written, not counted.
    assert_eq!(
        engine
            .put_vectors(&k, id, &values(&[3, 1, 9], "a"))
            .unwrap(),
        Some(2)
    );
    assert_eq!(
        vector_texts(engine, &k, id),
        [(1, "a1".to_string()), (3, "a3".to_string())]
    );
    // A turn's vector is replaced; a put does not change the conversation's version.
    assert_eq!(
        engine.put_vectors(&k, id, &values(&[1, 2], "b")).unwrap(),
        Some(2)
    );
    assert_eq!(
        vector_texts(engine, &k, id),
        [(1, "b1".into()), (2, "b2".into()), (3, "a3".into())]
    );
    assert_eq!(engine.load(&k).unwrap().version, version);
    assert_eq!(engine.vector_count().unwrap(), 3);
    // Another id (a writer that read another life of the conversation) writes nothing.
    assert_eq!(
        engine
            .put_vectors(&k, id + 1000, &values(&[4], "x"))
            .unwrap(),
        None
    );
    assert_eq!(
        engine
            .put_vectors(&key("t", "a", "none"), id, &values(&[4], "x"))
            .unwrap(),
        None
    );
    // Another conversation's vectors are its own.
    let d = key("t", "a", "d");
    let (other, _) = create(engine, &d, 1);
    assert_eq!(
        engine.put_vectors(&d, other, &values(&[1], "d")).unwrap(),
        Some(1)
    );
    assert_eq!(vector_texts(engine, &d, other), [(1, "d1".into())]);
    assert_eq!(vector_texts(engine, &k, id).len(), 3);
    assert_eq!(engine.vector_count().unwrap(), 4);
    // Keys name ids and turns only: nothing of the conversation's key is in them.
    assert!(!engine.any_trace_of(b"x4").unwrap());
}

pub fn a_write_removes_the_vectors_of_the_turns_it_removes(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, v1) = create(engine, &k, 6);
    engine
        .put_vectors(&k, id, &values(&[1, 2, 3, 4, 5, 6], "v"))
        .unwrap();
    // Trimmed rounds (1, 2) and a replaced reply (6, written again as 7).
    let v2 = engine
        .write(
            &k,
            &v1,
            Write {
                meta: &meta(id, 8, 4),
                remove_turns: &[1, 2, 6],
                add: &[message(7, "m7")],
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: &[],
                response_ids: &[],
            },
        )
        .unwrap();
    assert_eq!(
        vector_texts(engine, &k, id),
        [(3, "v3".into()), (4, "v4".into()), (5, "v5".into())]
    );
    // A branch closed from turn 4 takes 4, 5 and 7 off the main line: their vectors go.
    engine.put_vectors(&k, id, &values(&[7], "v")).unwrap();
    let v3 = engine
        .write(
            &k,
            &v2,
            Write {
                meta: &meta(id, 9, 2),
                remove_turns: &[4, 5, 7],
                add: &[message(8, "m8")],
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: &[branch(1, 3, &[4, 5, 7], "branch")],
                response_ids: &[],
            },
        )
        .unwrap();
    assert_eq!(vector_texts(engine, &k, id), [(3, "v3".into())]);
    assert_eq!(engine.vector_count().unwrap(), 1);
    // A branch's turns are not the main line's: no vector is written for them.
    assert_eq!(
        engine.put_vectors(&k, id, &values(&[4, 8], "w")).unwrap(),
        Some(1)
    );
    // A stale write removes nothing.
    let stale = engine.write(
        &k,
        &v2,
        Write {
            meta: &meta(id, 9, 1),
            remove_turns: &[3],
            add: &[],
            vectors: &[],
            summaries: &[],
            remove_summaries: &[],
            branches: &[],
            response_ids: &[],
        },
    );
    assert!(matches!(stale, Err(StoreError::Stale)));
    assert_eq!(
        vector_texts(engine, &k, id),
        [(3, "v3".into()), (8, "w8".into())]
    );
    // A turn written again (an engine writes what it is given) loses the vector it had.
    engine
        .write(
            &k,
            &v3,
            Write {
                meta: &meta(id, 9, 2),
                remove_turns: &[],
                add: &[message(8, "m8 again")],
                vectors: &[],
                summaries: &[],
                remove_summaries: &[],
                branches: &[],
                response_ids: &[],
            },
        )
        .unwrap();
    assert_eq!(vector_texts(engine, &k, id), [(3, "v3".into())]);
}

pub fn vectors_given_with_a_write_are_written_with_its_messages(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, v1) = create(engine, &k, 2);
    fn write<'a>(
        meta: &'a ConversationMeta,
        remove_turns: &'a [u64],
        add: &'a [StoredMessage],
        vectors: &'a [(u64, Vec<u8>)],
    ) -> Write<'a> {
        Write {
            meta,
            remove_turns,
            add,
            vectors,
            summaries: &[],
            remove_summaries: &[],
            branches: &[],
            response_ids: &[],
        }
    }
    // An exchange appended with the vector of its reply (its question has none).
    let (m3, m4) = (message(3, "m3"), message(4, "m4"));
    let v2 = engine
        .write(
            &k,
            &v1,
            write(&meta(id, 5, 4), &[], &[m3, m4], &values(&[4], "e")),
        )
        .unwrap();
    assert_eq!(vector_texts(engine, &k, id), [(4, "e4".into())]);
    assert_eq!(engine.vector_count().unwrap(), 1);
    // A stale write's vectors are not written, nor left behind.
    let stale = engine.write(
        &k,
        &v1,
        write(
            &meta(id, 6, 5),
            &[],
            &[message(5, "m5")],
            &values(&[5], "s"),
        ),
    );
    assert!(matches!(stale, Err(StoreError::Stale)));
    assert_eq!(vector_texts(engine, &k, id), [(4, "e4".into())]);
    assert_eq!(engine.vector_count().unwrap(), 1);
    // A turn written again, with a trim in the same write, takes the vector given with it.
    engine
        .write(
            &k,
            &v2,
            write(
                &meta(id, 5, 3),
                &[1],
                &[message(4, "m4 again")],
                &values(&[4], "f"),
            ),
        )
        .unwrap();
    assert_eq!(vector_texts(engine, &k, id), [(4, "f4".into())]);
    assert_eq!(engine.vector_count().unwrap(), 1);
}

pub fn a_delete_removes_every_vector_of_the_conversation(engine: &dyn Engine) {
    let k = key("t", "a", "c");
    let (id, _) = create(engine, &k, 3);
    engine
        .put_vectors(&k, id, &values(&[1, 2, 3], "v"))
        .unwrap();
    let idle = key("t", "a", "idle");
    let (idle_id, _) = create(engine, &idle, 2);
    engine
        .put_vectors(&idle, idle_id, &values(&[1, 2], "i"))
        .unwrap();
    let kept = key("t", "a", "kept");
    let (kept_id, _) = create(engine, &kept, 1);
    engine
        .put_vectors(&kept, kept_id, &values(&[1], "k"))
        .unwrap();
    assert_eq!(engine.vector_count().unwrap(), 6);

    engine.delete(&k, None).unwrap().unwrap();
    assert!(engine.vectors(&k, id).unwrap().is_empty());
    assert_eq!(engine.vector_count().unwrap(), 3);
    // The TTL sweeper's delete (idle since before the cutoff) too.
    engine.delete(&idle, Some(i64::MAX)).unwrap().unwrap();
    assert_eq!(engine.vector_count().unwrap(), 1);
    // A put finishing after the delete writes nothing, and the conversation started again
    // (a new id, the same turns) has none of the old life's.
    assert_eq!(
        engine.put_vectors(&k, id, &values(&[1], "late")).unwrap(),
        None
    );
    let (again, _) = create(engine, &k, 3);
    assert_ne!(again, id);
    assert!(engine.vectors(&k, again).unwrap().is_empty());
    assert_eq!(
        engine.put_vectors(&k, id, &values(&[1], "late")).unwrap(),
        None
    );
    assert_eq!(engine.vector_count().unwrap(), 1);
    assert_eq!(vector_texts(engine, &kept, kept_id), [(1, "k1".into())]);
}

pub fn owner_vectors_go_with_their_records_and_their_owner(engine: &dyn Engine) {
    let tenant = TenantId::from_token(Some("t"));
    let user = OwnerKey::user(&tenant, "ana");
    let kept = OwnerKey::user(&tenant, "bob");
    let mut ids = Vec::new();
    for owner in [&user, &kept] {
        let id = engine.new_id().unwrap();
        engine
            .create_owner(owner, OwnerMeta { id, created_ms: 0 })
            .unwrap();
        engine
            .write_owner(
                owner,
                id,
                &[
                    record(1, b"a", "x"),
                    record(3, b"m2", "y"),
                    record(3, b"m1", "z"),
                ],
                &[],
            )
            .unwrap();
        ids.push(id);
    }
    let put = |owner: &OwnerKey, id: u64, which: &[(u8, &[u8])]| {
        let vectors: Vec<(u8, Vec<u8>, Vec<u8>)> = which
            .iter()
            .map(|(space, rid)| (*space, rid.to_vec(), [&[*space][..], rid].concat()))
            .collect();
        engine.put_owner_vectors(owner, id, &vectors).unwrap()
    };
    // A record that is not stored (or in another space) gets no vector.
    assert_eq!(
        put(
            &user,
            ids[0],
            &[(3, b"m2"), (3, b"m1"), (1, b"a"), (3, b"a"), (3, b"gone")]
        ),
        Some(3)
    );
    put(&kept, ids[1], &[(3, b"m1")]);
    let memories = engine.owner_vectors(&user, 3).unwrap();
    assert_eq!(
        memories,
        [
            (b"m1".to_vec(), b"\x03m1".to_vec()),
            (b"m2".to_vec(), b"\x03m2".to_vec())
        ]
    );
    assert_eq!(engine.owner_vectors(&user, 1).unwrap().len(), 1);
    assert!(engine.owner_vectors(&user, 2).unwrap().is_empty());
    assert_eq!(engine.vector_count().unwrap(), 4);
    // A writer holding another id writes nothing.
    assert_eq!(put(&user, ids[1], &[(3, b"m1")]), None);
    // A record removed takes its vector; one rewritten keeps it (the writer re-embeds).
    assert!(
        engine
            .write_owner(
                &user,
                ids[0],
                &[record(3, b"m1", "z2")],
                &[(3, b"m2".to_vec())]
            )
            .unwrap()
    );
    assert_eq!(
        engine.owner_vectors(&user, 3).unwrap(),
        [(b"m1".to_vec(), b"\x03m1".to_vec())]
    );
    assert_eq!(engine.vector_count().unwrap(), 3);
    // The owner's delete takes them all; the other owner's stay.
    engine.delete_owner(&user).unwrap().unwrap();
    assert!(engine.owner_vectors(&user, 3).unwrap().is_empty());
    assert!(engine.owner_vectors(&user, 1).unwrap().is_empty());
    assert_eq!(put(&user, ids[0], &[(3, b"m1")]), None);
    assert_eq!(engine.vector_count().unwrap(), 1);
    assert_eq!(engine.owner_vectors(&kept, 3).unwrap().len(), 1);
}

/// Runs every contract test against the engine `$make()` returns (with a guard that keeps its
/// resources alive).
macro_rules! contract_tests {
    ($engine:ident, $make:expr) => {
        mod $engine {
            contract_tests!(@each $make;
                a_write_is_checked_against_the_version,
                a_write_removes_adds_and_counts_atomically,
                reads_are_ordered,
                ids_are_never_reused,
                summaries_are_fenced_by_the_conversation_id,
                ttl_records_page_and_orphans_go,
                listing_filters_and_pages,
                a_delete_leaves_nothing,
                a_branch_closes_with_its_write,
                a_delete_leaves_no_branch,
                flush_and_readiness,
                a_reopen_keeps_what_was_flushed,
                response_ids_follow_their_conversation,
                the_ledger_is_kept_in_the_record
            );
        }
    };
    // Owners' records (long-term memory): for the engines that keep them.
    (owners: $engine:ident, $make:expr) => {
        mod $engine {
            contract_tests!(@each $make;
                owners_are_created_once_and_fence_their_writes,
                owner_records_page_in_id_order,
                an_owner_delete_leaves_nothing
            );
        }
    };
    // Vectors of messages and of owners' records.
    (vectors: $engine:ident, $make:expr) => {
        mod $engine {
            contract_tests!(@each $make;
                vectors_are_kept_for_stored_turns_only_and_read_by_turn,
                a_write_removes_the_vectors_of_the_turns_it_removes,
                vectors_given_with_a_write_are_written_with_its_messages,
                a_delete_removes_every_vector_of_the_conversation,
                owner_vectors_go_with_their_records_and_their_owner
            );
        }
    };
    (@each $make:expr; $($test:ident),*) => {
        $(
            #[test]
            fn $test() {
                let (engine, _guard) = ($make)();
                super::$test(&*engine);
            }
        )*
    };
}

fn sled() -> (Box<dyn Engine>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let engine = super::SledEngine::open(dir.path(), 1 << 20, None).unwrap();
    let _ = Durability::Commit;
    (Box::new(engine), dir)
}

contract_tests!(sled_engine, super::sled);
contract_tests!(owners: sled_engine_owners, super::sled);
contract_tests!(vectors: sled_engine_vectors, super::sled);

fn fjall() -> (Box<dyn Engine>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let engine = super::FjallEngine::open(dir.path(), 1 << 20, None).unwrap();
    (Box::new(engine), dir)
}

contract_tests!(fjall_engine, super::fjall);
contract_tests!(owners: fjall_engine_owners, super::fjall);
contract_tests!(vectors: fjall_engine_vectors, super::fjall);

#[path = "../../../tests/support/redis_server.rs"]
pub(crate) mod redis_server;

/// A Redis engine on a redis-server of its own (killed with the guard).
pub(crate) fn redis() -> (Box<dyn Engine>, redis_server::RedisServer) {
    let server = redis_server::RedisServer::start();
    let engine = super::RedisEngine::open(&redis_options(&server.url())).unwrap();
    (Box::new(engine), server)
}

/// How the tests connect to a test server.
pub(crate) fn redis_options(url: &str) -> super::RedisOptions {
    super::RedisOptions {
        url: url.to_string(),
        password: None,
        key_prefix: "mp:".to_string(),
        pool_size: 4,
        connect_timeout: std::time::Duration::from_secs(2),
        command_timeout: std::time::Duration::from_secs(5),
        wait_replicas: 0,
        wait_timeout: std::time::Duration::from_secs(1),
    }
}

contract_tests!(redis_engine, super::redis);
contract_tests!(owners: redis_engine_owners, super::redis);
contract_tests!(vectors: redis_engine_vectors, super::redis);
