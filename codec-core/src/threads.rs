//! Spreading independent jobs over threads: what parallel decoding and encoding share. Results
//! come back in job order and each job's result depends on the job alone, so what the caller
//! assembles never depends on the thread count. Without `std` every job runs on the caller's
//! thread.

/// Most threads a call uses, whatever it asks for: past a few tens of thousands the OS refuses
/// threads or the memory maps of their stacks (a refused map aborts the process), and no
/// machine has cores for more than this.
pub const MAX_THREADS: usize = 1024;

/// The thread count `threads` asks for: itself, or with 0 every core the process may use (1
/// without `std`); at most [`MAX_THREADS`].
pub fn thread_count(threads: usize) -> usize {
    #[cfg(feature = "std")]
    if threads == 0 {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        return cores.min(MAX_THREADS);
    }
    threads.clamp(1, MAX_THREADS)
}

/// Runs `f(state, job)` for every job on up to `threads` threads ([`thread_count`]; fewer if the
/// OS refuses more), the caller's among them, each thread with its own `state` from `init`,
/// taking the jobs in order from a shared queue; returns the results in job order. A panic in a job is resumed on the caller's thread.
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
        // The caller's thread is one of the workers. Threads the OS refuses (a count past its
        // limit) are not needed: the queue is shared, so fewer workers still run every job.
        let workers: Vec<_> = (1..threads)
            .map_while(|_| std::thread::Builder::new().spawn_scoped(scope, worker).ok())
            .collect();
        let mut all = worker();
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

#[cfg(all(test, feature = "std"))]
mod tests {
    /// More threads than the OS gives a process: 40 000 jobs, each once on a thread of its own,
    /// failed (a thread's stack guard page refused past the OS's memory-map limit on the
    /// development machine). The jobs all run, in order.
    #[test]
    fn a_thread_count_past_the_os_limit_still_runs_every_job() {
        let jobs: Vec<u32> = (0..40_000).collect();
        let out = super::run(jobs, 100_000, || (), |_, j| j * 2);
        assert!(out.iter().enumerate().all(|(i, &r)| r == 2 * i as u32));
        assert_eq!(out.len(), 40_000);
    }
}
