//! The tools' calls: each argument read and checked (an error names it), the caller's user
//! settled, then the memory core called on the blocking pool (store reads and writes are
//! synchronous) and its answer returned as JSON, both as the result's structured content and
//! as its text.
//!
//! Errors are MCP errors: a bad or refused argument (a missing or malformed one, an unknown
//! one, another user, a memory or conversation the caller has not) is `-32602` (invalid
//! params) whose message names the argument and whose `data` is `{"argument": NAME}`; a
//! memory that cannot be read is `-32603`, logged without any text or id.

use std::sync::Arc;

use rmcp::ErrorData;
use rmcp::model::{CallToolResult, ContentBlock, JsonObject};
use serde_json::{Value, json};

use super::Caller;
use super::catalog::{
    CONVERSATION_RECALL, DEFAULT_LIMIT, MAX_LIMIT, MEMORY_CORRECT, MEMORY_FORGET, MEMORY_REMEMBER,
    MEMORY_SEARCH,
};
use crate::identity::{ConversationKey, is_valid_id};
use crate::longterm::edits::{self, EditError, Fields, Statement};
use crate::memory::Memory;
use crate::store::{OwnerKey, StoreError};

/// Why a call failed.
#[derive(Debug)]
pub(super) enum CallError {
    /// An argument is wrong or refused: its name and why.
    Argument { name: &'static str, message: String },
    /// Long-term memory is off for the caller's agent.
    Off,
    /// The store failed.
    Store(StoreError),
}

fn argument(name: &'static str, message: impl Into<String>) -> CallError {
    CallError::Argument {
        name,
        message: message.into(),
    }
}

impl From<StoreError> for CallError {
    fn from(err: StoreError) -> CallError {
        CallError::Store(err)
    }
}

impl From<EditError> for CallError {
    fn from(err: EditError) -> CallError {
        match err {
            EditError::Invalid { field, message } => argument(field, message),
            EditError::NotFound { id } => argument("id", format!("no memory {id} of this user")),
            EditError::Shared { .. } => argument("id", err.to_string()),
            EditError::Store(err) => CallError::Store(err),
        }
    }
}

/// What a call answers when memory cannot be read.
pub(super) fn unavailable() -> ErrorData {
    ErrorData::internal_error("memory is unavailable; retry later", None)
}

impl From<CallError> for ErrorData {
    fn from(err: CallError) -> ErrorData {
        match err {
            CallError::Argument { name, message } => {
                ErrorData::invalid_params(message, Some(json!({"argument": name})))
            }
            CallError::Off => ErrorData::invalid_request(
                "long-term memory is off for this agent (long_term_enabled = false)",
                None,
            ),
            CallError::Store(err) => {
                // The store's errors name no message text; they may name a path.
                tracing::warn!(error = %err, "a memory tool failed to read or write memory");
                unavailable()
            }
        }
    }
}

/// A call's arguments, taken one by one; what is left at the end is unknown.
struct Arguments(JsonObject);

impl Arguments {
    fn take(&mut self, name: &'static str) -> Option<Value> {
        self.0.remove(name).filter(|v| !v.is_null())
    }

    fn text(&mut self, name: &'static str) -> Result<Option<String>, CallError> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::String(s)) if !s.trim().is_empty() => Ok(Some(s)),
            Some(_) => Err(argument(
                name,
                format!("`{name}` must be a non-empty string"),
            )),
        }
    }

    fn required_text(&mut self, name: &'static str) -> Result<String, CallError> {
        self.text(name)?
            .ok_or_else(|| argument(name, format!("`{name}` is required")))
    }

