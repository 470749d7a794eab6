//! One whole benchmark: start the two processes, measure memproxy's RSS growth per new
//! conversation, run every scenario in every mode, stop the processes, then report.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::json;

use crate::args::{Args, parse_modes, select_scenarios};
use crate::children::ChildProc;
use crate::client::{Api, Ctx, HttpClient, REQUEST_TIMEOUT, Spec, chat_request, send, small_body};
use crate::load::{MAX_IN_FLIGHT, Mode, run_closed, run_open};
use crate::machine::{
    clock_ticks_per_second, load_average, machine_line, run_dir, source_state, status_kb,
};
use crate::redis_server::RedisServer;
use crate::report::{RunResult, fmt_us, mib, print_report, quantile, report_log, result_json};
use crate::rng::Rng;
use crate::scenarios::{Prefill, Target, prefill};
use crate::tally::{Tally, Window};
use crate::text::sentence;

/// Redis's `used_memory` (bytes), from `INFO memory`.
fn used_memory(redis: &RedisServer) -> u64 {
    // The inline command's reply is one bulk string; its first read holds the line.
    redis
        .command("INFO memory")
        .lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Conversations per RSS-growth batch.
pub const RSS_BATCH: usize = 1000;

/// RSS-growth batches.
pub const RSS_BATCHES: usize = 3;

pub async fn bench(args: Args) -> Result<(), String> {
    let wall = Instant::now();
    let (measure_s, warmup_s) = if args.quick {
        (1.0, 0.2)
    } else {
        (args.seconds, args.warmup)
    };
    if !(measure_s > 0.0 && measure_s <= 3600.0 && (0.0..=600.0).contains(&warmup_s)) {
        return Err("--seconds must be in (0, 3600] and --warmup in [0, 600]".to_string());
    }
    let measure = Duration::from_secs_f64(measure_s);
    let warmup = Duration::from_secs_f64(warmup_s);
    let modes = parse_modes(&args)?;
    let scenarios = select_scenarios(&args)?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let machine = machine_line();

    println!("memproxy load benchmark");
    println!("machine: {machine}");
    println!("command: {command}");
    println!("source: {}", source_state(None));
    println!("load average at start: {}", load_average());
    println!(
        "runs: {} s measured + {} s warm-up each; modes {}; open-loop rate {} req/s (max {} in flight); loopback only",
        measure_s,
        warmup_s,
        modes
            .iter()
            .map(|m| m.label())
            .collect::<Vec<_>>()
            .join(","),
        args.rate,
        MAX_IN_FLIGHT
    );

    let dir = run_dir("bench")?;
    let mut mock = ChildProc::mock(dir.path())?;
    let data_dir = dir.path().join("data");
    let config_text = format!(
        "[server]\nbody_limit_bytes = 268435456\nshutdown_grace = \"PT5S\"\nworker_threads = {}\n{}{}\n[upstream]\nbase_url = \"http://127.0.0.1:{}/v1\"\nconnect_timeout = \"PT2S\"\ntimeout = \"PT120S\"\n\n[upstream.anthropic]\nbase_url = \"http://127.0.0.1:{}\"\n\n[storage]\ndata_dir = {}\n\n[memory]\nmax_messages = 20000\n\n[limits]\nmax_new_messages = 20000\nmax_new_tokens = 10000000\n",
        args.proxy_threads,
        // `--budget-mib`: the benchmark's memproxy at another budget (the 10,000-message rows
        // need more than the default's room).
        args.budget_mib
            .map_or_else(String::new, |mib| format!("memory_budget = \"{mib}MiB\"\n")),
        // `--runtime`: the benchmark's memproxy in either runtime shape.
        runtime_line(&args),
        mock.port,
        mock.port,
        toml::Value::String(data_dir.display().to_string())
    );
    // `--proxy-config FILE` merged in (`[receipts] enabled = false`, say) to compare runs.
    let config_text = crate::args::with_extra(&config_text, args.proxy_config.as_deref())?;
    let config_path = dir.path().join("memproxy.toml");
    std::fs::write(&config_path, &config_text).map_err(|e| format!("writing the config: {e}"))?;
    let mut proxy = ChildProc::spawn(
        "memproxy",
        &["--serve-proxy".as_ref(), config_path.as_os_str()],
        &dir.path().join("memproxy.log"),
    )?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let proxy_idle_kb = status_kb(proxy.pid, "VmRSS");
    let mock_idle_kb = status_kb(mock.pid, "VmRSS");
    println!(
        "processes: mock pid {} port {} (idle RSS {} MiB); memproxy pid {} port {} (idle RSS {} MiB, right after start)",
        mock.pid,
        mock.port,
        mib(mock_idle_kb),
        proxy.pid,
        proxy.port,
        mib(proxy_idle_kb)
    );
    println!(
        "memproxy config: {}",
        config_text.trim().replace('\n', "; ")
    );

    // The Redis rows: a redis-server of the benchmark's own (append-only, fsync always, as
    // the tests run it) and a second memproxy with memory there, started only when a Redis
    // scenario is selected.
    let wants_redis = scenarios.iter().any(|s| s.target == Target::RedisProxy);
    let redis = if wants_redis {
        if std::process::Command::new("redis-server")
            .arg("--version")
            .output()
            .is_err()
        {
            return Err(
                "the redis-* scenarios need redis-server (apt-get install redis-server), or leave them out with --scenarios"
                    .to_string(),
            );
        }
        Some(RedisServer::start())
    } else {
        None
    };
    let mut redis_proxy = match &redis {
        None => None,
        Some(redis) => {
            let text = config_text.replacen(
                "[storage]\n",
                &format!(
                    "[storage]\nbackend = \"redis\"\nredis_url = \"{}\"\nredis_pool_size = 64\n",
                    redis.url()
                ),
                1,
            );
            let path = dir.path().join("memproxy-redis.toml");
            std::fs::write(&path, &text).map_err(|e| format!("writing the config: {e}"))?;
            let child = ChildProc::spawn(
                "memproxy-redis",
                &["--serve-proxy".as_ref(), path.as_os_str()],
                &dir.path().join("memproxy-redis.log"),
            )?;
            println!(
                "memproxy with memory in Redis: pid {} port {}; redis-server on {} (appendonly, appendfsync always)",
                child.pid,
                child.port,
                redis.url()
            );
            Some(child)
        }
    };

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_keepalive(Some(Duration::from_secs(60)));
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(MAX_IN_FLIGHT * 2)
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector);
    let mut rng = Rng::new(42);
    let texts: Vec<String> = (0..1024).map(|_| sentence(&mut rng)).collect();
    let ctx = Arc::new(Ctx {
        client,
        mock_url: format!("http://127.0.0.1:{}/v1/chat/completions", mock.port)
            .parse()
            .map_err(|e| format!("mock url: {e}"))?,
        proxy_url: format!("http://127.0.0.1:{}/v1/chat/completions", proxy.port)
            .parse()
            .map_err(|e| format!("proxy url: {e}"))?,
        texts,
        counter: AtomicU64::new(0),
        proxy_pid: proxy.pid,
        mock_pid: mock.pid,
        clk_tck: clock_ticks_per_second(),
    });
    // The same, aimed at the Redis-backed memproxy.
    let redis_ctx = match &redis_proxy {
        None => None,
        Some(child) => Some(Arc::new(Ctx {
            client: ctx.client.clone(),
            mock_url: ctx.mock_url.clone(),
            proxy_url: format!("http://127.0.0.1:{}/v1/chat/completions", child.port)
                .parse()
                .map_err(|e| format!("proxy url: {e}"))?,
            texts: ctx.texts.clone(),
            counter: AtomicU64::new(1 << 40),
            proxy_pid: child.pid,
            mock_pid: mock.pid,
            clk_tck: ctx.clk_tck,
        })),
    };
    let mut redis_memory: Vec<(String, usize, u64, u64)> = Vec::new();

    // RSS growth per 1,000 newly cached conversations (each stores one exchange), measured
    // first, on a young heap: later, memory freed by the big scenarios is reused and hides it.
    // One warm-up conversation first: the first request loads the tokenizers.
    let warm_errors = new_conversations(&ctx, "warm", 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let proxy_warm_kb = status_kb(proxy.pid, "VmRSS");
    println!(
        "memproxy RSS after its first request (tokenizers loaded): {} MiB{}",
        mib(proxy_warm_kb),
        if warm_errors > 0 {
            " (that request FAILED)"
        } else {
            ""
        }
    );
    let mut growth: Vec<(u64, u64, u64, Duration)> = Vec::new();
    for batch in 0..RSS_BATCHES {
        let before = status_kb(proxy.pid, "VmRSS").unwrap_or(0);
        let started = Instant::now();
        let errors = new_conversations(&ctx, &batch.to_string(), RSS_BATCH).await;
        let took = started.elapsed();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let after = status_kb(proxy.pid, "VmRSS").unwrap_or(0);
        println!(
            "  +{RSS_BATCH} new conversations ({:.1} s, {errors} errors): RSS {} -> {} MiB",
            took.as_secs_f64(),
            mib(Some(before)),
            mib(Some(after))
        );
        growth.push((before, after, errors, took));
        proxy.check_alive()?;
    }

    let mut prefills: Vec<Prefill> = Vec::new();
    let mut prefilled: BTreeSet<String> = BTreeSet::new();
    let mut results: Vec<RunResult> = Vec::new();
    for scenario in &scenarios {
        let run_ctx = match (scenario.target, &redis_ctx) {
            (Target::RedisProxy, Some(redis_ctx)) => redis_ctx,
            _ => &ctx,
        };
        for &mode in &modes {
            // Each proxy's conversations are its own (the Redis one does not share sled's).
            let target = match scenario.target {
                Target::RedisProxy => "redis-",
                Target::Mock | Target::Proxy => "",
            };
            let conversation = match (scenario.prefill, scenario.persist) {
                _ if scenario.spread => Some(format!("{}-{}", scenario.name, mode.short())),
                (0, _) => None,
                (n, false) => Some(format!("{target}bench-{n}{}", api_suffix(scenario.api))),
                (n, true) => Some(format!(
                    "{target}bench-{n}{}-persist-{}",
                    api_suffix(scenario.api),
                    mode.short()
                )),
            };
            if let Some(conversation) = &conversation
                && !scenario.spread
                && !prefilled.contains(conversation)
            {
                let used_before = redis.as_ref().map(used_memory);
                let done = prefill(run_ctx, scenario.api, conversation, scenario.prefill).await?;
                if scenario.target == Target::RedisProxy
                    && let (Some(redis), Some(before)) = (&redis, used_before)
                {
                    let after = used_memory(redis);
                    println!(
                        "  Redis used_memory {} -> {} KiB for {} messages: {:.0} KiB per 1,000 stored messages",
                        before / 1024,
                        after / 1024,
                        done.messages,
                        (after as f64 - before as f64) / 1024.0 * 1000.0 / done.messages as f64
                    );
                    redis_memory.push((conversation.clone(), done.messages, before, after));
                }
                println!(
                    "  pre-filled {} with {} messages in one request ({:.1} MiB body) in {:.0} ms, their vectors made {:.1} s later; X-Memory-Turns {}; proxy RSS now {} MiB",
                    done.conversation,
                    done.messages,
                    done.body_bytes as f64 / 1048576.0,
                    done.took.as_secs_f64() * 1000.0,
                    done.embedding.as_secs_f64(),
                    done.turns.map_or("-".to_string(), |t| t.to_string()),
                    mib(done.proxy_rss_after_kb)
                );
                prefilled.insert(conversation.clone());
                prefills.push(done);
            }
            let spec = Arc::new(Spec {
                api: scenario.api,
                uri: scenario.api.uri(match scenario.target {
                    Target::Mock => &ctx.mock_url,
                    Target::Proxy | Target::RedisProxy => &run_ctx.proxy_url,
                }),
                spread: scenario.spread,
                conversation: conversation.clone(),
                persist_false: conversation.is_some() && !scenario.persist,
                extra_headers: scenario.headers,
                stream: scenario.stream,
                expect_memory: match (&conversation, scenario.persist) {
                    (None, _) => None,
                    (Some(_), true) => Some("stored"),
                    (Some(_), false) => Some("not-stored"),
                },
            });
            let output = match mode {
                Mode::Closed(c) => run_closed(run_ctx, &spec, c, warmup, measure).await,
                Mode::Open(rate) => run_open(run_ctx, &spec, rate, warmup, measure).await,
            };
            let throughput = output.tally.completed as f64 / output.measured.as_secs_f64();
            let result = RunResult {
                scenario: scenario.name,
                baseline: scenario.baseline,
                stream: scenario.stream,
                mode,
                conversation,
                throughput,
                proxy_rss_kb: status_kb(run_ctx.proxy_pid, "VmRSS"),
                proxy_hwm_kb: status_kb(run_ctx.proxy_pid, "VmHWM"),
                mock_rss_kb: status_kb(mock.pid, "VmRSS"),
                output,
            };
            let t = &result.output.tally;
            println!(
                "  {:<19} {:<9} {:>9.0} req/s  p50 {:>7} µs  p99 {:>8} µs  errors {}{}{}",
                result.scenario,
                mode.label(),
                throughput,
                fmt_us(quantile(&t.latency, 0.5)),
                fmt_us(quantile(&t.latency, 0.99)),
                t.errors,
                match (t.retrieved, t.prompt_tokens) {
                    (None, None) => String::new(),
                    (r, p) => format!(
                        "; X-Memory-Retrieved {}, X-Memory-Prompt-Tokens {}, X-Memory-Summary {}, X-Memory-Recall {}",
                        fmt_us(r),
                        fmt_us(p),
                        t.summary.as_deref().unwrap_or("-"),
                        t.recall.as_deref().unwrap_or("-")
                    ),
                },
                if t.samples.is_empty() {
                    String::new()
                } else {
                    format!(" (e.g. {})", t.samples[0])
                }
            );
            results.push(result);
            proxy.check_alive()?;
            if let Some(child) = &mut redis_proxy {
                child.check_alive()?;
            }
            mock.check_alive()?;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    let final_rss = status_kb(proxy.pid, "VmRSS");
    let final_hwm = status_kb(proxy.pid, "VmHWM");
    let store_bytes = memproxy::store::dir_bytes(&data_dir);

    drop(ctx);
    drop(redis_ctx);
    let redis_proxy_exit = redis_proxy
        .as_mut()
        .map(|child| child.stop(Duration::from_secs(15)));
    let proxy_exit = proxy.stop(Duration::from_secs(15));
    let mock_exit = mock.stop(Duration::from_secs(5));
    let proxy_log = std::fs::read_to_string(&proxy.log).unwrap_or_default();
    let mock_log = std::fs::read_to_string(&mock.log).unwrap_or_default();

    print_report(&results, measure_s);
    println!();
    println!("memproxy memory:");
    println!(
        "  idle RSS right after start: {} MiB; after its first request: {} MiB",
        mib(proxy_idle_kb),
        mib(proxy_warm_kb)
    );
    for p in &prefills {
        println!(
            "  after pre-filling {:<26} ({:>6} messages, {:>5.0} ms): RSS {} MiB",
            p.conversation,
            p.messages,
            p.took.as_secs_f64() * 1000.0,
            mib(p.proxy_rss_after_kb)
        );
    }
    for (i, (before, after, errors, took)) in growth.iter().enumerate() {
        println!(
            "  +{RSS_BATCH} new conversations (batch {}, before the scenarios, {:.1} s, {errors} errors): RSS {} -> {} MiB, growth {:+.2} MiB per 1,000 conversations ({:+.0} bytes each)",
            i + 1,
            took.as_secs_f64(),
            mib(Some(*before)),
            mib(Some(*after)),
            (*after as f64 - *before as f64) / 1024.0 * 1000.0 / RSS_BATCH as f64,
            (*after as f64 - *before as f64) * 1024.0 / RSS_BATCH as f64
        );
    }
    println!(
        "  at the end: RSS {} MiB, peak (VmHWM) {} MiB; store on disk {:.1} MiB",
        mib(final_rss),
        mib(final_hwm),
        store_bytes as f64 / 1048576.0
    );
    println!("  mock idle RSS {} MiB", mib(mock_idle_kb));
    println!();
    println!("shutdown: memproxy {proxy_exit}; mock {mock_exit}");
    if let Some(exit) = &redis_proxy_exit {
        println!("shutdown: memproxy with Redis {exit}");
    }
    report_log("memproxy", &proxy_log);
    report_log("mock", &mock_log);
    let total_errors: u64 = results.iter().map(|r| r.output.tally.errors).sum();
    println!("errors across all runs: {total_errors}");
    for r in results.iter().filter(|r| r.output.tally.errors > 0) {
        println!(
            "  {} {}: {} errors: {}",
            r.scenario,
            r.mode.label(),
            r.output.tally.errors,
            r.output.tally.samples.join(" | ")
        );
    }
    let wall_s = wall.elapsed().as_secs_f64();
    println!("load average at the end: {}", load_average());
    println!("wall time: {wall_s:.1} s");

    if let Some(path) = &args.json {
        let value = json!({
            "machine": machine,
            "command": command,
            "measure_seconds": measure_s,
            "warmup_seconds": warmup_s,
            "rate": args.rate,
            "wall_seconds": wall_s,
            "memproxy_config": config_text,
            "proxy_idle_rss_kb": proxy_idle_kb,
            "proxy_rss_after_first_request_kb": proxy_warm_kb,
            "mock_idle_rss_kb": mock_idle_kb,
            "proxy_final_rss_kb": final_rss,
            "proxy_peak_rss_kb": final_hwm,
            "store_bytes": store_bytes,
            "prefills": prefills.iter().map(|p| json!({
                "conversation": p.conversation, "messages": p.messages, "body_bytes": p.body_bytes,
                "ms": p.took.as_secs_f64() * 1000.0, "turns": p.turns, "proxy_rss_kb": p.proxy_rss_after_kb,
            })).collect::<Vec<_>>(),
            "rss_growth": growth.iter().map(|(b, a, e, t)| json!({
                "conversations": RSS_BATCH, "rss_before_kb": b, "rss_after_kb": a, "errors": e, "seconds": t.as_secs_f64(),
            })).collect::<Vec<_>>(),
            "results": results.iter().map(|r| result_json(r, &results)).collect::<Vec<_>>(),
            "shutdown": {"memproxy": proxy_exit, "mock": mock_exit},
            "errors": total_errors,
            "redis_memory": redis_memory.iter().map(|(c, n, b, a)| json!({
                "conversation": c, "messages": n, "used_memory_before": b, "used_memory_after": a,
            })).collect::<Vec<_>>(),
        });
        let text = serde_json::to_string_pretty(&value).map_err(|e| format!("json: {e}"))?;
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!("results written to {}", path.display());
    }
    Ok(())
}

/// Conversations of the other APIs are their own (their stored shapes differ).
fn api_suffix(api: Api) -> &'static str {
    match api {
        Api::Chat => "",
        Api::Responses => "-responses",
        Api::Messages => "-messages",
    }
}

/// Sends one request each to `count` new conversations (8 at a time); returns the error count.
pub async fn new_conversations(ctx: &Arc<Ctx>, batch: &str, count: usize) -> u64 {
    let next = Arc::new(AtomicUsize::new(0));
    let window = Window {
        measure_start: Instant::now(),
        end: Instant::now() + Duration::from_secs(3600),
    };
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (ctx, next, batch) = (Arc::clone(ctx), Arc::clone(&next), batch.to_string());
            tokio::spawn(async move {
                let mut tally = Tally::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    let spec = Spec {
                        api: Api::Chat,
                        uri: ctx.proxy_url.clone(),
                        conversation: Some(format!("rss-{batch}-{i}")),
                        persist_false: false,
                        extra_headers: &[],
                        stream: false,
                        spread: false,
                        expect_memory: Some("stored"),
                    };
                    let n = ctx.counter.fetch_add(1, Ordering::Relaxed);
                    let result = match chat_request(&spec, small_body(&ctx, &spec, n)) {
                        Ok(request) => {
                            tokio::time::timeout(REQUEST_TIMEOUT, send(&ctx.client, request)).await
                        }
                        Err(err) => Ok(Err(err)),
                    };
                    tally.observe(&spec, Instant::now(), window, result);
                }
                tally.errors
            })
        })
        .collect();
    let mut errors = 0;
    for task in tasks {
        errors += task.await.unwrap_or(1);
    }
    errors
}

/// `server.runtime` as `--runtime` asks (nothing without it: memproxy's default).
pub fn runtime_line(args: &Args) -> String {
    args.runtime
        .as_deref()
        .map_or_else(String::new, |shape| format!("runtime = \"{shape}\"\n"))
}
