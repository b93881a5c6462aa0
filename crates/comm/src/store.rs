//! TCP rendezvous: rank 0 listens at MASTER_ADDR:MASTER_PORT, every other rank connects, says its
//! rank and sends its payload; once all are there rank 0 sends each the full list (every rank's
//! payload and the address rank 0 saw it connect from). Used to hand out NCCL's unique id and the
//! TCP backend's listening ports. Gives up after `timeout`, naming the ranks that never came.

use crate::{CommError, DistEnv, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn err(env: &DistEnv, msg: impl Into<String>) -> CommError {
    CommError::Rendezvous { addr: format!("{}:{}", env.master_addr, env.master_port), msg: msg.into() }
}

fn timeout_err(env: &DistEnv, timeout: Duration, missing: Vec<usize>) -> CommError {
    CommError::Timeout { op: "rendezvous", group: format!("world of {}", env.world_size), timeout, missing }
}

/// Every rank gets the bytes `payload` makes on rank 0 (it is not called elsewhere).
pub fn rendezvous(env: &DistEnv, payload: impl FnOnce() -> Result<Vec<u8>>, timeout: Duration) -> Result<Vec<u8>> {
    let mine = if env.rank == 0 { payload()? } else { Vec::new() };
    let mut all = rendezvous_all(env, mine, timeout)?;
    Ok(std::mem::take(&mut all[0].1))
}

/// Every rank gets every rank's payload, in rank order, with the host each was seen at (rank 0's
/// is MASTER_ADDR).
pub fn rendezvous_all(env: &DistEnv, mine: Vec<u8>, timeout: Duration) -> Result<Vec<(String, Vec<u8>)>> {
    if env.world_size == 1 {
        return Ok(vec![(env.master_addr.clone(), mine)]);
    }
    let deadline = Instant::now() + timeout;
    if env.rank == 0 { serve(env, mine, deadline, timeout) } else { join(env, mine, deadline, timeout) }
}

fn write_blob(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u64).to_le_bytes())?;
    s.write_all(b)
}

fn read_blob(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let mut data = vec![0u8; u64::from_le_bytes(len) as usize];
    s.read_exact(&mut data)?;
    Ok(data)
}

fn encode(all: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (host, p) in all {
        for b in [host.as_bytes(), p.as_slice()] {
            out.extend_from_slice(&(b.len() as u64).to_le_bytes());
            out.extend_from_slice(b);
        }
    }
    out
}

fn decode(mut b: &[u8], n: usize) -> Option<Vec<(String, Vec<u8>)>> {
    let mut take = || {
        let len = u64::from_le_bytes(b.get(..8)?.try_into().ok()?) as usize;
        let v = b.get(8..8 + len)?.to_vec();
        b = &b[8 + len..];
        Some(v)
    };
    (0..n).map(|_| Some((String::from_utf8(take()?).ok()?, take()?))).collect()
}

fn serve(env: &DistEnv, mine: Vec<u8>, deadline: Instant, timeout: Duration) -> Result<Vec<(String, Vec<u8>)>> {
    let listener = TcpListener::bind((env.master_addr.as_str(), env.master_port))
        .map_err(|e| err(env, format!("rank 0 cannot listen: {e}")))?;
    listener.set_nonblocking(true).map_err(|e| err(env, e.to_string()))?;
    let mut peers: Vec<(usize, TcpStream, String, Vec<u8>)> = Vec::new();
    while peers.len() < env.world_size - 1 {
        match listener.accept() {
            Ok((mut s, addr)) => {
                s.set_nonblocking(false).map_err(|e| err(env, e.to_string()))?;
                s.set_read_timeout(Some(
                    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)),
                ))
                .map_err(|e| err(env, e.to_string()))?;
                let mut r = [0u8; 4];
                s.read_exact(&mut r).map_err(|e| err(env, format!("a peer did not say its rank: {e}")))?;
                let rank = u32::from_le_bytes(r) as usize;
                if rank == 0 || rank >= env.world_size || peers.iter().any(|(p, ..)| *p == rank) {
                    return Err(err(env, format!("unexpected rank {rank} joined (world size {})", env.world_size)));
                }
                let payload = read_blob(&mut s).map_err(|e| err(env, format!("reading rank {rank}: {e}")))?;
                peers.push((rank, s, addr.ip().to_string(), payload));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing = (1..env.world_size).filter(|r| !peers.iter().any(|(p, ..)| p == r)).collect();
                    return Err(timeout_err(env, timeout, missing));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(err(env, e.to_string())),
        }
    }
    peers.sort_by_key(|p| p.0);
    let mut all = vec![(env.master_addr.clone(), mine)];
    all.extend(peers.iter().map(|(_, _, host, p)| (host.clone(), p.clone())));
    let blob = encode(&all);
    for (rank, s, ..) in &mut peers {
        write_blob(s, &blob).map_err(|e| err(env, format!("sending to rank {rank}: {e}")))?;
    }
    Ok(all)
}

