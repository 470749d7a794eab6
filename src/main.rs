//! The `memproxy` binary: parse flags, load config, start tracing, bind, serve until a signal.

use std::process::ExitCode;

use clap::Parser;
use memproxy::cli::{Cli, Command};
use memproxy::config::{self, Config, LogFormat};
use memproxy::server;
use memproxy::state::AppState;

fn main() -> ExitCode {
    memproxy::allocator::configure();
    let cli = Cli::parse();
    // The model commands read no config: they run even where none is valid.
    if let Some(Command::Model(command)) = &cli.command {
        return memproxy::cli::model::run(command);
    }
    let config = match config::load(&cli.overrides(), &|name| std::env::var(name).ok()) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("memproxy: {err}");
            return ExitCode::from(2);
        }
    };
    let runtime = match server::runtime(&config) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("memproxy: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        match cli.command {
            Some(Command::CheckConfig) => check_config(&config),
            Some(Command::Conversations(command)) => {
                memproxy::admin::offline::run(&config, command).await
            }
            Some(Command::Users(command)) => {
                memproxy::admin::offline::run_users(&config, command).await
            }
            Some(Command::Store(command)) => memproxy::admin::store_cli::run(&config, command),
            Some(Command::Vectors(command)) => {
                init_tracing(config.log_format);
                memproxy::cli::vectors::run(config, command).await
            }
            Some(Command::Mcp(args)) => {
                // Standard output carries the protocol: logs go to standard error.
                init_tracing(config.log_format);
                memproxy::mcp::stdio::run(config, args).await
            }
            Some(Command::Serve) | None => serve(config).await,
            // Answered above, before the config is read.
            Some(Command::Model(_)) => ExitCode::SUCCESS,
        }
    })
}

async fn serve(config: Config) -> ExitCode {
    init_tracing(config.log_format);
    let listen = config.listen;
    let upstream = config.upstream.base_url.to_string();
    let state = match AppState::build(config) {
        Ok(state) => state,
        Err(err) => {
            tracing::error!(error = %err, "cannot start");
            return ExitCode::FAILURE;
        }
    };
    let listeners = match server::Listeners::bind(&state.config, listen).await {
        Ok(listeners) => listeners,
        Err(err) => {
            tracing::error!(error = %err, %listen, "cannot listen");
            return ExitCode::FAILURE;
        }
    };
    let addr = listeners.local_addr().map_or(listen, |a| a);
    tracing::info!(%addr, %upstream, runtime = ?state.config.runtime, "memproxy listening");
    match listeners.serve(state, server::shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %err, "shutdown failed to flush the store");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(format: LogFormat) {
    // The MCP SDK logs each stateless request's start and end (and the client's notifications)
    // at info: kept to warnings unless `RUST_LOG` names `rmcp` itself.
    let spec = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_string());
    let spec = if spec.contains("rmcp") {
        spec
    } else {
        format!("{spec},rmcp=warn")
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&spec)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,rmcp=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.init(),
    }
}

/// What sled needs of the budget: for the store already in the data directory (told from its
/// size on disk, without opening it: a running memproxy holds its lock), and for a few sizes.
// Allowed: part of `check-config`'s report, below.
#[allow(clippy::print_stdout)]
fn print_store_needs(config: &Config) {
    use memproxy::config::messages_on_disk;
    let mib = |bytes: u64| bytes.div_ceil(1 << 20);
    let budget = &config.memory_budget;
    let on_disk = memproxy::store::dir_bytes(&config.data_dir.join("store"));
    if on_disk > 0 {
        let messages = messages_on_disk(on_disk);
        let overdraft = budget.store_overdraft(messages);
        println!(
            "store on disk = {} MiB, about {messages} messages: sled needs about {} MiB past its page cache, the budget reserves {} MiB{}",
            mib(on_disk),
            mib(budget.engine_need(messages)),
            mib(budget.engine_reserve),
            if overdraft > 0 {
                format!(
                    "; the caches give up {} MiB: a budget of {} MiB would leave them whole",
                    mib(overdraft),
                    mib(budget.budget_for_messages(messages))
                )
            } else {
                String::new()
            }
        );
    }
    // The contextual model's and the provider's vectors are stored beside the messages, and
    // the budget counts them (`MemoryBudget::store_growth`).
    let vectors = if budget.store_growth == memproxy::config::StoreGrowth::WITH_VECTORS {
        format!(
            ", each message with the {} embedder's vector",
            config.embedding.embedder.name()
        )
    } else {
        String::new()
    };
    let sizes: Vec<String> = [100_000u64, 1_000_000, 10_000_000]
        .iter()
        .map(|&n| format!("{n} messages {} MiB", mib(budget.budget_for_messages(n))))
        .collect();
    println!(
        "budget a sled store needs so the caches keep their shares{vectors}: {}",
        sizes.join(", ")
    );
}

