//! A watchdog for backends whose operations complete asynchronously (NCCL): each enqueued
//! operation is tracked with a probe that says whether it has finished; they finish in the order
//! enqueued (one stream), so only the oldest is watched. If it is still running after the
//! timeout, the watchdog runs the abort hooks once (ncclCommAbort, which makes stuck kernels
//! return) and every later `check` fails naming the operation and its group. Without it a rank
//! that never arrives hangs the others for ever.

use crate::{CommError, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

type Probe = Box<dyn Fn() -> bool + Send>;
type Hook = Box<dyn Fn() + Send>;

struct Pending {
    op: &'static str,
    group: String,
    since: Instant,
    done: Probe,
}

struct Inner {
    timeout: Duration,
    queue: Mutex<VecDeque<Pending>>,
    failed: Mutex<Option<(&'static str, String)>>,
    aborted: AtomicBool,
    hooks: Mutex<Vec<(u64, Hook)>>,
    next_hook: std::sync::atomic::AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Shared by a process's communicators (the world and its splits).
#[derive(Clone)]
pub struct Watchdog {
    inner: Arc<Inner>,
}

impl Watchdog {
    /// Starts the polling thread (it ends when the last handle is dropped).
    pub fn new(timeout: Duration, poll: Duration) -> Watchdog {
        let inner = Arc::new(Inner {
            timeout,
            queue: Mutex::new(VecDeque::new()),
            failed: Mutex::new(None),
            aborted: AtomicBool::new(false),
            hooks: Mutex::new(vec![]),
            next_hook: std::sync::atomic::AtomicU64::new(0),
        });
        let weak: Weak<Inner> = Arc::downgrade(&inner);
        let spawned = std::thread::Builder::new().name("comm-watchdog".into()).spawn(move || {
            while let Some(w) = weak.upgrade() {
                if !w.poll() {
                    break;
                }
                drop(w);
                std::thread::sleep(poll);
            }
        });
        // Without the thread nothing is watched; operations still run.
        drop(spawned);
        Watchdog { inner }
    }

    /// Runs `hook` when an operation times out (once, with every other hook); returns its id for
    /// `forget`.
    pub fn on_timeout(&self, hook: impl Fn() + Send + 'static) -> u64 {
        let id = self.inner.next_hook.fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.hooks).push((id, Box::new(hook)));
        id
    }

    /// Drops hook `id` (its communicator is going away); waits for hooks that are running.
    pub fn forget(&self, id: u64) {
        lock(&self.inner.hooks).retain(|(i, _)| *i != id);
    }

    /// Watches an operation just enqueued on `group`; `done` says whether it has finished.
    pub fn track(&self, op: &'static str, group: &str, done: impl Fn() -> bool + Send + 'static) {
        if self.aborted() {
            return;
        }
        lock(&self.inner.queue).push_back(Pending {
            op,
            group: group.to_string(),
            since: Instant::now(),
            done: Box::new(done),
        });
    }

    /// Err once an operation has timed out (and the communicators were aborted).
    pub fn check(&self) -> Result<()> {
        match &*lock(&self.inner.failed) {
            Some((op, group)) => Err(CommError::Stuck { op, group: group.clone(), timeout: self.inner.timeout }),
            None => Ok(()),
        }
    }

    /// Whether the abort hooks have run (communicators are gone: do not destroy them again).
    pub fn aborted(&self) -> bool {
        self.inner.aborted.load(Ordering::Acquire)
    }
}

impl Inner {
    /// One look at the queue; false once aborted (the thread can stop).
    fn poll(&self) -> bool {
        let mut q = lock(&self.queue);
        while q.front().is_some_and(|p| (p.done)()) {
            q.pop_front();
        }
        let Some(p) = q.front() else { return true };
        if p.since.elapsed() <= self.timeout {
            return true;
        }
        *lock(&self.failed) = Some((p.op, p.group.clone()));
        q.clear();
        drop(q);
        self.aborted.store(true, Ordering::Release);
        for (_, h) in lock(&self.hooks).iter() {
            h();
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    const POLL: Duration = Duration::from_millis(5);

    #[test]
    fn finished_operations_never_trip_it() {
        // The operations finish within the timeout (with room for a loaded machine oversleeping),
        // then the test waits well past it: a watchdog that kept finished work would trip.
        let w = Watchdog::new(Duration::from_secs(1), POLL);
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        w.track("all_reduce", "dp[0, 1]", move || f.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(10));
        flag.store(true, Ordering::Relaxed);
        w.track("broadcast", "tp[0, 1]", || true);
        std::thread::sleep(Duration::from_millis(2500));
        assert!(w.check().is_ok());
        assert!(!w.aborted());
    }

    #[test]
    fn a_stuck_operation_aborts_once_and_is_named() {
        let w = Watchdog::new(Duration::from_millis(30), POLL);
        let aborts = Arc::new(AtomicUsize::new(0));
        let mut ids = vec![];
        for _ in 0..3 {
            let a = aborts.clone();
            ids.push(w.on_timeout(move || {
                a.fetch_add(1, Ordering::SeqCst);
            }));
        }
        w.forget(ids[1]); // a communicator already dropped is not aborted
        w.track("all_reduce", "dp[0, 1]", || true);
        w.track("reduce_scatter", "dp[0, 1]", || false);
        w.track("all_gather", "tp[2, 3]", || false);
        let start = Instant::now();
        while w.check().is_ok() {
            assert!(start.elapsed() < Duration::from_secs(5), "the watchdog never fired");
            std::thread::sleep(POLL);
        }
        let msg = w.check().unwrap_err().to_string();
        assert!(msg.contains("reduce_scatter") && msg.contains("dp[0, 1]"), "{msg}");
        assert!(w.aborted());
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(aborts.load(Ordering::SeqCst), 2, "each hook not forgotten runs exactly once");
    }
}
