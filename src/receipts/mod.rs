//! Receipts: for every memory-on exchange, what memproxy forwarded and why, readable for a
//! short while by an operator (`GET /admin/v1/receipts/{id}`, `admin/receipts.rs`).
//!
//! A receipt is made when the prompt is planned and rendered: the exact body forwarded (and
//! its SHA-256), the prompt's parts as the plan made them (`pipeline::assemble::Prompt`'s
//! named fields, moved here, not copied), what the budget dropped, the settings in effect. It
//! is filled in as the exchange goes on: the upstream's status and the time to its head, then,
//! when the exchange ends (a JSON answer read, or a stream's end), the usage the upstream
//! reported and what memory did with it.
//!
//! A request whose memory failed (`X-Memory-Status: degraded`: the store could not be read)
//! gets a receipt too, of what it forwarded: the client's own body, its messages as the only
//! parts ([`Planned::unplanned`]), with the reason.
//!
//! An exchange that ends without being told so (the client went away mid-stream, or before
//! the answer came: the response body, or the request's future, is dropped) is finished by a
//! drop: `ended` is `client_gone`, with the usage seen so far ([`Receipt::gone`]).
//!
//! Receipts hold message text. They live only in this process's memory, in a cache bounded in
//! bytes (`receipts.max_bytes`, its share of `server.memory_budget`; weighed with `heap.rs`)
//! and in time (`receipts.retention`); they are never written to disk or logged, and the
//! client's credential is never part of one. A deleted conversation takes its receipts along,
//! whoever deletes it (an operator, a user or tenant delete, the TTL sweeper: `Memory` tells
//! the receipts through its `OnDelete`): an index by conversation finds them. Token counts of
//! the parts are counted when a receipt is read, never on the request's path.

pub mod render;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::cache::{Limit, Shrink};
use crate::config::ReceiptsConfig;
use crate::heap;
use crate::identity::hex;
use crate::identity::{ConversationKey, TenantId};
use crate::message::Message;
use crate::pipeline::assemble::Prompt;
use crate::pipeline::plan::Plan;
use crate::settings::MemorySettings;
use crate::wire::Api;
use crate::wire::usage::Usage;

/// The response header that names an exchange's receipt.
pub const RECEIPT_HEADER: http::HeaderName = http::HeaderName::from_static("x-memory-receipt");

/// Request headers a receipt keeps for its replay: what shapes the upstream's answer, never a
/// credential.
pub const REPLAYED_HEADERS: &[&str] = &[
    "content-type",
    "accept",
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
    "openai-organization",
    "openai-project",
];

/// What a receipt takes besides its body and its prompt's messages: the plan's figures, the
/// settings, the outcome (measured on receipts of small prompts, rounded up).
const FIXED_BYTES: usize = 2048;

/// What the bookkeeping takes per receipt besides its id: a slot in the map, in the order
/// kept and in its conversation's list, and a share of their tables (rounded up).
const INDEX_BYTES: usize = 64;

/// The receipts of this process (cloned cheaply: the clones share what is kept).
#[derive(Clone)]
pub struct Receipts {
    kept: Option<Arc<Mutex<Kept>>>,
    retention: Duration,
    /// `receipts.max_bytes`, and the limit the memory guard holds the receipts to now
    /// ([`Shrink`]).
    limits: Arc<Limit>,
}

/// The kept receipts: by id, in the order kept (which is the order they go in, oldest first:
/// past the size or the retention), and by conversation (what a delete drops). One lock, held
/// only for a few map operations: a receipt is kept once per exchange and read rarely.
#[derive(Default)]
struct Kept {
    by_id: HashMap<String, Arc<Receipt>>,
    /// Oldest first, not holding them: one forgotten (its conversation deleted) is gone, or no
    /// longer in `by_id`, when it comes up.
    order: VecDeque<Weak<Receipt>>,
    by_conversation: HashMap<ConversationKey, VecDeque<Arc<Receipt>>>,
    bytes: u64,
}

impl Kept {
    /// Lets go of the oldest receipt; false when none is left.
    fn pop_oldest(&mut self) -> bool {
        let Some(oldest) = self.order.pop_front() else {
            return false;
        };
        if let Some(receipt) = oldest.upgrade().and_then(|r| self.by_id.remove(&r.id)) {
            self.bytes = self.bytes.saturating_sub(receipt.weight as u64);
            if let Some(list) = self.by_conversation.get_mut(&receipt.key) {
                // The oldest overall is its conversation's oldest: nearly always the first.
                if let Some(at) = list.iter().position(|kept| Arc::ptr_eq(kept, &receipt)) {
                    list.remove(at);
                }
                if list.is_empty() {
                    self.by_conversation.remove(&receipt.key);
                }
            }
        }
        true
    }

