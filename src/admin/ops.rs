//! The admin operations on a store, shared by the HTTP API and the offline CLI, and the
//! deletes that also drop the recall index and count in metrics.

use std::collections::BTreeMap;

use http::header::HeaderName;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::{Value, json};

use super::format::{self, EXPORT_FORMAT, Export};
use super::{DEFAULT_PAGE, MAX_PAGE, key_of, tenant_of};
use crate::body::ProxyBody;
use crate::error::ApiError;
use crate::identity::hex;
use crate::identity::{ConversationKey, TenantId, is_valid_id};
use crate::settings::MemorySettings;
use crate::store::{ExchangePoint, Scope, Store, StoreError};

/// An admin error: a JSON body `{"error":{"message","type","param","code"}}` and a status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    BadRequest(String),
    #[error("the admin token is missing or wrong: send `Authorization: Bearer <admin token>`")]
    Unauthorized,
    #[error("{0}")]
    NotFound(String),
    #[error("method not allowed here; allowed: {0}")]
    MethodNotAllowed(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Forbidden(String),
    /// The request body did not come within `server.body_read_timeout`.
    #[error("{0}")]
    RequestTimeout(String),
    /// The store cannot serve: it could not be opened at start, its writes fail (a full
    /// disk), or its files are damaged.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// The memory guard did not admit the request: memproxy is at its memory high-water mark.
    #[error("memproxy is at its memory high-water mark (server.memory_budget); retry shortly")]
    MemoryBudget,
}

impl AdminError {
    pub fn status(&self) -> StatusCode {
        ApiError::status(self)
    }

    pub fn into_response(self) -> Response<ProxyBody> {
        crate::error::respond(&self)
    }
}

impl ApiError for AdminError {
    fn status(&self) -> StatusCode {
        match self {
            AdminError::BadRequest(_) => StatusCode::BAD_REQUEST,
            AdminError::Unauthorized => StatusCode::UNAUTHORIZED,
            AdminError::NotFound(_) => StatusCode::NOT_FOUND,
            AdminError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            AdminError::Conflict(_) => StatusCode::CONFLICT,
            AdminError::Forbidden(_) => StatusCode::FORBIDDEN,
            AdminError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            AdminError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            AdminError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            AdminError::MemoryBudget => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            AdminError::BadRequest(_) => "invalid_request",
            AdminError::Unauthorized => "invalid_admin_token",
            AdminError::NotFound(_) => "not_found",
            AdminError::MethodNotAllowed(_) => "method_not_allowed",
            AdminError::Conflict(_) => "conflict",
            AdminError::Forbidden(_) => "forbidden",
            AdminError::RequestTimeout(_) => "request_timeout",
            AdminError::Unavailable(_) => "store_unavailable",
            AdminError::Internal(_) => "internal_error",
            AdminError::MemoryBudget => "memory_budget_exceeded",
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            AdminError::BadRequest(_)
            | AdminError::MethodNotAllowed(_)
            | AdminError::Conflict(_)
            | AdminError::RequestTimeout(_) => "invalid_request_error",
            AdminError::Unauthorized => "authentication_error",
            AdminError::Forbidden(_) => "permission_error",
            AdminError::NotFound(_) => "not_found_error",
            AdminError::Unavailable(_) | AdminError::Internal(_) | AdminError::MemoryBudget => {
                "server_error"
            }
        }
    }

