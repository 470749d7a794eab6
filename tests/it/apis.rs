//! Memory for the Responses API and the Anthropic Messages API: the same memory contract as
//! chat completions, over the real server and the mock upstream's own wire formats.

use serde_json::{Value, json};

use crate::support::mock_upstream::{MockUpstream, Reply};
use crate::support::*;

const AUTH: &str = "Bearer sk-test-one";

async fn responses(proxy: &Proxy, conversation: Option<&str>, body: &Value) -> Answer {
    let mut headers = vec![
        ("authorization", AUTH),
        ("content-type", "application/json"),
    ];
    if let Some(conversation) = conversation {
        headers.push(("x-memory-conversation-id", conversation));
    }
    send(
        "POST",
        &proxy.url("/v1/responses"),
        &headers,
        body.to_string(),
    )
    .await
}

async fn messages(proxy: &Proxy, conversation: &str, body: &Value) -> Answer {
    let headers = [
        ("x-api-key", "sk-ant-test"),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", "tools-2024-04-04"),
        ("content-type", "application/json"),
        ("x-memory-conversation-id", conversation),
    ];
    send(
        "POST",
        &proxy.url("/v1/messages"),
        &headers,
        body.to_string(),
    )
    .await
}

/// Posts and reads the body until it ends or breaks; true when it broke.
async fn post_cut(url: &str, headers: &[(&str, &str)], body: &Value) -> bool {
    use http_body_util::BodyExt;
    let mut request = http::Request::builder().method("POST").uri(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let request = request
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let mut body = client().request(request).await.unwrap().into_body();
    while let Some(frame) = body.frame().await {
        if frame.is_err() {
            return true;
        }
    }
    false
}

fn last_input(mock: &MockUpstream) -> Vec<Value> {
    mock.responses_requests().last().unwrap().json()["input"]
        .as_array()
        .unwrap()
        .clone()
}

fn texts(items: &[Value]) -> String {
    items
        .iter()
        .map(Value::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test]
async fn responses_keep_memory_across_turns_and_instructions_are_not_turns() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { mock, proxy, .. } = Harness::new().anthropic_to(&claude).start().await;

    for (i, text) in [
        "my cat is called Miso",
        "I live in Lyon",
        "what is my cat called?",
    ]
    .iter()
    .enumerate()
    {
        let request =
            json!({"model": "gpt-4.1", "instructions": "Be brief.", "input": text, "store": false});
        let answer = responses(&proxy, Some("r1"), &request).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.header("x-memory-status"), "stored");
        assert_eq!(answer.header("x-memory-turns"), ((i + 1) * 2).to_string());
        assert_eq!(answer.json()["object"], "response");
    }
    let forwarded = mock.responses_requests().last().unwrap().json();
    assert_eq!(forwarded["instructions"], "Be brief.");
    assert_eq!(forwarded["store"], false);
    let input = forwarded["input"].as_array().unwrap();
    let all = texts(input);
    assert!(
        all.contains("my cat is called Miso") && all.contains("reply to: I live in Lyon"),
        "{all}"
    );
    assert_eq!(
        input.last().unwrap(),
        &json!({"role": "user", "content": "what is my cat called?"})
    );
    // Stored once each; instructions never.
    let stored = summarize(&proxy.stored(Some(TOKEN), "r1"));
    assert_eq!(stored.len(), 6);
    assert!(!stored.iter().any(|m| m.contains("Be brief.")));
    assert_eq!(stored[0], "user:my cat is called Miso");
}

