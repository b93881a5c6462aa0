//! TCP rendezvous: rank 0 listens at MASTER_ADDR:MASTER_PORT, every other rank connects and says
//! its rank, and once all are there rank 0 sends each the same payload (length-prefixed). Used to
//! hand out NCCL's unique id. Gives up after `timeout`, naming the ranks that never came.

use crate::{CommError, DistEnv, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn err(env: &DistEnv, msg: impl Into<String>) -> CommError {
    CommError::Rendezvous { addr: format!("{}:{}", env.master_addr, env.master_port), msg: msg.into() }
}

/// Every rank gets the bytes `payload` makes on rank 0 (it is not called elsewhere).
pub fn rendezvous(env: &DistEnv, payload: impl FnOnce() -> Result<Vec<u8>>, timeout: Duration) -> Result<Vec<u8>> {
    if env.world_size == 1 {
        return payload();
    }
    let deadline = Instant::now() + timeout;
    if env.rank == 0 { serve(env, payload()?, deadline, timeout) } else { join(env, deadline, timeout) }
}

fn serve(env: &DistEnv, data: Vec<u8>, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let listener = TcpListener::bind((env.master_addr.as_str(), env.master_port))
        .map_err(|e| err(env, format!("rank 0 cannot listen: {e}")))?;
    listener.set_nonblocking(true).map_err(|e| err(env, e.to_string()))?;
    let mut peers: Vec<(usize, TcpStream)> = Vec::new();
    while peers.len() < env.world_size - 1 {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(|e| err(env, e.to_string()))?;
                s.set_read_timeout(Some(
                    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)),
                ))
                .map_err(|e| err(env, e.to_string()))?;
                let mut r = [0u8; 4];
                s.read_exact(&mut r).map_err(|e| err(env, format!("a peer did not say its rank: {e}")))?;
                let rank = u32::from_le_bytes(r) as usize;
                if rank == 0 || rank >= env.world_size || peers.iter().any(|(p, _)| *p == rank) {
                    return Err(err(env, format!("unexpected rank {rank} joined (world size {})", env.world_size)));
                }
                peers.push((rank, s));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing = (1..env.world_size).filter(|r| !peers.iter().any(|(p, _)| p == r)).collect();
                    return Err(CommError::Timeout { op: "rendezvous", size: env.world_size, timeout, missing });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(err(env, e.to_string())),
        }
    }
    for (rank, s) in &mut peers {
        s.write_all(&(data.len() as u64).to_le_bytes())
            .and_then(|_| s.write_all(&data))
            .map_err(|e| err(env, format!("sending to rank {rank}: {e}")))?;
    }
    Ok(data)
}

fn join(env: &DistEnv, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let mut s = loop {
        match TcpStream::connect((env.master_addr.as_str(), env.master_port)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => {
                return Err(CommError::Timeout { op: "rendezvous", size: env.world_size, timeout, missing: vec![0] });
            }
        }
    };
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).map_err(|e| err(env, e.to_string()))?;
    s.write_all(&(env.rank as u32).to_le_bytes()).map_err(|e| err(env, e.to_string()))?;
    let mut len = [0u8; 8];
    let timed_out = |e: std::io::Error| {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            // Rank 0 is up but some other rank never came, so rank 0 never sent.
            CommError::Timeout { op: "rendezvous", size: env.world_size, timeout, missing: vec![] }
        } else {
            err(env, format!("reading from rank 0: {e}"))
        }
    };
    s.read_exact(&mut len).map_err(timed_out)?;
    let mut data = vec![0u8; u64::from_le_bytes(len) as usize];
    s.read_exact(&mut data).map_err(timed_out)?;
    Ok(data)
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
}