    fn headers(&self) -> Vec<(HeaderName, HeaderValue)> {
        match self {
            AdminError::MethodNotAllowed(allowed) => HeaderValue::from_str(allowed)
                .map(|value| vec![(header::ALLOW, value)])
                .unwrap_or_default(),
            AdminError::Unauthorized => {
                vec![(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"))]
            }
            // The rest of the body may still be on its way: the connection cannot be reused.
            AdminError::RequestTimeout(_) => {
                vec![(header::CONNECTION, HeaderValue::from_static("close"))]
            }
            // The body was not read: the connection cannot be reused either.
            AdminError::MemoryBudget => vec![
                (
                    header::RETRY_AFTER,
                    HeaderValue::from(crate::error::OVERLOADED_RETRY_AFTER_SECONDS),
                ),
                (header::CONNECTION, HeaderValue::from_static("close")),
            ],
            _ => Vec::new(),
        }
    }
}

impl From<StoreError> for AdminError {
    fn from(err: StoreError) -> AdminError {
        if err.is_write_failure() || matches!(err, StoreError::Damaged(_)) {
            AdminError::Unavailable(err.to_string())
        } else {
            AdminError::Internal(err.to_string())
        }
    }
}

fn missing(key: &ConversationKey) -> AdminError {
    AdminError::NotFound(format!(
        "no conversation {}/{}/{}",
        key.tenant, key.agent, key.conversation
    ))
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A listing filter and page, as the query string gives it.
#[derive(Debug, Default, Clone)]
pub struct ListQuery {
    pub tenant: Option<TenantId>,
    pub agent: Option<String>,
    pub cursor: Option<Vec<u8>>,
    pub limit: usize,
    /// Only conversations whose id contains this text (ASCII case-insensitive).
    pub q: Option<String>,
}

impl ListQuery {
    /// Reads `tenant`, `agent`, `q`, `cursor` and `limit` from a query string.
    pub fn parse(query: &str) -> Result<ListQuery, AdminError> {
        let mut out = ListQuery {
            limit: DEFAULT_PAGE,
            ..ListQuery::default()
        };
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            match name {
                "tenant" => out.tenant = Some(tenant_of(value)?),
                "agent" => {
                    if !is_valid_id(value) {
                        return Err(AdminError::BadRequest(
                            "`agent` is 1-128 characters from A-Za-z0-9._:@-".into(),
                        ));
                    }
                    out.agent = Some(value.to_string());
                }
                "q" => {
                    // Ids are 1-128 characters from A-Za-z0-9._:@- (no escapes needed).
                    if !value.is_empty() && !is_valid_id(value) {
                        return Err(AdminError::BadRequest(
                            "`q` is 1-128 characters from A-Za-z0-9._:@- (part of an id)".into(),
                        ));
                    }
                    out.q = (!value.is_empty()).then(|| value.to_ascii_lowercase());
                }
                "cursor" => {
                    out.cursor = Some(unhex(value).ok_or_else(|| {
                        AdminError::BadRequest("`cursor` is not a cursor this API gave".into())
                    })?);
                }
                "limit" => {
                    out.limit = value
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_PAGE).contains(n))
                        .ok_or_else(|| {
                            AdminError::BadRequest(format!(
                                "`limit` must be an integer from 1 to {MAX_PAGE}"
                            ))
                        })?;
                }
                other => {
                    return Err(AdminError::BadRequest(format!(
                        "unknown query parameter `{other}`: accepted are tenant, agent, q, cursor, limit"
                    )));
                }
            }
        }
        Ok(out)
    }
}

/// Lists conversations: `{"conversations":[...],"next_cursor":...}`.
pub fn list(store: &Store, query: &str) -> Result<Value, AdminError> {
    list_with(store, &ListQuery::parse(query)?)
}

pub fn list_with(store: &Store, query: &ListQuery) -> Result<Value, AdminError> {
    let scope = Scope {
        tenant: query.tenant.as_ref(),
        agent: query.agent.as_deref(),
    };
    let limit = query.limit.max(1);
    let (page, next) = match &query.q {
        None => store.list(scope, query.cursor.as_deref(), limit)?,
        Some(q) => store.search(scope, query.cursor.as_deref(), limit, |key| {
            key.conversation.to_ascii_lowercase().contains(q.as_str())
        })?,
    };
    Ok(json!({
        "conversations": page.iter().map(format::listed).collect::<Vec<_>>(),
        "next_cursor": next.map(|c| hex(&c)),
    }))
}

/// A conversation whole: record, messages, summaries, closed branches.
pub fn show(store: &Store, key: &ConversationKey) -> Result<Value, AdminError> {
    let meta = store.meta(key)?.ok_or_else(|| missing(key))?;
    let messages = store.all_messages(key, &meta)?;
    let summaries = store.raw_summaries(key, meta.id)?;
    let branches = store.branches(key, meta.id)?;
    let ttl = store.ttl_of(key)?;
    Ok(format::shown(
        key,
        &meta,
        &messages,
        &summaries,
        &branches,
        ttl.as_ref(),
    ))
}

/// A field of an opaque summary record, read leniently.
fn summary_field(record: &serde_json::value::RawValue, field: &str) -> Option<u64> {
    serde_json::from_str::<Value>(record.get())
        .ok()?
        .get(field)?
        .as_u64()
}

