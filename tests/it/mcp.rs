//! The memory tools over MCP (`/mcp`, issue 25): JSON-RPC posts as a Streamable HTTP client
//! sends them (stateless: every request answered on its own). What a tool changes is in the
//! next chat request's prompt and what the chat path learned is found by the tools; calls
//! across tenants and users are refused; bad arguments are MCP errors naming the argument;
//! `/mcp` needs a client key like a chat request, honours the body limit, and can be off.

use serde_json::{Value, json};

use crate::support;
use crate::support::mock_upstream::{MockUpstream, Reply};
use crate::support::*;

const ANA: &str = "ana";

/// Posts one JSON-RPC request to `/mcp` with `token` and, if any, the user header.
async fn rpc(
    proxy: &Proxy,
    token: &str,
    user: Option<&str>,
    method: &str,
    params: Value,
) -> Answer {
    let auth = format!("Bearer {token}");
    let mut headers = vec![
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-protocol-version", "2025-11-25"),
    ];
    if let Some(user) = user {
        headers.push(("x-memory-user-id", user));
    }
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    send("POST", &proxy.url("/mcp"), &headers, body.to_string()).await
}

/// Calls `tool` as `token` (and `user`, in the header).
async fn call(
    proxy: &Proxy,
    token: &str,
    user: Option<&str>,
    tool: &str,
    arguments: Value,
) -> Answer {
    let params = json!({"name": tool, "arguments": arguments});
    rpc(proxy, token, user, "tools/call", params).await
}

/// The structured result of a successful call.
fn result(answer: &Answer) -> Value {
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let json = answer.json();
    assert!(json.get("error").is_none(), "{json}");
    assert_eq!(json["result"]["isError"], false, "{json}");
    // The text content is the same JSON, for clients that read only text.
    let text = json["result"]["content"][0]["text"].as_str().unwrap();
    let structured = json["result"]["structuredContent"].clone();
    assert_eq!(serde_json::from_str::<Value>(text).unwrap(), structured);
    structured
}

/// Ana remembers `arguments` (memory_remember): the structured result.
async fn ana_remembers(proxy: &Proxy, arguments: Value) -> Value {
    result(&call(proxy, TOKEN, Some(ANA), "memory_remember", arguments).await)
}

/// The MCP error of a refused call: (code, message, the argument it names).
fn error(answer: &Answer) -> (i64, String, String) {
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let json = answer.json();
    let error = &json["error"];
    assert!(error.is_object(), "not an error: {json}");
    (
        error["code"].as_i64().unwrap(),
        error["message"].as_str().unwrap().to_string(),
        error["data"]["argument"].as_str().unwrap_or("").to_string(),
    )
}

/// The memories message of the last forwarded prompt ("" when there is none).
fn memories_in_prompt(mock: &MockUpstream) -> String {
    mock.last_messages()
        .iter()
        .filter_map(|m| m["content"].as_str())
        .find(|c| c.starts_with("[What you know about this user"))
        .unwrap_or("")
        .to_string()
}

/// A chat request of `user` in `conversation`.
async fn say(proxy: &Proxy, user: &str, conversation: &str, text: &str) {
    let extra = [("x-memory-user-id", user)];
    let answer = chat(proxy, conversation, &body(&[support::user(text)]), &extra).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
}

#[tokio::test]
async fn initialize_then_the_five_tools_are_listed_with_titles_schemas_and_hints() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let init = rpc(
        &proxy,
        TOKEN,
        None,
        "initialize",
        json!({"protocolVersion": "2025-11-25", "capabilities": {},
               "clientInfo": {"name": "it", "version": "1"}}),
    )
    .await;
    let init = init.json();
    assert_eq!(init["result"]["serverInfo"]["name"], "memproxy", "{init}");
    assert!(
        init["result"]["capabilities"]["tools"].is_object(),
        "{init}"
    );
    let listed = rpc(&proxy, TOKEN, None, "tools/list", json!({}))
        .await
        .json();
    let tools = listed["result"]["tools"].as_array().unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, memproxy::mcp::TOOL_NAMES);
    for tool in tools {
        assert!(tool["title"].is_string(), "{tool}");
        assert_eq!(tool["inputSchema"]["type"], "object", "{tool}");
        assert!(tool["annotations"]["readOnlyHint"].is_boolean(), "{tool}");
        assert!(
            tool["annotations"]["destructiveHint"].is_boolean(),
            "{tool}"
        );
    }
    proxy.stop().await;
}