    fn number(&mut self, name: &'static str) -> Result<Option<f64>, CallError> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(_) => Err(argument(name, format!("`{name}` must be a number"))),
        }
    }

    fn id(&mut self, name: &'static str) -> Result<Option<u64>, CallError> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(_) => Err(argument(
                name,
                format!("`{name}` must be a whole number ≥ 0"),
            )),
        }
    }

    fn required_id(&mut self, name: &'static str) -> Result<u64, CallError> {
        self.id(name)?
            .ok_or_else(|| argument(name, format!("`{name}` is required")))
    }

    fn limit(&mut self) -> Result<usize, CallError> {
        match self.id("limit")? {
            None => Ok(DEFAULT_LIMIT as usize),
            Some(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n as usize),
            Some(_) => Err(argument(
                "limit",
                format!("`limit` must be 1 to {MAX_LIMIT}"),
            )),
        }
    }

    fn list<T>(
        &mut self,
        name: &'static str,
        item: impl Fn(&Value) -> Option<T>,
        expected: &str,
    ) -> Result<Option<Vec<T>>, CallError> {
        let Some(value) = self.take(name) else {
            return Ok(None);
        };
        let items = value.as_array().and_then(|a| a.iter().map(&item).collect());
        items
            .map(Some)
            .ok_or_else(|| argument(name, format!("`{name}` must be an array of {expected}")))
    }

    fn tags(&mut self) -> Result<Option<Vec<String>>, CallError> {
        self.list("tags", |v| v.as_str().map(str::to_string), "strings")
    }

    /// Refuses whatever argument was not taken.
    fn done(self) -> Result<(), CallError> {
        match self.0.keys().next() {
            Some(unknown) => Err(CallError::Argument {
                name: "arguments",
                message: format!("unknown argument `{unknown}`"),
            }),
            None => Ok(()),
        }
    }
}

/// The user a call is for: the transport's, which a `user` argument must not contradict, or
/// the `user` argument where the transport names none.
fn user_of(caller: &Caller, arguments: &mut Arguments) -> Result<OwnerKey, CallError> {
    let named = arguments.text("user")?;
    let user = match (&caller.user, named) {
        (Some(own), Some(named)) if *own != named => {
            return Err(argument(
                "user",
                "`user` names another user than the caller's (X-Memory-User-Id): a caller reaches only its own user's memory",
            ));
        }
        (Some(own), _) => own.clone(),
        (None, Some(named)) => named,
        (None, None) => {
            return Err(argument(
                "user",
                "`user` is required: name the user with the X-Memory-User-Id header or this argument",
            ));
        }
    };
    if !is_valid_id(&user) {
        return Err(argument(
            "user",
            "`user` must be 1-128 characters from A-Za-z0-9._:@-",
        ));
    }
    if !caller.settings.long_term_enabled {
        return Err(CallError::Off);
    }
    Ok(OwnerKey::user(&caller.tenant, &user))
}

/// Calls tool `name` for `caller` with `arguments`.
pub(super) async fn call(
    memory: Arc<Memory>,
    caller: Caller,
    name: &str,
    arguments: JsonObject,
) -> Result<CallToolResult, ErrorData> {
    let run: fn(&Memory, &Caller, Arguments) -> Result<Value, CallError> = match name {
        MEMORY_SEARCH => search,
        MEMORY_REMEMBER => remember,
        MEMORY_CORRECT => correct,
        MEMORY_FORGET => forget,
        CONVERSATION_RECALL => recall,
        _ => {
            return Err(ErrorData::invalid_params(
                format!("unknown tool `{name}`"),
                Some(json!({"argument": "name"})),
            ));
        }
    };
    let answer = tokio::task::spawn_blocking(move || run(&memory, &caller, Arguments(arguments)))
        .await
        .map_err(|_| ErrorData::internal_error("the tool call failed", None))??;
    let mut result = CallToolResult::success(vec![ContentBlock::text(answer.to_string())]);
    result.structured_content = Some(answer);
    Ok(result)
}

fn search(memory: &Memory, caller: &Caller, mut arguments: Arguments) -> Result<Value, CallError> {
    let query = arguments.required_text("query")?;
    let limit = arguments.limit()?;
    let user = user_of(caller, &mut arguments)?;
    arguments.done()?;
    let found = crate::tools::search(
        memory,
        &user,
        &caller.agent,
        &caller.settings,
        &query,
        limit,
    )?;
    Ok(json!({"user": user.name, "query": query, "memories": found.memories, "turns": found.turns}))
}