/// A conversation's numbers: messages total/active/summarized, summaries, tokens, and how
/// far it is into the context budget and towards the next summary.
pub fn stats(
    store: &Store,
    key: &ConversationKey,
    settings: &MemorySettings,
) -> Result<Value, AdminError> {
    let meta = store.meta(key)?.ok_or_else(|| missing(key))?;
    let messages = store.all_messages(key, &meta)?;
    let summaries = store.raw_summaries(key, meta.id)?;
    // Messages up to the newest summary's last turn are summarized; the rest are active.
    let summarized_to = summaries
        .iter()
        .filter_map(|(_, record)| summary_field(record, "to_turn"))
        .max()
        .unwrap_or(0);
    let latest_summary_tokens = summaries
        .iter()
        .max_by_key(|(_, record)| summary_field(record, "to_turn").unwrap_or(0))
        .and_then(|(_, record)| summary_field(record, "tokens"))
        .unwrap_or(0);
    let (summarized, active): (Vec<_>, Vec<_>) =
        messages.iter().partition(|m| m.turn <= summarized_to);
    let active_tokens: u64 = active.iter().map(|m| u64::from(m.tokens)).sum();
    let percent = |part: u64, whole: u64| {
        if whole == 0 {
            Value::Null
        } else {
            json!(((part as f64) * 1000.0 / whole as f64).round() / 10.0)
        }
    };
    let budget = settings.max_context_tokens;
    let mut value = format::address(key);
    value["messages"] = json!({
        "total": messages.len(),
        "active": active.len(),
        "summarized": summarized.len(),
    });
    value["summaries"] = json!(summaries.len());
    value["tokens"] = json!({
        "total": meta.total_tokens,
        "active": active_tokens,
        "summary": latest_summary_tokens,
    });
    value["context_budget"] = json!({
        "max_context_tokens": budget,
        "used_percent": budget.map_or(Value::Null, |b| percent(active_tokens + latest_summary_tokens, b)),
    });
    value["ledger"] = format::ledger(meta.ledger.exchanges, meta.tokens_forwarded, &meta.ledger);
    value["exchanges"] = ExchangePoint::newest(&meta.recent, &messages)
        .iter()
        .map(format::exchange_point)
        .collect();
    value["next_summary"] = json!({
        "enabled": settings.compression_enabled,
        "threshold_tokens": settings.compression_threshold_tokens,
        "percent": if settings.compression_enabled {
            percent(active_tokens, settings.compression_threshold_tokens)
        } else {
            Value::Null
        },
    });
    Ok(value)
}

/// Calls `each` with every conversation in `scope`, read a page at a time.
fn each_conversation(
    store: &Store,
    scope: Scope<'_>,
    mut each: impl FnMut(&crate::store::ConversationSummary),
) -> Result<(), AdminError> {
    let mut cursor: Option<Vec<u8>> = None;
    loop {
        let (page, next) = store.list(scope, cursor.as_deref(), MAX_PAGE)?;
        page.iter().for_each(&mut each);
        match next {
            Some(next) if !page.is_empty() => cursor = Some(next),
            _ => return Ok(()),
        }
    }
}

/// A ledger and the tokens forwarded, added up over conversations.
#[derive(Default)]
struct Tally {
    conversations: u64,
    forwarded: u64,
    totals: crate::store::LedgerTotals,
}

impl Tally {
    fn add(&mut self, conversation: &crate::store::ConversationSummary) {
        self.conversations += 1;
        self.forwarded += conversation.meta.tokens_forwarded;
        self.totals.add(&conversation.meta.ledger);
    }

    fn ledger(&self) -> Value {
        format::ledger(self.totals.exchanges, self.forwarded, &self.totals)
    }
}

/// A tenant's token ledger: its conversations' ledgers added up (every conversation's record
/// is read, a page at a time).
pub fn tenant_stats(store: &Store, tenant: &TenantId) -> Result<Value, AdminError> {
    let scope = Scope {
        tenant: Some(tenant),
        agent: None,
    };
    let mut all = Tally::default();
    let mut agents: BTreeMap<String, Tally> = BTreeMap::new();
    each_conversation(store, scope, |conversation| {
        all.add(conversation);
        agents
            .entry(conversation.key.agent.clone())
            .or_default()
            .add(conversation);
    })?;
    if all.conversations == 0 {
        return Err(AdminError::NotFound(format!(
            "no conversation of tenant {tenant}"
        )));
    }
    let by_agent: serde_json::Map<String, Value> = agents
        .iter()
        .map(|(agent, tally)| (agent.clone(), tally.ledger()))
        .collect();
    Ok(json!({
        "tenant": tenant.as_str(),
        "conversations": all.conversations,
        "ledger": all.ledger(),
        "agents": by_agent,
    }))
}