    /// Lets go of the receipts made longer than `retention` ago (and of forgotten ones ahead
    /// of the oldest kept).
    fn expire(&mut self, retention: Duration, now: Instant) {
        while let Some(oldest) = self.order.front() {
            match oldest.upgrade() {
                // Within its retention: it and all after it stay. (Its id is not looked up: one
                // forgotten while its conversation was deleted is gone when nothing else holds
                // it, and otherwise goes when it comes up here past its retention.)
                Some(r) if now.duration_since(r.started) < retention => break,
                _ => {
                    self.pop_oldest();
                }
            }
        }
    }

    /// Lets go of the oldest receipts until they weigh at most `target` bytes; returns the
    /// bytes let go of.
    fn evict_to(&mut self, target: u64) -> u64 {
        let before = self.bytes;
        while self.bytes > target && self.pop_oldest() {}
        before - self.bytes
    }

    /// Drops the receipts in `list` (their conversation is deleted).
    fn forget(&mut self, list: VecDeque<Arc<Receipt>>) {
        for receipt in list {
            if self.by_id.remove(&receipt.id).is_some() {
                self.bytes = self.bytes.saturating_sub(receipt.weight as u64);
            }
        }
    }
}

impl std::fmt::Debug for Receipts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receipts")
            .field("enabled", &self.kept.is_some())
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl Receipts {
    pub fn new(config: &ReceiptsConfig) -> Receipts {
        let capacity = if config.enabled { config.max_bytes } else { 0 };
        Receipts {
            kept: config.enabled.then(Arc::default),
            retention: config.retention,
            limits: Arc::new(Limit::new(capacity)),
        }
    }

    /// True when receipts are kept.
    pub fn enabled(&self) -> bool {
        self.kept.is_some()
    }

    fn kept(&self) -> Option<std::sync::MutexGuard<'_, Kept>> {
        let mut kept = lock(self.kept.as_ref()?);
        kept.expire(self.retention, Instant::now());
        Some(kept)
    }

    /// Keeps a receipt; it can be read until the retention passes, newer ones push it out
    /// (the oldest go first past the size, or the lower limit the memory guard holds the
    /// receipts to), or its conversation is deleted.
    pub fn insert(&self, receipt: Arc<Receipt>) {
        let Some(mut kept) = self.kept() else {
            return;
        };
        let (weight, limit) = (receipt.weight as u64, self.limit());
        if weight > limit {
            return;
        }
        kept.bytes += weight;
        kept.order.push_back(Arc::downgrade(&receipt));
        // The key is cloned only for a conversation not in the map yet.
        match kept.by_conversation.get_mut(&receipt.key) {
            Some(list) => list.push_back(Arc::clone(&receipt)),
            None => {
                let list = VecDeque::from([Arc::clone(&receipt)]);
                kept.by_conversation.insert(receipt.key.clone(), list);
            }
        }
        kept.by_id.insert(receipt.id.clone(), receipt);
        kept.evict_to(limit);
    }

    /// The receipt `id`, while it is kept.
    pub fn get(&self, id: &str) -> Option<Arc<Receipt>> {
        let kept = self.kept()?;
        kept.by_id.get(id).cloned()
    }

    /// The kept receipts of the conversation `key`, newest first, at most `limit`.
    pub fn of_conversation(&self, key: &ConversationKey, limit: usize) -> Vec<Arc<Receipt>> {
        let Some(kept) = self.kept() else {
            return Vec::new();
        };
        let mut found: Vec<Arc<Receipt>> = kept
            .by_conversation
            .get(key)
            .map(|list| list.iter().rev().cloned().collect())
            .unwrap_or_default();
        drop(kept);
        found.sort_by_key(|receipt| std::cmp::Reverse(receipt.created_ms));
        found.truncate(limit);
        found
    }

    /// Drops the receipts of the conversation `key` (deleted): from now on they are unknown.
    pub fn forget_conversation(&self, key: &ConversationKey) {
        if let Some(mut kept) = self.kept() {
            let list = kept.by_conversation.remove(key).unwrap_or_default();
            kept.forget(list);
        }
    }

    /// Drops the receipts of every conversation of `tenant` (deleted).
    pub fn forget_tenant(&self, tenant: &TenantId) {
        if let Some(mut kept) = self.kept() {
            let mut lists = Vec::new();
            kept.by_conversation.retain(|key, list| {
                let gone = key.tenant == *tenant;
                if gone {
                    lists.push(std::mem::take(list));
                }
                !gone
            });
            for list in lists {
                kept.forget(list);
            }
        }
    }

    /// Bytes the kept receipts take (their weights).
    pub fn weighted_size(&self) -> u64 {
        self.kept().map_or(0, |kept| kept.bytes)
    }

    /// Receipts kept now.
    pub fn len(&self) -> u64 {
        self.kept().map_or(0, |kept| kept.by_id.len() as u64)
    }

    /// True when none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A new receipt id: `rcpt_` and 128 random bits from a CSPRNG, so an id cannot be guessed
