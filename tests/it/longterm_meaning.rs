//! Long-term memory by meaning (#24) through the real proxy and the static embedder
//! (`scripts/fetch-model.sh` puts the model where these tests find it): a fact said in one
//! conversation of a user is recalled in another by a question in other words; a paraphrased
//! memory is not stored twice; an edited memory gets a new vector, a refresh keeps it, a user
//! delete leaves none; `memproxy vectors rebuild` gives archived turns and memories their
//! vectors. The threshold of deduplication by meaning is checked on a set of paraphrases and
//! distinct facts.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use memproxy::longterm::archive::SPACE_ARCHIVE;
use memproxy::longterm::memories::{MEANING_DUPLICATE, SPACE_MEMORIES, cosine, names_differ};
use memproxy::store::{OwnerKey, Store};
use memproxy_embed::Embed;

use crate::longterm::{eventually, extraction_answer, memories_of, recalled};
use crate::recall_meaning::embedded;
use crate::support;
use crate::support::*;

/// The static embedder on, as `recall_meaning.rs` has it.
const STATIC: &str = "[embedding]\nembedder = \"static\"\n";

/// Memories said twice in other words (the second kept apart by text: another type, or too
/// few words in common), and pairs of distinct facts, some about the same thing.
const PARAPHRASES: [(&str, &str); 12] = [
    (
        "The user drives a silver Volvo",
        "The user's car is a silver Volvo",
    ),
    (
        "The user is allergic to peanuts",
        "The user has a peanut allergy",
    ),
    (
        "The user works as a nurse at a children's hospital",
        "The user is a nurse in a children's hospital",
    ),
    (
        "The user's sister Anna lives in Lisbon",
        "Anna, the user's sister, lives in Lisbon",
    ),
    (
        "The user is vegetarian",
        "The user does not eat meat and is a vegetarian",
    ),
    (
        "The user prefers answers in bullet points",
        "The user likes answers as bullet points",
    ),
    (
        "The user plays the cello in a community orchestra",
        "The user is a cellist in a community orchestra",
    ),
    (
        "The user's dog is a golden retriever named Biscuit",
        "Biscuit, the user's dog, is a golden retriever",
    ),
    (
        "The user is training for the Berlin marathon",
        "The user trains to run the Berlin marathon",
    ),
    (
        "The user supports Arsenal football club",
        "The user is an Arsenal football supporter",
    ),
    (
        "The user commutes to work by bicycle",
        "The user cycles to work every day",
    ),
    (
        "The user speaks fluent Japanese",
        "The user is fluent in Japanese",
    ),
];

const DISTINCT: [(&str, &str); 12] = [
    (
        "The user drives a silver Volvo",
        "The user drives a red Toyota",
    ),
    ("The user lives in Lisbon", "The user lives in Berlin"),
    (
        "The user is allergic to peanuts",
        "The user is allergic to cats",
    ),
    (
        "The user's sister Anna lives in Lisbon",
        "The user's brother Tom lives in Madrid",
    ),
    (
        "The user works as a nurse at a children's hospital",
        "The user works as a software engineer",
    ),
    (
        "The user prefers answers in bullet points",
        "The user prefers short answers",
    ),
    (
        "The user plays the cello in a community orchestra",
        "The user plays football on Sundays",
    ),
    (
        "The user's dog is a golden retriever named Biscuit",
        "The user's cat is called Pixel",
    ),
    (
        "The user is training for the Berlin marathon",
        "The user broke a wrist skiing last winter",
    ),
    (
        "The user supports Arsenal football club",
        "The user supports Chelsea football club",
    ),
    (
        "The user speaks fluent Japanese",
        "The user is learning Spanish",
    ),
    (
        "The user is vegetarian",
        "The user takes coffee black with no sugar",
    ),
];

