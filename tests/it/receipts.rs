//! Receipts through the real proxy and the mock upstream: every memory-on answer names one
//! (`X-Memory-Receipt`), and `GET /admin/v1/receipts/{id}` gives the exact body the upstream
//! received (chat completions, streamed or not, the Responses API, Anthropic Messages), its
//! SHA-256, the prompt's parts, the usage; receipts are tenant-checked, expire, stay within
//! their bytes, and can be turned off; a replay returns the upstream's answer and stores
//! nothing.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::support;
use crate::support::admin::*;
use crate::support::mock_upstream::Recorded;
use crate::support::*;

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn receipt(proxy: &Proxy, answer: &Answer) -> Value {
    let id = answer.header("x-memory-receipt");
    let got = admin(proxy, "GET", &format!("/admin/v1/receipts/{id}"), "").await;
    assert_eq!(got.status, 200, "{:?}", String::from_utf8_lossy(&got.body));
    got.json()
}

/// Checks the receipt's body is byte for byte what the upstream got, and its digest.
fn assert_same_body(receipt: &Value, recorded: &Recorded) {
    let body = receipt["forwarded"]["body"].as_str().unwrap();
    assert_eq!(body.as_bytes(), &recorded.body[..], "the forwarded bytes");
    assert_eq!(receipt["forwarded"]["bytes"], recorded.body.len());
    assert_eq!(receipt["forwarded"]["sha256"], sha256_hex(&recorded.body));
}

async fn post(proxy: &Proxy, path: &str, headers: &[(&str, &str)], body: &Value) -> Answer {
    send("POST", &proxy.url(path), headers, body.to_string()).await
}

/// Replays the receipt `id` with the admin token, the client's credential being `client` (an
/// `Authorization` value).
async fn replay_as(proxy: &Proxy, id: &str, client: &str) -> Answer {
    send(
        "POST",
        &proxy.url(&format!("/admin/v1/receipts/{id}/replay")),
        &[
            ("authorization", &format!("Bearer {ADMIN_TOKEN}")),
            ("x-memory-upstream-authorization", client),
        ],
        "",
    )
    .await
}

