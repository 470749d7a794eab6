//! Recall by meaning through the real proxy and the real in-process embedder (the static table
//! distilled from all-MiniLM-L6-v2; `scripts/fetch-model.sh` puts the model where these tests
//! find it): 30 facts stated early in a 300-exchange conversation, asked about at the end in
//! other words. Words alone find few of them, words and meaning most; questions nothing in the
//! conversation answers carry fewer recalled turns with the relevance floor than without.

use std::time::Duration;

use serde_json::Value;

use crate::support::mock_upstream::MockUpstream;
use crate::support::*;

/// (the fact as the user states it, a question about it sharing none of its words).
const FACTS: [(&str, &str); 30] = [
    (
        "I drive a silver Volvo.",
        "What kind of automobile do I own?",
    ),
    (
        "My sister Anna lives in Lisbon.",
        "Which city is my sibling based in?",
    ),
    (
        "I'm allergic to peanuts.",
        "Is there any food that makes me ill?",
    ),
    (
        "Our dog is a golden retriever named Biscuit.",
        "What breed is our pet?",
    ),
    (
        "I work as a nurse at the children's hospital.",
        "What is my profession?",
    ),
    (
        "My favourite band is Radiohead.",
        "Which musicians do I enjoy most?",
    ),
    (
        "I play the cello in a community orchestra.",
        "Which instrument can I perform on?",
    ),
    ("My wife is called Priya.", "What is my spouse's name?"),
    (
        "I'm training for the Berlin marathon in September.",
        "What race am I preparing for?",
    ),
    ("I can't stand coriander.", "Which herb do I dislike?"),
    (
        "We moved into a flat in Manchester last spring.",
        "Where is our new apartment?",
    ),
    (
        "I studied chemistry at university.",
        "What was my major in college?",
    ),
    (
        "My son Leo just started kindergarten.",
        "Where does my child go during the day?",
    ),
    ("I'm vegetarian.", "Do I eat meat?"),
    ("My laptop is a ThinkPad.", "What computer do I use?"),
    (
        "I'm terrified of spiders.",
        "What creatures am I scared of?",
    ),
    (
        "I speak fluent Japanese.",
        "Which foreign languages do I know?",
    ),
    (
        "My dad was a carpenter.",
        "What did my father do for a living?",
    ),
    (
        "I take my coffee black with no sugar.",
        "How do I like my morning brew?",
    ),
    (
        "My favourite film is Spirited Away.",
        "Which movie do I love most?",
    ),
    (
        "I broke my wrist skiing last winter.",
        "Have I had any injuries?",
    ),
    (
        "I grow tomatoes and basil on the balcony.",
        "What plants do I cultivate at home?",
    ),
    (
        "I'm saving up for a trip to Iceland.",
        "Where do I want to travel?",
    ),
    (
        "I volunteer at the animal shelter on Saturdays.",
        "What charity work do I do at weekends?",
    ),
    (
        "My doctor says my cholesterol is high.",
        "Do I have any health issues?",
    ),
    ("I support Arsenal.", "Which football team do I cheer for?"),
    (
        "I commute by bicycle every day.",
        "How do I get to the office?",
    ),
    (
        "My grandmother taught me to knit.",
        "Who showed me how to make scarves?",
    ),
    (
        "I'm learning to bake sourdough bread.",
        "What am I practising in the kitchen?",
    ),
    (
        "My phone is an old iPhone 8.",
        "What mobile device do I carry?",
    ),
];

/// Questions nothing in the conversation answers.
const UNRELATED: [&str; 10] = [
    "What is the boiling point of mercury?",
    "Who painted the ceiling of the Sistine Chapel?",
    "How many moons does Neptune have?",
    "Explain quantum entanglement briefly.",
    "What is the capital of Mongolia?",
    "How do volcanoes form?",
    "Translate 'good morning' into Swahili.",
    "What year did the Berlin Wall fall?",
    "Summarise the plot of Hamlet.",
    "How does a jet engine work?",
];

