//! A cache-stable prompt through the real proxy and the mock upstream: consecutive forwarded
//! prompts of a conversation extend each other byte for byte (but for the recalled turns and
//! the new message at the end) until the window's anchor jumps, which it does when the window
//! passes `recent_n + window_step`; `prompt_cache_key` is set when the client set none and left
//! alone when it did; the Anthropic writer keeps recalled turns out of the cached prefix and
//! marks it with breakpoints; the new settings are checked like the others.

use memproxy::message::RECALL_MARKER;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::support::mock_upstream::{MockUpstream, Reply};
use crate::support::*;

/// The byte offset in `body` where each of its `messages` starts.
fn message_offsets(body: &str) -> Vec<usize> {
    #[derive(Deserialize)]
    struct Body<'a> {
        #[serde(borrow)]
        messages: Vec<&'a RawValue>,
    }
    let parsed: Body = serde_json::from_str(body).unwrap();
    parsed
        .messages
        .iter()
        .map(|m| m.get().as_ptr() as usize - body.as_ptr() as usize)
        .collect()
}

fn is_recalled(message: &Value) -> bool {
    message["role"] == "system"
        && message["content"]
            .as_str()
            .is_some_and(|c| c.starts_with(RECALL_MARKER))
}

/// The `n`th user message of the replayed conversation: every one shares words with the
/// others, so recall finds older ones.
fn question(n: usize) -> String {
    let topics = ["garden", "invoice", "holiday", "guitar"];
    format!(
        "Note {n}: the {} plan for week {n}, and what about the {} again?",
        topics[n % 4],
        topics[(n + 1) % 4]
    )
}

/// The bodies the mock received for chat completions, as text.
fn chat_bodies(mock: &MockUpstream) -> Vec<String> {
    mock.chat_requests()
        .iter()
        .map(|r| String::from_utf8(r.body.to_vec()).unwrap())
        .collect()
}

