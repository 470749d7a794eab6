//! The admin API under `/admin/v1/`: list, show, stats, preview, export, import and delete
//! conversations, list and delete tenants, a user's long-term memories ([`users`]), receipts
//! ([`receipts`]) and the status the console shows ([`status`]). Documented in
//! `docs/admin-openapi.json`. The console's files under `/admin/ui/` are served by [`ui`].
//!
//! Access: `Authorization: Bearer <admin token>`, the token from `MEMPROXY_ADMIN_TOKEN` or the
//! variable `admin.token_env` names. With no token configured every `/admin` path is 404, as if
//! the API did not exist; a wrong or missing token is 401. Tokens are compared as SHA-256
//! digests in constant time, so neither the timing nor the length says anything of the token.
//!
//! The operations on a store ([`ops`]) are shared with the offline CLI; this file adds HTTP,
//! the recall index (which the store does not own) and metrics. It never forwards anything
//! upstream: preview plans a request without sending or storing it.

pub mod format;
pub mod offline;
pub mod ops;
pub mod receipts;
pub mod status;
pub mod store_cli;
pub mod ui;
pub mod users;

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, header};
use http_body::Body as _;
use hyper::body::Incoming;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use crate::body::{CollectError, ProxyBody, collect_limited};
use crate::config::hash_key;
use crate::error::json_response;
use crate::identity::{ConversationKey, TenantId, bearer_token, is_valid_id};
use crate::memory::Memory;
use crate::memory_guard::{self, Reservation};
use crate::message::ChatRequest;
use crate::metrics::Refusal;
use crate::pipeline::plan::{PlanError, plan};
use crate::settings::{self, MemorySettings};
use crate::state::AppState;

pub use ops::AdminError;

/// The prefix of every admin path.
pub const PREFIX: &str = "/admin/v1/";

/// Every route the admin API serves, as `(method, path template)`: the OpenAPI document is
/// checked against this list by a test.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/admin/v1/status"),
    ("GET", "/admin/v1/conversations"),
    ("GET", "/admin/v1/conversations/{tenant}/{agent}/{id}"),
    ("DELETE", "/admin/v1/conversations/{tenant}/{agent}/{id}"),
    ("GET", "/admin/v1/conversations/{tenant}/{agent}/{id}/stats"),
    (
        "POST",
        "/admin/v1/conversations/{tenant}/{agent}/{id}/preview",
    ),
    (
        "GET",
        "/admin/v1/conversations/{tenant}/{agent}/{id}/export",
    ),
    (
        "POST",
        "/admin/v1/conversations/{tenant}/{agent}/{id}/import",
    ),
    (
        "GET",
        "/admin/v1/conversations/{tenant}/{agent}/{id}/receipts",
    ),
    ("GET", "/admin/v1/tenants"),
    ("DELETE", "/admin/v1/tenants/{tenant}"),
    ("GET", "/admin/v1/tenants/{tenant}/stats"),
    ("GET", "/admin/v1/receipts/{id}"),
    ("POST", "/admin/v1/receipts/{id}/replay"),
    ("DELETE", "/admin/v1/users/{tenant}/{user}"),
    ("GET", "/admin/v1/users/{tenant}/{user}/export"),
    ("POST", "/admin/v1/users/{tenant}/{user}/import"),
    ("GET", "/admin/v1/users/{tenant}/{user}/memories"),
    ("POST", "/admin/v1/users/{tenant}/{user}/memories"),
    ("GET", "/admin/v1/users/{tenant}/{user}/memories/{memory}"),
    ("PATCH", "/admin/v1/users/{tenant}/{user}/memories/{memory}"),
    (
        "DELETE",
        "/admin/v1/users/{tenant}/{user}/memories/{memory}",
    ),
];

/// The default and largest page of a listing.
pub const DEFAULT_PAGE: usize = 100;
pub const MAX_PAGE: usize = 1000;

/// True when `headers` carry the admin token (constant-time comparison of digests).
pub fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(expected) = &state.config.admin_token else {
        return false;
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .unwrap_or("");
    let expected = hash_key(&expected.0);
    let presented = hash_key(presented);
    bool::from(expected.ct_eq(&presented))
}