/// The filler exchanges between the facts and the questions: everyday requests.
fn filler(i: usize) -> String {
    const TASKS: [&str; 10] = [
        "Can you rephrase this line of the quarterly report",
        "Draft a short reply to the email about the invoice",
        "List three ideas for the team offsite agenda",
        "Check the grammar of this paragraph about our release",
        "Suggest a title for the slide on customer churn",
        "Summarise the notes from the planning meeting",
        "Write a polite reminder about the overdue timesheets",
        "Give me a checklist for the server migration",
        "Turn these bullet points into a status update",
        "Propose a name for the new onboarding document",
    ];
    format!("{} (item {i})", TASKS[i % TASKS.len()])
}

/// The recalled-turns message of the last forwarded prompt ("" when none).
fn recalled(mock: &MockUpstream) -> String {
    mock.last_messages()
        .iter()
        .filter_map(|m| m["content"].as_str())
        .find(|text| text.starts_with("[Earlier in this conversation"))
        .unwrap_or("")
        .to_string()
}

/// Waits until every stored message has its vector (they are made in the background).
pub(crate) async fn embedded(proxy: &Proxy) {
    let memory = proxy.state.memory().expect("memory");
    for _ in 0..6000 {
        if memory.embedding.idle() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the background embedding jobs did not finish within a minute");
}

/// With the static table, a stored exchange's vectors are made in its commit and put into the
/// conversation's recall index by the time the answer ends, with no background job: the next
/// question finds the reply by meaning at once. They are not stored (a table's vector is made
/// again from the text, `Embed::derived`): a new process on the same data builds the index from
/// the stored texts and finds it by meaning as well, with the same turns.
#[tokio::test]
async fn the_static_table_s_vectors_are_made_in_the_commit_and_again_from_the_texts() {
    let Started {
        mock, proxy, dir, ..
    } = Harness::new().config(EMBEDDING).start().await;
    let memory = std::sync::Arc::clone(proxy.state.memory().expect("memory"));
    let (space, _) = memory.embedding.space().expect("the static table");
    let space = space.to_string();
    for (fact, _) in FACTS.iter().take(12) {
        let answer = chat(&proxy, "inline", &body(&[user(fact)]), &[]).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
    }
    {
        let handle = proxy
            .store()
            .conversation(&key(Some(TOKEN), "inline"))
            .unwrap();
        let conversation = handle.lock().unwrap();
        assert_eq!(conversation.entries.len(), 24);
        assert!(
            proxy
                .store()
                .vectors(&conversation, &space)
                .unwrap()
                .is_empty(),
            "a table's vectors are not stored"
        );
    }
    let c = &memory.embedding.counters;
    let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&c.jobs_queued), 0, "no background job");
    assert_eq!(load(&c.vectors_in_commit), 24);
    assert_eq!(load(&c.vectors_derived), 24);
    assert_eq!(load(&c.vectors_stored), 0);
    let metrics = send("GET", &proxy.url("/metrics"), &[], "").await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    for line in [
        "memproxy_embedding_vectors_in_commit_total 24",
        "memproxy_embedding_vectors_derived_total 24",
        "memproxy_embedding_vectors_stored_total 0",
    ] {
        assert!(metrics.contains(line), "{line}: {metrics}");
    }
    // The first fact is older than the window of 10: found by its meaning as soon as stored.
    let (fact, question) = FACTS[0];
    let persist_off = [("x-memory-persist", "false")];
    let answer = chat(&proxy, "inline", &body(&[user(question)]), &persist_off).await;
    assert_eq!(answer.header("x-memory-recall"), "hybrid");
    let turns = answer.header("x-memory-retrieved-turns").to_string();
    assert!(recalled(&mock).contains(fact), "{}", recalled(&mock));
    drop(memory);
    proxy.stop().await;

    // A new process on the same data: the index is built from the stored texts, their vectors
    // made again, and the question recalls the same turns by words and meaning.
    let proxy = Harness::new()
        .config(EMBEDDING)
        .proxy_on(&mock, dir.path())
        .await;
    let answer = chat(&proxy, "inline", &body(&[user(question)]), &persist_off).await;
    assert_eq!(answer.header("x-memory-recall"), "hybrid");
    assert_eq!(answer.header("x-memory-retrieved-turns"), turns);
    assert!(recalled(&mock).contains(fact), "{}", recalled(&mock));
}

