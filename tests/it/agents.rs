//! What the coding agents (Claude Code, the Codex CLI, the Claude Agent SDK) send, without the
//! agents: the shapes of their requests replayed through the real proxy to the strict mock, so a
//! test passes only if the provider would take every forwarded body (the agents themselves run
//! in `tests/e2e/test_agents.py`).
//!
//! - `system`-role messages inside an Anthropic `messages` list are turns kept in place;
//! - the client's `cache_control` markers are never stored or replayed;
//! - a client's own compaction (a rebase) is forwarded as sent, what it dropped is recalled;
//! - a provider's compaction (a `compaction` block or item) starts the window;
//! - side calls stay out of memory;
//! - a tool loop ends with its tool result, and its recall stays the same at every step;
//! - bodies the provider takes are never refused by memproxy.

use serde_json::{Value, json};

use crate::support::mock_upstream::{MockUpstream, Reply};
use crate::support::*;

const ANTHROPIC_KEY: &str = "sk-ant-agents";
const OPENAI_KEY: &str = "sk-agents";
/// The betas Claude Code names when it sends `system`-role messages.
const CLAUDE_CODE_BETAS: &str = "claude-code-20250219,mid-conversation-system-2026-04-07";

async fn messages(
    proxy: &Proxy,
    conversation: &str,
    body: &Value,
    extra: &[(&str, &str)],
) -> Answer {
    let mut headers = vec![
        ("x-api-key", ANTHROPIC_KEY),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", CLAUDE_CODE_BETAS),
        ("content-type", "application/json"),
        ("x-memory-conversation-id", conversation),
    ];
    headers.extend_from_slice(extra);
    send(
        "POST",
        &proxy.url("/v1/messages"),
        &headers,
        body.to_string(),
    )
    .await
}

async fn responses(proxy: &Proxy, conversation: &str, body: &Value) -> Answer {
    let auth = format!("Bearer {OPENAI_KEY}");
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
        ("x-memory-conversation-id", conversation),
    ];
    send(
        "POST",
        &proxy.url("/v1/responses"),
        &headers,
        body.to_string(),
    )
    .await
}

fn ok(answer: &Answer) {
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
}

/// The last forwarded body of `path`.
fn last_forwarded(mock: &MockUpstream, path: &str) -> Value {
    mock.recorded()
        .into_iter()
        .rev()
        .find(|r| r.path == path)
        .expect("a forwarded request")
        .json()
}

/// How many blocks of a forwarded Anthropic body carry `cache_control`.
fn breakpoints(body: &Value) -> usize {
    fn count(value: &Value) -> usize {
        match value {
            Value::Object(map) => {
                usize::from(map.contains_key("cache_control"))
                    + map.values().map(count).sum::<usize>()
            }
            Value::Array(list) => list.iter().map(count).sum(),
            _ => 0,
        }
    }
    count(&body["system"]) + count(&body["messages"])
}

/// The stored texts of a conversation, `role:text` each.
fn stored_texts(proxy: &Proxy, token: &str, conversation: &str) -> Vec<String> {
    summarize(&proxy.stored(Some(token), conversation))
}

fn text_block(text: &str) -> Value {
    json!({"type": "text", "text": text})
}

/// The answer's content blocks, as a client re-sends them.
fn answer_content(answer: &Answer) -> Value {
    answer.json()["content"].clone()
}

