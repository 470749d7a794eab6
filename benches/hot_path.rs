//! Micro-benchmarks of the request path's hot steps, on synthetic conversations of 1,000 and
//! 10,000 messages: reconciliation of a re-sent history, recall (index search alone), recall +
//! assembly (the whole plan: reconcile, window, recall, budget, render), fitting long recalled
//! turns into `relevance_max_tokens`, token counting of a new message, and a commit with its
//! group flush.
//!
//! `cargo bench --bench hot_path` runs them with criterion. Before that it prints latency
//! percentiles of the plan step (criterion reports means) and the recall index's memory per
//! 1,000 messages.
// Allowed: a benchmark run by hand prints its percentiles, and a set-up step that fails ends
// it (unwrap) rather than let it measure half a set-up.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{BenchmarkId, Criterion};
use memproxy::config;
use memproxy::identity::{ConversationKey, TenantId};
use memproxy::message::{Message, Role};
use memproxy::pipeline::plan::plan;
use memproxy::pipeline::recalled::{RecalledTurn, fit_recalled};
use memproxy::pipeline::reconcile::{Mark, align};
use memproxy::proxy::chat::limits;
use memproxy::recall::index::Index;
use memproxy::recall::tokenize::{Lang, TextLanguage, terms};
use memproxy::settings::MemorySettings;
use memproxy::state::AppState;
use memproxy::store::{Change, Origin, StoredMessage, lock};
use memproxy::tokens;
use serde_json::json;
use serde_json::value::RawValue;

#[path = "../tests/support/rng.rs"]
mod rng;
use rng::Rng;

/// A question naming two rare words and two everyday ones.
const QUESTION: &str = "what did we decide about the garden budget for enkaka and lomiter?";

const WORDS: &[&str] = &[
    "garden",
    "tomato",
    "invoice",
    "meeting",
    "budget",
    "holiday",
    "sister",
    "recipe",
    "lentil",
    "train",
    "ticket",
    "account",
    "password",
    "doctor",
    "appointment",
    "weather",
    "rain",
    "bike",
    "repair",
    "novel",
    "chapter",
    "project",
    "deadline",
    "review",
    "coffee",
    "market",
    "price",
    "flight",
    "hotel",
    "museum",
    "painting",
    "guitar",
    "lesson",
    "school",
    "teacher",
    "birthday",
    "present",
    "camera",
    "photo",
    "mountain",
    "river",
    "dinner",
    "friend",
    "office",
    "printer",
    "server",
    "database",
    "backup",
    "release",
    "bug",
    "fix",
    "customer",
    "order",
    "shipping",
    "refund",
    "address",
    "phone",
    "number",
    "plan",
    "idea",
    "music",
    "concert",
    "game",
    "team",
];