// Allowed: `memproxy check-config` prints its report on stdout, as a command's answer (tracing,
// which logs to stderr, is not even started for it).
#[allow(clippy::print_stdout)]
fn check_config(config: &Config) -> ExitCode {
    println!("config OK");
    let iso = memproxy::settings::format_iso8601_duration;
    println!("listen = {}", config.listen);
    println!(
        "clients = at most {} connections; head within {}, body within {}, idle for {}",
        config.max_connections,
        iso(config.header_read_timeout),
        iso(config.body_read_timeout),
        iso(config.idle_timeout)
    );
    println!(
        "threads = {} serving ({}), at most {} for blocking work (the store's calls, the embedder)",
        config
            .worker_threads
            .map_or_else(|| "one per CPU".to_string(), |n| n.to_string()),
        match config.runtime {
            memproxy::config::RuntimeShape::Shared => "one shared runtime",
            memproxy::config::RuntimeShape::PerThread => "a runtime per thread",
        },
        config.blocking_threads
    );
    println!("upstream = {}", config.upstream.base_url);
    println!(
        "upstream timeouts = connect {}, head {}, JSON answer {}, idle {}",
        iso(config.upstream.connect_timeout),
        iso(config.upstream.timeout),
        iso(config.upstream.read_timeout),
        iso(config.upstream.idle_timeout)
    );
    println!(
        "upstream key = {}",
        if config.upstream.api_key.is_some() {
            "set (from environment)"
        } else {
            "not set: client Authorization is forwarded"
        }
    );
    let budget = &config.memory_budget;
    let mib = |bytes: u64| bytes >> 20;
    // The engine's two parts when it runs in this process; Redis keeps the store elsewhere.
    let engine = match config.backend {
        memproxy::config::Backend::Sled => Some("sled page cache"),
        memproxy::config::Backend::Fjall => Some("fjall block cache"),
        memproxy::config::Backend::Redis(_) => None,
    }
    .map_or_else(
        || "no storage engine in the process (Redis)".to_string(),
        |cache| {
            format!(
                "{cache} {} MiB, the storage engine beyond its cache {} MiB",
                mib(budget.store_cache),
                mib(budget.engine_reserve)
            )
        },
    );
    println!(
        "memory budget = {} MiB: state cache {} MiB, {engine}, recall cache {} MiB, receipts {} MiB, the process itself about {} MiB, the embedder {} MiB, requests in flight {} MiB; memory off for new chat requests from {} MiB, a request short of room only for those in flight waiting up to {} for it (pod memory limit: at least {} MiB)",
        mib(budget.total),
        mib(budget.state_cache),
        mib(budget.recall_cache),
        mib(budget.receipts),
        mib(memproxy::config::PROCESS_BASE),
        mib(budget.embedder),
        mib(budget.in_flight()),
        mib(budget.high_water),
        iso(config.memory_wait),
        mib(budget.total) + 64
    );
    match &config.backend {
        memproxy::config::Backend::Sled => {
            println!("storage = sled in {}", config.data_dir.display());
            print_store_needs(config);
        }
        memproxy::config::Backend::Fjall => {
            println!(
                "storage = fjall in {}: its memory is its block cache (above), a memtable per keyspace of an eighth of that (1 to 16 MiB), and the indexes and filters of its newest tables, whatever it stores",
                config.data_dir.display()
            );
        }
        memproxy::config::Backend::Redis(redis) => {
            // The URL may hold a password: only where it points is printed.
            let scheme = if redis.url.0.starts_with("rediss://") {
                "rediss (TLS)"
            } else {
                "redis"
            };
            println!(
                "storage = {scheme}, key prefix `{}`, pool {}, connect timeout {:?}, command timeout {:?}, WAIT for {} replica(s), password {}",
                redis.key_prefix,
                redis.pool_size,
                redis.connect_timeout,
                redis.command_timeout,
                redis.wait_replicas,
                if redis.password.is_some() {
                    "from environment"
                } else {
                    "from the URL, if any"
                }
            );
        }
    }
    println!("allow_header_overrides = {}", config.allow_header_overrides);
    println!(
        "admin API = {}",
        if config.admin_token.is_some() {
            "on (token from environment)"
        } else {
            "off: no admin token"
        }
    );
    println!(
        "mcp = {}",
        match (config.mcp.enabled, config.mcp.allowed_hosts.is_empty()) {
            (false, _) => "off".to_string(),
            (true, true) => "on at /mcp, any Host".to_string(),
            (true, false) => format!("on at /mcp, Host {}", config.mcp.allowed_hosts.join(", ")),
        }
    );
    println!(
        "metrics = {}",
        if config.protect_metrics {
            "admin token required"
        } else {
            "open"
        }
    );
    println!(
        "sweeper = every {}, at most {} scanned and {} deleted per pass",
        iso(config.sweeper.interval),
        config.sweeper.max_scanned,
        config.sweeper.max_deleted
    );
    let profiles = std::iter::once(("[memory] (any other agent)".to_string(), &config.memory))
        .chain(
            config
                .agents
                .iter()
                .map(|(name, s)| (format!("[agents.{name}]"), s)),
        );
    for (title, settings) in profiles {
        println!("\n{title}");
        for (name, value) in settings.describe() {
            println!("  {name} = {value}");
        }
    }
    ExitCode::SUCCESS
}