#[tokio::test]
async fn previous_response_id_finds_the_conversation_and_an_unknown_one_turns_memory_off() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { mock, proxy, .. } = Harness::new().anthropic_to(&claude).start().await;

    let first = responses(
        &proxy,
        Some("chain"),
        &json!({"model": "m", "input": "the code word is heron"}),
    )
    .await;
    let id = first.json()["id"].as_str().unwrap().to_string();
    // No conversation header: the id says which conversation.
    let second = responses(
        &proxy,
        None,
        &json!({"model": "m", "input": "what was the code word?", "previous_response_id": id}),
    )
    .await;
    assert_eq!(second.status, 200);
    assert_eq!(second.header("x-memory-status"), "stored");
    assert_eq!(second.header("x-memory-conversation-id"), "chain");
    let forwarded = mock.responses_requests().last().unwrap().json();
    assert!(
        forwarded.get("previous_response_id").is_none(),
        "forwarded stateless"
    );
    assert!(texts(&last_input(&mock)).contains("the code word is heron"));
    assert_eq!(proxy.stored(Some(TOKEN), "chain").len(), 4);

    // Another tenant does not find it.
    let other = send(
        "POST",
        &proxy.url("/v1/responses"),
        &[
            ("authorization", "Bearer sk-other"),
            ("content-type", "application/json"),
        ],
        json!({"model": "m", "input": "x", "previous_response_id": id}).to_string(),
    )
    .await;
    assert_eq!(other.header("x-memory-status"), "off");
    assert_eq!(other.header("x-memory-reason"), "unknown-previous-response");

    // An id memproxy never answered: forwarded as sent, memory off, said why.
    let unknown = json!({"model": "m", "input": "hi", "previous_response_id": "resp_upstream_1"});
    let answer = responses(&proxy, Some("chain"), &unknown).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-status"), "off");
    assert_eq!(
        answer.header("x-memory-reason"),
        "unknown-previous-response"
    );
    assert_eq!(mock.responses_requests().last().unwrap().json(), unknown);
    assert_eq!(proxy.stored(Some(TOKEN), "chain").len(), 4);

    // Without any conversation id or previous id: plain pass-through.
    let plain = responses(&proxy, None, &json!({"model": "m", "input": "hello"})).await;
    assert!(plain.headers.get("x-memory-status").is_none());
}

#[tokio::test]
async fn response_ids_survive_a_restart_and_go_with_their_conversation() {
    let claude = MockUpstream::start().await.unwrap();
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().anthropic_to(&claude).start().await;
    let first = responses(
        &proxy,
        Some("kept"),
        &json!({"model": "m", "input": "the code word is osprey"}),
    )
    .await;
    let id = first.json()["id"].as_str().unwrap().to_string();
    proxy.stop().await;

    // A new process on the same data directory knows the id.
    let proxy = Harness::new()
        .anthropic_to(&claude)
        .proxy_on(&mock, dir.path())
        .await;
    let chained = responses(
        &proxy,
        None,
        &json!({"model": "m", "input": "what was the code word?", "previous_response_id": id}),
    )
    .await;
    assert_eq!(chained.header("x-memory-status"), "stored");
    assert_eq!(chained.header("x-memory-conversation-id"), "kept");
    assert!(texts(&last_input(&mock)).contains("the code word is osprey"));
    let second = chained.json()["id"].as_str().unwrap().to_string();

    // GET answers from memory (the mock was never asked), DELETE forgets the id only.
    let get = |id: String| {
        let url = proxy.url(&format!("/v1/responses/{id}"));
        async move { send("GET", &url, &[("authorization", AUTH)], String::new()).await }
    };
    let before = mock.recorded().len();
    let fetched = get(id.clone()).await;
    assert_eq!(fetched.status, 200);
    assert_eq!(fetched.json()["id"], id.as_str());
    // As the upstream answered it: its output, creation time and usage.
    assert_eq!(fetched.json()["created_at"], 1);
    assert_eq!(fetched.json()["usage"]["total_tokens"], 2);
    assert_eq!(fetched.json()["output"][0]["type"], "message");
    assert_eq!(mock.recorded().len(), before);
    let deleted = send(
        "DELETE",
        &proxy.url(&format!("/v1/responses/{id}")),
        &[("authorization", AUTH)],
        String::new(),
    )
    .await;
    assert_eq!(deleted.json()["deleted"], true);
    let again = responses(
        &proxy,
        None,
        &json!({"model": "m", "input": "x", "previous_response_id": id}),
    )
    .await;
    assert_eq!(again.header("x-memory-reason"), "unknown-previous-response");
    assert_eq!(proxy.stored(Some(TOKEN), "kept").len(), 4, "the turns stay");

    // Deleting the conversation takes its ids along: nothing is left to chain to.
    let kept = key(Some(TOKEN), "kept");
    let export =
        serde_json::to_vec(&memproxy::admin::ops::export(proxy.store(), &kept).unwrap()).unwrap();
    proxy
        .state
        .memory()
        .unwrap()
        .delete_conversation(&kept)
        .unwrap()
        .unwrap();
    let after = responses(
        &proxy,
        None,
        &json!({"model": "m", "input": "x", "previous_response_id": second}),
    )
    .await;
    assert_eq!(after.header("x-memory-status"), "off");
    assert_eq!(after.header("x-memory-reason"), "unknown-previous-response");
    assert!(!proxy.store().any_trace_of(second.as_bytes()).unwrap());

    // An import brings the replies back, and their ids with them.
    memproxy::admin::ops::import(proxy.store(), &kept, &export, false).unwrap();
    let imported = responses(
        &proxy,
        None,
        &json!({"model": "m", "input": "and now?", "previous_response_id": second}),
    )
    .await;
    assert_eq!(imported.header("x-memory-status"), "stored");
    assert_eq!(imported.header("x-memory-conversation-id"), "kept");
}

