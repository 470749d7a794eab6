//! What the store keeps: a conversation's record, its messages, summaries and TTL, and the
//! small in-memory view of each message the request path works from. Plain data, the same for
//! every engine; each engine chooses its own encoding and keys.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::fmt::Write as _;
use time::OffsetDateTime;

use memproxy_base::identity::ConversationKey;
use memproxy_base::message::{HasRole, Role, text_of};

/// Where a stored message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Sent by the client in a request.
    Client,
    /// The upstream's reply, read from its response.
    Reply,
}

/// A conversation's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConversationMeta {
    /// The number that identifies this life of the conversation: a conversation deleted and
    /// started afresh under the same key gets a new one, and ids are never reused.
    pub id: u64,
    /// The turn number the next stored message gets; turn numbers only grow.
    pub next_turn: u64,
    /// The oldest turn the conversation holds (0 in records written before it was kept, and
    /// in those of a conversation imported with its turns). An engine may hold messages below
    /// it or from `next_turn` on that are not the conversation's (sled: a write cut short,
    /// `sled_engine.rs::SledEngine::append`); readers take turns in `first_turn..next_turn`.
    #[serde(default)]
    pub first_turn: u64,
    pub message_count: u64,
    pub total_tokens: u64,
    pub created_ms: i64,
    pub last_activity_ms: i64,
    /// Tokens of the prompts forwarded for this conversation's stored exchanges.
    #[serde(default)]
    pub tokens_forwarded: u64,
    /// Closed branches so far: the next one closed is numbered one more.
    #[serde(default)]
    pub branches: u64,
    /// The token ledger of the stored exchanges (beside `tokens_forwarded`).
    #[serde(default)]
    pub ledger: LedgerTotals,
    /// Read from records written before each exchange's figures moved onto its reply
    /// ([`StoredMessage::exchange`]): that record's newest exchanges' figures, oldest first.
    /// Never written: the record, read and written with every exchange, stays small, and
    /// these go at the conversation's next write.
    #[serde(default, skip_serializing)]
    pub recent: Vec<ExchangePoint>,
}

/// How many exchanges' figures a conversation's stats show (the console's cost chart): the
/// newest.
pub const RECENT_EXCHANGES: usize = 100;

/// One stored exchange's token figures with its reply's turn and time, as a conversation's
/// stats show them (the figures themselves are kept on the reply: [`ExchangeFigures`]).
/// Serialized as a compact array `[turn, at_ms, forwarded, history, cached]`, as records
/// written before kept a hundred of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "[u64; 5]", into = "[u64; 5]")]
pub struct ExchangePoint {
    /// The turn of the exchange's reply.
    pub turn: u64,
    /// When it was stored (ms since the epoch).
    pub at_ms: i64,
    /// Tokens of the prompt forwarded.
    pub forwarded_tokens: u64,
    /// Tokens the client's history would have taken (the request without memproxy).
    pub history_tokens: u64,
    /// Of the prompt forwarded, the tokens the upstream reported read from its cache.
    pub cached_tokens: u64,
}

impl From<[u64; 5]> for ExchangePoint {
    fn from([turn, at_ms, forwarded_tokens, history_tokens, cached_tokens]: [u64; 5]) -> Self {
        ExchangePoint {
            turn,
            at_ms: i64::try_from(at_ms).unwrap_or(i64::MAX),
            forwarded_tokens,
            history_tokens,
            cached_tokens,
        }
    }
}

impl ExchangePoint {
    /// The point of the exchange `message` ends, if it is a reply that ended one.
    pub fn of(message: &StoredMessage) -> Option<ExchangePoint> {
        let figures = message.exchange?;
        Some(ExchangePoint {
            turn: message.turn,
            at_ms: message.at_ms,
            forwarded_tokens: figures.forwarded_tokens.into(),
            history_tokens: figures.history_tokens.into(),
            cached_tokens: figures.cached_tokens.into(),
        })
    }

    /// The newest [`RECENT_EXCHANGES`] points of a conversation, oldest first: those of
    /// `messages` (its stored messages, in turn order) and, for turns before them, those a
    /// record written before kept (`legacy`).
    pub fn newest(legacy: &[ExchangePoint], messages: &[StoredMessage]) -> Vec<ExchangePoint> {
        let from_messages: Vec<ExchangePoint> = messages.iter().filter_map(Self::of).collect();
        let first = from_messages.first().map_or(u64::MAX, |p| p.turn);
        let mut points: Vec<ExchangePoint> = legacy
            .iter()
            .filter(|p| p.turn < first)
            .copied()
            .chain(from_messages)
            .collect();
        let excess = points.len().saturating_sub(RECENT_EXCHANGES);
        points.drain(..excess);
        points
    }
}