#[tokio::test]
async fn a_receipt_holds_the_bytes_the_upstream_received_in_every_api() {
    let Started { mock, proxy, .. } = Harness::new().admin().anthropic_to_the_mock().start().await;
    let cached = [("x-mock-cached-tokens", "7")];

    // Chat completions, JSON: a system prompt, three turns so the window is stored messages.
    let mut history = vec![json!({"role": "system", "content": "You are terse."})];
    let mut last = None;
    for text in ["my cat is Miso", "I live in Lyon", "what is my cat called?"] {
        history.push(user(text));
        let answer = chat(&proxy, "receipt-chat", &body(&history), &cached).await;
        assert_eq!(answer.status, 200);
        history.push(reply_message(&answer));
        last = Some(answer);
    }
    let answer = last.unwrap();
    let chat_receipt = receipt(&proxy, &answer).await;
    assert_same_body(&chat_receipt, mock.chat_requests().last().unwrap());
    assert_eq!(chat_receipt["api"], "chat");
    assert_eq!(chat_receipt["conversation"], "receipt-chat");
    assert_eq!(chat_receipt["tenant"], tenant(TOKEN));
    let prompt = &chat_receipt["prompt"];
    assert_eq!(
        prompt["instructions"]["messages"][0]["content"],
        "You are terse."
    );
    assert!(prompt["instructions"]["tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        prompt["new"]["messages"][0]["content"],
        "what is my cat called?"
    );
    assert_eq!(prompt["window"]["messages"].as_array().unwrap().len(), 4);
    assert!(prompt["window"]["tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        prompt["tokens"].as_u64().unwrap(),
        answer
            .header("x-memory-prompt-tokens")
            .parse::<u64>()
            .unwrap()
    );
    assert_eq!(
        chat_receipt["history_tokens"].as_u64().unwrap(),
        answer
            .header("x-memory-history-tokens")
            .parse::<u64>()
            .unwrap()
    );
    let upstream = &chat_receipt["upstream"];
    assert_eq!(upstream["status"], 200);
    assert_eq!(upstream["ended"], "complete");
    assert_eq!(upstream["stream"], false);
    assert_eq!(upstream["usage"]["cached_tokens"], 7);
    assert_eq!(upstream["memory_status"], "stored");
    assert!(upstream["latency_ms"].as_f64().is_some());
    assert_eq!(chat_receipt["settings"]["recent_n"], "10");
    // No credential in the receipt.
    let text = chat_receipt.to_string();
    assert!(
        !text.contains(TOKEN),
        "the client's key is never in a receipt"
    );

    // Chat completions, streamed, usage in the last chunk.
    let mut streamed = body(&[user("tell me about Lyon")]);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let answer = chat(&proxy, "receipt-stream", &streamed, &cached).await;
    assert_eq!(answer.status, 200);
    let stream_receipt = receipt(&proxy, &answer).await;
    assert_same_body(&stream_receipt, mock.chat_requests().last().unwrap());
    assert_eq!(stream_receipt["upstream"]["stream"], true);
    assert_eq!(stream_receipt["upstream"]["ended"], "complete");
    assert_eq!(stream_receipt["upstream"]["usage"]["cached_tokens"], 7);

    // The Responses API, JSON and streamed.
    let headers = [
        ("authorization", "Bearer sk-test-one"),
        ("content-type", "application/json"),
        ("x-memory-conversation-id", "receipt-responses"),
        ("x-mock-cached-tokens", "5"),
    ];
    let request = json!({"model": "gpt-4o-mini", "input": "hello there"});
    let answer = post(&proxy, "/v1/responses", &headers, &request).await;
    assert_eq!(answer.status, 200);
    let responses_receipt = receipt(&proxy, &answer).await;
    assert_same_body(
        &responses_receipt,
        mock.responses_requests().last().unwrap(),
    );
    assert_eq!(responses_receipt["api"], "responses");
    assert_eq!(responses_receipt["upstream"]["usage"]["cached_tokens"], 5);
    let request = json!({"model": "gpt-4o-mini", "input": "and again", "stream": true});
    let answer = post(&proxy, "/v1/responses", &headers, &request).await;
    let responses_stream = receipt(&proxy, &answer).await;
    assert_same_body(&responses_stream, mock.responses_requests().last().unwrap());
    assert_eq!(responses_stream["upstream"]["ended"], "complete");
    assert_eq!(responses_stream["upstream"]["usage"]["cached_tokens"], 5);

    // Anthropic Messages, JSON and streamed: cache_read_input_tokens.
    let headers = [
        ("x-api-key", "sk-ant-test"),
        ("anthropic-version", "2023-06-01"),
        ("content-type", "application/json"),
        ("x-memory-conversation-id", "receipt-anthropic"),
        ("x-mock-cached-tokens", "9"),
    ];
    let request = json!({"model": "claude-mock", "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi claude"}]});
    let answer = post(&proxy, "/v1/messages", &headers, &request).await;
    assert_eq!(answer.status, 200);
    let anthropic_receipt = receipt(&proxy, &answer).await;
    assert_same_body(
        &anthropic_receipt,
        mock.anthropic_requests().last().unwrap(),
    );
    assert_eq!(anthropic_receipt["api"], "anthropic");
    assert_eq!(anthropic_receipt["upstream"]["usage"]["cached_tokens"], 9);
    let mut request = request.clone();
    request["stream"] = json!(true);
    request["messages"] = json!([{"role": "user", "content": "stream it"}]);
    let answer = post(&proxy, "/v1/messages", &headers, &request).await;
    let anthropic_stream = receipt(&proxy, &answer).await;
    assert_same_body(&anthropic_stream, mock.anthropic_requests().last().unwrap());
    assert_eq!(anthropic_stream["upstream"]["stream"], true);
    assert_eq!(anthropic_stream["upstream"]["usage"]["cached_tokens"], 9);
    assert_eq!(
        anthropic_stream["upstream"]["usage"]["output_tokens"], 1,
        "from message_delta"
    );

    // Receipt ids are distinct and unguessable-looking; an unknown one is 404.
    let ids: std::collections::HashSet<String> = [
        &chat_receipt,
        &stream_receipt,
        &responses_receipt,
        &anthropic_receipt,
    ]
    .iter()
    .map(|r| r["id"].as_str().unwrap().to_string())
    .collect();
    assert_eq!(ids.len(), 4);
    let missing = admin(&proxy, "GET", "/admin/v1/receipts/rcpt_0000", "").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["code"], "not_found");
    // The admin token is required.
    let id = chat_receipt["id"].as_str().unwrap();
    let anonymous = admin_as(&proxy, None, "GET", &format!("/admin/v1/receipts/{id}"), "").await;
    assert_eq!(anonymous.status, 401);
}

