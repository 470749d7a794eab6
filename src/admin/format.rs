//! The JSON shapes of the admin API and the offline CLI: the export format (which import reads
//! back), a conversation's listing entry, its messages and its statistics.
//!
//! The export keeps each message as the raw object that was stored (so tool calls, names and
//! any field memproxy does not know survive), with its turn, timestamp and token count, and
//! each summary record as stored, opaque. Closed branches (stored messages that left the main
//! line when a client's history diverged from it) are shown and exported in the same shapes,
//! apart from the main line.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::identity::ConversationKey;
use crate::message::{Message, Role};
use crate::settings::format_iso8601_duration;
use crate::store::{
    BranchRecord, ConversationMeta, ConversationSummary, Deleted, ExchangeFigures, ExchangePoint,
    LedgerTotals, Origin, StoredBranch, StoredMessage, TtlRecord,
};

/// The `format` of an export.
pub const EXPORT_FORMAT: &str = "memproxy.conversation.v1";

/// A conversation as exported, and as imported.
#[derive(Debug, Serialize, Deserialize)]
pub struct Export {
    pub format: String,
    #[serde(default)]
    pub tenant: Option<String>,
    #[serde(default)]
    pub agent: Option<String>,
    #[serde(default)]
    pub conversation: Option<String>,
    #[serde(default)]
    pub created_ms: Option<i64>,
    #[serde(default)]
    pub last_activity_ms: Option<i64>,
    #[serde(default)]
    pub next_turn: Option<u64>,
    pub messages: Vec<ExportMessage>,
    #[serde(default)]
    pub summaries: Vec<ExportSummary>,
    /// Closed branches, oldest first (absent in exports made before branches existed).
    #[serde(default)]
    pub branches: Vec<ExportBranch>,
    /// The token ledger (absent in exports made before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_forwarded: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ledger: Option<LedgerTotals>,
}

/// One exported closed branch: its record, its messages (each with its `turn`) and the
/// summary records it took along.
#[derive(Debug, Serialize, Deserialize)]
pub struct ExportBranch {
    pub number: u64,
    pub forked_after_turn: u64,
    #[serde(default)]
    pub closed_ms: Option<i64>,
    pub messages: Vec<ExportMessage>,
    #[serde(default)]
    pub summaries: Vec<ExportSummary>,
}

/// One exported message. On import, `message` (the raw object) or `role` and `content` are
/// required; the rest is filled in when absent (now, a fresh token count).
#[derive(Debug, Serialize, Deserialize)]
pub struct ExportMessage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Origin>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<Box<RawValue>>,
    /// On a reply that ended a stored exchange: the exchange's token figures (the stats'
    /// cost chart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange: Option<ExportExchange>,
}

/// An exchange's token figures in an export ([`ExchangeFigures`], by name).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ExportExchange {
    pub forwarded_tokens: u64,
    pub history_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
}

impl From<ExchangeFigures> for ExportExchange {
    fn from(f: ExchangeFigures) -> ExportExchange {
        ExportExchange {
            forwarded_tokens: f.forwarded_tokens.into(),
            history_tokens: f.history_tokens.into(),
            cached_tokens: f.cached_tokens.into(),
        }
    }
}

impl From<ExportExchange> for ExchangeFigures {
    fn from(e: ExportExchange) -> ExchangeFigures {
        ExchangeFigures::new(e.forwarded_tokens, e.history_tokens, e.cached_tokens)
    }
}

/// One exported summary: its number and the record as stored.
#[derive(Debug, Serialize, Deserialize)]
pub struct ExportSummary {
    pub number: u64,
    pub record: Box<RawValue>,
}

/// Why an export could not be imported; `field` names the place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct ImportError {
    pub field: String,
    pub why: String,
}

impl ExportMessage {
    pub fn of(message: &StoredMessage) -> ExportMessage {
        ExportMessage {
            turn: Some(message.turn),
            role: Some(message.role.as_str().to_string()),
            origin: Some(message.origin),
            at_ms: Some(message.at_ms),
            tokens: Some(message.tokens),
            content: None,
            message: Some(message.message.clone()),
            exchange: message.exchange.map(ExportExchange::from),
        }
    }

    /// The message ready to store; `index` names it in errors.
    pub fn to_stored(&self, index: usize, now_ms: i64) -> Result<StoredMessage, ImportError> {
        self.to_stored_at(format!("messages[{index}]"), now_ms)
    }

