//! The strict mock upstream (`tests/support/strict.rs`): each provider rule refuses a body that
//! breaks it and accepts the same body made valid, and the mock answers a refused request with
//! the provider's status and error shape, lists it, and can be told to answer anything.

use serde_json::{Value, json};

use crate::support;
use crate::support::mock_upstream::strict::{
    self, Api, Issued, check_anthropic_value, check_chat_value, check_responses_value,
};
use crate::support::mock_upstream::{MockOptions, MockUpstream, Reply, THINKING_TEXT};
use crate::support::send;

/// Asserts that `result` is a refusal whose message contains `needle`.
#[track_caller]
fn refused(result: Result<(), String>, needle: &str) {
    match result {
        Ok(()) => panic!("accepted, expected a refusal containing {needle:?}"),
        Err(message) => assert!(
            message.contains(needle),
            "refusal {message:?} does not contain {needle:?}"
        ),
    }
}

#[track_caller]
fn accepted(result: Result<(), String>) {
    if let Err(message) = result {
        panic!("refused: {message}");
    }
}

// ---------------------------------------------------------------------------------------------
// Anthropic Messages
// ---------------------------------------------------------------------------------------------

fn claude(messages: Value) -> Value {
    json!({"model": "claude-mock", "max_tokens": 64, "messages": messages})
}

fn anthropic(body: &Value) -> Result<(), String> {
    check_anthropic_value(body, "", &Issued::default())
}

#[test]
fn anthropic_requires_model_max_tokens_and_messages() {
    accepted(anthropic(&claude(
        json!([{"role": "user", "content": "hi"}]),
    )));
    let mut body = claude(json!([{"role": "user", "content": "hi"}]));
    body.as_object_mut().unwrap().remove("max_tokens");
    refused(anthropic(&body), "max_tokens: Field required");
    let mut body = claude(json!([{"role": "user", "content": "hi"}]));
    body.as_object_mut().unwrap().remove("model");
    refused(anthropic(&body), "model: Field required");
    refused(anthropic(&claude(json!([]))), "at least one message");
}

#[test]
fn anthropic_roles_and_the_first_message() {
    refused(
        anthropic(&claude(json!([{"role": "tool", "content": "hi"}]))),
        "messages.0.role",
    );
    refused(
        anthropic(&claude(json!([
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "hi"}
        ]))),
        "first message must use the \"user\" role",
    );
    // Consecutive same-role messages are merged by the API, not refused.
    accepted(anthropic(&claude(json!([
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b"}
    ]))));
}

#[test]
fn anthropic_system_messages_need_the_mid_conversation_system_beta() {
    let body = claude(json!([
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "go"}
    ]));
    refused(
        check_anthropic_value(&body, "tools-2024-04-04", &Issued::default()),
        "messages.1.role: Input should be 'user' or 'assistant'",
    );
    accepted(check_anthropic_value(
        &body,
        "tools-2024-04-04, mid-conversation-system-2026-04-07",
        &Issued::default(),
    ));
    accepted(check_anthropic_value(
        &body,
        "claude-code-20250219,interleaved-thinking-2025-05-14",
        &Issued::default(),
    ));
    // Leading system messages pass with the beta; the first other message is still a user one.
    let leading = claude(json!([
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "hi"}
    ]));
    accepted(check_anthropic_value(
        &leading,
        "mid-conversation-system-2026-04-07",
        &Issued::default(),
    ));
    refused(anthropic(&leading), "messages.0.role");
}

#[test]
fn anthropic_system_is_a_string_or_text_blocks() {
    let mut body = claude(json!([{"role": "user", "content": "hi"}]));
    body["system"] = json!([{"type": "text", "text": "rules"}]);
    accepted(anthropic(&body));
    body["system"] = json!([{"type": "image", "source": {}}]);
    refused(anthropic(&body), "system.0.type");
    body["system"] = json!(42);
    refused(anthropic(&body), "system: Input should be a valid list");
}

#[test]
fn anthropic_content_is_non_empty() {
    refused(
        anthropic(&claude(json!([{"role": "user", "content": ""}]))),
        "all messages must have non-empty content",
    );
    refused(
        anthropic(&claude(
            json!([{"role": "user", "content": [{"type": "text", "text": ""}]}]),
        )),
        "text content blocks must be non-empty",
    );
    // Only a final assistant message (a prefill) may be empty.
    accepted(anthropic(&claude(json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""}
    ]))));
}