/// Answers one `/admin...` request. Never fails: errors are JSON responses.
pub async fn handle(state: &Arc<AppState>, request: Request<Incoming>) -> Response<ProxyBody> {
    if state.config.admin_token.is_none() {
        return AdminError::NotFound("no such path".into()).into_response();
    }
    // The console's files carry no data: served without the token, which the page then asks
    // for and sends with every admin request (`ui.rs`).
    if ui::is_console(request.uri().path()) {
        return ui::serve(request.method(), request.uri().path());
    }
    if !authorized(state, request.headers()) {
        return AdminError::Unauthorized.into_response();
    }
    match route(state, request).await {
        Ok(response) => response,
        Err(err) => {
            if err.status().is_server_error() {
                tracing::warn!(error = %err, "admin request failed");
            }
            err.into_response()
        }
    }
}

/// Runs the operation the path (under [`PREFIX`]) and the method name: each route takes its
/// own methods (405 for others), and the smaller operations are written out here, the others
/// in the functions below.
async fn route(
    state: &Arc<AppState>,
    request: Request<Incoming>,
) -> Result<Response<ProxyBody>, AdminError> {
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or("").to_string();
    let method = request.method().clone();
    let rest = path
        .strip_prefix(PREFIX)
        .ok_or_else(|| no_route(&method, &path))?;
    // The one route answered without a store: what the console shows when there is none.
    if rest == "status" {
        return match method {
            Method::GET => ok(status::status(state).await),
            _ => Err(wrong_method("GET")),
        };
    }
    // Every operation needs the store: without one (it could not be opened at start) the
    // admin API answers 503, as it would a store whose writes fail.
    let memory = state
        .memory
        .as_ref()
        .map_err(|unavailable| AdminError::Unavailable(unavailable.to_string()))?;
    let parts: Vec<&str> = rest.split('/').collect();
    let call = AdminCall {
        state,
        memory,
        method: method.clone(),
        query: &query,
        request,
    };

    match parts.as_slice() {
        ["conversations"] => {
            call.allow(Method::GET)?;
            ok(ops::list(&memory.store, &query)?)
        }
        ["tenants"] => {
            call.allow(Method::GET)?;
            ok(ops::tenants(&memory.store)?)
        }
        ["tenants", tenant, "stats"] => {
            call.allow(Method::GET)?;
            ok(ops::tenant_stats(&memory.store, &tenant_of(tenant)?)?)
        }
        ["receipts", id] => {
            call.allow(Method::GET)?;
            let receipt = receipts::find(state, id, &query)?;
            let _reservation = admit(state, Some(receipt.weight() as u64))?;
            ok(receipts::show(&receipt))
        }
        ["receipts", id, "replay"] => {
            call.allow(Method::POST)?;
            let receipt = receipts::find(state, id, &query)?;
            receipts::replay(state, &receipt, call.request.headers()).await
        }
        ["tenants", tenant] => {
            call.allow(Method::DELETE)?;
            delete_tenant(state, memory, &tenant_of(tenant)?)
        }
        ["users", tenant, user] => {
            let (tenant, user) = user_of(tenant, user)?;
            call.allow(Method::DELETE)?;
            ok(users::delete_user(memory, &tenant, user)?)
        }
        ["users", tenant, user, "memories"] => user_memories(call, user_of(tenant, user)?).await,
        ["users", tenant, user, "export"] => {
            let (tenant, user) = user_of(tenant, user)?;
            call.allow(Method::GET)?;
            let _reservation = admit(state, None)?;
            ok(users::export_user(&memory.store, &tenant, user)?)
        }
        ["users", tenant, user, "import"] => import_user(call, user_of(tenant, user)?).await,
        ["users", tenant, user, "memories", id] => {
            user_memory(call, user_of(tenant, user)?, id).await
        }
        ["conversations", tenant, agent, id] => conversation(call, &key_of(tenant, agent, id)?),
        ["conversations", tenant, agent, id, action] => {
            conversation_action(call, &key_of(tenant, agent, id)?, action).await
        }
        _ => Err(no_route(&method, &path)),
    }
}

/// One admin request on its way to its operation: the request (its body not read yet), its
/// method and query, and the server state and memory core it acts on.
struct AdminCall<'a> {
    state: &'a AppState,
    memory: &'a Memory,
    method: Method,
    query: &'a str,
    request: Request<Incoming>,
}

