//! The one background worker and the one back-off. Summaries and memory extraction each run a
//! [`Worker`]: a bounded queue, at most so many jobs at once, every job tracked so shutdown
//! waits for it (within a grace period) or cancels it. Every retry (a summary that failed, an
//! extraction call, a commit that met another replica's) waits a [`Backoff`].

use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::{JoinHandle, JoinSet};

/// Runs jobs of type `J` in the background, off every request's path.
pub struct Worker<J> {
    queue: Mutex<Option<mpsc::Sender<J>>>,
    /// The queue's other end, until [`Worker::start`] takes it.
    waiting: Mutex<Option<mpsc::Receiver<J>>>,
    stop: Arc<Notify>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// The most job tasks [`Worker::start`]'s set held at once, running or finished.
    #[cfg(test)]
    most_held: Arc<std::sync::atomic::AtomicUsize>,
}

impl<J> std::fmt::Debug for Worker<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<J: Send + 'static> Worker<J> {
    /// A worker whose queue holds at most `capacity` jobs; none runs before [`Worker::start`].
    pub fn new(capacity: usize) -> Worker<J> {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        Worker {
            queue: Mutex::new(Some(tx)),
            waiting: Mutex::new(Some(rx)),
            stop: Arc::new(Notify::new()),
            task: Mutex::new(None),
            #[cfg(test)]
            most_held: Arc::default(),
        }
    }

    /// Runs the queued jobs with `run`, at most `concurrency` at once, until
    /// [`Worker::shutdown`]. Must be called inside a tokio runtime; a second call does nothing.
    pub fn start<F, Fut>(&self, concurrency: usize, run: F)
    where
        F: Fn(J) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Some(mut rx) = lock(&self.waiting).take() else {
            return;
        };
        let stop = Arc::clone(&self.stop);
        #[cfg(test)]
        let most_held = Arc::clone(&self.most_held);
        let task = tokio::spawn(async move {
            let permits = Arc::new(Semaphore::new(concurrency.max(1)));
            let mut jobs = JoinSet::new();
            loop {
                tokio::select! {
                    job = rx.recv() => {
                        let Some(job) = job else { break };
                        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else { break };
                        // The jobs that ended are let go of first. While the queue is never
                        // empty, `select!` picks this branch or the next at random, so the
                        // next alone would leave ended jobs' tasks held (each the size of its
                        // future) in a number that grows for as long as the queue stays full.
                        while jobs.try_join_next().is_some() {}
                        let running = run(job);
                        jobs.spawn(async move {
                            let _permit = permit;
                            running.await;
                        });
                        #[cfg(test)]
                        most_held.fetch_max(jobs.len(), std::sync::atomic::Ordering::Relaxed);
                    }
                    Some(_) = jobs.join_next(), if !jobs.is_empty() => {}
                    () = stop.notified() => break,
                }
            }
            // Jobs still queued are not started; the ones running finish (or are aborted when
            // the grace period ends and this task is dropped).
            rx.close();
            while jobs.join_next().await.is_some() {}
        });
        *lock(&self.task) = Some(task);
    }

    /// Runs the queued jobs with `run` one batch at a time: each batch is what waited in the
    /// queue when the previous one ended (at least one job, at most `max_batch`), so a job
    /// whose fixed cost can be shared with the others (one store transaction per
    /// conversation, one embedding call) pays it once per batch. Until [`Worker::shutdown`];
    /// a second call (or one after [`Worker::start`]) does nothing.
    pub fn start_batched<F, Fut>(&self, max_batch: usize, run: F)
    where
        F: Fn(Vec<J>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Some(mut rx) = lock(&self.waiting).take() else {
            return;
        };
        let stop = Arc::clone(&self.stop);
        let max_batch = max_batch.max(1);
        let task = tokio::spawn(async move {
            let mut batch = Vec::with_capacity(max_batch);
            loop {
                tokio::select! {
                    got = rx.recv_many(&mut batch, max_batch) => {
                        if got == 0 {
                            break;
                        }
                        run(std::mem::replace(&mut batch, Vec::with_capacity(max_batch))).await;
                    }
                    () = stop.notified() => break,
                }
            }
            rx.close();
        });
        *lock(&self.task) = Some(task);
    }

    /// Queues a job; false when the queue is full or closed (the job is dropped).
    pub fn enqueue(&self, job: J) -> bool {
        self.try_enqueue(job).is_ok()
    }

    /// Queues a job; gives it back when the queue is full or closed.
    pub fn try_enqueue(&self, job: J) -> Result<(), J> {
        match &*lock(&self.queue) {
            Some(tx) => tx.try_send(job).map_err(|err| err.into_inner()),
            None => Err(job),
        }
    }

    /// A sender into the queue that does not keep it open (for the worker's own jobs to queue
    /// more); `None` once shut down.
    pub fn weak_sender(&self) -> Option<mpsc::WeakSender<J>> {
        lock(&self.queue).as_ref().map(mpsc::Sender::downgrade)
    }

    /// Stops taking jobs and waits up to `grace` for the running ones; then cancels them.
    /// True when some had to be cancelled.
    pub async fn shutdown(&self, grace: Duration) -> bool {
        lock(&self.queue).take();
        lock(&self.waiting).take();
        self.stop.notify_one();
        let task = lock(&self.task).take();
        if let Some(mut task) = task
            && tokio::time::timeout(grace, &mut task).await.is_err()
        {
            task.abort();
            let _ = task.await;
            return true;
        }
        false
    }
}

