//! memproxy's own model calls (summaries, memory extraction) sent to the family the model
//! belongs to: a model whose name starts with one of `[upstream.anthropic] model_prefixes`
//! is called with the Anthropic Messages API on the Anthropic upstream, every other one with
//! chat completions on `[upstream]`. Both go through the one forward path.
//!
//! Structured output (a `response_format` of type `json_schema`, the memory extraction's
//! contract) has no `response_format` in the Messages API: there it is a forced tool call,
//! the tool named as the schema with the schema as its `input_schema` and `tool_choice`
//! `{"type": "tool", "name": ...}`; the `tool_use` block's `input` is the answer, read as the
//! same JSON.

use http::header::{HeaderMap, HeaderValue};
use serde_json::{Value, json};

use crate::config::UpstreamConfig;
use crate::model::{ModelCall, ModelError, ModelFuture, ModelReply, ModelRequest};
use crate::upstream::Upstream;

/// The most tokens an Anthropic call of memproxy's may answer with (the API requires a bound;
/// summaries are cut to `compression.max_summary_tokens` afterwards).
const ANTHROPIC_MAX_TOKENS: u32 = 4096;

/// The model-call implementation memory uses: one upstream per family.
#[derive(Debug)]
pub struct Models {
    openai: Upstream,
    anthropic: Upstream,
    prefixes: Vec<String>,
    version: HeaderValue,
}

impl Models {
    pub fn new(openai: Upstream, anthropic: Upstream, config: &UpstreamConfig) -> Models {
        Models {
            openai,
            anthropic,
            prefixes: config.anthropic.model_prefixes.clone(),
            version: HeaderValue::try_from(config.anthropic.version.as_str()).unwrap_or_else(
                |_| HeaderValue::from_static(crate::config::DEFAULT_ANTHROPIC_VERSION),
            ),
        }
    }

    /// True when `model` is called on the Anthropic upstream.
    pub fn is_anthropic(&self, model: &str) -> bool {
        self.prefixes.iter().any(|p| model.starts_with(p.as_str()))
    }
}

impl ModelCall for Models {
    fn complete(&self, request: ModelRequest) -> ModelFuture<'_> {
        if self.is_anthropic(&request.model) {
            Box::pin(anthropic_complete(&self.anthropic, &self.version, request))
        } else {
            ModelCall::complete(&self.openai, request)
        }
    }
}

/// The Messages API request body of a model call: system messages into `system`.
fn anthropic_body(call: &ModelRequest) -> String {
    let system: Vec<&str> = call
        .messages
        .iter()
        .filter(|m| m.role == "system" || m.role == "developer")
        .map(|m| m.content.as_str())
        .collect();
    let messages: Vec<Value> = call
        .messages
        .iter()
        .filter(|m| m.role != "system" && m.role != "developer")
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    let mut body =
        json!({"model": call.model, "max_tokens": ANTHROPIC_MAX_TOKENS, "messages": messages});
    if !system.is_empty() {
        body["system"] = Value::String(system.join("\n\n"));
    }
    if let Some((name, schema)) = forced_tool(call) {
        body["tools"] = json!([{
            "name": name,
            "description": "Record the answer in this schema.",
            "input_schema": schema,
        }]);
        body["tool_choice"] = json!({"type": "tool", "name": name});
    }
    body.to_string()
}

/// The tool a call's `json_schema` response format becomes in the Messages API: its name and
/// input schema.
fn forced_tool(call: &ModelRequest) -> Option<(&str, &Value)> {
    let format = call.response_format.as_ref()?;
    if format.get("type")?.as_str()? != "json_schema" {
        return None;
    }
    let schema = format.get("json_schema")?;
    Some((schema.get("name")?.as_str()?, schema.get("schema")?))
}

