//! The thread backend: N ranks in one process, each a thread with its own communicator. Sending is
//! a move into the receiver's mailbox. Used by the tests and by `--nproc N` on CPU.

use crate::Communicator;
use crate::mesh::MeshComm;
use crate::transport::{Key, Mailbox, Message, Transport};
use std::sync::Arc;
use std::time::Duration;

struct ThreadTransport {
    rank: usize,
    boxes: Arc<Vec<Mailbox>>,
}

impl Transport for ThreadTransport {
    fn world_rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.boxes.len()
    }
    fn send(&self, dst: usize, key: Key, msg: Message) -> std::io::Result<()> {
        self.boxes[dst].put(key, msg);
        Ok(())
    }
    fn inbox(&self) -> &Mailbox {
        &self.boxes[self.rank]
    }
}

/// One world communicator per rank, for `n` threads of this process.
pub fn thread_world(n: usize, timeout: Duration) -> Vec<Arc<dyn Communicator>> {
    world_and_mailboxes(n, timeout).0
}

fn world_and_mailboxes(n: usize, timeout: Duration) -> (Vec<Arc<dyn Communicator>>, Arc<Vec<Mailbox>>) {
    let boxes: Arc<Vec<Mailbox>> = Arc::new((0..n).map(|_| Mailbox::default()).collect());
    let world = (0..n)
        .map(|rank| {
            let t = Arc::new(ThreadTransport { rank, boxes: boxes.clone() });
            Arc::new(MeshComm::world(t, timeout)) as Arc<dyn Communicator>
        })
        .collect();
    (world, boxes)
}

/// The prefix of the reason a rank gives for a peer that has left (see `run_ranks`): a rank
/// whose error carries it failed because another did.
pub const PEER_LEFT: &str = "it has left the run";

/// When a rank's thread ends (its work returned, failed or panicked), the others are told: each
/// wait for a message from it that is not already delivered fails at once, naming it, instead of
/// running into the timeout. Everything it sent before it ended is still received.
struct LeaveOnDrop {
    rank: usize,
    boxes: Arc<Vec<Mailbox>>,
}

impl Drop for LeaveOnDrop {
    fn drop(&mut self) {
        let how = if std::thread::panicking() { "panicked" } else { "returned" };
        for (_, b) in self.boxes.iter().enumerate().filter(|(r, _)| *r != self.rank) {
            b.mark_broken(self.rank, format!("{PEER_LEFT} (rank {} {how})", self.rank));
        }
    }
}

/// Runs `f(rank, world)` on `n` threads and returns every rank's result in rank order. A rank
/// that panics is reported as an error rather than taking the others down, and a rank that ends
/// (returning an error, say) makes the others' waits for it fail at once rather than time out.
pub fn run_ranks<T: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(usize, Arc<dyn Communicator>) -> T + Sync,
) -> Vec<std::result::Result<T, String>> {
    let (world, boxes) = world_and_mailboxes(n, timeout);
    std::thread::scope(|s| {
        let hs: Vec<_> = world
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let f = &f;
                let leave = LeaveOnDrop { rank: r, boxes: boxes.clone() };
                std::thread::Builder::new()
                    .name(format!("rank{r}"))
                    .spawn_scoped(s, move || {
                        let _leave = leave;
                        f(r, c)
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().map_err(|p| {
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "rank panicked".into())
                })
            })
            .collect()
    })
}

/// `Ok` with every rank's value, or the first rank's error (as text) that is its own: one that
/// does not only say a peer left (`PEER_LEFT`), when there is such an error.
pub fn all_ok<T, E: std::fmt::Display>(
    v: Vec<std::result::Result<std::result::Result<T, E>, String>>,
) -> std::result::Result<Vec<T>, String> {
    let mut errors = vec![];
    let mut values = vec![];
    for (r, x) in v.into_iter().enumerate() {
        match x {
            Ok(Ok(t)) => values.push(t),
            Ok(Err(e)) => errors.push(format!("rank {r}: {e}")),
            Err(p) => errors.push(format!("rank {r} panicked: {p}")),
        }
    }
    match errors.iter().position(|e| !e.contains(PEER_LEFT)) {
        Some(i) => Err(errors.swap_remove(i)),
        None if !errors.is_empty() => Err(errors.swap_remove(0)),
        None => Ok(values),
    }
}