/// Replicas sharing memory in Redis with the static table: turns one replica stored reach the
/// other's cached recall index with their vectors, made there (they are not stored), so the
/// other finds them by meaning at once.
#[tokio::test]
async fn a_replica_finds_by_meaning_what_the_other_stored_with_the_static_table() {
    let redis = crate::support::redis_server::RedisServer::start();
    let replica = || Harness::new().redis(&redis).config(EMBEDDING);
    let Started { mock, proxy: a, .. } = replica().start().await;
    let dir_b = tempfile::tempdir().unwrap();
    let b = replica().proxy_on(&mock, dir_b.path()).await.keeping(dir_b);
    // A holds the conversation's recall index: past the window of 10, its requests search.
    for i in 0..12 {
        let answer = chat(&a, "shared", &body(&[user(&filler(i))]), &[]).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
    }
    // B stores a fact, then enough small talk to push it out of the window.
    let (fact, question) = FACTS[1];
    chat(&b, "shared", &body(&[user(fact)]), &[]).await;
    for i in 12..24 {
        let answer = chat(&b, "shared", &body(&[user(&filler(i))]), &[]).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
    }
    // A catches up with B's turns and asks in other words: found by meaning.
    let lookups_before = a.state.memory().unwrap().recall.cache_counts();
    let answer = chat(
        &a,
        "shared",
        &body(&[user(question)]),
        &[("x-memory-persist", "false")],
    )
    .await;
    assert_eq!(answer.header("x-memory-recall"), "hybrid");
    let (lookups, misses) = a.state.memory().unwrap().recall.cache_counts();
    assert_eq!(
        (lookups - lookups_before.0, misses - lookups_before.1),
        (1, 0),
        "A's cached index was caught up, not built again"
    );
    assert!(recalled(&mock).contains(fact), "{}", recalled(&mock));
}

const EMBEDDING: &str = "[memory]\nrecent_n = 10\nrelevance_top_k = 5\ncompression_enabled = false\nmax_messages = 10000\n[embedding]\nembedder = \"static\"\n";

/// Facts found by each question's recall, as (found, of 30).
async fn facts_found(proxy: &Proxy, mock: &MockUpstream, extra: &[(&str, &str)]) -> usize {
    let mut found = 0;
    for (fact, question) in FACTS {
        let mut headers = vec![("x-memory-persist", "false")];
        headers.extend_from_slice(extra);
        let answer = chat(proxy, "facts", &body(&[user(question)]), &headers).await;
        assert_eq!(answer.status, 200);
        if recalled(mock).contains(fact) {
            found += 1;
        }
    }
    found
}

/// Replays the facts and the filler with `embedder`, then asks each fact's question by words
/// alone and by words and meaning: (facts found by words, facts found by both, the vector
/// space `/readyz` names).
async fn paraphrase_run(embedder: &str) -> (usize, usize, String) {
    let config = EMBEDDING.replace("\"static\"", &format!("\"{embedder}\""));
    let Started { mock, proxy, .. } = Harness::new().config(&config).start().await;
    let ready: Value = send("GET", &proxy.url("/readyz"), &[], "").await.json();
    assert_eq!(ready["recall"], "hybrid", "{ready}");
    let space = ready["embedder"].as_str().unwrap_or_default().to_string();
    for (fact, _) in FACTS {
        chat(&proxy, "facts", &body(&[user(fact)]), &[]).await;
    }
    for i in 0..270 {
        chat(&proxy, "facts", &body(&[user(&filler(i))]), &[]).await;
    }
    embedded(&proxy).await;

    let lexical = facts_found(&proxy, &mock, &[("x-memory-relevance-semantic", "false")]).await;
    let hybrid = facts_found(&proxy, &mock, &[]).await;
    eprintln!(
        "{embedder}: paraphrased facts recalled (top 5 of 600 messages): words alone {lexical}/30, words and meaning {hybrid}/30"
    );

    // The request says how it searched.
    let asked = |semantic: &'static str| {
        let proxy = &proxy;
        async move {
            chat(
                proxy,
                "facts",
                &body(&[user(FACTS[0].1)]),
                &[
                    ("x-memory-persist", "false"),
                    ("x-memory-relevance-semantic", semantic),
                ],
            )
            .await
        }
    };
    assert_eq!(asked("true").await.header("x-memory-recall"), "hybrid");
    assert_eq!(
        asked("false").await.header("x-memory-recall"),
        "lexical; reason=setting"
    );
    (lexical, hybrid, space)
}