/// `words` words drawn with the seeded `rng`, so every run benchmarks the same text: half
/// everyday words, half drawn from a long, skewed tail of 4,000 rarer ones (names, numbers,
/// topics), as conversation text is: most words are common, most content is rare.
fn sentence(rng: &mut Rng, words: usize) -> String {
    (0..words)
        .map(|i| {
            if i % 2 == 0 {
                rng.pick(WORDS).to_string()
            } else {
                let u = rng.below(1_000_000) as f64 / 1_000_000.0;
                rare_word((u * u * 4000.0) as usize)
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A pronounceable made-up word for rank `n`.
fn rare_word(n: usize) -> String {
    const SYLLABLES: &[&str] = &[
        "ka", "lo", "mi", "ter", "san", "vu", "rek", "pa", "dol", "en",
    ];
    let mut n = n + 10;
    let mut word = String::new();
    while n > 0 {
        word.push_str(SYLLABLES[n % 10]);
        n /= 10;
    }
    word
}

fn message(role: Role, text: &str) -> Message {
    let raw =
        RawValue::from_string(json!({"role": role.as_str(), "content": text}).to_string()).unwrap();
    Message::parse(raw, "m").unwrap()
}

fn conversation(n: usize, seed: u64) -> Vec<Message> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| {
            let role = if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            message(role, &sentence(&mut rng, 20))
        })
        .collect()
}

struct Fixture {
    state: Arc<AppState>,
    key: ConversationKey,
    history: Vec<Message>,
    _dir: tempfile::TempDir,
}

/// A store holding one conversation of `n` messages.
fn fixture(runtime: &tokio::runtime::Runtime, n: usize) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[storage]\ndata_dir = \"{}\"\n[upstream]\nbase_url = \"http://127.0.0.1:9/v1\"\n",
        dir.path().display()
    );
    let config = config::from_toml(&text, &|_| None).unwrap();
    let state = runtime.block_on(async { AppState::build(config).unwrap() });
    let key = ConversationKey {
        tenant: TenantId::from_token(Some("bench")),
        agent: "default".into(),
        conversation: format!("bench-{n}"),
    };
    let history = conversation(n, 7 + n as u64);
    let handle = state.memory().unwrap().store.conversation(&key).unwrap();
    {
        let mut conv = lock(&handle);
        let add = history
            .iter()
            .map(|m| StoredMessage {
                turn: 0,
                role: m.role,
                origin: if m.role == Role::User {
                    Origin::Client
                } else {
                    Origin::Reply
                },
                at_ms: 0,
                tokens: tokens::count_message(None, &m.text()),
                fingerprint: m.fingerprint,
                message: m.raw.clone(),
                exchange: None,
            })
            .collect();
        state
            .memory()
            .unwrap()
            .store
            .commit(
                &mut conv,
                Change {
                    remove_turns: vec![],
                    add,
                    tokens_forwarded: 0,
                    branch_from_turn: None,
                    ..Change::default()
                },
            )
            .unwrap();
    }
    Fixture {
        state,
        key,
        history,
        _dir: dir,
    }
}

fn settings() -> MemorySettings {
    MemorySettings {
        max_messages: 20_000,
        ..MemorySettings::default()
    }
}

fn run_plan(f: &Fixture, question: &Message) -> usize {
    let p = plan(
        f.state.memory().unwrap(),
        &f.key,
        None,
        &settings(),
        limits(&f.state),
        Some("gpt-4o-mini".into()),
        vec![question.clone()],
    )
    .unwrap();
    p.prompt.messages().count()
}

fn percentiles(runtime: &tokio::runtime::Runtime) {
    println!("plan (reconcile + window + recall top-5 + assemble), newest-only request:");
    for n in [1_000, 10_000] {
        let f = fixture(runtime, n);
        let question = message(Role::User, QUESTION);
        // Warm: the first search builds the index from the store.
        run_plan(&f, &question);
        let mut histogram = hdrhistogram::Histogram::<u64>::new(3).unwrap();
        for _ in 0..5_000 {
            let started = Instant::now();
            black_box(run_plan(&f, &question));
            histogram
                .record(started.elapsed().as_nanos() as u64)
                .unwrap();
        }
        println!(
            "  {n:>6} messages: p50 {:.1} µs  p99 {:.1} µs  p99.9 {:.1} µs",
            histogram.value_at_quantile(0.5) as f64 / 1e3,
            histogram.value_at_quantile(0.99) as f64 / 1e3,
            histogram.value_at_quantile(0.999) as f64 / 1e3,
        );
    }
    for n in [1_000, 10_000] {
        let mut index = Index::new();
        for (i, m) in conversation(n, 3).iter().enumerate() {
            index.push(i as u64 + 1, terms(&m.text(), Some(Lang::English)));
        }
        println!(
            "recall index: {n} messages → {:.0} KiB ({:.0} KiB per 1,000 messages)",
            index.heap_bytes() as f64 / 1024.0,
            index.heap_bytes() as f64 / 1024.0 / (n as f64 / 1000.0)
        );
    }
}