fn remember(
    memory: &Memory,
    caller: &Caller,
    mut arguments: Arguments,
) -> Result<Value, CallError> {
    let statement = Statement {
        text: arguments.required_text("text")?,
        kind: arguments.required_text("type")?,
        scope: arguments.text("scope")?,
        importance: arguments.number("importance")?,
        tags: arguments.tags()?.unwrap_or_default(),
        supersedes: arguments
            .list("supersedes", Value::as_u64, "memory ids")?
            .unwrap_or_default(),
        conversation: None,
    };
    let user = user_of(caller, &mut arguments)?;
    arguments.done()?;
    let (kept, record) = edits::remember(
        &memory.store,
        Some(&memory.embedding),
        &user,
        &caller.agent,
        statement,
    )?;
    Ok(json!({"kept": kept.as_str(), "memory": record}))
}

fn correct(memory: &Memory, caller: &Caller, mut arguments: Arguments) -> Result<Value, CallError> {
    let id = arguments.required_id("id")?;
    let fields = Fields {
        text: arguments.text("text")?,
        kind: arguments.text("type")?,
        importance: arguments.number("importance")?,
        confidence: None,
        tags: arguments.tags()?,
    };
    let user = user_of(caller, &mut arguments)?;
    arguments.done()?;
    if fields.text.is_none()
        && fields.kind.is_none()
        && fields.importance.is_none()
        && fields.tags.is_none()
    {
        return Err(argument(
            "text",
            "give at least one of `text`, `type`, `importance`, `tags`",
        ));
    }
    let (owner, _) = edits::find_for_user(&memory.store, &user, &caller.agent, id)?;
    let record = edits::correct(&memory.store, Some(&memory.embedding), &owner, id, fields)?;
    Ok(json!({"memory": record}))
}

fn forget(memory: &Memory, caller: &Caller, mut arguments: Arguments) -> Result<Value, CallError> {
    let id = arguments.required_id("id")?;
    let user = user_of(caller, &mut arguments)?;
    arguments.done()?;
    let (owner, _) = edits::find_for_user(&memory.store, &user, &caller.agent, id)?;
    edits::forget(&memory.store, &owner, id)?;
    Ok(json!({"forgotten": id}))
}

fn recall(memory: &Memory, caller: &Caller, mut arguments: Arguments) -> Result<Value, CallError> {
    let conversation = arguments.required_text("conversation")?;
    let query = arguments.required_text("query")?;
    let agent = arguments
        .text("agent")?
        .unwrap_or_else(|| caller.agent.clone());
    let limit = arguments.limit()?;
    // A user is optional here: without one, any conversation of the tenant (as a chat request
    // naming it reads it); with one, only the user's own.
    let user = match (&caller.user, arguments.0.contains_key("user")) {
        (None, false) => None,
        _ => Some(user_of(caller, &mut arguments)?),
    };
    arguments.done()?;
    for (name, id) in [("conversation", &conversation), ("agent", &agent)] {
        if !is_valid_id(id) {
            return Err(argument(
                name,
                format!("`{name}` must be 1-128 characters from A-Za-z0-9._:@-"),
            ));
        }
    }
    let key = ConversationKey {
        tenant: caller.tenant.clone(),
        agent,
        conversation,
    };
    let turns = crate::tools::recall_conversation(
        memory,
        &key,
        user.as_ref(),
        &caller.settings,
        &query,
        limit,
    )?
    .ok_or_else(|| {
        argument(
            "conversation",
            format!(
                "no conversation `{}` of agent `{}`{}",
                key.conversation,
                key.agent,
                if user.is_some() { " of this user" } else { "" }
            ),
        )
    })?;
    Ok(
        json!({"conversation": key.conversation, "agent": key.agent, "query": query, "turns": turns}),
    )
}
