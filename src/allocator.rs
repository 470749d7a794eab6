//! The global allocator, and giving what it freed back to the system.
//!
//! A long-running sidecar frees as much as it allocates, but its RSS only falls if the
//! allocator returns the freed pages: the memory guard (`memory_guard.rs`) shrinks the caches
//! under pressure and then calls [`release`]. Chosen at build time by a Cargo feature:
//!
//! - `jemalloc` (the default): jemalloc (`tikv-jemallocator`) with one arena, small thread
//!   caches and background threads that purge freed pages after `dirty_decay_ms` (its options
//!   in `.cargo/config.toml`); [`release`] purges at once.
//! - `glibc-trim` (on Linux with glibc, elsewhere it does nothing): glibc's malloc with
//!   [`GLIBC_ARENAS`] arena and a fixed [`GLIBC_MMAP_THRESHOLD`] ([`configure`]), and
//!   `malloc_trim(0)` as [`release`].
//! - `mimalloc`: mimalloc, which returns freed pages on its own after a short delay.
//! - none (`--no-default-features`): glibc's malloc as it comes, and [`release`] does nothing.
//!
//! Chosen with the soak and the request cost beside nginx (README, "Sizing the sidecar" and
//! "Performance"), the three measured again on 2026-11-27 once the heap that grew under the
//! soak had been found elsewhere (49901ee). glibc's one arena is a lock every thread takes for
//! what its small per-thread cache does not hold: under 64 connections about a third of a
//! read-only memory request's CPU was threads parking on it and waking each other. jemalloc as
//! configured served read-only memory requests with 1.86× less CPU (1.88× the throughput),
//! stored ones with 1.37× less (1.36×), pass-through with a little more (32 against 30 µs a
//! request). It holds a little more than glibc under the soak at the default budget with sled
//! (131 against about 127 MiB at 240,000 requests); with two arenas and jemalloc's own thread
//! caches it was 157, with two arenas and small caches 142. It idles 2–4 MiB higher (44.9
//! against 42.9 MiB, static embedder, sled, once sled's histograms were made zeroed:
//! `Cargo.toml`). mimalloc as it comes idled at 170 MiB and failed the soak at the default
//! budget (memory for 0.01% of the requests); with eager commit and the purge delay off it
//! idles at 63 MiB (not soaked).

#[cfg(all(feature = "jemalloc", target_os = "linux"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[cfg(all(feature = "mimalloc", not(feature = "jemalloc"), target_os = "linux"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// glibc's malloc arenas with `glibc-trim`. Each thread that allocates takes an arena (glibc
/// makes up to eight per core); what an arena freed it keeps, so one arena keeps least.
pub const GLIBC_ARENAS: i32 = 1;

/// With `glibc-trim`, allocations of at least this many bytes get pages of their own
/// (`mmap`), given back as soon as they are freed. Set, it stays: glibc's default threshold
/// starts here too but rises to the size of every mapped block freed (up to 32 MiB), so after
/// one large body the next ones come from the arena, and what they leave there fragments it.
/// Measured with the soak at 128 MiB (Redis, `embedder = "off"`, 150 s): memory for ordinary
/// requests during the oversized burst 97.9% instead of 1.8%, the peak RSS 10 MiB lower.
pub const GLIBC_MMAP_THRESHOLD: i32 = 128 * 1024;

/// Sets the allocator up; call once, first thing in `main`, before any thread starts.
pub fn configure() {
    imp::configure();
}

/// Gives the pages the allocator holds free back to the system, as far as it can.
pub fn release() {
    imp::release();
}

/// What the allocator holds, in bytes: handed out to the program (`in_use`) and kept free
/// for later (`free`: what `release` could not give back, or has not yet). With the RSS
/// beside them, they say whether memory is held by the program or by the allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub in_use: u64,
    pub free: u64,
}

/// The allocator's own figures, where it gives them (jemalloc; glibc with `glibc-trim`);
/// `None` else. For a scrape, not a request: glibc walks its free lists under its lock.
pub fn held() -> Option<Held> {
    imp::held()
}

/// Starts counting the current thread's peak: from now on [`thread_peak`] says the most this
/// thread held allocated at once, net of what it freed, above what it held now.
pub fn thread_peak_reset() {
    imp::thread_peak_reset();
}

/// The most the current thread held allocated at once since [`thread_peak_reset`] on it,
/// above what it held then (what it freed of memory allocated before counts against it);
/// `None` where the allocator does not count (only jemalloc does).
pub fn thread_peak() -> Option<u64> {
    imp::thread_peak()
}