/// from another: the thread's own (`rand`'s ChaCha12, seeded and reseeded from the system's),
/// not a system call for every request.
pub fn new_id() -> String {
    use rand::Rng;
    let mut bytes = [0u8; 16];
    rand::rng().fill(&mut bytes);
    format!("rcpt_{}", hex(&bytes))
}

/// What the plan decided, kept for the receipt (the prompt's parts are moved in whole).
#[derive(Debug)]
pub struct Planned {
    pub prompt: Prompt,
    pub prompt_tokens: u64,
    pub history_tokens: u64,
    pub stored_count: usize,
    /// The conversation's recalled turns, best first.
    pub recalled: Vec<RecallScore>,
    /// Turns the relevance floor kept out, best first.
    pub under_floor: Vec<RecallScore>,
    /// How recall searched (`X-Memory-Recall`), when it did.
    pub recall_mode: crate::embedding::RecallMode,
    /// (conversation, turn, BM25 score): the user's other conversations.
    pub recalled_elsewhere: Vec<(String, u64, f32)>,
    /// Recalled turns cut to their most relevant passage.
    pub excerpted: Vec<u64>,
    /// The `window_step` in effect (`auto` resolved); `None` when nothing was planned.
    pub window_step: Option<usize>,
    /// (memory id, score, decay).
    pub memories: Vec<(u64, f64, f64)>,
    pub summary: Option<crate::store::SummaryRecord>,
    pub budget: Option<crate::pipeline::budget::Fitted>,
    pub dropped: crate::pipeline::budget::Dropped,
}

/// A recalled turn's scores: fused, and its parts (`recall/hybrid.rs`).
pub use crate::recall::hybrid::Scored as RecallScore;

impl Planned {
    /// Takes what the receipt needs from `plan`, moved out: the body was rendered from the plan
    /// and its headers made already; what is left of it is the exchange to commit.
    pub fn take(plan: &mut Plan) -> Planned {
        Planned {
            prompt: std::mem::take(&mut plan.prompt),
            prompt_tokens: plan.report.prompt_tokens,
            history_tokens: plan.report.history_tokens,
            stored_count: plan.report.stored_count,
            recalled: std::mem::take(&mut plan.report.recalled_scores),
            under_floor: std::mem::take(&mut plan.report.under_floor),
            recall_mode: plan.report.recall_mode,
            recalled_elsewhere: std::mem::take(&mut plan.report.recalled_elsewhere),
            excerpted: std::mem::take(&mut plan.report.excerpted_turns),
            window_step: Some(plan.report.window_step),
            memories: plan
                .report
                .memories
                .iter()
                .map(|c| (c.memory.id, c.score, c.decay))
                .collect(),
            summary: plan.report.summary.take(),
            budget: plan.report.fitted,
            dropped: std::mem::take(&mut plan.report.dropped),
        }
    }

    /// What a request whose memory failed forwarded: the client's own `messages` (parsed from
    /// its body), its instructions apart and the rest as its new messages; no summary, window,
    /// recall or memories. `model` counts their tokens, the prompt's and the history's alike
    /// (the client sent its history itself). Counts every message: call it off the runtime's
    /// threads.
    pub fn unplanned(messages: Vec<Message>, model: Option<&str>) -> Planned {
        let mut prompt = Prompt::default();
        let mut tokens = 0u64;
        for message in messages {
            tokens += u64::from(crate::tokens::count_message(model, &message.text()));
            if message.is_instruction() {
                prompt.instructions.push(message.raw);
            } else {
                prompt.incoming.push(message.raw);
            }
        }
        Planned {
            prompt,
            prompt_tokens: tokens,
            history_tokens: tokens,
            stored_count: 0,
            recalled: Vec::new(),
            under_floor: Vec::new(),
            recall_mode: crate::embedding::RecallMode::None,
            recalled_elsewhere: Vec::new(),
            excerpted: Vec::new(),
            window_step: None,
            memories: Vec::new(),
            summary: None,
            budget: None,
            dropped: Default::default(),
        }
    }

