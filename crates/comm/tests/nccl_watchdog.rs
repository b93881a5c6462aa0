//! The NCCL watchdog on two GPUs (feature `cuda`; run on a machine with two, e.g. the
//! nvidia-h200-x2 kind): rank 1 skips an all-reduce that rank 0 enters. Rank 0's all-reduce never
//! ends; after the timeout its communicator is aborted and its next call fails naming the
//! operation and group. Rank 1 enters the all-reduce late, after rank 0 gave up, and gets the same
//! kind of error instead of hanging. (At world size 1 nothing can be left unmatched: NCCL refuses
//! a lone receive from oneself up front.) Its own binary: aborted communicators must not share a
//! process with other tests.
#![cfg(feature = "cuda")]

use ferrotron_comm::{CommError, Communicator, DistEnv, NcclComm, ReduceOp};
use ferrotron_core::{DType, Device, Tensor};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(2);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Rank `rank`'s story; returns the error its first failing call gave.
fn rank_main(rank: usize, port: u16) -> CommError {
    let gpu = Device::cuda(rank).unwrap_or_else(|e| panic!("GPU {rank}: this test needs two GPUs ({e})"));
    let Device::Cuda(dev) = gpu.clone() else { unreachable!() };
    let env = DistEnv {
        rank,
        world_size: 2,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        source: "test",
    };
    let comm = NcclComm::new(&dev, &env, TIMEOUT).expect("NCCL init");
    // Host tensors travel through the device; a matched all-reduce completes.
    let host = Tensor::from_vec(vec![1.5f32, -2.0 + rank as f32], [2], &Device::Cpu).unwrap();
    comm.all_reduce(&host, ReduceOp::Sum).unwrap();
    assert_eq!(host.to_vec_f32().unwrap(), vec![3.0, -3.0]);
    let t = Tensor::zeros([1 << 20], DType::F32, &gpu).unwrap();
    if rank == 1 {
        // Skips the collective rank 0 is in until rank 0 has certainly given up on it.
        std::thread::sleep(3 * TIMEOUT);
    }
    let start = Instant::now();
    let mut first = comm.all_reduce(&t, ReduceOp::Sum).err();
    while first.is_none() {
        std::thread::sleep(Duration::from_millis(200));
        first = comm.barrier().err();
        assert!(start.elapsed() < Duration::from_secs(60), "rank {rank}: no timeout after 60 s");
    }
    first.unwrap()
}

#[test]
fn a_skipped_all_reduce_times_out_on_every_rank_with_a_named_error() {
    let port = free_port();
    let ranks: Vec<_> = (0..2).map(|r| std::thread::spawn(move || rank_main(r, port))).collect();
    for (r, h) in ranks.into_iter().enumerate() {
        let err = h.join().unwrap_or_else(|_| panic!("rank {r} panicked"));
        let msg = err.to_string();
        assert!(msg.contains("all_reduce"), "rank {r}: {msg}");
        assert!(matches!(err, CommError::Stuck { op: "all_reduce", .. }), "rank {r}: {msg}");
        assert!(msg.contains("world[0, 1]"), "rank {r}: {msg}");
    }
}