/// The default embedder, a static table: a word-piece lookup per text, about 0.02 ms. The
/// learned table (`memproxy model learn`, which `scripts/test.sh` runs first) found 20 of 30
/// when it was made the default; the distilled table it replaced, 15.
#[tokio::test]
async fn facts_asked_about_in_other_words_are_recalled_by_the_static_table() {
    let (lexical, hybrid, space) = paraphrase_run("static").await;
    assert!(
        space.contains("learned"),
        "the static embedder is {space:?}, not the learned table: make it with \
         `cargo run --bin memproxy -- model learn` (needs Debian's wordnet-base)"
    );
    assert!(lexical <= 3, "words alone found {lexical} of 30");
    assert!(hybrid >= 18, "words and meaning found {hybrid} of 30");
}

/// The full model (`embedder = "contextual"`): better vectors, milliseconds per text.
#[tokio::test]
async fn facts_asked_about_in_other_words_are_recalled_by_the_full_model() {
    let (lexical, hybrid, _) = paraphrase_run("contextual").await;
    assert!(lexical <= 3, "words alone found {lexical} of 30");
    assert!(hybrid >= 20, "words and meaning found {hybrid} of 30");
}

#[tokio::test]
async fn the_relevance_floor_keeps_unrelated_questions_free_of_recalled_turns() {
    let Started { mock, proxy, .. } = Harness::new().config(EMBEDDING).start().await;
    for (fact, _) in FACTS {
        chat(&proxy, "floor", &body(&[user(fact)]), &[]).await;
    }
    for i in 0..60 {
        chat(&proxy, "floor", &body(&[user(&filler(i))]), &[]).await;
    }
    embedded(&proxy).await;
    let (mut without_floor, mut with_floor, mut none_recalled) = (0, 0, 0);
    for question in UNRELATED {
        let answer = chat(
            &proxy,
            "floor",
            &body(&[user(question)]),
            &[
                ("x-memory-persist", "false"),
                ("x-memory-relevance-floor", "0"),
                ("x-memory-relevance-relative-floor", "0"),
            ],
        )
        .await;
        without_floor += answer
            .header("x-memory-retrieved")
            .parse::<usize>()
            .unwrap();
        let answer = chat(
            &proxy,
            "floor",
            &body(&[user(question)]),
            &[("x-memory-persist", "false")],
        )
        .await;
        let recalled: usize = answer.header("x-memory-retrieved").parse().unwrap();
        with_floor += recalled;
        none_recalled += usize::from(recalled == 0);
    }
    eprintln!(
        "recalled turns for 10 unrelated questions: floor 0 {without_floor}, default floor {with_floor} ({none_recalled} questions with none)"
    );
    // Without a floor every question carries its top-K; with it, those sharing no word with
    // the conversation carry none (a question that does, "How does a jet engine work?" and
    // the filler's "work", still finds that turn).
    assert_eq!(without_floor, 50);
    assert!(none_recalled >= 5, "{none_recalled}");
    assert!(
        with_floor * 2 <= without_floor,
        "{with_floor} of {without_floor}"
    );
    // A paraphrased fact still clears the floor.
    chat(
        &proxy,
        "floor",
        &body(&[user(FACTS[0].1)]),
        &[("x-memory-persist", "false")],
    )
    .await;
    assert!(recalled(&mock).contains(FACTS[0].0));
}

/// A question one older turn answers squarely: the relative floor leaves out the turns that
/// only share a word or two with it, and keeps the answer.
#[tokio::test]
async fn the_relative_floor_leaves_out_the_weak_tail_and_keeps_the_answer() {
    let Started { mock, proxy, .. } = Harness::new().config(EMBEDDING).start().await;
    // Three office chores after each fact, so no fact is within reach of another's words.
    for (i, (fact, _)) in FACTS.iter().enumerate() {
        chat(&proxy, "tail", &body(&[user(fact)]), &[]).await;
        for j in 0..3 {
            chat(&proxy, "tail", &body(&[user(&filler(i * 3 + j))]), &[]).await;
        }
    }
    embedded(&proxy).await;
    let (all_turns, all_answered) = own_words_asked(&proxy, &mock, Some("0")).await;
    let (kept_turns, kept_answered) = own_words_asked(&proxy, &mock, Some("0.4")).await;
    eprintln!(
        "30 facts asked in their own words: relative floor 0 {all_turns} turns ({all_answered} answered), 0.4 {kept_turns} turns ({kept_answered} answered)"
    );
    // The last fact is in the recent window, not recalled.
    assert_eq!((all_answered, kept_answered), (29, 29));
    // What is left out is the far tail: a fact's neighbours carry its words (a turn's words
    // count in its neighbours' two places away, `recall/index.rs`) and stay.
    assert!(
        kept_turns + 10 <= all_turns,
        "{kept_turns} of {all_turns} turns"
    );
    // The default is 0.4.
    assert_eq!(
        own_words_asked(&proxy, &mock, None).await,
        (kept_turns, kept_answered)
    );
}