    /// The message ready to store; `path` names it in errors.
    fn to_stored_at(&self, path: String, now_ms: i64) -> Result<StoredMessage, ImportError> {
        let raw = match (&self.message, &self.role) {
            (Some(raw), _) => raw.clone(),
            (None, Some(role)) => {
                let object =
                    json!({"role": role, "content": self.content.clone().unwrap_or(Value::Null)});
                RawValue::from_string(object.to_string()).map_err(|err| ImportError {
                    field: path.clone(),
                    why: err.to_string(),
                })?
            }
            (None, None) => {
                return Err(ImportError {
                    field: path,
                    why: "needs `message` (the message object) or `role` and `content`".into(),
                });
            }
        };
        let parsed = Message::parse(raw, &path).map_err(|err| ImportError {
            field: err.field,
            why: err.why,
        })?;
        let tokens = self
            .tokens
            .unwrap_or_else(|| crate::tokens::count_message(None, &parsed.text()));
        let origin = self.origin.unwrap_or(if parsed.role == Role::Assistant {
            Origin::Reply
        } else {
            Origin::Client
        });
        Ok(StoredMessage {
            turn: self.turn.unwrap_or(0),
            role: parsed.role,
            origin,
            at_ms: self.at_ms.unwrap_or(now_ms),
            tokens,
            fingerprint: parsed.fingerprint,
            message: parsed.raw,
            exchange: self.exchange.map(ExchangeFigures::from),
        })
    }
}

impl ExportBranch {
    pub fn of(branch: &StoredBranch) -> ExportBranch {
        ExportBranch {
            number: branch.record.number,
            forked_after_turn: branch.record.forked_after_turn,
            closed_ms: Some(branch.record.closed_ms),
            messages: branch.messages.iter().map(ExportMessage::of).collect(),
            summaries: branch
                .summaries
                .iter()
                .filter_map(|(number, bytes)| {
                    let text = String::from_utf8(bytes.clone()).ok()?;
                    let record = RawValue::from_string(text).ok()?;
                    Some(ExportSummary {
                        number: *number,
                        record,
                    })
                })
                .collect(),
        }
    }

    /// The branch ready to store; `index` names it in errors. Its messages keep their turns,
    /// which every one of them must carry.
    pub fn to_stored(&self, index: usize, now_ms: i64) -> Result<StoredBranch, ImportError> {
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, message) in self.messages.iter().enumerate() {
            let path = format!("branches[{index}].messages[{i}]");
            if message.turn.is_none() {
                return Err(ImportError {
                    field: path,
                    why: "a branch's message needs its `turn`".into(),
                });
            }
            messages.push(message.to_stored_at(path, now_ms)?);
        }
        Ok(StoredBranch {
            record: BranchRecord {
                number: self.number,
                forked_after_turn: self.forked_after_turn,
                closed_ms: self.closed_ms.unwrap_or(now_ms),
            },
            messages,
            summaries: self
                .summaries
                .iter()
                .map(|s| (s.number, s.record.get().as_bytes().to_vec()))
                .collect(),
        })
    }
}

/// A conversation's address in the admin API: `{tenant}/{agent}/{id}`.
pub fn address(key: &ConversationKey) -> Value {
    json!({
        "tenant": key.tenant.as_str(),
        "agent": key.agent,
        "id": key.conversation,
    })
}

fn ttl_json(ttl: Option<&TtlRecord>) -> Value {
    match ttl {
        Some(TtlRecord {
            ttl_ms: Some(ms), ..
        }) => Value::String(format_iso8601_duration(std::time::Duration::from_millis(
            *ms,
        ))),
        Some(TtlRecord { ttl_ms: None, .. }) => Value::String("none".into()),
        None => Value::Null,
    }
}

/// A listing entry.
pub fn listed(summary: &ConversationSummary) -> Value {
    let mut value = address(&summary.key);
    let meta = &summary.meta;
    value["message_count"] = json!(meta.message_count);
    value["total_tokens"] = json!(meta.total_tokens);
    value["created_ms"] = json!(meta.created_ms);
    value["last_activity_ms"] = json!(meta.last_activity_ms);
    value["summary_count"] = json!(summary.summary_count);
    value["ttl"] = ttl_json(summary.ttl.as_ref());
    value
}

/// The text of a stored message's content, for people.
fn content_text(message: &StoredMessage) -> Value {
    match serde_json::from_str::<Value>(message.message.get()) {
        Ok(Value::Object(mut object)) => object.remove("content").unwrap_or(Value::Null),
        _ => Value::Null,
    }
}

