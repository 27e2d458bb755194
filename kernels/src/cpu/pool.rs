//! The CPU backend's helper threads: a fork-join pool for [`CpuBackend::par_for`](super::CpuBackend), built for
//! the many small parallel calls of a decode step.
//!
//! One decode step of a 30-layer model makes over two hundred parallel calls (seven matmuls and an attention
//! call per layer), each a few tens of microseconds of work. A pool whose idle workers sleep on a futex pays a
//! wake-up per call and a sleep after it: with rayon, `perf` put 30% of single-stream decode samples in the
//! kernel's scheduler (`try_to_wake_up`, `finish_task_switch`) and more time went to the latency of each wake.
//! Here a helper that finishes a job keeps polling for the next one for [`POLL`] before it parks, as ggml's
//! thread pool does, so back-to-back calls reach a helper that is already running; a pool left idle for longer
//! sleeps and costs nothing.
//!
//! The cores may be shared (other workers, other processes, a test harness). Two rules keep a pool from stalling
//! there:
//! - The caller never waits for a helper that has not joined its job: it works through the tasks itself, closes
//!   the job, and waits only for helpers inside it. A descheduled helper costs the call nothing.
//! - A polling helper pauses for [`SPIN`] and then yields the core between polls, so it gives way to any thread
//!   that has work.
//!
//! One job runs at a time: callers on other threads queue on a mutex. A nested call (a task that itself calls
//! `par_for`) runs inline. A panicking task is caught on its thread; the caller waits for every helper to leave the
//! job (the tasks borrow its stack) and then re-raises the first panic.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle helper polls for the next job before it parks. Long enough to bridge the gaps between the
/// calls of one forward pass (a few microseconds of single-threaded work: norms, RoPE, residual adds), short
/// enough that a pool between engine steps gives its core back almost at once.
const POLL: Duration = Duration::from_micros(200);

/// The first part of [`POLL`], spent in `pause` loops; the rest yields between polls.
const SPIN: Duration = Duration::from_micros(20);

/// Polls between two reads of the clock.
const POLLS_PER_CLOCK_READ: u32 = 32;

thread_local! {
    /// True on a pool helper, and on a caller while it runs its share of a job.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// A job as the helpers see it. The task closure is the caller's, borrowed for the duration of the call.
#[derive(Clone, Copy)]
struct Job {
    task: *const (dyn Fn(usize) + Sync + 'static),
    tasks: usize,
}

struct Shared {
    /// Bumped once per job (and at shutdown) to wake helpers; joining is decided by `open`.
    generation: AtomicU64,
    /// Written only by the submitter, while no job is open and no helper is inside one.
    job: UnsafeCell<Job>,
    /// The next task index to hand out.
    next: AtomicUsize,
    /// True while the current job may be joined.
    open: AtomicBool,
    /// Helpers that have announced themselves to the current job and not yet left it.
    active: AtomicUsize,
    shutdown: AtomicBool,
    /// Helpers parked now (polling given up): how a test sees that an idle pool leaves its cores alone.
    parked: AtomicUsize,
    /// The first panic raised on a helper during the current job.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `job` is written by the submitter only while `open` is false and `active` is 0, and read by a helper
// only after it has raised `active` and then seen `open` true (both SeqCst: either the helper sees the job closed,
// or the caller sees the helper and waits for it). The closure it points at is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer in `job` is only dereferenced under that protocol.
unsafe impl Send for Shared {}

impl Shared {
    /// Pulls task indices until none are left.
    fn work(&self, job: Job) {
        // SAFETY: the submitter keeps the closure alive until no helper is inside the job.
        let task = unsafe { &*job.task };
        loop {
            let t = self.next.fetch_add(1, Ordering::Relaxed);
            if t >= job.tasks {
                break;
            }
            task(t);
        }
    }
}

/// `helpers` threads that run [`PollingPool::run`]'s tasks beside the calling thread.
pub(crate) struct PollingPool {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// Serialises callers from different threads.
    submit: Mutex<()>,
}

impl PollingPool {
    /// Starts `helpers` threads named `pagoda-kernels-{i}`.
    pub(crate) fn new(helpers: usize) -> std::io::Result<PollingPool> {
        let noop: &(dyn Fn(usize) + Sync) = &|_| {};
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(Job { task: erase(noop), tasks: 0 }),
            next: AtomicUsize::new(0),
            open: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
            panic: Mutex::new(None),
        });
        let mut pool = PollingPool { shared, helpers: Vec::with_capacity(helpers), submit: Mutex::new(()) };
        for i in 0..helpers {
            let shared = Arc::clone(&pool.shared);
            let handle =
                std::thread::Builder::new().name(format!("pagoda-kernels-{i}")).spawn(move || helper_loop(&shared))?;
            // On an error `pool` is dropped, which stops the helpers already started.
            pool.helpers.push(handle);
        }
        Ok(pool)
    }

    /// Runs `task(t)` for every `t in 0..tasks` on the calling thread and the helpers, which pull indices from a
    /// shared counter (so a descheduled core does not hold a fixed share of the work). Returns when every task has
    /// run; re-raises the first panic of any task.
    pub(crate) fn run(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        if self.helpers.is_empty() || tasks <= 1 || IN_JOB.get() {
            (0..tasks).for_each(task);
            return;
        }
        // A panic re-raised by an earlier call poisons the mutex; the pool's state is consistent again by then.
        let _turn = self.submit.lock().unwrap_or_else(PoisonError::into_inner);
        let shared = &*self.shared;
        shared.next.store(0, Ordering::Relaxed);
        let job = Job { task: erase(task), tasks };
        // SAFETY: the previous job is closed and no helper is inside it (the previous call waited for that), so no
        // helper reads `job` until the SeqCst store of `open` below publishes this write.
        unsafe { *shared.job.get() = job };
        shared.open.store(true, Ordering::SeqCst);
        shared.generation.fetch_add(1, Ordering::Release);
        for h in &self.helpers {
            // Only a syscall when the helper is parked; a polling one just sees the new generation.
            h.thread().unpark();
        }

        IN_JOB.set(true);
        let own = catch_unwind(AssertUnwindSafe(|| shared.work(job)));
        IN_JOB.set(false);

        // Every task has been taken. Close the job so that late helpers stay out, then wait for the ones inside
        // (the tasks borrow this caller's stack), panic or not.
        shared.open.store(false, Ordering::SeqCst);
        let mut polls = 0u32;
        while shared.active.load(Ordering::SeqCst) != 0 {
            if polls < 1 << 10 {
                polls += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // Taken even when the caller's own share panicked, so that it is not raised by the next job.
        let helper_panic = shared.panic.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(payload) = own.err().or(helper_panic) {
            resume_unwind(payload);
        }
    }
}

impl Drop for PollingPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.generation.fetch_add(1, Ordering::Release);
        for h in self.helpers.drain(..) {
            h.thread().unpark();
            // A helper only exits through the shutdown flag; its tasks' panics are caught.
            let _ = h.join();
        }
    }
}

/// Drops the borrow's lifetime so the job can sit in the shared state; [`PollingPool::run`] keeps the closure alive
/// until no helper is inside the job.
fn erase<'a>(task: &'a (dyn Fn(usize) + Sync + 'a)) -> *const (dyn Fn(usize) + Sync + 'static) {
    let ptr: *const (dyn Fn(usize) + Sync + 'a) = task;
    // SAFETY: only the lifetime changes (same fat-pointer layout); see above for why the pointee outlives its use.
    unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + 'a), *const (dyn Fn(usize) + Sync + 'static)>(ptr) }
}