/// The token figures of the exchange a reply ends, kept on the reply
/// ([`StoredMessage::exchange`]). Serialized as a compact array
/// `[forwarded, history, cached]`. Held as `u32` (one prompt's tokens; larger figures are
/// kept as `u32::MAX`), so a message held in memory grows by 16 bytes, not 32.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "[u64; 3]", into = "[u64; 3]")]
pub struct ExchangeFigures {
    /// Tokens of the prompt forwarded.
    pub forwarded_tokens: u32,
    /// Tokens the client's history would have taken (the request without memproxy).
    pub history_tokens: u32,
    /// Of the prompt forwarded, the tokens the upstream reported read from its cache.
    pub cached_tokens: u32,
}

impl ExchangeFigures {
    /// The figures of an exchange, each held as at most `u32::MAX`.
    pub fn new(forwarded_tokens: u64, history_tokens: u64, cached_tokens: u64) -> Self {
        let held = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        ExchangeFigures {
            forwarded_tokens: held(forwarded_tokens),
            history_tokens: held(history_tokens),
            cached_tokens: held(cached_tokens),
        }
    }
}

impl From<[u64; 3]> for ExchangeFigures {
    fn from([forwarded, history, cached]: [u64; 3]) -> Self {
        ExchangeFigures::new(forwarded, history, cached)
    }
}

impl From<ExchangeFigures> for [u64; 3] {
    fn from(figures: ExchangeFigures) -> [u64; 3] {
        [
            figures.forwarded_tokens.into(),
            figures.history_tokens.into(),
            figures.cached_tokens.into(),
        ]
    }
}

impl From<ExchangePoint> for [u64; 5] {
    fn from(point: ExchangePoint) -> [u64; 5] {
        [
            point.turn,
            u64::try_from(point.at_ms).unwrap_or(0),
            point.forwarded_tokens,
            point.history_tokens,
            point.cached_tokens,
        ]
    }
}

/// What a conversation's stored exchanges cost and saved, in tokens: kept in its record, so
/// it is written with each exchange, survives a restart, is shared by replicas and goes with
/// a delete.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerTotals {
    /// Exchanges stored.
    #[serde(default)]
    pub exchanges: u64,
    /// Tokens the requests would have sent without memproxy (the whole history each time).
    #[serde(default)]
    pub history_tokens: u64,
    /// Of the prompts forwarded, the tokens the upstream reported read from its cache.
    #[serde(default)]
    pub cached_tokens: u64,
    /// Tokens memproxy's own model calls (summaries, memory extraction) spent for the
    /// conversation.
    #[serde(default)]
    pub background_tokens: u64,
}

impl LedgerTotals {
    /// Adds `other` in.
    pub fn add(&mut self, other: &LedgerTotals) {
        self.exchanges += other.exchanges;
        self.history_tokens += other.history_tokens;
        self.cached_tokens += other.cached_tokens;
        self.background_tokens += other.background_tokens;
    }
}

impl ConversationMeta {
    /// The record of a conversation about to be stored for the first time.
    pub fn new(id: u64, now: i64) -> ConversationMeta {
        ConversationMeta {
            id,
            next_turn: 1,
            first_turn: 0,
            message_count: 0,
            total_tokens: 0,
            created_ms: now,
            last_activity_ms: now,
            tokens_forwarded: 0,
            branches: 0,
            ledger: LedgerTotals::default(),
            recent: Vec::new(),
        }
    }
}

/// One stored message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredMessage {
    pub turn: u64,
    pub role: Role,
    pub origin: Origin,
    /// UTC milliseconds since the epoch when it was stored.
    pub at_ms: i64,
    /// Tokens counted once, when stored.
    pub tokens: u32,
    pub fingerprint: u64,
    /// The message object as sent (or, for a reply, as rebuilt from the response).
    pub message: Box<RawValue>,
    /// On the reply that ends a stored exchange: the exchange's token figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange: Option<ExchangeFigures>,
}

/// A closed branch's record: where it left the main line, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BranchRecord {
    /// 1, 2, 3… per conversation.
    pub number: u64,
    /// The last main-line turn the branch shared (0: it shared no stored message).
    pub forked_after_turn: u64,
    /// When it was closed (UTC ms).
    pub closed_ms: i64,
}