#[tokio::test]
async fn a_receipt_names_the_recalled_turns_the_summary_and_what_the_budget_dropped() {
    let Started { proxy, .. } = Harness::new()
        .admin()
        .config("[memory]\nrecent_n = 2\ncompression_threshold_tokens = 60\ncompression_async = false\ncompression_interval = \"PT0S\"\n")
        .start()
        .await;
    let topics = [
        "the lighthouse keeper named Orsolya paints seagulls",
        "my favourite pasta shape is orecchiette with broccoli",
        "the quarterly invoice number is INV-88213",
        "our staging database runs on port 6543",
        "the dog's vet appointment moved to Thursday",
        "we ship the desktop release on the ninth",
    ];
    for text in topics {
        let answer = chat(&proxy, "receipt-parts", &body(&[user(text)]), &[]).await;
        assert_eq!(answer.status, 200);
    }
    let question = body(&[user("what does Orsolya the lighthouse keeper paint?")]);
    let answer = chat(&proxy, "receipt-parts", &question, &[]).await;
    let parts = receipt(&proxy, &answer).await;
    let prompt = &parts["prompt"];
    let recalled = &prompt["recalled"];
    assert!(recalled.is_object(), "{prompt}");
    let turns = recalled["turns"].as_array().unwrap();
    assert!(turns.iter().any(|t| t["turn"] == 1), "{recalled}");
    assert!(turns.iter().all(|t| t["score"].as_f64().unwrap() > 0.0));
    assert!(recalled["tokens"].as_u64().unwrap() > 0);
    let summary = &prompt["summary"];
    assert!(summary.is_object(), "a summary was made: {prompt}");
    assert!(summary["covers"]["to_turn"].as_u64().unwrap() >= 1);
    assert!(summary["tokens"].as_u64().unwrap() > 0);

    // A budget that cannot take the recalled turns drops them, by name.
    let tight = body(&[user("what does Orsolya the lighthouse keeper paint?")]);
    let answer = chat(
        &proxy,
        "receipt-parts",
        &tight,
        &[("x-memory-max-context-tokens", "1")],
    )
    .await;
    let tight_receipt = receipt(&proxy, &answer).await;
    let budget = &tight_receipt["budget"];
    assert_eq!(budget["verdict"], "exceeded");
    let dropped = budget["dropped"]["recalled"].as_array().unwrap();
    assert!(dropped.iter().any(|d| d["turn"] == 1), "{budget}");
    assert!(
        !budget["dropped"]["window_turns"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{budget}"
    );
    assert!(tight_receipt["prompt"]["recalled"].is_null());
}

#[tokio::test]
async fn receipts_are_tenant_checked() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let answer = chat_as(
        &proxy,
        "sk-tenant-a",
        "mine",
        &body(&[user("secret of A")]),
        &[],
    )
    .await;
    let id = answer.header("x-memory-receipt").to_string();
    let path = format!("/admin/v1/receipts/{id}");
    let as_b = admin(
        &proxy,
        "GET",
        &format!("{path}?tenant={}", tenant("sk-tenant-b")),
        "",
    )
    .await;
    assert_eq!(
        as_b.status, 404,
        "tenant B's scope does not see A's receipt"
    );
    assert!(!String::from_utf8_lossy(&as_b.body).contains("secret of A"));
    let as_a = admin(
        &proxy,
        "GET",
        &format!("{path}?tenant={}", tenant("sk-tenant-a")),
        "",
    )
    .await;
    assert_eq!(as_a.status, 200);
    // A replay with tenant B's credential is refused; nothing reaches the upstream.
    let before = mock.chat_requests().len();
    let replay = replay_as(&proxy, &id, "Bearer sk-tenant-b").await;
    assert_eq!(replay.status, 403);
    assert_eq!(replay.json()["error"]["code"], "forbidden");
    assert_eq!(mock.chat_requests().len(), before);
}

