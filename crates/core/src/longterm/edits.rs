//! Memories changed at someone's word rather than by extraction: written, corrected and
//! forgotten by an operator (the admin API and its offline CLI, `src/admin/users.rs`) or by a
//! user's agent (the memory tools, `crate::tools`). Every one of them goes through these
//! functions, so a correction is the same new version, with the old text in its history,
//! whoever made it; a memory a user asks to keep goes through extraction's own
//! [`memories::apply`] (deduplicated, superseding).
//!
//! Arguments are checked here, each error naming the field and what it accepts; the callers
//! turn an [`EditError`] into their own answer (a 400 or 404, an MCP error).
//!
//! A memory written or given a new text loses the vector of its old text in the same write;
//! with an embedding (`None`: the offline CLI, whose memories wait for `memproxy vectors
//! rebuild`) its new vector is made by the background worker; a statement to remember is
//! embedded at once, as its deduplication by meaning needs it.

use std::collections::HashMap;

use super::extract;
use super::memories::{
    self, Applied, Candidate, CandidateSource, MAX_MEMORY_CHARS, MemoryRecord, MemoryScope,
    MemorySource, MemoryType,
};
use crate::embedding::Embedding;
use memproxy_store::{OwnerKey, OwnerKind, Store, StoreError};

/// Why an edit was refused.
#[derive(Debug, thiserror::Error)]
pub enum EditError {
    /// An argument is wrong: `message` names it and says what it accepts.
    #[error("{message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    /// No memory `id` the editor may change.
    #[error("no memory {id}")]
    NotFound { id: u64 },
    /// Memory `id` is shared (its scope) and was learned from another user: only an operator
    /// changes it.
    #[error(
        "memory {id} is shared ({scope} scope) and was learned from another user: only an operator can change it"
    )]
    Shared { id: u64, scope: &'static str },
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn invalid(field: &'static str, message: String) -> EditError {
    EditError::Invalid { field, message }
}

/// A memory's text, trimmed: 1 to [`MAX_MEMORY_CHARS`] characters.
pub fn checked_text(text: &str) -> Result<String, EditError> {
    let text = text.trim();
    if text.is_empty() || text.chars().count() > MAX_MEMORY_CHARS {
        return Err(invalid(
            "text",
            format!("`text` must be 1 to {MAX_MEMORY_CHARS} characters"),
        ));
    }
    Ok(text.to_string())
}

/// A memory type by name.
pub fn checked_kind(kind: &str) -> Result<MemoryType, EditError> {
    MemoryType::parse(kind).ok_or_else(|| {
        invalid(
            "type",
            format!("`type` must be one of {}", MemoryType::ALL.join(", ")),
        )
    })
}

/// A scope by name.
pub fn checked_scope(scope: &str) -> Result<MemoryScope, EditError> {
    MemoryScope::parse(scope).ok_or_else(|| {
        invalid(
            "scope",
            "`scope` must be one of private, agent, tenant".to_string(),
        )
    })
}

/// A score from 0 to 1.
pub fn checked_unit(field: &'static str, value: Option<f64>) -> Result<Option<f64>, EditError> {
    match value {
        Some(v) if !(0.0..=1.0).contains(&v) => {
            Err(invalid(field, format!("`{field}` must be from 0 to 1")))
        }
        other => Ok(other),
    }
}

/// The fields an edit may set; `None` keeps what is there (or the default of a new memory).
#[derive(Debug, Clone, Default)]
pub struct Fields {
    pub text: Option<String>,
    pub kind: Option<String>,
    pub importance: Option<f64>,
    pub confidence: Option<f64>,
    pub tags: Option<Vec<String>>,
}

/// A memory written by an operator under `owner` (a user: private scope), source
/// `corrected_memory`; its vector made by `embedding`'s worker.
pub fn create(
    store: &Store,
    embedding: Option<&Embedding>,
    owner: &OwnerKey,
    fields: Fields,
) -> Result<MemoryRecord, EditError> {
    let text = checked_text(fields.text.as_deref().unwrap_or(""))?;
    let kind = checked_kind(fields.kind.as_deref().unwrap_or(""))?;
    let importance = checked_unit("importance", fields.importance)?.unwrap_or(0.7);
    let confidence = checked_unit("confidence", fields.confidence)?.unwrap_or(1.0);
    let now = store.clock().now_ms();
    let record = MemoryRecord {
        id: store.new_id()?,
        tenant: owner.tenant.as_str().to_string(),
        user: owner.name.clone(),
        agent: String::new(),
        kind,
        scope: MemoryScope::Private,
        text,
        excerpt: String::new(),
        importance,
        confidence,
        tags: fields.tags.unwrap_or_default(),
        source: MemorySource::CorrectedMemory,
        conversation: None,
        source_turns: Vec::new(),
        version: 1,
        history: Vec::new(),
        created_ms: now,
        updated_ms: now,
        last_accessed_ms: now,
        supersedes: Vec::new(),
        related_to: Vec::new(),
    };
    memories::write(store, owner, std::slice::from_ref(&record), &[], &[])?;
    memories::embed_later(embedding, owner, vec![record.id]);
    Ok(record)
}

/// Memory `id` of `owner`.
pub fn find(store: &Store, owner: &OwnerKey, id: u64) -> Result<MemoryRecord, EditError> {
    let Some(handle) = store.owner(owner, false)? else {
        return Err(EditError::NotFound { id });
    };
    memories::all(store, &handle)?
        .into_iter()
        .find(|m| m.id == id)
        .ok_or(EditError::NotFound { id })
}

/// Memory `id` as `user` of `agent` may change it: one of the user's own (private), or a
/// shared one (the agent's or the tenant's) learned from this user. Another user's private
/// memory is [`EditError::NotFound`], exactly as an id that does not exist; a shared memory
/// learned from someone else is [`EditError::Shared`].
pub fn find_for_user(
    store: &Store,
    user: &OwnerKey,
    agent: &str,
    id: u64,
) -> Result<(OwnerKey, MemoryRecord), EditError> {
    for owner in extract::owners(user, agent) {
        match find(store, &owner, id) {
            Ok(record) if owner.kind == OwnerKind::User || record.user == user.name => {
                return Ok((owner, record));
            }
            Ok(record) => {
                return Err(EditError::Shared {
                    id,
                    scope: record.scope.as_str(),
                });
            }
            Err(EditError::NotFound { .. }) => {}
            Err(err) => return Err(err),
        }
    }
    Err(EditError::NotFound { id })
}

/// Corrects memory `id` of `owner`: a new version (the old text kept in its history), source
/// `corrected_memory`, used from the next request on; a new text gets its vector from
/// `embedding`'s worker (the old one goes in the same write).
pub fn correct(
    store: &Store,
    embedding: Option<&Embedding>,
    owner: &OwnerKey,
    id: u64,
    fields: Fields,
) -> Result<MemoryRecord, EditError> {
    let mut record = find(store, owner, id)?;
    let old_text = record.text.clone();
    let text = match fields.text.as_deref() {
        Some(text) => checked_text(text)?,
        None => record.text.clone(),
    };
    let kind = fields.kind.as_deref().map(checked_kind).transpose()?;
    let importance = checked_unit("importance", fields.importance)?;
    let confidence = checked_unit("confidence", fields.confidence)?;
    record.revise(text, MemorySource::CorrectedMemory, store.clock().now_ms());
    if let Some(kind) = kind {
        record.kind = kind;
    }
    if let Some(v) = importance {
        record.importance = v;
    }
    if let Some(v) = confidence {
        record.confidence = v;
    }
    if let Some(tags) = fields.tags {
        record.tags = tags;
    }
    let new_text: &[u64] = if record.text == old_text { &[] } else { &[id] };
    memories::write(store, owner, std::slice::from_ref(&record), new_text, &[])?;
    memories::embed_later(embedding, owner, new_text.to_vec());
    Ok(record)
}

/// Deletes memory `id` of `owner`.
pub fn forget(store: &Store, owner: &OwnerKey, id: u64) -> Result<MemoryRecord, EditError> {
    let record = find(store, owner, id)?;
    memories::write(store, owner, &[], &[], &[id])?;
    Ok(record)
}

/// A memory a user asked to keep.
#[derive(Debug, Clone)]
pub struct Statement {
    pub text: String,
    pub kind: String,
    /// `None`: private.
    pub scope: Option<String>,
    pub importance: Option<f64>,
    pub tags: Vec<String>,
    /// Memories it replaces (their ids), as extraction's `supersedes`.
    pub supersedes: Vec<u64>,
    /// The conversation it was said in, if any.
    pub conversation: Option<String>,
}

/// How a remembered statement was kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// A new memory.
    Added,
    /// A new version of a similar memory, or of one it named in `supersedes`.
    Updated,
    /// The same memory was already there: its scores were raised.
    AlreadyKnown,
}

