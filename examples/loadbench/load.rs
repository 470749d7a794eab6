//! The load loops: closed (N tasks, each sending its next request when the last is answered)
//! and open (requests sent at a fixed rate by a scheduler thread, latency counted from each
//! request's scheduled time), and the CPU use of the three processes over a run.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio::sync::Semaphore;

use crate::client::{Ctx, REQUEST_TIMEOUT, Spec, chat_request, send, small_body};
use crate::machine::{cpu_ticks, machine_busy_ticks, sys_and_user_ticks};
use crate::tally::{Tally, Window, histogram, micros};

/// A closed-loop task never sends more than this many requests in one run.
pub const MAX_REQUESTS_PER_TASK: u64 = 5_000_000;

/// An open-loop run never schedules more than this many requests.
pub const MAX_OPEN_REQUESTS: u64 = 5_000_000;

/// Open-loop requests in flight at once; later ones wait (their wait counts as latency).
pub const MAX_IN_FLIGHT: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Closed(usize),
    Open(u64),
}

impl Mode {
    pub fn label(self) -> String {
        match self {
            Mode::Closed(c) => format!("c{c}"),
            Mode::Open(rate) => format!("open@{rate}"),
        }
    }

    pub fn short(self) -> String {
        match self {
            Mode::Closed(c) => format!("c{c}"),
            Mode::Open(_) => "open".to_string(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct CpuUse {
    pub proxy: f64,
    /// The part of `proxy` spent in the kernel (system time): sockets, wake-ups.
    pub proxy_sys: f64,
    pub mock: f64,
    pub generator: f64,
    /// Every other process on the machine (from `/proc/stat`): other work skews the run.
    pub other: f64,
}

/// CPU use (percent of one core) of the three processes over the measured window.
pub async fn cpu_over(ctx: &Ctx, window: Window) -> CpuUse {
    tokio::time::sleep_until(window.measure_start.into()).await;
    let me = std::process::id();
    let before = (
        cpu_ticks(ctx.proxy_pid),
        cpu_ticks(ctx.mock_pid),
        cpu_ticks(me),
        machine_busy_ticks(),
        sys_and_user_ticks(ctx.proxy_pid).map(|t| t.0),
    );
    let started = Instant::now();
    tokio::time::sleep_until(window.end.into()).await;
    let after = (
        cpu_ticks(ctx.proxy_pid),
        cpu_ticks(ctx.mock_pid),
        cpu_ticks(me),
        machine_busy_ticks(),
        sys_and_user_ticks(ctx.proxy_pid).map(|t| t.0),
    );
    let seconds = started.elapsed().as_secs_f64().max(1e-3);
    let pct = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => b.saturating_sub(a) as f64 / ctx.clk_tck as f64 / seconds * 100.0,
        _ => f64::NAN,
    };
    let (proxy, mock, generator) = (
        pct(before.0, after.0),
        pct(before.1, after.1),
        pct(before.2, after.2),
    );
    CpuUse {
        proxy,
        proxy_sys: pct(before.4, after.4),
        mock,
        generator,
        other: (pct(before.3, after.3) - proxy - mock - generator).max(0.0),
    }
}

pub async fn closed_task(ctx: Arc<Ctx>, spec: Arc<Spec>, window: Window) -> Tally {
    let mut tally = Tally::new();
    for _ in 0..MAX_REQUESTS_PER_TASK {
        let origin = Instant::now();
        if origin >= window.end {
            break;
        }
        let n = ctx.counter.fetch_add(1, Ordering::Relaxed);
        let request = match chat_request(&spec, small_body(&ctx, &spec, n)) {
            Ok(request) => request,
            Err(err) => {
                tally.error(err);
                break;
            }
        };
        let result = tokio::time::timeout(REQUEST_TIMEOUT, send(&ctx.client, request)).await;
        tally.observe(&spec, origin, window, result);
    }
    tally
}

pub struct RunOutput {
    pub tally: Tally,
    pub cpu: CpuUse,
    /// Open loop: how late the scheduler sent each request, in µs.
    pub lag: Option<Histogram<u64>>,
    pub measured: Duration,
}

pub async fn run_closed(
    ctx: &Arc<Ctx>,
    spec: &Arc<Spec>,
    concurrency: usize,
    warmup: Duration,
    measure: Duration,
) -> RunOutput {
    let start = Instant::now();
    let window = Window {
        measure_start: start + warmup,
        end: start + warmup + measure,
    };
    let tasks: Vec<_> = (0..concurrency)
        .map(|i| {
            let spec = match (&spec.conversation, spec.spread) {
                (Some(conversation), true) => Arc::new(Spec {
                    conversation: Some(format!("{conversation}-{i}")),
                    ..Spec::clone(spec)
                }),
                _ => Arc::clone(spec),
            };
            tokio::spawn(closed_task(Arc::clone(ctx), spec, window))
        })
        .collect();
    let cpu = cpu_over(ctx, window).await;
    let mut tally = Tally::new();
    for task in tasks {
        match task.await {
            Ok(t) => tally.merge(t),
            Err(err) => tally.error(format!("load task failed: {err}")),
        }
    }
    RunOutput {
        tally,
        cpu,
        lag: None,
        measured: measure,
    }
}

pub async fn open_request(
    ctx: Arc<Ctx>,
    spec: Arc<Spec>,
    origin: Instant,
    window: Window,
    limit: Arc<Semaphore>,
    tally: Arc<Mutex<Tally>>,
) {
    let Ok(_permit) = limit.acquire_owned().await else {
        return;
    };
    let n = ctx.counter.fetch_add(1, Ordering::Relaxed);
    let result = match chat_request(&spec, small_body(&ctx, &spec, n)) {
        Ok(request) => tokio::time::timeout(REQUEST_TIMEOUT, send(&ctx.client, request)).await,
        Err(err) => Ok(Err(err)),
    };
    let mut tally = tally
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    tally.observe(&spec, origin, window, result);
}

pub async fn run_open(
    ctx: &Arc<Ctx>,
    spec: &Arc<Spec>,
    rate: u64,
    warmup: Duration,
    measure: Duration,
) -> RunOutput {
    let start = Instant::now() + Duration::from_millis(20);
    let window = Window {
        measure_start: start + warmup,
        end: start + warmup + measure,
    };
    let total = ((rate as f64 * (warmup + measure).as_secs_f64()) as u64).min(MAX_OPEN_REQUESTS);
    let interval = 1.0 / rate.max(1) as f64;
    let tally = Arc::new(Mutex::new(Tally::new()));
    let limit = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let runtime = tokio::runtime::Handle::current();
    // The scheduler is an OS thread: std::thread::sleep is precise to tens of µs, tokio's
    // timer to a millisecond, and lateness here would count as latency.
    let scheduler = {
        let (ctx, spec, tally, limit) = (
            Arc::clone(ctx),
            Arc::clone(spec),
            Arc::clone(&tally),
            Arc::clone(&limit),
        );
        std::thread::spawn(move || {
            let mut lag = histogram();
            let mut handles = Vec::with_capacity(total as usize);
            for i in 0..total {
                let at = start + Duration::from_secs_f64(i as f64 * interval);
                let now = Instant::now();
                if at > now {
                    std::thread::sleep(at - now);
                }
                lag.saturating_record(micros(Instant::now().saturating_duration_since(at)));
                handles.push(runtime.spawn(open_request(
                    Arc::clone(&ctx),
                    Arc::clone(&spec),
                    at,
                    window,
                    Arc::clone(&limit),
                    Arc::clone(&tally),
                )));
            }
            (handles, lag)
        })
    };
    let cpu = cpu_over(ctx, window).await;
    let joined = tokio::task::spawn_blocking(move || scheduler.join()).await;
    let (handles, lag) = match joined {
        Ok(Ok(out)) => out,
        _ => {
            let mut t = Tally::new();
            t.error("the open-loop scheduler failed".to_string());
            return RunOutput {
                tally: t,
                cpu,
                lag: None,
                measured: measure,
            };
        }
    };
    let deadline =
        tokio::time::Instant::from_std(window.end) + REQUEST_TIMEOUT + Duration::from_secs(5);
    let mut unfinished = 0u64;
    for mut handle in handles {
        if tokio::time::timeout_at(deadline, &mut handle)
            .await
            .is_err()
        {
            handle.abort();
            unfinished += 1;
        }
    }
    let mut tally = std::mem::replace(
        &mut *tally
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
        Tally::new(),
    );
    for _ in 0..unfinished {
        tally.error("not finished by the drain deadline".to_string());
    }
    RunOutput {
        tally,
        cpu,
        lag: Some(lag),
        measured: measure,
    }
}
