//! Admission against `server.memory_budget`: whether a new request may use memory, from the
//! process's resident memory and what the requests admitted before it may still take.
//!
//! - **Measured**: the RSS (`VmRSS` of `/proc/self/status`), read at most every
//!   [`SAMPLE_INTERVAL`]: a request in between uses the last reading, so the cost is one small
//!   file read per interval, whatever the traffic.
//! - **Reserved**: each admitted request reserves an estimate of what it takes (its body
//!   several times over: the bytes read, the parsed messages, the assembled prompt; plus what
//!   its planning takes besides, measured: [`PLANNING_QUANTILE`]) until its response is done
//!   with. A burst admitted between two readings is counted before the RSS shows it.
//! - **Staged**: a chat request is admitted on its whole estimate but reserves it as it takes
//!   memory ([`MemoryGuard::admit_request`]): one copy of its body while it waits for its
//!   body and for a thread to plan on; the rest from when a thread starts its planning
//!   ([`Reservation::plan_start`]: a runtime thread, or the blocking pool's once one takes
//!   it, not while it is queued for one); once its prompt is forwarded the planning's
//!   temporaries are freed, and it keeps [`ANSWER_BYTES`] and its forwarded prompt's size
//!   until its response is done ([`Reservation::settle`]). Held whole from admission to the response's end, 64
//!   clients' estimates (full-history bodies of tens of KiB, four times over, and the fixed
//!   part) kept memory off for 9% of the soak's ordinary requests at 128 MiB, the RSS 22 MiB
//!   under the mark (held whole until the prompt went, up to 31 MiB of them were sampled).
//! - **Decided** ([`decide`]): admitted while the RSS, the reservations and this request's
//!   estimate stay under the budget's high-water mark (`config/memory_budget.rs`); else refused, with
//!   the [`Pressure`] that says why.
//! - **Waited for** ([`MemoryGuard::admit_request`]): a chat request refused only for what the
//!   requests in flight reserved (it would fit with the RSS alone) waits up to
//!   `server.memory_wait` ([`crate::config::DEFAULT_MEMORY_WAIT`]) for them to give it back,
//!   woken as they do, before it goes with memory off.
//!
//! - **Relieved** ([`Relief`]): before it comes to refusing, a thread every [`RELIEF_EVERY`]
//!   holds the caches (conversation state, recall indexes, users' indexes, receipts; each a
//!   [`Shrink`]) under lower limits, least recently used first, down to their floors, and asks
//!   the allocator to give the freed pages back (`allocator.rs`), once the RSS with the
//!   reservations on top passes [`Marks::shrink_above`]; it lifts the limits again once that
//!   is under [`Marks::grow_below`] ([`new_limits`]). Refusal is left for what shrinking cannot cover,
//!   and ends as soon as the RSS is back under the mark.
//!
//! What a refusal means is the caller's choice (README, "Sizing the sidecar"): a chat request
//! is served with memory off (forwarded untouched, `X-Memory-Status: degraded`, its body
//! streamed, never read whole), so the agent goes on; an admin request that reads or builds a
//! whole body (preview, import, export) is answered 503 with `Retry-After`.
//!
//! Where `/proc` cannot be read (not Linux), only the cache sizes follow the budget: admission
//! admits everything. Tests pretend a reading with [`MemoryGuard::pretend_resident`].

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::cache::Shrink;
use crate::config::MemoryBudget;

/// How often the relief thread reads the RSS and shrinks or lifts the caches' limits.
pub const RELIEF_EVERY: Duration = Duration::from_millis(250);

/// How old a reading of the RSS may be before the next request reads it again.
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(100);

/// What a memory request is assumed to take besides its body (the plan, the reply, buffers)
/// until plannings were measured, and where the allocator does not count them (only
/// jemalloc does): see [`PLANNING_QUANTILE`].
pub const REQUEST_BASE_BYTES: u64 = 256 * 1024;

/// With jemalloc, the part a planning is assumed to take besides its body's copies is what
/// plannings were measured to take (its thread's peak of memory held, above what it held
/// when it started, less those copies): a running estimate of this quantile of them, moved a
/// 64th of itself at each planning ([`learn`]). Held at [`REQUEST_BASE_BYTES`], 64 clients'
/// reservations at 128 MiB with Redis came to 10–16 MiB (sampled) and memory was refused to
/// 6% of the requests over 30 minutes (17% before the planning's part counted only while it
/// runs), where plannings were measured to take a mean of 25–30 KiB in the first 100 s (none
/// of 225,078 over 256 KiB) and 87 KiB over the first 15 minutes (the conversations grow;
/// none of 689,214 over 512 KiB).
pub const PLANNING_QUANTILE: f64 = 0.9;

/// The least and the most the measured part of a planning is taken as.
pub const PLANNING_FLOOR_BYTES: u64 = 16 * 1024;
pub const PLANNING_CEILING_BYTES: u64 = 64 << 20;

/// The running estimate of [`PLANNING_QUANTILE`] of what plannings take, after one more took
/// `seen` bytes: up a 64th if `seen` is more, down (1 − q) / q of that if not (a ninth at
/// 0.9), so it rests where a share 1 − q of the plannings take more; within
/// [`PLANNING_FLOOR_BYTES`] and [`PLANNING_CEILING_BYTES`].
pub fn learn(current: u64, seen: u64) -> u64 {
    let step = (current / 64).max(64);
    let next = if seen > current {
        current.saturating_add(step)
    } else {
        let down = step as f64 * (1.0 - PLANNING_QUANTILE) / PLANNING_QUANTILE;
        current.saturating_sub(down as u64)
    };
    next.clamp(PLANNING_FLOOR_BYTES, PLANNING_CEILING_BYTES)
}

/// Copies of its body a memory request holds at once, at most: the bytes read, the parsed
/// messages, the assembled prompt, the body forwarded.
pub const BODY_COPIES: u64 = 4;

/// The body size assumed when a request does not announce one (chunked).
pub const UNKNOWN_BODY_BYTES: u64 = 1024 * 1024;

/// What a request is assumed to take once its prompt is forwarded, besides the prompt: its
/// answer read (a JSON answer whole, a stream's reply as it passes), parsed and committed
/// ([`Reservation::settle`]).
pub const ANSWER_BYTES: u64 = 64 * 1024;

/// What a request with a body of `body_len` bytes (`None`: not announced) is assumed to take
/// until its response is done with, before anything was measured: for admin requests that
/// read or build a whole body.
pub fn estimate(body_len: Option<u64>) -> u64 {
    estimate_with(REQUEST_BASE_BYTES, body_len)
}

/// [`estimate`] with `base` for the part besides the body's copies.
fn estimate_with(base: u64, body_len: Option<u64>) -> u64 {
    base.saturating_add(
        body_len
            .unwrap_or(UNKNOWN_BODY_BYTES)
            .saturating_mul(BODY_COPIES),
    )
}

/// Why a request was not admitted: the `reason` label of `memproxy_admission_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pressure {
    /// The RSS alone has reached the high-water mark.
    Resident,
    /// The RSS is under it, but not with the requests in flight and this one added.
    InFlight,
}

impl Pressure {
    pub const ALL: [Pressure; 2] = [Pressure::Resident, Pressure::InFlight];

    pub fn as_str(self) -> &'static str {
        match self {
            Pressure::Resident => "resident",
            Pressure::InFlight => "in_flight",
        }
    }
}