/// The static embedder, loaded as the proxy loads it: the learned table beside the model
/// (`memproxy model learn`, which `scripts/test.sh` runs first).
fn static_embedder() -> Arc<dyn Embed> {
    let files = memproxy_embed::ModelFiles::locate(None).expect("scripts/fetch-model.sh");
    let path = memproxy_embed::learn::learned_path(&files);
    Arc::new(
        memproxy_embed::learn::load_learned(&files, &path)
            .expect("the learned static table: cargo run --bin memproxy -- model learn"),
    )
}

fn cosines(embedder: &dyn Embed, pairs: &[(&str, &str)]) -> Vec<f32> {
    pairs
        .iter()
        .map(|(a, b)| {
            let v = embedder.embed(&[a, b]).unwrap();
            cosine(&v[0], &v[1])
        })
        .collect()
}

#[test]
fn the_meaning_threshold_tells_paraphrased_memories_from_distinct_facts() {
    let embedder = static_embedder();
    let same = cosines(&*embedder, &PARAPHRASES);
    let distinct = cosines(&*embedder, &DISTINCT);
    let mut report = String::new();
    for ((a, b), c) in PARAPHRASES.iter().zip(&same) {
        report.push_str(&format!("same     {c:.3}  {a} | {b}\n"));
    }
    for ((a, b), c) in DISTINCT.iter().zip(&distinct) {
        report.push_str(&format!("distinct {c:.3}  {a} | {b}\n"));
    }
    eprintln!("{report}");
    let merges = |pairs: &[(&str, &str)], cosines: &[f32]| {
        pairs
            .iter()
            .zip(cosines)
            .filter(|((a, b), c)| **c >= MEANING_DUPLICATE && !names_differ(a, b))
            .count()
    };
    let caught = merges(&PARAPHRASES, &same);
    let merged = merges(&DISTINCT, &distinct);
    // The names keep apart the pairs whose vectors alone would merge them.
    assert!(
        names_differ(DISTINCT[9].0, DISTINCT[9].1),
        "{:?}",
        DISTINCT[9]
    );
    assert!(PARAPHRASES.iter().all(|(a, b)| !names_differ(a, b)));
    eprintln!(
        "threshold {MEANING_DUPLICATE}: {caught}/{} paraphrases caught, {merged}/{} distinct pairs merged",
        same.len(),
        distinct.len()
    );
    assert!(caught >= 8, "{report}");
    assert_eq!(merged, 0, "{report}");
}

/// User `ana` of the test tenant.
fn ana() -> OwnerKey {
    OwnerKey::user(&key(Some(TOKEN), "x").tenant, "ana")
}

/// Ana's vectors of record space `records`.
fn vectors_of(store: &Store, records: u8) -> Vec<(Vec<u8>, Vec<f32>)> {
    let space = memproxy_embed::learn::learned_id();
    match store.owner(&ana(), false).unwrap() {
        Some(handle) => store.owner_vectors(&handle, records, &space).unwrap(),
        None => Vec::new(),
    }
}

async fn say(proxy: &Proxy, conversation: &str, text: &str, extra: &[(&str, &str)]) {
    let mut headers = vec![("x-memory-user-id", "ana")];
    headers.extend_from_slice(extra);
    let answer = chat(proxy, conversation, &body(&[support::user(text)]), &headers).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
}