impl AdminCall<'_> {
    /// Refuses any method but `allowed` (405).
    fn allow(&self, allowed: Method) -> Result<(), AdminError> {
        if self.method == allowed {
            Ok(())
        } else {
            Err(wrong_method(allowed.as_str()))
        }
    }

    /// Admits the operation under the memory budget with the body length the request
    /// announces (503 when refused).
    fn admit_body(&self) -> Result<Reservation, AdminError> {
        admit(self.state, self.request.body().size_hint().exact())
    }

    /// The request's head and its body, read within `body_limit` and `body_read_timeout`.
    async fn read(self) -> Result<(http::request::Parts, Bytes), AdminError> {
        let (parts, body) = self.request.into_parts();
        Ok((parts, read_body(self.state, body).await?))
    }
}

/// No admin route for `method` and `path` (404).
fn no_route(method: &Method, path: &str) -> AdminError {
    AdminError::NotFound(format!("no admin route for {method} {path}"))
}

/// A method the route does not take (405), with those it takes.
fn wrong_method(allowed: &str) -> AdminError {
    AdminError::MethodNotAllowed(allowed.to_string())
}

/// `DELETE /tenants/{tenant}`: every conversation of the tenant, and what is cached of them.
fn delete_tenant(
    state: &AppState,
    memory: &Memory,
    tenant: &TenantId,
) -> Result<Response<ProxyBody>, AdminError> {
    let deleted = ops::delete_tenant_in(&memory.store, tenant, |key| memory.forget_deleted(key))?;
    memory.forget_deleted_tenant(tenant);
    state.metrics.admin_deleted(deleted);
    ok(json!({"tenant": tenant.as_str(), "deleted_conversations": deleted}))
}

/// `/users/{tenant}/{user}/memories`: list a user's memories, or add one.
async fn user_memories(
    call: AdminCall<'_>,
    (tenant, user): (TenantId, &str),
) -> Result<Response<ProxyBody>, AdminError> {
    let (store, embedding) = (&call.memory.store, Some(&call.memory.embedding));
    match call.method {
        Method::GET => {
            let now = call.memory.clock.now_ms();
            ok(users::list(store, now, &tenant, user, call.query)?)
        }
        Method::POST => {
            let (_, bytes) = call.read().await?;
            ok(users::create(store, embedding, &tenant, user, &bytes)?)
        }
        _ => Err(wrong_method("GET, POST")),
    }
}

/// `POST /users/{tenant}/{user}/import`: a user's export stored again; the user's cached
/// memories are dropped.
async fn import_user(
    call: AdminCall<'_>,
    (tenant, user): (TenantId, &str),
) -> Result<Response<ProxyBody>, AdminError> {
    call.allow(Method::POST)?;
    let memory = call.memory;
    let force = query_flag(call.query, "force_tenant");
    let _reservation = call.admit_body()?;
    let (_, bytes) = call.read().await?;
    let imported = users::import_user(&memory.store, &tenant, user, &bytes, force)?;
    memory
        .longterm
        .forget(&crate::store::OwnerKey::user(&tenant, user));
    ok(imported)
}

/// `/users/{tenant}/{user}/memories/{id}`: read, change or delete one memory.
async fn user_memory(
    call: AdminCall<'_>,
    (tenant, user): (TenantId, &str),
    id: &str,
) -> Result<Response<ProxyBody>, AdminError> {
    let id: u64 = id
        .parse()
        .map_err(|_| AdminError::BadRequest("a memory id is a number".to_string()))?;
    let (store, embedding) = (&call.memory.store, Some(&call.memory.embedding));
    match call.method {
        Method::GET => ok(users::get(store, &tenant, user, id)?),
        Method::PATCH => {
            let (_, bytes) = call.read().await?;
            ok(users::update(store, embedding, &tenant, user, id, &bytes)?)
        }
        Method::DELETE => ok(users::delete(store, &tenant, user, id)?),
        _ => Err(wrong_method("GET, PATCH, DELETE")),
    }
}

/// `/conversations/{tenant}/{agent}/{id}`: show or delete one conversation.
fn conversation(
    call: AdminCall<'_>,
    key: &ConversationKey,
) -> Result<Response<ProxyBody>, AdminError> {
    let memory = call.memory;
    match call.method {
        Method::GET => ok(ops::show(&memory.store, key)?),
        Method::DELETE => {
            let deleted = memory
                .delete_conversation(key)?
                .ok_or_else(|| missing(key))?;
            call.state.metrics.admin_deleted(1);
            tracing::info!(agent = %key.agent, "conversation deleted by an operator");
            ok(format::deleted(key, &deleted))
        }
        _ => Err(wrong_method("GET, DELETE")),
    }
}