/// The admission decision: a request estimated at `request` bytes is admitted when the
/// `resident` memory, the bytes `reserved` by requests in flight and its own estimate stay
/// within `high_water`. With no reading (`None`) everything is admitted.
pub fn decide(
    high_water: u64,
    resident: Option<u64>,
    reserved: u64,
    request: u64,
) -> Result<(), Pressure> {
    let Some(resident) = resident else {
        return Ok(());
    };
    if resident >= high_water {
        return Err(Pressure::Resident);
    }
    if resident.saturating_add(reserved).saturating_add(request) > high_water {
        return Err(Pressure::InFlight);
    }
    Ok(())
}

/// The budget, the readings and the reservations of one process.
#[derive(Debug)]
pub struct MemoryGuard {
    budget: MemoryBudget,
    resident: Arc<Resident>,
    in_flight: Arc<InFlight>,
    relief: Arc<Relief>,
    /// Requests are being refused: logged when it starts and when it ends, not once per
    /// request, and at most once per [`LOG_EVERY`] each (near the mark admission flips often).
    refusing: AtomicBool,
    /// Milliseconds after the guard's start of the last such log line ([`NEVER_READ`]: none).
    logged_at_ms: AtomicU64,
}

/// The least time between two log lines saying the mark was reached or left.
const LOG_EVERY: Duration = Duration::from_secs(60);

impl MemoryGuard {
    pub fn new(budget: MemoryBudget) -> MemoryGuard {
        let resident = Arc::new(Resident::new());
        let in_flight = Arc::new(InFlight::default());
        MemoryGuard {
            budget,
            relief: Arc::new(Relief {
                budget,
                marks: Marks::of(&budget),
                stored_messages: Mutex::default(),
                pretended_messages: AtomicU64::new(NOT_PRETENDING),
                overdraft: AtomicU64::new(0),
                messages: AtomicU64::new(0),
                store_grows: AtomicBool::new(true),
                resident: Arc::clone(&resident),
                in_flight: Arc::clone(&in_flight),
                caches: Mutex::default(),
                shrinks: AtomicU64::new(0),
                state: AtomicU64::new(PressureState::Calm as u64),
            }),
            resident,
            in_flight,
            refusing: AtomicBool::new(false),
            logged_at_ms: AtomicU64::new(NEVER_READ),
        }
    }

    /// The budget this guard keeps to.
    pub fn budget(&self) -> &MemoryBudget {
        &self.budget
    }

    /// The caches shrunk under pressure, and what was done to them.
    pub fn relief(&self) -> &Arc<Relief> {
        &self.relief
    }

    /// Starts holding `caches` to the budget: a thread that runs [`Relief::relieve`] every
    /// [`RELIEF_EVERY`] until this guard is dropped. Where the RSS cannot be read, the caches
    /// keep their sizes and no thread starts.
    ///
    /// `stored` (an embedded engine's) tells about how many messages the store holds: with
    /// sled, whose memory grows with them past the budget's reserve, what it needs beyond is
    /// taken from the caches' sizes ([`MemoryBudget::store_overdraft`]); with fjall they are
    /// only counted.
    pub fn watch(&self, caches: Vec<Arc<dyn Shrink>>, stored: Option<Stored>) {
        *lock(&self.relief.caches) = caches;
        if let Some(stored) = stored {
            self.relief
                .store_grows
                .store(stored.grows, Ordering::Relaxed);
            *lock(&self.relief.stored_messages) = Some(stored.count);
        }
        if read_resident().is_none() {
            return;
        }
        let relief: Weak<Relief> = Arc::downgrade(&self.relief);
        let started = std::thread::Builder::new()
            .name("memproxy-relief".to_string())
            .spawn(move || {
                loop {
                    std::thread::sleep(RELIEF_EVERY);
                    let Some(relief) = relief.upgrade() else {
                        return;
                    };
                    relief.relieve();
                }
            });
        if let Err(err) = started {
            tracing::warn!(error = %err, "the memory relief thread could not start: caches keep their sizes");
        }
    }

    /// Why memory is off for new requests right now, or `None` when it is on: for `/readyz`.
    pub fn memory_off_reason(&self) -> Option<String> {
        let resident = self.resident.bytes()?;
        let high_water = self.budget.high_water;
        (resident >= high_water).then(|| {
            let floors = if self.relief.at_floors() {
                "; the caches are at their floors"
            } else {
                "; the caches are being shrunk"
            };
            format!(
                "resident memory {} MiB has reached the high-water mark {} MiB of server.memory_budget {} MiB{floors}{}",
                resident >> 20,
                high_water >> 20,
                self.budget.total >> 20,
                self.store_outgrown().unwrap_or_default()
            )
        })
    }

    /// When the store has outgrown the budget's reserve for it (its memory grows with what
    /// is stored: [`MemoryBudget::store_overdraft`]), what it needs and the budget that would
    /// hold it, for the reason memory is off: raising the budget is then the remedy, not
    /// waiting.
    fn store_outgrown(&self) -> Option<String> {
        if self.relief.store_overdraft() == 0 {
            return None;
        }
        let messages = self.relief.store_messages();
        Some(format!(
            "; the store's {messages} messages need about {} MiB past sled's page cache where the budget reserves {} MiB: server.memory_budget = \"{}MiB\" holds them",
            self.budget.engine_need(messages) >> 20,
            self.budget.engine_reserve >> 20,
            self.budget.budget_for_messages(messages) >> 20
        ))
    }

