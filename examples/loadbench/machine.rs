//! What the benchmark reads of the machine and of its processes: RSS and CPU time from
//! `/proc`, a description of the machine, the source's git state, the store's size on disk;
//! and the run's folder in the system's temporary directory.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The folder of this run (memproxy's data directory, its config and logs), removed when the
/// run ends. A soak's data directory grows by gigabytes in half an hour, and a run killed
/// outright (a session's end, SIGKILL) never removes its folder: folders that runs of `kind`
/// left behind, their process gone, are removed first.
pub fn run_dir(kind: &str) -> Result<tempfile::TempDir, String> {
    let prefix = format!("loadbench-{kind}-");
    let tmp = std::env::temp_dir();
    if let Ok(entries) = std::fs::read_dir(&tmp) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|name| name.strip_prefix(&prefix))
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    tempfile::Builder::new()
        .prefix(&format!("{prefix}{}-", std::process::id()))
        .tempdir()
        .map_err(|e| format!("tempdir: {e}"))
}

/// A `kB` field of `/proc/PID/status` (`VmRSS`, `VmHWM`), in kB.
pub fn status_kb(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// user + system CPU time of a process, in clock ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    sys_and_user_ticks(pid).map(|(sys, user)| sys + user)
}

/// (system, user) CPU time of a process, in clock ticks.
pub fn sys_and_user_ticks(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After the command come fields 3.. of stat(5): utime is field 14, stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((stime, utime))
}

/// Busy CPU time of the whole machine, in clock ticks (`/proc/stat`, first line).
pub fn machine_busy_ticks() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    Some(
        v.first()? + v.get(1)? + v.get(2)? + v.get(5)? + v.get(6)? + v.get(7).copied().unwrap_or(0),
    )
}

pub fn clock_ticks_per_second() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(100)
}

pub fn machine_line() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string());
    let processors = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| {
                l.strip_prefix("MemTotal:")?
                    .split_whitespace()
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
        })
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "nproc {nproc} ({processors} in /proc/cpuinfo), model name: {model}, MemTotal {:.1} GiB, Linux {}",
        mem_kb as f64 / 1024.0 / 1024.0,
        kernel.trim()
    )
}

/// The git commit and uncommitted files of the crate, and whether `src/` changed after the
/// measured binary was built (other work in progress would then not be what was measured):
/// `binary`, or this one, which holds memproxy when it runs in process. A binary given by path
/// may have been built from any commit: the line says the HEAD is the folder's, not its.
pub fn source_state(binary: Option<&Path>) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).to_string())
    };
    let head = git(&["rev-parse", "--short", "HEAD"])
        .map_or_else(|| "unknown".to_string(), |h| h.trim().to_string());
    let dirty: Vec<String> = git(&[
        "status",
        "--porcelain",
        "--",
        "src",
        "Cargo.toml",
        "Cargo.lock",
    ])
    .unwrap_or_default()
    .lines()
    .filter(|l| !l.trim().is_empty())
    .map(|l| l.get(3..).unwrap_or(l).trim().to_string())
    .collect();
    fn newest(path: &Path) -> Option<std::time::SystemTime> {
        let meta = std::fs::metadata(path).ok()?;
        if !meta.is_dir() {
            return meta.modified().ok();
        }
        std::fs::read_dir(path)
            .ok()?
            .flatten()
            .filter_map(|e| newest(&e.path()))
            .max()
    }
    let built = binary
        .map(Path::to_path_buf)
        .or_else(|| std::env::current_exe().ok())
        .and_then(|exe| std::fs::metadata(exe).ok()?.modified().ok());
    let freshness = match (newest(&root.join("src")), built) {
        (Some(src), Some(built)) => match src.duration_since(built) {
            Ok(newer) if newer > Duration::ZERO => format!(
                "WARNING: src/ was modified {:.0} s after this binary was built; the results measure the older build",
                newer.as_secs_f64()
            ),
            _ => "binary is newer than every file in src/".to_string(),
        },
        _ => "build freshness unknown".to_string(),
    };
    let whose = if binary.is_some() {
        " (this folder's: a binary given by path is not known to be built from it)"
    } else {
        ""
    };
    format!(
        "git HEAD {head}{whose}; uncommitted: {}; {freshness}",
        if dirty.is_empty() {
            "none".to_string()
        } else {
            dirty.join(", ")
        }
    )
}

/// `/proc/loadavg`: other work on the machine skews every number here.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_folder_takes_the_place_of_those_whose_process_is_gone() {
        let tmp = std::env::temp_dir();
        // Past any pid the kernel hands out: that run is gone.
        let gone = tmp.join("loadbench-foldertest-4000000000-abc");
        let alive = tmp.join(format!("loadbench-foldertest-{}-def", std::process::id()));
        let other = tmp.join("loadbench-otherkind-4000000000-ghi");
        for dir in [&gone, &alive, &other] {
            std::fs::create_dir_all(dir.join("data")).unwrap();
        }
        let made = run_dir("foldertest").unwrap();
        let name = made
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(
            name.starts_with(&format!("loadbench-foldertest-{}-", std::process::id())),
            "{name}"
        );
        assert!(!gone.exists(), "a gone run's folder is removed");
        assert!(alive.exists(), "a live run's folder is kept");
        assert!(
            other.exists(),
            "another kind's folder is left to its own runs"
        );
        let path = made.path().to_path_buf();
        drop(made);
        assert!(!path.exists(), "the run's own folder goes when it ends");
        std::fs::remove_dir_all(alive).unwrap();
        std::fs::remove_dir_all(other).unwrap();
    }
}