#[tokio::test]
async fn a_replay_returns_the_upstream_answer_and_stores_nothing() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let first = chat(&proxy, "replayed", &body(&[user("first question")]), &[]).await;
    let id = first.header("x-memory-receipt").to_string();
    let original = mock.chat_requests().last().unwrap().clone();
    let stored = proxy.stored(Some(TOKEN), "replayed").len();
    let replay_path = proxy.url(&format!("/admin/v1/receipts/{id}/replay"));
    let admin_auth = format!("Bearer {ADMIN_TOKEN}");

    // memproxy holds no upstream key: the client's credential is required.
    let refused = send("POST", &replay_path, &[("authorization", &admin_auth)], "").await;
    assert_eq!(refused.status, 400);
    assert!(
        refused.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x-memory-upstream-authorization")
    );

    let replay = replay_as(&proxy, &id, &format!("Bearer {TOKEN}")).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("x-memory-replay-of"), id);
    assert_eq!(
        replay.json()["choices"][0]["message"]["content"],
        "reply to: first question"
    );
    let resent = mock.chat_requests().last().unwrap().clone();
    assert_eq!(resent.body, original.body, "the identical body");
    assert_eq!(
        resent.headers["authorization"],
        format!("Bearer {TOKEN}").as_str()
    );
    assert!(
        !resent
            .headers
            .contains_key("x-memory-upstream-authorization")
    );
    // Nothing stored: the conversation is as it was, and no new receipt.
    assert_eq!(proxy.stored(Some(TOKEN), "replayed").len(), stored);
    assert!(replay.headers.get("x-memory-receipt").is_none());

    // A streamed exchange replays as a stream.
    let mut streamed = body(&[user("stream this")]);
    streamed["stream"] = json!(true);
    let answer = chat(&proxy, "replayed", &streamed, &[]).await;
    let id = answer.header("x-memory-receipt").to_string();
    let replay = replay_as(&proxy, &id, &format!("Bearer {TOKEN}")).await;
    assert!(
        replay
            .header("content-type")
            .starts_with("text/event-stream")
    );
    assert!(String::from_utf8_lossy(&replay.body).contains("[DONE]"));
}

#[tokio::test]
async fn with_its_own_upstream_key_memproxy_replays_without_the_clients() {
    let Started { mock, proxy, .. } = Harness::new()
        .admin()
        .upstream("api_key_env = \"UPSTREAM_KEY\"\n")
        .env("UPSTREAM_KEY", "sk-proxy-own")
        .start()
        .await;
    let answer = chat(&proxy, "keyed", &body(&[user("hello")]), &[]).await;
    let id = answer.header("x-memory-receipt").to_string();
    let replay = admin(
        &proxy,
        "POST",
        &format!("/admin/v1/receipts/{id}/replay"),
        "",
    )
    .await;
    assert_eq!(replay.status, 200);
    assert_eq!(
        mock.chat_requests().last().unwrap().headers["authorization"],
        "Bearer sk-proxy-own"
    );
}

#[tokio::test]
async fn receipts_expire_after_their_retention() {
    let Started { proxy, .. } = Harness::new()
        .admin()
        .config("[receipts]\nretention = \"PT1S\"\n")
        .start()
        .await;
    let answer = chat(&proxy, "short-lived", &body(&[user("hello")]), &[]).await;
    let id = answer.header("x-memory-receipt").to_string();
    let path = format!("/admin/v1/receipts/{id}");
    assert_eq!(admin(&proxy, "GET", &path, "").await.status, 200);
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert_eq!(admin(&proxy, "GET", &path, "").await.status, 404);
}