    /// Admits a chat request with a body of `body_len` bytes on its whole [`estimate`], and
    /// reserves one copy of its body (what reading it takes): the rest (the other copies and
    /// what a planning takes besides) is reserved when a thread starts its planning
    /// ([`Reservation::plan_start`]). A request waits for its
    /// body and for a thread to plan on (under 64 clients on two cores most do, for most of
    /// their time) with only that reserved; whole, 64 such estimates alone (full-history
    /// bodies of tens of KiB, four times over) passed the room the caches at their floors left
    /// at 128 MiB while the RSS showed none of it.
    ///
    /// Refused only for the reservations in flight (it would fit with the RSS alone), it waits
    /// up to `wait` (`server.memory_wait`) for them to give room back, tried again each time one is
    /// given back or the relief ticks; refused for the RSS, or for its own size, it is refused
    /// at once.
    pub async fn admit_request(
        &self,
        body_len: Option<u64>,
        wait: Duration,
    ) -> Result<Reservation, Pressure> {
        let high_water = self.budget.high_water;
        let first = self.try_request(body_len);
        let estimate = match &first {
            Err(refused) if !wait.is_zero() && refused.only_for_others(high_water) => {
                refused.estimate
            }
            _ => return self.noted(first),
        };
        let deadline = tokio::time::Instant::now() + wait;
        let in_flight = &self.in_flight;
        let _waiting = Waiting::on(in_flight, estimate);
        let outcome = loop {
            // Made before trying: room given back in between wakes it (`notify_waiters`
            // wakes every `Notified` made before it, polled or not).
            let given_back = in_flight.room.notified();
            let tried = self.try_request(body_len);
            if !matches!(&tried, Err(refused) if refused.only_for_others(high_water)) {
                break tried;
            }
            if tokio::time::timeout_at(deadline, given_back).await.is_err() {
                break self.try_request(body_len);
            }
        };
        let counter = if outcome.is_ok() {
            &in_flight.waited_admitted
        } else {
            &in_flight.waited_refused
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.noted(outcome)
    }

    /// One try of [`MemoryGuard::admit_request`], not logged.
    fn try_request(&self, body_len: Option<u64>) -> Result<Reservation, Refused> {
        let base = self.in_flight.planning.load(Ordering::Relaxed);
        let mut reservation = self.try_admit(estimate_with(base, body_len))?;
        let held = body_len.unwrap_or(UNKNOWN_BODY_BYTES);
        let pending = reservation.bytes - held;
        self.in_flight.reserved.fetch_sub(pending, Ordering::AcqRel);
        reservation.bytes = held;
        reservation.plan = PlanStart(Some(Arc::new(PlanPart {
            bytes: pending,
            copies: pending - base,
            stage: AtomicU8::new(PlanPart::WAITING),
            in_flight: Arc::clone(&self.in_flight),
        })));
        Ok(reservation)
    }

    /// Admits a request estimated at `estimate` bytes ([`estimate`]), reserving them until
    /// the returned [`Reservation`] is dropped; or says why not, at once.
    pub fn admit(&self, estimate: u64) -> Result<Reservation, Pressure> {
        self.noted(self.try_admit(estimate))
    }

    /// One decision, not logged: the reservation, or why not.
    fn try_admit(&self, estimate: u64) -> Result<Reservation, Refused> {
        let resident = self.resident.bytes();
        let in_flight = &self.in_flight;
        // Reserved only if admitted (a refused try never counts for a moment: 64 requests
        // waiting for room try at once).
        let mut before = in_flight.reserved.load(Ordering::SeqCst);
        loop {
            if let Err(pressure) = decide(self.budget.high_water, resident, before, estimate) {
                return Err(Refused {
                    pressure,
                    resident,
                    reserved: before,
                    estimate,
                });
            }
            match in_flight.reserved.compare_exchange_weak(
                before,
                before.saturating_add(estimate),
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break,
                Err(now) => before = now,
            }
        }
        in_flight
            .peak
            .fetch_max(before.saturating_add(estimate), Ordering::AcqRel);
        Ok(Reservation {
            bytes: estimate,
            plan: PlanStart(None),
            in_flight: Arc::clone(&self.in_flight),
        })
    }

    /// The decision made: logged when admission starts or stops refusing.
    fn noted(&self, decided: Result<Reservation, Refused>) -> Result<Reservation, Pressure> {
        match decided {
            Ok(reservation) => {
                if self.refusing.swap(false, Ordering::Relaxed) && self.may_log() {
                    tracing::info!(
                        resident_mib = self.resident.bytes().unwrap_or(0) >> 20,
                        "under the memory high-water mark again: memory on for new requests"
                    );
                }
                Ok(reservation)
            }
            Err(refused) => {
                if !self.refusing.swap(true, Ordering::Relaxed) && self.may_log() {
                    tracing::warn!(
                        resident_mib = refused.resident.unwrap_or(0) >> 20,
                        reserved_mib = refused.reserved >> 20,
                        high_water_mib = self.budget.high_water >> 20,
                        budget_mib = self.budget.total >> 20,
                        reason = refused.pressure.as_str(),
                        "memory high-water mark reached: new chat requests are served with memory off"
                    );
                }
                Err(refused.pressure)
            }
        }
    }

    /// True at most once per [`LOG_EVERY`].
    fn may_log(&self) -> bool {
        let now = self.resident.now_ms();
        let last = self.logged_at_ms.load(Ordering::Relaxed);
        (last == NEVER_READ || now.saturating_sub(last) >= LOG_EVERY.as_millis() as u64)
            && self
                .logged_at_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// The process's resident memory as last read (read again if the reading is older than
    /// [`SAMPLE_INTERVAL`]); `None` where it cannot be read.
    pub fn resident_bytes(&self) -> Option<u64> {
        self.resident.bytes()
    }

    /// Bytes reserved by the requests admitted and not yet done with.
    pub fn reserved_bytes(&self) -> u64 {
        self.in_flight.reserved.load(Ordering::Acquire)
    }

    /// What a planning is taken to need besides its body's copies now
    /// ([`PLANNING_QUANTILE`]).
    pub fn planning_bytes(&self) -> u64 {
        self.in_flight.planning.load(Ordering::Relaxed)
    }

    /// Requests waiting for room now ([`MemoryGuard::admit_request`]).
    pub fn waiting(&self) -> u64 {
        self.in_flight.waiting.load(Ordering::Relaxed)
    }

    /// Requests that waited for room since the start: admitted, and refused after all.
    pub fn waited(&self) -> (u64, u64) {
        (
            self.in_flight.waited_admitted.load(Ordering::Relaxed),
            self.in_flight.waited_refused.load(Ordering::Relaxed),
        )
    }

    /// Replaces what the store says it holds with `messages` (`None`: ask the store again).
    /// For tests, as [`MemoryGuard::pretend_resident`] does for the RSS.
    pub fn pretend_stored_messages(&self, messages: Option<u64>) {
        self.relief
            .pretended_messages
            .store(messages.unwrap_or(NOT_PRETENDING), Ordering::Release);
    }

    /// Replaces the readings of the RSS with `bytes` (`None`: read `/proc` again). For tests,
    /// as [`crate::store::Clock::advance`] moves the clock.
    pub fn pretend_resident(&self, bytes: Option<u64>) {
        self.resident
            .pretended
            .store(bytes.unwrap_or(NOT_PRETENDING), Ordering::Release);
    }
}

/// The bytes an admitted request reserved, given back when it is dropped (with the response
/// body, once sent or abandoned).
#[derive(Debug)]
pub struct Reservation {
    bytes: u64,
    /// Admitted on, reserved when its planning starts on a thread
    /// ([`MemoryGuard::admit_request`]).
    plan: PlanStart,
    in_flight: Arc<InFlight>,
}

impl Reservation {
    /// What starts the reservation of the planning's part, where the planning runs: on a
    /// runtime thread, or in the blocking pool once a thread takes it (a request queued for
    /// the pool has allocated nothing yet: under 64 clients most wait there, and each holding
    /// its whole estimate refused memory with the RSS mostly 13–18 MiB under the mark).
    pub fn plan_start(&self) -> PlanStart {
        self.plan.clone()
    }

    /// The request's prompt of `prompt` bytes is forwarded: its planning's temporaries are
    /// freed, and it keeps the prompt and [`ANSWER_BYTES`] for its answer, never more than it
    /// held (a request whose planning never started keeps its body's copy at most), and its
    /// planning's part, if it had not started, never starts.
    pub fn settle(&mut self, prompt: u64) {
        let held = self.bytes.saturating_add(self.plan.end());
        let keep = held.min(prompt.saturating_add(ANSWER_BYTES));
        self.in_flight.give_back(held - keep);
        self.bytes = keep;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let held = self.bytes.saturating_add(self.plan.end());
        self.in_flight.give_back(held);
    }
}

/// Why [`MemoryGuard::try_admit`] did not admit, what it read, and the estimate it weighed.
#[derive(Debug)]
struct Refused {
    pressure: Pressure,
    resident: Option<u64>,
    reserved: u64,
    estimate: u64,
}

impl Refused {
    /// Refused only for what the requests in flight reserved: the estimate fits under
    /// `high_water` with the RSS as it was read alone, so waiting for them may make room.
    fn only_for_others(&self, high_water: u64) -> bool {
        self.pressure == Pressure::InFlight
            && decide(high_water, self.resident, 0, self.estimate).is_ok()
    }
}

/// A request counted in [`InFlight::waiting`], and its estimate in [`InFlight::wanted`],
/// while it lives.
struct Waiting<'a> {
    in_flight: &'a InFlight,
    estimate: u64,
}

impl<'a> Waiting<'a> {
    fn on(in_flight: &'a InFlight, estimate: u64) -> Waiting<'a> {
        in_flight.wanted.fetch_add(estimate, Ordering::Relaxed);
        in_flight.waiting.fetch_add(1, Ordering::SeqCst);
        Waiting {
            in_flight,
            estimate,
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.in_flight.waiting.fetch_sub(1, Ordering::SeqCst);
        self.in_flight
            .wanted
            .fetch_sub(self.estimate, Ordering::Relaxed);
    }
}

/// The planning's part of a request's reservation ([`Reservation::plan_start`]): counted from
/// [`PlanStart::now`] until the request settles or is dropped. Cheap to clone and `Send`, for
/// the closure planning in the blocking pool, which may start after the request was dropped
/// (a client gone): then it counts nothing.
#[derive(Debug, Clone, Default)]
pub struct PlanStart(Option<Arc<PlanPart>>);

#[derive(Debug)]
struct PlanPart {
    bytes: u64,
    /// Of `bytes`, the body's copies (the rest is the measured part: [`PLANNING_QUANTILE`]).
    copies: u64,
    /// [`PlanPart::WAITING`], [`PlanPart::COUNTED`] or [`PlanPart::ENDED`].
    stage: AtomicU8,
    in_flight: Arc<InFlight>,
}

impl PlanPart {
    const WAITING: u8 = 0;
    const COUNTED: u8 = 1;
    const ENDED: u8 = 2;
}

impl PlanStart {
    /// The planning starts: its part is reserved (the request was admitted on it already:
    /// [`MemoryGuard::admit_request`]). Once only; nothing once the request settled or was
    /// dropped.
    ///
    /// Call it on the thread the planning runs on, and [`PlanStart::done`] on the same thread
    /// once it is done, with nothing awaited between: that measures what it took.
    pub fn now(&self) {
        let Some(part) = &self.0 else {
            return;
        };
        crate::allocator::thread_peak_reset();
        let started = part.stage.compare_exchange(
            PlanPart::WAITING,
            PlanPart::COUNTED,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        if started.is_ok() {
            let before = part
                .in_flight
                .reserved
                .fetch_add(part.bytes, Ordering::AcqRel);
            part.in_flight
                .peak
                .fetch_max(before.saturating_add(part.bytes), Ordering::AcqRel);
        }
    }

    /// The planning started with [`PlanStart::now`] on this thread is done: what it took at
    /// most (its thread's peak since), learned for the next requests' estimates
    /// ([`PLANNING_QUANTILE`]) and returned; `None` where the allocator does not count, or
    /// for a request admitted without a planning part.
    pub fn done(&self) -> Option<u64> {
        let part = self.0.as_ref()?;
        let peak = crate::allocator::thread_peak()?;
        let besides_copies = peak.saturating_sub(part.copies);
        let planning = &part.in_flight.planning;
        // Two plannings done at once may each move it from the same value: one step is lost.
        let current = planning.load(Ordering::Relaxed);
        planning.store(learn(current, besides_copies), Ordering::Relaxed);
        Some(peak)
    }

    /// Ends the part: it never starts from now on. Its bytes if it had started (still
    /// counted in the reservations: the caller takes them off), else 0.
    fn end(&self) -> u64 {
        match &self.0 {
            Some(part)
                if part.stage.swap(PlanPart::ENDED, Ordering::AcqRel) == PlanPart::COUNTED =>
            {
                part.bytes
            }
            _ => 0,
        }
    }
}

/// What admission counts on top of the RSS: the reservations of the requests in flight.
#[derive(Debug)]
struct InFlight {
    reserved: AtomicU64,
    /// What a planning is taken to need besides its body's copies ([`PLANNING_QUANTILE`]).
    planning: AtomicU64,
    /// The most admission counted, an admitted request's estimate included, since the relief
    /// last looked ([`InFlight::take_peak`]).
    peak: AtomicU64,
    /// Requests waiting for room ([`MemoryGuard::admit_request`]), woken by `room`, and
    /// their estimates: the relief makes room for them as for the reservations.
    waiting: AtomicU64,
    wanted: AtomicU64,
    room: tokio::sync::Notify,
    /// Requests that waited for room: admitted, and refused after all.
    waited_admitted: AtomicU64,
    waited_refused: AtomicU64,
}

impl Default for InFlight {
    fn default() -> InFlight {
        InFlight {
            reserved: AtomicU64::new(0),
            planning: AtomicU64::new(REQUEST_BASE_BYTES),
            peak: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            wanted: AtomicU64::new(0),
            room: tokio::sync::Notify::new(),
            waited_admitted: AtomicU64::new(0),
            waited_refused: AtomicU64::new(0),
        }
    }
}

impl InFlight {
    /// A request gives back `bytes` it reserved: the requests waiting for room try again.
    fn give_back(&self, bytes: u64) {
        // Sequentially consistent with a waiter's count and its try: either it sees these
        // bytes given back, or this sees it waiting and wakes it.
        self.reserved.fetch_sub(bytes, Ordering::SeqCst);
        self.wake();
    }

    /// Wakes the requests waiting for room, if any.
    fn wake(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.room.notify_waiters();
        }
    }

    /// The most counted since the last call, or now if more: what the relief makes room for.
    /// Requests come and go between its ticks; what it read at a tick alone, with 64 clients
    /// a few MiB under the peaks that admission met, let the caches grow back into the room
    /// admission then found missing.
    fn take_peak(&self) -> u64 {
        let now = self.reserved.load(Ordering::Acquire);
        self.peak.swap(now, Ordering::AcqRel).max(now)
    }
}

const NOT_PRETENDING: u64 = u64::MAX;
const NEVER_READ: u64 = u64::MAX;

/// The RSS marks the relief works between (all under the high-water mark, so the caches give
/// memory back before any request is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marks {
    /// Above this the caches are shrunk: half a gap below the high-water mark, where the gap
    /// is what lies between the mark and the budget.
    pub shrink_above: u64,
    /// What a shrink aims the RSS at: a gap below the high-water mark.
    pub aim: u64,
    /// Under this the limits are lifted again, an eighth of each cache's size per tick: two
    /// gaps below the high-water mark.
    pub grow_below: u64,
}

impl Marks {
    pub fn of(budget: &MemoryBudget) -> Marks {
        let gap = budget.total.saturating_sub(budget.high_water);
        Marks {
            shrink_above: budget.high_water.saturating_sub(gap / 2),
            aim: budget.high_water.saturating_sub(gap),
            grow_below: budget.high_water.saturating_sub(2 * gap),
        }
    }
}

/// One cache's figures, as [`new_limits`] reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheFigures {
    pub bytes: u64,
    pub limit: u64,
    pub floor: u64,
    pub capacity: u64,
}

/// The limits the caches are held to next, for an RSS of `resident`: above
/// [`Marks::shrink_above`], what the RSS is over [`Marks::aim`] is taken from the caches, each
/// in proportion to what it holds over its floor; under [`Marks::grow_below`], each limit is
/// lifted by an eighth of its capacity; in between, the limits stay.
pub fn new_limits(resident: u64, marks: &Marks, caches: &[CacheFigures]) -> Vec<u64> {
    if resident > marks.shrink_above {
        let need = resident - marks.aim;
        let room: Vec<u64> = caches
            .iter()
            .map(|c| c.bytes.min(c.limit).saturating_sub(c.floor))
            .collect();
        let total: u64 = room.iter().sum();
        return caches
            .iter()
            .zip(&room)
            .map(|(c, &room)| {
                let take = if total == 0 {
                    0
                } else {
                    let share = u128::from(need) * u128::from(room) / u128::from(total);
                    u64::try_from(share).unwrap_or(u64::MAX).min(room)
                };
                (c.bytes.min(c.limit) - take).max(c.floor)
            })
            .collect();
    }
    caches
        .iter()
        .map(|c| {
            if resident < marks.grow_below {
                c.limit.saturating_add(c.capacity / 8).min(c.capacity)
            } else {
                c.limit
            }
        })
        .collect()
}

/// Where the relief stands: the `memproxy_memory_pressure` gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum PressureState {
    /// The RSS is under [`Marks::shrink_above`], or no reading.
    Calm = 0,
    /// The caches are being shrunk.
    Shrinking = 1,
    /// The caches are at their floors and the RSS is still above [`Marks::shrink_above`]:
    /// what is left is refused.
    AtFloors = 2,
}