    fn heap_bytes(&self) -> usize {
        let raw = |m: &serde_json::value::RawValue| heap::chunk(m.get().len()) + heap::chunk(16);
        let prompt = &self.prompt;
        let messages: usize = prompt
            .instructions
            .iter()
            .chain(&prompt.memories)
            .chain(&prompt.summary)
            .chain(&prompt.recalled)
            .chain(&prompt.window)
            .chain(&prompt.incoming)
            .map(|m| raw(m))
            .sum();
        messages
            + heap::vec::<(String, u64, f32)>(self.recalled_elsewhere.len())
            + self
                .recalled_elsewhere
                .iter()
                .map(|(c, _, _)| heap::string(c.len()))
                .sum::<usize>()
            + heap::vec::<RecallScore>(self.recalled.len())
            + heap::vec::<RecallScore>(self.under_floor.len())
            + heap::vec::<u64>(self.excerpted.len())
            + heap::vec::<(u64, f64, f64)>(self.memories.len())
            + self.summary.as_ref().map_or(0, |s| {
                heap::string(s.text.len()) + heap::string(s.model.len())
            })
            + heap::vec::<(Option<String>, u64, f32)>(self.dropped.recalled.len())
            + heap::vec::<u64>(self.dropped.window.len())
    }
}

/// How the exchange went, filled in as it goes.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// The upstream's status.
    pub status: Option<u16>,
    /// Time to the upstream's response head.
    pub upstream_latency: Option<Duration>,
    /// From the forward to the end of the exchange (the answer read, or the stream's end).
    pub total: Option<Duration>,
    pub stream: bool,
    /// The exchange ended: `complete` (an answer or a stream that finished), `cut` (a stream
    /// that failed or ended unfinished), `error` (the upstream answered a status other than
    /// 2xx, or could not be reached), or `client_gone` (the client went away before the
    /// answer or the stream was over).
    pub ended: Option<&'static str>,
    pub usage: Option<Usage>,
    /// `X-Memory-Status` of the exchange.
    pub memory_status: Option<&'static str>,
    /// `X-Memory-Reason` of a `degraded` exchange.
    pub memory_reason: Option<&'static str>,
}

/// The receipts give memory back as the caches do (`cache.rs`): the oldest go first.
impl Shrink for Receipts {
    fn name(&self) -> &'static str {
        "receipts"
    }

    fn weighted_bytes(&self) -> u64 {
        self.weighted_size()
    }

    fn limits(&self) -> &Limit {
        &self.limits
    }

    fn evict_to(&self, target: u64) -> u64 {
        self.kept().map_or(0, |mut kept| kept.evict_to(target))
    }
}

/// One exchange's receipt.
#[derive(Debug)]
pub struct Receipt {
    pub id: String,
    pub key: ConversationKey,
    pub api: Api,
    /// The upstream path (`/v1/chat/completions`) and query it went to.
    pub api_path: String,
    pub query: Option<String>,
    pub model: Option<String>,
    pub created_ms: i64,
    /// The request headers a replay sends again ([`REPLAYED_HEADERS`]).
    pub headers: Vec<(String, String)>,
    /// The body forwarded, byte for byte (its SHA-256 is computed when the receipt is read,
    /// off the request's path: [`Receipt::sha256`]).
    pub body: Bytes,
    pub planned: Planned,
    /// The settings in effect (described by name when the receipt is read).
    pub settings: MemorySettings,
    pub outcome: Mutex<Outcome>,
    started: Instant,
    /// What the receipt takes in the cache.
    weight: usize,
}

/// What a receipt is made of, as the edge has it.
pub struct Made<'a> {
    pub key: &'a ConversationKey,
    pub api: Api,
    pub api_path: &'a str,
    pub query: Option<&'a str>,
    pub model: Option<String>,
    pub headers: &'a HeaderMap,
    pub body: Bytes,
    pub planned: Planned,
    pub settings: &'a MemorySettings,
    /// When it was made (`AppState::clock`).
    pub created_ms: i64,
}

