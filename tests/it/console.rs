//! The console (`/admin/ui/`, `src/admin/ui.rs`) and the admin routes it reads: its files
//! served with their types and a strict Content-Security-Policy only when the admin API is on,
//! and the status, tenants, search, per-conversation receipts and per-exchange figures.
//! The pages themselves are clicked through in a real browser by `tests/e2e/test_console.py`.

use serde_json::{Value, json};

use crate::support::admin::*;
use crate::support::*;

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Stores `turns` exchanges in conversation `id` of the test token (agent `agent`); returns
/// each answer's receipt id.
async fn converse(proxy: &Proxy, agent: &str, id: &str, turns: usize) -> Vec<String> {
    let mut history = vec![json!({"role": "system", "content": "be brief"})];
    let mut receipts = Vec::new();
    for i in 1..=turns {
        history.push(user(&format!("{id} question number {i} about the harbour")));
        let answer = chat(proxy, id, &body(&history), &[("x-memory-agent", agent)]).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        receipts.push(answer.header("x-memory-receipt").to_string());
        history.push(reply_message(&answer));
    }
    receipts
}

fn ids(listing: &Value) -> Vec<String> {
    listing["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn console_files_are_served_with_their_types_and_a_strict_policy_and_no_cookie() {
    let Started { proxy, mock, .. } = Harness::new().admin().start().await;
    for (path, content_type) in [
        ("/admin/ui/", "text/html; charset=utf-8"),
        ("/admin/ui/app.js", "text/javascript; charset=utf-8"),
        ("/admin/ui/pages.js", "text/javascript; charset=utf-8"),
        ("/admin/ui/app.css", "text/css; charset=utf-8"),
        ("/admin/ui/icon.svg", "image/svg+xml"),
    ] {
        // No token: the files are the shell, with no data in them.
        let answer = send("GET", &proxy.url(path), &[], "").await;
        assert_eq!(answer.status, 200, "{path}");
        assert_eq!(answer.header("content-type"), content_type, "{path}");
        assert_eq!(answer.header("content-security-policy"), CSP, "{path}");
        assert_eq!(answer.header("x-content-type-options"), "nosniff");
        assert_eq!(answer.header("referrer-policy"), "no-referrer");
        assert_eq!(answer.header("x-frame-options"), "DENY");
        assert!(answer.headers.get("set-cookie").is_none(), "{path}");
        assert!(!answer.body.is_empty(), "{path}");
    }
    let page = send("GET", &proxy.url("/admin/ui/"), &[], "").await;
    let html = String::from_utf8_lossy(&page.body).to_string();
    for asset in ["app.js", "pages.js", "app.css", "icon.svg"] {
        assert!(html.contains(&format!("\"{asset}\"")), "{asset} linked");
    }
    assert!(!html.contains("<script>") && !html.contains("style=\""));

    let head = send("HEAD", &proxy.url("/admin/ui/app.js"), &[], "").await;
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    let bare = send("GET", &proxy.url("/admin/ui"), &[], "").await;
    assert_eq!(bare.status, 308);
    assert_eq!(bare.header("location"), "/admin/ui/");
    let missing = send("GET", &proxy.url("/admin/ui/secrets.json"), &[], "").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.header("content-security-policy"), CSP);
    let post = send("POST", &proxy.url("/admin/ui/"), &[], "x").await;
    assert_eq!(post.status, 405);
    assert_eq!(post.header("allow"), "GET, HEAD");
    // Climbing out of the console is refused before routing.
    let climb = send("GET", &proxy.url("/admin/ui/%2e%2e/v1/status"), &[], "").await;
    assert_eq!(climb.status, 400);
    assert_eq!(mock.recorded().len(), 0);
}

#[tokio::test]
async fn the_console_is_404_without_an_admin_token_and_its_data_401_without_the_token() {
    let Started {
        proxy: off,
        mock,
        dir,
        ..
    } = Harness::new().start().await;
    for path in ["/admin/ui/", "/admin/ui/app.js", "/admin/ui"] {
        let answer = send("GET", &off.url(path), &[], "").await;
        assert_eq!(answer.status, 404, "{path}");
        assert!(answer.headers.get("content-security-policy").is_none());
    }
    off.stop().await;

    let proxy = Harness::new().admin().proxy_on(&mock, dir.path()).await;
    for path in [
        "/admin/v1/status",
        "/admin/v1/tenants",
        "/admin/v1/conversations?q=abc",
    ] {
        for token in [None, Some("wrong")] {
            let answer = admin_as(&proxy, token, "GET", path, "").await;
            assert_eq!(answer.status, 401, "{path} {token:?}");
            assert_eq!(answer.json()["error"]["code"], "invalid_admin_token");
        }
    }
}

