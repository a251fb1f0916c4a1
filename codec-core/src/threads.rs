//! Spreading independent jobs over threads: what parallel decoding and encoding share. Results
//! come back in job order and each job's result depends on the job alone, so what the caller
//! assembles never depends on the thread count. Without `std` every job runs on the caller's
//! thread.

/// The thread count `threads` asks for: itself, or with 0 every core the process may use (1
/// without `std`).
pub fn thread_count(threads: usize) -> usize {
    #[cfg(feature = "std")]
    if threads == 0 {
        return std::thread::available_parallelism().map_or(1, |n| n.get());
    }
    threads.max(1)
}

/// Runs `f(state, job)` for every job on up to `threads` threads ([`thread_count`]), each thread
/// with its own `state` from `init`, taking the jobs in order from a shared queue; returns the
/// results in job order. A panic in a job is resumed on the caller's thread.
pub(crate) fn run<J: Send, S, R: Send>(
    jobs: alloc::vec::Vec<J>,
    threads: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, J) -> R + Sync,
) -> alloc::vec::Vec<R> {
    let threads = thread_count(threads).min(jobs.len());
    #[cfg(feature = "std")]
    if threads > 1 {
        return run_on_threads(jobs, threads, init, f);
    }
    let _ = threads;
    let mut state = init();
    jobs.into_iter().map(|j| f(&mut state, j)).collect()
}

#[cfg(feature = "std")]
fn run_on_threads<J: Send, S, R: Send>(
    jobs: Vec<J>,
    threads: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, J) -> R + Sync,
) -> Vec<R> {
    let queue = std::sync::Mutex::new(jobs.into_iter().enumerate());
    // A job that panics poisons nothing the others need: the queue's iterator is only advanced
    // under the lock, never left half-updated.
    let next = || match queue.lock() {
        Ok(mut q) => q.next(),
        Err(poisoned) => poisoned.into_inner().next(),
    };
    let worker = || {
        let mut state = init();
        let mut done = Vec::new();
        while let Some((i, job)) = next() {
            done.push((i, f(&mut state, job)));
        }
        done
    };
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads).map(|_| scope.spawn(worker)).collect();
        let mut all = Vec::new();
        for w in workers {
            match w.join() {
                Ok(d) => all.extend(d),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        all
    });
    done.sort_unstable_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}