/// A closed branch with what it holds: stored messages that left the conversation's main line
/// when a client's history diverged from it, and the summary records that covered them. Kept
/// for people (the admin API, exports); never read into a prompt, the recall index or a
/// summary.
#[derive(Debug, Clone)]
pub struct StoredBranch {
    pub record: BranchRecord,
    /// Its messages in turn order, as they were stored on the main line.
    pub messages: Vec<StoredMessage>,
    /// Its summary records (opaque), by number.
    pub summaries: Vec<(u64, Vec<u8>)>,
}

/// UTC milliseconds to the second as RFC 3339 writes them (`2026-11-22T10:15:00Z`); `None`
/// outside the years 0–9999: what `time`'s `Rfc3339` format gives for a whole second, its
/// digits written here directly (its formatting was a fifth of a recalled turn's line, and
/// `format!`'s padding no cheaper).
pub fn rfc3339_seconds(at_ms: i64) -> Option<String> {
    let t = OffsetDateTime::from_unix_timestamp(at_ms.div_euclid(1000)).ok()?;
    if !(0..=9999).contains(&t.year()) {
        return None;
    }
    let mut out = String::with_capacity(20);
    let fields = [
        (t.year().unsigned_abs(), 4, '-'),
        (u32::from(u8::from(t.month())), 2, '-'),
        (u32::from(t.day()), 2, 'T'),
        (u32::from(t.hour()), 2, ':'),
        (u32::from(t.minute()), 2, ':'),
        (u32::from(t.second()), 2, 'Z'),
    ];
    for (value, width, then) in fields {
        for place in (0..width).rev() {
            let digit = value / 10u32.pow(place) % 10;
            out.push(char::from(b'0' + digit as u8));
        }
        out.push(then);
    }
    Some(out)
}

/// A stored message as one line of a transcript (recalled turns, summary input):
/// `[earlier turn #N at 2026-11-22T10:15:00Z] role: text`; tool calls and results as text.
pub fn transcript_line(message: &StoredMessage) -> String {
    let at = rfc3339_seconds(message.at_ms).unwrap_or_else(|| "unknown time".to_string());
    // Most stored messages are plain text with nothing else to show: read just that, borrowed
    // where it has no escapes, instead of a map of every field (this runs for every recalled
    // turn of every request).
    if let Ok(plain) = serde_json::from_str::<Plain<'_>>(message.message.get())
        && plain.tool_calls.is_none()
        && plain.tool_call_id.is_none()
        && plain.name.is_none()
        && message.role != Role::Tool
    {
        let text = plain.content.unwrap_or_default();
        let mut line = String::with_capacity(64 + text.len());
        let _ = write!(line, "[earlier turn #{} at ", message.turn);
        line.push_str(&at);
        line.push_str("] ");
        line.push_str(message.role.as_str());
        line.push_str(": ");
        line.push_str(&text);
        return line;
    }
    let object: Map<String, Value> =
        serde_json::from_str(message.message.get()).unwrap_or_default();
    let mut text = match object.get("content") {
        Some(Value::Array(parts)) => {
            let mut text = text_of(&object);
            let images = parts
                .iter()
                .filter(|p| p.get("type").and_then(Value::as_str) != Some("text"))
                .count();
            if images > 0 {
                text.push_str(&format!(" [{images} non-text part(s)]"));
            }
            text
        }
        _ => match object.get("content") {
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        },
    };
    if let Some(Value::Array(calls)) = object.get("tool_calls") {
        for call in calls {
            let name = call
                .pointer("/function/name")
                .and_then(Value::as_str)
                .unwrap_or("tool");
            let args = call
                .pointer("/function/arguments")
                .and_then(Value::as_str)
                .unwrap_or("");
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(&format!("[called {name}({args})]"));
        }
    }
    let who = match message.role {
        Role::Tool => {
            let id = object
                .get("tool_call_id")
                .and_then(Value::as_str)
                .unwrap_or("?");
            format!("tool result for {id}")
        }
        role => match object.get("name").and_then(Value::as_str) {
            Some(name) => format!("{} ({name})", role.as_str()),
            None => role.as_str().to_string(),
        },
    };
    format!("[earlier turn #{} at {at}] {who}: {text}", message.turn)
}