#[tokio::test]
async fn system_messages_stay_in_place_and_cache_markers_are_never_replayed() {
    let Started { mock, proxy, .. } = Harness::new()
        .anthropic_to_the_mock()
        .config("[memory]\nrecent_n = 40\n")
        .start()
        .await;

    // Claude Code: its system prompt marked, a system reminder after the first user message,
    // and its breakpoint moved to the newest user message on every request.
    let system = json!([{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]);
    let reminder = json!({"role": "system", "content": "<system-reminder>today is Wednesday</system-reminder>"});
    let mut history: Vec<Value> = Vec::new();
    for i in 0..6 {
        let question = format!("question {i}: what does file_{i}.rs do?");
        let mut sent = history.clone();
        sent.push(json!({"role": "user", "content": [{"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}]}));
        if i == 0 {
            sent.push(reminder.clone());
        }
        let body = json!({"model": "claude-opus-5-5", "max_tokens": 64, "system": system, "messages": sent});
        let answer = messages(&proxy, "cc", &body, &[]).await;
        ok(&answer);
        assert_eq!(answer.header("x-memory-status"), "stored");
        let forwarded = last_forwarded(&mock, "/v1/messages");
        let marks = breakpoints(&forwarded);
        assert!(marks <= 4, "request {i} forwarded {marks} breakpoints");
        // The client's history re-sent: its own markers gone from the earlier turns.
        history = sent;
        if let Some(last) = history.iter_mut().rev().find(|m| m["role"] == "user")
            && let Some(block) = last["content"].get_mut(0)
        {
            block.as_object_mut().unwrap().remove("cache_control");
        }
        history.push(json!({"role": "assistant", "content": answer_content(&answer)}));
    }

    // The reminder is a turn of its own, in place: after the first question, stored once.
    let forwarded = last_forwarded(&mock, "/v1/messages");
    let list = forwarded["messages"].as_array().unwrap();
    assert_eq!(list[1]["role"], "system", "{list:?}");
    assert!(list[1].to_string().contains("today is Wednesday"));
    let stored = stored_texts(&proxy, ANTHROPIC_KEY, "cc");
    assert_eq!(
        stored.len(),
        13,
        "6 questions, the reminder and 6 answers: {stored:?}"
    );
    assert_eq!(
        stored
            .iter()
            .filter(|s| s.contains("today is Wednesday"))
            .count(),
        1,
        "{stored:?}"
    );
    // No marker is stored.
    for message in proxy.stored(Some(ANTHROPIC_KEY), "cc") {
        assert!(
            !message.message.get().contains("cache_control"),
            "stored with a marker: {}",
            message.message.get()
        );
    }
}

#[tokio::test]
async fn a_clients_own_compaction_is_forwarded_as_sent_and_what_it_dropped_is_recalled() {
    let settings = "[memory]\nrecent_n = 4\nrelevance_enabled = true\nrelevance_top_k = 3\n";
    let Started { mock, proxy, .. } = Harness::new()
        .anthropic_to_the_mock()
        .config(settings)
        .start()
        .await;

    let mut history: Vec<Value> = Vec::new();
    for text in [
        "note this: the vault code is 7291",
        "refactor the parser module",
        "now add tests for the lexer",
    ] {
        history.push(json!({"role": "user", "content": text}));
        let answer = messages(
            &proxy,
            "compact",
            &json!({"model": "claude-opus-5-5", "max_tokens": 64, "messages": history}),
            &[],
        )
        .await;
        ok(&answer);
        history.push(json!({"role": "assistant", "content": answer_content(&answer)}));
    }
    assert_eq!(stored_texts(&proxy, ANTHROPIC_KEY, "compact").len(), 6);

    // The client compacts (as Claude Code does): its history is now its own summary, a system
    // message, the last answer kept verbatim and the new question.
    let summary = "This session is being continued from a previous conversation. Summary: the parser was refactored and lexer tests were added.";
    let question = "what was the vault code?";
    let kept = history.last().unwrap().clone();
    let compacted_history = vec![
        json!({"role": "user", "content": summary}),
        json!({"role": "system", "content": "Today's date is 2026-11-25."}),
        kept,
        json!({"role": "user", "content": [text_block(question)]}),
    ];
    let compacted =
        json!({"model": "claude-opus-5-5", "max_tokens": 64, "messages": compacted_history});
    let answer = messages(&proxy, "compact", &compacted, &[]).await;
    ok(&answer);
    assert_eq!(answer.header("x-memory-status"), "stored");
    let forwarded = last_forwarded(&mock, "/v1/messages");
    let list = forwarded["messages"].as_array().unwrap();
    assert_eq!(
        list.len(),
        4,
        "the client's compacted history as sent: {list:?}"
    );
    // memproxy may mark a block of its own (within four): compared without markers.
    let unmarked = |list: &[Value]| -> Vec<Value> {
        list.iter()
            .map(|m| {
                let mut m = m.clone();
                if let Some(blocks) = m["content"].as_array_mut() {
                    for block in blocks {
                        block.as_object_mut().unwrap().remove("cache_control");
                    }
                }
                m
            })
            .collect()
    };
    assert_eq!(
        unmarked(&list[..3]),
        unmarked(&compacted_history[..3]),
        "{list:?}"
    );
    let newest = list[3].to_string();
    assert!(newest.contains(question), "{newest}");
    assert!(
        newest.contains("7291"),
        "the dropped fact is recalled: {newest}"
    );

    // The next request continues the compacted history: nothing is stored twice.
    let mut next = compacted_history.clone();
    next.push(json!({"role": "assistant", "content": answer_content(&answer)}));
    next.push(json!({"role": "user", "content": "thanks, and the lexer?"}));
    let next = json!({"model": "claude-opus-5-5", "max_tokens": 64, "messages": next});
    ok(&messages(&proxy, "compact", &next, &[]).await);
    let stored = stored_texts(&proxy, ANTHROPIC_KEY, "compact");
    let mut seen = std::collections::HashSet::new();
    for text in &stored {
        assert!(
            seen.insert(text.clone()),
            "stored twice: {text}\n{stored:?}"
        );
    }
    // The 6 before, the summary, the system message, the question, its answer, the next
    // question and its answer.
    assert_eq!(stored.len(), 12, "{stored:?}");
}

#[tokio::test]
async fn a_providers_compaction_starts_the_window_and_what_came_before_is_recalled() {
    // A window wide enough to hold the whole conversation: only the compaction moves it.
    let settings = "[memory]\nrecent_n = 40\nrelevance_enabled = true\nrelevance_top_k = 3\n";
    let Started { mock, proxy, .. } = Harness::new()
        .anthropic_to_the_mock()
        .config(settings)
        .start()
        .await;
    let compaction = "Summary: the user works on a Rust parser.";

    // Anthropic server-side compaction: the third answer opens with a compaction block.
    let mut history: Vec<Value> = Vec::new();
    let context_management = json!({"edits": [{"type": "compact_20260112"}]});
    for (i, text) in [
        "note this: the vault code is 7291",
        "refactor the parser module",
        "now add tests for the lexer",
        "which vault code did I note?",
    ]
    .into_iter()
    .enumerate()
    {
        if i == 2 {
            mock.push(Reply::Compaction(compaction.into(), Box::new(Reply::Auto)));
        }
        history.push(json!({"role": "user", "content": text}));
        let body = json!({"model": "claude-opus-5-5", "max_tokens": 64, "context_management": context_management, "messages": history});
        let answer = messages(&proxy, "server", &body, &[]).await;
        ok(&answer);
        history.push(json!({"role": "assistant", "content": answer_content(&answer)}));
    }
    let forwarded = last_forwarded(&mock, "/v1/messages");
    assert_eq!(forwarded["context_management"], context_management);
    let list = forwarded["messages"].as_array().unwrap();
    let texts: Vec<String> = list.iter().map(|m| m.to_string()).collect();
    let at = texts
        .iter()
        .position(|t| t.contains("\"compaction\""))
        .expect("the compaction block is forwarded");
    assert!(
        texts[..at].iter().all(|t| !t.contains("refactor")),
        "nothing before the compaction but an opening turn: {texts:?}"
    );
    assert!(
        texts.last().unwrap().contains("7291"),
        "what came before the compaction is recalled into the newest turn: {texts:?}"
    );
    assert_eq!(stored_texts(&proxy, ANTHROPIC_KEY, "server").len(), 8);

    // The Responses API: a compaction item in the output.
    let mut input: Vec<Value> = Vec::new();
    for (i, text) in [
        "note this: the locker number is 4417",
        "refactor the parser module",
        "now add tests for the lexer",
        "which locker number did I note?",
    ]
    .into_iter()
    .enumerate()
    {
        if i == 2 {
            mock.push(Reply::Compaction(compaction.into(), Box::new(Reply::Auto)));
        }
        input.push(json!({"role": "user", "content": text}));
        let answer = responses(
            &proxy,
            "server-r",
            &json!({"model": "gpt-5", "context_management": [{"type": "compaction", "compact_threshold": 1000}], "input": input}),
        )
        .await;
        ok(&answer);
        input.extend(answer.json()["output"].as_array().unwrap().iter().cloned());
    }
    let forwarded = last_forwarded(&mock, "/v1/responses");
    let items = forwarded["input"].as_array().unwrap();
    let texts: Vec<String> = items.iter().map(|m| m.to_string()).collect();
    assert_eq!(items[0]["type"], "compaction", "{texts:?}");
    assert!(
        texts.iter().any(|t| t.contains("4417")),
        "what came before the compaction is recalled: {texts:?}"
    );
    assert_eq!(stored_texts(&proxy, OPENAI_KEY, "server-r").len(), 8);
}

#[tokio::test]
async fn side_calls_stay_out_of_memory_unless_the_agent_keeps_them() {
    let Started { mock, proxy, .. } = Harness::new().anthropic_to_the_mock().start().await;

    ok(&messages(
        &proxy,
        "side",
        &json!({"model": "claude-opus-5-5", "max_tokens": 64, "tools": [{"name": "Bash", "input_schema": {"type": "object"}}], "messages": [{"role": "user", "content": "list the files"}]}),
        &[],
    )
    .await);
    // A title call (an empty tool list) and a classification (a JSON-schema answer, no tools)
    // under the same conversation.
    let title = json!({"model": "claude-haiku-4-5", "max_tokens": 32, "tools": [], "system": "Write a 3-word title.", "messages": [{"role": "user", "content": "Title this conversation: list the files"}]});
    let answer = messages(&proxy, "side", &title, &[]).await;
    ok(&answer);
    assert_eq!(answer.header("x-memory-status"), "off");
    assert_eq!(answer.header("x-memory-reason"), "side-call-no-tools");
    let classify = json!({"model": "claude-haiku-4-5", "max_tokens": 32, "output_format": {"type": "json_schema", "schema": {"type": "object"}}, "messages": [{"role": "user", "content": "is this a question?"}]});
    let answer = messages(&proxy, "side", &classify, &[]).await;
    ok(&answer);
    assert_eq!(
        answer.header("x-memory-reason"),
        "side-call-structured-output"
    );
    // Forwarded as sent: nothing of memory's in it.
    let forwarded = last_forwarded(&mock, "/v1/messages");
    assert_eq!(forwarded["messages"], classify["messages"]);
    assert_eq!(stored_texts(&proxy, ANTHROPIC_KEY, "side").len(), 2);

    // Codex's compaction call (a compaction_trigger item) is one too.
    let trigger = json!({"model": "gpt-5", "input": [{"role": "user", "content": "hi"}, {"type": "compaction_trigger"}]});
    let answer = responses(&proxy, "side-r", &trigger).await;
    ok(&answer);
    assert_eq!(answer.header("x-memory-reason"), "side-call-compaction");

    let metrics = send("GET", &proxy.url("/metrics"), &[], "").await;
    let text = String::from_utf8(metrics.body.to_vec()).unwrap();
    for reason in [
        "side-call-no-tools",
        "side-call-structured-output",
        "side-call-compaction",
    ] {
        let line = format!("memproxy_memory_off_total{{reason=\"{reason}\"}} 1");
        assert!(text.contains(&line), "{line} in\n{text}");
    }

    // An agent that keeps them: the title call is a turn.
    let answer = messages(
        &proxy,
        "side",
        &title,
        &[("x-memory-store-side-calls", "true")],
    )
    .await;
    ok(&answer);
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(stored_texts(&proxy, ANTHROPIC_KEY, "side").len(), 4);
}

#[tokio::test]
async fn a_tool_loop_ends_with_its_result_and_its_recall_stays_the_same() {
    let settings =
        "[memory]\nrecent_n = 2\nwindow_step = 0\nrelevance_enabled = true\nrelevance_top_k = 2\n";
    let Started { mock, proxy, .. } = Harness::new()
        .anthropic_to_the_mock()
        .config(settings)
        .start()
        .await;
    let tools = json!([{"name": "Read", "input_schema": {"type": "object"}}]);

    let mut history: Vec<Value> = Vec::new();
    for text in [
        "remember: the deploy host is kestrel.internal",
        "what is a trait object?",
        "and a generic?",
    ] {
        history.push(json!({"role": "user", "content": text}));
        let answer = messages(&proxy, "loop", &json!({"model": "claude-opus-5-5", "max_tokens": 64, "tools": tools, "messages": history}), &[]).await;
        ok(&answer);
        history.push(json!({"role": "assistant", "content": answer_content(&answer)}));
    }
    // The loop: a question, then five tool steps, each answered with a tool call.
    history.push(
        json!({"role": "user", "content": "read the config files and check the deploy host"}),
    );
    let mut recalled_parts: Vec<String> = Vec::new();
    for step in 0..6 {
        if step < 5 {
            mock.push(Reply::ToolCalls(vec![(
                format!("toolu_{step}"),
                "Read".into(),
                format!("{{\"path\":\"config_{step}.toml\"}}"),
            )]));
        }
        let answer = messages(&proxy, "loop", &json!({"model": "claude-opus-5-5", "max_tokens": 64, "tools": tools, "messages": history}), &[]).await;
        ok(&answer);
        eprintln!(
            "step {step}: retrieved {}",
            answer.header("x-memory-retrieved-turns")
        );
        let forwarded = last_forwarded(&mock, "/v1/messages");
        let list = forwarded["messages"].as_array().unwrap();
        let last = list.last().unwrap();
        if step > 0 {
            let blocks = last["content"].as_array().unwrap();
            assert_eq!(
                blocks.last().unwrap()["type"],
                "tool_result",
                "step {step}: the newest input is the tool result: {last}"
            );
        }
        // The recalled turns: the same text at every step, about the loop's question.
        let recalled = list
            .iter()
            .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
            .filter_map(|b| b["text"].as_str().map(str::to_string))
            .find(|t| t.contains("[earlier turn"))
            .unwrap_or_default();
        assert!(recalled.contains("kestrel"), "step {step}: {list:?}");
        recalled_parts.push(recalled);
        history.push(json!({"role": "assistant", "content": answer_content(&answer)}));
        if step < 5 {
            history.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("toolu_{step}"), "content": format!("host = \"kestrel.internal\" # file {step}")}]}));
        }
    }
    assert!(
        recalled_parts.windows(2).all(|w| w[0] == w[1]),
        "recall changed during the loop: {recalled_parts:?}"
    );
}

#[tokio::test]
async fn the_ledger_counts_the_clients_instructions_on_both_sides() {
    let Started { proxy, .. } = Harness::new()
        .anthropic_to_the_mock()
        .config("[memory]\nrecent_n = 2\nwindow_step = 0\n")
        .start()
        .await;
    // Codex: long developer instructions in the input, the whole history re-sent.
    let instructions = "You are Codex, a coding agent. ".repeat(200);
    let mut input: Vec<Value> = vec![json!({"role": "developer", "content": instructions})];
    let mut last = None;
    for i in 0..8 {
        input.push(json!({"role": "user", "content": format!("step {i}: change module {i}")}));
        let answer = responses(&proxy, "ledger", &json!({"model": "gpt-5", "input": input})).await;
        ok(&answer);
        input.extend(answer.json()["output"].as_array().unwrap().iter().cloned());
        last = Some(answer);
    }
    let answer = last.unwrap();
    let history: u64 = answer.header("x-memory-history-tokens").parse().unwrap();
    let prompt: u64 = answer.header("x-memory-prompt-tokens").parse().unwrap();
    assert!(history > prompt, "history {history} <= prompt {prompt}");
    assert!(
        prompt > 1000,
        "the instructions are counted in the prompt: {prompt}"
    );
}

#[tokio::test]
async fn bodies_the_provider_takes_are_never_refused() {
    let Started { mock, proxy, .. } = Harness::new().anthropic_to_the_mock().start().await;

    // Anthropic: block types memproxy does not read, beta fields, a system message with empty
    // content, context editing.
    let anthropic = [
        json!({"model": "c", "max_tokens": 8, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}, "messages": [{"role": "user", "content": "hi"}]}),
        json!({"model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t", "content": [{"type": "text", "text": "x"}]}, {"type": "text", "text": "what does it say?"}]}]}),
        json!({"model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}}, {"type": "text", "text": "summarize"}]}]}),
        json!({"model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": ""}, {"role": "user", "content": "go on"}]}),
        json!({"model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}}, {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}, {"type": "text", "text": "found nothing"}]}, {"role": "user", "content": "ok"}]}),
    ];
    for (i, body) in anthropic.iter().enumerate() {
        let answer = messages(&proxy, &format!("taken-a{i}"), body, &[]).await;
        assert_eq!(
            answer.status,
            200,
            "anthropic body {i}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(
            answer.header("x-memory-status"),
            "stored",
            "anthropic body {i}"
        );
    }
    // Responses: item types memproxy does not read, kept raw at their place.
    let items = [
        json!({"model": "gpt-5", "input": [{"role": "user", "content": "run it"}, {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"}, {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"}, {"role": "user", "content": "and now?"}]}),
        json!({"model": "gpt-5", "input": [{"role": "user", "content": "q"}, {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "q"}}, {"role": "user", "content": "ok"}]}),
        json!({"model": "gpt-5", "input": [{"type": "compaction", "id": "cmp_1", "encrypted_content": "opaque"}, {"role": "user", "content": "continue"}]}),
    ];
    for (i, body) in items.iter().enumerate() {
        let answer = responses(&proxy, &format!("taken-r{i}"), body).await;
        assert_eq!(
            answer.status,
            200,
            "responses body {i}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(
            answer.header("x-memory-status"),
            "stored",
            "responses body {i}"
        );
        let forwarded = last_forwarded(&mock, "/v1/responses");
        let sent = body["input"].as_array().unwrap();
        assert_eq!(
            &forwarded["input"].as_array().unwrap()[..sent.len()],
            sent.as_slice(),
            "responses body {i}: kept raw in place"
        );
    }
    // `/v1/responses/compact` goes through as sent.
    let auth = format!("Bearer {OPENAI_KEY}");
    let compact = send(
        "POST",
        &proxy.url("/v1/responses/compact"),
        &[
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
            ("x-memory-conversation-id", "taken-c"),
        ],
        json!({"model": "gpt-5", "input": [{"role": "user", "content": "hi"}]}).to_string(),
    )
    .await;
    ok(&compact);
    assert_eq!(
        mock.recorded().last().unwrap().path,
        "/v1/responses/compact"
    );
    assert!(proxy.stored(Some(OPENAI_KEY), "taken-c").is_empty());
}