#[test]
fn anthropic_block_types_are_known_and_in_their_role() {
    refused(
        anthropic(&claude(
            json!([{"role": "user", "content": [{"type": "made_up", "text": "x"}]}]),
        )),
        "Input tag 'made_up'",
    );
    refused(
        anthropic(&claude(json!([
            {"role": "user", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
        ]))),
        "`tool_use` blocks can only be in `assistant` messages",
    );
}

fn tool_round(result_first: bool) -> Value {
    let result = json!({"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"});
    let text = json!({"type": "text", "text": "and then?"});
    let answer = if result_first {
        json!([result, text])
    } else {
        json!([text, result])
    };
    claude(json!([
        {"role": "user", "content": "compute"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {}}]},
        {"role": "user", "content": answer}
    ]))
}

#[test]
fn anthropic_tool_use_is_answered_at_the_start_of_the_next_turn() {
    accepted(anthropic(&tool_round(true)));
    refused(
        anthropic(&tool_round(false)),
        "messages.2: Did not find 1 `tool_result` block(s) at the beginning of this message",
    );
    let unanswered = claude(json!([
        {"role": "user", "content": "compute"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {}}]},
        {"role": "user", "content": "never mind"}
    ]));
    refused(
        anthropic(&unanswered),
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1",
    );
    let pending = claude(json!([
        {"role": "user", "content": "compute"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {}}]}
    ]));
    refused(anthropic(&pending), "toolu_1");
}

#[test]
fn anthropic_tool_result_answers_the_turn_before() {
    let orphan = claude(json!([
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}
    ]));
    refused(
        anthropic(&orphan),
        "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9",
    );
    let late = claude(json!([
        {"role": "user", "content": "compute"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]}
    ]));
    refused(
        anthropic(&late),
        "messages.4.content.0: unexpected `tool_use_id`",
    );
}

#[test]
fn anthropic_tool_use_ids_are_unique() {
    let body = claude(json!([
        {"role": "user", "content": "compute"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {}},
            {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {}}
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]}
    ]));
    refused(anthropic(&body), "`tool_use` ids must be unique");
}

fn marked(text: &str) -> Value {
    json!({"type": "text", "text": text, "cache_control": {"type": "ephemeral"}})
}

#[test]
fn anthropic_allows_at_most_four_cache_breakpoints() {
    let mut body = claude(json!([
        {"role": "user", "content": [marked("one")]},
        {"role": "assistant", "content": [marked("two")]},
        {"role": "user", "content": [marked("three")]}
    ]));
    body["system"] = json!([marked("rules")]);
    accepted(anthropic(&body));
    body["tools"] = json!([{"name": "calc", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]);
    refused(
        anthropic(&body),
        "A maximum of 4 blocks with cache_control may be provided. Found 5.",
    );
}

#[test]
fn anthropic_cache_ttls_go_from_long_to_short() {
    let long = json!({"type": "text", "text": "rules", "cache_control": {"type": "ephemeral", "ttl": "1h"}});
    let mut body = claude(json!([{"role": "user", "content": [marked("hi")]}]));
    body["system"] = json!([long.clone()]);
    accepted(anthropic(&body));
    let mut body = claude(json!([{"role": "user", "content": [long]}]));
    body["system"] = json!([marked("rules")]);
    refused(
        anthropic(&body),
        "ttl='1h' cache_control block must not come after",
    );
}

#[test]
fn anthropic_thinking_signatures_must_be_the_ones_issued() {
    let mut issued = Issued::default();
    issued.thinking("sig-1", THINKING_TEXT);
    let body = |thinking: &str, signature: &str| {
        claude(json!([
            {"role": "user", "content": "think"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": thinking, "signature": signature},
                {"type": "text", "text": "ok"}
            ]},
            {"role": "user", "content": "more"}
        ]))
    };
    accepted(check_anthropic_value(
        &body(THINKING_TEXT, "sig-1"),
        "",
        &issued,
    ));
    refused(
        check_anthropic_value(&body(THINKING_TEXT, "sig-2"), "", &issued),
        "messages.1.content.0: Invalid `signature` in `thinking` block",
    );
    refused(
        check_anthropic_value(&body("Let me think again.", "sig-1"), "", &issued),
        "Invalid `signature` in `thinking` block",
    );
}

