//! The offline CLI: `memproxy conversations list|show|export|import|delete` and `memproxy users
//! memories|get|create|update|forget|export|import|delete` on the data directory of a stopped
//! memproxy. The same operations and JSON shapes as the admin API.
//!
//! sled lets one process open a store at a time, so these commands refuse, with a clear
//! message, to run while a server holds the data directory.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use serde_json::{Value, json};

use super::ops::{self, AdminError, ListQuery, parse_address};
use super::tenant_of;
use super::users;
use crate::config::Config;
use crate::store::{Durability, Embedded, Store, StoreError, StoreOptions};

/// `memproxy conversations ...`.
#[derive(Debug, Subcommand)]
pub enum ConversationsCommand {
    /// List conversations (JSON, one page; follow `next_cursor` with --cursor).
    List {
        /// Only this tenant's (32 hex characters, or `anonymous`).
        #[arg(long)]
        tenant: Option<String>,
        /// Only this agent's.
        #[arg(long)]
        agent: Option<String>,
        /// Page size, 1 to 1000.
        #[arg(long, default_value_t = super::DEFAULT_PAGE)]
        limit: usize,
        /// Where the previous page stopped.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Show a conversation's messages and summaries (JSON).
    Show {
        /// TENANT/AGENT/ID
        address: String,
    },
    /// Export a conversation (JSON, the admin API's export format).
    Export {
        /// TENANT/AGENT/ID
        address: String,
        /// Write to this file instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
    /// Import an export into a conversation (idempotent: what is stored already is skipped).
    Import {
        /// TENANT/AGENT/ID
        address: String,
        /// Read from this file instead of standard input.
        #[arg(long, short)]
        input: Option<PathBuf>,
        /// Allow an export of another tenant.
        #[arg(long)]
        force_tenant: bool,
    },
    /// Delete a conversation completely, or with --tenant every conversation of a tenant.
    Delete {
        /// TENANT/AGENT/ID (or TENANT with --tenant).
        address: String,
        /// Delete every conversation of the tenant ADDRESS.
        #[arg(long)]
        tenant: bool,
    },
}

/// `memproxy users ...`: a user's long-term memory (`TENANT/USER` addresses).
#[derive(Debug, Subcommand)]
pub enum UsersCommand {
    /// List a user's memories (JSON); with --query, ranked as a prompt would rank them.
    Memories {
        /// TENANT/USER
        address: String,
        #[arg(long, short)]
        query: Option<String>,
    },
    /// Show one memory.
    Get { address: String, id: u64 },
    /// Write a memory by hand: BODY is `{"text", "type", "importance"?, "confidence"?, "tags"?}`.
    Create { address: String, body: String },
    /// Correct a memory (a new version, the old text in its history): BODY as for create, every
    /// field optional.
    Update {
        address: String,
        id: u64,
        body: String,
    },
    /// Delete one memory.
    Forget { address: String, id: u64 },
    /// Export a user: memories with their history, and the archive of their turns (JSON).
    Export {
        /// TENANT/USER
        address: String,
        /// Write to this file instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
    /// Add a user export to a user (idempotent).
    Import {
        /// TENANT/USER
        address: String,
        /// Read from this file instead of standard input.
        #[arg(long, short)]
        input: Option<PathBuf>,
        /// Allow an export of another tenant.
        #[arg(long)]
        force_tenant: bool,
    },
    /// Delete a user: every conversation their archive knows, the archive and their memories.
    Delete {
        /// TENANT/USER
        address: String,
    },
}

/// Why an offline command failed.
#[derive(Debug, thiserror::Error)]
enum OfflineError {
    #[error(
        "cannot open the store in {dir}: {source}\n  The store can be used by one process at a time: if memproxy is running on this data directory, stop it first (or use the admin API)."
    )]
    Locked {
        dir: String,
        #[source]
        source: crate::store::StoreError,
    },
    #[error(
        "cannot open the store in {dir}: {source}\n  `memproxy store check` reports what of it can be read, `memproxy store repair --into NEW_DIR` salvages it."
    )]
    Unreadable {
        dir: String,
        #[source]
        source: crate::store::StoreError,
    },
    #[error("the data directory {0} does not exist")]
    NoDataDir(String),
    #[error("{0}")]
    Admin(#[from] AdminError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Store(#[from] crate::store::StoreError),
}

/// Runs one command; prints JSON to standard output, errors to standard error.
pub async fn run(config: &Config, command: ConversationsCommand) -> ExitCode {
    exit_code(run_inner(config, |store| execute(store, command)).await)
}

/// Runs one `memproxy users` command.
pub async fn run_users(config: &Config, command: UsersCommand) -> ExitCode {
    exit_code(run_inner(config, |store| execute_users(store, command)).await)
}

fn exit_code(result: Result<(), OfflineError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let _ = writeln!(std::io::stderr(), "memproxy: {err}");
            match err {
                OfflineError::Admin(AdminError::NotFound(_)) => ExitCode::from(3),
                OfflineError::Admin(AdminError::BadRequest(_) | AdminError::Conflict(_)) => {
                    ExitCode::from(2)
                }
                _ => ExitCode::FAILURE,
            }
        }
    }
}

fn open(config: &Config) -> Result<Store, OfflineError> {
    let dir = config.data_dir.as_path();
    let engine = config.backend.embedded().unwrap_or(Embedded::Sled);
    if !dir.join(engine.folder()).exists() {
        return Err(OfflineError::NoDataDir(dir.display().to_string()));
    }
    let options = StoreOptions {
        durability: Durability::Commit,
        page_cache_bytes: 16 * 1024 * 1024,
        state_cache_bytes: 16 * 1024 * 1024,
    };
    let dir_name = dir.display().to_string();
    Store::open_embedded(dir, engine, options).map_err(|source| match &source {
        StoreError::Disk(err) if err.to_string().contains("could not acquire lock") => {
            OfflineError::Locked {
                dir: dir_name,
                source,
            }
        }
        _ => OfflineError::Unreadable {
            dir: dir_name,
            source,
        },
    })
}