/// `/conversations/{tenant}/{agent}/{id}/{action}`: a conversation's stats, export, import or
/// preview.
async fn conversation_action(
    call: AdminCall<'_>,
    key: &ConversationKey,
    action: &str,
) -> Result<Response<ProxyBody>, AdminError> {
    let (state, memory) = (call.state, call.memory);
    match (action, &call.method) {
        ("stats", &Method::GET) => ok(ops::stats(
            &memory.store,
            key,
            state.config.profile(&key.agent),
        )?),
        ("export", &Method::GET) => {
            let _reservation = admit(state, None)?;
            let export = ops::export(&memory.store, key)?;
            let text = serde_json::to_string(&export)
                .map_err(|err| AdminError::Internal(err.to_string()))?;
            Ok(json_response(StatusCode::OK, text))
        }
        ("import", &Method::POST) => {
            let force_tenant = query_flag(call.query, "force_tenant");
            let _reservation = call.admit_body()?;
            let (_, bytes) = call.read().await?;
            let imported = ops::import(&memory.store, key, &bytes, force_tenant)?;
            memory.recall.forget(key);
            ok(imported)
        }
        ("preview", &Method::POST) => {
            let _reservation = call.admit_body()?;
            let (parts, bytes) = call.read().await?;
            ok(preview(state, memory, key, &parts.headers, &bytes)?)
        }
        ("receipts", &Method::GET) => ok(receipts::of_conversation(state, key, call.query)?),
        ("stats" | "export" | "receipts", _) => Err(wrong_method("GET")),
        ("import" | "preview", _) => Err(wrong_method("POST")),
        _ => {
            let path = call.request.uri().path();
            Err(no_route(&call.method, path))
        }
    }
}

fn ok(value: Value) -> Result<Response<ProxyBody>, AdminError> {
    Ok(json_response(StatusCode::OK, value.to_string()))
}

/// The value of `name` in a query string, as given (ids and tenants need no decoding).
fn query_value<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

fn query_flag(query: &str, name: &str) -> bool {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .any(|(k, v)| k == name && (v == "true" || v == "1"))
}

fn missing(key: &ConversationKey) -> AdminError {
    AdminError::NotFound(format!(
        "no conversation {}/{}/{}",
        key.tenant, key.agent, key.conversation
    ))
}

fn tenant_of(text: &str) -> Result<TenantId, AdminError> {
    TenantId::from_stored(text).ok_or_else(|| {
        AdminError::BadRequest(
            "a tenant is 32 lower-case hex characters or `anonymous`".to_string(),
        )
    })
}

/// The user addressed by `{tenant}/{user}`, each part checked.
pub(crate) fn user_of<'a>(tenant: &str, user: &'a str) -> Result<(TenantId, &'a str), AdminError> {
    let tenant = tenant_of(tenant)?;
    if !is_valid_id(user) {
        return Err(AdminError::BadRequest(
            "user ids are 1-128 characters from A-Za-z0-9._:@-".to_string(),
        ));
    }
    Ok((tenant, user))
}

/// The key addressed by `{tenant}/{agent}/{id}`, each part checked.
pub fn key_of(tenant: &str, agent: &str, id: &str) -> Result<ConversationKey, AdminError> {
    let tenant = tenant_of(tenant)?;
    if !is_valid_id(agent) || !is_valid_id(id) {
        return Err(AdminError::BadRequest(
            "agent and conversation ids are 1-128 characters from A-Za-z0-9._:@-".to_string(),
        ));
    }
    Ok(ConversationKey {
        tenant,
        agent: agent.to_string(),
        conversation: id.to_string(),
    })
}

/// Admits an operation that reads or builds a whole body (`body_len`: the request's, when it
/// announces one) under the memory budget; refused, it is a 503 (`Retry-After`).
fn admit(state: &AppState, body_len: Option<u64>) -> Result<Reservation, AdminError> {
    state
        .memory_guard
        .admit(memory_guard::estimate(body_len))
        .map_err(|pressure| {
            state
                .metrics
                .admission_refused(Refusal::Unavailable, pressure);
            AdminError::MemoryBudget
        })
}

