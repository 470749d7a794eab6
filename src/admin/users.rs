//! The admin API's users (long-term memory, `crate::longterm`): a user's memories listed,
//! searched, shown, created, corrected and deleted by hand, and a user deleted entirely.
//!
//! - `GET /admin/v1/users/{tenant}/{user}/memories[?q=text]` — the user's memories (private
//!   scope), each with its decay now; `?q=` (form-encoded) ranks them as a prompt would and
//!   returns the scores;
//! - `POST …/memories` — a memory written by hand (`{"text", "type", "importance"?, "tags"?}`,
//!   source `corrected_memory`);
//! - `GET | PATCH | DELETE …/memories/{id}` — one memory; `PATCH {"text"?, "type"?,
//!   "importance"?, "confidence"?, "tags"?}` makes a new version (the old text in its history,
//!   source `corrected_memory`), used from the next request;
//! - `DELETE /admin/v1/users/{tenant}/{user}` — every conversation of the user, their archive
//!   and memories, with the erasure of a conversation delete;
//! - `GET /admin/v1/users/{tenant}/{user}/export` — the user's memories (with their history)
//!   and archive (layer 1: every archived turn of their conversations), as one JSON document;
//! - `POST /admin/v1/users/{tenant}/{user}/import[?force_tenant=true]` — an export added to a
//!   user (idempotent: a memory with the same type and text, or an archived conversation the
//!   user already has, is skipped; memory ids are new ones, references among them follow).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::ops::AdminError;
use crate::embedding::Embedding;
use crate::identity::TenantId;
use crate::longterm::archive::{self, ArchivedTurn};
use crate::longterm::edits::{self, EditError, Fields};
use crate::longterm::memories::{self, MemoryRecord};
use crate::memory::Memory;
use crate::store::{OwnerHandle, OwnerKey, Store};

fn owner_handle(
    store: &Store,
    owner: &OwnerKey,
    create: bool,
) -> Result<Option<OwnerHandle>, AdminError> {
    Ok(store.owner(owner, create)?)
}

fn user_missing(user: &str) -> AdminError {
    AdminError::NotFound(format!("no memories of user {user}"))
}

fn all(store: &Store, owner: &OwnerKey) -> Result<Vec<MemoryRecord>, AdminError> {
    match owner_handle(store, owner, false)? {
        Some(handle) => Ok(memories::all(store, &handle)?),
        None => Err(user_missing(&owner.name)),
    }
}

/// The user's memories, or with `q` those a prompt would take for it, with their scores.
pub fn list(
    store: &Store,
    now: i64,
    tenant: &TenantId,
    user: &str,
    query: &str,
) -> Result<Value, AdminError> {
    let owner = OwnerKey::user(tenant, user);
    let records = all(store, &owner)?;
    let q = query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(k, _)| *k == "q")
        .map(|(_, v)| form_decoded(v))
        .transpose()?;
    let decay = memories::Decay {
        half_life_ms: crate::settings::DEFAULT_MEMORY_HALF_LIFE.as_secs_f64() * 1000.0,
        min: 0.0,
    };
    let Some(q) = q else {
        // Each with its decay now, as a prompt would weigh it.
        let listed: Vec<Value> = records
            .iter()
            .map(|m| {
                let mut value = json!(m);
                value["decay"] = json!(m.decay(now, decay));
                value
            })
            .collect();
        return Ok(json!({"user": user, "memories": listed}));
    };
    let candidates = records.into_iter().map(|m| (owner.clone(), m)).collect();
    // By words (an operator's search; the chat path and the memory tools add meaning).
    let no_vectors = std::collections::HashMap::new();
    let ask = memories::Ask {
        query: crate::recall::Query {
            text: &q,
            vector: crate::recall::QueryVector::None,
            fusion: crate::recall::hybrid::Fusion::default(),
            when: None,
        },
        vectors: &no_vectors,
    };
    let chosen = memories::select(candidates, ask, now, decay, 50, u64::MAX);
    let found: Vec<Value> = chosen
        .into_iter()
        .map(|c| json!({"score": c.score, "decay": c.decay, "memory": c.memory}))
        .collect();
    Ok(json!({"user": user, "query": q, "memories": found}))
}