/// jemalloc: nothing to set up (its options are built in); a purge of every arena.
#[cfg(all(feature = "jemalloc", target_os = "linux"))]
mod imp {
    /// `arena.<MALLCTL_ARENAS_ALL>.purge`: every arena's unused dirty pages back to the system.
    const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
    /// `thread.peak.reset`, a void control, and `thread.peak.read`, a `u64`.
    const PEAK_RESET: &[u8] = b"thread.peak.reset\0";
    const PEAK_READ: &[u8] = b"thread.peak.read\0";

    pub fn configure() {}

    /// jemalloc's own counts (built with its statistics): `stats.allocated` in use, and the
    /// rest of `stats.resident` (its metadata, pages partly used, freed pages not yet purged)
    /// free. Read after `epoch` is advanced, which refreshes them.
    pub fn held() -> Option<super::Held> {
        use tikv_jemalloc_ctl::{epoch, stats};
        epoch::advance().ok()?;
        let in_use = stats::allocated::read().ok()? as u64;
        let resident = stats::resident::read().ok()? as u64;
        Some(super::Held {
            in_use,
            free: resident.saturating_sub(in_use),
        })
    }

    // `mallctl` is a C function: calling it is `unsafe`. `arena.<i>.purge` is a void control,
    // which jemalloc runs only when it is given no value at all, every pointer null (it
    // answers `EPERM` otherwise): tikv-jemalloc-ctl's `raw::write(name, ())` passes a pointer
    // to its `()` and was refused every time, so this calls `mallctl` itself.
    #[allow(unsafe_code)]
    pub fn release() {
        // SAFETY: the name is a NUL-terminated control name, and the null pointers with zero
        // length say that nothing is read or written, as a void control requires.
        let status = unsafe {
            tikv_jemalloc_sys::mallctl(
                PURGE_ALL.as_ptr().cast(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if status != 0 {
            tracing::debug!(errno = status, "jemalloc purge failed");
        }
    }

    #[allow(unsafe_code)]
    pub fn thread_peak_reset() {
        // SAFETY: a NUL-terminated name of a void control, every pointer null (as `release`).
        unsafe {
            tikv_jemalloc_sys::mallctl(
                PEAK_RESET.as_ptr().cast(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            );
        }
    }

    #[allow(unsafe_code)]
    pub fn thread_peak() -> Option<u64> {
        // SAFETY: the name is NUL-terminated and the control's type is `uint64_t`, which
        // `u64` is.
        unsafe { tikv_jemalloc_ctl::raw::read::<u64>(PEAK_READ) }.ok()
    }
}

/// glibc with `glibc-trim`: the arenas bounded, `malloc_trim` as the release.
#[cfg(all(
    feature = "glibc-trim",
    not(feature = "jemalloc"),
    not(feature = "mimalloc"),
    target_os = "linux",
    target_env = "gnu"
))]
mod imp {
    pub fn thread_peak_reset() {}
    pub fn thread_peak() -> Option<u64> {
        None
    }

    // `mallopt` is a C function: calling it is `unsafe` in Rust; glibc documents
    // `M_ARENA_MAX` as settable at any time (it bounds arenas created from then on).
    #[allow(unsafe_code)]
    pub fn configure() {
        // SAFETY: `mallopt` takes two integers and changes glibc's own parameters under its
        // lock; it touches no memory of ours.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, super::GLIBC_ARENAS);
            libc::mallopt(libc::M_MMAP_THRESHOLD, super::GLIBC_MMAP_THRESHOLD);
        }
    }

    // `mallinfo2` is a C function: calling it is `unsafe` in Rust, though it has no
    // precondition (any thread, any time).
    #[allow(unsafe_code)]
    pub fn held() -> Option<super::Held> {
        // SAFETY: `mallinfo2` walks glibc's own arenas under their locks and returns a plain
        // struct of counts; it touches no memory of ours.
        let info = unsafe { libc::mallinfo2() };
        // `uordblks`: bytes in use in the arenas; `hblkhd`: in blocks mapped on their own
        // (in use while mapped); `fordblks`: free bytes the arenas keep.
        Some(super::Held {
            in_use: (info.uordblks + info.hblkhd) as u64,
            free: info.fordblks as u64,
        })
    }