#[tokio::test]
async fn status_names_the_engine_and_says_memory_is_on() {
    let Started { proxy, redis, .. } = Harness::new().admin().start().await;
    let status = admin(&proxy, "GET", "/admin/v1/status", "").await;
    assert_eq!(status.status, 200);
    let status = status.json();
    let engine = match (&redis, std::env::var("MEMPROXY_TEST_BACKEND").as_deref()) {
        (Some(_), _) => "redis",
        (None, Ok("fjall")) => "fjall",
        (None, _) => "sled",
    };
    assert_eq!(status["storage"], engine);
    assert_eq!(status["store"], json!({"available": true, "reason": null}));
    assert_eq!(status["memory"], "on");
    assert_eq!(status["receipts"]["enabled"], true);
    let post = admin(&proxy, "POST", "/admin/v1/status", "").await;
    assert_eq!(post.status, 405);

    // Past the memory high-water mark, memory is degraded for new requests: the status says so.
    let state = &proxy.state;
    state
        .memory_guard
        .pretend_resident(Some(state.memory_guard.budget().high_water));
    let status = admin(&proxy, "GET", "/admin/v1/status", "").await.json();
    assert_eq!(status["memory"], "degraded");
}

#[tokio::test]
async fn the_listing_searches_by_id_and_pages_the_matches() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    for id in ["alpha-1", "beta-1", "alpha-2", "ALPHA-3", "gamma"] {
        converse(&proxy, "default", id, 1).await;
    }
    let found = admin(&proxy, "GET", "/admin/v1/conversations?q=alpha", "").await;
    assert_eq!(found.status, 200);
    assert_eq!(ids(&found.json()), ["ALPHA-3", "alpha-1", "alpha-2"]);

    let first = admin(&proxy, "GET", "/admin/v1/conversations?q=alpha&limit=2", "")
        .await
        .json();
    assert_eq!(ids(&first), ["ALPHA-3", "alpha-1"]);
    let cursor = first["next_cursor"].as_str().unwrap();
    let second = admin(
        &proxy,
        "GET",
        &format!("/admin/v1/conversations?q=alpha&limit=2&cursor={cursor}"),
        "",
    )
    .await
    .json();
    assert_eq!(ids(&second), ["alpha-2"]);
    assert!(second["next_cursor"].is_null());

    let other_agent = admin(
        &proxy,
        "GET",
        "/admin/v1/conversations?q=alpha&agent=support",
        "",
    )
    .await
    .json();
    assert_eq!(ids(&other_agent), Vec::<String>::new());

    let bad = admin(&proxy, "GET", "/admin/v1/conversations?q=a%20b", "").await;
    assert_eq!(bad.status, 400);
    assert!(
        bad.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`q`")
    );
}

#[tokio::test]
async fn tenants_lists_each_tenant_with_its_agents() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let empty = admin(&proxy, "GET", "/admin/v1/tenants", "").await;
    assert_eq!(empty.json(), json!({"tenants": []}));
    converse(&proxy, "default", "c1", 1).await;
    converse(&proxy, "default", "c2", 1).await;
    converse(&proxy, "support", "c3", 1).await;
    let answer = chat_as(&proxy, "sk-test-other", "c9", &body(&[user("hello")]), &[]).await;
    assert_eq!(answer.status, 200);
    let listed = admin(&proxy, "GET", "/admin/v1/tenants", "").await.json();
    let mut expected = vec![
        json!({"tenant": tenant(TOKEN), "conversations": 3, "agents": {"default": 2, "support": 1}}),
        json!({"tenant": tenant("sk-test-other"), "conversations": 1, "agents": {"default": 1}}),
    ];
    expected.sort_by_key(|t| t["tenant"].as_str().unwrap().to_string());
    assert_eq!(listed, json!({ "tenants": expected }));
}

