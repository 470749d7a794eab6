//! The results: one [`RunResult`] per scenario and mode, printed as tables and written as
//! JSON, each row next to its baseline.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde_json::{Value, json};

use crate::load::{Mode, RunOutput};

pub struct RunResult {
    pub scenario: &'static str,
    pub baseline: &'static str,
    pub stream: bool,
    pub mode: Mode,
    pub conversation: Option<String>,
    pub throughput: f64,
    pub output: RunOutput,
    pub proxy_rss_kb: Option<u64>,
    pub proxy_hwm_kb: Option<u64>,
    pub mock_rss_kb: Option<u64>,
}

pub fn quantile(h: &Histogram<u64>, q: f64) -> Option<u64> {
    (!h.is_empty()).then(|| h.value_at_quantile(q))
}

pub fn fmt_us(v: Option<u64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

pub fn fmt_delta(a: Option<u64>, b: Option<u64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:+}", a as i64 - b as i64),
        _ => "-".to_string(),
    }
}

pub fn fmt_pct(v: f64) -> String {
    if v.is_nan() {
        "-".to_string()
    } else {
        format!("{v:.0}")
    }
}

pub fn mib(kb: Option<u64>) -> String {
    kb.map_or_else(
        || "-".to_string(),
        |kb| format!("{:.1}", kb as f64 / 1024.0),
    )
}

pub fn report_log(name: &str, log: &str) {
    let notable: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("panicked"))
        .collect();
    println!(
        "{name} stderr: {} lines, {} warnings/errors",
        log.lines().count(),
        notable.len()
    );
    let mut seen = BTreeMap::new();
    for line in &notable {
        // Group by the message, without the timestamp.
        let key: String = line
            .split_whitespace()
            .skip(2)
            .collect::<Vec<_>>()
            .join(" ");
        *seen
            .entry(key.chars().take(160).collect::<String>())
            .or_insert(0u64) += 1;
    }
    for (line, count) in seen.iter().take(8) {
        println!("  {count} x {line}");
    }
}

pub fn baseline_of<'a>(r: &RunResult, all: &'a [RunResult]) -> Option<&'a RunResult> {
    all.iter()
        .find(|b| b.scenario == r.baseline && b.mode == r.mode)
}

pub fn result_json(r: &RunResult, all: &[RunResult]) -> Value {
    let t = &r.output.tally;
    let q = |h: &Histogram<u64>| {
        json!({
            "count": h.len(), "p50": quantile(h, 0.5), "p90": quantile(h, 0.9), "p99": quantile(h, 0.99),
            "p999": quantile(h, 0.999), "max": (!h.is_empty()).then(|| h.max()), "mean": (!h.is_empty()).then(|| h.mean()),
        })
    };
    let base = baseline_of(r, all);
    json!({
        "scenario": r.scenario,
        "mode": r.mode.label(),
        "conversation": r.conversation,
        "stream": r.stream,
        "throughput_rps": r.throughput,
        "completed": t.completed,
        "errors": t.errors,
        "error_samples": t.samples,
        "latency_us": q(&t.latency),
        "latency_kind": if r.stream { "time to first body byte" } else { "whole response" },
        "total_latency_us": q(&t.total),
        "baseline": r.baseline,
        "added_p50_us": base.and_then(|b| Some(quantile(&t.latency, 0.5)? as i64 - quantile(&b.output.tally.latency, 0.5)? as i64)),
        "added_p99_us": base.and_then(|b| Some(quantile(&t.latency, 0.99)? as i64 - quantile(&b.output.tally.latency, 0.99)? as i64)),
        "cpu_percent": {"memproxy": r.output.cpu.proxy, "memproxy_system": r.output.cpu.proxy_sys, "mock": r.output.cpu.mock, "generator": r.output.cpu.generator, "other_processes": r.output.cpu.other},
        "proxy_rss_kb": r.proxy_rss_kb,
        "proxy_peak_rss_kb": r.proxy_hwm_kb,
        "mock_rss_kb": r.mock_rss_kb,
        "conversation_messages_at_end": t.turns,
        "x_memory_retrieved": t.retrieved,
        "x_memory_prompt_tokens": t.prompt_tokens,
        "x_memory_summary": t.summary,
        "x_memory_recall": t.recall,
        "open_loop_send_lag_us": r.output.lag.as_ref().map(q),
    })
}