#[tokio::test]
async fn a_memory_remembered_over_mcp_is_in_the_next_prompt_corrected_then_forgotten() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let remembered = ana_remembers(
        &proxy,
        json!({"text": "The user prefers window seats", "type": "preference", "importance": 0.9}),
    )
    .await;
    assert_eq!(remembered["kept"], "added");
    assert_eq!(remembered["memory"]["source"], "explicit_user_input");
    let id = remembered["memory"]["id"].as_u64().unwrap();
    // The same memory again changes nothing (deduplicated as extraction does).
    let again = call(
        &proxy,
        TOKEN,
        Some(ANA),
        "memory_remember",
        json!({"text": "The user prefers window seats", "type": "preference"}),
    )
    .await;
    assert_eq!(result(&again)["kept"], "already_known");
    assert_eq!(result(&again)["memory"]["id"], id);

    say(&proxy, ANA, "flight", "Book me a flight to Oslo").await;
    assert!(
        memories_in_prompt(&mock).contains("The user prefers window seats"),
        "{:?}",
        mock.last_messages()
    );

    let corrected = call(
        &proxy,
        TOKEN,
        Some(ANA),
        "memory_correct",
        json!({"id": id, "text": "The user prefers aisle seats"}),
    )
    .await;
    let corrected = result(&corrected);
    assert_eq!(corrected["memory"]["version"], 2);
    assert_eq!(corrected["memory"]["source"], "corrected_memory");
    assert_eq!(
        corrected["memory"]["history"][0]["text"],
        "The user prefers window seats"
    );
    say(&proxy, ANA, "flight", "And a hotel near the station").await;
    let prompt = memories_in_prompt(&mock);
    assert!(
        prompt.contains("aisle seats") && !prompt.contains("window"),
        "{prompt}"
    );

    let forgotten = call(&proxy, TOKEN, Some(ANA), "memory_forget", json!({"id": id})).await;
    assert_eq!(result(&forgotten)["forgotten"], id);
    say(&proxy, ANA, "flight", "Thanks, that is all").await;
    assert_eq!(memories_in_prompt(&mock), "");
    let (code, _, argument) =
        error(&call(&proxy, TOKEN, Some(ANA), "memory_forget", json!({"id": id})).await);
    assert_eq!((code, argument.as_str()), (-32602, "id"));
    proxy.stop().await;
}

fn extraction_answer(memories: Value) -> Reply {
    Reply::Text(json!({ "memories": memories }).to_string())
}

#[tokio::test]
async fn what_the_chat_path_learned_is_found_by_memory_search_and_conversation_recall() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    mock.push_extraction(extraction_answer(json!([
        {"text": "The user lives in Lisbon", "type": "profile", "scope": "private",
         "importance": 0.9, "confidence": 0.95, "tags": ["home"], "source_turns": [1], "supersedes": []}
    ])));
    let extra = [
        ("x-memory-user-id", ANA),
        ("x-memory-extraction-every", "2"),
    ];
    for text in ["I live in Lisbon, near the river", "Please answer briefly"] {
        let answer = chat(&proxy, "home", &body(&[support::user(text)]), &extra).await;
        assert_eq!(answer.status, 200);
    }
    let mut found = Value::Null;
    for _ in 0..100 {
        found = result(
            &call(
                &proxy,
                TOKEN,
                Some(ANA),
                "memory_search",
                json!({"query": "Where does the user live? Lisbon"}),
            )
            .await,
        );
        if !found["memories"].as_array().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let memory = &found["memories"][0];
    assert_eq!(memory["text"], "The user lives in Lisbon", "{found}");
    assert_eq!(memory["conversation"], "home");
    assert_eq!(memory["owner"], "user");
    assert!(memory["score"].as_f64().unwrap() > 0.0);
    assert!(memory["updated_at"].as_str().unwrap().ends_with('Z'));
    // The turns of her conversations, each with where it comes from.
    let turn = &found["turns"][0];
    assert_eq!(turn["conversation"], "home", "{found}");
    assert_eq!(turn["turn"], 1);
    assert_eq!(turn["role"], "user");
    assert!(turn["text"].as_str().unwrap().contains("Lisbon"));

    let recalled = result(
        &call(
            &proxy,
            TOKEN,
            Some(ANA),
            "conversation_recall",
            json!({"conversation": "home", "query": "river"}),
        )
        .await,
    );
    assert_eq!(recalled["turns"][0]["turn"], 1, "{recalled}");
    assert!(
        recalled["turns"][0]["text"]
            .as_str()
            .unwrap()
            .contains("river")
    );
    proxy.stop().await;
}