/// A stored message whose content is a string (or absent), for [`transcript_line`]: any other
/// content (a list of parts) fails to read as this and takes the general way.
#[derive(Deserialize)]
struct Plain<'a> {
    #[serde(borrow, default)]
    content: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_call_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
}

/// What the request path needs of one stored message, kept in memory per conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub turn: u64,
    pub role: Role,
    pub origin: Origin,
    pub tokens: u32,
    pub fingerprint: u64,
    pub at_ms: i64,
    /// Tokens of this message and every one before it still stored: the tokens of any run of
    /// messages is a difference of two of these, with no scan.
    pub cum_tokens: u64,
}

impl HasRole for Entry {
    fn role(&self) -> Role {
        self.role
    }
}

impl Entry {
    /// The entry of `m`, stored after a message whose `cum_tokens` was `before`.
    pub fn new(m: &StoredMessage, before: u64) -> Entry {
        Entry {
            turn: m.turn,
            role: m.role,
            origin: m.origin,
            tokens: m.tokens,
            fingerprint: m.fingerprint,
            at_ms: m.at_ms,
            cum_tokens: before + u64::from(m.tokens),
        }
    }

    /// The entries of `messages` (in turn order), with their running token totals.
    pub fn all(messages: &[StoredMessage]) -> Vec<Entry> {
        let mut entries: Vec<Entry> = Vec::with_capacity(messages.len());
        for message in messages {
            let before = entries.last().map_or(0, |e| e.cum_tokens);
            entries.push(Entry::new(message, before));
        }
        entries
    }
}

/// Tokens of `entries[from..to]`, from their running totals.
pub fn tokens_between(entries: &[Entry], from: usize, to: usize) -> u64 {
    if from >= to {
        return 0;
    }
    let before = if from == 0 {
        entries[0].cum_tokens - u64::from(entries[0].tokens)
    } else {
        entries[from - 1].cum_tokens
    };
    entries[to - 1].cum_tokens - before
}

/// The TTL a conversation's requests asked for, as last seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtlRecord {
    /// Milliseconds of idleness after which the conversation is deleted; `None`: keep forever.
    pub ttl_ms: Option<u64>,
    /// When the record was written (UTC ms): lets the sweeper drop records whose conversation
    /// was never stored.
    pub set_ms: i64,
}

impl TtlRecord {
    pub fn ttl(&self) -> Option<Duration> {
        self.ttl_ms.map(Duration::from_millis)
    }
}

/// One conversation in a listing.
#[derive(Debug, Clone)]
pub struct ConversationSummary {
    pub key: ConversationKey,
    pub meta: ConversationMeta,
    pub summary_count: usize,
    pub ttl: Option<TtlRecord>,
}

/// What a delete removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deleted {
    pub messages: usize,
    pub summaries: usize,
    /// Closed branches (their messages and summaries not counted above).
    pub branches: usize,
}

/// Who long-term records (`crate::longterm`) belong to, within a tenant: one user, every user
/// of one agent, or the whole tenant. Never more than one tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerKey {
    pub tenant: memproxy_base::identity::TenantId,
    pub kind: OwnerKind,
    /// The user id, the agent name, or empty for the tenant.
    pub name: String,
}

/// The kinds of [`OwnerKey`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OwnerKind {
    User,
    Agent,
    Tenant,
}

impl OwnerKind {
    fn tag(self) -> u8 {
        match self {
            OwnerKind::User => b'u',
            OwnerKind::Agent => b'a',
            OwnerKind::Tenant => b't',
        }
    }
}

impl OwnerKey {
    pub fn user(tenant: &memproxy_base::identity::TenantId, user: &str) -> OwnerKey {
        OwnerKey {
            tenant: tenant.clone(),
            kind: OwnerKind::User,
            name: user.to_string(),
        }
    }

    pub fn agent(tenant: &memproxy_base::identity::TenantId, agent: &str) -> OwnerKey {
        OwnerKey {
            tenant: tenant.clone(),
            kind: OwnerKind::Agent,
            name: agent.to_string(),
        }
    }

    pub fn tenant(tenant: &memproxy_base::identity::TenantId) -> OwnerKey {
        OwnerKey {
            tenant: tenant.clone(),
            kind: OwnerKind::Tenant,
            name: String::new(),
        }
    }

