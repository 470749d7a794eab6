//! Forwarding through the real proxy: pass-through routes, headers, auth, upstream errors and
//! bad input.

use std::time::Duration;

use serde_json::json;

use crate::support::mock_upstream::{MockUpstream, Reply};
use crate::support::*;

#[tokio::test]
async fn other_routes_pass_through_untouched() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    let models = send(
        "GET",
        &proxy.url("/v1/models"),
        &[("authorization", "Bearer sk-1")],
        "",
    )
    .await;
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], "mock-model");

    let answer = send(
        "DELETE",
        &proxy.url("/v1/files/file-1?purpose=x&a=%20b"),
        &[
            ("authorization", "Bearer sk-1"),
            ("x-stainless-lang", "python"),
            ("openai-organization", "org-9"),
            ("x-memory-conversation-id", "ignored-here"),
            ("connection", "keep-alive"),
        ],
        "payload",
    )
    .await;
    assert_eq!(answer.status, 200);
    let seen = mock.recorded().pop().unwrap();
    assert_eq!(seen.method, "DELETE");
    assert_eq!(seen.path, "/v1/files/file-1?purpose=x&a=%20b");
    assert_eq!(seen.body, "payload");
    assert_eq!(seen.headers["authorization"], "Bearer sk-1");
    assert_eq!(seen.headers["x-stainless-lang"], "python");
    assert_eq!(seen.headers["openai-organization"], "org-9");
    assert!(
        !seen
            .headers
            .keys()
            .any(|k| k.as_str().starts_with("x-memory-"))
    );
    assert!(answer.headers.get("x-memory-status").is_none());

    // Chat completions without a conversation id are forwarded byte for byte.
    let raw = r#"{"messages":[{"role":"user","content":"hi"}],"model":"m","temperature":1.0}"#;
    send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        raw,
    )
    .await;
    assert_eq!(mock.chat_requests().last().unwrap().body, raw.as_bytes());

    // Unknown paths outside /v1 are 404 with an OpenAI-shaped body.
    let missing = send("GET", &proxy.url("/v2/models"), &[], "").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["code"], "not_found");
}

#[tokio::test]
async fn unknown_request_fields_reach_the_upstream_unchanged() {
    // It sends no credential: memory for such requests must be allowed.
    let Started { mock, proxy, .. } = Harness::new().config(ANONYMOUS_MEMORY).start().await;
    let raw = r#"{"model":"gpt-4o","temperature":0.70,"seed":1e3,"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2}}}],"x_vendor":{"keep":[1.50,true,null]},"stream_options":null}"#;
    let answer = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[
            ("x-memory-conversation-id", "u"),
            ("content-type", "application/json"),
        ],
        raw,
    )
    .await;
    assert_eq!(answer.status, 200);
    let forwarded = mock.chat_requests().pop().unwrap();
    // memproxy's `prompt_cache_key` (the client set none) is the one field added, last.
    let with_key = |body: &str| {
        let key = key(None, "u").prompt_cache_key();
        format!(
            r#"{},"prompt_cache_key":"{key}"}}"#,
            body.strip_suffix('}').unwrap()
        )
    };
    assert_eq!(
        String::from_utf8(forwarded.body.to_vec()).unwrap(),
        with_key(raw),
        "a first request is forwarded byte for byte"
    );

    // On the next request the messages change; every other field keeps its bytes and place.
    let raw2 = raw.replace(r#""content":"hi""#, r#""content":"again""#);
    send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-memory-conversation-id", "u")],
        raw2.clone(),
    )
    .await;
    let forwarded = String::from_utf8(mock.chat_requests().pop().unwrap().body.to_vec()).unwrap();
    let expected = raw2.replace(
        r#""messages":[{"role":"user","content":"again"}]"#,
        r#""messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"reply to: hi"},{"role":"user","content":"again"}]"#,
    );
    assert_eq!(forwarded, with_key(&expected));
}

