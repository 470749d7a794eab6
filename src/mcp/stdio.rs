//! `memproxy mcp`: the memory tools over stdio, for an MCP client that starts memproxy itself
//! on a data directory (sled; or the Redis store the config names) with no server running on
//! it. The tenant is named once for the whole session (`--tenant`, or `--credential-env`: the
//! tenant of a credential as a chat request presenting it would get), and so may the user
//! (`--user`; else each call names its user in its `user` argument) and the agent.
//!
//! Standard output carries the protocol alone: logs go to standard error. The process ends
//! when the client closes standard input; the store is then flushed and closed, as at a
//! server's shutdown.

use std::process::ExitCode;
use std::sync::Arc;

use rmcp::ServiceExt;

use super::{Caller, MemoryTools};
use crate::config::Config;
use crate::identity::{Credential, DEFAULT_AGENT, TenantId, is_valid_id};
use crate::state::AppState;

/// `memproxy mcp`'s flags.
#[derive(Debug, clap::Args)]
pub struct McpArgs {
    /// The tenant whose memory the tools serve: 32 hex characters (as the admin API names
    /// tenants) or `anonymous`.
    #[arg(long, env = "MEMPROXY_MCP_TENANT")]
    pub tenant: Option<String>,
    /// The name of an environment variable holding a client credential (an API key, or an
    /// `Authorization` value): the tools serve its tenant, as a chat request presenting it.
    #[arg(long, env = "MEMPROXY_MCP_CREDENTIAL_ENV", conflicts_with = "tenant")]
    pub credential_env: Option<String>,
    /// The user every call is for; without it, each call names its user (`user` argument).
    #[arg(long, env = "MEMPROXY_MCP_USER")]
    pub user: Option<String>,
    /// The agent (whose shared memories a search reads): `default` if not given.
    #[arg(long, env = "MEMPROXY_MCP_AGENT")]
    pub agent: Option<String>,
}

/// Why `memproxy mcp` cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StdioError {
    #[error("name the tenant: --tenant (32 hex characters or `anonymous`) or --credential-env")]
    NoTenant,
    #[error("--tenant must be 32 lower-case hex characters or `anonymous`")]
    BadTenant,
    #[error("the environment variable {0} named by --credential-env holds no credential")]
    NoCredential(String),
    #[error("--{0} must be 1-128 characters from A-Za-z0-9._:@-")]
    BadId(&'static str),
}

/// The caller every call of the session is for, from the flags (`env` reads the
/// environment).
pub fn caller_of(
    config: &Config,
    args: &McpArgs,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Caller, StdioError> {
    let tenant = match (&args.tenant, &args.credential_env) {
        (Some(tenant), _) => TenantId::from_stored(tenant).ok_or(StdioError::BadTenant)?,
        (None, Some(name)) => {
            let value = env(name).unwrap_or_default();
            // A bare key or an `Authorization` value, read as that header would be.
            let credential = Credential::from_authorization(&value)
                .ok_or_else(|| StdioError::NoCredential(name.clone()))?;
            TenantId::of(Some(&credential))
        }
        (None, None) => return Err(StdioError::NoTenant),
    };
    let agent = args
        .agent
        .clone()
        .unwrap_or_else(|| DEFAULT_AGENT.to_string());
    if !is_valid_id(&agent) {
        return Err(StdioError::BadId("agent"));
    }
    if args.user.as_deref().is_some_and(|user| !is_valid_id(user)) {
        return Err(StdioError::BadId("user"));
    }
    Ok(Caller {
        tenant,
        user: args.user.clone(),
        settings: config.profile(&agent).clone(),
        agent,
    })
}

/// Serves the tools over stdio until the client closes standard input.
pub async fn run(config: Config, args: McpArgs) -> ExitCode {
    let caller = match caller_of(&config, &args, &|name| std::env::var(name).ok()) {
        Ok(caller) => caller,
        Err(err) => {
            tracing::error!("{err}");
            return ExitCode::from(2);
        }
    };
    let grace = config.shutdown_grace;
    let state = match AppState::build(config) {
        Ok(state) => state,
        Err(err) => {
            tracing::error!(error = %err, "cannot start");
            return ExitCode::FAILURE;
        }
    };
    let memory = match &state.memory {
        Ok(memory) => Arc::clone(memory),
        Err(unavailable) => {
            tracing::error!(
                reason = %unavailable,
                "cannot open the store: the store can be used by one process at a time; if memproxy serves this data directory, use its /mcp instead"
            );
            return ExitCode::FAILURE;
        }
    };
    let tools = MemoryTools::new(Arc::clone(&state), Some(caller));
    let served = match tools.serve(rmcp::transport::stdio()).await {
        Ok(running) => running
            .waiting()
            .await
            .map(|_| ())
            .map_err(|e| e.to_string()),
        Err(err) => Err(err.to_string()),
    };
    if let Err(err) = &served {
        tracing::warn!(error = %err, "the MCP session ended with an error");
    }
    match memory.shutdown(grace).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %err, "failed to flush the store");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(tenant: Option<&str>, credential_env: Option<&str>, user: Option<&str>) -> McpArgs {
        McpArgs {
            tenant: tenant.map(str::to_string),
            credential_env: credential_env.map(str::to_string),
            user: user.map(str::to_string),
            agent: None,
        }
    }

    #[test]
    fn the_tenant_is_named_or_the_credentials_as_a_chat_request_would_get_it() {
        let config = crate::config::from_toml("", &|_| None).unwrap();
        let env = |name: &str| (name == "KEY").then(|| "sk-one".to_string());
        let by_key = caller_of(&config, &args(None, Some("KEY"), Some("ana")), &env).unwrap();
        let chat = TenantId::of(Credential::from_key("sk-one").as_ref());
        assert_eq!(by_key.tenant, chat);
        assert_eq!(by_key.user.as_deref(), Some("ana"));
        assert_eq!(by_key.agent, DEFAULT_AGENT);
        let named = caller_of(&config, &args(Some(chat.as_str()), None, None), &env).unwrap();
        assert_eq!(named.tenant, chat);
        for (bad, expected) in [
            (args(None, None, None), "name the tenant"),
            (args(Some("nope"), None, None), "--tenant"),
            (args(None, Some("MISSING"), None), "MISSING"),
            (args(Some("anonymous"), None, Some("a b")), "--user"),
        ] {
            let err = caller_of(&config, &bad, &env).unwrap_err().to_string();
            assert!(err.contains(expected), "{err}");
        }
    }
}
