//! Long-term memory through the real proxy (issue 13): what a user said in one conversation
//! is recalled in their next one, tagged with the conversation it came from; never for another
//! user of the tenant, nor for the same user id under another credential; a conversation
//! deleted by its TTL stays searchable and is rebuilt when asked for again; a request without
//! a user id behaves as before.

use std::time::Duration;

use memproxy::ttl::{Cursor, sweep_pass};

use crate::support;
use crate::support::mock_upstream::MockUpstream;
use crate::support::*;

const FACT: &str = "My favourite city is Lisbon and I am allergic to peanuts";
const QUESTION: &str = "Which city is my favourite, and what am I allergic to?";

/// The recalled-turns system message of the last forwarded prompt, if any.
pub(crate) fn recalled(mock: &MockUpstream) -> String {
    mock.last_messages()
        .iter()
        .filter(|m| m["role"] == "system")
        .filter_map(|m| m["content"].as_str())
        .find(|c| c.starts_with("[Earlier in this conversation"))
        .unwrap_or("")
        .to_string()
}

async fn say(
    proxy: &Proxy,
    token: &str,
    user: Option<&str>,
    conversation: &str,
    text: &str,
) -> Answer {
    let extra: Vec<(&str, &str)> = user.map(|u| ("x-memory-user-id", u)).into_iter().collect();
    let answer = chat_as(
        proxy,
        token,
        conversation,
        &body(&[support::user(text)]),
        &extra,
    )
    .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    answer
}

#[tokio::test]
async fn a_fact_from_one_conversation_is_recalled_in_the_users_next_one() {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().admin().start().await;

    say(&proxy, TOKEN, Some("ana"), "trip-planning", FACT).await;
    say(
        &proxy,
        TOKEN,
        Some("ana"),
        "trip-planning",
        "Thanks, that is all for today",
    )
    .await;

    // A fresh conversation of the same user: layer 1 brings the fact back at once.
    let answer = say(&proxy, TOKEN, Some("ana"), "new-chat", QUESTION).await;
    let message = recalled(&mock);
    assert!(message.contains(FACT), "{message}");
    assert!(
        message.contains("[earlier conversation trip-planning, turn #1 at "),
        "{message}"
    );
    assert_eq!(answer.header("x-memory-retrieved"), "0");
    assert_ne!(answer.header("x-memory-retrieved-elsewhere"), "");
    // Nothing recalled is stored as a turn of the new conversation.
    let stored = proxy.stored(Some(TOKEN), "new-chat");
    assert_eq!(stored.len(), 2);
    assert!(!stored[0].message.get().contains("Lisbon"));

    // Another user of the tenant, the same user under another credential, and a request
    // without a user id never see it.
    say(&proxy, TOKEN, Some("bob"), "bob-chat", QUESTION).await;
    assert!(!recalled(&mock).contains("Lisbon"));
    say(
        &proxy,
        "sk-other-tenant",
        Some("ana"),
        "other-tenant-chat",
        QUESTION,
    )
    .await;
    assert!(!recalled(&mock).contains("Lisbon"));
    say(&proxy, TOKEN, None, "anonymous-chat", QUESTION).await;
    assert!(!recalled(&mock).contains("Lisbon"));
    let plain = say(&proxy, TOKEN, None, "anonymous-chat-2", QUESTION).await;
    assert!(plain.headers.get("x-memory-retrieved-elsewhere").is_none());

    // Switched off per request, the user's other conversations are not searched.
    let off = chat_as(
        &proxy,
        TOKEN,
        "new-chat-2",
        &body(&[support::user(QUESTION)]),
        &[
            ("x-memory-user-id", "ana"),
            ("x-memory-long-term-enabled", "false"),
        ],
    )
    .await;
    assert_eq!(off.status, 200);
    assert!(!recalled(&mock).contains("Lisbon"));

    // The archive is readable through the store, and sealed on disk like conversations.
    let memory = proxy.state.memory().unwrap();
    assert!(memory.store.any_trace_of(b"Lisbon").unwrap());
    proxy.stop().await;
    for (path, bytes) in files(dir.path()) {
        assert!(!bytes.windows(6).any(|w| w == b"Lisbon"), "{path:?}");
    }
}