async fn read_body(state: &AppState, body: Incoming) -> Result<Bytes, AdminError> {
    let config = &state.config;
    collect_limited(body, config.body_limit_bytes, config.body_read_timeout)
        .await
        .map_err(|err| match err {
            CollectError::TooLarge { limit } => AdminError::BadRequest(format!(
                "the request body is larger than the limit of {limit} bytes"
            )),
            CollectError::TimedOut { within } => AdminError::RequestTimeout(format!(
                "the request body was not received within {} seconds",
                within.as_secs_f64()
            )),
            CollectError::Read(_) => {
                AdminError::BadRequest("the request body could not be read".to_string())
            }
        })
}

/// The exact `messages` memproxy would forward for a chat-completions body, planned against
/// the stored conversation without forwarding or storing anything. `X-Memory-*` setting
/// headers on the admin request apply as they would on a chat request, `X-Memory-User-Id`
/// included: the user's memories and the turns recalled from their other conversations are
/// then in the preview, as they would be in the forwarded prompt.
fn preview(
    state: &AppState,
    memory: &Memory,
    key: &ConversationKey,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Value, AdminError> {
    if memory.store.meta(key)?.is_none() {
        return Err(missing(key));
    }
    let settings = settings_for(state.config.profile(&key.agent).clone(), headers)?;
    let user = preview_user(headers)?;
    let mut request = ChatRequest::parse(body)
        .map_err(|err| AdminError::BadRequest(format!("the chat-completions body: {err}")))?;
    let messages = std::mem::take(&mut request.messages);
    // A preview stores nothing: no summary job, no heuristic stand-in.
    let limits = crate::pipeline::plan::RequestLimits {
        writes: false,
        ..crate::proxy::chat::limits(state)
    };
    let planned = plan(
        memory,
        key,
        user.as_deref(),
        &settings,
        limits,
        request.model.clone(),
        messages,
    )
    .map_err(|err| match err {
        PlanError::Store(err) => AdminError::from(err),
        limit => AdminError::BadRequest(limit.to_string()),
    })?;
    let forwarded: Vec<Value> = planned
        .prompt
        .messages()
        .map(|raw| serde_json::from_str(raw.get()).unwrap_or(Value::Null))
        .collect();
    let budget = planned.report.fitted.map(|fitted| fitted.verdict());
    Ok(json!({
        "model": request.model,
        "messages": forwarded,
        "prompt_tokens": planned.report.prompt_tokens,
        "recalled_turns": planned.report.recalled_turns,
        "recalled": planned
            .report.recalled_scores
            .iter()
            .map(|s| json!({"turn": s.turn, "score": s.score}))
            .collect::<Vec<_>>(),
        "stored_messages": planned.report.stored_count,
        "summary": planned
            .prompt
            .summary
            .is_some()
            .then(|| serde_json::to_value(&planned.report.summary).unwrap_or(Value::Null)),
        "budget": budget,
    }))
}

/// The user a preview plans for: its `X-Memory-User-Id` header, checked as on a chat request.
fn preview_user(headers: &HeaderMap) -> Result<Option<String>, AdminError> {
    let header = crate::proxy::identify::USER_HEADER;
    let Some(value) = headers.get(header) else {
        return Ok(None);
    };
    match value.to_str() {
        Ok(user) if is_valid_id(user) => Ok(Some(user.to_string())),
        _ => Err(AdminError::BadRequest(format!(
            "header `{header}` must be 1-128 characters from A-Za-z0-9._:@-"
        ))),
    }
}

/// The agent's profile with the request's `X-Memory-*` setting headers applied.
fn settings_for(
    mut settings: MemorySettings,
    headers: &HeaderMap,
) -> Result<MemorySettings, AdminError> {
    for (name, value) in headers {
        let Some(setting) = settings::setting_for_header(name.as_str()) else {
            continue;
        };
        let text = value.to_str().map_err(|_| {
            AdminError::BadRequest(format!("header `{name}` must be visible ASCII"))
        })?;
        settings
            .apply(setting, text)
            .map_err(|err| AdminError::BadRequest(format!("header `{name}`: {err}")))?;
    }
    Ok(settings)
}