#[tokio::test]
async fn a_fact_from_another_conversation_is_recalled_by_a_question_in_other_words() {
    let Started { mock, proxy, .. } = Harness::new().admin().config(STATIC).start().await;
    let facts = [
        ("cars", "I drive a silver Volvo."),
        ("family", "My sister Anna lives in Lisbon."),
        ("food", "I'm allergic to peanuts."),
        ("music", "I play the cello in a community orchestra."),
        ("pets", "Our dog is a golden retriever named Biscuit."),
    ];
    for (conversation, fact) in facts {
        say(&proxy, conversation, fact, &[]).await;
    }
    embedded(&proxy).await;
    let archived = vectors_of(proxy.store(), SPACE_ARCHIVE).len();
    assert_eq!(archived, 10, "every archived turn has its vector");

    let question = "What kind of automobile do I own?";
    let ask = [
        ("x-memory-persist", "false"),
        ("x-memory-relevance-top-k", "2"),
    ];
    let mut words_only = ask.to_vec();
    words_only.push(("x-memory-relevance-semantic", "false"));
    say(&proxy, "new-chat", question, &words_only).await;
    assert!(!recalled(&mock).contains("Volvo"), "{}", recalled(&mock));
    say(&proxy, "new-chat", question, &ask).await;
    let message = recalled(&mock);
    assert!(message.contains("Volvo"), "{message}");
    assert!(
        message.contains("[earlier conversation cars, turn #"),
        "{message}"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_paraphrased_memory_is_not_stored_twice_and_a_distinct_one_is_added() {
    let Started { mock, proxy, .. } = Harness::new().admin().config(STATIC).start().await;
    let extra = [("x-memory-extraction-every", "1")];
    mock.push_extraction(extraction_answer(serde_json::json!([
        {"text": "The user is training for the Berlin marathon", "type": "profile", "scope": "private",
         "importance": 0.6, "confidence": 0.9, "tags": [], "source_turns": [1], "supersedes": []}
    ])));
    say(&proxy, "a", "I'm training for the Berlin marathon", &extra).await;
    let store = proxy.store();
    eventually("the first extraction", || {
        memories_of(&proxy, "ana").len() == 1
    })
    .await;
    assert_eq!(vectors_of(store, SPACE_MEMORIES).len(), 1);
    // In other words (and of another type: by text alone it would be a second memory), with
    // a distinct fact beside it.
    mock.push_extraction(extraction_answer(serde_json::json!([
        {"text": "The user trains to run the Berlin marathon", "type": "semantic", "scope": "private",
         "importance": 0.9, "confidence": 0.95, "tags": [], "source_turns": [3], "supersedes": []},
        {"text": "The user is allergic to peanuts", "type": "profile", "scope": "private",
         "importance": 0.8, "confidence": 0.9, "tags": [], "source_turns": [3], "supersedes": []}
    ])));
    say(
        &proxy,
        "a",
        "Still running every morning; and no peanuts for me",
        &extra,
    )
    .await;
    let counters = &proxy.state.memory().unwrap().longterm.extractor.counters;
    eventually("the second extraction", || {
        counters.done.load(Ordering::Relaxed) == 2
    })
    .await;
    let all = memories_of(&proxy, "ana");
    assert_eq!(all.len(), 2, "{all:?}");
    assert_eq!(counters.ignored.load(Ordering::Relaxed), 1);
    assert_eq!(counters.updated.load(Ordering::Relaxed), 0);
    let marathon = all.iter().find(|m| m.text.contains("marathon")).unwrap();
    assert_eq!(
        marathon.text,
        "The user is training for the Berlin marathon"
    );
    assert_eq!(marathon.importance, 0.9, "its scores were raised");
    assert_eq!(vectors_of(store, SPACE_MEMORIES).len(), 2);
    proxy.stop().await;
}

#[tokio::test]
async fn an_edited_memory_is_re_embedded_a_refresh_keeps_its_vector_and_a_user_delete_leaves_none()
{
    use crate::support::admin::{admin, tenant};
    let Started { proxy, .. } = Harness::new().admin().config(STATIC).start().await;
    say(&proxy, "a", "Hello there", &[]).await;
    let base = format!("/admin/v1/users/{}/ana", tenant(TOKEN));
    let created = admin(
        &proxy,
        "POST",
        &format!("{base}/memories"),
        r#"{"text": "The user drives a silver Volvo", "type": "profile"}"#,
    )
    .await;
    assert_eq!(created.status, 200, "{:?}", created.body);
    let id = created.json()["id"].as_u64().unwrap();
    embedded(&proxy).await;
    let store = proxy.store();
    let before = vectors_of(store, SPACE_MEMORIES);
    assert_eq!(before.len(), 1);

    // Another text: another vector.
    let corrected = admin(
        &proxy,
        "PATCH",
        &format!("{base}/memories/{id}"),
        r#"{"text": "The user plays the cello in an orchestra"}"#,
    )
    .await;
    assert_eq!(corrected.status, 200, "{:?}", corrected.body);
    embedded(&proxy).await;
    let after = vectors_of(store, SPACE_MEMORIES);
    assert_eq!(after.len(), 1);
    assert!(
        cosine(&before[0].1, &after[0].1) < 0.9,
        "the vector changed"
    );
    let embedder = proxy
        .state
        .memory()
        .unwrap()
        .embedding
        .embedder()
        .unwrap()
        .clone();
    let made = embedder
        .embed(&["The user plays the cello in an orchestra"])
        .unwrap();
    assert!(cosine(&made[0], &after[0].1) > 0.99);

    // A change of importance only, and the memory used in a prompt (its last access
    // refreshed): the vector stays as it is.
    let scored = admin(
        &proxy,
        "PATCH",
        &format!("{base}/memories/{id}"),
        r#"{"importance": 0.9}"#,
    )
    .await;
    assert_eq!(scored.status, 200);
    let used = chat(
        &proxy,
        "b",
        &body(&[support::user("Which instrument do I play?")]),
        &[("x-memory-user-id", "ana")],
    )
    .await;
    assert_eq!(used.header("x-memory-memories"), "1");
    embedded(&proxy).await;
    assert_eq!(vectors_of(store, SPACE_MEMORIES), after);

    // The user deleted: no vector of hers is left.
    assert!(store.vector_count().unwrap() > 0);
    let deleted = admin(&proxy, "DELETE", &base, "").await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    embedded(&proxy).await;
    assert_eq!(store.vector_count().unwrap(), 0);
    proxy.stop().await;
}

#[tokio::test]
async fn a_rebuild_gives_archived_turns_and_memories_their_vectors() {
    use crate::support::admin::{admin, tenant};
    // Stored with no embedder: nothing has a vector.
    let Started { proxy, .. } = Harness::new().admin().start().await;
    say(&proxy, "a", "I drive a silver Volvo", &[]).await;
    say(&proxy, "b", "My sister Anna lives in Lisbon", &[]).await;
    let base = format!("/admin/v1/users/{}/ana", tenant(TOKEN));
    let created = admin(
        &proxy,
        "POST",
        &format!("{base}/memories"),
        r#"{"text": "The user is vegetarian", "type": "preference"}"#,
    )
    .await;
    assert_eq!(created.status, 200);
    let memory = proxy.state.memory().unwrap();
    let store = &memory.store;
    assert_eq!(store.vector_count().unwrap(), 0);

    let embedder = static_embedder();
    let records = &memproxy::longterm::VECTOR_RECORDS;
    let done = memproxy::embedding::rebuild(store, &memory.recall, &*embedder, records, |_, _| {})
        .unwrap();
    // The table's vectors of the conversations' messages are derived (made from their texts
    // when an index is built), never stored: the rebuild leaves the conversations alone.
    assert_eq!((done.conversations, done.vectors), (0, 0), "{done:?}");
    assert_eq!(store.vector_count().unwrap(), 5, "the records' only");
    assert_eq!(done.records, 5, "{done:?}");
    assert_eq!(done.records_present, 0, "{done:?}");
    let handle = store.owner(&ana(), false).unwrap().unwrap();
    for records in [SPACE_ARCHIVE, SPACE_MEMORIES] {
        assert!(
            store
                .owner_records_without_vectors(&handle, records, embedder.id())
                .unwrap()
                .is_empty()
        );
    }
    let memories = store
        .owner_vectors(&handle, SPACE_MEMORIES, embedder.id())
        .unwrap();
    let made = embedder.embed(&["The user is vegetarian"]).unwrap();
    assert!(cosine(&made[0], &memories[0].1) > 0.99);
    // Again: everything is there already.
    let again = memproxy::embedding::rebuild(store, &memory.recall, &*embedder, records, |_, _| {})
        .unwrap();
    assert_eq!((again.vectors, again.records), (0, 0));
    assert_eq!(again.records_present, 5);
    proxy.stop().await;
}