fn benches(c: &mut Criterion, runtime: &tokio::runtime::Runtime) {
    let query = terms(QUESTION, Some(Lang::English));
    let mut group = c.benchmark_group("recall_search");
    for n in [1_000usize, 10_000] {
        let mut index = Index::new();
        for (i, m) in conversation(n, 3).iter().enumerate() {
            index.push(i as u64 + 1, terms(&m.text(), Some(Lang::English)));
        }
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter(|| black_box(index.search(&query, n as u64 - 9, 5)))
        });
    }
    group.finish();

    // Adding a stored message to its conversation's index (its own terms, its neighbours'):
    // what every commit does, here 1,000 messages in a row.
    let texts: Vec<Vec<String>> = conversation(1_000, 3)
        .iter()
        .map(|m| terms(&m.text(), Some(Lang::English)))
        .collect();
    c.bench_function("recall_index_push_1000", |b| {
        b.iter(|| {
            let mut index = Index::new();
            for (i, t) in texts.iter().enumerate() {
                index.push(i as u64 + 1, t.clone());
            }
            black_box(index.len())
        })
    });

    let mut group = c.benchmark_group("plan");
    for n in [1_000usize, 10_000] {
        let f = fixture(runtime, n);
        let question = message(Role::User, QUESTION);
        run_plan(&f, &question);
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| black_box(run_plan(&f, &question)))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("reconcile_full_resend");
    for n in [1_000usize, 10_000] {
        let f = fixture(runtime, n);
        let handle = f
            .state
            .memory()
            .unwrap()
            .store
            .conversation(&f.key)
            .unwrap();
        let conv = lock(&handle);
        let mut incoming: Vec<Mark> = f.history.iter().map(Mark::from).collect();
        incoming.push(Mark::from(&message(Role::User, "and one more thing")));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| black_box(align(&conv.entries, true, &incoming)))
        });
    }
    group.finish();

    // Fitting 5 recalled replies of 150 words (about 200 tokens each) into the default budget
    // of 500 tokens: the 4 not best cut to their passage. `none`: the same turns, no limit
    // (the baseline: nothing to do).
    let mut group = c.benchmark_group("fit_recalled_5x150_words");
    let mut rng = Rng::new(21);
    let turns: Vec<RecalledTurn> = (0..5)
        .map(|i| {
            let text = sentence(&mut rng, 150);
            RecalledTurn {
                turn: i * 7 + 1,
                score: 5.0 - i as f32,
                lexical: 5.0 - i as f32,
                semantic: None,
                when: false,
                tokens: tokens::count_message(Some("gpt-4o"), &text) + 20,
                line: format!(
                    "[earlier turn #{} at 2026-11-22T10:15:00Z] assistant: {text}",
                    i * 7 + 1
                ),
                elsewhere: None,
                excerpted: false,
            }
        })
        .collect();
    for (name, budget) in [("500", Some(500)), ("none", None)] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let mut fitted = turns.clone();
                fit_recalled(
                    &mut fitted,
                    QUESTION,
                    TextLanguage::Auto,
                    budget,
                    Some("gpt-4o"),
                );
                black_box(fitted)
            })
        });
    }
    group.finish();

    let text = sentence(&mut Rng::new(11), 60);
    c.bench_function("tokens_new_message_60_words", |b| {
        b.iter(|| black_box(tokens::count_message(Some("gpt-4o"), &text)))
    });

    // A commit of one exchange (user message + reply) with its group flush to disk.
    let f = fixture(runtime, 10);
    let mut rng = Rng::new(5);
    c.bench_function("commit_with_flush", |b| {
        b.iter(|| {
            let question = message(Role::User, &sentence(&mut rng, 12));
            let p = plan(
                f.state.memory().unwrap(),
                &f.key,
                None,
                &settings(),
                limits(&f.state),
                None,
                vec![question],
            )
            .unwrap();
            let reply = RawValue::from_string(
                json!({"role": "assistant", "content": sentence(&mut rng, 12)}).to_string(),
            )
            .unwrap();
            runtime
                .block_on(
                    p.exchange
                        .commit(Arc::clone(f.state.memory().unwrap()), reply),
                )
                .unwrap()
        })
    });
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // `cargo bench` passes --bench; `cargo test --benches` does not: skip the slow part then.
    if std::env::args().any(|a| a == "--bench") {
        percentiles(&runtime);
    }
    let mut criterion = Criterion::default().configure_from_args();
    benches(&mut criterion, &runtime);
    criterion.final_summary();
}
