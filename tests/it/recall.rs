//! Relevance recall through the real proxy: older turns come back, tagged and in order, in any
//! language, within the token budget, after a restart, and never stored back.

use memproxy::message::check_tool_sequence;
use memproxy::pipeline::budget::TRUNCATION_NOTICE;
use serde_json::{Value, json};

use crate::support::mock_upstream::{MockUpstream, Reply};
use crate::support::*;

const FILLER: [&str; 8] = [
    "Let's plan the garden: tomatoes along the fence",
    "The weather this week looks rainy on Thursday",
    "Remind me to call the plumber about the sink",
    "What is a good recipe for lentil soup",
    "My sister visits in March with her two kids",
    "The car needs new tyres before winter",
    "I started reading a novel about lighthouse keepers",
    "The team meeting moved to Tuesday afternoon",
];

/// A distinct everyday message.
fn filler(i: usize) -> String {
    format!("{} (note {i})", FILLER[i % FILLER.len()])
}

/// The recalled-turns system message of the last forwarded prompt, if any.
fn recalled_message(mock: &MockUpstream) -> Option<String> {
    mock.last_messages()
        .iter()
        .find(|m| {
            m["role"] == "system"
                && m["content"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with("[Earlier in this conversation")
        })
        .map(|m| m["content"].as_str().unwrap().to_string())
}

async fn fill(proxy: &Proxy, conversation: &str, first: &str, exchanges: usize) {
    chat(proxy, conversation, &body(&[user(first)]), &[]).await;
    for i in 0..exchanges {
        chat(proxy, conversation, &body(&[user(&filler(i))]), &[]).await;
    }
}

#[tokio::test]
async fn the_turn_3_fact_comes_back_at_turn_30() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    chat(&proxy, "fact", &body(&[user("Hello there")]), &[]).await;
    chat(
        &proxy,
        "fact",
        &body(&[user(
            "My savings account number is 4471-9920, keep it handy",
        )]),
        &[],
    )
    .await;
    for i in 0..13 {
        chat(&proxy, "fact", &body(&[user(&filler(i))]), &[]).await;
    }
    let request = body(&[
        json!({"role": "system", "content": "You are a bank assistant."}),
        user("Which savings account number did I give you?"),
    ]);
    let answer = chat(&proxy, "fact", &request, &[]).await;
    assert_eq!(answer.header("x-memory-retrieved"), "5");
    let turns: Vec<u64> = answer
        .header("x-memory-retrieved-turns")
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect();
    assert!(turns.contains(&3), "{turns:?}");
    assert!(turns.windows(2).all(|w| w[0] < w[1]));

    let forwarded = mock.last_messages();
    // Client system message · window · recalled turns · new message.
    assert_eq!(
        role_content(&forwarded[0]),
        "system:You are a bank assistant."
    );
    let recalled = forwarded[forwarded.len() - 2]["content"].as_str().unwrap();
    assert!(recalled.starts_with("[Earlier in this conversation"));
    let lines: Vec<&str> = recalled.lines().skip(1).collect();
    assert_eq!(lines.len(), 5);
    assert!(
        lines.iter().any(|l| l.starts_with("[earlier turn #3 at ")
            && l.contains("] user: My savings account number is 4471-9920")),
        "{lines:?}"
    );
    let mut previous = 0;
    for line in &lines {
        let n: u64 = line["[earlier turn #".len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(n > previous, "chronological: {lines:?}");
        previous = n;
        assert!(line.contains("T") && line.contains("Z] "), "{line}");
    }
    // The window: the last 10 stored (exchanges this short stay under the provider's cache
    // minimum, so `window_step = "auto"` slides); turn 3 is older.
    assert_eq!(forwarded.len(), 1 + 10 + 1 + 1);
    // Nothing recalled is also in the window.
    for window_message in &forwarded[1..11] {
        let text = window_message["content"].as_str().unwrap();
        assert!(
            !lines.iter().any(|l| l.ends_with(&format!(": {text}"))),
            "{text} repeated"
        );
    }

    // Relevance off: no recalled message; top-k bounds the count.
    chat(
        &proxy,
        "fact",
        &request,
        &[("x-memory-relevance-enabled", "false")],
    )
    .await;
    assert!(recalled_message(&mock).is_none());
    let answer = chat(
        &proxy,
        "fact",
        &request,
        &[("x-memory-relevance-top-k", "2")],
    )
    .await;
    assert_eq!(answer.header("x-memory-retrieved"), "2");
}

#[tokio::test]
async fn tool_turns_come_back_as_text() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    let mut history = vec![user("Look up the order status for order 88123")];
    mock.push(Reply::ToolCalls(vec![(
        "call_9".into(),
        "order_status".into(),
        r#"{"order":"88123"}"#.into(),
    )]));
    let answer = chat(&proxy, "tools", &body(&history), &[]).await;
    history.push(reply_message(&answer));
    history.push(json!({"role": "tool", "tool_call_id": "call_9", "content": "order 88123 shipped via courier"}));
    let answer = chat(&proxy, "tools", &body(&history), &[]).await;
    history.push(reply_message(&answer));
    for text in FILLER {
        history.push(user(text));
        let answer = chat(&proxy, "tools", &body(&history), &[]).await;
        history.push(reply_message(&answer));
    }
    history.push(user("Was order 88123 shipped by courier?"));
    // The window slides (as it did before `window_step`), so the tool round is outside it: a
    // growing window would still hold all 20 stored messages.
    chat(
        &proxy,
        "tools",
        &body(&history),
        &[("x-memory-window-step", "0")],
    )
    .await;
    let forwarded = mock.last_messages();
    check_tool_sequence(&forwarded).unwrap();
    assert!(
        !forwarded.iter().any(|m| m["role"] == "tool"),
        "no raw tool messages outside the window"
    );
    let recalled = recalled_message(&mock).unwrap();
    assert!(
        recalled.contains(r#"assistant: [called order_status({"order":"88123"})]"#),
        "{recalled}"
    );
    assert!(
        recalled.contains("tool result for call_9: order 88123 shipped via courier"),
        "{recalled}"
    );
}

#[tokio::test]
async fn chinese_and_russian_conversations_find_their_turns() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    let chinese = [
        "我的猫叫小白，它喜欢吃鱼",
        "明天我们去公园散步吧",
        "这个周末天气很好",
        "我在学习弹钢琴",
        "公司下个月要搬家",
        "我妹妹在北京上大学",
        "晚饭吃饺子怎么样",
        "我最近在看一本历史书",
    ];
    for text in chinese {
        chat(&proxy, "zh", &body(&[user(text)]), &[]).await;
    }
    chat(
        &proxy,
        "zh",
        &body(&[user("我的猫叫什么名字？")]),
        &[
            ("x-memory-recent-n", "2"),
            ("x-memory-relevance-top-k", "1"),
        ],
    )
    .await;
    let recalled = recalled_message(&mock).unwrap();
    assert!(recalled.contains("我的猫叫小白"), "{recalled}");

    let russian = [
        "Мой любимый город — Новосибирск, я там вырос",
        "Завтра будет дождь и холодный ветер",
        "Я купил новый велосипед на прошлой неделе",
        "Моя сестра работает врачом в больнице",
        "Нужно починить кран на кухне",
        "Мы планируем отпуск на море в августе",
        "Я читаю книгу о космосе",
        "Встреча перенесена на четверг",
    ];
    for text in russian {
        chat(&proxy, "ru", &body(&[user(text)]), &[]).await;
    }
    // Different word forms: "городе" / "город", "вырос" is not repeated.
    chat(
        &proxy,
        "ru",
        &body(&[user("В каком городе я вырос?")]),
        &[
            ("x-memory-recent-n", "2"),
            ("x-memory-relevance-top-k", "1"),
        ],
    )
    .await;
    let recalled = recalled_message(&mock).unwrap();
    assert!(recalled.contains("Новосибирск"), "{recalled}");
    chat(
        &proxy,
        "ru",
        &body(&[user("Кем работает сестра?")]),
        &[
            ("x-memory-recent-n", "2"),
            ("x-memory-relevance-top-k", "1"),
        ],
    )
    .await;
    assert!(recalled_message(&mock).unwrap().contains("врачом"));
}