/// The text and usage of a Messages API answer; with `tool`, the `input` of that forced
/// tool's `tool_use` block, as JSON text.
fn anthropic_reply(body: &[u8], tool: Option<&str>) -> Result<ModelReply, ModelError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|_| ModelError::BadAnswer("not JSON"))?;
    let blocks = value
        .get("content")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let text = match tool {
        Some(tool) => blocks
            .iter()
            .find(|b| b["type"] == "tool_use" && b["name"] == tool)
            .and_then(|b| b.get("input"))
            .filter(|input| input.is_object())
            .map(Value::to_string)
            .ok_or(ModelError::BadAnswer(
                "no tool_use of the structured output",
            ))?,
        None => blocks
            .iter()
            .filter(|b| b["type"] == "text")
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("")
            .trim()
            .to_string(),
    };
    if text.is_empty() {
        return Err(ModelError::BadAnswer("no text"));
    }
    let usage = |field: &str| {
        value
            .pointer(&format!("/usage/{field}"))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    Ok(ModelReply {
        text,
        prompt_tokens: usage("input_tokens"),
        completion_tokens: usage("output_tokens"),
    })
}

/// One Messages API call for memproxy itself, over [`Upstream::model_post`].
async fn anthropic_complete(
    upstream: &Upstream,
    version: &HeaderValue,
    call: ModelRequest,
) -> Result<ModelReply, ModelError> {
    let body = anthropic_body(&call);
    let mut headers = HeaderMap::new();
    // The client's own `anthropic-version`, when its credentials carry one, wins.
    headers.insert("anthropic-version", version.clone());
    let body = upstream
        .model_post("/v1/messages", &call.credentials, headers, body, call.task)
        .await?;
    anthropic_reply(&body, forced_tool(&call).map(|(name, _)| name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Credentials, ModelMessage};

    #[test]
    fn system_goes_top_level_and_the_reply_is_the_text() {
        let call = ModelRequest {
            model: "claude-x".into(),
            messages: vec![
                ModelMessage {
                    role: "system",
                    content: "be brief".into(),
                },
                ModelMessage {
                    role: "user",
                    content: "sum up".into(),
                },
            ],
            task: "summary",
            credentials: Credentials::default(),
            response_format: None,
        };
        let body: Value = serde_json::from_str(&anthropic_body(&call)).unwrap();
        assert_eq!(body["system"], "be brief");
        assert_eq!(
            body["messages"],
            json!([{"role": "user", "content": "sum up"}])
        );
        assert!(body.get("tools").is_none());
        let reply = anthropic_reply(
            br#"{"content":[{"type":"thinking","thinking":"x"},{"type":"text","text":" ok "}],"usage":{"input_tokens":3,"output_tokens":1}}"#,
            None,
        )
        .unwrap();
        assert_eq!(reply.text, "ok");
        assert_eq!(reply.prompt_tokens, 3);
        assert!(anthropic_reply(br#"{"content":[]}"#, None).is_err());
    }

    #[test]
    fn a_json_schema_response_format_is_a_forced_tool_call() {
        let schema = json!({"type": "object", "properties": {"memories": {"type": "array"}}});
        let call = ModelRequest {
            model: "claude-x".into(),
            messages: vec![ModelMessage {
                role: "user",
                content: "extract".into(),
            }],
            task: "extraction",
            credentials: Credentials::default(),
            response_format: Some(json!({"type": "json_schema",
                "json_schema": {"name": "memproxy_memories", "strict": true, "schema": schema}})),
        };
        let body: Value = serde_json::from_str(&anthropic_body(&call)).unwrap();
        assert_eq!(body["tools"][0]["name"], "memproxy_memories");
        assert_eq!(body["tools"][0]["input_schema"], schema);
        assert_eq!(
            body["tool_choice"],
            json!({"type": "tool", "name": "memproxy_memories"})
        );
        assert!(body.get("response_format").is_none());
        let answer = br#"{"content":[{"type":"tool_use","id":"t","name":"memproxy_memories","input":{"memories":[]}}]}"#;
        let reply = anthropic_reply(answer, Some("memproxy_memories")).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&reply.text).unwrap(),
            json!({"memories": []})
        );
        // A text answer, or another tool, is not the structured output.
        for bad in [
            &br#"{"content":[{"type":"text","text":"{"memories":[]}"}]}"#[..],
            br#"{"content":[{"type":"tool_use","id":"t","name":"other","input":{}}]}"#,
        ] {
            assert!(anthropic_reply(bad, Some("memproxy_memories")).is_err());
        }
    }
}