#[test]
fn anthropic_forced_tool_choice_names_a_tool_and_thinking_has_a_budget() {
    let mut body = claude(json!([{"role": "user", "content": "hi"}]));
    body["tools"] = json!([{"name": "save", "input_schema": {"type": "object"}}]);
    body["tool_choice"] = json!({"type": "tool", "name": "save"});
    accepted(anthropic(&body));
    body["tool_choice"] = json!({"type": "tool", "name": "load"});
    refused(anthropic(&body), "tool_choice");
    body["tools"] =
        json!([{"name": "save", "input_schema": {}}, {"name": "save", "input_schema": {}}]);
    body["tool_choice"] = json!({"type": "auto"});
    refused(anthropic(&body), "Tool names must be unique");

    let mut body = claude(json!([{"role": "user", "content": "hi"}]));
    body["max_tokens"] = json!(4096);
    body["thinking"] = json!({"type": "enabled", "budget_tokens": 2048});
    accepted(anthropic(&body));
    body["thinking"] = json!({"type": "enabled", "budget_tokens": 8192});
    refused(
        anthropic(&body),
        "`max_tokens` must be greater than `thinking.budget_tokens`",
    );
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

fn responses_body(input: Value) -> Value {
    json!({"model": "gpt-mock", "input": input})
}

fn responses(body: &Value) -> Result<(), String> {
    check_responses_value(body, &Issued::default())
}

fn call(id: &str) -> Value {
    json!({"type": "function_call", "call_id": id, "name": "lookup", "arguments": "{}"})
}

fn output(id: &str) -> Value {
    json!({"type": "function_call_output", "call_id": id, "output": "found"})
}

fn said(role: &str, text: &str) -> Value {
    json!({"role": role, "content": text})
}

#[test]
fn responses_function_calls_have_their_outputs() {
    accepted(responses(&responses_body(json!([
        said("user", "look it up"),
        call("call_1"),
        output("call_1")
    ]))));
    refused(
        responses(&responses_body(json!([
            said("user", "look it up"),
            call("call_1")
        ]))),
        "No tool output found for function call call_1.",
    );
    refused(
        responses(&responses_body(json!([
            said("user", "look it up"),
            call("call_1"),
            said("user", "never mind")
        ]))),
        "No tool output found for function call call_1.",
    );
}

#[test]
fn responses_outputs_answer_an_earlier_call_unless_a_stored_response_holds_it() {
    let body = responses_body(json!([output("call_7")]));
    refused(
        responses(&body),
        "No tool call found for function call output with call_id call_7.",
    );
    let mut chained = body.clone();
    chained["previous_response_id"] = json!("resp_1");
    accepted(responses(&chained));
    // An output before its call does not answer it.
    refused(
        responses(&responses_body(json!([output("call_1"), call("call_1")]))),
        "No tool call found",
    );
}

#[test]
fn responses_items_have_a_known_type_or_role() {
    refused(
        responses(&responses_body(json!([{"type": "made_up"}]))),
        "Invalid value: 'made_up'",
    );
    refused(
        responses(&responses_body(json!([said("tool", "x")]))),
        "Invalid value: 'tool'",
    );
    refused(
        responses(&responses_body(json!([{"content": "no role"}]))),
        "input[0].role",
    );
    // An assistant message holds output parts; input parts are the others'.
    let assistant = |kind: &str| json!({"type": "message", "role": "assistant", "content": [{"type": kind, "text": "x"}]});
    accepted(responses(&responses_body(json!([
        said("user", "hi"),
        assistant("output_text")
    ]))));
    refused(
        responses(&responses_body(json!([
            said("user", "hi"),
            assistant("input_text")
        ]))),
        "Invalid value: 'input_text'. Supported values are: 'output_text' and 'refusal'.",
    );
}

#[test]
fn responses_item_ids_are_unique() {
    let item = json!({"type": "message", "id": "msg_1", "role": "user", "content": "hi"});
    refused(
        responses(&responses_body(json!([item.clone(), item]))),
        "Duplicate item found with id msg_1",
    );
}

#[test]
fn responses_reasoning_comes_back_as_issued() {
    let mut issued = Issued::default();
    issued.encrypted_content("enc-1");
    let reasoning = |content: &str| json!({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": content});
    let body = |content: &str| {
        responses_body(json!([
            said("user", "hi"),
            reasoning(content),
            said("assistant", "ok"),
            said("user", "more")
        ]))
    };
    accepted(check_responses_value(&body("enc-1"), &issued));
    refused(
        check_responses_value(&body("enc-1 "), &issued),
        "The encrypted content for item rs_1 could not be verified.",
    );
    refused(
        check_responses_value(
            &responses_body(json!([{"type": "reasoning", "encrypted_content": "enc-1"}])),
            &issued,
        ),
        "input[0].summary",
    );
}

#[test]
fn responses_require_a_model() {
    refused(
        responses(&json!({"input": "hi"})),
        "Missing required parameter: 'model'.",
    );
    accepted(responses(&responses_body(json!("hi"))));
}

// ---------------------------------------------------------------------------------------------
// Chat completions
// ---------------------------------------------------------------------------------------------

fn chat_body(messages: Value) -> Value {
    json!({"model": "gpt-mock", "messages": messages})
}

fn with_calls(ids: &[&str]) -> Value {
    let calls: Vec<Value> = ids
        .iter()
        .map(|id| json!({"id": id, "type": "function", "function": {"name": "f", "arguments": "{}"}}))
        .collect();
    json!({"role": "assistant", "content": null, "tool_calls": calls})
}

fn tool(id: &str) -> Value {
    json!({"role": "tool", "tool_call_id": id, "content": "result"})
}

#[test]
fn chat_tool_calls_are_answered_before_the_next_message() {
    accepted(check_chat_value(&chat_body(json!([
        said("user", "go"),
        with_calls(&["call_a", "call_b"]),
        tool("call_b"),
        tool("call_a"),
        said("user", "thanks")
    ]))));
    refused(
        check_chat_value(&chat_body(json!([
            said("user", "go"),
            with_calls(&["call_a", "call_b"]),
            tool("call_a"),
            said("user", "thanks")
        ]))),
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: call_b",
    );
    refused(
        check_chat_value(&chat_body(json!([
            said("user", "go"),
            with_calls(&["call_a"])
        ]))),
        "call_a",
    );
}

#[test]
fn chat_tool_messages_follow_tool_calls() {
    refused(
        check_chat_value(&chat_body(json!([said("user", "go"), tool("call_a")]))),
        "messages with role 'tool' must be a response to a preceeding message with 'tool_calls'",
    );
    refused(
        check_chat_value(&chat_body(json!([
            said("user", "go"),
            with_calls(&["call_a"]),
            tool("call_z")
        ]))),
        "'tool_call_id' of 'call_z' not found in 'tool_calls' of previous message.",
    );
}

#[test]
fn chat_roles_and_messages() {
    refused(
        check_chat_value(&chat_body(json!([]))),
        "Invalid 'messages': empty array",
    );
    refused(
        check_chat_value(&chat_body(json!([said("robot", "hi")]))),
        "Invalid value: 'robot'",
    );
    accepted(check_chat_value(&chat_body(json!([
        said("developer", "rules"),
        said("system", "more rules"),
        said("user", "hi"),
        said("assistant", "hello")
    ]))));
    refused(
        check_chat_value(&json!({"messages": [said("user", "hi")]})),
        "you must provide a model parameter",
    );
}

// ---------------------------------------------------------------------------------------------
// The mock over HTTP
// ---------------------------------------------------------------------------------------------

async fn post(
    mock: &MockUpstream,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> support::Answer {
    let url = format!("http://{}{path}", mock.addr);
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    send("POST", &url, &all, body.to_string()).await
}

#[tokio::test]
async fn a_refused_request_gets_the_providers_error_and_is_listed() {
    let mock = MockUpstream::start().await.unwrap();
    mock.push(Reply::Text("scripted".into()));
    let bad = chat_body(json!([said("user", "go"), with_calls(&["call_a"])]));
    let answer = post(
        &mock,
        "/v1/chat/completions",
        &[("x-memproxy-task", "summary")],
        &bad,
    )
    .await;
    assert_eq!(answer.status, 400);
    let error = answer.json();
    assert_eq!(error["error"]["type"], "invalid_request_error");
    assert_eq!(error["error"]["param"], "messages.[1].role");
    assert!(error["error"]["code"].is_null());
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("call_a")
    );

    let bad = claude(json!([{"role": "assistant", "content": "first"}]));
    let answer = post(
        &mock,
        "/v1/messages",
        &[("anthropic-version", "2023-06-01")],
        &bad,
    )
    .await;
    assert_eq!(answer.status, 400);
    let error = answer.json();
    assert_eq!(error["type"], "error");
    assert_eq!(error["error"]["type"], "invalid_request_error");

    let refusals = mock.refusals();
    assert_eq!(refusals.len(), 2);
    assert_eq!(refusals[0].task, "summary");
    assert_eq!(refusals[1].refusal.api, Api::Anthropic);

    // The e2e tests read the same list over HTTP; it holds no header.
    let url = format!("http://{}/_mock/refusals", mock.addr);
    let listed = send("GET", &url, &[], "").await.json();
    assert_eq!(listed.as_array().unwrap().len(), 2);
    assert_eq!(listed[0]["path"], "/v1/chat/completions");
    assert_eq!(listed[0]["status"], 400);
    assert!(listed[0].get("headers").is_none());

    // A refusal comes before the script: the scripted reply is still there for a valid call.
    let good = chat_body(json!([said("user", "go")]));
    let answer = post(&mock, "/v1/chat/completions", &[], &good).await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.json()["choices"][0]["message"]["content"],
        "scripted"
    );
    assert_eq!(mock.take_refusals().len(), 2);
    assert!(mock.refusals().is_empty(), "taken");
}

#[tokio::test]
async fn strictness_can_be_turned_off_for_a_mock() {
    let bad = chat_body(json!([said("user", "go"), tool("call_a")]));
    let lenient = MockUpstream::start_with(
        MockOptions {
            strict: false,
            ..MockOptions::default()
        },
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        post(&lenient, "/v1/chat/completions", &[], &bad)
            .await
            .status,
        200
    );

    let mock = MockUpstream::start().await.unwrap();
    assert_eq!(
        post(&mock, "/v1/chat/completions", &[], &bad).await.status,
        400
    );
    mock.set_strict(false);
    assert_eq!(
        post(&mock, "/v1/chat/completions", &[], &bad).await.status,
        200
    );
    let url = format!("http://{}/_mock/strict", mock.addr);
    let on = send("POST", &url, &[], json!({"strict": true}).to_string()).await;
    assert_eq!(on.status, 200);
    assert_eq!(
        post(&mock, "/v1/chat/completions", &[], &bad).await.status,
        400
    );
    assert_eq!(mock.take_refusals().len(), 2);
}

#[tokio::test]
async fn what_the_mock_issued_comes_back_accepted_and_anything_else_is_refused() {
    let mock = MockUpstream::start().await.unwrap();
    mock.push(Reply::Reasoning("sig-issued".into(), Box::new(Reply::Auto)));
    let first = claude(json!([{"role": "user", "content": "think"}]));
    let answer = post(&mock, "/v1/messages", &[], &first).await;
    assert_eq!(answer.status, 200);
    let content = answer.json()["content"].clone();
    assert_eq!(content[0]["signature"], "sig-issued");

    let next = |content: Value| {
        claude(json!([
            {"role": "user", "content": "think"},
            {"role": "assistant", "content": content},
            {"role": "user", "content": "more"}
        ]))
    };
    assert_eq!(
        post(&mock, "/v1/messages", &[], &next(content.clone()))
            .await
            .status,
        200
    );
    let mut forged = content;
    forged[0]["signature"] = json!("sig-forged");
    let answer = post(&mock, "/v1/messages", &[], &next(forged)).await;
    assert_eq!(answer.status, 400);
    assert!(
        answer.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Invalid `signature` in `thinking` block")
    );

    mock.push(Reply::Reasoning("enc-issued".into(), Box::new(Reply::Auto)));
    let answer = post(&mock, "/v1/responses", &[], &responses_body(json!("hi"))).await;
    let reasoning = answer.json()["output"][0].clone();
    assert_eq!(reasoning["encrypted_content"], "enc-issued");
    let again = |item: Value| {
        responses_body(json!([
            said("user", "hi"),
            item,
            said("assistant", "ok"),
            said("user", "more")
        ]))
    };
    assert_eq!(
        post(&mock, "/v1/responses", &[], &again(reasoning.clone()))
            .await
            .status,
        200
    );
    let mut changed = reasoning;
    changed["encrypted_content"] = json!("enc-changed");
    assert_eq!(
        post(&mock, "/v1/responses", &[], &again(changed))
            .await
            .status,
        400
    );
    assert_eq!(mock.take_refusals().len(), 2);
}

/// A refusal nobody took fails the test when its mock is dropped, even though the test never
/// read the answer.
#[tokio::test]
#[should_panic(expected = "the strict mock upstream refused 1 request(s)")]
async fn a_refusal_nobody_took_fails_the_test() {
    let mock = MockUpstream::start().await.unwrap();
    let bad = chat_body(json!([said("user", "go"), tool("call_a")]));
    let _ignored = post(&mock, "/v1/chat/completions", &[], &bad).await;
}

#[test]
fn the_refusal_bodies_have_each_providers_shape() {
    let openai = strict::check(Api::Responses, "", b"[1]", &Issued::default()).unwrap_err();
    let body = openai.body();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"].get("param").is_some());
    let anthropic = strict::check(Api::Anthropic, "", b"{}", &Issued::default()).unwrap_err();
    assert_eq!(anthropic.body()["type"], "error");
    assert_eq!(
        anthropic.body()["error"]["message"],
        "model: Field required"
    );
    assert_eq!(Api::of("GET", "/v1/responses"), None);
    assert_eq!(Api::of("POST", "/v1/messages/count_tokens"), None);
    assert_eq!(
        Api::of("POST", "/v1/messages?beta=true"),
        Some(Api::Anthropic)
    );
}