#[tokio::test]
async fn calls_across_tenants_and_users_are_refused() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let remembered = ana_remembers(
        &proxy,
        json!({"text": "The user is allergic to peanuts", "type": "profile"}),
    )
    .await;
    let id = remembered["memory"]["id"].as_u64().unwrap();
    say(&proxy, ANA, "diet", "I am allergic to peanuts").await;
    let search = json!({"query": "peanuts allergic"});

    // Another user of the tenant: nothing found, her memory and conversation out of reach.
    let bob = result(&call(&proxy, TOKEN, Some("bob"), "memory_search", search.clone()).await);
    assert_eq!(bob["memories"], json!([]), "{bob}");
    assert_eq!(bob["turns"], json!([]), "{bob}");
    for (tool, arguments, named) in [
        ("memory_forget", json!({"id": id}), "id"),
        ("memory_correct", json!({"id": id, "text": "Nothing"}), "id"),
        (
            "conversation_recall",
            json!({"conversation": "diet", "query": "peanuts"}),
            "conversation",
        ),
        // The header names the user: an argument naming another is refused.
        (
            "memory_search",
            json!({"query": "peanuts", "user": ANA}),
            "user",
        ),
    ] {
        let (code, message, argument) =
            error(&call(&proxy, TOKEN, Some("bob"), tool, arguments).await);
        assert_eq!(
            (code, argument.as_str()),
            (-32602, named),
            "{tool}: {message}"
        );
    }

    // The same user id under another credential: another tenant, nothing of hers.
    let other = result(
        &call(
            &proxy,
            "sk-other",
            Some(ANA),
            "memory_search",
            search.clone(),
        )
        .await,
    );
    assert_eq!(other["memories"], json!([]), "{other}");
    assert_eq!(other["turns"], json!([]), "{other}");
    for (tool, arguments) in [
        ("memory_forget", json!({"id": id})),
        (
            "conversation_recall",
            json!({"conversation": "diet", "query": "peanuts"}),
        ),
    ] {
        let (code, _, _) = error(&call(&proxy, "sk-other", Some(ANA), tool, arguments).await);
        assert_eq!(code, -32602, "{tool}");
    }

    // Hers are intact.
    let hers = result(&call(&proxy, TOKEN, Some(ANA), "memory_search", search).await);
    assert_eq!(hers["memories"][0]["id"], id, "{hers}");
    assert_eq!(hers["turns"][0]["conversation"], "diet", "{hers}");
    proxy.stop().await;
}

#[tokio::test]
async fn bad_arguments_are_mcp_errors_naming_the_argument() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    for (tool, arguments, named) in [
        ("memory_search", json!({}), "query"),
        ("memory_search", json!({"query": 3}), "query"),
        ("memory_search", json!({"query": "x", "limit": 0}), "limit"),
        (
            "memory_search",
            json!({"query": "x", "colour": "red"}),
            "arguments",
        ),
        (
            "memory_remember",
            json!({"text": "x", "type": "feeling"}),
            "type",
        ),
        (
            "memory_remember",
            json!({"text": "x", "type": "profile", "importance": 2}),
            "importance",
        ),
        (
            "memory_remember",
            json!({"text": "x".repeat(1001), "type": "profile"}),
            "text",
        ),
        (
            "memory_remember",
            json!({"text": "x", "type": "profile", "scope": "world"}),
            "scope",
        ),
        (
            "memory_remember",
            json!({"text": "x", "type": "profile", "tags": [1]}),
            "tags",
        ),
        ("memory_correct", json!({"id": "seven", "text": "x"}), "id"),
        ("memory_correct", json!({"id": 7}), "text"),
        ("memory_forget", json!({}), "id"),
        ("conversation_recall", json!({"query": "x"}), "conversation"),
        (
            "conversation_recall",
            json!({"conversation": "a/b", "query": "x"}),
            "conversation",
        ),
        ("no_such_tool", json!({}), "name"),
    ] {
        let answer = call(&proxy, TOKEN, Some(ANA), tool, arguments.clone()).await;
        let (code, message, argument) = error(&answer);
        assert_eq!(code, -32602, "{tool} {arguments}: {message}");
        assert_eq!(argument, named, "{tool} {arguments}: {message}");
        if named != "arguments" && named != "name" {
            assert!(message.contains(&format!("`{named}`")), "{message}");
        }
    }
    // Without a user header, the user is an argument: required, and checked.
    let (_, message, argument) =
        error(&call(&proxy, TOKEN, None, "memory_search", json!({"query": "x"})).await);
    assert_eq!(argument, "user", "{message}");
    let by_argument = call(
        &proxy,
        TOKEN,
        None,
        "memory_search",
        json!({"query": "x", "user": ANA}),
    )
    .await;
    assert_eq!(result(&by_argument)["user"], ANA);
    proxy.stop().await;
}