/// Tells how many messages the store holds (`Store::stored_messages`: counted, not guessed).
pub type StoredMessages = Box<dyn Fn() -> u64 + Send + Sync>;

/// An embedded store as the guard watches it ([`MemoryGuard::watch`]).
pub struct Stored {
    pub count: StoredMessages,
    /// The engine's memory grows with what it stores past the budget's reserve (sled; fjall's
    /// caches bound its own).
    pub grows: bool,
}

/// The caches the guard shrinks under pressure, and what it did.
pub struct Relief {
    budget: MemoryBudget,
    marks: Marks,
    stored_messages: Mutex<Option<StoredMessages>>,
    /// A count tests set instead ([`NOT_PRETENDING`]: none).
    pretended_messages: AtomicU64,
    /// What the store needs beyond its reserve, taken from the caches' sizes (last tick).
    overdraft: AtomicU64,
    /// The messages the store held at the last tick (0 with Redis).
    messages: AtomicU64,
    /// Whether the store's share grows with them ([`Stored::grows`]; tests that pretend a
    /// count without a store: yes).
    store_grows: AtomicBool,
    resident: Arc<Resident>,
    /// The guard's reservations of the requests in flight ([`MemoryGuard::admit`]).
    in_flight: Arc<InFlight>,
    caches: Mutex<Vec<Arc<dyn Shrink>>>,
    /// Ticks that shrank a cache.
    shrinks: AtomicU64,
    state: AtomicU64,
}