#[tokio::test]
async fn the_conversations_own_turns_and_other_conversations_share_the_slots() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    say(
        &proxy,
        TOKEN,
        Some("ana"),
        "old",
        "The garage door code is 7781",
    )
    .await;
    for i in 0..8 {
        say(
            &proxy,
            TOKEN,
            Some("ana"),
            "current",
            &format!("Filler note number {i} about gardening"),
        )
        .await;
    }
    let answer = chat_as(
        &proxy,
        TOKEN,
        "current",
        &body(&[support::user(
            "What is the garage door code again? Gardening aside.",
        )]),
        &[
            ("x-memory-user-id", "ana"),
            ("x-memory-recent-n", "2"),
            ("x-memory-relevance-top-k", "3"),
        ],
    )
    .await;
    assert_eq!(answer.status, 200);
    let message = recalled(&mock);
    assert!(message.contains("7781"), "{message}");
    let own: usize = answer.header("x-memory-retrieved").parse().unwrap();
    let elsewhere: usize = answer
        .header("x-memory-retrieved-elsewhere")
        .parse()
        .unwrap();
    assert_eq!(own + elsewhere, 3, "{message}");
    assert!(own >= 1 && elsewhere >= 1);
    // The other conversation's lines come first.
    let first_line = message.lines().nth(1).unwrap();
    assert!(
        first_line.starts_with("[earlier conversation old, turn #"),
        "{message}"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_conversation_deleted_by_its_ttl_stays_searchable_and_is_rebuilt() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let extra = [("x-memory-user-id", "ana"), ("x-memory-ttl", "PT1H")];
    for text in [FACT, "Book me a table for Friday"] {
        let answer = chat(&proxy, "short-lived", &body(&[support::user(text)]), &extra).await;
        assert_eq!(answer.status, 200);
    }
    let state = &proxy.state;
    let memory = state.memory().unwrap();
    memory.clock.advance(Duration::from_secs(2 * 3600));
    let pass = sweep_pass(memory, &state.config, &mut Cursor::default()).unwrap();
    assert_eq!(pass.deleted, 1);
    assert!(proxy.stored(Some(TOKEN), "short-lived").is_empty());

    // Still searchable from another conversation of the user.
    say(&proxy, TOKEN, Some("ana"), "later", QUESTION).await;
    assert!(recalled(&mock).contains("Lisbon"));

    // A new request on the deleted conversation's id finds it rebuilt.
    say(
        &proxy,
        TOKEN,
        Some("ana"),
        "short-lived",
        "And what did I book?",
    )
    .await;
    let stored = proxy.stored(Some(TOKEN), "short-lived");
    assert_eq!(
        stored.len(),
        6,
        "the four archived turns and the new exchange"
    );
    assert!(stored[0].message.get().contains("Lisbon"));
    assert_eq!(stored[0].turn, 1);
    let forwarded = mock.last_messages();
    assert!(
        forwarded
            .iter()
            .any(|m| m["content"].as_str().is_some_and(|c| c.contains("Friday"))),
        "{forwarded:?}"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_bad_user_id_is_a_400_naming_the_header() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    for (header, value) in [
        ("x-memory-user-id", "../etc/passwd"),
        ("x-memory-long-term-top-k", "many"),
        ("x-memory-memory-min-decay", "1.5"),
    ] {
        let answer = chat(
            &proxy,
            "c",
            &body(&[support::user("hi")]),
            &[(header, value)],
        )
        .await;
        assert_eq!(answer.status, 400);
        assert_eq!(answer.error_param(), header);
    }
    proxy.stop().await;
}

/// The memories stored for `user` (private scope) of the test tenant.
pub(crate) fn memories_of(
    proxy: &Proxy,
    user: &str,
) -> Vec<memproxy::longterm::memories::MemoryRecord> {
    let store = proxy.store();
    let owner = memproxy::store::OwnerKey::user(&key(Some(TOKEN), "x").tenant, user);
    match store.owner(&owner, false).unwrap() {
        Some(handle) => memproxy::longterm::memories::all(store, &handle).unwrap(),
        None => Vec::new(),
    }
}

/// Says `text` in conversation `a` with `extra` headers (user `ana`), then waits until she
/// has `memories` memories.
async fn tell_ana(proxy: &Proxy, text: &str, extra: &[(&str, &str)], memories: usize) {
    let answer = chat(proxy, "a", &body(&[support::user(text)]), extra).await;
    assert_eq!(answer.status, 200);
    eventually("the extraction", || {
        memories_of(proxy, "ana").len() == memories
    })
    .await;
}

/// Waits (bounded) until `done` holds.
pub(crate) async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..100 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

pub(crate) fn extraction_answer(memories: serde_json::Value) -> support::mock_upstream::Reply {
    support::mock_upstream::Reply::Text(serde_json::json!({ "memories": memories }).to_string())
}

#[tokio::test]
async fn extracted_memories_reach_the_next_conversation_and_a_move_supersedes_the_old_city() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let extra = [
        ("x-memory-user-id", "ana"),
        ("x-memory-extraction-every", "2"),
    ];
    let send = |conversation: &'static str, text: &'static str| {
        let proxy = &proxy;
        async move {
            let answer = chat(proxy, conversation, &body(&[support::user(text)]), &extra).await;
            assert_eq!(answer.status, 200);
            answer
        }
    };

    mock.push_extraction(extraction_answer(serde_json::json!([
        {"text": "The user lives in Lisbon", "type": "profile", "scope": "private",
         "importance": 0.9, "confidence": 0.95, "tags": ["home"], "source_turns": [1], "supersedes": []},
        {"text": "The user prefers answers in bullet points", "type": "preference", "scope": "private",
         "importance": 0.6, "confidence": 0.8, "tags": [], "source_turns": [3], "supersedes": []}
    ])));
    let first = send("a", "I live in Lisbon").await;
    assert!(first.headers.get("x-memory-memories").is_none());
    assert!(
        mock.extraction_requests().is_empty(),
        "one user message is not enough"
    );
    send("a", "Please answer in bullet points").await;
    eventually("the extraction", || memories_of(&proxy, "ana").len() == 2).await;
    let call = mock.extraction_requests().pop().unwrap().json();
    assert_eq!(call["response_format"]["type"], "json_schema");
    assert_eq!(
        call["response_format"]["json_schema"]["name"],
        "memproxy_memories"
    );
    let prompt = call["messages"][1]["content"].as_str().unwrap();
    assert!(
        prompt.contains("[turn #1] user: I live in Lisbon"),
        "{prompt}"
    );

    // A new conversation of the user: the memories come right after the instructions.
    let answer = chat(
        &proxy,
        "b",
        &body(&[
            serde_json::json!({"role": "system", "content": "You are a travel agent."}),
            support::user("Where do I live?"),
        ]),
        &[("x-memory-user-id", "ana")],
    )
    .await;
    assert_eq!(answer.header("x-memory-memories"), "2");
    let forwarded = mock.last_messages();
    let memories = forwarded[1]["content"].as_str().unwrap();
    assert!(
        memories.starts_with("[What you know about this user"),
        "{forwarded:?}"
    );
    assert!(memories.contains("The user lives in Lisbon"));
    // Another user, and the same user id under another credential, see none of it.
    let other = chat(
        &proxy,
        "c",
        &body(&[support::user("Where do I live?")]),
        &[("x-memory-user-id", "bob")],
    )
    .await;
    assert!(other.headers.get("x-memory-memories").is_none());
    let other_tenant = chat_as(
        &proxy,
        "sk-other",
        "c",
        &body(&[support::user("Where do I live?")]),
        &[("x-memory-user-id", "ana")],
    )
    .await;
    assert!(other_tenant.headers.get("x-memory-memories").is_none());
    assert!(
        !mock
            .last_messages()
            .iter()
            .any(|m| m.to_string().contains("Lisbon"))
    );

    // The move: the model names the memory it supersedes.
    let lisbon = memories_of(&proxy, "ana")
        .into_iter()
        .find(|m| m.text.contains("Lisbon"))
        .unwrap();
    mock.push_extraction(extraction_answer(serde_json::json!([
        {"text": "The user lives in Berlin", "type": "profile", "scope": "private",
         "importance": 0.9, "confidence": 0.95, "tags": ["home"], "source_turns": [5], "supersedes": [lisbon.id]}
    ])));
    send("a", "I moved from Lisbon to Berlin").await;
    send("a", "Thanks").await;
    eventually("the superseding extraction", || {
        memories_of(&proxy, "ana")
            .iter()
            .any(|m| m.text.contains("Berlin"))
    })
    .await;
    let all = memories_of(&proxy, "ana");
    let homes: Vec<_> = all
        .iter()
        .filter(|m| m.tags.contains(&"home".to_string()))
        .collect();
    assert_eq!(homes.len(), 1, "{all:?}");
    assert_eq!(homes[0].id, lisbon.id);
    assert_eq!(homes[0].version, 2);
    assert_eq!(homes[0].history[0].text, "The user lives in Lisbon");
    proxy.stop().await;
}