#[tokio::test]
async fn mcp_needs_a_client_key_honours_the_body_limit_and_can_be_turned_off() {
    let Started { proxy, .. } = Harness::new()
        .config("body_limit_bytes = 2000\n[auth]\nclient_keys = [\"sk-allowed\"]\n")
        .start()
        .await;
    let search = json!({"query": "x"});
    let refused = call(
        &proxy,
        "sk-not-allowed",
        Some(ANA),
        "memory_search",
        search.clone(),
    )
    .await;
    assert_eq!(refused.status, 401);
    let unsigned = send(
        "POST",
        &proxy.url("/mcp"),
        &[("content-type", "application/json")],
        "{}",
    )
    .await;
    assert_eq!(unsigned.status, 401);
    let allowed = call(&proxy, "sk-allowed", Some(ANA), "memory_search", search).await;
    result(&allowed);
    let huge = json!({"query": "x".repeat(5000)});
    let too_large = call(&proxy, "sk-allowed", Some(ANA), "memory_search", huge).await;
    assert_eq!(too_large.status, 413);
    // A bad X-Memory-* header is refused as on a chat request.
    let bad = send(
        "POST",
        &proxy.url("/mcp"),
        &[
            ("authorization", "Bearer sk-allowed"),
            ("x-memory-user-id", "a b"),
        ],
        "{}",
    )
    .await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.error_param(), "x-memory-user-id");
    proxy.stop().await;

    let Started { proxy, .. } = Harness::new()
        .config("[mcp]\nenabled = false\n")
        .start()
        .await;
    let off = call(
        &proxy,
        TOKEN,
        Some(ANA),
        "memory_search",
        json!({"query": "x"}),
    )
    .await;
    assert_eq!(off.status, 404);
    proxy.stop().await;
}

#[tokio::test]
async fn a_shared_memory_is_found_by_every_user_of_the_agent_and_changed_only_by_its_own() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let remembered = ana_remembers(
        &proxy,
        json!({"text": "The team deploys on Tuesdays", "type": "procedural", "scope": "agent"}),
    )
    .await;
    assert_eq!(remembered["memory"]["scope"], "agent");
    let id = remembered["memory"]["id"].as_u64().unwrap();
    // Another user of the agent finds it (its owner is the agent), and gets it in the prompt.
    let search = json!({"query": "when does the team deploy"});
    let found = result(&call(&proxy, TOKEN, Some("bob"), "memory_search", search).await);
    assert_eq!(found["memories"][0]["id"], id, "{found}");
    assert_eq!(found["memories"][0]["owner"], "agent");
    say(&proxy, "bob", "ops", "When does the team deploy?").await;
    assert!(memories_in_prompt(&mock).contains("deploys on Tuesdays"));
    // Only the user it was learned from (or an operator) changes it.
    let (code, message, argument) = error(
        &call(
            &proxy,
            TOKEN,
            Some("bob"),
            "memory_forget",
            json!({"id": id}),
        )
        .await,
    );
    assert_eq!((code, argument.as_str()), (-32602, "id"));
    assert!(message.contains("shared"), "{message}");
    let forgotten = call(&proxy, TOKEN, Some(ANA), "memory_forget", json!({"id": id})).await;
    assert_eq!(result(&forgotten)["forgotten"], id);
    proxy.stop().await;
}
