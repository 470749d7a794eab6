//! The token ledger through the real proxy and the mock upstream: per exchange the tokens the
//! request would have sent without memproxy (`X-Memory-History-Tokens`), those forwarded, the
//! cached tokens the upstream reported and what summaries spent in the background; as
//! Prometheus counters per agent label (closed set), in the admin stats of a conversation and
//! of a tenant (kept in the store: they survive a restart, with sled and with Redis, and go
//! with an export); and the daily background budget per agent.

use prometheus_parse::{Scrape, Value as Sample};
use serde_json::{Value, json};

use crate::support::admin::*;
use crate::support::redis_server::RedisServer;
use crate::support::*;

async fn scrape(proxy: &Proxy) -> Scrape {
    let answer = send("GET", &proxy.url("/metrics"), &[], "").await;
    let text = String::from_utf8(answer.body.to_vec()).unwrap();
    Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap()
}

fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            Sample::Counter(v) | Sample::Gauge(v) | Sample::Untyped(v) => v,
            _ => panic!("{metric} is not a single value"),
        })
        .sum()
}

fn number(answer: &Answer, header: &str) -> u64 {
    answer.header(header).parse().unwrap()
}

#[tokio::test]
async fn the_ledger_is_counted_per_agent_label_with_cached_tokens() {
    let Started { proxy, .. } = Harness::new()
        .admin()
        .config("[agents.support]\nrecent_n = 4\n")
        .start()
        .await;

    let (mut history, mut forwarded, mut cached) = (0u64, 0u64, 0u64);
    let mut messages = Vec::new();
    for i in 0..4 {
        messages.push(user(&format!("support question {i} about invoices")));
        let answer = chat(
            &proxy,
            "ledger-support",
            &body(&messages),
            &[("x-memory-agent", "support"), ("x-mock-cached-tokens", "3")],
        )
        .await;
        assert_eq!(answer.status, 200);
        let (h, p) = (
            number(&answer, "x-memory-history-tokens"),
            number(&answer, "x-memory-prompt-tokens"),
        );
        assert!(h >= p, "history {h} < prompt {p}");
        history += h;
        forwarded += p;
        cached += 3;
        messages.push(reply_message(&answer));
    }
    // A stream: usage from its last chunk.
    let mut streamed = body(&[user("a streamed one")]);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let answer = chat(
        &proxy,
        "ledger-support-stream",
        &streamed,
        &[("x-memory-agent", "support"), ("x-mock-cached-tokens", "4")],
    )
    .await;
    history += number(&answer, "x-memory-history-tokens");
    forwarded += number(&answer, "x-memory-prompt-tokens");
    cached += 4;
    // An agent the config does not name counts as `other`.
    let answer = chat(
        &proxy,
        "ledger-other",
        &body(&[user("hello")]),
        &[
            ("x-memory-agent", "some-random-agent"),
            ("x-mock-cached-tokens", "2"),
        ],
    )
    .await;
    assert_eq!(answer.status, 200);

    let scrape = scrape(&proxy).await;
    let support = [("agent", "support")];
    assert_eq!(
        value(&scrape, "memproxy_ledger_history_tokens_total", &support),
        history as f64
    );
    assert_eq!(
        value(&scrape, "memproxy_ledger_forwarded_tokens_total", &support),
        forwarded as f64
    );
    assert_eq!(
        value(&scrape, "memproxy_ledger_cached_tokens_total", &support),
        cached as f64
    );
    assert_eq!(
        value(
            &scrape,
            "memproxy_ledger_cached_tokens_total",
            &[("agent", "other")]
        ),
        2.0
    );
    // Closed label sets: only the config's names and `other`.
    for sample in &scrape.samples {
        if let Some(agent) = sample.labels.get("agent") {
            assert!(
                agent == "support" || agent == "other",
                "{} has agent={agent}",
                sample.metric
            );
        }
    }
    for task in ["summary", "extraction"] {
        assert!(
            scrape
                .samples
                .iter()
                .any(|s| s.metric == "memproxy_background_budget_exhausted_total"
                    && s.labels.get("task") == Some(task)
                    && s.labels.get("agent") == Some("support")),
            "{task} series exists"
        );
    }
}