impl Receipt {
    /// A receipt with a fresh id; `None` when no id could be made.
    pub fn new(made: Made<'_>) -> Option<Receipt> {
        let id = new_id();
        if id.is_empty() {
            return None;
        }
        let headers: Vec<(String, String)> = REPLAYED_HEADERS
            .iter()
            .filter_map(|name| {
                let value = made.headers.get(*name)?.to_str().ok()?;
                Some((name.to_string(), value.to_string()))
            })
            .collect();
        let weight = heap::CACHE_ENTRY
            + FIXED_BYTES
            + INDEX_BYTES
            + heap::string(id.len())
            + heap::chunk(made.body.len())
            + made.planned.heap_bytes()
            + headers
                .iter()
                .map(|(n, v)| heap::string(n.len()) + heap::string(v.len()))
                .sum::<usize>();
        Some(Receipt {
            id,
            key: made.key.clone(),
            api: made.api,
            api_path: made.api_path.to_string(),
            query: made.query.map(str::to_string),
            model: made.model,
            created_ms: made.created_ms,
            headers,
            body: made.body,
            planned: made.planned,
            settings: made.settings.clone(),
            outcome: Mutex::new(Outcome::default()),
            started: Instant::now(),
            weight,
        })
    }

    /// The SHA-256 of the forwarded body, hex.
    pub fn sha256(&self) -> String {
        hex(&Sha256::digest(&self.body))
    }

    /// What the receipt takes in the cache (bytes).
    pub fn weight(&self) -> usize {
        self.weight
    }

    fn outcome(&self) -> std::sync::MutexGuard<'_, Outcome> {
        self.outcome
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The upstream answered with `status` after `latency`; a status other than 2xx ends the
    /// exchange (`error`: nothing is read from its answer).
    pub fn answered(&self, status: u16, latency: Option<Duration>, stream: bool) {
        let mut outcome = self.outcome();
        outcome.status = Some(status);
        outcome.upstream_latency = latency;
        outcome.stream = stream;
        if !(200..300).contains(&status) {
            outcome.ended = Some("error");
            outcome.total = Some(self.started.elapsed());
        }
    }

    /// What memory did: `X-Memory-Status`, and for `degraded` its `X-Memory-Reason`.
    pub fn memory_status(&self, status: &'static str, reason: Option<&'static str>) {
        let mut outcome = self.outcome();
        outcome.memory_status = Some(status);
        outcome.memory_reason = reason;
    }

    /// The client went away before the exchange ended (a dropped response body or request):
    /// `client_gone`, with the usage seen so far. Nothing when it had ended already.
    pub fn gone(&self, usage: Option<Usage>) {
        let mut outcome = self.outcome();
        if outcome.ended.is_none() {
            outcome.ended = Some("client_gone");
            outcome.usage = usage;
            outcome.total = Some(self.started.elapsed());
        }
    }

    /// The exchange ended (`complete` or `cut`) with `usage`.
    pub fn ended(&self, how: &'static str, usage: Option<Usage>) {
        let mut outcome = self.outcome();
        outcome.ended = Some(how);
        outcome.usage = usage;
        outcome.total = Some(self.started.elapsed());
    }