/// Asks about each fact in its own words with `X-Memory-Relevance-Relative-Floor: share`
/// (`None`: the default): (turns recalled in all, facts recalled).
async fn own_words_asked(
    proxy: &Proxy,
    mock: &MockUpstream,
    share: Option<&str>,
) -> (usize, usize) {
    let (mut turns, mut answered) = (0, 0);
    for (fact, _) in FACTS {
        let question = format!("Remind me, did I tell you this: {fact}");
        let mut headers = vec![("x-memory-persist", "false")];
        headers.extend(share.map(|share| ("x-memory-relevance-relative-floor", share)));
        let answer = chat(proxy, "tail", &body(&[user(&question)]), &headers).await;
        turns += answer
            .header("x-memory-retrieved")
            .parse::<usize>()
            .unwrap();
        answered += usize::from(recalled(mock).contains(fact));
    }
    (turns, answered)
}

#[tokio::test]
async fn a_broken_model_leaves_recall_by_words_and_every_request_answered() {
    let model = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::write(model.path().join(file), "not a model").unwrap();
    }
    let config = format!(
        "[memory]\nrecent_n = 2\n[embedding]\nembedder = \"static\"\nmodel_dir = {:?}\n",
        model.path().display().to_string()
    );
    let Started { mock, proxy, .. } = Harness::new().config(&config).start().await;
    // Ready (once the tokenizer is warm), recalling by words.
    let mut ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    for _ in 0..200 {
        if ready.status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    }
    assert_eq!(ready.status, 200, "{:?}", ready.body);
    let ready: Value = ready.json();
    assert_eq!(ready["recall"], "lexical", "{ready}");
    assert!(
        ready["embedder_reason"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{ready}"
    );
    for (fact, _) in &FACTS[..4] {
        let answer = chat(&proxy, "broken", &body(&[user(fact)]), &[]).await;
        assert_eq!(answer.status, 200);
        assert_eq!(answer.header("x-memory-status"), "stored");
    }
    let answer = chat(
        &proxy,
        "broken",
        &body(&[user("Where does my sister Anna live?")]),
        &[],
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.header("x-memory-recall"),
        "lexical; reason=embedder-unavailable"
    );
    assert!(recalled(&mock).contains("Lisbon"));
    let metrics = send("GET", &proxy.url("/metrics"), &[], "").await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(metrics.contains("memproxy_embedding_up 0"), "{metrics}");
}

