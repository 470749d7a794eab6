//! The new message embedded ahead: started on a thread of its own as the plan begins (from
//! the request's trailing user messages, confirmed by reconcile), while the plan goes on with
//! reconcile, the window, the summary and the words' search on its own thread; recall then
//! takes the vector when it needs it.
//!
//! One helper thread, started with the first embedding ahead. It never makes a request wait
//! on other requests: a request whose embedding the helper has not started by the time recall
//! needs it takes it back and embeds on its own thread, as it would without the helper; one
//! the helper is running is helped with, then waited for: the full model offers its pass
//! ([`Assist`]) and the request's thread, which would only wait, runs the second half of the
//! rows of each step it joins (the same vector to the bit). Only for an embedder for which a text costs enough to be worth a thread
//! ([`memproxy_embed::Embed::worth_a_thread`]: the full model's forward pass, the upstream's
//! `/v1/embeddings`), not for the static table's few additions.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use memproxy_embed::{Assist, Embed, EmbedError};

/// Embeddings waiting for the helper at once; past it, a request embeds on its own thread.
const WAITING: usize = 64;

/// What one embedding ahead came to.
pub(super) type Made = (Result<Vec<Vec<f32>>, EmbedError>, Duration);

enum State {
    /// Waiting for the helper.
    Queued,
    /// The helper is embedding it.
    Running,
    /// Made (by the helper).
    Done(Made),
    /// Taken back by the request (or dropped): the helper skips it.
    Taken,
}

struct Slot {
    text: String,
    state: Mutex<State>,
    done: Condvar,
    /// Where the helper's pass is offered to the request waiting for it.
    assist: Assist,
}

impl Slot {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The embedding, taken if it is made within [`SOON`] of looking (a pass just helped
    /// with); `None` after that, left to be waited for.
    fn soon_done(&self) -> Option<Made> {
        let until = Instant::now() + SOON;
        loop {
            {
                let mut state = self.state();
                match std::mem::replace(&mut *state, State::Taken) {
                    State::Done(made) => return Some(made),
                    other => *state = other,
                }
            }
            if Instant::now() >= until {
                return None;
            }
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
    }
}

/// How long a request that helped with its pass looks for the vector before it sleeps until
/// it is handed over.
const SOON: Duration = Duration::from_micros(200);

/// A new message's embedding started ahead; [`Ahead::take`] gives its vector.
pub struct Ahead {
    slot: Arc<Slot>,
    embedder: Arc<dyn Embed>,
}

impl std::fmt::Debug for Ahead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ahead").finish_non_exhaustive()
    }
}

impl Ahead {
    /// The text it embeds.
    pub fn text(&self) -> &str {
        &self.slot.text
    }

