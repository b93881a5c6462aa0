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
    let boxes: Arc<Vec<Mailbox>> = Arc::new((0..n).map(|_| Mailbox::default()).collect());
    (0..n)
        .map(|rank| {
            let t = Arc::new(ThreadTransport { rank, boxes: boxes.clone() });
            Arc::new(MeshComm::world(t, timeout)) as Arc<dyn Communicator>
        })
        .collect()
}

/// Runs `f(rank, world)` on `n` threads and returns every rank's result in rank order. A rank
/// that panics is reported as an error rather than taking the others down.
pub fn run_ranks<T: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(usize, Arc<dyn Communicator>) -> T + Sync,
) -> Vec<std::result::Result<T, String>> {
    let world = thread_world(n, timeout);
    std::thread::scope(|s| {
        let hs: Vec<_> = world
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank{r}"))
                    .spawn_scoped(s, move || f(r, c))
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

/// `Ok` with every rank's value, or the first rank's error (as text).
pub fn all_ok<T, E: std::fmt::Display>(
    v: Vec<std::result::Result<std::result::Result<T, E>, String>>,
) -> std::result::Result<Vec<T>, String> {
    v.into_iter()
        .enumerate()
        .map(|(r, x)| match x {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(e)) => Err(format!("rank {r}: {e}")),
            Err(p) => Err(format!("rank {r} panicked: {p}")),
        })
        .collect()
}