    // `malloc_trim` is a C function: calling it is `unsafe` in Rust, though it has no
    // precondition (any thread, any time).
    #[allow(unsafe_code)]
    pub fn release() {
        // SAFETY: `malloc_trim` takes a pad size and walks glibc's own arenas under their
        // locks; it touches no memory of ours.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// Any other allocator (mimalloc returns pages on its own; the system's as it comes): nothing
/// to set up or ask.
#[cfg(not(any(
    all(feature = "jemalloc", target_os = "linux"),
    all(
        feature = "glibc-trim",
        not(feature = "mimalloc"),
        target_os = "linux",
        target_env = "gnu"
    )
)))]
mod imp {
    pub fn configure() {}
    pub fn release() {}
    pub fn thread_peak_reset() {}
    pub fn thread_peak() -> Option<u64> {
        None
    }
    pub fn held() -> Option<super::Held> {
        None
    }
}

#[cfg(test)]
mod tests {
    /// The options `.cargo/config.toml` sets are the ones built in (a build that missed the
    /// file would run four arenas per CPU, larger thread caches, and purge after ten seconds).
    #[cfg(all(feature = "jemalloc", target_os = "linux"))]
    #[test]
    fn jemalloc_runs_with_the_configured_options() {
        use tikv_jemalloc_ctl::opt;
        assert_eq!(opt::narenas::read().unwrap(), 1);
        assert!(opt::background_thread::read().unwrap());
        assert_eq!(opt::tcache_max::read().unwrap(), 4096);
    }

    /// With an allocator that gives its figures (the default build's jemalloc, or glibc with
    /// `glibc-trim`), what a live allocation takes shows in `in_use`, and freeing it lowers it.
    #[test]
    fn a_live_allocation_counts_as_in_use() {
        super::configure();
        #[cfg(all(feature = "jemalloc", target_os = "linux"))]
        assert!(
            super::held().is_some(),
            "jemalloc gives its figures (built with its statistics)"
        );
        let Some(before) = super::held() else {
            return;
        };
        // Past the mmap threshold and jemalloc's thread caches: counted at once.
        let block = std::hint::black_box(vec![7u8; 4 << 20]);
        let during = super::held().unwrap();
        assert!(
            during.in_use >= before.in_use + (4 << 20) - (64 << 10),
            "{before:?} {during:?}"
        );
        drop(block);
        let after = super::held().unwrap();
        assert!(
            after.in_use + (4 << 20) <= during.in_use + (64 << 10),
            "{during:?} {after:?}"
        );
    }

    /// A thread's peak counts what it held at most since the reset, freed or not, net of what
    /// it freed of what it held before.
    #[cfg(all(feature = "jemalloc", target_os = "linux"))]
    #[test]
    fn a_thread_s_peak_counts_from_its_reset() {
        let before = std::hint::black_box(vec![3u8; 4 << 20]);
        super::thread_peak_reset();
        let block = std::hint::black_box(vec![7u8; 2 << 20]);
        drop(block);
        let peak = super::thread_peak().unwrap();
        assert!((2 << 20..(2 << 20) + (64 << 10)).contains(&peak), "{peak}");
        // What was held before the reset and freed after counts against what follows.
        drop(before);
        let block = std::hint::black_box(vec![7u8; 2 << 20]);
        drop(block);
        assert_eq!(super::thread_peak(), Some(peak));
        super::thread_peak_reset();
        assert!(super::thread_peak().unwrap() < 64 << 10);
    }

    /// A purge gives back the pages jemalloc keeps freed: what it holds free falls. (Until
    /// 2026-11-30 `release` asked in a way jemalloc refuses, and gave back nothing.) The
    /// background threads purge them too after `dirty_decay_ms`, so the free is tried a few
    /// times until the pages are seen held.
    #[cfg(all(feature = "jemalloc", target_os = "linux"))]
    #[test]
    fn a_purge_gives_the_freed_pages_back() {
        let mut seen = Vec::new();
        for _ in 0..20 {
            // Many blocks of 64 KiB, each touched: whole pages of jemalloc's extents.
            let blocks: Vec<Vec<u8>> = (0..128)
                .map(|i| std::hint::black_box(vec![i as u8; 64 << 10]))
                .collect();
            drop(blocks);
            let freed = super::held().unwrap();
            seen.push(freed);
            if freed.free >= 8 << 20 {
                super::release();
                let after = super::held().unwrap();
                assert!(
                    after.free + (4 << 20) <= freed.free,
                    "a purge gives them back: {freed:?} {after:?}"
                );
                return;
            }
        }
        panic!("8 MiB freed never showed as held free: {seen:?}");
    }
}