/// A stored message as the admin API shows it.
fn shown_message(m: &StoredMessage) -> Value {
    json!({
        "turn": m.turn,
        "role": m.role.as_str(),
        "origin": m.origin,
        "content": content_text(m),
        "at_ms": m.at_ms,
        "tokens": m.tokens,
        "message": serde_json::from_str::<Value>(m.message.get()).unwrap_or(Value::Null),
    })
}

/// Summary records as the admin API shows them.
fn shown_summaries<'a>(summaries: impl Iterator<Item = (u64, &'a str)>) -> Value {
    summaries
        .map(|(number, record)| {
            json!({
                "number": number,
                "record": serde_json::from_str::<Value>(record).unwrap_or(Value::Null),
            })
        })
        .collect()
}

/// A conversation shown whole: its record, messages, summaries and closed branches.
pub fn shown(
    key: &ConversationKey,
    meta: &ConversationMeta,
    messages: &[StoredMessage],
    summaries: &[(u64, Box<RawValue>)],
    branches: &[StoredBranch],
    ttl: Option<&TtlRecord>,
) -> Value {
    let mut value = address(key);
    value["message_count"] = json!(meta.message_count);
    value["total_tokens"] = json!(meta.total_tokens);
    value["created_ms"] = json!(meta.created_ms);
    value["last_activity_ms"] = json!(meta.last_activity_ms);
    value["ttl"] = ttl_json(ttl);
    value["messages"] = messages.iter().map(shown_message).collect();
    value["summaries"] = shown_summaries(summaries.iter().map(|(n, r)| (*n, r.get())));
    value["branches"] = branches
        .iter()
        .map(|branch| {
            json!({
                "number": branch.record.number,
                "forked_after_turn": branch.record.forked_after_turn,
                "closed_ms": branch.record.closed_ms,
                "messages": branch.messages.iter().map(shown_message).collect::<Vec<_>>(),
                "summaries": shown_summaries(branch.summaries.iter().map(|(n, bytes)| {
                    (*n, std::str::from_utf8(bytes).unwrap_or("null"))
                })),
            })
        })
        .collect();
    value
}

/// What a delete removed, as the admin API and the CLI report it: main-line messages and
/// summaries, and (when there were any) closed branches.
pub fn deleted(key: &ConversationKey, deleted: &Deleted) -> Value {
    let mut value = address(key);
    value["deleted"] = json!({
        "messages": deleted.messages,
        "summaries": deleted.summaries,
    });
    if deleted.branches > 0 {
        value["deleted"]["branches"] = json!(deleted.branches);
    }
    value
}

/// The export of a conversation.
pub fn export(
    key: &ConversationKey,
    meta: &ConversationMeta,
    messages: &[StoredMessage],
    summaries: Vec<(u64, Box<RawValue>)>,
    branches: &[StoredBranch],
) -> Export {
    Export {
        format: EXPORT_FORMAT.to_string(),
        tenant: Some(key.tenant.as_str().to_string()),
        agent: Some(key.agent.clone()),
        conversation: Some(key.conversation.clone()),
        created_ms: Some(meta.created_ms),
        last_activity_ms: Some(meta.last_activity_ms),
        next_turn: Some(meta.next_turn),
        messages: messages.iter().map(ExportMessage::of).collect(),
        summaries: summaries
            .into_iter()
            .map(|(number, record)| ExportSummary { number, record })
            .collect(),
        branches: branches.iter().map(ExportBranch::of).collect(),
        tokens_forwarded: Some(meta.tokens_forwarded),
        ledger: Some(meta.ledger),
    }
}

/// A token ledger as the admin API shows it: what the requests would have sent without
/// memproxy, what was forwarded, what that saved, what the provider cached, what memproxy's own
/// calls spent.
pub fn ledger(exchanges: u64, forwarded: u64, totals: &LedgerTotals) -> Value {
    json!({
        "exchanges": exchanges,
        "history_tokens": totals.history_tokens,
        "forwarded_tokens": forwarded,
        "saved_tokens": totals.history_tokens.saturating_sub(forwarded),
        "cached_tokens": totals.cached_tokens,
        "background_tokens": totals.background_tokens,
    })
}

/// One exchange's figures in a conversation's stats (`exchanges`: the newest hundred).
pub fn exchange_point(point: &ExchangePoint) -> Value {
    json!({
        "turn": point.turn,
        "at_ms": point.at_ms,
        "forwarded_tokens": point.forwarded_tokens,
        "history_tokens": point.history_tokens,
        "cached_tokens": point.cached_tokens,
    })
}