#[tokio::test]
async fn receipts_stay_within_their_bytes_the_newest_kept() {
    let Started { proxy, .. } = Harness::new()
        .admin()
        .config("[receipts]\nmax_bytes = \"256KiB\"\n")
        .start()
        .await;
    let mut ids = Vec::new();
    for i in 0..12 {
        let text = format!("{i} {}", "filler words for a large body ".repeat(1000));
        let answer = chat(&proxy, &format!("big-{i}"), &body(&[user(&text)]), &[]).await;
        ids.push(answer.header("x-memory-receipt").to_string());
    }
    let scrape = send("GET", &proxy.url("/metrics"), &[], "").await;
    let text = String::from_utf8_lossy(&scrape.body).to_string();
    let bytes: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("memproxy_receipts_bytes "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(bytes > 0.0 && bytes <= 256.0 * 1024.0, "{bytes}");
    let newest = admin(
        &proxy,
        "GET",
        &format!("/admin/v1/receipts/{}", ids[11]),
        "",
    )
    .await;
    assert_eq!(newest.status, 200);
    let oldest = admin(&proxy, "GET", &format!("/admin/v1/receipts/{}", ids[0]), "").await;
    assert_eq!(oldest.status, 404, "pushed out by newer ones");
}

#[tokio::test]
async fn receipts_can_be_turned_off() {
    for off in [
        "[receipts]\nretention = \"PT0S\"\n",
        "[receipts]\nenabled = false\n",
    ] {
        let Started { proxy, .. } = Harness::new().admin().config(off).start().await;
        let answer = chat(&proxy, "off", &body(&[user("hello")]), &[]).await;
        assert_eq!(answer.status, 200);
        assert!(answer.headers.get("x-memory-receipt").is_none(), "{off}");
        assert_eq!(answer.header("x-memory-status"), "stored");
        let got = admin(&proxy, "GET", "/admin/v1/receipts/rcpt_1", "").await;
        assert_eq!(got.status, 404);
    }
}

#[tokio::test]
async fn a_request_without_memory_has_no_receipt() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let answer = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[
            ("authorization", "Bearer sk-test-one"),
            ("content-type", "application/json"),
        ],
        body(&[user("no conversation id")]).to_string(),
    )
    .await;
    assert_eq!(answer.status, 200);
    assert!(answer.headers.get("x-memory-receipt").is_none());
}

#[tokio::test]
async fn deleting_a_conversation_drops_its_receipts() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let gone = chat(&proxy, "to-delete", &body(&[user("delete me")]), &[]).await;
    let kept = chat(&proxy, "to-keep", &body(&[user("keep me")]), &[]).await;
    let path =
        |answer: &Answer| format!("/admin/v1/receipts/{}", answer.header("x-memory-receipt"));
    let deleted = admin(
        &proxy,
        "DELETE",
        &conversation_path(TOKEN, "default", "to-delete"),
        "",
    )
    .await;
    assert_eq!(deleted.status, 200);
    assert_eq!(admin(&proxy, "GET", &path(&gone), "").await.status, 404);
    assert_eq!(admin(&proxy, "GET", &path(&kept), "").await.status, 200);
    let tenant_deleted = admin(
        &proxy,
        "DELETE",
        &format!("/admin/v1/tenants/{}", tenant(TOKEN)),
        "",
    )
    .await;
    assert_eq!(tenant_deleted.status, 200);
    assert_eq!(admin(&proxy, "GET", &path(&kept), "").await.status, 404);
}

