//! A receipt as the admin API shows it (`GET /admin/v1/receipts/{id}`): the forwarded body
//! and its digest, each part of the prompt with its messages and token count (counted now,
//! with the request's model's tokenizer), what the budget dropped, the settings, and how the
//! exchange went.

use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::{Outcome, Receipt};
use crate::message::Message;
use crate::tokens;

/// The receipt as JSON.
pub fn to_json(receipt: &Receipt) -> Value {
    let model = receipt.model.as_deref();
    let planned = &receipt.planned;
    let prompt = &planned.prompt;
    let part = |messages: &[&RawValue]| {
        let tokens: u64 = messages.iter().map(|m| count(model, m)).sum();
        json!({
            "messages": messages.iter().map(|m| value(m)).collect::<Vec<_>>(),
            "tokens": tokens,
        })
    };
    let one = |message: &Option<Box<RawValue>>| message.as_deref().map(|m| part(&[m]));

    let instructions: Vec<&RawValue> = prompt.instructions.iter().map(|m| &**m).collect();
    let window: Vec<&RawValue> = prompt.window.iter().map(|m| &**m).collect();
    let incoming: Vec<&RawValue> = prompt.incoming.iter().map(|m| &**m).collect();

    let summary = one(&prompt.summary).map(|mut part| {
        if let Some(record) = &planned.summary {
            part["number"] = json!(record.number);
            part["covers"] = json!({"from_turn": record.from_turn, "to_turn": record.to_turn});
            part["heuristic"] = json!(record.heuristic);
            part["summary_tokens"] = json!(record.tokens);
        }
        part
    });
    let memories = one(&prompt.memories).map(|mut part| {
        part["items"] = planned
            .memories
            .iter()
            .map(|(id, score, decay)| json!({"id": id, "score": score, "decay": decay}))
            .collect();
        part
    });
    let recalled = one(&prompt.recalled).map(|mut part| {
        part["turns"] = planned.recalled.iter().map(score_json).collect();
        part["elsewhere"] = planned
            .recalled_elsewhere
            .iter()
            .map(|(conversation, turn, score)| {
                json!({"conversation": conversation, "turn": turn, "score": score})
            })
            .collect();
        part["excerpted"] = json!(planned.excerpted);
        part
    });

    let dropped = &planned.dropped;
    let mut settings = Map::new();
    for (name, text) in receipt.settings.describe() {
        settings.insert(name.to_string(), json!(text));
    }
    if let Some(step) = planned.window_step {
        settings.insert("window_step_in_effect".to_string(), json!(step));
    }
    json!({
        "id": receipt.id,
        "created_ms": receipt.created_ms,
        "tenant": receipt.key.tenant.as_str(),
        "agent": receipt.key.agent,
        "conversation": receipt.key.conversation,
        "api": receipt.api.as_str(),
        "path": receipt.api_path,
        "model": receipt.model,
        "forwarded": {
            "body": String::from_utf8_lossy(&receipt.body),
            "bytes": receipt.body.len(),
            "sha256": receipt.sha256(),
        },
        "prompt": {
            "instructions": part(&instructions),
            "summary": summary,
            "memories": memories,
            "window": part(&window),
            "recalled": recalled,
            "new": part(&incoming),
            "tokens": planned.prompt_tokens,
        },
        "recall": {
            "mode": planned.recall_mode.header(),
            "floor": receipt.settings.fusion().floor,
            "lexical_weight": receipt.settings.fusion().lexical_weight,
            "under_floor": planned.under_floor.iter().map(score_json).collect::<Vec<_>>(),
        },
        "history_tokens": planned.history_tokens,
        "stored_messages": planned.stored_count,
        "budget": {
            "verdict": planned.budget.map(|f| f.verdict()),
            "truncated": planned.budget.is_some_and(|f| f.truncated),
            "dropped": {
                "recalled": dropped.recalled.iter().map(|(conversation, turn, score)| {
                    json!({"conversation": conversation, "turn": turn, "score": score})
                }).collect::<Vec<_>>(),
                "window_turns": dropped.window,
            },
        },
        "settings": settings,
        "upstream": outcome(&receipt.outcome_now()),
    })
}

/// A recalled turn's scores: fused, words, meaning (`null`: no vector took part), and whether
/// it is of the period the question names.
fn score_json(score: &super::RecallScore) -> Value {
    json!({
        "turn": score.turn,
        "score": score.score,
        "lexical": score.lexical,
        "semantic": score.semantic,
        "when": score.when,
    })
}

/// A receipt in a conversation's list: what it is and its figures, without the body.
pub fn brief(receipt: &Receipt) -> Value {
    let outcome = receipt.outcome_now();
    json!({
        "id": receipt.id,
        "created_ms": receipt.created_ms,
        "api": receipt.api.as_str(),
        "model": receipt.model,
        "prompt_tokens": receipt.planned.prompt_tokens,
        "history_tokens": receipt.planned.history_tokens,
        "stored_messages": receipt.planned.stored_count,
        "cached_tokens": outcome.usage.as_ref().map(|usage| usage.cached_tokens),
        "status": outcome.status,
        "ended": outcome.ended,
        "memory_status": outcome.memory_status,
    })
}

fn outcome(outcome: &Outcome) -> Value {
    json!({
        "status": outcome.status,
        "latency_ms": outcome.upstream_latency.map(|d| d.as_secs_f64() * 1000.0),
        "total_ms": outcome.total.map(|d| d.as_secs_f64() * 1000.0),
        "stream": outcome.stream,
        "ended": outcome.ended,
        "usage": outcome.usage,
        "memory_status": outcome.memory_status,
        "memory_reason": outcome.memory_reason,
    })
}

fn value(raw: &RawValue) -> Value {
    serde_json::from_str(raw.get()).unwrap_or(Value::Null)
}

/// A message's tokens as the plan counts them (text plus the per-message overhead).
fn count(model: Option<&str>, raw: &RawValue) -> u64 {
    let text =
        Message::parse(raw.to_owned(), "receipt").map_or_else(|_| String::new(), |m| m.text());
    u64::from(tokens::count_message(model, &text))
}
