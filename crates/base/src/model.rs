//! Model calls made by memproxy itself (summaries today; memory extraction next), seen from the
//! memory core: a request in, a reply out, nothing of HTTP. The upstream client implements
//! [`ModelCall`] over the one forward path; tests implement it with a closure.

use std::future::Future;
use std::pin::Pin;

/// Credentials of the request that triggered a call, held in memory only for the call, as
/// (header name, value) pairs. Never printed: `Debug` shows only the header names.
#[derive(Clone, Default)]
pub struct Credentials(Vec<(String, String)>);

impl Credentials {
    pub fn new(pairs: Vec<(String, String)>) -> Credentials {
        Credentials(pairs)
    }

    pub fn pairs(&self) -> &[(String, String)] {
        &self.0
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(name, _)| name))
            .finish()
    }
}

/// One message of a model call.
#[derive(Debug, Clone)]
pub struct ModelMessage {
    pub role: &'static str,
    pub content: String,
}

/// A chat completion memproxy asks for.
#[derive(Debug, Clone)]
pub struct ModelRequest {
    pub model: String,
    pub messages: Vec<ModelMessage>,
    /// What the call is for (`summary`), sent upstream as `x-memproxy-task`.
    pub task: &'static str,
    pub credentials: Credentials,
    /// The request's `response_format` (structured output), when the call needs one.
    pub response_format: Option<serde_json::Value>,
}

impl ModelRequest {
    /// A call with one user message.
    pub fn prompt(
        model: impl Into<String>,
        task: &'static str,
        prompt: String,
        credentials: Credentials,
    ) -> ModelRequest {
        ModelRequest {
            model: model.into(),
            messages: vec![ModelMessage {
                role: "user",
                content: prompt,
            }],
            task,
            credentials,
            response_format: None,
        }
    }

    /// The request's messages counted with the model's tokenizer: what the ledger counts
    /// when the answer reports no usage.
    pub fn counted_tokens(&self) -> u64 {
        self.messages
            .iter()
            .map(|m| u64::from(crate::tokens::count_message(Some(&self.model), &m.content)))
            .sum()
    }
}

/// The model's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelReply {
    pub text: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl ModelReply {
    /// The tokens the call spent: the upstream's usage, or, when the answer has none, the
    /// request's tokens (`counted`, called only then) and the reply counted with the
    /// tokenizer of `model`.
    pub fn spent_tokens(&self, model: Option<&str>, counted: impl FnOnce() -> u64) -> u64 {
        if self.prompt_tokens + self.completion_tokens > 0 {
            self.prompt_tokens + self.completion_tokens
        } else {
            counted() + u64::from(crate::tokens::count_text(model, &self.text))
        }
    }
}

/// Why a model call failed. Never carries message text or credentials.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("the model could not be reached: {0}")]
    Unreachable(String),
    #[error("the model answered {0}")]
    Status(u16),
    #[error("the model's answer is unusable: {0}")]
    BadAnswer(&'static str),
}

/// The future a [`ModelCall`] returns.
pub type ModelFuture<'a> =
    Pin<Box<dyn Future<Output = Result<ModelReply, ModelError>> + Send + 'a>>;

/// Something that answers chat completions.
pub trait ModelCall: Send + Sync + 'static {
    fn complete(&self, request: ModelRequest) -> ModelFuture<'_>;
}