#[tokio::test]
async fn a_conversations_receipts_are_listed_newest_first_and_only_its_own() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let mine = converse(&proxy, "default", "c1", 3).await;
    converse(&proxy, "default", "c2", 1).await;
    let path = conversation_path(TOKEN, "default", "c1");
    let listed = admin(&proxy, "GET", &format!("{path}/receipts"), "").await;
    assert_eq!(listed.status, 200);
    let listed = listed.json();
    assert_eq!(listed["receipts_enabled"], true);
    let receipts = listed["receipts"].as_array().unwrap();
    let listed_ids: Vec<&str> = receipts.iter().map(|r| r["id"].as_str().unwrap()).collect();
    let newest_first: Vec<&str> = mine.iter().rev().map(String::as_str).collect();
    assert_eq!(listed_ids, newest_first);
    for brief in receipts {
        let id = brief["id"].as_str().unwrap();
        let whole = admin(&proxy, "GET", &format!("/admin/v1/receipts/{id}"), "")
            .await
            .json();
        assert_eq!(brief["prompt_tokens"], whole["prompt"]["tokens"]);
        assert_eq!(brief["history_tokens"], whole["history_tokens"]);
        assert_eq!(brief["status"], 200);
        assert_eq!(brief["api"], "chat");
        assert!(brief.get("forwarded").is_none(), "a brief holds no body");
    }
    let limited = admin(&proxy, "GET", &format!("{path}/receipts?limit=1"), "")
        .await
        .json();
    assert_eq!(limited["receipts"].as_array().unwrap().len(), 1);
    assert_eq!(limited["receipts"][0]["id"], mine[2]);
    let bad = admin(&proxy, "GET", &format!("{path}/receipts?limit=0"), "").await;
    assert_eq!(bad.status, 400);

    // Another tenant's conversation of the same name has none of them.
    let theirs = conversation_path("sk-test-other", "default", "c1");
    let none = admin(&proxy, "GET", &format!("{theirs}/receipts"), "")
        .await
        .json();
    assert_eq!(none["receipts"], json!([]));

    // A deleted conversation's receipts go with it.
    assert_eq!(admin(&proxy, "DELETE", &path, "").await.status, 200);
    let gone = admin(&proxy, "GET", &format!("{path}/receipts"), "")
        .await
        .json();
    assert_eq!(gone["receipts"], json!([]));
}

#[tokio::test]
async fn stats_give_each_exchanges_figures_adding_up_to_the_ledger() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let receipts = converse(&proxy, "default", "c1", 4).await;
    let path = conversation_path(TOKEN, "default", "c1");
    let stats = admin(&proxy, "GET", &format!("{path}/stats"), "")
        .await
        .json();
    let exchanges = stats["exchanges"].as_array().unwrap();
    assert_eq!(exchanges.len(), 4);
    let turns: Vec<u64> = exchanges
        .iter()
        .map(|e| e["turn"].as_u64().unwrap())
        .collect();
    // The instructions are not turns; each exchange stores a question and its reply.
    assert_eq!(turns, [2, 4, 6, 8]);
    let sum = |field: &str| -> u64 { exchanges.iter().map(|e| e[field].as_u64().unwrap()).sum() };
    assert_eq!(sum("forwarded_tokens"), stats["ledger"]["forwarded_tokens"]);
    assert_eq!(sum("history_tokens"), stats["ledger"]["history_tokens"]);
    assert_eq!(sum("cached_tokens"), stats["ledger"]["cached_tokens"]);
    // Each point is its exchange's receipt's figures.
    for (point, id) in exchanges.iter().zip(&receipts) {
        let receipt = admin(&proxy, "GET", &format!("/admin/v1/receipts/{id}"), "")
            .await
            .json();
        assert_eq!(point["forwarded_tokens"], receipt["prompt"]["tokens"]);
        assert_eq!(point["history_tokens"], receipt["history_tokens"]);
    }
    // The history grows with every exchange.
    assert!(
        exchanges
            .windows(2)
            .all(|w| w[0]["history_tokens"].as_u64() < w[1]["history_tokens"].as_u64())
    );
}

#[tokio::test]
async fn a_users_memories_carry_their_decay_and_a_search_is_form_decoded() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let base = format!("/admin/v1/users/{}/u1/memories", tenant(TOKEN));
    let made = admin(
        &proxy,
        "POST",
        &base,
        r#"{"text": "The user lives in Lisbon, by the river", "type": "profile"}"#,
    )
    .await;
    assert_eq!(made.status, 200, "{:?}", made.body);
    let listed = admin(&proxy, "GET", &base, "").await.json();
    let decay = listed["memories"][0]["decay"].as_f64().unwrap();
    assert!((0.99..=1.0).contains(&decay), "{decay}");
    let found = admin(&proxy, "GET", &format!("{base}?q=Lisbon%2C+river"), "")
        .await
        .json();
    assert_eq!(found["query"], "Lisbon, river");
    assert_eq!(found["memories"].as_array().unwrap().len(), 1);
    let bad = admin(&proxy, "GET", &format!("{base}?q=%E2%28"), "").await;
    assert_eq!(bad.status, 400);
}