/// A query value as a form encodes it: `+` is a space, `%XX` a byte; UTF-8.
fn form_decoded(value: &str) -> Result<String, AdminError> {
    let bad = || AdminError::BadRequest("`q` is not a well-encoded query value".to_string());
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = value.get(i + 1..i + 3).ok_or_else(bad)?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
                i += 2;
            }
            byte => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// One memory.
pub fn get(store: &Store, tenant: &TenantId, user: &str, id: u64) -> Result<Value, AdminError> {
    let records = all(store, &OwnerKey::user(tenant, user))?;
    let found = records
        .into_iter()
        .find(|m| m.id == id)
        .ok_or_else(|| AdminError::NotFound(format!("no memory {id} of user {user}")))?;
    Ok(json!(found))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Edit {
    text: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    importance: Option<f64>,
    confidence: Option<f64>,
    tags: Option<Vec<String>>,
}

fn parse_edit(body: &[u8]) -> Result<Fields, AdminError> {
    let edit: Edit = serde_json::from_slice(body).map_err(|err| {
        AdminError::BadRequest(format!(
            "the body must be {{\"text\", \"type\", \"importance\", \"confidence\", \"tags\"}}: {err}"
        ))
    })?;
    Ok(Fields {
        text: edit.text,
        kind: edit.kind,
        importance: edit.importance,
        confidence: edit.confidence,
        tags: edit.tags,
    })
}

/// An edit's error as the admin API answers it.
fn edit_error(err: EditError, user: &str) -> AdminError {
    match err {
        EditError::Invalid { message, .. } => AdminError::BadRequest(message),
        EditError::NotFound { id } => {
            AdminError::NotFound(format!("no memory {id} of user {user}"))
        }
        EditError::Shared { .. } => AdminError::BadRequest(err.to_string()),
        EditError::Store(err) => err.into(),
    }
}

/// A memory written by hand.
pub fn create(
    store: &Store,
    embedding: Option<&Embedding>,
    tenant: &TenantId,
    user: &str,
    body: &[u8],
) -> Result<Value, AdminError> {
    let fields = parse_edit(body)?;
    let record = edits::create(store, embedding, &OwnerKey::user(tenant, user), fields)
        .map_err(|err| edit_error(err, user))?;
    Ok(json!(record))
}

/// A memory corrected by hand: a new version, the old text kept in its history.
pub fn update(
    store: &Store,
    embedding: Option<&Embedding>,
    tenant: &TenantId,
    user: &str,
    id: u64,
    body: &[u8],
) -> Result<Value, AdminError> {
    let fields = parse_edit(body)?;
    let owner = OwnerKey::user(tenant, user);
    all(store, &owner)?;
    let record = edits::correct(store, embedding, &owner, id, fields)
        .map_err(|err| edit_error(err, user))?;
    Ok(json!(record))
}

/// Deletes one memory.
pub fn delete(store: &Store, tenant: &TenantId, user: &str, id: u64) -> Result<Value, AdminError> {
    let owner = OwnerKey::user(tenant, user);
    all(store, &owner)?;
    edits::forget(store, &owner, id).map_err(|err| edit_error(err, user))?;
    Ok(json!({"user": user, "deleted": id}))
}

/// Deletes a user entirely.
pub fn delete_user(memory: &Memory, tenant: &TenantId, user: &str) -> Result<Value, AdminError> {
    let deleted = memory
        .delete_user(tenant, user)?
        .ok_or_else(|| user_missing(user))?;
    deleted_user(tenant, user, deleted)
}

/// What a user delete answers.
pub fn deleted_user(tenant: &TenantId, user: &str, deleted: usize) -> Result<Value, AdminError> {
    tracing::info!("a user was deleted by an operator");
    Ok(json!({"tenant": tenant.as_str(), "user": user, "deleted_conversations": deleted}))
}

/// The format of a user's export.
pub const USER_EXPORT_FORMAT: &str = "memproxy.user.v1";

/// A user's export.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct UserExport {
    format: String,
    tenant: String,
    user: String,
    memories: Vec<MemoryRecord>,
    archive: Vec<ArchivedTurn>,
}