#[tokio::test]
async fn the_conversation_field_names_the_conversation_and_is_not_forwarded() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { mock, proxy, .. } = Harness::new().anthropic_to(&claude).start().await;
    let first = responses(
        &proxy,
        None,
        &json!({"model": "m", "input": "the code word is plover", "conversation": "conv_abc"}),
    )
    .await;
    assert_eq!(first.header("x-memory-status"), "stored");
    assert_eq!(first.header("x-memory-conversation-id"), "conv_abc");
    // The object form names the same conversation.
    let second = responses(
        &proxy,
        None,
        &json!({"model": "m", "input": "the code word?", "conversation": {"id": "conv_abc"}}),
    )
    .await;
    assert_eq!(second.header("x-memory-status"), "stored");
    let forwarded = mock.responses_requests().last().unwrap().json();
    assert!(forwarded.get("conversation").is_none(), "{forwarded}");
    assert!(texts(&last_input(&mock)).contains("the code word is plover"));
    assert_eq!(proxy.stored(Some(TOKEN), "conv_abc").len(), 4);

    // A bad id, or one that disagrees with the header: a 400 naming the field, nothing sent.
    let sent = mock.recorded().len();
    for (header, value) in [
        (None, json!("has spaces")),
        (None, json!({"name": "x"})),
        (Some("other"), json!("conv_abc")),
    ] {
        let answer = responses(
            &proxy,
            header,
            &json!({"model": "m", "input": "x", "conversation": value}),
        )
        .await;
        assert_eq!(answer.status, 400, "{value}");
        assert_eq!(answer.json()["error"]["param"], "conversation");
    }
    assert_eq!(mock.recorded().len(), sent);

    // With no conversation header the user id still counts: the user's other conversation is
    // searched.
    let as_ana = |conversation: &str, input: &str| {
        let body = json!({"model": "m", "input": input, "conversation": conversation});
        let url = proxy.url("/v1/responses");
        async move {
            let headers = [
                ("authorization", AUTH),
                ("content-type", "application/json"),
                ("x-memory-user-id", "ana"),
            ];
            send("POST", &url, &headers, body.to_string()).await
        }
    };
    let user_said = as_ana("lockers", "my locker number is 4711").await;
    assert_eq!(user_said.header("x-memory-status"), "stored");
    let asked = as_ana("fresh", "what is my locker number?").await;
    assert_ne!(asked.header("x-memory-retrieved-elsewhere"), "");
    let forwarded = mock.responses_requests().last().unwrap().json().to_string();
    assert!(forwarded.contains("4711"), "{forwarded}");
}