    /// The embedding: the helper's, helped with and waited for if it is running; else made on
    /// this thread. Also how many halves of the helper's pass this thread ran.
    pub(super) fn take(self) -> (Made, usize) {
        let mut state = self.slot.state();
        let mut helped = None;
        loop {
            match std::mem::replace(&mut *state, State::Taken) {
                State::Done(made) => return (made, helped.unwrap_or(0)),
                State::Running if helped.is_none() => {
                    // This thread would only wait: it runs half of the pass's rows instead
                    // (the full model's pass; other embedders offer nothing).
                    *state = State::Running;
                    drop(state);
                    let halves = self.slot.assist.help();
                    helped = Some(halves);
                    if halves > 0 {
                        // The pass is done; the vector is a moment away (pooled, normalised,
                        // handed over): looked for here rather than slept for.
                        if let Some(made) = self.slot.soon_done() {
                            return (made, halves);
                        }
                    }
                    state = self.slot.state();
                }
                State::Running => {
                    *state = State::Running;
                    state = self
                        .slot
                        .done
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                State::Queued | State::Taken => break,
            }
        }
        drop(state);
        (embed(self.embedder.as_ref(), &self.slot.text), 0)
    }
}

impl Drop for Ahead {
    /// Not taken (recall did not search after all): the helper skips it if it has not begun.
    fn drop(&mut self) {
        let mut state = self.slot.state();
        if matches!(*state, State::Queued) {
            *state = State::Taken;
        }
    }
}

/// One text embedded, and how long it took.
pub(super) fn embed(embedder: &dyn Embed, text: &str) -> Made {
    let started = Instant::now();
    let result = embedder.embed(&[text]);
    (result, started.elapsed())
}

/// An embedding handed to the helper: the slot it is made into, and the embedder.
type Queued = (Arc<Slot>, Arc<dyn Embed>);

/// The helper: its queue, the thread started with the first embedding ahead (`None` if no
/// thread could be started).
#[derive(Default)]
pub(super) struct Helper {
    queue: OnceLock<Option<SyncSender<Queued>>>,
}

impl Helper {
    /// Starts embedding `text` ahead, or `None` when the helper cannot take it (its queue full,
    /// or no thread could be started): the request then embeds on its own thread, as before.
    pub(super) fn start(&self, embedder: &Arc<dyn Embed>, text: String) -> Option<Ahead> {
        let queue = self.queue.get_or_init(|| {
            let (sender, receiver) = std::sync::mpsc::sync_channel(WAITING);
            std::thread::Builder::new()
                .name("memproxy-query".into())
                .spawn(move || run(receiver))
                .map_err(|err| {
                    tracing::warn!(error = %err, "no thread to embed new messages ahead; they are embedded when recall needs them");
                })
                .ok()
                .map(|_| sender)
        });
        let slot = Arc::new(Slot {
            text,
            state: Mutex::new(State::Queued),
            done: Condvar::new(),
            assist: Assist::default(),
        });
        match queue
            .as_ref()?
            .try_send((Arc::clone(&slot), Arc::clone(embedder)))
        {
            Ok(()) => Some(Ahead {
                slot,
                embedder: Arc::clone(embedder),
            }),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => None,
        }
    }
}

/// The helper's loop: each queued embedding not taken back is made and handed over.
fn run(queue: Receiver<Queued>) {
    for (slot, embedder) in queue {
        {
            let mut state = slot.state();
            if !matches!(*state, State::Queued) {
                continue;
            }
            *state = State::Running;
        }
        // A panic in the embedder ends this embedding, not the helper, and never leaves the
        // request that waits for it waiting.
        let started = Instant::now();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            embedder.embed_assisted(&slot.text, &slot.assist)
        }))
        .unwrap_or_else(|_| Err(EmbedError::Failed("the embedder panicked".to_string())));
        slot.assist.close();
        let made = (result, started.elapsed());
        *slot.state() = State::Done(made);
        slot.done.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Embeds a text as its length, after `delay`, counting its calls and naming the threads
    /// that made them.
    #[derive(Debug)]
    struct Slow {
        delay: Duration,
        calls: AtomicUsize,
        threads: Mutex<Vec<String>>,
        /// While set, the text "a" waits (bounded) until it is cleared; "panic" panics.
        gate: std::sync::atomic::AtomicBool,
    }

    impl Embed for Slow {
        fn id(&self) -> &str {
            "slow"
        }
        fn dims(&self) -> usize {
            1
        }
        fn worth_a_thread(&self) -> bool {
            true
        }
        fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
            let name = std::thread::current().name().unwrap_or("").to_string();
            self.threads.lock().unwrap().push(name);
            if texts == ["panic"] {
                panic!("an embedder's bug");
            }
            if texts == ["a"] {
                for _ in 0..1000 {
                    if !self.gate.load(Ordering::SeqCst) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            std::thread::sleep(self.delay);
            self.calls.fetch_add(1, Ordering::SeqCst);
            Ok(texts.iter().map(|t| vec![t.len() as f32]).collect())
        }
    }

    fn slow(millis: u64) -> (Arc<Slow>, Arc<dyn Embed>) {
        let slow = Arc::new(Slow {
            delay: Duration::from_millis(millis),
            calls: AtomicUsize::new(0),
            threads: Mutex::new(Vec::new()),
            gate: std::sync::atomic::AtomicBool::new(false),
        });
        let embedder: Arc<dyn Embed> = slow.clone();
        (slow, embedder)
    }

    /// Waits (bounded) until the helper has begun an embedding of `slow`'s.
    fn began(slow: &Slow) {
        for _ in 0..500 {
            if !slow.threads.lock().unwrap().is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no embedding was begun in 5 s");
    }

    /// Waits (bounded) until `slow` has made `calls` embeddings.
    fn made(slow: &Slow, calls: usize) {
        for _ in 0..500 {
            if slow.calls.load(Ordering::SeqCst) >= calls {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("{calls} embeddings were not made in 5 s");
    }

    #[test]
    fn the_helper_embeds_on_its_own_thread_and_the_caller_takes_its_result() {
        let helper = Helper::default();
        let (slow, embedder) = slow(20);
        let ahead = helper.start(&embedder, "four".into()).unwrap();
        assert_eq!(ahead.text(), "four");
        // The caller's own work meanwhile.
        made(&slow, 1);
        let ((vectors, _), _) = ahead.take();
        assert_eq!(vectors.unwrap(), vec![vec![4.0]]);
        assert_eq!(slow.calls.load(Ordering::SeqCst), 1);
        assert_eq!(*slow.threads.lock().unwrap(), ["memproxy-query"]);
    }

    #[test]
    fn a_caller_never_waits_behind_another_requests_embedding() {
        let helper = Helper::default();
        let (slow, embedder) = slow(1);
        // The first holds the helper until the gate opens.
        slow.gate.store(true, Ordering::SeqCst);
        let first = helper.start(&embedder, "a".into()).unwrap();
        began(&slow);
        let second = helper.start(&embedder, "bb".into()).unwrap();
        // The helper is busy with the first: the second is taken back and made here.
        let ((vectors, _), _) = second.take();
        assert_eq!(vectors.unwrap(), vec![vec![2.0]]);
        slow.gate.store(false, Ordering::SeqCst);
        let ((vectors, _), _) = first.take();
        assert_eq!(vectors.unwrap(), vec![vec![1.0]]);
        // A third, after both: the helper skipped the second, so it starts this one.
        let third = helper.start(&embedder, "ccc".into()).unwrap();
        made(&slow, 3);
        assert_eq!(third.take().0.0.unwrap(), vec![vec![3.0]]);
        let here = std::thread::current().name().unwrap_or("").to_string();
        assert_eq!(
            *slow.threads.lock().unwrap(),
            ["memproxy-query", here.as_str(), "memproxy-query"]
        );
    }

    #[test]
    fn an_embedder_that_panics_fails_that_embedding_and_the_helper_goes_on() {
        let helper = Helper::default();
        let (slow, embedder) = slow(1);
        let broken = helper.start(&embedder, "panic".into()).unwrap();
        // The helper has run it (its thread name is pushed before the panic).
        began(&slow);
        let ((vectors, _), _) = broken.take();
        assert!(vectors.is_err());
        let next = helper.start(&embedder, "four".into()).unwrap();
        made(&slow, 1);
        assert_eq!(next.take().0.0.unwrap(), vec![vec![4.0]]);
        assert_eq!(
            *slow.threads.lock().unwrap(),
            ["memproxy-query", "memproxy-query"]
        );
    }

    #[test]
    fn one_dropped_before_the_helper_begins_is_never_made() {
        let helper = Helper::default();
        let (slow, embedder) = slow(100);
        let busy = helper.start(&embedder, "busy".into()).unwrap();
        drop(helper.start(&embedder, "dropped".into()).unwrap());
        let _ = busy.take();
        // The helper's next one shows it went past the dropped one.
        let next = helper.start(&embedder, "next".into()).unwrap();
        made(&slow, 2);
        let _ = next.take();
        assert_eq!(slow.calls.load(Ordering::SeqCst), 2);
    }

    /// A table lookup: not worth a thread.
    #[derive(Debug)]
    struct Quick;

    impl Embed for Quick {
        fn id(&self) -> &str {
            "quick"
        }
        fn dims(&self) -> usize {
            1
        }
        fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
            Ok(texts.iter().map(|t| vec![t.len() as f32]).collect())
        }
    }

    #[test]
    fn only_an_embedder_worth_a_thread_goes_ahead_and_only_the_same_text_is_taken() {
        use crate::embedding::{Embedder, Embedding};
        let quick = Embedding::new(Embedder::Ready(Arc::new(Quick)), Duration::from_secs(5), 4);
        assert!(quick.ahead("question".into()).is_none());
        assert_eq!(quick.query_from(None, "question").unwrap(), vec![8.0]);

        let (slow, embedder) = slow(10);
        let embedding = Embedding::new(Embedder::Ready(embedder), Duration::from_secs(5), 4);
        let ahead = embedding.ahead("question".into());
        assert!(ahead.is_some());
        assert_eq!(embedding.query_from(ahead, "question").unwrap(), vec![8.0]);
        // Started ahead for another text (a tool loop's query is found later): that text
        // is embedded, not the one started.
        let ahead = embedding.ahead("question".into());
        assert_eq!(embedding.query_from(ahead, "tool").unwrap(), vec![4.0]);
        let counters = &embedding.counters;
        assert_eq!(counters.queries_ahead.load(Ordering::Relaxed), 2);
        assert_eq!(counters.queries.load(Ordering::Relaxed), 2);
        assert_eq!(counters.query_failures.load(Ordering::Relaxed), 0);
        // The second one ahead was made or skipped, never both taken and made twice.
        assert!(slow.calls.load(Ordering::SeqCst) <= 3);
    }
}
