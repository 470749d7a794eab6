//! One forward pass shared by two threads: the thread that runs it (the lead) and one that
//! waits for its result (the partner), which would otherwise sleep.
//!
//! The pass is a list of steps, each in two halves (the first and the second half of the
//! text's word pieces); a step's halves may run at once, and a step begins only once the one
//! before it is done. The lead runs every first half; it offers each second half while a
//! partner is there ([`Team::lead`]) and runs it itself when no partner claimed it, so a lead
//! alone runs the whole pass as before and never waits on a partner that is not working
//! ([`Team::follow`] claims a half only while it spins, and a half it claimed is running). A
//! partner joins at any step and leaves once the pass is done, or after
//! [`Team::PATIENCE`] without a half to run (the lead held up elsewhere).
//!
//! [`Assist`] is how the thread that waits finds the pass: the embedder offers its pass there
//! once it has begun it ([`crate::Embed::embed_assisted`]), and the waiting thread calls
//! [`Assist::help`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// `open` once the pass is done: nothing more will be offered.
const FINISHED: usize = usize::MAX;

/// The state two threads share for one pass.
#[derive(Default)]
pub(crate) struct Team {
    /// `step + 1` while the second half of `step` waits to be claimed; 0 when none does;
    /// [`FINISHED`].
    open: AtomicUsize,
    /// `step + 1` once the partner has run the second half of `step`.
    done: AtomicUsize,
    /// Set when the partner's half panicked.
    broken: AtomicBool,
}

impl Team {
    /// How long a partner spins without a half to run before it leaves (the lead is held up:
    /// descheduled, or the pass is almost done).
    pub(crate) const PATIENCE: Duration = Duration::from_millis(1);

    /// Runs `steps` steps, `run(step, half)` for half 0 and 1 of each, on this thread or, for
    /// a second half a partner claimed first, on the partner's. Each second half is on offer
    /// from the moment its step begins, so a partner that arrives while the lead runs a first
    /// half takes the second (two atomic operations a step when none comes). Panics if a
    /// partner's half panicked (its rows are not filled in).
    pub(crate) fn lead(&self, steps: usize, mut run: impl FnMut(usize, usize)) {
        /// Marks the pass finished however the lead leaves it (a panic included), so that a
        /// partner stops at once.
        struct Finish<'a>(&'a AtomicUsize);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                self.0.store(FINISHED, Ordering::Release);
            }
        }
        let _finish = Finish(&self.open);
        for step in 0..steps {
            self.open.store(step + 1, Ordering::Release);
            run(step, 0);
            if self
                .open
                .compare_exchange(step + 1, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                run(step, 1);
                continue;
            }
            // The partner claimed it and is running it.
            let mut spins = 0u32;
            while self.done.load(Ordering::Acquire) < step + 1 {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            assert!(
                !self.broken.load(Ordering::Acquire),
                "the half a partner ran panicked"
            );
        }
    }

    /// Runs the second halves the lead offers, `run(step, 1)`, until the pass is done or none
    /// has been offered for [`Team::PATIENCE`]; returns how many it ran. Two partners at once
    /// would each claim halves correctly, but the pass has room for one: its caller lets one
    /// in at a time (`bert.rs`'s `Partner`, by its scratch's lock).
    pub(crate) fn follow(&self, mut run: impl FnMut(usize, usize)) -> usize {
        let mut ran_halves = 0;
        let mut idle = Instant::now();
        let mut spins = 0u32;
        loop {
            let open = self.open.load(Ordering::Acquire);
            if open == FINISHED {
                break;
            }
            if open != 0
                && self
                    .open
                    .compare_exchange(open, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(open - 1, 1);
                }));
                if ran.is_err() {
                    self.broken.store(true, Ordering::Release);
                }
                self.done.store(open, Ordering::Release);
                if ran.is_err() {
                    break;
                }
                ran_halves += 1;
                idle = Instant::now();
                continue;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && idle.elapsed() > Team::PATIENCE {
                break;
            }
        }
        ran_halves
    }
}

/// A pass the thread that runs it offers to one that waits for its result.
pub(crate) trait Help: Send + Sync {
    /// Runs parts of the pass until it is done or there is nothing left to run; returns how
    /// many it ran.
    fn help(&self) -> usize;
}

enum Offer {
    /// The embedding has not offered a pass yet.
    Pending,
    Offered(Arc<dyn Help>),
    /// The embedding is done, or offers nothing.
    Closed,
}

/// Where an embedding offers its pass to a thread that waits for it (one text embedded ahead,
/// `memproxy-core`'s helper thread: the request that waits helps).
pub struct Assist {
    offer: Mutex<Offer>,
    changed: Condvar,
}

impl Default for Assist {
    fn default() -> Self {
        Assist {
            offer: Mutex::new(Offer::Pending),
            changed: Condvar::new(),
        }
    }
}

impl std::fmt::Debug for Assist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Assist").finish_non_exhaustive()
    }
}

impl Assist {
    /// How long [`Assist::help`] waits for a pass to be offered (the embedding is still
    /// tokenizing) before it returns.
    const OFFER_WAIT: Duration = Duration::from_millis(2);