#[tokio::test]
async fn a_function_call_round_and_reasoning_items_are_forwarded_whole() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { mock, proxy, .. } = Harness::new()
        .anthropic_to(&claude)
        .config("[memory]\nrecent_n = 2\n")
        .start()
        .await;

    let secret = "gAAAAB+enc/rypted==";
    mock.push(Reply::Reasoning(
        secret.into(),
        Box::new(Reply::ToolCalls(vec![(
            "call_1".into(),
            "get_weather".into(),
            "{\"city\":\"Paris\"}".into(),
        )])),
    ));
    let first = responses(&proxy, Some("tools"), &json!({"model": "o4", "input": "weather in Paris?", "tools": [{"type": "function", "name": "get_weather", "parameters": {}}]})).await;
    let output = first.json()["output"].clone();
    assert_eq!(output[0]["type"], "reasoning");
    assert_eq!(output[1]["type"], "function_call");
    let id = first.json()["id"].as_str().unwrap().to_string();
    let reasoning_raw = {
        let body = String::from_utf8(first.body.to_vec()).unwrap();
        let start = body
            .find("{\"type\":\"reasoning\"")
            .or_else(|| body.find("{\"encrypted_content\""))
            .unwrap();
        let end = start + body[start..].find('}').unwrap() + 1;
        body[start..end].to_string()
    };

    let result = json!({"model": "o4", "previous_response_id": id, "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]});
    let second = responses(&proxy, None, &result).await;
    assert_eq!(second.header("x-memory-status"), "stored");
    let input = last_input(&mock);
    let kinds: Vec<&str> = input
        .iter()
        .map(|i| i["type"].as_str().unwrap_or("message"))
        .collect();
    assert_eq!(
        kinds,
        [
            "message",
            "reasoning",
            "function_call",
            "function_call_output"
        ]
    );
    // The reasoning item byte for byte.
    let raw = String::from_utf8(mock.responses_requests().last().unwrap().body.to_vec()).unwrap();
    assert!(raw.contains(&reasoning_raw), "{raw}\n{reasoning_raw}");

    // Two turns later (recent_n = 2) the window still holds the call with its output.
    responses(
        &proxy,
        Some("tools"),
        &json!({"model": "o4", "input": "thanks"}),
    )
    .await;
    let input = last_input(&mock);
    let calls = input
        .iter()
        .filter(|i| i["type"] == "function_call")
        .count();
    let outputs = input
        .iter()
        .filter(|i| i["type"] == "function_call_output")
        .count();
    assert_eq!(calls, outputs, "{input:?}");

    // Chat completions on the same conversation get the call without the reasoning item.
    let answer = chat(
        &proxy,
        "tools",
        &body(&[user("and tomorrow?")]),
        &[("x-memory-recent-n", "20")],
    )
    .await;
    assert_eq!(answer.status, 200);
    let forwarded = mock.last_messages();
    assert!(
        forwarded.iter().all(|m| m.get("_wire").is_none()),
        "{forwarded:?}"
    );
    memproxy::message::check_tool_sequence(&forwarded).unwrap();
    assert!(
        forwarded
            .iter()
            .any(|m| m["role"] == "tool" && m["content"] == "sunny")
    );
}

#[tokio::test]
async fn responses_streams_are_teed_and_stored_from_response_completed() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { mock, proxy, .. } = Harness::new().anthropic_to(&claude).start().await;

    let answer = responses(
        &proxy,
        Some("s"),
        &json!({"model": "m", "input": "stream please", "stream": true}),
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-status"), "stored");
    let text = String::from_utf8(answer.body.to_vec()).unwrap();
    assert!(text.starts_with("event: response.created\n"));
    assert!(text.contains("event: response.completed\n"));
    let stored = summarize(&proxy.stored(Some(TOKEN), "s"));
    assert_eq!(
        stored,
        ["user:stream please", "assistant:reply to: stream please"]
    );

    // The id of a streamed answer chains too.
    let id = text
        .split("\"id\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap()
        .to_string();
    let next = responses(
        &proxy,
        None,
        &json!({"model": "m", "input": "again", "previous_response_id": id}),
    )
    .await;
    assert_eq!(next.header("x-memory-conversation-id"), "s");

    // A cut stream stores nothing.
    mock.push(Reply::CutStream { chunks: 2 });
    let headers = [("authorization", AUTH), ("x-memory-conversation-id", "s")];
    let request = json!({"model": "m", "input": "cut", "stream": true});
    assert!(post_cut(&proxy.url("/v1/responses"), &headers, &request).await);
    assert_eq!(proxy.stored(Some(TOKEN), "s").len(), 4);
}

#[tokio::test]
async fn get_and_delete_answer_for_ids_memproxy_answered() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { proxy, .. } = Harness::new().anthropic_to(&claude).start().await;
    let first = responses(
        &proxy,
        Some("g"),
        &json!({"model": "m", "input": "keep this"}),
    )
    .await;
    let id = first.json()["id"].as_str().unwrap().to_string();
    let url = proxy.url(&format!("/v1/responses/{id}"));
    let got = send("GET", &url, &[("authorization", AUTH)], "").await;
    assert_eq!(got.status, 200);
    assert_eq!(got.json()["id"], id.as_str());
    assert_eq!(got.json()["output"], first.json()["output"]);
    // Another tenant: not memproxy's to answer; it goes upstream.
    let other = send("GET", &url, &[("authorization", "Bearer sk-other")], "").await;
    assert_eq!(other.json()["path"], format!("/v1/responses/{id}"));
    let deleted = send("DELETE", &url, &[("authorization", AUTH)], "").await;
    assert_eq!(deleted.json()["deleted"], true);
    let again = send("GET", &url, &[("authorization", AUTH)], "").await;
    assert_eq!(
        again.json()["path"],
        format!("/v1/responses/{id}"),
        "forgotten: upstream's"
    );
}

#[tokio::test]
async fn anthropic_messages_keep_memory_and_go_to_the_anthropic_upstream() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { mock, proxy, .. } = Harness::new().anthropic_to(&claude).start().await;

    for text in ["my dog is Rex", "I like tea", "what is my dog called?"] {
        let request = json!({"model": "claude-sonnet-4-6", "max_tokens": 100, "system": "Be brief.", "messages": [{"role": "user", "content": text}]});
        let answer = messages(&proxy, "a1", &request).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.header("x-memory-status"), "stored");
        assert_eq!(answer.json()["type"], "message");
    }
    assert!(
        mock.anthropic_requests().is_empty(),
        "nothing to the OpenAI upstream"
    );
    let last = claude.anthropic_requests().last().unwrap().clone();
    assert_eq!(last.headers["x-api-key"], "sk-ant-test");
    assert_eq!(last.headers["anthropic-version"], "2023-06-01");
    assert_eq!(last.headers["anthropic-beta"], "tools-2024-04-04");
    let forwarded = last.json();
    assert_eq!(forwarded["system"], "Be brief.");
    let list = forwarded["messages"].as_array().unwrap();
    assert_eq!(list.len(), 5);
    assert_eq!(list[0], json!({"role": "user", "content": "my dog is Rex"}));
    assert_eq!(list[1]["content"][0]["text"], "reply to: my dog is Rex");
    let stored = summarize(&proxy.stored(Some("sk-ant-test"), "a1"));
    assert_eq!(stored.len(), 6);
    assert_eq!(stored[1], "assistant:reply to: my dog is Rex");

    // The same conversation continued with chat completions sees the same memory.
    let answer = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[
            ("x-api-key", "sk-ant-test"),
            ("content-type", "application/json"),
            ("x-memory-conversation-id", "a1"),
        ],
        body(&[user("and my drink?")]).to_string(),
    )
    .await;
    assert_eq!(answer.status, 200);
    let forwarded = mock.last_messages();
    assert_eq!(forwarded.len(), 7);
    assert_eq!(
        forwarded[1],
        json!({"role": "assistant", "content": "reply to: my dog is Rex"})
    );

    // count_tokens and models (asked with anthropic-version) reach the Anthropic upstream.
    let headers = [
        ("x-api-key", "sk-ant-test"),
        ("anthropic-version", "2023-06-01"),
    ];
    let count = send(
        "POST",
        &proxy.url("/v1/messages/count_tokens"),
        &headers,
        "{\"messages\":[]}",
    )
    .await;
    assert!(count.json()["input_tokens"].is_number());
    let models = send("GET", &proxy.url("/v1/models"), &headers, "").await;
    assert_eq!(models.json()["data"][0]["id"], "claude-mock");
    let openai_models = send(
        "GET",
        &proxy.url("/v1/models"),
        &[("authorization", AUTH)],
        "",
    )
    .await;
    assert_eq!(openai_models.json()["data"][0]["id"], "mock-model");
}