/// The ledger of a conversation and of a tenant, and after a restart the same.
async fn stats_survive_a_restart(storage: &str) {
    // The admin API on, memory where `storage` says.
    let ledger = || Harness::new().admin().storage(storage);
    let Started {
        mock, dir, proxy, ..
    } = ledger().start().await;
    let (mut history, mut forwarded) = (0u64, 0u64);
    for (conversation, n) in [("ledger-a", 3), ("ledger-b", 2)] {
        for i in 0..n {
            let answer = chat(
                &proxy,
                conversation,
                &body(&[user(&format!("message {i} of {conversation}"))]),
                &[("x-mock-cached-tokens", "5")],
            )
            .await;
            assert_eq!(answer.status, 200);
            history += number(&answer, "x-memory-history-tokens");
            forwarded += number(&answer, "x-memory-prompt-tokens");
        }
    }
    let path = conversation_path(TOKEN, "default", "ledger-a");
    let check = |stats: Value, tenant: Value| {
        let ledger = &stats["ledger"];
        assert_eq!(ledger["exchanges"], 3, "{stats}");
        assert_eq!(ledger["cached_tokens"], 15);
        assert!(ledger["forwarded_tokens"].as_u64().unwrap() > 0);
        assert_eq!(
            ledger["saved_tokens"].as_u64().unwrap(),
            ledger["history_tokens"].as_u64().unwrap()
                - ledger["forwarded_tokens"].as_u64().unwrap()
        );
        let all = &tenant["ledger"];
        assert_eq!(tenant["conversations"], 2, "{tenant}");
        assert_eq!(all["exchanges"], 5);
        assert_eq!(all["history_tokens"], history);
        assert_eq!(all["forwarded_tokens"], forwarded);
        assert_eq!(all["cached_tokens"], 25);
        assert_eq!(tenant["agents"]["default"]["exchanges"], 5);
    };
    let tenant_path = format!("/admin/v1/tenants/{}/stats", tenant(TOKEN));
    let stats = admin(&proxy, "GET", &format!("{path}/stats"), "")
        .await
        .json();
    let tenant_stats = admin(&proxy, "GET", &tenant_path, "").await;
    assert_eq!(tenant_stats.status, 200);
    check(stats, tenant_stats.json());
    proxy.stop().await;

    let proxy = ledger().proxy_on(&mock, dir.path()).await;
    let stats = admin(&proxy, "GET", &format!("{path}/stats"), "")
        .await
        .json();
    let tenant_stats = admin(&proxy, "GET", &tenant_path, "").await.json();
    check(stats, tenant_stats);

    // The ledger goes with an export into a new conversation.
    let export = admin(&proxy, "GET", &format!("{path}/export"), "").await;
    let copy = conversation_path(TOKEN, "default", "ledger-copy");
    let imported = admin(
        &proxy,
        "POST",
        &format!("{copy}/import"),
        std::str::from_utf8(&export.body).unwrap(),
    )
    .await;
    assert_eq!(imported.status, 200, "{:?}", imported.body);
    let copied = admin(&proxy, "GET", &format!("{copy}/stats"), "")
        .await
        .json();
    assert_eq!(copied["ledger"]["exchanges"], 3);
    assert_eq!(copied["ledger"]["cached_tokens"], 15);
    // So do each exchange's figures (the stats' cost chart), on the same replies.
    let original = admin(&proxy, "GET", &format!("{path}/stats"), "")
        .await
        .json();
    assert_eq!(original["exchanges"].as_array().unwrap().len(), 3);
    assert_eq!(copied["exchanges"], original["exchanges"]);
}

#[tokio::test]
async fn conversation_and_tenant_stats_show_the_ledger_and_survive_a_restart() {
    stats_survive_a_restart("").await;
}

#[tokio::test]
async fn with_redis_the_ledger_is_in_the_shared_store() {
    let redis = RedisServer::start();
    let storage = format!(
        "backend = \"redis\"\nredis_url = \"{}\"\nredis_key_prefix = \"mp:\"\n",
        redis.url()
    );
    stats_survive_a_restart(&storage).await;
}

const SUMMARIES: &str = "[memory]\nrecent_n = 4\ncompression_threshold_tokens = 150\nrelevance_enabled = false\ncompression_async = false\ncompression_interval = \"PT0S\"\n";

fn line(i: usize) -> String {
    format!("Fact number {i}: the blue lantern stands on shelf {i} in the north storeroom")
}