impl Kept {
    pub fn as_str(self) -> &'static str {
        match self {
            Kept::Added => "added",
            Kept::Updated => "updated",
            Kept::AlreadyKnown => "already_known",
        }
    }
}

/// Keeps a statement of `user` (talking to `agent`) as extraction keeps a candidate: compared
/// with the memories of the owner its scope names (by text, and by meaning with
/// `embedding`'s embedder), it supersedes, updates or is added ([`memories::apply`]); its
/// source is `explicit_user_input` (the user's own words).
pub fn remember(
    store: &Store,
    embedding: Option<&Embedding>,
    user: &OwnerKey,
    agent: &str,
    statement: Statement,
) -> Result<(Kept, MemoryRecord), EditError> {
    let text = checked_text(&statement.text)?;
    checked_kind(&statement.kind)?;
    let scope = statement.scope.as_deref().map(checked_scope).transpose()?;
    let importance = checked_unit("importance", statement.importance)?.unwrap_or(0.7);
    if statement.tags.len() > 32 {
        return Err(invalid("tags", "`tags` holds at most 32 tags".to_string()));
    }
    let candidate = Candidate {
        text,
        kind: statement.kind,
        scope: scope.map(|s| s.as_str().to_string()),
        importance,
        confidence: 1.0,
        tags: statement.tags,
        source_turns: Vec::new(),
        supersedes: statement.supersedes,
    };
    let origin = CandidateSource {
        user: user.clone(),
        agent: agent.to_string(),
        conversation: statement.conversation,
        turns: HashMap::new(),
        stated: true,
        now_ms: store.clock().now_ms(),
    };
    let mut known = extract::known(store, user, agent)?;
    let embedder = embedding.and_then(Embedding::embedder).map(|e| &**e);
    let candidates = [candidate];
    let mut meanings = extract::meanings(store, embedder, &known, &candidates)?;
    let (applied, changed) =
        memories::apply(&mut known, &candidates, &origin, &mut meanings, || {
            store.new_id()
        })?;
    let record = changed.values().flatten().next().cloned();
    memories::store_changed(store, changed, &known, &meanings, embedder.map(|e| e.id()))?;
    let kept = match applied {
        Applied { added: 1, .. } => Kept::Added,
        Applied { ignored: 1, .. } => Kept::AlreadyKnown,
        _ => Kept::Updated,
    };
    match record {
        Some(record) => Ok((kept, record)),
        // Checked above, so never refused by `apply`; said plainly if it ever is.
        None => Err(invalid("text", "the memory was refused".to_string())),
    }
}