    /// `tenant \0 kind \0 name`: no part holds a NUL, so the bytes of one owner are never a
    /// prefix of another's followed by NUL.
    pub fn to_bytes(&self) -> Vec<u8> {
        let tenant = self.tenant.as_str().as_bytes();
        let mut out = Vec::with_capacity(tenant.len() + self.name.len() + 3);
        out.extend_from_slice(tenant);
        out.push(0);
        out.push(self.kind.tag());
        out.push(0);
        out.extend_from_slice(self.name.as_bytes());
        out
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<OwnerKey> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut parts = text.split('\0');
        let tenant = memproxy_base::identity::TenantId::from_stored(parts.next()?)?;
        let kind = match parts.next()? {
            "u" => OwnerKind::User,
            "a" => OwnerKind::Agent,
            "t" => OwnerKind::Tenant,
            _ => return None,
        };
        let name = parts.next()?.to_string();
        let valid = match kind {
            OwnerKind::Tenant => name.is_empty(),
            _ => memproxy_base::identity::is_valid_id(&name),
        };
        (parts.next().is_none() && valid).then_some(OwnerKey { tenant, kind, name })
    }
}

/// An owner's record: the id its records are sealed under (from the same sequence as
/// conversation ids, so never reused), and when it was created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerMeta {
    pub id: u64,
    pub created_ms: i64,
}

/// One record of an owner: its space (what kind of record it is), its id within the space,
/// and its value (opaque to engines).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerRecord {
    pub space: u8,
    pub id: Vec<u8>,
    pub value: Vec<u8>,
}

/// What an import did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Imported {
    /// Messages appended.
    pub added: usize,
    /// Messages already stored, not stored again.
    pub already_stored: usize,
    pub summaries_added: usize,
    /// Summaries not imported: already there, or the conversation was not empty (their turn
    /// ranges would not match the renumbered messages).
    pub summaries_skipped: usize,
    pub branches_added: usize,
    /// Closed branches not imported: the conversation was not empty (as for summaries).
    pub branches_skipped: usize,
}

/// What an import keeps of the exported conversation's record, for an empty target.
#[derive(Debug, Clone, Copy, Default)]
pub struct ImportMeta {
    pub created_ms: Option<i64>,
    pub last_activity_ms: Option<i64>,
    pub next_turn: Option<u64>,
    /// The exported token ledger: taken by an import that creates the conversation.
    pub tokens_forwarded: Option<u64>,
    pub ledger: Option<LedgerTotals>,
}

/// A stored summary of a conversation's older turns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryRecord {
    /// 1, 2, 3… per conversation.
    pub number: u64,
    pub text: String,
    /// The turns it covers: `from_turn..=to_turn`.
    pub from_turn: u64,
    pub to_turn: u64,
    /// Tokens of `text`.
    pub tokens: u32,
    /// Tokens of what it was made from (previous summary + new messages).
    pub original_tokens: u64,
    /// `tokens / original_tokens`.
    pub ratio: f64,
    /// Time of the first and last covered message (UTC ms).
    pub from_ms: i64,
    pub to_ms: i64,
    /// The model that wrote it (`heuristic` for the stand-in).
    pub model: String,
    pub created_ms: i64,
    /// A stand-in made without an LLM.
    pub heuristic: bool,
    /// Upstream token usage of the call.
    #[serde(default)]
    pub usage_prompt_tokens: u64,
    #[serde(default)]
    pub usage_completion_tokens: u64,
    /// 0, or how many summaries in a row (this one included) read `max_input_tokens` and
    /// stopped before the last turn that was due. While it is between 1 and
    /// [`MAX_CATCH_UP_CALLS`], the next summary continues through the backlog without waiting
    /// for `compression_interval`.
    #[serde(default)]
    pub partial_run: u32,
}

/// Summaries in a row that may skip `compression_interval` to work through a backlog larger
/// than one call's input (64 calls of the default 16,384 tokens: about a million tokens).
pub const MAX_CATCH_UP_CALLS: u32 = 64;

impl SummaryRecord {
    /// The call stopped before the last turn that was due.
    pub fn partial(&self) -> bool {
        self.partial_run > 0
    }

    /// The next summary may skip `compression_interval`: a backlog is being worked through.
    pub fn catching_up(&self) -> bool {
        (1..=MAX_CATCH_UP_CALLS).contains(&self.partial_run)
    }

