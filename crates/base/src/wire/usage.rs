//! The token usage an upstream reports for one exchange, read from its answer in each API's
//! own fields, whole (JSON) or from the stream's events as they pass:
//!
//! | API | where | input | cached input | cache written |
//! |---|---|---|---|---|
//! | chat completions | `usage` (JSON; the last chunk of a stream with `stream_options.include_usage`) | `prompt_tokens` | `prompt_tokens_details.cached_tokens` | — |
//! | Responses | `usage` (JSON; `response.completed`'s `response.usage`) | `input_tokens` | `input_tokens_details.cached_tokens` | — |
//! | Anthropic Messages | `usage` (JSON; `message_start`'s `message.usage`, then `message_delta`'s `usage`) | `input_tokens` (+ the two cache fields) | `cache_read_input_tokens` | `cache_creation_input_tokens` |
//!
//! Anthropic counts `input_tokens` without the cached ones; [`Usage::input_tokens`] is always
//! the whole prompt, so the three APIs read alike.

use serde::Serialize;
use serde_json::Value;

use super::Api;

/// Tokens the upstream reported for one exchange.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// The whole prompt, cached part included.
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Of the prompt, the tokens read from the provider's prompt cache.
    pub cached_tokens: u64,
    /// Of the prompt, the tokens written to the provider's cache (Anthropic).
    pub cache_creation_tokens: u64,
}

impl Usage {
    /// The usage in a whole JSON answer of `api`, when it has one.
    pub fn from_json(api: Api, body: &[u8]) -> Option<Usage> {
        // Only `usage` is built; the rest of the answer (its output) is skipped, not copied.
        #[derive(serde::Deserialize)]
        struct Answer {
            usage: Option<Value>,
        }
        let answer: Answer = serde_json::from_slice(body).ok()?;
        Usage::from_object(api, &answer.usage?)
    }

    /// Reads a `usage` object of `api`.
    fn from_object(api: Api, usage: &Value) -> Option<Usage> {
        let number = |path: &str| usage.pointer(path).and_then(Value::as_u64).unwrap_or(0);
        if !usage.is_object() {
            return None;
        }
        Some(match api {
            Api::Chat => Usage {
                input_tokens: number("/prompt_tokens"),
                output_tokens: number("/completion_tokens"),
                cached_tokens: number("/prompt_tokens_details/cached_tokens"),
                cache_creation_tokens: 0,
            },
            Api::Responses => Usage {
                input_tokens: number("/input_tokens"),
                output_tokens: number("/output_tokens"),
                cached_tokens: number("/input_tokens_details/cached_tokens"),
                cache_creation_tokens: 0,
            },
            Api::Anthropic => {
                let read = number("/cache_read_input_tokens");
                let created = number("/cache_creation_input_tokens");
                Usage {
                    input_tokens: number("/input_tokens") + read + created,
                    output_tokens: number("/output_tokens"),
                    cached_tokens: read,
                    cache_creation_tokens: created,
                }
            }
        })
    }
}

/// What [`UsageReader`] reads of an event: a `usage` present as `null` is `Some(Null)`, as
/// `Value::get` would give it.
#[derive(serde::Deserialize)]
struct UsageEvent {
    #[serde(rename = "type")]
    kind: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    usage: Option<Value>,
    response: Option<Holder>,
    message: Option<Holder>,
}

#[derive(serde::Deserialize)]
struct Holder {
    #[serde(default, deserialize_with = "present")]
    usage: Option<Value>,
}

/// A field that is there, `null` included.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    <Value as serde::Deserialize>::deserialize(d).map(Some)
}

/// Reads the usage of a stream from its events' data as they pass. Only events that mention
/// `usage` are parsed a second time, and only for their type and usage, so a long stream of
/// deltas costs a substring search each.
#[derive(Debug)]
pub struct UsageReader {
    api: Api,
    usage: Option<Usage>,
}

impl UsageReader {
    pub fn new(api: Api) -> UsageReader {
        UsageReader { api, usage: None }
    }