/// A user's memories and archive.
pub fn export_user(store: &Store, tenant: &TenantId, user: &str) -> Result<Value, AdminError> {
    let owner = OwnerKey::user(tenant, user);
    let handle = owner_handle(store, &owner, false)?.ok_or_else(|| user_missing(user))?;
    let export = UserExport {
        format: USER_EXPORT_FORMAT.to_string(),
        tenant: tenant.as_str().to_string(),
        user: user.to_string(),
        memories: memories::all(store, &handle)?,
        archive: archive::all(store, &handle)?
            .into_iter()
            .map(|added| added.turn)
            .collect(),
    };
    Ok(json!(export))
}

/// Adds an export to a user. An export of another tenant is refused unless `force_tenant`.
/// The caller drops its cached index of the user (`LongTerm::forget`).
pub fn import_user(
    store: &Store,
    tenant: &TenantId,
    user: &str,
    body: &[u8],
    force_tenant: bool,
) -> Result<Value, AdminError> {
    let export: UserExport = serde_json::from_slice(body)
        .map_err(|err| AdminError::BadRequest(format!("the body is not a user export: {err}")))?;
    if export.format != USER_EXPORT_FORMAT {
        return Err(AdminError::BadRequest(format!(
            "`format` must be \"{USER_EXPORT_FORMAT}\""
        )));
    }
    if export.tenant != tenant.as_str() && !force_tenant {
        return Err(AdminError::BadRequest(
            "the export is of another tenant: import it with force_tenant=true to move it"
                .to_string(),
        ));
    }
    for record in &export.memories {
        edits::checked_text(&record.text).map_err(|err| edit_error(err, user))?;
    }
    let owner = OwnerKey::user(tenant, user);
    let handle = owner_handle(store, &owner, true)?
        .ok_or_else(|| AdminError::BadRequest("the user could not be created".to_string()))?;
    let existing = memories::all(store, &handle)?;
    // Memories already there (same type and text) are skipped; the others get new ids.
    let mut ids: HashMap<u64, u64> = HashMap::new();
    let mut fresh: Vec<MemoryRecord> = Vec::new();
    for record in export.memories {
        let same = existing
            .iter()
            .chain(&fresh)
            .find(|e| e.kind == record.kind && e.text == record.text)
            .map(|e| e.id);
        match same {
            Some(id) => {
                ids.insert(record.id, id);
            }
            None => {
                let id = store.new_id()?;
                ids.insert(record.id, id);
                fresh.push(MemoryRecord {
                    id,
                    tenant: tenant.as_str().to_string(),
                    user: user.to_string(),
                    ..record
                });
            }
        }
    }
    for record in &mut fresh {
        let follow = |list: &[u64]| list.iter().filter_map(|id| ids.get(id).copied()).collect();
        record.supersedes = follow(&record.supersedes);
        record.related_to = follow(&record.related_to);
    }
    let skipped_memories = ids.len() - fresh.len();
    if !fresh.is_empty() {
        memories::write(store, &owner, &fresh, &[], &[])?;
    }
    let (added, skipped) = archive::import(store, &handle, export.archive)?;
    tracing::info!("a user was imported by an operator");
    Ok(json!({
        "tenant": tenant.as_str(),
        "user": user,
        "memories_added": fresh.len(),
        "memories_skipped": skipped_memories,
        "conversations_added": added,
        "conversations_skipped": skipped,
    }))
}