    /// `1-120`, or `1-120 heuristic`: for `X-Memory-Summary`.
    pub fn label(&self) -> String {
        let range = format!("{}-{}", self.from_turn, self.to_turn);
        if self.heuristic {
            format!("{range} heuristic")
        } else {
            range
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_is_written_as_rfc3339_writes_a_whole_second() {
        use time::format_description::well_known::Rfc3339;
        let by_time = |at_ms: i64| {
            OffsetDateTime::from_unix_timestamp(at_ms.div_euclid(1000))
                .ok()
                .and_then(|t| t.format(&Rfc3339).ok())
                .unwrap_or_else(|| "unknown time".to_string())
        };
        // Year 0 starts at -62,167,219,200 s; year 10,000 at 253,402,300,800 s.
        let mut times = vec![
            0,
            -1,
            999,
            1_000,
            1_764_000_000_123,
            -62_167_219_200_000,
            -62_167_219_200_001,
            253_402_300_799_999,
            253_402_300_800_000,
            i64::MIN,
            i64::MAX,
        ];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            times.push((x % 330_000_000_000_000) as i64 - 70_000_000_000_000);
        }
        for at_ms in times {
            let ours = rfc3339_seconds(at_ms).unwrap_or_else(|| "unknown time".to_string());
            assert_eq!(ours, by_time(at_ms), "{at_ms}");
        }
    }

    #[test]
    fn a_record_written_before_keeps_its_figures_until_its_next_write() {
        let old = r#"{"id":3,"next_turn":9,"message_count":8,"total_tokens":40,
            "created_ms":1,"last_activity_ms":2,"recent":[[2,1,5,50,0],[4,1,6,60,1],[6,1,7,70,2]]}"#;
        let meta: ConversationMeta = serde_json::from_str(old).unwrap();
        assert_eq!(meta.recent.len(), 3);
        assert_eq!(meta.recent[1].history_tokens, 60);
        // Written again, the record no longer holds them.
        let written = serde_json::to_string(&meta).unwrap();
        assert!(!written.contains("recent"), "{written}");
        // The stats show them for the turns before the first reply that keeps its own.
        let mut reply = stored(Role::Assistant, r#"{"role":"assistant","content":"a"}"#);
        reply.turn = 6;
        reply.exchange = Some(ExchangeFigures::new(8, 80, 3));
        let points = ExchangePoint::newest(&meta.recent, std::slice::from_ref(&reply));
        let turns: Vec<u64> = points.iter().map(|p| p.turn).collect();
        assert_eq!(turns, [2, 4, 6]);
        assert_eq!(points[2].forwarded_tokens, 8);
        assert_eq!(points[2].at_ms, reply.at_ms);
        // A reply's figures are a compact array; a message without them carries no field.
        let encoded = serde_json::to_string(&reply).unwrap();
        assert!(encoded.ends_with(r#""exchange":[8,80,3]}"#), "{encoded}");
        reply.exchange = None;
        assert!(!serde_json::to_string(&reply).unwrap().contains("exchange"));
    }

    fn stored(role: Role, json: &str) -> StoredMessage {
        StoredMessage {
            turn: 7,
            role,
            origin: Origin::Client,
            at_ms: 1_700_000_000_000,
            tokens: 1,
            fingerprint: 0,
            message: RawValue::from_string(json.to_string()).unwrap(),
            exchange: None,
        }
    }

    #[test]
    fn transcript_lines_read_plain_and_structured_messages_alike() {
        let at = "[earlier turn #7 at 2023-11-14T22:13:20Z]";
        let cases = [
            (
                Role::User,
                r#"{"role":"user","content":"I drive a silver Volvo."}"#,
                "user: I drive a silver Volvo.",
            ),
            (
                Role::User,
                r#"{"role":"user","content":"a \"quoted\" line\nand a second"}"#,
                "user: a \"quoted\" line\nand a second",
            ),
            (
                Role::Assistant,
                r#"{"role":"assistant","content":null}"#,
                "assistant: ",
            ),
            (
                Role::User,
                r#"{"role":"user","name":"ann","content":"hello"}"#,
                "user (ann): hello",
            ),
            (
                Role::User,
                r#"{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"x"}}]}"#,
                "user: look [1 non-text part(s)]",
            ),
            (
                Role::Assistant,
                r#"{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"get","arguments":"{}"}}]}"#,
                "assistant: [called get({})]",
            ),
            (
                Role::Tool,
                r#"{"role":"tool","tool_call_id":"c1","content":"42"}"#,
                "tool result for c1: 42",
            ),
        ];
        for (role, json, want) in cases {
            assert_eq!(
                transcript_line(&stored(role, json)),
                format!("{at} {want}"),
                "{json}"
            );
        }
    }
}