#[tokio::test]
async fn the_providers_embeddings_serve_recall_when_configured() {
    let Started { mock, proxy, .. } = Harness::new()
        .upstream("api_key_env = \"TEST_UPSTREAM_KEY\"\n")
        .config(
            "[memory]\nrecent_n = 2\nrelevance_top_k = 2\n[embedding]\nembedder = \"upstream\"\nupstream_model = \"text-embedding-3-small\"\n",
        )
        .start()
        .await;
    for (fact, _) in &FACTS[..6] {
        let answer = chat(&proxy, "provider", &body(&[user(fact)]), &[]).await;
        assert_eq!(answer.status, 200);
    }
    embedded(&proxy).await;
    let calls: Vec<_> = mock
        .recorded()
        .into_iter()
        .filter(|r| r.path.ends_with("/embeddings"))
        .collect();
    assert!(!calls.is_empty());
    for call in &calls {
        assert_eq!(call.headers["authorization"], "Bearer sk-proxy-held");
        assert_eq!(call.headers["x-memproxy-task"], "embedding");
        assert_eq!(call.json()["model"], "text-embedding-3-small");
    }
    let memory = proxy.state.memory().unwrap();
    assert!(
        memory
            .embedding
            .counters
            .vectors_stored
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 12
    );
    let answer = chat(
        &proxy,
        "provider",
        &body(&[user("Tell me about the Volvo again")]),
        &[("x-memory-persist", "false")],
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-recall"), "hybrid");
    assert!(recalled(&mock).contains("silver Volvo"));
    assert!(mock.refusals().is_empty(), "{:?}", mock.refusals());
    // A call to the provider is worth a thread: the new message was embedded ahead, while
    // the plan read the window and matched the words.
    let ahead = memory
        .embedding
        .counters
        .queries_ahead
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(ahead >= 1, "{ahead}");
    // Embedded once: started before reconcile from the request's trailing user message, and
    // confirmed by it.
    let asked: Vec<_> = mock
        .recorded()
        .into_iter()
        .filter(|r| r.path.ends_with("/embeddings"))
        .filter(|r| r.json()["input"].to_string().contains("Volvo again"))
        .collect();
    assert_eq!(asked.len(), 1, "{asked:?}");
    let metrics = send("GET", &proxy.url("/metrics"), &[], "").await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(
        metrics.contains(&format!("memproxy_embedding_queries_ahead_total {ahead}")),
        "{metrics}"
    );
    // The provider's embedder offers no forward pass to help with: the request only waited.
    assert!(
        metrics.contains("memproxy_embedding_query_halves_helped_total 0"),
        "{metrics}"
    );
}

/// `memproxy_embedding_jobs_pending` counts a job while its vectors are being made and is 0
/// once they are stored.
#[tokio::test]
async fn pending_embedding_jobs_are_a_gauge_that_returns_to_zero() {
    let Started { mock, proxy, .. } = Harness::new()
        .upstream("api_key_env = \"TEST_UPSTREAM_KEY\"\n")
        .config(
            "[memory]\nrecent_n = 2\ncompression_enabled = false\n[embedding]\nembedder = \"upstream\"\nupstream_model = \"text-embedding-3-small\"\n",
        )
        .start()
        .await;
    mock.set_embeddings_delay(Duration::from_millis(2000));
    let pending = || async {
        let metrics = send("GET", &proxy.url("/metrics"), &[], "").await;
        String::from_utf8_lossy(&metrics.body)
            .lines()
            .find_map(|l| {
                l.strip_prefix("memproxy_embedding_jobs_pending ")?
                    .parse::<u64>()
                    .ok()
            })
            .expect("memproxy_embedding_jobs_pending")
    };
    assert_eq!(pending().await, 0);
    let answer = chat(&proxy, "pending", &body(&[user(FACTS[0].0)]), &[]).await;
    assert_eq!(answer.status, 200);
    // The provider takes two seconds to answer the job's embedding request.
    assert_eq!(pending().await, 1);
    embedded(&proxy).await;
    assert_eq!(pending().await, 0);
}

/// A slow provider fills the embedding queue (of one job): the jobs dropped are caught up once
/// the worker has room, so every stored message, archived turn included, ends with a vector
/// without `memproxy vectors rebuild`.
#[tokio::test]
async fn jobs_a_full_queue_dropped_are_caught_up() {
    let Started { mock, proxy, .. } = Harness::new()
        .upstream("api_key_env = \"TEST_UPSTREAM_KEY\"\n")
        .config(
            "[memory]\nrecent_n = 2\nrelevance_top_k = 2\ncompression_enabled = false\n[embedding]\nembedder = \"upstream\"\nupstream_model = \"text-embedding-3-small\"\nqueue = 1\n",
        )
        .start()
        .await;
    mock.set_embeddings_delay(Duration::from_millis(300));
    // Eight commits at once: the worker embeds the first while the second waits in the queue
    // of one, and the rest are dropped.
    let go = |i: usize| {
        let conversation = format!("slow-{i}");
        let proxy = &proxy;
        async move {
            let headers = [("x-memory-user-id", "ana")];
            chat(proxy, &conversation, &body(&[user(FACTS[i].0)]), &headers).await
        }
    };
    let answers = tokio::join!(go(0), go(1), go(2), go(3), go(4), go(5), go(6), go(7));
    for answer in [
        answers.0, answers.1, answers.2, answers.3, answers.4, answers.5, answers.6, answers.7,
    ] {
        assert_eq!(answer.status, 200);
    }
    let memory = proxy.state.memory().unwrap();
    let counters = &memory.embedding.counters;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        load(&counters.jobs_dropped) >= 2,
        "the queue of one never filled"
    );
    embedded(&proxy).await;
    assert!(load(&counters.caught_up) >= 2);
    assert_eq!(load(&counters.owed_forgotten), 0);
    assert_eq!(memory.embedding.owed(), 0);

    let store = proxy.store();
    let (space, _) = memory.embedding.space().unwrap();
    let (listed, _) = store.scan(None, 100).unwrap();
    assert_eq!(listed.len(), 8);
    for (key, _) in &listed {
        let handle = store.conversation(key).unwrap();
        let conversation = memproxy::store::lock(&handle);
        assert_eq!(conversation.entries.len(), 2);
        let missing = store.turns_without_vectors(&conversation, space).unwrap();
        assert!(
            missing.is_empty(),
            "{key:?}: turns {missing:?} have no vector"
        );
    }
    let ana = memproxy::store::OwnerKey::user(&listed[0].0.tenant, "ana");
    let owner = store.owner(&ana, false).unwrap().unwrap();
    let archived = store
        .owner_records_without_vectors(&owner, memproxy::longterm::archive::SPACE_ARCHIVE, space)
        .unwrap();
    assert!(
        archived.is_empty(),
        "{} archived turns have no vector",
        archived.len()
    );
    assert!(
        store
            .owner_vectors(&owner, memproxy::longterm::archive::SPACE_ARCHIVE, space)
            .unwrap()
            .len()
            >= 16
    );
    assert!(mock.refusals().is_empty(), "{:?}", mock.refusals());
}