#[tokio::test]
async fn anthropic_tool_rounds_thinking_and_memory_in_system_keep_the_list_valid() {
    let claude = MockUpstream::start().await.unwrap();
    let settings = "[memory]\nrecent_n = 2\nrelevance_enabled = true\nrelevance_top_k = 2\n";
    let Started { proxy, .. } = Harness::new()
        .anthropic_to(&claude)
        .config(settings)
        .start()
        .await;

    let signature = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrk+/==";
    claude.push(Reply::Reasoning(
        signature.into(),
        Box::new(Reply::ToolCalls(vec![(
            "toolu_1".into(),
            "get_weather".into(),
            "{\"city\":\"Oslo\"}".into(),
        )])),
    ));
    let tools = json!([{"name": "get_weather", "input_schema": {"type": "object"}}]);
    let ask = json!({"role": "user", "content": "the secret harbour is Bergen; weather in Oslo?"});
    let first = messages(
        &proxy,
        "t",
        &json!({"model": "claude", "max_tokens": 50, "tools": tools, "messages": [ask]}),
    )
    .await;
    let content = first.json()["content"].clone();
    assert_eq!(content[0]["signature"], signature);
    let result = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold"}]});
    let second = messages(&proxy, "t", &json!({"model": "claude", "max_tokens": 50, "tools": tools, "messages": [ask, {"role": "assistant", "content": content}, result]})).await;
    assert_eq!(second.header("x-memory-status"), "stored");
    let forwarded = claude.anthropic_requests().last().unwrap().clone();
    let raw = String::from_utf8(forwarded.body.to_vec()).unwrap();
    assert!(
        raw.contains(&format!("\"signature\":\"{signature}\"")),
        "{raw}"
    );
    let list = forwarded.json()["messages"].as_array().unwrap().clone();
    assert_eq!(list[1]["content"][0]["type"], "thinking");
    assert_eq!(list[2]["content"][0]["type"], "tool_result");
    assert_eq!(
        proxy.stored(Some("sk-ant-test"), "t").len(),
        4,
        "history stored once"
    );

    // Later turns: older ones are recalled into the newest user turn, the list starts with a
    // user turn and alternates.
    for text in [
        "tell me about fjords",
        "and about trolls",
        "which harbour was secret?",
    ] {
        let answer = messages(&proxy, "t", &json!({"model": "claude", "max_tokens": 50, "system": [{"type": "text", "text": "Be brief."}], "messages": [{"role": "user", "content": text}]})).await;
        assert_eq!(answer.status, 200);
        let forwarded = claude.anthropic_requests().last().unwrap().json();
        let list = forwarded["messages"].as_array().unwrap();
        assert_eq!(list[0]["role"], "user");
        for pair in list.windows(2) {
            assert_ne!(pair[0]["role"], pair[1]["role"], "{list:?}");
        }
        assert_eq!(forwarded["system"][0]["text"], "Be brief.");
    }
    let forwarded = claude.anthropic_requests().last().unwrap().json();
    let newest = forwarded["messages"].as_array().unwrap().last().unwrap()["content"].to_string();
    assert!(
        newest.contains("Bergen"),
        "recalled into the newest user turn: {newest}"
    );
}

