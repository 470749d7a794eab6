//! Command-line flags. Each flag has an environment variable; both override the config file.
//! [`model`] is the `memproxy model` commands (the embedding model, offline); [`vectors`] is
//! `memproxy vectors rebuild`.

pub mod model;
pub mod vectors;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::Overrides;

/// memproxy — an OpenAI-compatible proxy that gives any agent a memory.
///
/// Point your SDK's base_url at memproxy and send `X-Memory-Conversation-Id` (or use the path
/// form /agents/{agent}/conversations/{id}/v1): every turn is stored, and each request is
/// rebuilt from the conversation's memory before it goes upstream.
#[derive(Debug, Parser)]
#[command(name = "memproxy", version)]
pub struct Cli {
    /// Config file (TOML). Default: config/memproxy.toml when it exists, else built-in defaults.
    #[arg(long, env = "MEMPROXY_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Address to listen on. Default: 127.0.0.1:8080.
    #[arg(long, env = "MEMPROXY_LISTEN", global = true)]
    pub listen: Option<String>,
    /// Upstream base URL including its version path, like an SDK's base_url.
    /// Default: https://api.openai.com/v1.
    #[arg(long, env = "MEMPROXY_UPSTREAM", global = true)]
    pub upstream: Option<String>,
    /// Data directory for the store (created on first start). Default: ./data.
    #[arg(long, env = "MEMPROXY_DATA_DIR", global = true)]
    pub data_dir: Option<PathBuf>,
    /// Redis URL (redis:// or rediss://): keeps memory in Redis, shared by every replica
    /// pointed at it, instead of sled in the data directory.
    #[arg(
        long,
        env = "MEMPROXY_REDIS_URL",
        global = true,
        hide_env_values = true
    )]
    pub redis_url: Option<String>,
    /// Log format: text or json. Default: text.
    #[arg(long, env = "MEMPROXY_LOG_FORMAT", global = true)]
    pub log_format: Option<String>,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy (the default).
    Serve,
    /// Validate the config and print the effective settings per agent.
    CheckConfig,
    /// Inspect, export, import or delete conversations in the data directory of a stopped
    /// memproxy (the admin API's operations, offline).
    #[command(subcommand)]
    Conversations(crate::admin::offline::ConversationsCommand),
    /// Inspect, correct, export, import or delete a user's long-term memory in the data
    /// directory of a stopped memproxy (the admin API's user operations, offline).
    #[command(subcommand)]
    Users(crate::admin::offline::UsersCommand),
    /// Serve the memory tools over MCP on stdio (for a client that starts memproxy itself),
    /// on the data directory (or Redis store) of the config, with no server running on it.
    Mcp(crate::mcp::stdio::McpArgs),
    /// Check the data directory of a stopped memproxy for damage, or salvage what can be read
    /// into a fresh one.
    #[command(subcommand)]
    Store(crate::admin::store_cli::StoreCommand),
    /// Recall by meaning's vectors: `rebuild` gives every stored message one.
    #[command(subcommand)]
    Vectors(vectors::VectorsCommand),
    /// The embedding model for recall by meaning: distill its static table, or print the
    /// vectors of texts. Needs no config and no network (the files: scripts/fetch-model.sh).
    #[command(subcommand)]
    Model(model::ModelCommand),
}

impl Cli {
    pub fn overrides(&self) -> Overrides {
        Overrides {
            config_path: self.config.clone(),
            listen: self.listen.clone(),
            upstream: self.upstream.clone(),
            data_dir: self.data_dir.clone(),
            redis_url: self.redis_url.clone(),
            log_format: self.log_format.clone(),
        }
    }
}
