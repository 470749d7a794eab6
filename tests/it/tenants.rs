//! Tenants through the real proxy: the tenant is the hash of whichever credential a request
//! presents (`Authorization` in any scheme, `api-key`, `x-api-key`), two different credentials
//! are refused, none is refused unless `auth.allow_anonymous`, and the allow-list and summary
//! calls see every credential header.

use std::time::{Duration, Instant};

use crate::support::mock_upstream::MockUpstream;
use crate::support::*;

/// Posts a chat completion for `conversation` with exactly `credentials` as its credential
/// headers.
async fn chat_with(
    proxy: &Proxy,
    credentials: &[(&str, &str)],
    conversation: &str,
    text: &str,
) -> Answer {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("x-memory-conversation-id", conversation),
    ];
    headers.extend_from_slice(credentials);
    send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &headers,
        body(&[user(text)]).to_string(),
    )
    .await
}

/// The body of the last chat completion the mock received, as text.
fn last_forwarded(mock: &MockUpstream) -> String {
    String::from_utf8(mock.chat_requests().pop().unwrap().body.to_vec()).unwrap()
}

#[tokio::test]
async fn two_credentials_of_any_kind_never_share_a_conversation() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    let kinds: [(&str, [&str; 2]); 4] = [
        ("api-key", ["azure-key-a", "azure-key-b"]),
        ("x-api-key", ["anthropic-key-a", "anthropic-key-b"]),
        // user-a:pw and user-b:pw
        (
            "authorization",
            ["Basic dXNlci1hOnB3", "Basic dXNlci1iOnB3"],
        ),
        ("authorization", ["Bearer sk-a", "Bearer sk-b"]),
    ];
    for (i, (header, [first, second])) in kinds.into_iter().enumerate() {
        let conversation = format!("shared-{i}");
        let secret = format!("the vault code is {i}-swordfish");
        let answer = chat_with(&proxy, &[(header, first)], &conversation, &secret).await;
        assert_eq!(answer.status, 200, "{header}");
        assert_eq!(answer.header("x-memory-status"), "stored");
        assert!(last_forwarded(&mock).contains(&secret));

        let answer = chat_with(&proxy, &[(header, second)], &conversation, "what is it?").await;
        assert_eq!(answer.status, 200, "{header}");
        assert_eq!(answer.header("x-memory-turns"), "2", "{header}");
        let forwarded = last_forwarded(&mock);
        assert!(
            !forwarded.contains("swordfish"),
            "{header}: the second credential saw the first one's history: {forwarded}"
        );

        // The first credential still sees its own history.
        chat_with(&proxy, &[(header, first)], &conversation, "and again?").await;
        assert!(last_forwarded(&mock).contains(&secret), "{header}");
    }
}

#[tokio::test]
async fn one_key_is_one_tenant_whichever_header_carries_it() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    chat_with(
        &proxy,
        &[("authorization", "Bearer sk-same")],
        "c",
        "remember lighthouse",
    )
    .await;
    for (i, credentials) in [
        &[("x-api-key", "sk-same")][..],
        &[("api-key", "sk-same")],
        &[
            ("authorization", "Bearer sk-same"),
            ("x-api-key", "sk-same"),
        ],
    ]
    .into_iter()
    .enumerate()
    {
        let question = format!("what was it? ({i})");
        let answer = chat_with(&proxy, credentials, "c", &question).await;
        assert_eq!(answer.status, 200, "{credentials:?}");
        assert!(
            last_forwarded(&mock).contains("remember lighthouse"),
            "{credentials:?}"
        );
    }
    assert_eq!(proxy.stored(Some("sk-same"), "c").len(), 8);

    // A Basic credential is not a key: the same bytes under `Basic` are another tenant.
    chat_with(&proxy, &[("authorization", "Basic sk-same")], "c", "who?").await;
    assert!(!last_forwarded(&mock).contains("lighthouse"));
}

#[tokio::test]
async fn two_different_credentials_are_refused_and_nothing_is_forwarded() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    for (credentials, named) in [
        (
            &[("authorization", "Bearer sk-a"), ("x-api-key", "sk-b")][..],
            "authorization, x-api-key",
        ),
        (
            &[("api-key", "sk-a"), ("x-api-key", "sk-b")],
            "api-key, x-api-key",
        ),
        (
            &[("authorization", "Basic c2stYQ=="), ("api-key", "sk-a")],
            "authorization, api-key",
        ),
        (&[("x-api-key", "sk-a"), ("x-api-key", "sk-b")], "x-api-key"),
    ] {
        let answer = chat_with(&proxy, credentials, "two", "hi").await;
        assert_eq!(answer.status, 400, "{credentials:?}");
        let error = &answer.json()["error"];
        assert_eq!(error["param"], named);
        assert_eq!(error["type"], "invalid_request_error");
        assert_eq!(error["code"], "conflicting_credentials");
        let text = String::from_utf8_lossy(&answer.body).to_string();
        assert!(!text.contains("sk-a") && !text.contains("sk-b"), "{text}");
    }
    assert!(mock.recorded().is_empty());
    assert!(proxy.stored(Some("sk-a"), "two").is_empty());
    assert!(proxy.stored(Some("sk-b"), "two").is_empty());
}