#[tokio::test]
async fn bad_headers_and_bodies_get_400_naming_the_cause() {
    // It sends no credential: memory for such requests must be allowed.
    let Started { mock, proxy, .. } = Harness::new().config(ANONYMOUS_MEMORY).start().await;
    let ok_body = body(&[user("hi")]);

    type Case<'a> = (Vec<(&'a str, &'a str)>, String, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec![("x-memory-recent-n", "lots")],
            ok_body.to_string(),
            "x-memory-recent-n",
        ),
        (
            vec![("x-memory-relevance-top-k", "50")],
            ok_body.to_string(),
            "x-memory-relevance-top-k",
        ),
        (
            vec![("x-memory-persist", "maybe")],
            ok_body.to_string(),
            "x-memory-persist",
        ),
        (
            vec![("x-memory-compression-interval", "1 hour")],
            ok_body.to_string(),
            "x-memory-compression-interval",
        ),
        (
            vec![("x-memory-favourite-colour", "blue")],
            ok_body.to_string(),
            "x-memory-favourite-colour",
        ),
        (
            vec![("x-memory-conversation-id", "../../etc/passwd")],
            ok_body.to_string(),
            "x-memory-conversation-id",
        ),
        (
            vec![("x-memory-agent", "a b")],
            ok_body.to_string(),
            "x-memory-agent",
        ),
        (vec![], r#"{"model":"m"}"#.to_string(), "messages"),
        (
            vec![],
            r#"{"messages":[{"content":"no role"}]}"#.to_string(),
            "messages[0].role",
        ),
        (
            vec![],
            r#"{"messages":[{"role":"tool","content":"x"}]}"#.to_string(),
            "messages[0].tool_call_id",
        ),
        (
            vec![],
            r#"{"messages":[],"stream":"yes"}"#.to_string(),
            "stream",
        ),
    ];
    for (headers, body_text, param) in cases {
        let mut all = vec![("x-memory-conversation-id", "bad")];
        all.retain(|(k, _)| !headers.iter().any(|(h, _)| h == k));
        all.extend(headers);
        let answer = send("POST", &proxy.url("/v1/chat/completions"), &all, body_text).await;
        assert_eq!(answer.status, 400, "{param}");
        assert_eq!(answer.error_param(), param);
        let error = &answer.json()["error"];
        assert!(
            error["message"]
                .as_str()
                .unwrap()
                .contains(param.split('[').next().unwrap()),
            "{error}"
        );
        assert_eq!(error["type"], "invalid_request_error");
    }

    let malformed = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-memory-conversation-id", "bad")],
        r#"{"messages": [oops"#,
    )
    .await;
    assert_eq!(malformed.status, 400);
    assert_eq!(malformed.json()["error"]["code"], "invalid_json");
    assert!(mock.chat_requests().is_empty(), "nothing bad was forwarded");
    assert!(proxy.stored(None, "bad").is_empty());
}

#[tokio::test]
async fn upstream_errors_pass_through_and_store_nothing() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    for status in [429u16, 500] {
        let body_text = format!(
            r#"{{"error":{{"message":"upstream says {status}","type":"x","param":null,"code":"c"}}}}"#
        );
        mock.push(Reply::Status(status, body_text.clone()));
        let answer = chat(&proxy, "e", &body(&[user("hi")]), &[]).await;
        assert_eq!(answer.status, status);
        assert_eq!(answer.body, body_text.as_bytes());
        assert_eq!(answer.header("x-memory-status"), "not-stored");
        assert_eq!(answer.header("x-memory-turns"), "0");
        // Streaming requests too.
        mock.push(Reply::Status(status, body_text.clone()));
        let answer = chat(
            &proxy,
            "e",
            &json!({"model": "m", "stream": true, "messages": [user("hi")]}),
            &[],
        )
        .await;
        assert_eq!(answer.status, status);
    }
    assert!(proxy.stored(Some(TOKEN), "e").is_empty());
}