fn print(value: &Value) -> Result<(), OfflineError> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value).map_err(std::io::Error::other)?;
    writeln!(out)?;
    Ok(())
}

async fn run_inner(
    config: &Config,
    command: impl FnOnce(&Store) -> Result<(), OfflineError>,
) -> Result<(), OfflineError> {
    let store = open(config)?;
    let result = command(&store);
    // Flush whatever was written, whatever happened.
    store.close().await?;
    result
}

fn execute(store: &Store, command: ConversationsCommand) -> Result<(), OfflineError> {
    match command {
        ConversationsCommand::List {
            tenant,
            agent,
            limit,
            cursor,
        } => {
            let mut query = Vec::new();
            if let Some(tenant) = tenant {
                query.push(format!("tenant={tenant}"));
            }
            if let Some(agent) = agent {
                query.push(format!("agent={agent}"));
            }
            if let Some(cursor) = cursor {
                query.push(format!("cursor={cursor}"));
            }
            query.push(format!("limit={limit}"));
            let parsed = ListQuery::parse(&query.join("&"))?;
            print(&ops::list_with(store, &parsed)?)
        }
        ConversationsCommand::Show { address } => {
            print(&ops::show(store, &parse_address(&address)?)?)
        }
        ConversationsCommand::Export { address, output } => {
            let export = ops::export(store, &parse_address(&address)?)?;
            write_output(&export, output)
        }
        ConversationsCommand::Import {
            address,
            input,
            force_tenant,
        } => {
            let key = parse_address(&address)?;
            let bytes = read_input(input)?;
            print(&ops::import(store, &key, &bytes, force_tenant)?)
        }
        ConversationsCommand::Delete { address, tenant } => {
            if tenant {
                let tenant = tenant_of(&address)?;
                let count = ops::delete_tenant_in(store, &tenant, |_| {})?;
                return print(&json!({"tenant": tenant.as_str(), "deleted_conversations": count}));
            }
            let key = parse_address(&address)?;
            let deleted = store
                .delete_conversation(&key)?
                .ok_or_else(|| AdminError::NotFound(format!("no conversation {address}")))?;
            print(&super::format::deleted(&key, &deleted))
        }
    }
}

/// Standard input, or the file `input`.
fn read_input(input: Option<PathBuf>) -> Result<Vec<u8>, OfflineError> {
    Ok(match input {
        Some(path) => std::fs::read(path)?,
        None => {
            let mut bytes = Vec::new();
            std::io::stdin().lock().read_to_end(&mut bytes)?;
            bytes
        }
    })
}

/// `value` as pretty JSON to standard output, or to the file `output`.
fn write_output<T: serde::Serialize>(
    value: &T,
    output: Option<PathBuf>,
) -> Result<(), OfflineError> {
    let text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    match output {
        Some(path) => std::fs::write(path, text + "\n")?,
        None => writeln!(std::io::stdout().lock(), "{text}")?,
    }
    Ok(())
}

/// `TENANT/USER`, each part checked.
fn user_address(address: &str) -> Result<(crate::identity::TenantId, String), OfflineError> {
    let (tenant, user) = address
        .split_once('/')
        .ok_or_else(|| AdminError::BadRequest(format!("`{address}` is not TENANT/USER")))?;
    let (tenant, user) = super::user_of(tenant, user)?;
    Ok((tenant, user.to_string()))
}

fn execute_users(store: &Store, command: UsersCommand) -> Result<(), OfflineError> {
    match command {
        UsersCommand::Memories { address, query } => {
            let (tenant, user) = user_address(&address)?;
            let query = query.map_or_else(String::new, |q| format!("q={}", q.replace(' ', "+")));
            print(&users::list(
                store,
                store.clock().now_ms(),
                &tenant,
                &user,
                &query,
            )?)
        }
        UsersCommand::Get { address, id } => {
            let (tenant, user) = user_address(&address)?;
            print(&users::get(store, &tenant, &user, id)?)
        }
        UsersCommand::Create { address, body } => {
            let (tenant, user) = user_address(&address)?;
            print(&users::create(
                store,
                None,
                &tenant,
                &user,
                body.as_bytes(),
            )?)
        }
        UsersCommand::Update { address, id, body } => {
            let (tenant, user) = user_address(&address)?;
            print(&users::update(
                store,
                None,
                &tenant,
                &user,
                id,
                body.as_bytes(),
            )?)
        }
        UsersCommand::Forget { address, id } => {
            let (tenant, user) = user_address(&address)?;
            print(&users::delete(store, &tenant, &user, id)?)
        }
        UsersCommand::Export { address, output } => {
            let (tenant, user) = user_address(&address)?;
            write_output(&users::export_user(store, &tenant, &user)?, output)
        }
        UsersCommand::Import {
            address,
            input,
            force_tenant,
        } => {
            let (tenant, user) = user_address(&address)?;
            let bytes = read_input(input)?;
            print(&users::import_user(
                store,
                &tenant,
                &user,
                &bytes,
                force_tenant,
            )?)
        }
        UsersCommand::Delete { address } => {
            let (tenant, user) = user_address(&address)?;
            let deleted = crate::memory::delete_user_in(store, &tenant, &user, |_| {})?
                .ok_or_else(|| AdminError::NotFound(format!("no memories of user {user}")))?;
            print(&users::deleted_user(&tenant, &user, deleted)?)
        }
    }
}
