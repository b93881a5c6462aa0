//! The TCP backend for CPU processes: a full mesh of connections (rank i dials every rank below
//! it), set up through the rendezvous at MASTER_ADDR:MASTER_PORT. One reader thread per peer files
//! incoming frames into this rank's mailbox; the collectives are `MeshComm`'s.
//!
//! Frame: group u64 | seq u64 | op length u16 | op | data length u64 | data (little-endian).

use crate::mesh::MeshComm;
use crate::transport::{Key, Mailbox, Message, Transport};
use crate::{CommError, Communicator, DistEnv, Result, rendezvous_all};
use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct TcpTransport {
    rank: usize,
    size: usize,
    /// Writing half per peer (None for this rank).
    peers: Vec<Option<Mutex<TcpStream>>>,
    inbox: Arc<Mailbox>,
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        for p in self.peers.iter().flatten() {
            let _ = p.lock().map(|s| s.shutdown(Shutdown::Both));
        }
    }
}

impl Transport for TcpTransport {
    fn world_rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    fn send(&self, dst: usize, key: Key, msg: Message) -> std::io::Result<()> {
        if dst == self.rank {
            self.inbox.put(key, msg);
            return Ok(());
        }
        let Some(p) = &self.peers[dst] else { return Err(std::io::Error::other("no connection")) };
        let mut head = Vec::with_capacity(34 + msg.op.len());
        head.extend_from_slice(&key.group.to_le_bytes());
        head.extend_from_slice(&key.seq.to_le_bytes());
        head.extend_from_slice(&(msg.op.len() as u16).to_le_bytes());
        head.extend_from_slice(msg.op.as_bytes());
        head.extend_from_slice(&(msg.data.len() as u64).to_le_bytes());
        let mut s = p.lock().unwrap_or_else(|e| e.into_inner());
        s.write_all(&head)?;
        s.write_all(&msg.data)
    }
    fn inbox(&self) -> &Mailbox {
        &self.inbox
    }
}

fn read_frames(src: usize, stream: TcpStream, inbox: Arc<Mailbox>) {
    let mut r = BufReader::with_capacity(1 << 20, stream);
    let mut frame = || -> std::io::Result<(Key, Message)> {
        let mut u8s = [0u8; 8];
        r.read_exact(&mut u8s)?;
        let group = u64::from_le_bytes(u8s);
        r.read_exact(&mut u8s)?;
        let seq = u64::from_le_bytes(u8s);
        let mut l2 = [0u8; 2];
        r.read_exact(&mut l2)?;
        let mut op = vec![0u8; u16::from_le_bytes(l2) as usize];
        r.read_exact(&mut op)?;
        r.read_exact(&mut u8s)?;
        let mut data = vec![0u8; u64::from_le_bytes(u8s) as usize];
        r.read_exact(&mut data)?;
        Ok((Key { src, group, seq }, Message { op: String::from_utf8_lossy(&op).into_owned(), data }))
    };
    loop {
        match frame() {
            Ok((k, m)) => inbox.put(k, m),
            Err(e) => {
                inbox.mark_broken(src, e.to_string());
                return;
            }
        }
    }
}

fn link(env: &DistEnv, msg: String) -> CommError {
    CommError::Rendezvous { addr: format!("{}:{}", env.master_addr, env.master_port), msg }
}

/// Joins the world of `env` as CPU processes over TCP; `timeout` bounds the set-up and every
/// later collective.
pub fn tcp_world(env: &DistEnv, timeout: Duration) -> Result<Arc<dyn Communicator>> {
    let listener = TcpListener::bind("0.0.0.0:0").map_err(|e| link(env, format!("cannot listen: {e}")))?;
    let port = listener.local_addr().map_err(|e| link(env, e.to_string()))?.port();
    let all = rendezvous_all(env, port.to_le_bytes().to_vec(), timeout)?;
    let deadline = Instant::now() + timeout;
    let mut streams: Vec<Option<TcpStream>> = (0..env.world_size).map(|_| None).collect();
    for (j, (host, p)) in all.iter().enumerate().take(env.rank) {
        let port = u16::from_le_bytes(p.as_slice().try_into().map_err(|_| link(env, "bad port".into()))?);
        let host = if host == "0.0.0.0" { "127.0.0.1" } else { host.as_str() };
        let mut s = loop {
            match TcpStream::connect((host, port)) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(link(env, format!("cannot reach rank {j} at {host}:{port}: {e}"))),
            }
        };
        s.write_all(&(env.rank as u32).to_le_bytes()).map_err(|e| link(env, e.to_string()))?;
        streams[j] = Some(s);
    }
    listener.set_nonblocking(true).map_err(|e| link(env, e.to_string()))?;
    let mut waiting = env.world_size - 1 - env.rank;
    while waiting > 0 {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(|e| link(env, e.to_string()))?;
                let mut b = [0u8; 4];
                s.read_exact(&mut b).map_err(|e| link(env, e.to_string()))?;
                let j = u32::from_le_bytes(b) as usize;
                if j <= env.rank || j >= env.world_size || streams[j].is_some() {
                    return Err(link(env, format!("unexpected peer rank {j}")));
                }
                streams[j] = Some(s);
                waiting -= 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing = (env.rank + 1..env.world_size).filter(|&j| streams[j].is_none()).collect();
                    let group = format!("world of {}", env.world_size);
                    return Err(CommError::Timeout { op: "tcp connect", group, timeout, missing });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(link(env, e.to_string())),
        }
    }
    let inbox = Arc::new(Mailbox::default());
    let mut peers = Vec::with_capacity(env.world_size);
    for (j, s) in streams.into_iter().enumerate() {
        match s {
            Some(s) => {
                s.set_nodelay(true).map_err(|e| link(env, e.to_string()))?;
                let reader = s.try_clone().map_err(|e| link(env, e.to_string()))?;
                let ib = inbox.clone();
                std::thread::Builder::new()
                    .name(format!("tcp-recv-{j}"))
                    .spawn(move || read_frames(j, reader, ib))
                    .map_err(|e| link(env, e.to_string()))?;
                peers.push(Some(Mutex::new(s)));
            }
            None => peers.push(None),
        }
    }
    let t = Arc::new(TcpTransport { rank: env.rank, size: env.world_size, peers, inbox });
    Ok(Arc::new(MeshComm::world(t, timeout)))
}