#[tokio::test]
async fn an_unreachable_upstream_is_502_and_a_slow_one_504() {
    // A port with nothing listening: bind, note the port, close.
    let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = unused.local_addr().unwrap().port();
    drop(unused);
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[upstream]\nbase_url = \"http://127.0.0.1:{port}/v1\"\n[storage]\ndata_dir = \"{}\"\n",
        dir.path().display()
    );
    let proxy = Proxy::start_config(memproxy::config::from_toml(&text, &|_| None).unwrap()).await;
    let answer = chat(&proxy, "x", &body(&[user("hi")]), &[]).await;
    assert_eq!(answer.status, 502);
    assert_eq!(answer.json()["error"]["code"], "upstream_unreachable");
    assert!(
        !answer.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Bearer")
    );
    assert!(proxy.stored(Some(TOKEN), "x").is_empty());

    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[upstream]\nbase_url = \"{}\"\ntimeout = \"PT0.3S\"\n[storage]\ndata_dir = \"{}\"\n",
        mock.base_url(),
        dir.path().display()
    );
    let proxy = Proxy::start_config(memproxy::config::from_toml(&text, &|_| None).unwrap()).await;
    mock.push(Reply::Delay(
        Duration::from_secs(2),
        Box::new(Reply::Text("late".into())),
    ));
    let answer = chat(&proxy, "slow", &body(&[user("hi")]), &[]).await;
    assert_eq!(answer.status, 504);
    assert_eq!(answer.json()["error"]["code"], "upstream_timeout");
    assert!(proxy.stored(Some(TOKEN), "slow").is_empty());
}

#[tokio::test]
async fn keys_client_keys_and_the_path_form() {
    let Started { mock, proxy, .. } = Harness::new()
        .config("[auth]\nclient_keys = [\"sk-test-one\"]\n")
        .start()
        .await;

    let refused = chat_as(&proxy, "sk-wrong", "k", &body(&[user("hi")]), &[]).await;
    assert_eq!(refused.status, 401);
    assert_eq!(refused.json()["error"]["type"], "authentication_error");
    let missing = send("GET", &proxy.url("/v1/models"), &[], "").await;
    assert_eq!(missing.status, 401);
    let ok = chat(&proxy, "k", &body(&[user("hi")]), &[]).await;
    assert_eq!(ok.status, 200);
    assert_eq!(
        mock.chat_requests().last().unwrap().headers["authorization"],
        "Bearer sk-test-one"
    );

    // Health checks need no key.
    assert_eq!(
        send("GET", &proxy.url("/healthz"), &[], "").await.status,
        200
    );
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.status, 200);
    assert_eq!(ready.json()["store"], true);

    // The path form equals the two headers.
    let answer = send(
        "POST",
        &proxy.url("/agents/support/conversations/path-1/v1/chat/completions"),
        &[("authorization", "Bearer sk-test-one")],
        body(&[user("via path")]).to_string(),
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-conversation-id"), "path-1");
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(proxy.stored_agent("support", "path-1").len(), 2);
    let models = send(
        "GET",
        &proxy.url("/agents/support/conversations/path-1/v1/models"),
        &[("authorization", "Bearer sk-test-one")],
        "",
    )
    .await;
    assert_eq!(models.status, 200);
    assert_eq!(mock.recorded().last().unwrap().path, "/v1/models");
}

#[tokio::test]
async fn a_configured_upstream_key_replaces_the_clients() {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[upstream]\nbase_url = \"{}\"\napi_key_env = \"KEY_VAR\"\n[storage]\ndata_dir = \"{}\"\n",
        mock.base_url(),
        dir.path().display()
    );
    let env = |name: &str| (name == "KEY_VAR").then(|| "sk-held-by-proxy".to_string());
    let proxy = Proxy::start_config(memproxy::config::from_toml(&text, &env).unwrap()).await;
    chat(&proxy, "k", &body(&[user("hi")]), &[]).await;
    send("GET", &proxy.url("/v1/models"), &[], "").await;
    for seen in mock.recorded() {
        assert_eq!(
            seen.headers["authorization"], "Bearer sk-held-by-proxy",
            "{}",
            seen.path
        );
    }
    // The tenant still comes from the client's own token.
    assert_eq!(proxy.stored(Some(TOKEN), "k").len(), 2);
}

