//! The JSON shapes of the admin API and the offline CLI: the export format (which import reads
//! back), a conversation's listing entry, its messages and its statistics.
//!
//! The export keeps each message as the raw object that was stored (so tool calls, names and
//! any field memproxy does not know survive), with its turn, timestamp and token count, and
//! each summary record as stored, opaque.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::identity::ConversationKey;
use crate::message::{Message, Role};
use crate::settings::format_iso8601_duration;
use crate::store::{ConversationMeta, ConversationSummary, Origin, StoredMessage, TtlRecord};

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
        }
    }

    /// The message ready to store; `index` names it in errors.
    pub fn to_stored(&self, index: usize, now_ms: i64) -> Result<StoredMessage, ImportError> {
        let path = format!("messages[{index}]");
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

/// A conversation shown whole: its record, messages and summaries.
pub fn shown(
    key: &ConversationKey,
    meta: &ConversationMeta,
    messages: &[StoredMessage],
    summaries: &[(u64, Box<RawValue>)],
    ttl: Option<&TtlRecord>,
) -> Value {
    let mut value = address(key);
    value["message_count"] = json!(meta.message_count);
    value["total_tokens"] = json!(meta.total_tokens);
    value["created_ms"] = json!(meta.created_ms);
    value["last_activity_ms"] = json!(meta.last_activity_ms);
    value["ttl"] = ttl_json(ttl);
    value["messages"] = messages
        .iter()
        .map(|m| {
            json!({
                "turn": m.turn,
                "role": m.role.as_str(),
                "origin": m.origin,
                "content": content_text(m),
                "at_ms": m.at_ms,
                "tokens": m.tokens,
                "message": serde_json::from_str::<Value>(m.message.get()).unwrap_or(Value::Null),
            })
        })
        .collect();
    value["summaries"] = summaries
        .iter()
        .map(|(number, record)| {
            json!({
                "number": number,
                "record": serde_json::from_str::<Value>(record.get()).unwrap_or(Value::Null),
            })
        })
        .collect();
    value
}

/// The export of a conversation.
pub fn export(
    key: &ConversationKey,
    meta: &ConversationMeta,
    messages: &[StoredMessage],
    summaries: Vec<(u64, Box<RawValue>)>,
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
    }
}