impl std::fmt::Debug for Relief {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relief")
            .field("marks", &self.marks)
            .finish_non_exhaustive()
    }
}

impl Relief {
    /// The caches watched.
    pub fn caches(&self) -> Vec<Arc<dyn Shrink>> {
        lock(&self.caches).clone()
    }

    pub fn marks(&self) -> Marks {
        self.marks
    }

    /// What the store's memory needs beyond the budget's reserve for it, as of the last tick:
    /// the caches are held that much under their sizes.
    pub fn store_overdraft(&self) -> u64 {
        self.overdraft.load(Ordering::Relaxed)
    }

    /// The messages the store held as of the last tick (0 with Redis, whose memory is not
    /// this process's and whose writes other replicas share).
    pub fn store_messages(&self) -> u64 {
        self.messages.load(Ordering::Relaxed)
    }

    /// The store's share of the budget as of the last tick: its reserve, grown with what is
    /// stored (0 with Redis).
    pub fn store_share(&self) -> u64 {
        if self.budget.engine_reserve == 0 {
            0
        } else {
            self.budget.engine_reserve + self.store_overdraft()
        }
    }

    /// Each cache's size less its part of the store's overdraft (in proportion to its size),
    /// never under its floor.
    fn ceilings(&self, caches: &[Arc<dyn Shrink>]) -> Vec<u64> {
        let pretended = self.pretended_messages.load(Ordering::Acquire);
        let messages = if pretended == NOT_PRETENDING {
            lock(&self.stored_messages)
                .as_ref()
                .map_or(0, |count| count())
        } else {
            pretended
        };
        self.messages.store(messages, Ordering::Relaxed);
        let overdraft = if self.store_grows.load(Ordering::Relaxed) {
            self.budget.store_overdraft(messages)
        } else {
            0
        };
        let before = self.overdraft.swap(overdraft, Ordering::Relaxed);
        if overdraft > 0 && before == 0 {
            tracing::warn!(
                stored_messages = messages,
                store_needs_mib = self.budget.engine_need(messages) >> 20,
                reserve_mib = self.budget.engine_reserve >> 20,
                budget_mib = self.budget.total >> 20,
                budget_needed_mib = self.budget.budget_for_messages(messages) >> 20,
                "the store has outgrown the memory budget's reserve for it: the caches give up the difference; raise server.memory_budget"
            );
        }
        let total: u64 = caches.iter().map(|c| c.capacity()).sum();
        caches
            .iter()
            .map(|c| {
                let share = if total == 0 {
                    0
                } else {
                    let part = u128::from(overdraft) * u128::from(c.capacity()) / u128::from(total);
                    u64::try_from(part).unwrap_or(u64::MAX)
                };
                c.capacity()
                    .saturating_sub(share)
                    .max(c.capacity() / crate::cache::FLOOR_DIVISOR)
            })
            .collect()
    }

    /// Ticks that shrank a cache, since the start.
    pub fn shrinks(&self) -> u64 {
        self.shrinks.load(Ordering::Relaxed)
    }

    pub fn state(&self) -> PressureState {
        match self.state.load(Ordering::Relaxed) {
            1 => PressureState::Shrinking,
            2 => PressureState::AtFloors,
            _ => PressureState::Calm,
        }
    }

    fn at_floors(&self) -> bool {
        self.state() == PressureState::AtFloors
    }

    /// One tick: reads the RSS afresh, sets each cache's limit ([`new_limits`]) and, when
    /// anything was evicted, gives the freed pages back to the system.
    ///
    /// What it weighs is the RSS with the reservations of the requests in flight on top, as
    /// admission does: a steady load's reservations (about 4 MiB for the soak's 16 clients,
    /// `memproxy_memory_in_flight_bytes`) would otherwise keep admission past the mark while the
    /// caches, under the mark by the RSS alone, stayed full, and memory would be refused where
    /// shrinking could make room. The reservations weighed are the most admission counted
    /// since the last tick ([`InFlight::take_peak`]), not what a tick happens to find, and the
    /// estimates of the requests waiting for room.
    pub fn relieve(&self) {
        let Some(resident) = self.resident.read_now() else {
            return;
        };
        let reserved = self
            .in_flight
            .take_peak()
            .saturating_add(self.in_flight.wanted.load(Ordering::Relaxed));
        let weighed = resident.saturating_add(reserved);
        let caches = self.caches();
        let ceilings = self.ceilings(&caches);
        let figures: Vec<CacheFigures> = caches
            .iter()
            .zip(&ceilings)
            .map(|(c, &ceiling)| CacheFigures {
                bytes: c.weighted_bytes(),
                limit: c.limit().min(ceiling),
                floor: c.capacity() / crate::cache::FLOOR_DIVISOR,
                capacity: ceiling,
            })
            .collect();
        let limits = new_limits(weighed, &self.marks, &figures);
        let mut freed = 0;
        for (cache, limit) in caches.iter().zip(limits) {
            freed += cache.limit_to(limit);
        }
        let state = if weighed <= self.marks.shrink_above {
            PressureState::Calm
        } else if figures.iter().all(|c| c.bytes.min(c.limit) <= c.floor) {
            PressureState::AtFloors
        } else {
            PressureState::Shrinking
        };
        let before = self.state.swap(state as u64, Ordering::Relaxed);
        if before != state as u64 {
            tracing::info!(
                resident_mib = resident >> 20,
                reserved_mib = reserved >> 20,
                shrink_above_mib = self.marks.shrink_above >> 20,
                state = ?state,
                "memory pressure changed"
            );
        }
        if freed > 0 {
            self.shrinks.fetch_add(1, Ordering::Relaxed);
        }
        // Freed pages the allocator keeps count in the RSS as much as the caches do: ask for
        // them back after an eviction, and every tick while the RSS is past the mark (what
        // requests freed since may be held too).
        if freed > 0 || state != PressureState::Calm {
            crate::allocator::release();
            // The next admission reads the RSS the release left.
            self.resident.expire();
        }
        // A new reading may leave room for the requests waiting for it.
        self.in_flight.wake();
    }
}

