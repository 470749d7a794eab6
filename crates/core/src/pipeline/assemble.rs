//! Assemble: the forwarded `messages`, in order: the client's instructions · the summary ·
//! what memproxy knows about the user (long-term memory, with a user id) · the recent window ·
//! the recalled older turns · the new messages.
//!
//! The order keeps the provider's prompt cache warm: a provider caches a prompt's longest exact
//! prefix, so the parts come from the most stable to the least. Instructions change when the
//! client changes them; the summary when a new one is made; memories rarely; the window only
//! grows between two jumps of its anchor (`window.rs`); recalled turns change with every
//! question, so they come last among memproxy's parts, next to the question they answer. Each
//! prompt is then the previous one's instructions, summary, memories and window, extended.
//!
//! Each part is a list of raw message objects; the later stages (summaries, recall) fill their
//! slot and nothing else changes. Instructions (system/developer messages) that came before the
//! new messages go first, as sent; those among the new messages stay in place. Tool results at
//! the start of the new messages answer the window's last tool calls, so the recalled turns
//! come after them: a tool call is never parted from its results. In a tool loop (the new
//! messages are tool results only) nothing comes after the newest tool result: the recalled
//! turns go before the user message that opened the round, found with the same query at
//! every step of the loop, so the prompt stays the same prefix from step to step.

use serde_json::value::RawValue;

pub use memproxy_base::message::SUMMARY_MARKER;
use memproxy_base::message::{Message, Role};
pub use memproxy_base::wire::{CacheHints, Part};

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
    /// One system message summarizing older history (the compression stage).
    pub summary: Option<Box<RawValue>>,
    /// One system message with the user's memories (long-term memory, `crate::longterm`).
    pub memories: Option<Box<RawValue>>,
    /// Stored messages, verbatim.
    pub window: Vec<Box<RawValue>>,
    /// One system message with the recalled older turns (the recall stage).
    pub recalled: Option<Box<RawValue>>,
    /// The request's new messages, as sent.
    pub incoming: Vec<Box<RawValue>>,
    /// How many of `incoming`, from its start, are tool results answering the window's last
    /// tool calls: the recalled turns go after them.
    pub answers: usize,
    /// Where the recalled turns go when the request continues a round (a tool loop: its new
    /// messages are tool results, no user message): before the window's message at this
    /// index, the user message that opened the round. The newest input stays the tool result,
    /// and the prompt is the same at every step of the loop. `None`: after the answers.
    pub recalled_at: Option<usize>,
    /// What the writers add for the provider's prompt cache (`wire/`).
    pub cache: CacheHints,
}

impl Prompt {
    /// The forwarded list, in order, each message with the part it belongs to.
    pub fn parts(&self) -> impl Iterator<Item = (Part, &RawValue)> {
        let answers = self.answers.min(self.incoming.len());
        // The recalled turns sit between a first and a second piece of the window and the
        // new messages: after the window and the answers, or inside the window.
        let (window, incoming) = match self.recalled_at {
            Some(at) => {
                let at = at.min(self.window.len());
                (
                    self.window.split_at(at),
                    ([].as_slice(), &self.incoming[..]),
                )
            }
            None => (
                (&self.window[..], [].as_slice()),
                self.incoming.split_at(answers),
            ),
        };
        tagged(Part::Instructions, &self.instructions)
            .chain(tagged(Part::Summary, self.summary.as_slice()))
            .chain(tagged(Part::Memories, self.memories.as_slice()))
            .chain(tagged(Part::Window, window.0))
            .chain(tagged(Part::Incoming, incoming.0))
            .chain(tagged(Part::Recalled, self.recalled.as_slice()))
            .chain(tagged(Part::Window, window.1))
            .chain(tagged(Part::Incoming, incoming.1))
    }

    /// The forwarded list, in order.
    pub fn messages(&self) -> impl Iterator<Item = &RawValue> {
        self.parts().map(|(_, m)| m)
    }
}

/// `messages`, each with `part`.
fn tagged(part: Part, messages: &[Box<RawValue>]) -> impl Iterator<Item = (Part, &RawValue)> {
    messages.iter().map(move |m| (part, &**m))
}

/// A request's messages split around the first new one ([`split_request`]).
#[derive(Debug, Default)]
pub struct Split {
    /// The client's system/developer messages before the first new one, as sent.
    pub instructions: Vec<Box<RawValue>>,
    /// Every message from the first new one on, in place.
    pub incoming: Vec<Box<RawValue>>,
    /// How many of `incoming`, from its start, are tool results.
    pub answers: usize,
}

