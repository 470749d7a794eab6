//! The scenarios (what is sent, to which process, against how much stored history) and the
//! pre-filling of a scenario's conversation.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::client::{Api, Ctx, Spec, chat_request, send};
use crate::machine::status_kb;
use crate::rng::Rng;
use crate::text::{fnv, sentence};

/// A pre-fill request (up to 10,000 messages at once) gives up after this long.
pub const PREFILL_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Mock,
    Proxy,
    /// A memproxy with memory in Redis (a redis-server the benchmark starts).
    RedisProxy,
}

#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    pub name: &'static str,
    pub api: Api,
    pub target: Target,
    /// Messages stored in the conversation before the run (0: no conversation id).
    pub prefill: usize,
    pub persist: bool,
    pub stream: bool,
    /// Extra headers: the diagnostic scenarios turn one memory stage off.
    pub headers: &'static [(&'static str, &'static str)],
    pub baseline: &'static str,
    /// Each closed-loop task in a conversation of its own (64 clients over 64
    /// conversations), stored; no pre-fill.
    pub spread: bool,
}

pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "direct",
        api: Api::Chat,
        target: Target::Mock,
        prefill: 0,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "passthrough",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 0,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "mem-10",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 10,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "mem-10-persist",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 10,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "mem-1k",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 1000,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "mem-1k-persist",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 1000,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "mem-10k",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 10_000,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "mem-10k-persist",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 10_000,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    // Recall by words alone on the same conversations as `mem-1k`/`mem-10k` (which recall by
    // words and meaning, the default): the difference is what the embedder adds to a request.
    Scenario {
        name: "mem-1k-words",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 1000,
        persist: false,
        stream: false,
        headers: &[("x-memory-relevance-semantic", "false")],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "mem-10k-words",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 10_000,
        persist: false,
        stream: false,
        headers: &[("x-memory-relevance-semantic", "false")],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "mem-10k-norecall",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 10_000,
        persist: false,
        stream: false,
        headers: &[("x-memory-relevance-enabled", "false")],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "mem-10k-nocompress",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 10_000,
        persist: false,
        stream: false,
        headers: &[("x-memory-compression-enabled", "false")],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "stream-direct",
        api: Api::Chat,
        target: Target::Mock,
        prefill: 0,
        persist: false,
        stream: true,
        headers: &[],
        baseline: "stream-direct",
        spread: false,
    },
    Scenario {
        name: "stream-passthrough",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 0,
        persist: false,
        stream: true,
        headers: &[],
        baseline: "stream-direct",
        spread: false,
    },
    Scenario {
        name: "stream-mem-1k",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 1000,
        persist: false,
        stream: true,
        headers: &[],
        baseline: "stream-direct",
        spread: false,
    },
    Scenario {
        name: "mem-spread-persist",
        api: Api::Chat,
        target: Target::Proxy,
        prefill: 0,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: true,
    },
    Scenario {
        name: "redis-mem-1k",
        api: Api::Chat,
        target: Target::RedisProxy,
        prefill: 1000,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "redis-mem-1k-persist",
        api: Api::Chat,
        target: Target::RedisProxy,
        prefill: 1000,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: false,
    },
    Scenario {
        name: "redis-mem-spread-persist",
        api: Api::Chat,
        target: Target::RedisProxy,
        prefill: 0,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "direct",
        spread: true,
    },
    // The Responses API and the Anthropic Messages API, against the same mock's own formats.
    Scenario {
        name: "responses-direct",
        api: Api::Responses,
        target: Target::Mock,
        prefill: 0,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "responses-direct",
        spread: false,
    },
    Scenario {
        name: "responses-mem-1k",
        api: Api::Responses,
        target: Target::Proxy,
        prefill: 1000,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "responses-direct",
        spread: false,
    },
    Scenario {
        name: "responses-mem-1k-persist",
        api: Api::Responses,
        target: Target::Proxy,
        prefill: 1000,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "responses-direct",
        spread: false,
    },
    Scenario {
        name: "messages-direct",
        api: Api::Messages,
        target: Target::Mock,
        prefill: 0,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "messages-direct",
        spread: false,
    },
    Scenario {
        name: "messages-mem-1k",
        api: Api::Messages,
        target: Target::Proxy,
        prefill: 1000,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "messages-direct",
        spread: false,
    },
    Scenario {
        name: "messages-mem-1k-persist",
        api: Api::Messages,
        target: Target::Proxy,
        prefill: 1000,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "messages-direct",
        spread: false,
    },
];