/// Locks one of the relief's lists; a panic while it was held left it whole (it is only
/// replaced).
fn lock<T>(held: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    held.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The sampled RSS: the last reading and when it was made.
#[derive(Debug)]
struct Resident {
    origin: Instant,
    /// Milliseconds after `origin` of the last reading ([`NEVER_READ`] before the first).
    read_at_ms: AtomicU64,
    /// The last reading in bytes; 0: it could not be read.
    last: AtomicU64,
    /// A reading tests set instead ([`NOT_PRETENDING`]: none).
    pretended: AtomicU64,
}

impl Resident {
    fn new() -> Resident {
        Resident {
            origin: Instant::now(),
            read_at_ms: AtomicU64::new(NEVER_READ),
            last: AtomicU64::new(0),
            pretended: AtomicU64::new(NOT_PRETENDING),
        }
    }

    /// Milliseconds since this was made.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    /// A reading made now (or the pretended one).
    fn read_now(&self) -> Option<u64> {
        let pretended = self.pretended.load(Ordering::Acquire);
        if pretended != NOT_PRETENDING {
            return Some(pretended);
        }
        let bytes = read_resident()?;
        self.last.store(bytes, Ordering::Release);
        self.read_at_ms.store(self.now_ms(), Ordering::Release);
        Some(bytes)
    }

    /// Makes the next [`Resident::bytes`] read the RSS again.
    fn expire(&self) {
        self.read_at_ms.store(NEVER_READ, Ordering::Release);
    }

    fn bytes(&self) -> Option<u64> {
        let pretended = self.pretended.load(Ordering::Acquire);
        if pretended != NOT_PRETENDING {
            return Some(pretended);
        }
        let now = self.now_ms();
        let read_at = self.read_at_ms.load(Ordering::Acquire);
        let stale = read_at == NEVER_READ
            || now.saturating_sub(read_at) >= SAMPLE_INTERVAL.as_millis() as u64;
        // One caller reads; the others use the reading it replaces until it is done.
        if stale
            && self
                .read_at_ms
                .compare_exchange(read_at, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.last
                .store(read_resident().unwrap_or(0), Ordering::Release);
        }
        Some(self.last.load(Ordering::Acquire)).filter(|&bytes| bytes > 0)
    }
}

/// The resident memory of this process: `VmRSS` of `/proc/self/status`, in bytes.
fn read_resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    vm_rss_bytes(&status)
}