/// Polls the receipt at `path` until its exchange ended (bounded: 5 s).
async fn ended_receipt(proxy: &Proxy, path: &str) -> Value {
    for _ in 0..50 {
        let got = admin(proxy, "GET", path, "").await;
        assert_eq!(got.status, 200);
        let receipt = got.json();
        if !receipt["upstream"]["ended"].is_null() {
            return receipt;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the receipt at {path} never ended");
}

/// Checks a degraded exchange's receipt: the forwarded body (the client's own), the reason,
/// the client's messages as its only parts, how it went.
fn assert_degraded_receipt(receipt: &Value, recorded: &Recorded, new_messages: usize) {
    assert_same_body(receipt, recorded);
    let upstream = &receipt["upstream"];
    assert_eq!(upstream["memory_status"], "degraded", "{upstream}");
    assert_eq!(upstream["memory_reason"], "store-error");
    assert_eq!(upstream["status"], 200);
    assert_eq!(upstream["ended"], "complete");
    assert!(upstream["latency_ms"].as_f64().is_some());
    let prompt = &receipt["prompt"];
    assert_eq!(
        prompt["new"]["messages"].as_array().unwrap().len(),
        new_messages,
        "{prompt}"
    );
    assert!(prompt["new"]["tokens"].as_u64().unwrap() > 0);
    assert!(prompt["window"]["messages"].as_array().unwrap().is_empty());
    for absent in ["summary", "recalled", "memories"] {
        assert!(prompt[absent].is_null(), "{absent}: {prompt}");
    }
    assert_eq!(prompt["tokens"], receipt["history_tokens"]);
}

#[tokio::test]
async fn a_degraded_request_has_a_receipt_in_every_api_and_replays() {
    let chat_headers = |conversation: &'static str| {
        [
            ("authorization", "Bearer sk-test-one"),
            ("content-type", "application/json"),
            ("x-memory-conversation-id", conversation),
            ("x-mock-cached-tokens", "5"),
        ]
    };
    let anthropic_headers = [
        ("x-api-key", "sk-ant-test"),
        ("anthropic-version", "2023-06-01"),
        ("content-type", "application/json"),
        ("x-memory-conversation-id", "degraded-anthropic"),
        ("x-mock-cached-tokens", "9"),
    ];
    let anthropic_request = |text: &str| {
        json!({"model": "claude-mock", "max_tokens": 64, "stream": true,
            "messages": [{"role": "user", "content": text}]})
    };
    // One stored exchange in each API's conversation, then their keys lost: reading them
    // fails (`store-error`), as in `tests/it/store_damage.rs`.
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().admin().anthropic_to_the_mock().start().await;
    let stored = chat(&proxy, "degraded-chat", &body(&[user("first")]), &[]).await;
    assert_eq!(stored.header("x-memory-status"), "stored");
    let request = json!({"model": "gpt-4o-mini", "input": "first"});
    let stored = post(
        &proxy,
        "/v1/responses",
        &chat_headers("degraded-responses"),
        &request,
    )
    .await;
    assert_eq!(stored.header("x-memory-status"), "stored");
    let stored = post(
        &proxy,
        "/v1/messages",
        &anthropic_headers,
        &anthropic_request("first"),
    )
    .await;
    assert_eq!(stored.header("x-memory-status"), "stored");
    proxy.stop().await;
    for file in std::fs::read_dir(dir.path().join("keys")).unwrap() {
        std::fs::remove_file(file.unwrap().path()).unwrap();
    }
    let proxy = Harness::new()
        .admin()
        .anthropic_to_the_mock()
        .proxy_on(&mock, dir.path())
        .await;
    let degraded = |answer: &Answer| {
        assert_eq!(answer.status, 200);
        assert_eq!(answer.header("x-memory-status"), "degraded");
        assert_eq!(answer.header("x-memory-reason"), "store-error");
    };

    // Chat completions, JSON: the client's own messages went upstream, as the receipt says.
    let own = vec![
        json!({"role": "system", "content": "You are terse."}),
        user("an earlier question"),
        assistant("an earlier answer"),
        user("the new question"),
    ];
    let answer = chat(
        &proxy,
        "degraded-chat",
        &body(&own),
        &[("x-mock-cached-tokens", "5")],
    )
    .await;
    degraded(&answer);
    assert_eq!(mock.last_messages(), own);
    let json_receipt = receipt(&proxy, &answer).await;
    assert_degraded_receipt(&json_receipt, mock.chat_requests().last().unwrap(), 3);
    assert_eq!(
        json_receipt["prompt"]["instructions"]["messages"][0]["content"],
        "You are terse."
    );
    assert_eq!(json_receipt["upstream"]["stream"], false);
    assert_eq!(json_receipt["upstream"]["usage"]["cached_tokens"], 5);
    assert_eq!(
        json_receipt["prompt"]["new"]["messages"][2]["content"],
        "the new question"
    );

    // Chat completions, streamed: the usage read from the stream as it passed.
    let mut streamed = body(&[user("stream without memory")]);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let answer = chat(
        &proxy,
        "degraded-chat",
        &streamed,
        &[("x-mock-cached-tokens", "5")],
    )
    .await;
    degraded(&answer);
    assert!(String::from_utf8_lossy(&answer.body).contains("[DONE]"));
    let stream_receipt = receipt(&proxy, &answer).await;
    assert_degraded_receipt(&stream_receipt, mock.chat_requests().last().unwrap(), 1);
    assert_eq!(stream_receipt["upstream"]["stream"], true);
    assert_eq!(stream_receipt["upstream"]["usage"]["cached_tokens"], 5);

    // The Responses API, JSON.
    let request = json!({"model": "gpt-4o-mini", "input": "second"});
    let answer = post(
        &proxy,
        "/v1/responses",
        &chat_headers("degraded-responses"),
        &request,
    )
    .await;
    degraded(&answer);
    let responses_receipt = receipt(&proxy, &answer).await;
    assert_degraded_receipt(
        &responses_receipt,
        mock.responses_requests().last().unwrap(),
        1,
    );
    assert_eq!(responses_receipt["api"], "responses");
    assert_eq!(responses_receipt["upstream"]["usage"]["cached_tokens"], 5);

    // Anthropic Messages, streamed.
    let answer = post(
        &proxy,
        "/v1/messages",
        &anthropic_headers,
        &anthropic_request("second"),
    )
    .await;
    degraded(&answer);
    let anthropic_receipt = receipt(&proxy, &answer).await;
    assert_degraded_receipt(
        &anthropic_receipt,
        mock.anthropic_requests().last().unwrap(),
        1,
    );
    assert_eq!(anthropic_receipt["api"], "anthropic");
    assert_eq!(anthropic_receipt["upstream"]["usage"]["cached_tokens"], 9);
    assert!(!anthropic_receipt.to_string().contains("sk-ant-test"));

    // A degraded receipt replays: the identical body again, nothing stored.
    let id = json_receipt["id"].as_str().unwrap();
    let replay = replay_as(&proxy, id, "Bearer sk-test-one").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("x-memory-replay-of"), id);
    assert_eq!(
        replay.json()["choices"][0]["message"]["content"],
        "reply to: the new question"
    );
    let resent = mock.chat_requests().last().unwrap().clone();
    assert_eq!(
        resent.body.as_ref(),
        json_receipt["forwarded"]["body"]
            .as_str()
            .unwrap()
            .as_bytes()
    );
}