    fn lock(&self) -> MutexGuard<'_, Offer> {
        self.offer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Helps with the pass on offer until it is done (or no part of it is left to this thread);
    /// returns at once when the embedding is done or offers none. Returns how many parts of
    /// the pass this thread ran (half of the rows of one step each).
    pub fn help(&self) -> usize {
        let deadline = Instant::now() + Assist::OFFER_WAIT;
        let mut offer = self.lock();
        let help = loop {
            match &*offer {
                Offer::Offered(help) => break Arc::clone(help),
                Offer::Closed => return 0,
                Offer::Pending => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return 0;
                    }
                    offer = self
                        .changed
                        .wait_timeout(offer, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        };
        drop(offer);
        help.help()
    }

    /// Offers a pass (once; a closed assist takes none).
    pub(crate) fn offer(&self, help: Arc<dyn Help>) {
        let mut offer = self.lock();
        if matches!(*offer, Offer::Pending) {
            *offer = Offer::Offered(help);
            self.changed.notify_all();
        }
    }

    /// Ends the offer: the embedding is done (or offers nothing).
    pub fn close(&self) {
        *self.lock() = Offer::Closed;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records which thread ran each half, after `work` of spinning, and checks a step's
    /// halves never run before the step before them is done.
    struct Log {
        ran: Mutex<Vec<(usize, usize, std::thread::ThreadId)>>,
    }

    impl Log {
        fn run(&self, step: usize, half: usize) {
            {
                let ran = self.ran.lock().unwrap();
                let before = ran.iter().filter(|(s, _, _)| *s + 1 == step).count();
                assert!(
                    step == 0 || before == 2,
                    "step {step} began before {}",
                    step - 1
                );
            }
            let until = Instant::now() + Duration::from_micros(200);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            self.ran
                .lock()
                .unwrap()
                .push((step, half, std::thread::current().id()));
        }
    }

    #[test]
    fn a_lead_alone_runs_every_half_in_order() {
        let team = Team::default();
        let log = Log {
            ran: Mutex::new(Vec::new()),
        };
        team.lead(3, |step, half| log.run(step, half));
        let ran: Vec<_> = log
            .ran
            .lock()
            .unwrap()
            .iter()
            .map(|(s, h, _)| (*s, *h))
            .collect();
        assert_eq!(ran, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]);
    }

    #[test]
    fn a_partner_runs_second_halves_and_each_step_waits_for_the_one_before() {
        let lead = std::thread::current().id();
        let mut shared = 0;
        // Passes of 100 steps (40 ms) until the partner thread was scheduled in time to run a
        // half (on a busy machine it may not be, in one pass); at most 20.
        for _ in 0..20 {
            let team = Arc::new(Team::default());
            let log = Arc::new(Log {
                ran: Mutex::new(Vec::new()),
            });
            let partner = {
                let (team, log) = (Arc::clone(&team), Arc::clone(&log));
                std::thread::spawn(move || {
                    // Joins again whenever it left for want of work (this thread
                    // descheduled), until the pass is done.
                    while team.open.load(Ordering::Acquire) != FINISHED {
                        let _ = team.follow(|step, half| log.run(step, half));
                    }
                    std::thread::current().id()
                })
            };
            team.lead(100, |step, half| log.run(step, half));
            let partner = partner.join().unwrap();
            let ran = log.ran.lock().unwrap();
            assert_eq!(ran.len(), 200);
            for step in 0..100 {
                let first = ran.iter().find(|(s, h, _)| *s == step && *h == 0).unwrap();
                assert_eq!(first.2, lead, "a first half ran on the partner");
            }
            assert!(ran.iter().all(|(_, h, t)| *t == lead || *h == 1));
            shared += ran.iter().filter(|(_, _, t)| *t == partner).count();
            if shared > 0 {
                break;
            }
        }
        assert!(shared > 0, "the partner ran no half in 20 passes");
    }

    #[test]
    fn a_partners_panic_fails_the_pass_instead_of_hanging_it() {
        // Until the partner thread is scheduled in time to claim a half (at most 20 passes).
        let mut failed = false;
        for _ in 0..20 {
            let team = Arc::new(Team::default());
            let partner = {
                let team = Arc::clone(&team);
                std::thread::spawn(move || {
                    while team.open.load(Ordering::Acquire) != FINISHED {
                        let _ = team.follow(|_, _| panic!("a bug in a half"));
                    }
                })
            };
            let lead = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                team.lead(200, |_, _| std::thread::sleep(Duration::from_micros(50)));
            }));
            partner.join().unwrap();
            if lead.is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed, "a pass whose partner panicked did not fail");
    }

    struct Counted(AtomicUsize);

    impl Help for Counted {
        fn help(&self) -> usize {
            self.0.fetch_add(1, Ordering::SeqCst) + 1
        }
    }

    #[test]
    fn help_waits_briefly_for_an_offer_and_returns_once_closed() {
        // Nothing offered: returns after the offer's wait.
        let assist = Assist::default();
        let started = Instant::now();
        assert_eq!(assist.help(), 0);
        assert!(started.elapsed() >= Assist::OFFER_WAIT);
        // Offered before: it helps.
        let assist = Assist::default();
        assist.offer(Arc::new(Counted(AtomicUsize::new(0))));
        assert_eq!(assist.help(), 1);
        // Offered while it waits: it helps.
        let assist = Arc::new(Assist::default());
        let counted = Arc::new(Counted(AtomicUsize::new(0)));
        let helper = {
            let assist = Arc::clone(&assist);
            std::thread::spawn(move || assist.help())
        };
        assist.offer(counted.clone());
        helper.join().unwrap();
        // Closed: it returns at once, and a later offer is not taken.
        assist.close();
        assist.offer(counted.clone());
        assert_eq!(assist.help(), 0);
        assert!(counted.0.load(Ordering::SeqCst) <= 1);
    }
}