#[tokio::test]
async fn the_body_limit_gives_413() {
    let Started { mock, proxy, .. } = Harness::new()
        .config("body_limit_bytes = 1000\n")
        .start()
        .await;
    let big = body(&[user(&"x".repeat(2000))]);
    let answer = chat(&proxy, "big", &big, &[]).await;
    assert_eq!(answer.status, 413);
    assert_eq!(answer.json()["error"]["code"], "request_too_large");
    assert!(mock.chat_requests().is_empty());
}

#[tokio::test]
async fn h2c_clients_are_served() {
    // It sends no credential: memory for such requests must be allowed.
    let Started { proxy, .. } = Harness::new().config(ANONYMOUS_MEMORY).start().await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let request = http::Request::post(proxy.url("/v1/chat/completions"))
        .header("x-memory-conversation-id", "h2")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body(&[user("over h2")]).to_string(),
        )))
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-memory-status"], "stored");
}

#[tokio::test]
async fn readyz_waits_for_the_tokenizer_which_loads_at_start() {
    let Started { proxy, .. } = Harness::new().start().await;
    // No request has counted a token: the server loads the tokenizer by itself.
    let mut ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    for _ in 0..600 {
        if ready.status == 200 {
            break;
        }
        assert_eq!(ready.status, 503);
        assert_eq!(ready.json()["tokenizer"], false);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    }
    assert_eq!(ready.status, 200);
    assert_eq!(ready.json()["tokenizer"], true);
    assert_eq!(ready.json()["store"], true);
}

/// Sends one request over a raw TCP connection, so the path reaches memproxy exactly as
/// written (no client normalises it), and returns the status and the body.
async fn raw_request(proxy: &Proxy, method: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"));
    let body = answer
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

#[tokio::test]
async fn dot_segments_and_encoded_slashes_never_reach_the_upstream() {
    let Started { mock, proxy, .. } = Harness::new().start().await;
    let chat_body = body(&[user("hi")]).to_string();

    for (method, path) in [
        ("POST", "/v1/../../internal/admin?x=1"),
        ("GET", "/v1/%2e%2e/%2e%2e/internal"),
        ("GET", "/v1/%2E%2E/internal"),
        ("GET", "/v1/.%2e/internal"),
        ("GET", "/v1/%2e./internal"),
        ("GET", "/v1/./models"),
        ("GET", "/v1/models/.."),
        ("GET", "/v1/..;x/internal"),
        ("GET", "/v1/files%2f..%2finternal"),
        ("GET", "/v1/files%2F..%2Finternal"),
        ("GET", "/v1/files%5c..%5cinternal"),
        ("POST", "/v1/chat/completions/.."),
        ("POST", "/v1/chat/../chat/completions"),
        ("POST", "/agents/a/conversations/c/v1/../../internal"),
        (
            "POST",
            "/agents/a/conversations/c/v1/%2e%2e/chat/completions",
        ),
        ("POST", "/agents/%2e%2e/conversations/c/v1/chat/completions"),
        ("GET", "/admin/v1/../../v1/models"),
    ] {
        let (status, body) = raw_request(&proxy, method, path, &chat_body).await;
        assert_eq!(status, 400, "{method} {path}: {body}");
        let error: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"]["param"], "path", "{path}");
        assert_eq!(error["error"]["code"], "invalid_path", "{path}");
    }
    assert!(
        mock.recorded().is_empty(),
        "forwarded: {:?}",
        mock.recorded()
            .iter()
            .map(|r| r.path.clone())
            .collect::<Vec<_>>()
    );
    assert!(proxy.stored(Some(TOKEN), "c").is_empty());

    // Dots inside a name are no segment of their own: forwarded as they are.
    let (status, _) = raw_request(&proxy, "GET", "/v1/models/gpt-4.1..x", "").await;
    assert_eq!(status, 200);
    assert_eq!(mock.recorded()[0].path, "/v1/models/gpt-4.1..x");
}