#[tokio::test]
async fn a_stream_the_client_drops_ends_its_receipt_client_gone_with_the_usage_seen() {
    let Started { mock, proxy, .. } = Harness::new().admin().anthropic_to_the_mock().start().await;
    let open = |path: &str, headers: &[(&str, &str)], body: &Value| {
        let mut request = http::Request::post(proxy.url(path));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .unwrap();
        client().request(request)
    };
    // Reads the head and the first frame, then goes away; returns the receipt's path.
    let drop_after_first_frame = |response: http::Response<hyper::body::Incoming>| async move {
        use http_body_util::BodyExt;
        assert_eq!(response.status(), 200);
        let id = response.headers()["x-memory-receipt"]
            .to_str()
            .unwrap()
            .to_string();
        let mut body = response.into_body();
        let first = body.frame().await.unwrap().unwrap();
        assert!(first.data_ref().is_some());
        drop(body);
        format!("/admin/v1/receipts/{id}")
    };

    // Chat completions: the upstream stalls after two chunks, the client leaves.
    mock.push(support::mock_upstream::Reply::Stall { chunks: 2 });
    let mut streamed = body(&[user("a long answer please")]);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let response = open(
        "/v1/chat/completions",
        &[
            ("authorization", "Bearer sk-test-one"),
            ("content-type", "application/json"),
            ("x-memory-conversation-id", "dropped"),
        ],
        &streamed,
    )
    .await
    .unwrap();
    let path = drop_after_first_frame(response).await;
    let gone = ended_receipt(&proxy, &path).await;
    assert_eq!(gone["upstream"]["ended"], "client_gone", "{gone}");
    assert_eq!(gone["upstream"]["stream"], true);
    assert!(gone["upstream"]["usage"].is_null(), "no usage was sent yet");
    assert!(gone["upstream"]["total_ms"].as_f64().is_some());
    assert!(proxy.stored(Some(TOKEN), "dropped").is_empty());

    // Anthropic Messages: `message_start` carried the input side before the client left.
    mock.push(support::mock_upstream::Reply::Stall { chunks: 2 });
    let response = open(
        "/v1/messages",
        &[
            ("x-api-key", "sk-ant-test"),
            ("anthropic-version", "2023-06-01"),
            ("content-type", "application/json"),
            ("x-memory-conversation-id", "dropped-anthropic"),
            ("x-mock-cached-tokens", "9"),
        ],
        &json!({"model": "claude-mock", "max_tokens": 64, "stream": true,
            "messages": [{"role": "user", "content": "a long answer please"}]}),
    )
    .await
    .unwrap();
    let path = drop_after_first_frame(response).await;
    let gone = ended_receipt(&proxy, &path).await;
    assert_eq!(gone["upstream"]["ended"], "client_gone", "{gone}");
    assert_eq!(gone["upstream"]["usage"]["cached_tokens"], 9, "{gone}");

    // A stream read to its end is still `complete`.
    let answer = chat(&proxy, "kept", &streamed, &[]).await;
    let complete = receipt(&proxy, &answer).await;
    assert_eq!(complete["upstream"]["ended"], "complete");
}

