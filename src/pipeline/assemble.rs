//! Assemble: the forwarded `messages`, in order: the client's instructions · what memproxy
//! knows about the user (long-term memory, with a user id) · the summary · the recalled older
//! turns · the recent window · the new messages.
//!
//! Each part is a list of raw message objects; the later stages (summaries, recall) fill their
//! slot and nothing else changes. Instructions (system/developer messages) that came before the
//! new messages go first, as sent; those among the new messages stay in place.

use serde_json::value::RawValue;

use crate::message::Message;
pub use crate::message::SUMMARY_MARKER;

/// True for a system message memproxy injected (recalled turns, a summary) that a client sent
/// back: it is dropped, never stored or forwarded twice.
pub fn is_injected_echo(message: &Message) -> bool {
    message.injected
}

/// The parts of the forwarded prompt.
#[derive(Debug, Default)]
pub struct Prompt {
    /// The client's system/developer messages, as sent.
    pub instructions: Vec<Box<RawValue>>,
    /// One system message with the user's memories (long-term memory, `crate::longterm`).
    pub memories: Option<Box<RawValue>>,
    /// One system message summarizing older history (the compression stage).
    pub summary: Option<Box<RawValue>>,
    /// One system message with the recalled older turns (the recall stage).
    pub recalled: Option<Box<RawValue>>,
    /// Stored messages, verbatim.
    pub window: Vec<Box<RawValue>>,
    /// The request's new messages, as sent.
    pub incoming: Vec<Box<RawValue>>,
}

impl Prompt {
    /// The forwarded list, in order.
    pub fn messages(&self) -> impl Iterator<Item = &RawValue> {
        self.instructions
            .iter()
            .chain(&self.memories)
            .chain(&self.summary)
            .chain(&self.recalled)
            .chain(&self.window)
            .chain(&self.incoming)
            .map(|m| &**m)
    }
}

/// Splits a request's messages around the first new one (`first_new`, an index into
/// `messages`; `messages.len()` when nothing is new): instructions before it go first; from it
/// on, every message is forwarded in place. Already-stored messages before it are dropped: the
/// window brings them back from the store.
pub fn split_request(
    messages: Vec<Message>,
    first_new: usize,
) -> (Vec<Box<RawValue>>, Vec<Box<RawValue>>) {
    let mut instructions = Vec::new();
    let mut incoming = Vec::new();
    for (i, message) in messages.into_iter().enumerate() {
        if i >= first_new {
            incoming.push(message.raw);
        } else if message.role.is_instruction() {
            instructions.push(message.raw);
        }
    }
    (instructions, incoming)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn message(value: Value) -> Message {
        Message::parse(RawValue::from_string(value.to_string()).unwrap(), "m").unwrap()
    }

    fn texts<'a>(list: impl Iterator<Item = &'a RawValue>) -> Vec<String> {
        list.map(|m| {
            let v: Value = serde_json::from_str(m.get()).unwrap();
            format!(
                "{}:{}",
                v["role"].as_str().unwrap(),
                v["content"].as_str().unwrap_or("")
            )
        })
        .collect()
    }

    #[test]
    fn parts_come_in_order() {
        let request = vec![
            message(json!({"role": "system", "content": "s1"})),
            message(json!({"role": "user", "content": "old"})),
            message(json!({"role": "developer", "content": "d1"})),
            message(json!({"role": "assistant", "content": "old reply"})),
            message(json!({"role": "user", "content": "new"})),
            message(json!({"role": "system", "content": "in place"})),
        ];
        let (instructions, incoming) = split_request(request, 4);
        let raw = |v: Value| RawValue::from_string(v.to_string()).unwrap();
        let prompt = Prompt {
            instructions,
            memories: Some(raw(json!({"role": "system", "content": "memories"}))),
            summary: Some(raw(json!({"role": "system", "content": "summary"}))),
            recalled: Some(raw(json!({"role": "system", "content": "recalled"}))),
            window: vec![raw(json!({"role": "user", "content": "w"}))],
            incoming,
        };
        assert_eq!(
            texts(prompt.messages()),
            [
                "system:s1",
                "developer:d1",
                "system:memories",
                "system:summary",
                "system:recalled",
                "user:w",
                "user:new",
                "system:in place"
            ]
        );
    }
}