#[tokio::test]
async fn anthropic_streams_are_teed_and_a_cut_stream_stores_nothing() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { proxy, .. } = Harness::new().anthropic_to(&claude).start().await;
    let request = json!({"model": "claude", "max_tokens": 50, "stream": true, "messages": [{"role": "user", "content": "stream it"}]});
    let answer = messages(&proxy, "st", &request).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    let text = String::from_utf8(answer.body.to_vec()).unwrap();
    assert!(text.starts_with("event: message_start\n") && text.contains("event: message_stop\n"));
    assert_eq!(
        summarize(&proxy.stored(Some("sk-ant-test"), "st")),
        ["user:stream it", "assistant:reply to: stream it"]
    );
    claude.push(Reply::CutStream { chunks: 2 });
    let request = json!({"model": "claude", "max_tokens": 50, "stream": true, "messages": [{"role": "user", "content": "cut"}]});
    let headers = [
        ("x-api-key", "sk-ant-test"),
        ("x-memory-conversation-id", "st"),
    ];
    assert!(post_cut(&proxy.url("/v1/messages"), &headers, &request).await);
    assert_eq!(proxy.stored(Some("sk-ant-test"), "st").len(), 2);
}

#[tokio::test]
async fn bad_bodies_name_their_field() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { mock, proxy, .. } = Harness::new().anthropic_to(&claude).start().await;
    let answer = responses(
        &proxy,
        Some("b"),
        &json!({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}),
    )
    .await;
    assert_eq!(answer.status, 400);
    assert_eq!(answer.error_param(), "input[0].call_id");
    let answer = messages(
        &proxy,
        "b",
        &json!({"model": "c", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}),
    )
    .await;
    assert_eq!(answer.status, 400);
    assert_eq!(answer.error_param(), "messages[0].role");
    assert!(claude.recorded().is_empty() && mock.recorded().is_empty());
}