/// `VmRSS:    12345 kB` → bytes.
fn vm_rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    let mut words = line.split_whitespace();
    let kb: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;
    const WAIT: Duration = crate::config::DEFAULT_MEMORY_WAIT;

    impl MemoryGuard {
        /// [`MemoryGuard::admit_request`] without waiting.
        fn request_now(&self, body_len: Option<u64>) -> Result<Reservation, Pressure> {
            self.noted(self.try_request(body_len))
        }
    }

    #[test]
    fn requests_are_admitted_while_everything_stays_under_the_high_water_mark() {
        let high = 176 * MIB;
        // (resident, reserved, request) → decision.
        let cases = [
            (Some(100 * MIB), 0, MIB, Ok(())),
            (Some(100 * MIB), 70 * MIB, 6 * MIB, Ok(())),
            (
                Some(100 * MIB),
                70 * MIB,
                6 * MIB + 1,
                Err(Pressure::InFlight),
            ),
            (Some(175 * MIB), 0, MIB, Ok(())),
            (Some(175 * MIB), 0, MIB + 1, Err(Pressure::InFlight)),
            (Some(176 * MIB), 0, 0, Err(Pressure::Resident)),
            (Some(300 * MIB), 0, 1, Err(Pressure::Resident)),
            // One request larger than all the room there is.
            (Some(60 * MIB), 0, 200 * MIB, Err(Pressure::InFlight)),
            (Some(60 * MIB), u64::MAX, u64::MAX, Err(Pressure::InFlight)),
            // No reading: admitted.
            (None, u64::MAX, u64::MAX, Ok(())),
        ];
        for (resident, reserved, request, expected) in cases {
            assert_eq!(
                decide(high, resident, reserved, request),
                expected,
                "{resident:?} {reserved} {request}"
            );
        }
    }

    #[test]
    fn the_estimate_counts_the_body_several_times_and_a_fixed_part() {
        assert_eq!(estimate(Some(0)), REQUEST_BASE_BYTES);
        assert_eq!(estimate(Some(MIB)), REQUEST_BASE_BYTES + 4 * MIB);
        assert_eq!(estimate(None), estimate(Some(UNKNOWN_BODY_BYTES)));
        assert_eq!(estimate(Some(u64::MAX)), u64::MAX);
    }

    #[test]
    fn reservations_count_until_dropped() {
        let guard = MemoryGuard::new(crate::config::split_memory_budget(192 * MIB));
        guard.pretend_resident(Some(100 * MIB));
        let first = guard.admit(40 * MIB).unwrap();
        let second = guard.admit(30 * MIB).unwrap();
        assert_eq!(guard.reserved_bytes(), 70 * MIB);
        // 100 + 70 + 7 > 176.
        assert_eq!(guard.admit(7 * MIB).unwrap_err(), Pressure::InFlight);
        assert_eq!(guard.reserved_bytes(), 70 * MIB);
        drop(first);
        let third = guard.admit(7 * MIB).unwrap();
        assert_eq!(guard.reserved_bytes(), 37 * MIB);
        guard.pretend_resident(Some(180 * MIB));
        assert_eq!(guard.admit(1).unwrap_err(), Pressure::Resident);
        drop((second, third));
        assert_eq!(guard.reserved_bytes(), 0);
        guard.pretend_resident(Some(120 * MIB));
        assert!(guard.admit(MIB).is_ok());
    }

    #[test]
    fn a_forwarded_request_keeps_its_prompt_and_its_answer_s_part() {
        let guard = MemoryGuard::new(crate::config::split_memory_budget(192 * MIB));
        guard.pretend_resident(Some(100 * MIB));
        let mut planned = guard.admit(70 * MIB).unwrap();
        // 100 + 70 + 7 > 176.
        assert_eq!(guard.admit(7 * MIB).unwrap_err(), Pressure::InFlight);
        planned.settle(2 * MIB);
        assert_eq!(guard.reserved_bytes(), 2 * MIB + ANSWER_BYTES);
        let next = guard.admit(7 * MIB).unwrap();
        // Settling never raises a reservation.
        planned.settle(10 * MIB);
        assert_eq!(guard.reserved_bytes(), 9 * MIB + ANSWER_BYTES);
        drop((planned, next));
        assert_eq!(guard.reserved_bytes(), 0);
    }

    #[test]
    fn a_request_is_admitted_on_its_whole_estimate_and_holds_its_plan_s_part_while_planning() {
        let guard = MemoryGuard::new(crate::config::split_memory_budget(192 * MIB));
        let high = guard.budget().high_water;
        let body = 64 * 1024;
        // Admitted only with room for all of it, body and plan.
        guard.pretend_resident(Some(high - estimate(Some(body)) + 1));
        assert_eq!(
            guard.request_now(Some(body)).unwrap_err(),
            Pressure::InFlight
        );
        assert_eq!(guard.reserved_bytes(), 0);
        guard.pretend_resident(Some(high - estimate(Some(body))));
        let mut request = guard.request_now(Some(body)).unwrap();
        // Waiting for its body and a thread: one copy of the body.
        assert_eq!(guard.reserved_bytes(), body);
        request.plan_start().now();
        assert_eq!(guard.reserved_bytes(), estimate(Some(body)));
        request.settle(body);
        assert_eq!(guard.reserved_bytes(), body + ANSWER_BYTES);
        drop(request);
        assert_eq!(guard.reserved_bytes(), 0);
        // Not announced: a megabyte assumed.
        guard.pretend_resident(Some(MIB));
        let chunked = guard.request_now(None).unwrap();
        assert_eq!(guard.reserved_bytes(), UNKNOWN_BODY_BYTES);
        let start = chunked.plan_start();
        start.now();
        start.now();
        chunked.plan_start().now();
        assert_eq!(guard.reserved_bytes(), estimate(None));
        drop(chunked);
        assert_eq!(guard.reserved_bytes(), 0);
    }

    #[test]
    fn a_planning_part_counts_only_between_its_start_and_the_request_s_end() {
        let guard = MemoryGuard::new(crate::config::split_memory_budget(192 * MIB));
        guard.pretend_resident(Some(100 * MIB));
        let body = 100 * 1024;
        let plan_part = estimate(Some(body)) - body;
        // Started on a pool's thread after the request was dropped (its client gone): nothing.
        let gone = guard.request_now(Some(body)).unwrap();
        let late = gone.plan_start();
        drop(gone);
        late.now();
        assert_eq!(guard.reserved_bytes(), 0);
        // Never started (a side call, a failure before planning): its body's copy, settled.
        let mut unplanned = guard.request_now(Some(body)).unwrap();
        let start = unplanned.plan_start();
        unplanned.settle(body);
        assert_eq!(guard.reserved_bytes(), body);
        start.now();
        assert_eq!(guard.reserved_bytes(), body, "settled: never starts");
        drop(unplanned);
        assert_eq!(guard.reserved_bytes(), 0);
        // Started, then the request is dropped before its prompt went: all of it given back.
        let planning = guard.request_now(Some(body)).unwrap();
        guard.in_flight.take_peak();
        planning.plan_start().now();
        assert_eq!(guard.reserved_bytes(), body + plan_part);
        assert_eq!(
            guard.in_flight.take_peak(),
            body + plan_part,
            "the relief sees the start"
        );
        drop(planning);
        assert_eq!(guard.reserved_bytes(), 0);
        // A prompt larger than the body: kept up to what was held.
        let mut grown = guard.request_now(Some(body)).unwrap();
        grown.plan_start().now();
        grown.settle(3 * body);
        assert_eq!(guard.reserved_bytes(), 3 * body + ANSWER_BYTES);
        drop(grown);
        assert_eq!(guard.reserved_bytes(), 0);
    }

    /// The running estimate rests where about a tenth of the plannings take more, from the
    /// first guess down and back up when plannings come to take more; never under the floor.
    #[test]
    fn the_planning_estimate_settles_at_the_ninetieth_percentile() {
        // Plannings taking 1..=100 KiB, in a scrambled order (a multiplicative step mod 101).
        let seen = |i: u64| ((i * 37) % 101).max(1) * 1024;
        let rest = |mut current: u64, rounds: u64, scale: u64| {
            for i in 0..rounds {
                current = learn(current, scale * seen(i));
            }
            current
        };
        let down = rest(REQUEST_BASE_BYTES, 20_000, 1);
        assert!((85 * 1024..=95 * 1024).contains(&down), "{down}");
        let up = rest(down, 20_000, 8);
        assert!((680 * 1024..=760 * 1024).contains(&up), "{up}");
        assert_eq!(rest(up, 100_000, 0), PLANNING_FLOOR_BYTES);
        assert_eq!(
            learn(PLANNING_CEILING_BYTES, u64::MAX),
            PLANNING_CEILING_BYTES
        );
    }

    /// With jemalloc, what a planning held at most (on its thread, between `now` and `done`)
    /// is measured, and the next requests' planning parts follow it.
    #[cfg(all(feature = "jemalloc", target_os = "linux"))]
    #[test]
    fn a_planning_s_measured_peak_becomes_the_next_requests_part() {
        let guard = MemoryGuard::new(crate::config::split_memory_budget(1024 * MIB));
        guard.pretend_resident(Some(100 * MIB));
        let body = 1024;
        let mut taken = 0;
        for _ in 0..2_000 {
            let mut request = guard.request_now(Some(body)).unwrap();
            let start = request.plan_start();
            start.now();
            let held = std::hint::black_box(vec![1u8; 40 << 10]);
            drop(held);
            taken = start.done().expect("jemalloc counts");
            request.settle(body);
        }
        assert!((40 << 10..48 << 10).contains(&taken), "{taken}");
        // Learned less the body's copies, which are reserved on their own.
        let learned = guard.planning_bytes();
        assert!(
            ((40 << 10) - 4 * body..48 << 10).contains(&learned),
            "from {REQUEST_BASE_BYTES} down to what plannings took: {learned}"
        );
        let request = guard.request_now(Some(body)).unwrap();
        request.plan_start().now();
        assert_eq!(guard.reserved_bytes(), BODY_COPIES * body + learned);
        // A request admitted before without a planning part measures nothing.
        assert_eq!(PlanStart::default().done(), None);
    }

    /// Short of room only for the reservations in flight, a request waits for them to give
    /// it back (woken when they do), up to the wait; short for the RSS or its own size, it is
    /// refused at once.
    #[tokio::test(start_paused = true)]
    async fn a_request_short_of_room_for_the_reservations_waits_for_them() {
        use tokio::time::Instant;
        let guard = Arc::new(MemoryGuard::new(crate::config::split_memory_budget(
            192 * MIB,
        )));
        let high = guard.budget().high_water;
        guard.pretend_resident(Some(100 * MIB));
        let body = 64 * 1024;
        let held = guard.admit(high - 100 * MIB - 64 * 1024).unwrap();
        let waiter = {
            let guard = Arc::clone(&guard);
            tokio::spawn(async move {
                let started = Instant::now();
                let admitted = guard.admit_request(Some(body), WAIT).await;
                (admitted.map(drop), started.elapsed())
            })
        };
        tokio::time::sleep(WAIT / 4).await;
        assert_eq!(guard.waiting(), 1);
        drop(held);
        let (admitted, waited) = waiter.await.unwrap();
        assert_eq!(admitted, Ok(()));
        assert_eq!(waited, WAIT / 4, "woken as the room was given back");
        assert_eq!((guard.waiting(), guard.waited()), (0, (1, 0)));
        assert_eq!(guard.reserved_bytes(), 0);

        // Never given back: refused once the wait is over.
        let held = guard.admit(high - 100 * MIB - 64 * 1024).unwrap();
        let started = Instant::now();
        let refused = guard.admit_request(Some(body), WAIT).await;
        assert_eq!(refused.unwrap_err(), Pressure::InFlight);
        assert_eq!(started.elapsed(), WAIT);
        assert_eq!(guard.waited(), (1, 1));
        // A small reservation given back that still leaves too little (the request's estimate
        // is 512 KiB): waits on.
        drop(held);
        let held = guard.admit(high - 100 * MIB - 384 * 1024).unwrap();
        let small = guard.admit(64 * 1024).unwrap();
        let waiter = {
            let guard = Arc::clone(&guard);
            tokio::spawn(async move { guard.admit_request(Some(body), WAIT).await.map(drop) })
        };
        tokio::time::sleep(WAIT / 4).await;
        drop(small);
        tokio::time::sleep(WAIT / 4).await;
        assert_eq!(guard.waiting(), 1, "384 KiB is not enough");
        drop(held);
        assert_eq!(waiter.await.unwrap(), Ok(()));
        assert_eq!(guard.waited(), (2, 1));

        // The RSS at the mark, or a request larger than all the room: refused at once.
        let started = Instant::now();
        guard.pretend_resident(Some(high));
        let at_mark = guard.admit_request(Some(body), WAIT).await;
        assert_eq!(at_mark.unwrap_err(), Pressure::Resident);
        guard.pretend_resident(Some(high - 2 * MIB));
        let too_large = guard.admit_request(Some(MIB), WAIT).await;
        assert_eq!(too_large.unwrap_err(), Pressure::InFlight);
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(guard.waited(), (2, 1));
        assert_eq!(guard.reserved_bytes(), 0);
    }

    #[test]
    fn the_relief_weighs_the_most_admission_counted_since_its_last_tick() {
        let guard = MemoryGuard::new(crate::config::split_memory_budget(192 * MIB));
        guard.pretend_resident(Some(100 * MIB));
        let in_flight = &guard.in_flight;
        let first = guard.admit(30 * MIB).unwrap();
        let second = guard.admit(20 * MIB).unwrap();
        drop((first, second));
        let third = guard.admit(5 * MIB).unwrap();
        // Refused: not counted.
        assert!(guard.admit(100 * MIB).is_err());
        assert_eq!(guard.reserved_bytes(), 5 * MIB);
        assert_eq!(in_flight.take_peak(), 50 * MIB);
        // From then on, what is in flight at the tick, or a higher peak since.
        assert_eq!(in_flight.take_peak(), 5 * MIB);
        drop(third);
        assert_eq!(in_flight.take_peak(), 5 * MIB);
        assert_eq!(in_flight.take_peak(), 0);
    }

    /// A state cache of 8 MiB, filled with 120 entries of 64 KiB.
    fn full_cache() -> Arc<crate::cache::Cache<u64, u64>> {
        let cache = Arc::new(crate::cache::Cache::new(
            "state",
            8 * MIB,
            crate::cache::Policy::Lru,
            |_: &u64, _: &u64| (64 << 10) as u32,
        ));
        for key in 0..120u64 {
            cache.insert(key, key);
        }
        cache
    }

    #[test]
    fn the_reservations_in_flight_make_the_caches_give_room_before_admission_refuses() {
        let guard = MemoryGuard::new(crate::config::split_memory_budget(192 * MIB));
        let marks = guard.relief().marks();
        let cache = full_cache();
        let full = cache.weighted_size();
        assert!(full > 6 * MIB, "{full}");
        guard.watch(vec![Arc::clone(&cache) as Arc<dyn Shrink>], None);
        // The RSS alone is under the shrink mark: the caches stay as they are.
        guard.pretend_resident(Some(marks.shrink_above - 4 * MIB));
        guard.relief().relieve();
        assert_eq!(cache.limit(), cache.capacity());
        // With requests in flight reserving 8 MiB on top, they give room.
        let in_flight = guard.admit(8 * MIB).unwrap();
        guard.relief().relieve();
        assert!(cache.limit() < cache.capacity(), "{}", cache.limit());
        assert!(cache.weighted_size() < full);
        assert_ne!(guard.relief().state(), PressureState::Calm);
        drop(in_flight);
    }

    /// A request waiting for room counts for the relief as a reservation does: the caches
    /// give room for it.
    #[tokio::test(start_paused = true)]
    async fn the_caches_give_room_for_the_requests_waiting_for_it() {
        let guard = Arc::new(MemoryGuard::new(crate::config::split_memory_budget(
            192 * MIB,
        )));
        let marks = guard.relief().marks();
        let cache = full_cache();
        guard.watch(vec![Arc::clone(&cache) as Arc<dyn Shrink>], None);
        guard.pretend_resident(Some(100 * MIB));
        // Reserved up to the shrink mark: 8 MiB of room under the high-water mark.
        let held = guard.admit(marks.shrink_above - 100 * MIB).unwrap();
        guard.relief().relieve();
        assert_eq!(cache.limit(), cache.capacity(), "calm at the mark");
        // A request of a 2 MiB body (an estimate over 8 MiB) waits.
        let waiter = {
            let guard = Arc::clone(&guard);
            tokio::spawn(async move { guard.admit_request(Some(2 * MIB), WAIT).await })
        };
        tokio::time::sleep(WAIT / 4).await;
        assert_eq!(guard.waiting(), 1);
        guard.relief().relieve();
        assert!(cache.limit() < cache.capacity(), "{}", cache.limit());
        assert_ne!(guard.relief().state(), PressureState::Calm);
        drop(held);
        assert!(waiter.await.unwrap().is_ok());
    }

    #[test]
    fn the_marks_lie_below_the_high_water_mark() {
        let marks = Marks::of(&crate::config::split_memory_budget(192 * MIB));
        // High-water 176 MiB, a gap of 16.
        assert_eq!(marks.shrink_above, 168 * MIB);
        assert_eq!(marks.aim, 160 * MIB);
        assert_eq!(marks.grow_below, 144 * MIB);
    }

    #[test]
    fn caches_give_what_the_rss_is_over_in_proportion_to_what_they_hold_over_their_floors() {
        let marks = Marks {
            shrink_above: 168 * MIB,
            aim: 160 * MIB,
            grow_below: 144 * MIB,
        };
        let full = |capacity: u64, bytes: u64| CacheFigures {
            bytes,
            limit: capacity,
            floor: capacity / 8,
            capacity,
        };
        let caches = [
            full(16 * MIB, 16 * MIB),
            full(32 * MIB, 8 * MIB),
            full(8 * MIB, 0),
        ];
        // 170 MiB: 10 over the aim; room 14 and 4 (the empty cache has none).
        let limits = new_limits(170 * MIB, &marks, &caches);
        let taken: Vec<u64> = caches
            .iter()
            .zip(&limits)
            .map(|(c, l)| c.bytes.saturating_sub(*l))
            .collect();
        assert_eq!(taken.iter().sum::<u64>(), 10 * MIB - 1);
        assert!(taken[0] > 3 * taken[1], "{taken:?}");
        assert_eq!(limits[2], MIB, "never under the floor");
        // More over than all the room: every cache at its floor.
        let limits = new_limits(300 * MIB, &marks, &caches);
        assert_eq!(limits, vec![2 * MIB, 4 * MIB, MIB]);
        // Between the marks: the limits stay.
        let held = [CacheFigures {
            limit: 5 * MIB,
            ..full(16 * MIB, 5 * MIB)
        }];
        assert_eq!(new_limits(150 * MIB, &marks, &held), vec![5 * MIB]);
        // Under the lower mark: lifted by an eighth of the capacity a tick, up to it.
        assert_eq!(new_limits(100 * MIB, &marks, &held), vec![7 * MIB]);
        let nearly = [CacheFigures {
            limit: 15 * MIB,
            ..full(16 * MIB, 5 * MIB)
        }];
        assert_eq!(new_limits(100 * MIB, &marks, &nearly), vec![16 * MIB]);
    }

    #[test]
    fn the_rss_is_read_from_proc() {
        let status = "Name:\tmemproxy\nVmPeak:\t  200 kB\nVmRSS:\t   57344 kB\nRssAnon:\t 1 kB\n";
        assert_eq!(vm_rss_bytes(status), Some(56 * MIB));
        assert_eq!(vm_rss_bytes("VmRSS: lots\n"), None);
        assert_eq!(vm_rss_bytes("Name: x\n"), None);
        if cfg!(target_os = "linux") {
            let guard = MemoryGuard::new(crate::config::split_memory_budget(192 * MIB));
            let rss = guard.resident_bytes().unwrap();
            assert!(rss > MIB, "{rss}");
            guard.pretend_resident(Some(5));
            assert_eq!(guard.resident_bytes(), Some(5));
            guard.pretend_resident(None);
            assert!(guard.resident_bytes().unwrap() > MIB);
        }
    }
}