#[tokio::test]
async fn the_budget_drops_recalled_then_rounds_then_truncates() {
    let Started { mock, proxy, .. } = Harness::new().start().await;
    fill(&proxy, "b", "My locker code is 5521", 12).await;
    let question = body(&[user("What is my locker code?")]);

    let roomy = chat(
        &proxy,
        "b",
        &question,
        &[("x-memory-max-context-tokens", "100000")],
    )
    .await;
    assert_eq!(roomy.header("x-memory-budget"), "fits");
    let full_tokens: u64 = roomy.header("x-memory-prompt-tokens").parse().unwrap();
    let full_len = mock.last_messages().len();

    // A budget a little under the full prompt: recalled turns go first.
    let budget = (full_tokens - 30).to_string();
    let answer = chat(
        &proxy,
        "b",
        &question,
        &[("x-memory-max-context-tokens", &budget)],
    )
    .await;
    assert_eq!(answer.header("x-memory-budget"), "trimmed");
    let retrieved: usize = answer.header("x-memory-retrieved").parse().unwrap();
    assert!(retrieved < 5 && retrieved > 0, "{retrieved}");
    assert_eq!(mock.last_messages().len(), full_len, "window intact");
    assert!(
        answer
            .header("x-memory-prompt-tokens")
            .parse::<u64>()
            .unwrap()
            <= full_tokens - 30
    );

    // Tighter: no recalled turns, the oldest rounds go.
    let answer = chat(
        &proxy,
        "b",
        &question,
        &[("x-memory-max-context-tokens", "120")],
    )
    .await;
    assert_eq!(answer.header("x-memory-retrieved"), "0");
    let forwarded = mock.last_messages();
    assert!(forwarded.len() < full_len - 1);
    assert_eq!(
        forwarded[0]["role"], "user",
        "the window still starts a round"
    );
    assert_eq!(
        role_content(forwarded.last().unwrap()),
        "user:What is my locker code?"
    );

    // A huge last message: its end is kept behind the notice.
    let long: String = (0..600).map(|i| format!("item{i} ")).collect();
    chat(&proxy, "long", &body(&[user(&long)]), &[]).await;
    let answer = chat(
        &proxy,
        "long",
        &body(&[user("and?")]),
        &[
            ("x-memory-max-context-tokens", "200"),
            ("x-memory-recent-n", "1"),
        ],
    )
    .await;
    assert_eq!(answer.header("x-memory-budget"), "trimmed");
    let forwarded = mock.last_messages();
    let cut = forwarded
        .iter()
        .find(|m| {
            m["content"]
                .as_str()
                .unwrap_or("")
                .starts_with(TRUNCATION_NOTICE)
        })
        .unwrap();
    assert!(cut["content"].as_str().unwrap().ends_with("item599 "));

    // The client's own messages are never cut, even over budget.
    let answer = chat(
        &proxy,
        "long",
        &body(&[user(&long)]),
        &[
            ("x-memory-max-context-tokens", "50"),
            ("x-memory-persist", "false"),
        ],
    )
    .await;
    assert_eq!(answer.header("x-memory-budget"), "exceeded");
    assert_eq!(
        mock.last_messages().last().unwrap()["content"],
        Value::String(long)
    );
}