#[tokio::test]
async fn summaries_of_a_claude_model_call_the_anthropic_upstream() {
    let claude = MockUpstream::start().await.unwrap();
    let settings = "[memory]\nrecent_n = 2\ncompression_threshold_tokens = 60\ncompression_async = false\ncompression_model = \"claude-haiku\"\nrelevance_enabled = false\n";
    let Started { mock, proxy, .. } = Harness::new()
        .anthropic_to(&claude)
        .config(settings)
        .start()
        .await;
    let mut summarized = false;
    for i in 0..10 {
        let text =
            format!("fact {i}: the green kettle sits on hook {i} in the old boathouse by the pier");
        let answer = messages(&proxy, "sum", &json!({"model": "claude", "max_tokens": 50, "messages": [{"role": "user", "content": text}]})).await;
        if answer.header("x-memory-summary") != "none" {
            summarized = true;
            break;
        }
    }
    assert!(summarized);
    let calls = claude.summary_requests();
    assert!(
        !calls.is_empty(),
        "a summary call on the Anthropic upstream"
    );
    assert!(calls[0].path.ends_with("/v1/messages"));
    assert_eq!(calls[0].json()["model"], "claude-haiku");
    assert!(mock.summary_requests().is_empty());
    let system = claude.anthropic_requests().last().unwrap().json()["system"].to_string();
    assert!(
        system.contains("[Summary of earlier conversation"),
        "{system}"
    );
}

#[tokio::test]
async fn a_stateless_client_resending_its_whole_input_is_stored_once() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { mock, proxy, .. } = Harness::new().anthropic_to(&claude).start().await;
    // Codex-style: `store: false`, the whole history as items every turn, reasoning included.
    mock.push(Reply::Reasoning("enc-1".into(), Box::new(Reply::Auto)));
    let user_item = |text: &str| json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]});
    let mut input = vec![user_item("first question")];
    let mut sent = Vec::new();
    for turn in 1..=3 {
        sent = input.clone();
        let request = json!({"model": "gpt-5-codex", "store": false, "instructions": "You are Codex.", "input": input});
        let answer = responses(&proxy, Some("codex"), &request).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
        assert_eq!(answer.header("x-memory-turns"), (turn * 2).to_string());
        input.extend(answer.json()["output"].as_array().unwrap().iter().cloned());
        input.push(user_item(&format!("question {}", turn + 1)));
    }
    let stored = summarize(&proxy.stored(Some(TOKEN), "codex"));
    assert_eq!(stored.len(), 6, "{stored:?}");
    // What was forwarded last: the client's items, the reasoning item among them, once each.
    let forwarded = last_input(&mock);
    let reasoning = forwarded
        .iter()
        .filter(|i| i["type"] == "reasoning")
        .count();
    assert_eq!(reasoning, 1, "{forwarded:?}");
    // Memory rebuilt exactly the items the client sent.
    assert_eq!(forwarded, sent);
}

#[tokio::test]
async fn persist_and_enabled_work_for_responses_as_for_chat() {
    let claude = MockUpstream::start().await.unwrap();
    let Started { mock, proxy, .. } = Harness::new().anthropic_to(&claude).start().await;
    let post = |extra: &'static [(&'static str, &'static str)], body: Value| {
        let url = proxy.url("/v1/responses");
        async move {
            let mut headers = vec![
                ("authorization", AUTH),
                ("content-type", "application/json"),
                ("x-memory-conversation-id", "p"),
            ];
            headers.extend_from_slice(extra);
            send("POST", &url, &headers, body.to_string()).await
        }
    };
    post(
        &[],
        json!({"model": "m", "input": "remember the violet door"}),
    )
    .await;
    // persist off: memory used, nothing stored, the id not remembered.
    let answer = post(
        &[("x-memory-persist", "false")],
        json!({"model": "m", "input": "which door?"}),
    )
    .await;
    assert_eq!(answer.header("x-memory-status"), "not-stored");
    assert!(texts(&last_input(&mock)).contains("violet door"));
    let id = answer.json()["id"].as_str().unwrap().to_string();
    let chained = responses(
        &proxy,
        None,
        &json!({"model": "m", "input": "x", "previous_response_id": id}),
    )
    .await;
    assert_eq!(chained.header("x-memory-status"), "off");
    // enabled off: forwarded as sent.
    let body = json!({"model": "m", "input": "untouched"});
    let answer = post(&[("x-memory-enabled", "false")], body.clone()).await;
    assert_eq!(answer.header("x-memory-status"), "off");
    assert_eq!(mock.responses_requests().last().unwrap().json(), body);
    assert_eq!(proxy.stored(Some(TOKEN), "p").len(), 2);
}
