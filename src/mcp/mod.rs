//! The memory tools over the Model Context Protocol (MCP): an agent reads and changes the
//! long-term memory of its user with tools (`memory_search`, `memory_remember`,
//! `memory_correct`, `memory_forget`, `conversation_recall`), served at `/mcp` (Streamable
//! HTTP, `route.rs`) and by `memproxy mcp` over stdio (`stdio.rs`). The protocol is `rmcp`'s
//! (the official Rust SDK); this module holds the [`MemoryTools`] handler, the tools'
//! definitions (`catalog.rs`) and their calls (`calls.rs`).
//!
//! Who calls is the transport's business, settled before a tool runs ([`Caller`]): over HTTP the
//! credential's tenant and the `X-Memory-*` headers, exactly as a chat request's
//! (`proxy::identify`); over stdio the tenant and user the command names. A tool never reaches
//! another tenant (every owner key holds the caller's tenant) nor another user than the one
//! the transport names.
//!
//! The tools are thin: they read through `crate::tools` and change memories through
//! `longterm::edits`, the functions the prompt and the admin API use, so what a tool changes
//! is what the next chat request's prompt holds, and the reverse. It must not keep state of
//! its own: each HTTP request gets a fresh handler (stateless MCP, no sessions).

mod calls;
mod catalog;
pub mod route;
pub mod stdio;

use std::sync::Arc;

use rmcp::ErrorData;
use rmcp::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, Implementation, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};

use crate::identity::TenantId;
use crate::settings::MemorySettings;
use crate::state::AppState;

pub use catalog::TOOL_NAMES;

/// What the server tells a client about itself when it connects.
const INSTRUCTIONS: &str = "memproxy keeps the long-term memory of this user across their conversations. \
Use memory_search before answering a question that may depend on what the user said before; \
memory_remember when the user asks you to remember something; memory_correct and memory_forget \
when the user corrects or withdraws something remembered; conversation_recall to look into one \
earlier conversation by its id.";

/// Who a tool call is for, as the transport established it.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The tenant of the caller's credential.
    pub tenant: TenantId,
    /// The user the transport names (`X-Memory-User-Id`, `memproxy mcp --user`): every call
    /// is for this user, and a tool's `user` argument must agree. `None`: each call names its
    /// user in its `user` argument.
    pub user: Option<String>,
    /// The agent (`X-Memory-Agent`, `--agent`; `default`): whose shared memories a search
    /// reads, and a conversation's agent unless the call names one.
    pub agent: String,
    /// The agent's memory settings (with the request's `X-Memory-*` overrides).
    pub settings: MemorySettings,
}

/// The MCP server's handler: the tools over the memory core of `state`.
#[derive(Debug, Clone)]
pub struct MemoryTools {
    state: Arc<AppState>,
    /// The caller of every call (stdio); `None`: each request carries its own (HTTP, in the
    /// request's extensions).
    caller: Option<Caller>,
}

impl MemoryTools {
    pub fn new(state: Arc<AppState>, caller: Option<Caller>) -> MemoryTools {
        MemoryTools { state, caller }
    }

    /// The caller of a call: the handler's own, else the one the HTTP route put in the
    /// request's extensions.
    fn caller(&self, context: &RequestContext<RoleServer>) -> Option<Caller> {
        self.caller.clone().or_else(|| {
            context
                .extensions
                .get::<::http::request::Parts>()
                .and_then(|parts| parts.extensions.get::<Caller>())
                .cloned()
        })
    }
}

impl ServerHandler for MemoryTools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(
                Implementation::new("memproxy", env!("CARGO_PKG_VERSION"))
                    .with_title("memproxy long-term memory"),
            )
            .with_instructions(INSTRUCTIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(catalog::tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let Some(caller) = self.caller(&context) else {
            return Err(ErrorData::internal_error("the caller is unknown", None));
        };
        let Some(memory) = self.state.memory().cloned() else {
            return Err(calls::unavailable());
        };
        let arguments = request.arguments.unwrap_or_default();
        calls::call(memory, caller, &request.name, arguments)
            .await
            .map(Into::into)
    }
}