#[tokio::test]
async fn no_credential_gets_memory_only_when_anonymous_memory_is_allowed() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    for credentials in [&[][..], &[("authorization", "Bearer")], &[("api-key", "")]] {
        let answer = chat_with(&proxy, credentials, "anon", "hi").await;
        assert_eq!(answer.status, 401, "{credentials:?}");
        assert!(answer.headers.contains_key("www-authenticate"));
        let error = &answer.json()["error"];
        assert_eq!(error["type"], "authentication_error");
        assert_eq!(error["code"], "missing_credential");
        assert!(
            error["message"]
                .as_str()
                .unwrap()
                .contains("auth.allow_anonymous"),
            "{error}"
        );
    }
    assert!(mock.recorded().is_empty());
    assert!(proxy.stored(None, "anon").is_empty());

    // Only memory needs a tenant: pass-through and memory switched off go through.
    let models = send("GET", &proxy.url("/v1/models"), &[], "").await;
    assert_eq!(models.status, 200);
    let off = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[
            ("x-memory-conversation-id", "anon"),
            ("x-memory-enabled", "false"),
        ],
        body(&[user("hi")]).to_string(),
    )
    .await;
    assert_eq!(off.status, 200);
    assert_eq!(off.header("x-memory-status"), "off");
    proxy.stop().await;

    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(&mock, dir.path(), ANONYMOUS_MEMORY).await;
    let answer = chat_with(&proxy, &[], "anon", "hi").await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(proxy.stored(None, "anon").len(), 2);
    // Anonymous memory is one tenant of its own, not any key's.
    chat_with(&proxy, &[("x-api-key", "sk-k")], "anon", "hi").await;
    assert_eq!(proxy.stored(None, "anon").len(), 2);
    assert_eq!(proxy.stored(Some("sk-k"), "anon").len(), 2);
}

#[tokio::test]
async fn client_keys_are_accepted_from_every_credential_header() {
    let Started { proxy, .. } = Harness::new()
        .config("[auth]\nclient_keys = [\"sk-allowed\"]\n")
        .start()
        .await;

    for (i, credentials) in [
        &[("authorization", "Bearer sk-allowed")][..],
        &[("api-key", "sk-allowed")],
        &[("x-api-key", "sk-allowed")],
    ]
    .into_iter()
    .enumerate()
    {
        let answer = chat_with(&proxy, credentials, "k", &format!("hi {i}")).await;
        assert_eq!(answer.status, 200, "{credentials:?}");
        let models = send("GET", &proxy.url("/v1/models"), credentials, "").await;
        assert_eq!(models.status, 200, "{credentials:?}");
    }
    for credentials in [
        &[("x-api-key", "sk-other")][..],
        &[("authorization", "Basic sk-allowed")],
        &[],
    ] {
        let models = send("GET", &proxy.url("/v1/models"), credentials, "").await;
        assert_eq!(models.status, 401, "{credentials:?}");
    }
    // An allowed key cannot carry another one along.
    let smuggled = send(
        "GET",
        &proxy.url("/v1/models"),
        &[
            ("authorization", "Bearer sk-allowed"),
            ("x-api-key", "sk-other"),
        ],
        "",
    )
    .await;
    assert_eq!(smuggled.status, 400);
    assert_eq!(smuggled.error_param(), "authorization, x-api-key");
    assert_eq!(proxy.stored(Some("sk-allowed"), "k").len(), 6);
}

#[tokio::test]
async fn summary_calls_carry_the_api_key_headers() {
    let Started { mock, proxy, .. } = Harness::new()
        .config("[memory]\nrecent_n = 2\ncompression_threshold_tokens = 100\nrelevance_enabled = false\ncompression_async = false\n")
        .start()
        .await;
    let started = Instant::now();
    for i in 0.. {
        if !mock.summary_requests().is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no summary call"
        );
        let text = format!("fact {i}: the blue lantern stands on shelf {i} in the north storeroom");
        let answer = chat_with(
            &proxy,
            &[("x-api-key", "sk-anthropic"), ("api-key", "sk-anthropic")],
            "sum",
            &text,
        )
        .await;
        assert_eq!(answer.status, 200);
    }
    let call = &mock.summary_requests()[0];
    assert_eq!(call.headers["x-api-key"], "sk-anthropic");
    assert_eq!(call.headers["api-key"], "sk-anthropic");
    assert!(call.headers.get("authorization").is_none());
}
