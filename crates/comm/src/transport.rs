//! Point-to-point message delivery under the thread and TCP backends.
//!
//! A message is addressed by (sender's world rank, group id, sequence number) and carries the name
//! of the operation that sent it, so a receiver can tell "never came" (timeout) from "came from a
//! different collective" (mismatch). Each rank owns one `Mailbox`; transports only move bytes into
//! the right mailbox.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// Where a message belongs: which group, which call of that group, who sent it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub src: usize,
    pub group: u64,
    pub seq: u64,
}

#[derive(Debug)]
pub struct Message {
    pub op: String,
    pub data: Vec<u8>,
}

/// Messages that have arrived for one rank, waiting to be taken.
#[derive(Default)]
pub struct Mailbox {
    slots: Mutex<HashMap<Key, Message>>,
    arrived: Condvar,
    /// Set when a peer's connection dropped: (peer, why). Waiters on that peer fail at once.
    broken: Mutex<Vec<(usize, String)>>,
}

pub enum Take {
    Got(Message),
    TimedOut,
    Broken(String),
}

impl Mailbox {
    pub fn put(&self, key: Key, msg: Message) {
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        s.insert(key, msg);
        self.arrived.notify_all();
    }

    pub fn mark_broken(&self, peer: usize, why: String) {
        self.broken.lock().unwrap_or_else(|p| p.into_inner()).push((peer, why));
        let _g = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        self.arrived.notify_all();
    }

    fn broken(&self, peer: usize) -> Option<String> {
        let b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        b.iter().find(|(p, _)| *p == peer).map(|(_, w)| w.clone())
    }

    /// Waits until the message `key` is here or `deadline` passes.
    pub fn take(&self, key: Key, deadline: Instant) -> Take {
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(m) = s.remove(&key) {
                return Take::Got(m);
            }
            if let Some(w) = self.broken(key.src) {
                return Take::Broken(w);
            }
            let now = Instant::now();
            if now >= deadline {
                return Take::TimedOut;
            }
            s = self.arrived.wait_timeout(s, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// Moves messages between ranks of one world.
pub trait Transport: Send + Sync {
    fn world_rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Delivers `msg` to world rank `dst`'s mailbox under `key` (key.src is this rank).
    fn send(&self, dst: usize, key: Key, msg: Message) -> std::io::Result<()>;
    /// This rank's mailbox.
    fn inbox(&self) -> &Mailbox;
}