fn helper_loop(shared: &Shared) {
    IN_JOB.set(true);
    let mut served = 0u64;
    loop {
        served = wait_for_job(shared, served);
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        shared.active.fetch_add(1, Ordering::SeqCst);
        if shared.open.load(Ordering::SeqCst) {
            // SAFETY: `open` was seen true after `active` was raised, so the job cannot be rewritten until this
            // helper leaves, and the SeqCst store of `open` ordered the submitter's write before this read.
            let job = unsafe { *shared.job.get() };
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| shared.work(job))) {
                let mut first = shared.panic.lock().unwrap_or_else(PoisonError::into_inner);
                first.get_or_insert(payload);
            }
        }
        // Release (part of SeqCst): the caller's load of 0 makes this helper's writes visible to it.
        shared.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Polls until the generation moves past `served`: pauses for [`SPIN`], yields the core between polls until
/// [`POLL`], then parks.
fn wait_for_job(shared: &Shared, served: u64) -> u64 {
    let start = Instant::now();
    let mut polls = 0u32;
    let mut elapsed = Duration::ZERO;
    loop {
        let generation = shared.generation.load(Ordering::Acquire);
        if generation != served {
            return generation;
        }
        polls = polls.wrapping_add(1);
        if polls.is_multiple_of(POLLS_PER_CLOCK_READ) {
            elapsed = start.elapsed();
        }
        if elapsed < SPIN {
            std::hint::spin_loop();
        } else if elapsed < POLL {
            std::thread::yield_now();
        } else {
            // Woken by the submitter's unpark (or spuriously); an unpark that lands between the load above and
            // this call leaves a token, so the park returns at once and the loop sees the new generation.
            shared.parked.fetch_add(1, Ordering::Relaxed);
            std::thread::park();
            shared.parked.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = PollingPool::new(3).expect("threads");
        for tasks in [0, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            pool.run(tasks, &|t| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "tasks = {tasks}");
        }
    }

    #[test]
    fn jobs_after_the_helpers_park_still_run() {
        let pool = PollingPool::new(1).expect("threads");
        for _ in 0..3 {
            std::thread::sleep(POLL * 5);
            let sum = AtomicUsize::new(0);
            pool.run(64, &|t| {
                sum.fetch_add(t, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 64 * 63 / 2);
        }
    }

    #[test]
    fn an_idle_pool_parks_its_helpers() {
        let pool = PollingPool::new(2).expect("threads");
        for _ in 0..3 {
            pool.run(16, &|_| {});
            // Helpers poll for POLL after a job; on a loaded machine they may take a while to be scheduled.
            let deadline = Instant::now() + Duration::from_secs(10);
            while pool.shared.parked.load(Ordering::Relaxed) < 2 {
                assert!(Instant::now() < deadline, "helpers still polling long after the last job");
                std::thread::sleep(POLL);
            }
        }
    }

    #[test]
    fn nested_calls_run_inline() {
        let pool = PollingPool::new(2).expect("threads");
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            pool.run(4, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(count.load(Ordering::Relaxed), 32);
    }

    #[test]
    fn callers_on_several_threads_share_the_pool() {
        let pool = PollingPool::new(1).expect("threads");
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        pool.run(16, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 200 * 16);
    }

    #[test]
    fn a_panicking_task_is_re_raised_and_the_pool_keeps_working() {
        let pool = PollingPool::new(2).expect("threads");
        for _ in 0..20 {
            let caught = catch_unwind(AssertUnwindSafe(|| {
                pool.run(50, &|t| {
                    if t == 37 {
                        panic!("task 37");
                    }
                })
            }));
            assert!(caught.is_err());
        }
        let count = AtomicUsize::new(0);
        pool.run(50, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 50);
    }
}