#[tokio::test]
async fn a_bad_or_failed_extraction_changes_nothing_and_chat_goes_on() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let extra = [
        ("x-memory-user-id", "ana"),
        ("x-memory-extraction-every", "1"),
    ];
    for _ in 0..3 {
        mock.push_extraction(support::mock_upstream::Reply::Text(
            "{\"memories\": \"nope\"}".into(),
        ));
    }
    let answer = chat(
        &proxy,
        "a",
        &body(&[support::user("I live in Lisbon")]),
        &extra,
    )
    .await;
    assert_eq!(answer.status, 200);
    let counters = &proxy.state.memory().unwrap().longterm.extractor.counters;
    eventually("three attempts", || {
        counters.failures.load(std::sync::atomic::Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(
        counters
            .bad_answers
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );
    assert!(memories_of(&proxy, "ana").is_empty());
    // The extraction model down: chat is untouched.
    for _ in 0..3 {
        mock.push_extraction(support::mock_upstream::Reply::Status(503, "{}".into()));
    }
    let answer = chat(&proxy, "a", &body(&[support::user("I like jazz")]), &extra).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-status"), "stored");
    proxy.stop().await;
}

#[tokio::test]
async fn memories_are_corrected_by_hand_and_a_user_delete_leaves_nothing() {
    use crate::support::admin::{admin, tenant};
    let Started {
        mock,
        dir,
        proxy,
        redis,
    } = Harness::new().admin().start().await;
    let extra = [
        ("x-memory-user-id", "ana"),
        ("x-memory-extraction-every", "1"),
    ];
    mock.push_extraction(extraction_answer(serde_json::json!([
        {"text": "The user lives in Lisbon", "type": "profile", "scope": "private",
         "importance": 0.9, "confidence": 0.95, "tags": [], "source_turns": [1], "supersedes": []}
    ])));
    tell_ana(&proxy, "I live in Lisbon, Rua Augusta", &extra, 1).await;
    let base = format!("/admin/v1/users/{}/ana", tenant(TOKEN));

    // Listed and searched through the API.
    let listed = admin(&proxy, "GET", &format!("{base}/memories"), "").await;
    assert_eq!(listed.status, 200);
    let id = listed.json()["memories"][0]["id"].as_u64().unwrap();
    let searched = admin(
        &proxy,
        "GET",
        &format!("{base}/memories?q=where+do+I+live"),
        "",
    )
    .await;
    assert!(searched.json()["memories"][0]["score"].as_f64().unwrap() > 0.0);

    // A wrong memory corrected by hand is used from the next request.
    let corrected = admin(
        &proxy,
        "PATCH",
        &format!("{base}/memories/{id}"),
        r#"{"text": "The user lives in Porto"}"#,
    )
    .await;
    assert_eq!(corrected.status, 200, "{:?}", corrected.body);
    assert_eq!(corrected.json()["source"], "corrected_memory");
    assert_eq!(
        corrected.json()["history"][0]["text"],
        "The user lives in Lisbon"
    );
    chat(
        &proxy,
        "b",
        &body(&[support::user("Where do I live?")]),
        &[("x-memory-user-id", "ana")],
    )
    .await;
    let prompt = mock.last_messages()[0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        prompt.contains("Porto") && !prompt.contains("Lisbon"),
        "{prompt}"
    );
    let created = admin(
        &proxy,
        "POST",
        &format!("{base}/memories"),
        r#"{"text": "The user is vegetarian", "type": "preference"}"#,
    )
    .await;
    assert_eq!(created.status, 200);
    let bad = admin(
        &proxy,
        "POST",
        &format!("{base}/memories"),
        r#"{"text": "x", "type": "mood"}"#,
    )
    .await;
    assert_eq!(bad.status, 400);

    // Vectors of the user's messages, archive and memories, as the embedding job puts them.
    let store = proxy.store();
    let space = "test/space/4";
    let embedding = |n: usize| vec![1.0, n as f32, 0.5, -2.0];
    for conversation in ["a", "b"] {
        let handle = store
            .conversation(&key_for(Some(TOKEN), "default", conversation))
            .unwrap();
        let conversation = memproxy::store::lock(&handle);
        let turns = store.turns_without_vectors(&conversation, space).unwrap();
        let vectors: Vec<(u64, Vec<f32>)> =
            turns.iter().map(|&t| (t, embedding(t as usize))).collect();
        assert!(store.put_vectors(&conversation, space, &vectors).unwrap() > 0);
    }
    let user = memproxy::store::OwnerKey::user(
        &memproxy::identity::TenantId::from_token(Some(TOKEN)),
        "ana",
    );
    let owner = store.owner(&user, false).unwrap().unwrap();
    for records in [
        memproxy::longterm::memories::SPACE_MEMORIES,
        memproxy::longterm::archive::SPACE_ARCHIVE,
    ] {
        let ids = store
            .owner_records_without_vectors(&owner, records, space)
            .unwrap();
        let vectors: Vec<(u8, Vec<u8>, Vec<f32>)> = ids
            .into_iter()
            .enumerate()
            .map(|(n, id)| (records, id, embedding(n)))
            .collect();
        assert!(store.put_owner_vectors(&owner, space, &vectors).unwrap() > 0);
        assert!(
            !store
                .owner_vectors(&owner, records, space)
                .unwrap()
                .is_empty()
        );
    }
    assert!(store.vector_count().unwrap() > 0);

    // Delete the user: conversations, archive, memories, their vectors; nothing readable
    // anywhere.
    let deleted = admin(&proxy, "DELETE", &base, "").await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    assert_eq!(deleted.json()["deleted_conversations"], 2);
    assert_eq!(
        admin(&proxy, "GET", &format!("{base}/memories"), "")
            .await
            .status,
        404
    );
    assert!(proxy.stored(Some(TOKEN), "a").is_empty());
    for needle in ["Rua Augusta", "Porto", "vegetarian"] {
        assert!(!store.any_trace_of(needle.as_bytes()).unwrap(), "{needle}");
    }
    assert_eq!(store.vector_count().unwrap(), 0);
    if let Some(redis) = &redis {
        // With Redis: no key of the user is left, only the id counter.
        assert_eq!(redis.command("KEYS mp:*"), "*1\r\n$6\r\nmp:ids\r\n");
    }
    proxy.stop().await;
    for (path, bytes) in files(dir.path()) {
        for needle in [&b"Rua Augusta"[..], b"Porto", b"vegetarian"] {
            assert!(
                !bytes.windows(needle.len()).any(|w| w == needle),
                "{path:?}"
            );
        }
    }
}

/// A proxy where user `ana` has the memories an extraction of `said` gave (`memories`, the
/// answer's list).
async fn with_memories(said: &str, memories: serde_json::Value) -> Started {
    let started = Harness::new().admin().start().await;
    let (mock, proxy) = (&started.mock, &started.proxy);
    let count = memories.as_array().unwrap().len();
    mock.push_extraction(extraction_answer(memories));
    let extra = [
        ("x-memory-user-id", "ana"),
        ("x-memory-extraction-every", "1"),
    ];
    chat(proxy, "a", &body(&[support::user(said)]), &extra).await;
    eventually("the extraction", || {
        memories_of(proxy, "ana").len() == count
    })
    .await;
    started
}

#[tokio::test]
async fn the_sweeper_deletes_memories_that_decayed_under_the_floor() {
    let Started { proxy, .. } = with_memories(
        "I live in Lisbon and work as a nurse",
        serde_json::json!([
            {"text": "The user lives in Lisbon", "type": "profile", "scope": "private",
             "importance": 0.0, "confidence": 0.95, "tags": [], "source_turns": [1], "supersedes": []},
            {"text": "The user is a nurse", "type": "profile", "scope": "private",
             "importance": 1.0, "confidence": 0.95, "tags": [], "source_turns": [1], "supersedes": []}
        ]),
    )
    .await;
    let state = &proxy.state;
    let memory = state.memory().unwrap();
    // 45 days: the unimportant memory (half-life 15 days) is at 0.125, the important one
    // (half-life 45 days) at 0.5; the floor is 0.2.
    memory.clock.advance(Duration::from_secs(45 * 86_400));
    let pass = sweep_pass(memory, &state.config, &mut Cursor::default()).unwrap();
    assert_eq!(pass.decayed, 1);
    let left = memories_of(&proxy, "ana");
    assert_eq!(left.len(), 1);
    assert!(left[0].text.contains("nurse"));
    proxy.stop().await;
}

#[tokio::test]
async fn a_memory_used_in_a_prompt_is_refreshed_and_escapes_the_sweep() {
    let Started { proxy, .. } = with_memories(
        "I live in Lisbon",
        serde_json::json!([
            {"text": "The user lives in Lisbon", "type": "profile", "scope": "private",
             "importance": 0.0, "confidence": 0.95, "tags": [], "source_turns": [1], "supersedes": []}
        ]),
    )
    .await;
    let state = &proxy.state;
    let memory = state.memory().unwrap();
    // 10 days on (half-life 15 days for an unimportant memory: 0.63), the memory is used...
    memory.clock.advance(Duration::from_secs(10 * 86_400));
    let used = chat(
        &proxy,
        "b",
        &body(&[support::user("Where do I live?")]),
        &[("x-memory-user-id", "ana")],
    )
    .await;
    assert_eq!(used.header("x-memory-memories"), "1");
    // ...so 30 days later it is at 0.25, over the floor, not at 0.06.
    memory.clock.advance(Duration::from_secs(30 * 86_400));
    let pass = sweep_pass(memory, &state.config, &mut Cursor::default()).unwrap();
    assert_eq!(pass.decayed, 0);
    assert_eq!(memories_of(&proxy, "ana").len(), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn a_stored_summary_is_extracted_from_too() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    mock.push_summary(support::mock_upstream::Reply::Text(
        "The user keeps bees on a rooftop in Porto and sells the honey.".into(),
    ));
    mock.push_extraction(extraction_answer(serde_json::json!([
        {"text": "The user keeps bees in Porto", "type": "profile", "scope": "private",
         "importance": 0.7, "confidence": 0.9, "tags": ["hobby"], "source_turns": [1], "supersedes": []}
    ])));
    // Extraction by count is out of the way (every 100 user messages): only the summary
    // brings one.
    let extra = [
        ("x-memory-user-id", "ana"),
        ("x-memory-extraction-every", "100"),
        ("x-memory-recent-n", "2"),
        ("x-memory-compression-threshold-tokens", "40"),
    ];
    const SAID: [&str; 4] = [
        "I keep bees on the rooftop of my building in Porto, three hives in all",
        "Every autumn I sell the honey at the market near the river",
        "The bees were calm this year, even in the heat of August",
        "Next spring I want to add a fourth hive if the roof allows it",
    ];
    for text in SAID {
        let answer = chat(&proxy, "bees", &body(&[support::user(text)]), &extra).await;
        assert_eq!(answer.status, 200);
    }
    eventually("the summary's extraction", || {
        memories_of(&proxy, "ana").len() == 1
    })
    .await;
    let calls = mock.extraction_requests();
    assert_eq!(calls.len(), 1, "one extraction, from the summary");
    let prompt = calls[0].json()["messages"][1]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        prompt.contains("Summary of conversation turns #1 to #")
            && prompt.contains("rooftop in Porto and sells the honey"),
        "{prompt}"
    );
    assert!(!prompt.contains("[turn #"), "{prompt}");
    // The summary's credentials are the triggering request's.
    assert_eq!(
        calls[0].headers["authorization"],
        format!("Bearer {TOKEN}").as_str()
    );
    let memory = &memories_of(&proxy, "ana")[0];
    assert_eq!(memory.text, "The user keeps bees in Porto");
    assert_eq!(memory.conversation.as_deref(), Some("bees"));
    assert!(
        memory.excerpt.contains("rooftop of my building"),
        "{memory:?}"
    );
    // Without a user id a summary brings no extraction.
    for text in SAID {
        chat(
            &proxy,
            "anonymous",
            &body(&[support::user(text)]),
            &extra[2..],
        )
        .await;
    }
    eventually("the anonymous conversation's summary", || {
        mock.summary_requests().len() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(mock.extraction_requests().len(), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn a_claude_extraction_model_answers_the_contract_through_a_forced_tool_call() {
    let Started { mock, proxy, .. } = Harness::new().anthropic_to_the_mock().start().await;
    mock.push_extraction(extraction_answer(serde_json::json!([
        {"text": "The user lives in Lisbon", "type": "profile", "scope": "private",
         "importance": 0.9, "confidence": 0.95, "tags": [], "source_turns": [1], "supersedes": []}
    ])));
    let extra = [
        ("x-memory-user-id", "ana"),
        ("x-memory-extraction-every", "1"),
        ("x-memory-extraction-model", "claude-haiku-4-5"),
    ];
    tell_ana(&proxy, "I live in Lisbon", &extra, 1).await;
    let call = mock.extraction_requests().pop().unwrap();
    assert!(call.path.ends_with("/v1/messages"), "{}", call.path);
    let call = call.json();
    assert_eq!(call["model"], "claude-haiku-4-5");
    assert!(call.get("response_format").is_none());
    assert_eq!(
        call["tool_choice"],
        serde_json::json!({"type": "tool", "name": "memproxy_memories"})
    );
    assert_eq!(call["tools"][0]["name"], "memproxy_memories");
    assert_eq!(
        call["tools"][0]["input_schema"],
        memproxy::longterm::extract::response_format()["json_schema"]["schema"]
    );
    assert_eq!(
        memories_of(&proxy, "ana")[0].text,
        "The user lives in Lisbon"
    );
    // A tool call whose input is not the contract changes nothing (a bad answer).
    let counters = &proxy.state.memory().unwrap().longterm.extractor.counters;
    for _ in 0..3 {
        mock.push_extraction(support::mock_upstream::Reply::Text("not json".into()));
    }
    chat(&proxy, "a", &body(&[support::user("I like jazz")]), &extra).await;
    eventually("three bad answers", || {
        counters.failures.load(std::sync::atomic::Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(memories_of(&proxy, "ana").len(), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn a_user_exported_and_imported_comes_back_with_memories_and_archive() {
    use crate::support::admin::{admin, tenant};
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    say(&proxy, TOKEN, Some("ana"), "trip-planning", FACT).await;
    let base = format!("/admin/v1/users/{}/ana", tenant(TOKEN));
    let created = admin(
        &proxy,
        "POST",
        &format!("{base}/memories"),
        r#"{"text": "The user prefers window seats", "type": "preference"}"#,
    )
    .await;
    assert_eq!(created.status, 200, "{:?}", created.body);

    let export = admin(&proxy, "GET", &format!("{base}/export"), "").await;
    assert_eq!(export.status, 200, "{:?}", export.body);
    let export_text = String::from_utf8(export.body.to_vec()).unwrap();
    assert!(export_text.contains("window seats"));
    assert!(export_text.contains("allergic to peanuts"));

    // Gone entirely, then back from the export.
    assert_eq!(admin(&proxy, "DELETE", &base, "").await.status, 200);
    assert_eq!(
        admin(&proxy, "GET", &format!("{base}/memories"), "")
            .await
            .status,
        404
    );
    let imported = admin(&proxy, "POST", &format!("{base}/import"), &export_text).await;
    assert_eq!(imported.status, 200, "{:?}", imported.body);
    assert_eq!(imported.json()["memories_added"], 1);
    assert_eq!(imported.json()["conversations_added"], 1);
    let listed = admin(&proxy, "GET", &format!("{base}/memories"), "").await;
    assert_eq!(
        listed.json()["memories"][0]["text"],
        "The user prefers window seats"
    );
    // Layer 1 is back: a new conversation recalls the deleted one's turn from the archive.
    say(&proxy, TOKEN, Some("ana"), "after-import", QUESTION).await;
    let message = recalled(&mock);
    assert!(message.contains(FACT), "{message}");
    assert!(
        message.contains("[earlier conversation trip-planning, turn #1 at "),
        "{message}"
    );

    // Again: nothing new.
    let again = admin(&proxy, "POST", &format!("{base}/import"), &export_text).await;
    assert_eq!(again.json()["memories_added"], 0);
    assert_eq!(again.json()["memories_skipped"], 1);
    assert_eq!(again.json()["conversations_added"], 0);
    // Into another tenant only when asked for.
    let other = format!("/admin/v1/users/{}/ana", tenant("sk-other-tenant"));
    let refused = admin(&proxy, "POST", &format!("{other}/import"), &export_text).await;
    assert_eq!(refused.status, 400);
    let moved = admin(
        &proxy,
        "POST",
        &format!("{other}/import?force_tenant=true"),
        &export_text,
    )
    .await;
    assert_eq!(moved.json()["memories_added"], 1);
    // A bad body is a 400 that says what it wants.
    let bad = admin(
        &proxy,
        "POST",
        &format!("{base}/import"),
        r#"{"format": "x"}"#,
    )
    .await;
    assert_eq!(bad.status, 400);
}

#[tokio::test]
async fn the_preview_of_a_request_with_a_user_shows_her_memories_and_other_conversations() {
    use crate::support::admin::{ADMIN_TOKEN, admin, conversation_path, tenant};
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    // Ana said a fact in conversation `a`, has a memory, and talks in `b`.
    say(&proxy, TOKEN, Some("ana"), "a", FACT).await;
    let base = format!("/admin/v1/users/{}/ana", tenant(TOKEN));
    let created = admin(
        &proxy,
        "POST",
        &format!("{base}/memories"),
        r#"{"text": "The user is vegetarian", "type": "preference"}"#,
    )
    .await;
    assert_eq!(created.status, 200, "{:?}", created.body);
    say(&proxy, TOKEN, Some("ana"), "b", "hello again").await;
    let accessed_before: Vec<i64> = memories_of(&proxy, "ana")
        .iter()
        .map(|m| m.last_accessed_ms)
        .collect();

    let path = format!("{}/preview", conversation_path(TOKEN, "default", "b"));
    let request = body(&[support::user(QUESTION)]).to_string();
    let preview_as = |user: Option<&'static str>| {
        let (proxy, path, request) = (&proxy, path.clone(), request.clone());
        async move {
            let auth = format!("Bearer {ADMIN_TOKEN}");
            let mut headers = vec![
                ("content-type", "application/json"),
                ("authorization", auth.as_str()),
            ];
            if let Some(user) = user {
                headers.push(("x-memory-user-id", user));
            }
            send("POST", &proxy.url(&path), &headers, request).await
        }
    };
    let requests_before = mock.recorded().len();
    let stored_before = proxy.stored(Some(TOKEN), "b").len();
    let with_user = preview_as(Some("ana")).await;
    assert_eq!(with_user.status, 200, "{:?}", with_user.body);
    let forwarded = with_user.json()["messages"].to_string();
    assert!(forwarded.contains("vegetarian"), "her memory: {forwarded}");
    assert!(
        forwarded.contains("Lisbon"),
        "the turn from her other conversation: {forwarded}"
    );

    let accessed_after: Vec<i64> = memories_of(&proxy, "ana")
        .iter()
        .map(|m| m.last_accessed_ms)
        .collect();
    assert_eq!(
        accessed_after, accessed_before,
        "a preview refreshes no memory"
    );

    // What the request itself would forward is what the preview showed.
    let answer = say(&proxy, TOKEN, Some("ana"), "b", QUESTION).await;
    assert_eq!(answer.status, 200);
    let sent = serde_json::Value::Array(mock.last_messages()).to_string();
    assert_eq!(sent, forwarded);

    // Without the header: neither; a bad header is a 400 naming it.
    let without = preview_as(None).await.json()["messages"].to_string();
    assert!(
        !without.contains("vegetarian") && !without.contains("Lisbon"),
        "{without}"
    );
    let bad = preview_as(Some("../ana")).await;
    assert_eq!(bad.status, 400);
    assert!(String::from_utf8_lossy(&bad.body).contains("x-memory-user-id"));

    // The previews stored nothing and called no upstream (only the chat request did).
    assert_eq!(mock.recorded().len(), requests_before + 1);
    assert_eq!(proxy.stored(Some(TOKEN), "b").len(), stored_before + 2);
}