/// A commit's messages and their copies in the user's archive are one embedding job: each text
/// is embedded once (the archived turn takes its message's vector), and both have vectors.
#[tokio::test]
async fn archived_turns_take_their_messages_vectors() {
    let Started { mock, proxy, .. } = Harness::new()
        .upstream("api_key_env = \"TEST_UPSTREAM_KEY\"\n")
        .config(
            "[memory]\nrecent_n = 2\nrelevance_top_k = 2\ncompression_enabled = false\n[embedding]\nembedder = \"upstream\"\nupstream_model = \"text-embedding-3-small\"\n",
        )
        .start()
        .await;
    // One exchange per conversation: no older turn, so no query is embedded on the way.
    for (i, (fact, _)) in FACTS[..6].iter().enumerate() {
        let answer = chat(
            &proxy,
            &format!("archived-{i}"),
            &body(&[user(fact)]),
            &[("x-memory-user-id", "ana")],
        )
        .await;
        assert_eq!(answer.status, 200);
    }
    embedded(&proxy).await;
    let texts: Vec<String> = mock
        .recorded()
        .into_iter()
        .filter(|r| r.path.ends_with("/embeddings"))
        .flat_map(|r| {
            let input = r.json()["input"].clone();
            input.as_array().cloned().unwrap_or_else(|| vec![input])
        })
        .filter_map(|text| text.as_str().map(str::to_string))
        .collect();
    // Each reply once (its message's vector serves its archived copy; before, twice); each
    // new message once too: as the query of recall over the user's other conversations, whose
    // vector its stored message and its archived copy then take (before, twice).
    for (fact, _) in &FACTS[..6] {
        let reply = format!("reply to: {fact}");
        assert_eq!(texts.iter().filter(|t| **t == reply).count(), 1, "{reply}");
        assert_eq!(texts.iter().filter(|t| t == fact).count(), 1, "{fact}");
    }
    assert_eq!(texts.len(), 12, "{texts:?}");

    let memory = proxy.state.memory().unwrap();
    let store = proxy.store();
    let (space, _) = memory.embedding.space().unwrap();
    let (listed, _) = store.scan(None, 100).unwrap();
    let ana = memproxy::store::OwnerKey::user(&listed[0].0.tenant, "ana");
    let owner = store.owner(&ana, false).unwrap().unwrap();
    let archive = memproxy::longterm::archive::SPACE_ARCHIVE;
    assert!(
        store
            .owner_records_without_vectors(&owner, archive, space)
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store.owner_vectors(&owner, archive, space).unwrap().len(),
        12
    );
    assert!(mock.refusals().is_empty(), "{:?}", mock.refusals());
}