fn join(env: &DistEnv, mine: Vec<u8>, deadline: Instant, timeout: Duration) -> Result<Vec<(String, Vec<u8>)>> {
    let mut s = loop {
        match TcpStream::connect((env.master_addr.as_str(), env.master_port)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => return Err(timeout_err(env, timeout, vec![0])),
        }
    };
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).map_err(|e| err(env, e.to_string()))?;
    s.write_all(&(env.rank as u32).to_le_bytes())
        .and_then(|_| write_blob(&mut s, &mine))
        .map_err(|e| err(env, e.to_string()))?;
    let blob = read_blob(&mut s).map_err(|e| {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            // Rank 0 is up but some other rank never came, so rank 0 never sent.
            timeout_err(env, timeout, vec![])
        } else {
            err(env, format!("reading from rank 0: {e}"))
        }
    })?;
    decode(&blob, env.world_size).ok_or_else(|| err(env, "rank 0 sent a malformed list"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envs(n: usize, port: u16) -> Vec<DistEnv> {
        (0..n)
            .map(|rank| DistEnv {
                rank,
                world_size: n,
                local_rank: rank,
                master_port: port,
                source: "test",
                ..DistEnv::single()
            })
            .collect()
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[test]
    fn every_rank_gets_rank_zeros_bytes() {
        let port = free_port();
        let handles: Vec<_> = envs(4, port)
            .into_iter()
            .map(|e| {
                std::thread::spawn(move || rendezvous(&e, || Ok(b"nccl-unique-id".to_vec()), Duration::from_secs(10)))
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), b"nccl-unique-id");
        }
    }

    #[test]
    fn a_missing_rank_times_out_by_name() {
        let port = free_port();
        let all = envs(3, port);
        let (r0, r1) = (all[0].clone(), all[1].clone());
        let t0 = std::thread::spawn(move || rendezvous(&r0, || Ok(vec![1]), Duration::from_millis(600)));
        let t1 = std::thread::spawn(move || rendezvous(&r1, || Ok(vec![1]), Duration::from_millis(600)));
        // Rank 2 never comes.
        let e0 = t0.join().unwrap().unwrap_err();
        assert!(matches!(&e0, CommError::Timeout { missing, .. } if missing == &vec![2]), "{e0}");
        assert!(e0.to_string().contains("rendezvous") && e0.to_string().contains("[2]"), "{e0}");
        assert!(matches!(t1.join().unwrap(), Err(CommError::Timeout { .. }) | Err(CommError::Rendezvous { .. })));
    }

    #[test]
    fn every_rank_gets_every_payload() {
        let port = free_port();
        let handles: Vec<_> = envs(3, port)
            .into_iter()
            .map(|e| {
                std::thread::spawn(move || rendezvous_all(&e, vec![e.rank as u8; e.rank + 1], Duration::from_secs(10)))
            })
            .collect();
        for h in handles {
            let all = h.join().unwrap().unwrap();
            let payloads: Vec<Vec<u8>> = all.into_iter().map(|(_, p)| p).collect();
            assert_eq!(payloads, vec![vec![0], vec![1, 1], vec![2, 2, 2]]);
        }
    }
}