pub struct Prefill {
    pub conversation: String,
    pub messages: usize,
    pub body_bytes: usize,
    pub took: Duration,
    pub turns: Option<u64>,
    pub proxy_rss_after_kb: Option<u64>,
    /// How long memproxy took after the answer to make the stored messages' vectors (off the
    /// request path; waited for, so that the rows measure requests and not that).
    pub embedding: Duration,
}

/// Stores `messages` messages in `conversation` with one request: `messages - 1` alternating
/// user/assistant messages ending with a user message, plus the reply memproxy stores.
pub async fn prefill(
    ctx: &Ctx,
    api: Api,
    conversation: &str,
    messages: usize,
) -> Result<Prefill, String> {
    let mut rng = Rng::new(fnv(conversation));
    let list: Vec<Value> = (0..messages.saturating_sub(1))
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": format!("{} [{conversation} #{i}]", sentence(&mut rng))})
        })
        .collect();
    let body = api.body(list, false);
    let body_bytes = body.len();
    let spec = Spec {
        api,
        uri: api.uri(&ctx.proxy_url),
        conversation: Some(conversation.to_string()),
        persist_false: false,
        extra_headers: &[],
        stream: false,
        spread: false,
        expect_memory: Some("stored"),
    };
    let request = chat_request(&spec, body)?;
    let started = Instant::now();
    let outcome = tokio::time::timeout(PREFILL_TIMEOUT, send(&ctx.client, request))
        .await
        .map_err(|_| {
            format!(
                "pre-filling {conversation}: no answer within {} s",
                PREFILL_TIMEOUT.as_secs()
            )
        })?
        .map_err(|e| format!("pre-filling {conversation}: {e}"))?;
    let took = started.elapsed();
    if outcome.status != 200 || outcome.memory.as_deref() != Some("stored") {
        return Err(format!(
            "pre-filling {conversation}: HTTP {}, x-memory-status {:?}: {}",
            outcome.status,
            outcome.memory,
            outcome.snippet()
        ));
    }
    let embedding = embedded(ctx).await;
    Ok(Prefill {
        conversation: conversation.to_string(),
        messages,
        body_bytes,
        took,
        turns: outcome.turns,
        proxy_rss_after_kb: status_kb(ctx.proxy_pid, "VmRSS"),
        embedding,
    })
}

/// The longest [`embedded`] waits.
const EMBEDDING_TIMEOUT: Duration = Duration::from_secs(300);

/// Waits until memproxy's background embedding is idle (`memproxy_embedding_jobs_pending`
/// and `memproxy_embedding_owed` both 0, twice in a row), at most [`EMBEDDING_TIMEOUT`]. With
/// the full model, the RSS phase's messages and 10,000 pre-filled ones take tens of seconds,
/// and rows measured meanwhile would measure that (and recall without vectors). Returns how
/// long it waited.
async fn embedded(ctx: &Ctx) -> Duration {
    let started = Instant::now();
    let mut idle_once = false;
    while started.elapsed() < EMBEDDING_TIMEOUT {
        // A scrape that fails is not idle.
        let Some(text) = scrape(ctx).await else {
            idle_once = false;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let read = |name: &str| {
            text.lines().find_map(|line| {
                line.strip_prefix(name)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
        };
        let idle = match (
            read("memproxy_embedding_jobs_pending"),
            read("memproxy_embedding_owed"),
        ) {
            (Some(pending), Some(owed)) => pending == 0.0 && owed == 0.0,
            // A memproxy without these metrics: nothing to wait for.
            _ => true,
        };
        if idle && idle_once {
            break;
        }
        idle_once = idle;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    started.elapsed()
}

/// memproxy's `GET /metrics` as text (`None` if it fails).
async fn scrape(ctx: &Ctx) -> Option<String> {
    let uri = format!(
        "http://{}/metrics",
        ctx.proxy_url.authority().map_or("", |a| a.as_str())
    );
    let uri = uri.parse::<hyper::Uri>().ok()?;
    let request = hyper::Request::get(uri)
        .body(http_body_util::Full::new(hyper::body::Bytes::new()))
        .ok()?;
    match tokio::time::timeout(Duration::from_secs(10), send(&ctx.client, request)).await {
        Ok(Ok(answer)) if answer.status == 200 => {
            Some(String::from_utf8_lossy(&answer.body).into_owned())
        }
        _ => None,
    }
}