/// Every tenant with conversations, its agents and how many conversations each has (every
/// conversation's record is read, a page at a time): what the console's filters offer.
pub fn tenants(store: &Store) -> Result<Value, AdminError> {
    let mut tenants: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    each_conversation(store, Scope::default(), |conversation| {
        let key = &conversation.key;
        *tenants
            .entry(key.tenant.as_str().to_string())
            .or_default()
            .entry(key.agent.clone())
            .or_default() += 1;
    })?;
    let listed: Vec<Value> = tenants
        .into_iter()
        .map(|(tenant, agents)| {
            json!({
                "tenant": tenant,
                "conversations": agents.values().sum::<u64>(),
                "agents": agents,
            })
        })
        .collect();
    Ok(json!({"tenants": listed}))
}

/// A conversation in the export format.
pub fn export(store: &Store, key: &ConversationKey) -> Result<Export, AdminError> {
    let meta = store.meta(key)?.ok_or_else(|| missing(key))?;
    let messages = store.all_messages(key, &meta)?;
    let summaries = store.raw_summaries(key, meta.id)?;
    let branches = store.branches(key, meta.id)?;
    Ok(format::export(key, &meta, &messages, summaries, &branches))
}

/// Imports an export (JSON `body`) into `key`. An export that names another tenant is refused
/// unless `force_tenant`: moving data between tenants must be deliberate.
pub fn import(
    store: &Store,
    key: &ConversationKey,
    body: &[u8],
    force_tenant: bool,
) -> Result<Value, AdminError> {
    let export: Export = serde_json::from_slice(body)
        .map_err(|err| AdminError::BadRequest(format!("the body is not an export: {err}")))?;
    if export.format != EXPORT_FORMAT {
        return Err(AdminError::BadRequest(format!(
            "`format` must be \"{EXPORT_FORMAT}\""
        )));
    }
    if let Some(tenant) = &export.tenant
        && tenant != key.tenant.as_str()
        && !force_tenant
    {
        return Err(AdminError::Conflict(
            "the export belongs to another tenant; add ?force_tenant=true to import it here"
                .to_string(),
        ));
    }
    let now = store.clock().now_ms();
    let messages = all_stored(&export.messages, |i, m| m.to_stored(i, now))?;
    let branches = all_stored(&export.branches, |i, b| b.to_stored(i, now))?;
    let summaries = export
        .summaries
        .into_iter()
        .map(|s| (s.number, s.record))
        .collect();
    let hint = crate::store::ImportMeta {
        created_ms: export.created_ms,
        last_activity_ms: export.last_activity_ms,
        next_turn: export.next_turn,
        tokens_forwarded: export.tokens_forwarded,
        ledger: export.ledger,
    };
    let imported = store.import_conversation(key, messages, summaries, branches, hint)?;
    let mut value = format::address(key);
    value["added"] = json!(imported.added);
    value["already_stored"] = json!(imported.already_stored);
    value["summaries_added"] = json!(imported.summaries_added);
    value["summaries_skipped"] = json!(imported.summaries_skipped);
    value["branches_added"] = json!(imported.branches_added);
    value["branches_skipped"] = json!(imported.branches_skipped);
    Ok(value)
}

/// Every item of an export made ready to store; the first one that cannot be is a 400 naming it.
fn all_stored<T, U>(
    items: &[T],
    to_stored: impl Fn(usize, &T) -> Result<U, format::ImportError>,
) -> Result<Vec<U>, AdminError> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| to_stored(i, item))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| AdminError::BadRequest(err.to_string()))
}

/// Deletes every conversation of a tenant in `store` (see [`crate::memory::delete_tenant_in`]);
/// 404 when the tenant has none.
pub fn delete_tenant_in(
    store: &Store,
    tenant: &TenantId,
    forget: impl Fn(&ConversationKey),
) -> Result<usize, AdminError> {
    let count = crate::memory::delete_tenant_in(store, tenant, forget)?;
    if count == 0 {
        return Err(AdminError::NotFound(format!(
            "tenant {tenant} has no conversations"
        )));
    }
    Ok(count)
}

/// Parses `{tenant}/{agent}/{id}` (the CLI's argument form).
pub fn parse_address(text: &str) -> Result<ConversationKey, AdminError> {
    let mut parts = text.splitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(tenant), Some(agent), Some(id)) => key_of(tenant, agent, id),
        _ => Err(AdminError::BadRequest(
            "a conversation is addressed as TENANT/AGENT/ID".to_string(),
        )),
    }
}