/// Splits a request's messages around the first new one (`first_new`, an index into
/// `messages`; `messages.len()` when nothing is new): instructions before it go first; from it
/// on, every message is forwarded in place. Already-stored messages before it are dropped: the
/// window brings them back from the store.
pub fn split_request(messages: Vec<Message>, first_new: usize) -> Split {
    let mut split = Split::default();
    for (i, message) in messages.into_iter().enumerate() {
        if i >= first_new {
            if message.role == Role::Tool && split.answers == split.incoming.len() {
                split.answers += 1;
            }
            split.incoming.push(message.raw);
        } else if message.is_instruction() {
            split.instructions.push(message.raw);
        }
    }
    split
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
        let split = split_request(request, 4);
        let raw = |v: Value| RawValue::from_string(v.to_string()).unwrap();
        let prompt = Prompt {
            instructions: split.instructions,
            memories: Some(raw(json!({"role": "system", "content": "memories"}))),
            summary: Some(raw(json!({"role": "system", "content": "summary"}))),
            recalled: Some(raw(json!({"role": "system", "content": "recalled"}))),
            window: vec![raw(json!({"role": "user", "content": "w"}))],
            incoming: split.incoming,
            answers: split.answers,
            recalled_at: None,
            cache: CacheHints::default(),
        };
        assert_eq!(
            texts(prompt.messages()),
            [
                "system:s1",
                "developer:d1",
                "system:summary",
                "system:memories",
                "user:w",
                "system:recalled",
                "user:new",
                "system:in place"
            ]
        );
        let parts: Vec<Part> = prompt.parts().map(|(part, _)| part).collect();
        assert_eq!(
            parts,
            [
                Part::Instructions,
                Part::Instructions,
                Part::Summary,
                Part::Memories,
                Part::Window,
                Part::Recalled,
                Part::Incoming,
                Part::Incoming
            ]
        );
    }

    #[test]
    fn recalled_turns_come_after_the_tool_results_that_answer_the_window() {
        let request = vec![
            message(json!({"role": "user", "content": "q"})),
            message(json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})),
            message(json!({"role": "tool", "tool_call_id": "c1", "content": "r1"})),
            message(json!({"role": "tool", "tool_call_id": "c2", "content": "r2"})),
            message(json!({"role": "user", "content": "and?"})),
        ];
        let split = split_request(request, 2);
        assert_eq!(split.answers, 2);
        let raw = |v: Value| RawValue::from_string(v.to_string()).unwrap();
        let prompt = Prompt {
            window: vec![
                raw(json!({"role": "user", "content": "q"})),
                raw(json!({"role": "assistant", "content": "calls"})),
            ],
            recalled: Some(raw(json!({"role": "system", "content": "recalled"}))),
            incoming: split.incoming,
            answers: split.answers,
            ..Prompt::default()
        };
        assert_eq!(
            texts(prompt.messages()),
            [
                "user:q",
                "assistant:calls",
                "tool:r1",
                "tool:r2",
                "system:recalled",
                "user:and?"
            ]
        );
    }

    #[test]
    fn in_a_tool_loop_the_recalled_turns_go_before_the_round_and_nothing_after_the_results() {
        let raw = |v: Value| RawValue::from_string(v.to_string()).unwrap();
        let prompt = Prompt {
            window: vec![
                raw(json!({"role": "user", "content": "earlier"})),
                raw(json!({"role": "assistant", "content": "earlier reply"})),
                raw(json!({"role": "user", "content": "q"})),
                raw(json!({"role": "assistant", "content": "calls"})),
            ],
            recalled: Some(raw(json!({"role": "system", "content": "recalled"}))),
            incoming: vec![raw(
                json!({"role": "tool", "tool_call_id": "c1", "content": "r1"}),
            )],
            answers: 1,
            recalled_at: Some(2),
            ..Prompt::default()
        };
        assert_eq!(
            texts(prompt.messages()),
            [
                "user:earlier",
                "assistant:earlier reply",
                "system:recalled",
                "user:q",
                "assistant:calls",
                "tool:r1"
            ]
        );
        let parts: Vec<Part> = prompt.parts().map(|(part, _)| part).collect();
        assert_eq!(
            parts,
            [
                Part::Window,
                Part::Window,
                Part::Recalled,
                Part::Window,
                Part::Window,
                Part::Incoming
            ]
        );
    }
}