    /// A copy of the outcome so far.
    pub fn outcome_now(&self) -> Outcome {
        self.outcome().clone()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_random_and_unlike_each_other() {
        let (a, b) = (new_id(), new_id());
        assert!(a.starts_with("rcpt_") && a.len() == 37, "{a}");
        assert_ne!(a, b);
    }

    fn receipts(max_bytes: u64) -> Receipts {
        Receipts::new(&ReceiptsConfig {
            enabled: true,
            retention: Duration::from_secs(60),
            max_bytes,
        })
    }

    fn receipt_of(tenant: &str, conversation: &str) -> Arc<Receipt> {
        let key = ConversationKey {
            tenant: TenantId::from_token(Some(tenant)),
            agent: "default".to_string(),
            conversation: conversation.to_string(),
        };
        Arc::new(
            Receipt::new(Made {
                key: &key,
                api: Api::Chat,
                api_path: "/v1/chat/completions",
                query: None,
                model: None,
                headers: &HeaderMap::new(),
                body: Bytes::from_static(b"{}"),
                planned: Planned::unplanned(Vec::new(), None),
                settings: &MemorySettings::default(),
                created_ms: 0,
            })
            .unwrap(),
        )
    }

    fn indexed(receipts: &Receipts) -> usize {
        let kept = lock(receipts.kept.as_ref().unwrap());
        kept.by_conversation.values().map(VecDeque::len).sum()
    }

    #[test]
    fn a_deleted_conversation_or_tenant_takes_its_receipts_and_only_those() {
        let receipts = receipts(1 << 20);
        let (a1, a2) = (receipt_of("sk-a", "one"), receipt_of("sk-a", "one"));
        let (other, b) = (receipt_of("sk-a", "two"), receipt_of("sk-b", "one"));
        for receipt in [&a1, &a2, &other, &b] {
            receipts.insert(Arc::clone(receipt));
        }
        receipts.forget_conversation(&a1.key);
        assert!(receipts.get(&a1.id).is_none() && receipts.get(&a2.id).is_none());
        assert!(receipts.get(&other.id).is_some() && receipts.get(&b.id).is_some());
        receipts.forget_tenant(&a1.key.tenant);
        assert!(receipts.get(&other.id).is_none());
        assert!(receipts.get(&b.id).is_some(), "another tenant's stay");
        assert_eq!(receipts.len(), 1);
        assert_eq!(indexed(&receipts), 1);
    }

    #[test]
    fn the_index_forgets_the_receipts_the_cache_lets_go() {
        // Room for about two: the older ones are pushed out, and out of the index too.
        let receipts = receipts(2 * receipt_of("sk-a", "c").weight() as u64);
        for i in 0..20 {
            receipts.insert(receipt_of("sk-a", &format!("c{}", i % 3)));
        }
        let kept = receipts.len();
        assert!(kept <= 2, "{kept}");
        assert_eq!(indexed(&receipts) as u64, kept);
    }

    #[test]
    fn the_oldest_go_first_past_the_size_the_limit_or_the_retention() {
        let weight = receipt_of("sk-a", "c").weight() as u64;
        let receipts = receipts(16 * weight);
        let all: Vec<_> = (0..16)
            .map(|i| receipt_of("sk-a", &format!("c{}", i % 3)))
            .collect();
        for receipt in &all {
            receipts.insert(Arc::clone(receipt));
        }
        assert_eq!(receipts.len(), 16);
        assert_eq!(receipts.weighted_size(), 16 * weight);
        // The memory guard holds them to three: the thirteen oldest go, now and on insert.
        assert_eq!(receipts.limit_to(3 * weight), 13 * weight);
        assert!(all[..13].iter().all(|r| receipts.get(&r.id).is_none()));
        assert!(all[13..].iter().all(|r| receipts.get(&r.id).is_some()));
        let newer = receipt_of("sk-a", "c0");
        receipts.insert(Arc::clone(&newer));
        assert_eq!(receipts.len(), 3);
        assert!(receipts.get(&all[13].id).is_none() && receipts.get(&newer.id).is_some());
        assert_eq!(indexed(&receipts), 3);
        let listed = receipts.of_conversation(&newer.key, 10);
        assert!(
            listed.iter().any(|r| Arc::ptr_eq(r, &newer)),
            "listed with its conversation"
        );

        let brief = Receipts::new(&ReceiptsConfig {
            enabled: true,
            retention: Duration::from_millis(20),
            max_bytes: 1 << 20,
        });
        let old = receipt_of("sk-a", "c");
        brief.insert(Arc::clone(&old));
        assert!(brief.get(&old.id).is_some());
        std::thread::sleep(Duration::from_millis(40));
        assert!(brief.get(&old.id).is_none(), "past the retention");
        assert_eq!(
            (brief.len(), brief.weighted_size(), indexed(&brief)),
            (0, 0, 0)
        );
    }

    #[test]
    fn a_receipt_dropped_before_its_end_says_client_gone_once() {
        let receipt = receipt_of("sk-a", "c");
        receipt.answered(200, None, true);
        let usage = Usage {
            input_tokens: 10,
            cached_tokens: 4,
            ..Usage::default()
        };
        receipt.gone(Some(usage));
        receipt.gone(None);
        let outcome = receipt.outcome_now();
        assert_eq!(outcome.ended, Some("client_gone"));
        assert_eq!(outcome.usage, Some(usage));
        let ended = receipt_of("sk-a", "c");
        ended.ended("complete", None);
        ended.gone(Some(usage));
        assert_eq!(ended.outcome_now().ended, Some("complete"));
        assert_eq!(ended.outcome_now().usage, None);
    }

    #[test]
    fn the_sha256_is_of_the_body() {
        assert_eq!(
            hex(&Sha256::digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