    /// Takes the data of one SSE event.
    pub fn on_event(&mut self, data: &str) {
        if !data.contains("\"usage\"") {
            return;
        }
        // Only the event's type and its `usage` objects are built; the rest (Responses'
        // `response.completed` carries the whole answer) is skipped, not copied.
        let Ok(event) = serde_json::from_str::<UsageEvent>(data) else {
            return;
        };
        match self.api {
            Api::Chat => {
                if let Some(usage) = event.usage.filter(|u| !u.is_null()) {
                    self.usage = Usage::from_object(Api::Chat, &usage);
                }
            }
            Api::Responses => {
                if event.kind.as_ref().and_then(Value::as_str) == Some("response.completed")
                    && let Some(usage) = event.response.and_then(|r| r.usage)
                {
                    self.usage = Usage::from_object(Api::Responses, &usage);
                }
            }
            // `message_start` has the input side; `message_delta` the output tokens so far
            // (and, from some models, the input side again).
            Api::Anthropic => match event.kind.as_ref().and_then(Value::as_str) {
                Some("message_start") => {
                    if let Some(usage) = event.message.and_then(|m| m.usage) {
                        self.usage = Usage::from_object(Api::Anthropic, &usage);
                    }
                }
                Some("message_delta") => {
                    if let Some(delta) = event.usage {
                        let mut usage = self.usage.unwrap_or_default();
                        if let Some(out) = delta.get("output_tokens").and_then(Value::as_u64) {
                            usage.output_tokens = out;
                        }
                        if delta.get("input_tokens").and_then(Value::as_u64).is_some()
                            && let Some(again) = Usage::from_object(Api::Anthropic, &delta)
                        {
                            usage.input_tokens = again.input_tokens;
                            usage.cached_tokens = again.cached_tokens;
                            usage.cache_creation_tokens = again.cache_creation_tokens;
                        }
                        self.usage = Some(usage);
                    }
                }
                _ => {}
            },
        }
    }

    /// The usage read so far (the stream's final usage once it ended).
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_answers_give_their_cached_tokens_in_each_api() {
        let chat = json!({"usage": {"prompt_tokens": 2000, "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 1920}}});
        let usage = Usage::from_json(Api::Chat, chat.to_string().as_bytes()).unwrap();
        assert_eq!((usage.input_tokens, usage.cached_tokens), (2000, 1920));
        let responses = json!({"usage": {"input_tokens": 1500, "output_tokens": 9,
            "input_tokens_details": {"cached_tokens": 1024}}});
        let usage = Usage::from_json(Api::Responses, responses.to_string().as_bytes()).unwrap();
        assert_eq!((usage.input_tokens, usage.cached_tokens), (1500, 1024));
        let anthropic = json!({"usage": {"input_tokens": 10, "output_tokens": 3,
            "cache_read_input_tokens": 900, "cache_creation_input_tokens": 90}});
        let usage = Usage::from_json(Api::Anthropic, anthropic.to_string().as_bytes()).unwrap();
        assert_eq!(
            usage,
            Usage {
                input_tokens: 1000,
                output_tokens: 3,
                cached_tokens: 900,
                cache_creation_tokens: 90
            }
        );
        assert_eq!(Usage::from_json(Api::Chat, b"{}"), None);
        assert_eq!(Usage::from_json(Api::Chat, b"not json"), None);
    }

    #[test]
    fn streams_give_their_usage_at_the_end() {
        let mut chat = UsageReader::new(Api::Chat);
        chat.on_event(r#"{"choices":[{"delta":{"content":"hi"}}],"usage":null}"#);
        assert_eq!(chat.usage(), None);
        chat.on_event(r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":3}}}"#);
        chat.on_event("[DONE]");
        assert_eq!(chat.usage().unwrap().cached_tokens, 3);

        let mut responses = UsageReader::new(Api::Responses);
        responses.on_event(r#"{"type":"response.created","response":{"usage":null}}"#);
        responses.on_event(r#"{"type":"response.completed","response":{"usage":{"input_tokens":8,"output_tokens":2,"input_tokens_details":{"cached_tokens":4}}}}"#);
        let usage = responses.usage().unwrap();
        assert_eq!((usage.input_tokens, usage.cached_tokens), (8, 4));

        let mut anthropic = UsageReader::new(Api::Anthropic);
        anthropic.on_event(r#"{"type":"message_start","message":{"usage":{"input_tokens":5,"output_tokens":0,"cache_read_input_tokens":6,"cache_creation_input_tokens":1}}}"#);
        anthropic.on_event(r#"{"type":"message_delta","delta":{},"usage":{"output_tokens":4}}"#);
        assert_eq!(
            anthropic.usage().unwrap(),
            Usage {
                input_tokens: 12,
                output_tokens: 4,
                cached_tokens: 6,
                cache_creation_tokens: 1
            }
        );
    }
}