#[tokio::test]
async fn prompts_extend_each_other_until_the_anchor_jumps() {
    let settings = "[memory]\nrecent_n = 4\nwindow_step = 6\ncompression_enabled = false\nrelevance_top_k = 2\n";
    let Started { mock, proxy, .. } = Harness::new().config(settings).start().await;
    let turns = 16;
    for n in 1..=turns {
        let answer = chat(&proxy, "cached", &body(&[user(&question(n))]), &[]).await;
        assert_eq!(
            answer.status,
            200,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    let bodies = chat_bodies(&mock);
    assert_eq!(bodies.len(), turns);

    // The window: every stored message until it would pass recent_n + window_step = 10, then
    // the anchor jumps to turn 7 (6 left), grows to 10, jumps to turn 13, …
    let windows: Vec<usize> = bodies
        .iter()
        .map(|b| {
            let value: Value = serde_json::from_str(b).unwrap();
            let messages = value["messages"].as_array().unwrap().clone();
            messages.iter().filter(|m| m["role"] != "system").count() - 1
        })
        .collect();
    assert_eq!(
        windows,
        [0, 2, 4, 6, 8, 10, 6, 8, 10, 6, 8, 10, 6, 8, 10, 6]
    );
    let jumps: Vec<usize> = (1..turns)
        .filter(|&i| windows[i] < windows[i - 1])
        .map(|i| i + 1)
        .collect();
    assert_eq!(jumps, [7, 10, 13, 16]);

    let mut recalled_seen = 0;
    for i in 1..turns {
        let (previous, next) = (&bodies[i - 1], &bodies[i]);
        let value: Value = serde_json::from_str(previous).unwrap();
        let messages = value["messages"].as_array().unwrap();
        // What the next prompt repeats: everything before the recalled turns and the new
        // message.
        let stable = messages
            .iter()
            .position(is_recalled)
            .unwrap_or(messages.len() - 1);
        if stable < messages.len() - 1 {
            recalled_seen += 1;
            // The recalled turns sit right after the window, before the new message.
            assert_eq!(stable, windows[i - 1], "turn {i}");
        }
        let cut = message_offsets(previous)[stable];
        let extends = next.starts_with(&previous[..cut]);
        let jumped = jumps.contains(&(i + 1));
        assert_eq!(
            extends,
            !jumped,
            "turn {} {} turn {i}'s prompt",
            i + 1,
            if jumped { "repeats" } else { "does not extend" }
        );
        if !jumped {
            // And it goes on with the previous new message and its reply, stored.
            let next_value: Value = serde_json::from_str(next).unwrap();
            let next_messages = next_value["messages"].as_array().unwrap();
            assert_eq!(next_messages[stable]["content"], question(i).as_str());
        }
    }
    assert!(recalled_seen >= 5, "recall took part: {recalled_seen}");
    proxy.stop().await;
}

#[tokio::test]
async fn a_window_step_of_zero_slides_as_before() {
    let Started { mock, proxy, .. } = Harness::new()
        .config("[memory]\nrecent_n = 4\n")
        .start()
        .await;
    let slide = [("x-memory-window-step", "0")];
    for n in 1..=6 {
        chat(&proxy, "slides", &body(&[user(&question(n))]), &slide).await;
    }
    let windows: Vec<usize> = mock
        .chat_requests()
        .iter()
        .map(|r| {
            let value = r.json();
            value["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["role"] != "system")
                .count()
                - 1
        })
        .collect();
    assert_eq!(windows, [0, 2, 4, 4, 4, 4]);
    proxy.stop().await;
}

#[tokio::test]
async fn the_prompt_cache_key_is_set_when_absent_and_left_alone_otherwise() {
    let Started { mock, proxy, .. } = Harness::new()
        .config("[agents.quiet]\nprompt_cache_key = false\n")
        .start()
        .await;
    let expected = key(Some(TOKEN), "keyed").prompt_cache_key();
    assert!(!expected.contains("keyed") && !expected.contains(TOKEN));

    let last = |mock: &MockUpstream| mock.chat_requests().last().unwrap().json();
    chat(&proxy, "keyed", &body(&[user("one")]), &[]).await;
    assert_eq!(last(&mock)["prompt_cache_key"], expected.as_str());
    chat(&proxy, "keyed", &body(&[user("two")]), &[]).await;
    assert_eq!(last(&mock)["prompt_cache_key"], expected.as_str());
    // Another conversation, another key.
    chat(&proxy, "other", &body(&[user("one")]), &[]).await;
    let other = last(&mock)["prompt_cache_key"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(other, expected);

    // The client's own key (or its explicit null) is forwarded as it is, once.
    for own in [json!("client-key"), Value::Null] {
        let mut request = body(&[user("three")]);
        request["prompt_cache_key"] = own.clone();
        chat(&proxy, "keyed", &request, &[]).await;
        assert_eq!(last(&mock)["prompt_cache_key"], own);
        let raw = mock.chat_requests().last().unwrap().body.clone();
        assert_eq!(
            String::from_utf8_lossy(&raw)
                .matches("prompt_cache_key")
                .count(),
            1
        );
    }

    // Off by header, and by an agent's profile.
    chat(
        &proxy,
        "keyed",
        &body(&[user("four")]),
        &[("x-memory-prompt-cache-key", "off")],
    )
    .await;
    assert!(last(&mock).get("prompt_cache_key").is_none());
    chat(
        &proxy,
        "keyed",
        &body(&[user("five")]),
        &[("x-memory-agent", "quiet")],
    )
    .await;
    assert!(last(&mock).get("prompt_cache_key").is_none());
    chat(
        &proxy,
        "keyed",
        &body(&[user("six")]),
        &[
            ("x-memory-agent", "quiet"),
            ("x-memory-prompt-cache-key", "on"),
        ],
    )
    .await;
    assert!(last(&mock).get("prompt_cache_key").is_some());
    proxy.stop().await;
}

#[tokio::test]
async fn bad_values_are_400s_naming_the_header() {
    let Started { mock, proxy, .. } = Harness::new().start().await;
    for (header, value) in [
        ("x-memory-window-step", "-1"),
        ("x-memory-window-step", "10001"),
        ("x-memory-window-step", "none"),
        ("x-memory-prompt-cache-key", "maybe"),
        ("x-memory-cache-breakpoints", "2"),
        ("x-memory-relevance-max-tokens", "-5"),
        ("x-memory-relevance-max-tokens", "lots"),
    ] {
        let answer = chat(&proxy, "bad", &body(&[user("hi")]), &[(header, value)]).await;
        assert_eq!(answer.status, 400, "{header}: {value}");
        assert_eq!(answer.error_param(), header);
        let message = answer.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(message.contains(header), "{message}");
    }
    assert!(mock.chat_requests().is_empty());
    for (header, value) in [
        ("x-memory-window-step", "auto"),
        ("x-memory-window-step", "0"),
        ("x-memory-prompt-cache-key", "ON"),
        ("x-memory-cache-breakpoints", "false"),
        ("x-memory-relevance-max-tokens", "auto"),
        ("x-memory-relevance-max-tokens", "0"),
    ] {
        let answer = chat(&proxy, "good", &body(&[user("hi")]), &[(header, value)]).await;
        assert_eq!(answer.status, 200, "{header}: {value}");
    }
    proxy.stop().await;

    // The config file: every bad value reported, by section.
    let text = format!(
        "[upstream]\nbase_url = \"{}\"\n[memory]\nwindow_step = -2\nprompt_cache_key = \"yes\"\n[agents.a]\nwindow_step = \"sometimes\"\ncache_breakpoints = 1\n",
        mock.base_url()
    );
    let err = memproxy::config::from_toml(&text, &|_| None).unwrap_err();
    let all = err.to_string();
    for expected in [
        "memory.window_step",
        "memory.prompt_cache_key",
        "agents.a.window_step",
        "agents.a.cache_breakpoints",
    ] {
        assert!(all.contains(expected), "{expected}: {all}");
    }
    let text = format!(
        "[upstream]\nbase_url = \"{}\"\n[memory]\nwindow_step = 0\n[agents.a]\nwindow_step = \"auto\"\nprompt_cache_key = false\n",
        mock.base_url()
    );
    let config = memproxy::config::from_toml(&text, &|_| None).unwrap();
    assert_eq!(config.profile("default").window_step, Some(0));
    assert_eq!(config.profile("a").window_step, None);
    assert!(!config.profile("a").prompt_cache_key);
}

/// Posts an Anthropic Messages request for `conversation`.
async fn messages(proxy: &Proxy, conversation: &str, body: &Value) -> Answer {
    let headers = [
        ("x-api-key", "sk-ant-test"),
        ("anthropic-version", "2023-06-01"),
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

/// `value` without its `cache_control` markers (they move; the provider's cache ignores them).
fn unmarked(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| *k != "cache_control")
                .map(|(k, v)| (k.clone(), unmarked(v)))
                .collect(),
        ),
        Value::Array(list) => Value::Array(list.iter().map(unmarked).collect()),
        other => other.clone(),
    }
}

#[tokio::test]
async fn anthropic_prompts_keep_recalled_turns_out_of_the_cached_prefix() {
    let claude = MockUpstream::start().await.unwrap();
    let settings = "[memory]\nrecent_n = 2\nwindow_step = 4\ncompression_enabled = false\nrelevance_top_k = 2\n";
    let Started { proxy, .. } = Harness::new()
        .anthropic_to(&claude)
        .config(settings)
        .start()
        .await;
    let turns = 9;
    for n in 1..=turns {
        let request = json!({
            "model": "claude-sonnet",
            "max_tokens": 100,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": question(n)}],
        });
        let answer = messages(&proxy, "claude", &request).await;
        assert_eq!(
            answer.status,
            200,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    let bodies: Vec<Value> = claude
        .anthropic_requests()
        .iter()
        .map(|r| r.json())
        .collect();
    assert_eq!(bodies.len(), turns);
    let mut recalled_seen = 0;
    let mut extended = 0;
    for (i, body) in bodies.iter().enumerate() {
        assert!(body.get("prompt_cache_key").is_none());
        // The client's system stays first and whole: no memproxy block (no summary here).
        assert_eq!(
            body["system"],
            json!([{"type": "text", "text": "Be brief."}])
        );
        let list = body["messages"].as_array().unwrap();
        let roles: Vec<&str> = list.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert!(roles.iter().step_by(2).all(|r| *r == "user"), "{roles:?}");
        assert!(
            roles.iter().skip(1).step_by(2).all(|r| *r == "assistant"),
            "{roles:?}"
        );
        let newest = list.last().unwrap();
        let blocks = newest["content"].as_array().cloned().unwrap_or_default();
        if blocks.len() == 2 {
            recalled_seen += 1;
            assert!(
                blocks[0]["text"]
                    .as_str()
                    .unwrap()
                    .starts_with(RECALL_MARKER)
            );
            assert_eq!(blocks[1]["text"], question(i + 1).as_str());
        }
        // One breakpoint, on the end of the window (the turn before the newest).
        let marks = body.to_string().matches("\"cache_control\"").count();
        if list.len() > 1 {
            assert_eq!(marks, 1, "turn {}", i + 1);
            let before = &list[list.len() - 2]["content"];
            let last_block = before.as_array().unwrap().last().unwrap();
            assert_eq!(last_block["cache_control"], json!({"type": "ephemeral"}));
        } else {
            assert_eq!(marks, 0);
        }
        // Everything before the newest turn is where the next prompt starts, until a jump.
        if let Some(next) = bodies.get(i + 1) {
            let next_list = next["messages"].as_array().unwrap();
            let stable = &list[..list.len() - 1];
            if next_list.len() > stable.len()
                && unmarked(&Value::Array(next_list[..stable.len()].to_vec()))
                    == unmarked(&Value::Array(stable.to_vec()))
            {
                extended += 1;
            }
        }
    }
    // recent_n 2 + step 4: windows 0, 2, 4, 6, then a jump to 4 at turn 5 (stored 8 > 6),
    // 6, jump at 7, 6, jump at 9: 5 of the 8 steps extend.
    assert_eq!(extended, 5);
    assert!(recalled_seen >= 3, "{recalled_seen}");

    // Breakpoints off: none added.
    let request = json!({
        "model": "claude-sonnet",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "no marks"}],
    });
    let headers = [
        ("x-api-key", "sk-ant-test"),
        ("anthropic-version", "2023-06-01"),
        ("content-type", "application/json"),
        ("x-memory-conversation-id", "claude"),
        ("x-memory-cache-breakpoints", "false"),
    ];
    let answer = send(
        "POST",
        &proxy.url("/v1/messages"),
        &headers,
        request.to_string(),
    )
    .await;
    assert_eq!(answer.status, 200);
    let last = claude.anthropic_requests().last().unwrap().json();
    assert!(!last.to_string().contains("cache_control"));
    proxy.stop().await;
}

/// The number of stored messages forwarded as the window (non-system messages but the new one).
fn window_len(messages: &[Value]) -> usize {
    messages.iter().filter(|m| m["role"] != "system").count() - 1
}

/// The summary message of a forwarded prompt, if any.
fn summary_text(messages: &[Value]) -> Option<String> {
    messages
        .iter()
        .filter_map(|m| m["content"].as_str())
        .find(|c| c.starts_with(memproxy::message::SUMMARY_MARKER))
        .map(str::to_string)
}

/// `words` words of filler, numbered so no two replies are alike.
fn filler_words(seed: usize, words: usize) -> String {
    let pool = [
        "weather", "traffic", "lunch", "meeting", "printer", "parking", "coffee",
    ];
    (0..words)
        .map(|i| pool[(seed * 7 + i) % pool.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn a_new_model_summary_waits_for_the_anchor_jump() {
    let settings = "[memory]\nrecent_n = 4\nwindow_step = 6\nrelevance_enabled = false\n\
                    compression_threshold_tokens = 120\ncompression_interval = \"PT0S\"\n";
    let Started { mock, proxy, .. } = Harness::new().config(settings).start().await;
    let conversation = key(Some(TOKEN), "waits");
    let summarizer = &proxy.state.memory().unwrap().summarizer;
    let mut windows = Vec::new();
    let mut summaries = Vec::new();
    for n in 1..=40 {
        let text = format!("Note {n}: {}", filler_words(n, 12));
        let answer = chat(&proxy, "waits", &body(&[user(&text)]), &[]).await;
        assert_eq!(answer.status, 200);
        let forwarded = mock.last_messages();
        windows.push(window_len(&forwarded));
        summaries.push(summary_text(&forwarded));
        // Every summary lands before the next turn, so when it is used is the proxy's choice.
        let started = std::time::Instant::now();
        while summarizer.in_flight(&conversation) {
            assert!(started.elapsed() < std::time::Duration::from_secs(10));
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
    assert!(mock.summary_requests().len() >= 4, "summaries were made");
    let mut waited = 0;
    let mut model_changes = 0;
    for i in 1..summaries.len() {
        let jumped = windows[i] < windows[i - 1];
        let from_model = summaries[i - 1]
            .as_ref()
            .is_some_and(|s| !s.contains("heuristic"));
        if summaries[i] != summaries[i - 1] && from_model {
            model_changes += 1;
            assert!(
                jumped,
                "turn {}: a model summary replaced another between jumps ({windows:?})",
                i + 1
            );
        }
        // A summary made on a turn between jumps is not in the next prompt.
        if !jumped && summaries[i] == summaries[i - 1] && from_model {
            waited += 1;
        }
    }
    assert!(model_changes >= 2, "{model_changes} changes: {windows:?}");
    assert!(waited > 0);
    // The newest summary is stored, and reached the prompt at a jump.
    let made = mock.summary_requests().len();
    assert!(made > model_changes, "made {made}, used {model_changes}");
    proxy.stop().await;
}

#[tokio::test]
async fn auto_slides_short_exchanges_and_anchors_long_ones() {
    let Started { mock, proxy, .. } = Harness::new()
        .config("[memory]\ncompression_enabled = false\nrelevance_enabled = false\n")
        .start()
        .await;
    // One-line exchanges: the prompt never reaches the provider's 1,024-token cache minimum,
    // so the window slides, `recent_n` messages long.
    for n in 1..=20 {
        chat(&proxy, "short", &body(&[user(&format!("hi {n}"))]), &[]).await;
    }
    let short: Vec<usize> = mock
        .chat_requests()
        .iter()
        .map(|r| window_len(r.json()["messages"].as_array().unwrap()))
        .collect();
    assert!(short[5..].iter().all(|&w| w == 10), "{short:?}");
    mock.clear();

    // Model-length replies: the window grows between jumps (past 2 × recent_n), and every
    // prompt between two jumps extends the one before it.
    for n in 1..=40 {
        mock.push(Reply::Text(format!("Reply {n}: {}", filler_words(n, 150))));
        chat(
            &proxy,
            "long",
            &body(&[user(&format!("question {n}"))]),
            &[],
        )
        .await;
    }
    let bodies = chat_bodies(&mock);
    let long: Vec<usize> = bodies
        .iter()
        .map(|b| {
            window_len(
                serde_json::from_str::<Value>(b).unwrap()["messages"]
                    .as_array()
                    .unwrap(),
            )
        })
        .collect();
    assert!(long.iter().any(|&w| w > 20), "{long:?}");
    let jumps = (1..long.len()).filter(|&i| long[i] < long[i - 1]).count();
    assert!(jumps >= 1, "{long:?}");
    for i in 1..bodies.len() {
        if long[i] > long[i - 1] {
            let previous = &bodies[i - 1];
            let cut = *message_offsets(previous).last().unwrap();
            assert!(bodies[i].starts_with(&previous[..cut]), "turn {}", i + 1);
        }
    }
    proxy.stop().await;
}

#[tokio::test]
async fn long_recalled_turns_are_cut_to_their_relevant_passage_within_the_budget() {
    let settings = "[memory]\nrecent_n = 2\nwindow_step = 0\ncompression_enabled = false\nrelevance_top_k = 3\nrelevance_max_tokens = 150\n";
    let Started { mock, proxy, .. } = Harness::new().config(settings).start().await;
    let fact = "The spare key for the boathouse is taped under the third step.";
    mock.push(Reply::Text(format!(
        "{}. {fact} {}.",
        filler_words(1, 200),
        filler_words(2, 200)
    )));
    chat(
        &proxy,
        "cut",
        &body(&[user("Tell me about the house.")]),
        &[],
    )
    .await;
    for n in 0..6 {
        chat(
            &proxy,
            "cut",
            &body(&[user(&format!("Unrelated note {n}."))]),
            &[],
        )
        .await;
    }
    let question = user("Where is the spare key for the boathouse?");
    chat(&proxy, "cut", &body(std::slice::from_ref(&question)), &[]).await;
    let forwarded = mock.last_messages();
    let recalled = forwarded
        .iter()
        .find(|m| is_recalled(m))
        .and_then(|m| m["content"].as_str())
        .unwrap()
        .to_string();
    let line = recalled
        .lines()
        .find(|l| l.contains("] assistant: "))
        .unwrap();
    assert!(line.contains(fact), "{line}");
    assert!(
        line.contains("] assistant: … ") && line.ends_with(" …"),
        "{line}"
    );
    let tokens = memproxy::tokens::count_text(None, &recalled);
    assert!(tokens <= 150 + 30, "{tokens} tokens: {recalled}");

    // No limit: the reply comes back whole.
    chat(
        &proxy,
        "cut",
        &body(&[question]),
        &[
            ("x-memory-relevance-max-tokens", "0"),
            ("x-memory-persist", "false"),
        ],
    )
    .await;
    let whole = mock.last_messages();
    let recalled = whole.iter().find(|m| is_recalled(m)).unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(recalled.contains(&filler_words(2, 200)), "{recalled}");
    proxy.stop().await;
}