#[tokio::test]
async fn a_user_delete_and_the_ttl_sweeper_drop_the_receipts_of_what_they_delete() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let path =
        |answer: &Answer| format!("/admin/v1/receipts/{}", answer.header("x-memory-receipt"));
    let status = |path: String| {
        let proxy = &proxy;
        async move { admin(proxy, "GET", &path, "").await.status }
    };

    // A user delete takes the receipts of the user's conversations, not the others'.
    let of_user = chat(
        &proxy,
        "ana-notes",
        &body(&[user("remember my locker code")]),
        &[("x-memory-user-id", "ana")],
    )
    .await;
    let of_other = chat(&proxy, "not-ana", &body(&[user("hello")]), &[]).await;
    assert_eq!(status(path(&of_user)).await, 200);
    let deleted = admin(
        &proxy,
        "DELETE",
        &format!("/admin/v1/users/{}/ana", tenant(TOKEN)),
        "",
    )
    .await;
    assert_eq!(
        deleted.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&deleted.body)
    );
    assert_eq!(deleted.json()["deleted_conversations"], 1);
    assert_eq!(status(path(&of_user)).await, 404);
    assert_eq!(status(path(&of_other)).await, 200);

    // The TTL sweeper's delete takes them too.
    let expiring = chat(
        &proxy,
        "expiring",
        &body(&[user("short-lived text")]),
        &[("x-memory-ttl", "PT1H")],
    )
    .await;
    assert_eq!(status(path(&expiring)).await, 200);
    let state = &proxy.state;
    let memory = state.memory().unwrap();
    memory
        .clock
        .advance(std::time::Duration::from_secs(2 * 3600));
    let mut cursor = memproxy::ttl::Cursor::default();
    let pass = memproxy::ttl::sweep_pass(memory, &state.config, &mut cursor).unwrap();
    assert_eq!(pass.deleted, 1);
    assert_eq!(status(path(&expiring)).await, 404);
    assert_eq!(status(path(&of_other)).await, 200, "no TTL: kept");
}

#[tokio::test]
async fn a_receipt_names_the_excerpted_turns_and_the_window_step_in_effect() {
    let Started { mock, proxy, .. } = Harness::new()
        .admin()
        .config("[memory]\nrecent_n = 2\nwindow_step = \"auto\"\ncompression_enabled = false\nrelevance_top_k = 2\nrelevance_max_tokens = 120\n")
        .start()
        .await;
    let filler = "we spoke about the weather and the trains again. ".repeat(40);
    mock.push(support::mock_upstream::Reply::Text(format!(
        "{filler}The boathouse key is under the third step. {filler}"
    )));
    chat(
        &proxy,
        "cut",
        &body(&[user("Tell me about the house.")]),
        &[],
    )
    .await;
    for n in 0..4 {
        chat(&proxy, "cut", &body(&[user(&format!("note {n}"))]), &[]).await;
    }
    let answer = chat(
        &proxy,
        "cut",
        &body(&[user("Where is the boathouse key?")]),
        &[],
    )
    .await;
    let receipt = receipt(&proxy, &answer).await;
    let recalled = &receipt["prompt"]["recalled"];
    assert_eq!(recalled["excerpted"], json!([2]), "{recalled}");
    assert!(
        recalled["messages"][0]["content"]
            .as_str()
            .unwrap()
            .contains("The boathouse key is under the third step."),
        "{recalled}"
    );
    assert_eq!(receipt["settings"]["relevance_max_tokens"], "120");
    assert_eq!(receipt["settings"]["window_step"], "auto");
    // Short exchanges and one long reply: the step chosen is in the receipt, a number.
    assert!(
        receipt["settings"]["window_step_in_effect"].is_u64(),
        "{}",
        receipt["settings"]
    );
    proxy.stop().await;
}