#[tokio::test]
async fn background_spend_is_counted_and_a_spent_daily_budget_stops_summaries() {
    let Started { mock, proxy, .. } = Harness::new().admin().config(&format!(
            "{SUMMARIES}[agents.rich]\ncompression_max_tokens_per_day = 100000000\n[compression]\nmax_tokens_per_day = 1\n"
        )).start().await;

    // The default agent (label `other`): its first summary spends past the budget of 1 token;
    // no summary call follows that day.
    for i in 0..30 {
        let answer = chat(&proxy, "budgeted", &body(&[user(&line(i))]), &[]).await;
        assert_eq!(answer.status, 200);
    }
    assert_eq!(mock.summary_requests().len(), 1, "stopped after the first");
    let scrape_now = scrape(&proxy).await;
    let other_summary = [("agent", "other"), ("task", "summary")];
    assert!(
        value(
            &scrape_now,
            "memproxy_ledger_background_tokens_total",
            &other_summary
        ) > 1.0
    );
    assert!(
        value(
            &scrape_now,
            "memproxy_background_budget_exhausted_total",
            &other_summary
        ) >= 1.0
    );
    let stats = admin(
        &proxy,
        "GET",
        &format!("{}/stats", conversation_path(TOKEN, "default", "budgeted")),
        "",
    )
    .await
    .json();
    assert!(
        stats["ledger"]["background_tokens"].as_u64().unwrap() > 1,
        "{stats}"
    );

    // A new conversation of the same label gets the heuristic stand-in, not a model summary.
    for i in 0..12 {
        chat(&proxy, "budgeted-2", &body(&[user(&line(i))]), &[]).await;
    }
    assert_eq!(mock.summary_requests().len(), 1);
    let last = mock.chat_requests().last().unwrap().json();
    let system: Vec<String> = last["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "system")
        .map(|m| m["content"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(
        system.iter().any(|c| c.contains("heuristic")),
        "the stand-in: {system:?}"
    );

    // An agent with a budget of its own goes on.
    for i in 0..30 {
        chat(
            &proxy,
            "rich-conversation",
            &body(&[user(&line(i))]),
            &[("x-memory-agent", "rich")],
        )
        .await;
    }
    assert!(
        mock.summary_requests().len() >= 3,
        "the rich agent's summaries"
    );
    let scrape_now = scrape(&proxy).await;
    assert!(
        value(
            &scrape_now,
            "memproxy_ledger_background_tokens_total",
            &[("agent", "rich"), ("task", "summary")]
        ) > 0.0
    );
    assert_eq!(
        value(
            &scrape_now,
            "memproxy_background_budget_exhausted_total",
            &[("agent", "rich"), ("task", "summary")]
        ),
        0.0
    );
}

#[tokio::test]
async fn a_budget_of_zero_or_a_bad_value_is_refused() {
    for (text, needle) in [
        (
            "[compression]\nmax_tokens_per_day = 0\n",
            "compression.max_tokens_per_day",
        ),
        (
            "[agents.a]\ncompression_max_tokens_per_day = \"lots\"\n",
            "agents.a.compression_max_tokens_per_day",
        ),
    ] {
        let err = memproxy::config::from_toml(text, &|_| None).unwrap_err();
        assert!(err.problems.join("\n").contains(needle), "{err:?}");
    }
    // And no header can lift a budget: it is no setting.
    assert!(memproxy::settings::kind_of("compression_max_tokens_per_day").is_none());
}

#[tokio::test]
async fn memory_extraction_spends_on_behalf_of_its_conversation() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let extra = [
        ("x-memory-user-id", "ana"),
        ("x-memory-extraction-every", "2"),
    ];
    for text in ["I live in Lisbon", "Please answer in bullet points"] {
        let answer = chat(&proxy, "extracted", &body(&[user(text)]), &extra).await;
        assert_eq!(answer.status, 200);
    }
    // The extraction runs in the background after the second exchange; the mock's answer
    // reports usage (2 tokens).
    let labels = [("agent", "other"), ("task", "extraction")];
    let mut spent = 0.0;
    for _ in 0..100 {
        spent = value(
            &scrape(&proxy).await,
            "memproxy_ledger_background_tokens_total",
            &labels,
        );
        if spent > 0.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(mock.extraction_requests().len(), 1);
    assert_eq!(spent, 2.0, "the usage of the extraction call");
    // The conversation's ledger takes it at its next commit.
    chat(&proxy, "extracted", &body(&[user("thanks")]), &extra).await;
    let stats = admin(
        &proxy,
        "GET",
        &format!("{}/stats", conversation_path(TOKEN, "default", "extracted")),
        "",
    )
    .await
    .json();
    assert_eq!(stats["ledger"]["background_tokens"], 2, "{stats}");
}