pub fn print_report(results: &[RunResult], measure_s: f64) {
    println!();
    println!(
        "Results ({measure_s} s measured per row; latency in µs; stream rows: time to first body byte; +p50/+p99: minus the baseline in the same mode; CPU in % of one core over the measured window, sys% = the part of proxy% spent in the kernel, other% = every other process on the machine; RSS of memproxy after the run)"
    );
    let header = format!(
        "{:<19} {:<9} {:>8} {:>7} {:>7} {:>7} {:>8} {:>7} {:>7} {:>5} {:>6} {:>5} {:>5} {:>5} {:>6} {:>7} {:>7} {:>6}",
        "scenario",
        "mode",
        "req/s",
        "p50",
        "p90",
        "p99",
        "p99.9",
        "+p50",
        "+p99",
        "errs",
        "proxy%",
        "sys%",
        "mock%",
        "gen%",
        "other%",
        "RSS MiB",
        "HWM MiB",
        "conv"
    );
    println!("{header}");
    println!("{}", "-".repeat(header.chars().count()));
    for r in results {
        let t = &r.output.tally;
        let base = baseline_of(r, results);
        let (b50, b99) = base.map_or((None, None), |b| {
            (
                quantile(&b.output.tally.latency, 0.5),
                quantile(&b.output.tally.latency, 0.99),
            )
        });
        let is_base = r.scenario == r.baseline;
        println!(
            "{:<19} {:<9} {:>8.0} {:>7} {:>7} {:>7} {:>8} {:>7} {:>7} {:>5} {:>6} {:>5} {:>5} {:>5} {:>6} {:>7} {:>7} {:>6}",
            r.scenario,
            r.mode.label(),
            r.throughput,
            fmt_us(quantile(&t.latency, 0.5)),
            fmt_us(quantile(&t.latency, 0.9)),
            fmt_us(quantile(&t.latency, 0.99)),
            fmt_us(quantile(&t.latency, 0.999)),
            if is_base {
                "base".to_string()
            } else {
                fmt_delta(quantile(&t.latency, 0.5), b50)
            },
            if is_base {
                "base".to_string()
            } else {
                fmt_delta(quantile(&t.latency, 0.99), b99)
            },
            t.errors,
            fmt_pct(r.output.cpu.proxy),
            fmt_pct(r.output.cpu.proxy_sys),
            fmt_pct(r.output.cpu.mock),
            fmt_pct(r.output.cpu.generator),
            fmt_pct(r.output.cpu.other),
            mib(r.proxy_rss_kb),
            mib(r.proxy_hwm_kb),
            t.turns.map_or("-".to_string(), |n| n.to_string()),
        );
    }
    println!();
    println!(
        "CPU per request (µs of CPU time per completed request, over the measured window; the closed-loop rows):"
    );
    println!(
        "{:<19} {:<9} {:>9} {:>11} {:>8} {:>8}",
        "scenario", "mode", "memproxy", "of it sys", "mock", "gen"
    );
    for r in results.iter().filter(|r| matches!(r.mode, Mode::Closed(_))) {
        let per = |pct: f64| {
            if r.throughput > 0.0 && pct.is_finite() {
                format!("{:.1}", pct / 100.0 * 1e6 / r.throughput)
            } else {
                "-".to_string()
            }
        };
        let cpu = &r.output.cpu;
        println!(
            "{:<19} {:<9} {:>9} {:>11} {:>8} {:>8}",
            r.scenario,
            r.mode.label(),
            per(cpu.proxy),
            per(cpu.proxy_sys),
            per(cpu.mock),
            per(cpu.generator)
        );
    }
    if results.iter().any(|r| r.stream) {
        println!();
        println!("Streams, whole response (µs):");
        println!(
            "{:<19} {:<9} {:>7} {:>7} {:>8} {:>7} {:>7}",
            "scenario", "mode", "p50", "p99", "p99.9", "+p50", "+p99"
        );
        for r in results.iter().filter(|r| r.stream) {
            let t = &r.output.tally.total;
            let base = baseline_of(r, results);
            let (b50, b99) = base.map_or((None, None), |b| {
                (
                    quantile(&b.output.tally.total, 0.5),
                    quantile(&b.output.tally.total, 0.99),
                )
            });
            println!(
                "{:<19} {:<9} {:>7} {:>7} {:>8} {:>7} {:>7}",
                r.scenario,
                r.mode.label(),
                fmt_us(quantile(t, 0.5)),
                fmt_us(quantile(t, 0.99)),
                fmt_us(quantile(t, 0.999)),
                fmt_delta(quantile(t, 0.5), b50),
                fmt_delta(quantile(t, 0.99), b99)
            );
        }
    }
    let lags: Vec<&RunResult> = results.iter().filter(|r| r.output.lag.is_some()).collect();
    if !lags.is_empty() {
        println!();
        println!(
            "Open-loop scheduler lateness (µs, included in open-loop latency; same for every scenario):"
        );
        for r in lags {
            if let Some(lag) = &r.output.lag {
                println!(
                    "  {:<19} {:<9} p50 {:>5} p99 {:>6} max {:>7}",
                    r.scenario,
                    r.mode.label(),
                    fmt_us(quantile(lag, 0.5)),
                    fmt_us(quantile(lag, 0.99)),
                    (!lag.is_empty())
                        .then(|| lag.max())
                        .map_or("-".to_string(), |m| m.to_string())
                );
            }
        }
    }
}