#[tokio::test]
async fn a_restart_rebuilds_the_index() {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().start().await;
    fill(&proxy, "r", "The wifi password is purple-otter-17", 12).await;
    proxy.stop().await;
    let proxy = Proxy::start(&mock, dir.path(), "").await;
    chat(
        &proxy,
        "r",
        &body(&[user("what was the wifi password?")]),
        &[],
    )
    .await;
    assert!(recalled_message(&mock).unwrap().contains("purple-otter-17"));
}

#[tokio::test]
async fn an_echoed_injected_message_is_not_stored_or_repeated() {
    let Started { mock, proxy, .. } = Harness::new().start().await;
    fill(&proxy, "echo", "The gate code is 2468", 10).await;
    chat(&proxy, "echo", &body(&[user("gate code?")]), &[]).await;
    let forwarded = mock.last_messages();
    let stored_before = proxy.stored(Some(TOKEN), "echo").len();

    // A client that sends back exactly what was forwarded, plus a new message.
    let mut echoed = forwarded.clone();
    echoed.push(reply_message(
        &chat(
            &proxy,
            "echo",
            &body(&[user("noop")]),
            &[("x-memory-persist", "false")],
        )
        .await,
    ));
    echoed.push(user("thanks, and the gate code again?"));
    chat(
        &proxy,
        "echo",
        &json!({"model": "m", "messages": echoed}),
        &[],
    )
    .await;
    let recalled_count = mock
        .last_messages()
        .iter()
        .filter(|m| {
            m["content"]
                .as_str()
                .unwrap_or("")
                .starts_with("[Earlier in this conversation")
        })
        .count();
    assert_eq!(recalled_count, 1);
    let stored = summarize(&proxy.stored(Some(TOKEN), "echo"));
    assert!(
        stored.len() <= stored_before + 3,
        "{} → {}",
        stored_before,
        stored.len()
    );
    assert!(
        !stored
            .iter()
            .any(|m| m.contains("[Earlier in this conversation"))
    );
}