/// Waits that double after each failure in a row, from `first` up to `cap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub cap: Duration,
}

impl Backoff {
    /// Doubling from `first` for at most 15 doublings.
    pub fn doubling(first: Duration) -> Backoff {
        Backoff {
            first,
            cap: first.saturating_mul(1 << 15),
        }
    }

    /// The wait after the `failures`-th failure in a row (1: the first).
    pub fn after(&self, failures: u32) -> Duration {
        let doublings = failures.clamp(1, 16) - 1;
        self.first.saturating_mul(1 << doublings).min(self.cap)
    }

    /// [`Backoff::after`] plus up to as much again, chosen at random: writers that collided
    /// stop retrying in step.
    pub fn jittered(&self, failures: u32) -> Duration {
        let wait = self.after(failures);
        // A hasher's random keys: a different amount each time, with no system call.
        let fraction = RandomState::new().hash_one(failures) % 1024;
        wait + wait.mul_f64(fraction as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn waits_double_up_to_the_cap_and_jitter_adds_at_most_as_much_again() {
        let backoff = Backoff::doubling(Duration::from_secs(60));
        assert_eq!(backoff.after(0), Duration::from_secs(60));
        assert_eq!(backoff.after(1), Duration::from_secs(60));
        assert_eq!(backoff.after(3), Duration::from_secs(240));
        assert_eq!(backoff.after(16), Duration::from_secs(60 << 15));
        assert_eq!(backoff.after(40), Duration::from_secs(60 << 15));
        let capped = Backoff {
            first: Duration::from_millis(1),
            cap: Duration::from_millis(8),
        };
        assert_eq!(capped.after(10), Duration::from_millis(8));
        for failures in 1..20 {
            let wait = capped.jittered(failures);
            assert!(wait >= capped.after(failures) && wait < 2 * capped.after(failures));
        }
    }

    #[tokio::test]
    async fn jobs_run_at_most_so_many_at_once_and_a_shutdown_stops_the_queue() {
        let worker = Worker::new(16);
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let done = Arc::new(AtomicUsize::new(0));
        let (r, m, d) = (Arc::clone(&running), Arc::clone(&most), Arc::clone(&done));
        worker.start(2, move |ms: u64| {
            let (r, m, d) = (Arc::clone(&r), Arc::clone(&m), Arc::clone(&d));
            async move {
                let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                r.fetch_sub(1, Ordering::SeqCst);
                d.fetch_add(1, Ordering::SeqCst);
            }
        });
        for _ in 0..6 {
            assert!(worker.enqueue(20));
        }
        while done.load(Ordering::SeqCst) < 6 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(most.load(Ordering::SeqCst), 2);
        assert!(worker.enqueue(60_000));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            worker.shutdown(Duration::from_millis(50)).await,
            "the long job is cancelled"
        );
        assert!(!worker.enqueue(1), "a worker shut down takes no job");
    }

    /// With the queue never empty, the tasks of ended jobs are let go of as new ones start:
    /// the set holds the running jobs and at most the ones that ended since the last start.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ended_jobs_are_let_go_of_while_the_queue_stays_full() {
        const JOBS: usize = 3_000;
        let worker = Worker::new(JOBS);
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..JOBS {
            assert!(worker.enqueue(()));
        }
        let d = Arc::clone(&done);
        worker.start(2, move |()| {
            let d = Arc::clone(&d);
            async move {
                tokio::task::yield_now().await;
                d.fetch_add(1, Ordering::SeqCst);
            }
        });
        for _ in 0..5_000 {
            if done.load(Ordering::SeqCst) == JOBS {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(done.load(Ordering::SeqCst), JOBS);
        let most = worker.most_held.load(Ordering::Relaxed);
        assert!(most <= 4, "the set held {most} tasks at once");
        assert!(!worker.shutdown(Duration::from_millis(50)).await);
    }

    #[tokio::test]
    async fn batches_take_what_queued_meanwhile_in_order_and_at_most_so_many() {
        let worker = Worker::new(64);
        let batches = Arc::new(Mutex::new(Vec::<Vec<u32>>::new()));
        let seen = Arc::clone(&batches);
        // Queued before the start: the first batch takes them, up to the limit.
        for n in 0..10 {
            assert!(worker.enqueue(n));
        }
        worker.start_batched(4, move |batch: Vec<u32>| {
            let seen = Arc::clone(&seen);
            async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                lock(&seen).push(batch);
            }
        });
        let count = || lock(&batches).iter().map(Vec::len).sum::<usize>();
        for _ in 0..2_500 {
            if count() >= 10 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let got = lock(&batches).clone();
        assert_eq!(got.concat(), (0..10).collect::<Vec<u32>>());
        assert!(got.iter().all(|b| !b.is_empty() && b.len() <= 4), "{got:?}");
        assert_eq!(got[0], [0, 1, 2, 3]);
        assert!(!worker.shutdown(Duration::from_millis(50)).await);
        assert!(!worker.enqueue(1), "a worker shut down takes no job");
    }
}