/// UTC ms of a day at noon.
fn noon(year: i32, month: u8, day: u8) -> i64 {
    let date =
        time::Date::from_calendar_date(year, time::Month::try_from(month).unwrap(), day).unwrap();
    (date.midnight().assume_utc().unix_timestamp() + 12 * 3600) * 1000
}

#[tokio::test]
async fn a_question_naming_a_period_recalls_the_turns_of_that_time() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let clock = &proxy.state.memory().unwrap().clock;
    let narrow = [
        ("x-memory-recent-n", "2"),
        ("x-memory-relevance-top-k", "1"),
    ];
    let say = |text: String| {
        let proxy = &proxy;
        async move {
            let answer = chat(proxy, "diary", &body(&[user(&text)]), &narrow).await;
            assert_eq!(answer.status, 200);
        }
    };
    // The March turn words a concert a little better than the July one (a shorter turn).
    clock.set(noon(2025, 3, 10));
    for i in 12..15 {
        say(filler(i)).await;
    }
    say("I went to a concert with Sam".into()).await;
    for i in 0..6 {
        say(filler(i)).await;
    }
    clock.set(noon(2025, 7, 12));
    say("I went to a concert with Alex, my neighbour from across the street".into()).await;
    for i in 6..12 {
        say(filler(i)).await;
    }
    clock.set(noon(2025, 7, 20));
    let ask = |question: &'static str, extra: &'static [(&'static str, &'static str)]| {
        let (proxy, mock) = (&proxy, &mock);
        async move {
            let mut headers = narrow.to_vec();
            headers.push(("x-memory-persist", "false"));
            headers.extend_from_slice(extra);
            let answer = chat(proxy, "diary", &body(&[user(question)]), &headers).await;
            assert_eq!(answer.status, 200);
            // The receipt tells whether the recalled turn is of the period named.
            let id = answer.header("x-memory-receipt");
            let path = format!("/admin/v1/receipts/{id}");
            let receipt = crate::support::admin::admin(proxy, "GET", &path, "").await;
            assert_eq!(receipt.status, 200);
            let when = receipt.json()["prompt"]["recalled"]["turns"][0]["when"].clone();
            (recalled_message(mock).unwrap_or_default(), when)
        }
    };
    let (july, when) = ask("Who did I go to a concert with in July?", &[]).await;
    assert_eq!(when, true);
    assert!(july.contains("Alex") && !july.contains("Sam"), "{july}");
    // The 20th is a Sunday: last weekend was the 12th and 13th.
    let (last_weekend, _) = ask("Who came to the concert last weekend?", &[]).await;
    assert!(last_weekend.contains("Alex"), "{last_weekend}");
    let (spring, _) = ask("Who did I go to a concert with in spring 2025?", &[]).await;
    assert!(
        spring.contains("Sam") && !spring.contains("Alex"),
        "{spring}"
    );
    // The setting off: words alone choose the better worded turn, whatever the question's time.
    let (off, when) = ask(
        "Who did I go to a concert with in July?",
        &[("x-memory-relevance-time", "false")],
    )
    .await;
    assert_eq!(when, false);
    assert!(off.contains("Sam") && !off.contains("Alex"), "{off}");
    proxy.stop().await;
}
