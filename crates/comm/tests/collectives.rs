//! Every collective on the thread backend and the TCP backend, against naive results computed from
//! what each rank put in; sub-groups; and a rank that skips a collective.

use ferrotron_comm::{CommError, Communicator, DistEnv, ReduceOp, all_ok, run_ranks, tcp_world};
use ferrotron_core::{DType, Device, Tensor};
use std::sync::Arc;
use std::time::Duration;

/// Rank r's values: distinct per rank and element, not exactly representable sums.
fn vals(r: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((r * 31 + i * 7) % 13) as f32 * 0.1 + r as f32 * 0.37 - 1.0).collect()
}

fn t(v: &[f32], dt: DType) -> Tensor {
    Tensor::from_f32(v, [v.len()], dt, &Device::Cpu).unwrap()
}

/// Runs every operation on `c` and checks it; returns the all-reduce bits for a cross-rank check.
fn exercise(c: &dyn Communicator) -> Result<Vec<u32>, CommError> {
    let (r, n) = (c.rank(), c.size());
    let len = 6;
    // all_reduce, every op, f32 and bf16
    let mut bits = vec![];
    for dt in [DType::F32, DType::BF16] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let x = t(&vals(r, len), dt);
            c.all_reduce(&x, op)?;
            let got = x.to_vec_f32()?;
            for (i, g) in got.iter().enumerate() {
                let each: Vec<f64> = (0..n).map(|q| t(&vals(q, len), dt).to_vec_f32().unwrap()[i] as f64).collect();
                let want = match op {
                    ReduceOp::Sum => each.iter().sum::<f64>(),
                    ReduceOp::Avg => each.iter().sum::<f64>() / n as f64,
                    ReduceOp::Max => each.iter().cloned().fold(f64::MIN, f64::max),
                    ReduceOp::Min => each.iter().cloned().fold(f64::MAX, f64::min),
                };
                let tol = if dt == DType::F32 { 1e-6 } else { 1e-2 };
                assert!((*g as f64 - want).abs() <= tol * want.abs().max(1.0), "{dt} {op:?} [{i}]: {g} vs {want}");
            }
            bits.extend(got.iter().map(|g| g.to_bits()));
        }
    }
    // u32 sum is exact
    let u = Tensor::from_vec(vec![r as u32 * 1_000_000 + 7; 3], [3], &Device::Cpu)?;
    c.all_reduce(&u, ReduceOp::Sum)?;
    assert_eq!(u.to_vec::<u32>()?, vec![(0..n as u32).map(|q| q * 1_000_000 + 7).sum::<u32>(); 3]);
    // reduce_scatter: chunk r of the sum
    let input = t(&vals(r, len * n), DType::F32);
    let out = Tensor::zeros([len], DType::F32, &Device::Cpu)?;
    c.reduce_scatter(&input, &out, ReduceOp::Sum)?;
    let want: Vec<f32> =
        (0..len).map(|i| (0..n).map(|q| vals(q, len * n)[r * len + i] as f64).sum::<f64>() as f32).collect();
    assert_eq!(out.to_vec_f32()?, want);
    // all_gather
    let out = Tensor::zeros([n * len], DType::F32, &Device::Cpu)?;
    c.all_gather(&t(&vals(r, len), DType::F32), &out)?;
    assert_eq!(out.to_vec_f32()?, (0..n).flat_map(|q| vals(q, len)).collect::<Vec<_>>());
    // all_gather_v: rank q has q+1 rows of 2
    let counts: Vec<usize> = (0..n).map(|q| q + 1).collect();
    let mine = Tensor::from_f32(&vals(r, 2 * (r + 1)), [r + 1, 2], DType::F32, &Device::Cpu)?;
    let g = c.all_gather_v(&mine, &counts)?;
    assert_eq!(g.dims(), &[counts.iter().sum::<usize>(), 2]);
    assert_eq!(g.to_vec_f32()?, (0..n).flat_map(|q| vals(q, 2 * (q + 1))).collect::<Vec<_>>());
    // broadcast from the last rank
    let b = t(&vals(r, len), DType::BF16);
    c.broadcast(&b, n - 1)?;
    assert_eq!(b.to_vec_f32()?, t(&vals(n - 1, len), DType::BF16).to_vec_f32()?);
    // send/recv around a ring, twice (ordering per pair)
    for round in 0..2 {
        let x = t(&vals(r + round * 10, len), DType::F32);
        let y = Tensor::zeros([len], DType::F32, &Device::Cpu)?;
        if r % 2 == 0 {
            c.send(&x, (r + 1) % n)?;
            c.recv(&y, (r + n - 1) % n)?;
        } else {
            c.recv(&y, (r + n - 1) % n)?;
            c.send(&x, (r + 1) % n)?;
        }
        assert_eq!(y.to_vec_f32()?, vals((r + n - 1) % n + round * 10, len));
    }
    // all_to_all_v: rank r sends (r + q) % 3 rows of 2 to rank q
    let send: Vec<usize> = (0..n).map(|q| (r + q) % 3).collect();
    let recv: Vec<usize> = (0..n).map(|q| (q + r) % 3).collect();
    let rows: usize = send.iter().sum();
    let data: Vec<f32> = (0..rows * 2).map(|i| (r * 100 + i) as f32).collect();
    let x = Tensor::from_f32(&data, [rows, 2], DType::F32, &Device::Cpu)?;
    let y = c.all_to_all_v(&x, &send, &recv)?;
    let mut want = vec![];
    for q in 0..n {
        let qsend: Vec<usize> = (0..n).map(|d| (q + d) % 3).collect();
        let start: usize = qsend[..r].iter().sum();
        want.extend((start * 2..(start + qsend[r]) * 2).map(|i| (q * 100 + i) as f32));
    }
    assert_eq!(y.to_vec_f32()?, want);
    // all_to_all_v from no rows: rank 0 sends nothing (a [0, 3] tensor) and receives two rows
    // of 3 from every other rank (an expert-parallel rank whose tokens all went elsewhere).
    let send: Vec<usize> = (0..n).map(|q| if r != 0 && q == 0 { 2 } else { 0 }).collect();
    let recv: Vec<usize> = (0..n).map(|q| if r == 0 && q != 0 { 2 } else { 0 }).collect();
    let rows: usize = send.iter().sum();
    let x = Tensor::from_f32(&vals(r, rows * 3), [rows, 3], DType::F32, &Device::Cpu)?;
    let y = c.all_to_all_v(&x, &send, &recv)?;
    assert_eq!(y.dims(), &[recv.iter().sum::<usize>(), 3]);
    let want: Vec<f32> = if r == 0 { (1..n).flat_map(|q| vals(q, 6)).collect() } else { vec![] };
    assert_eq!(y.to_vec_f32()?, want);
    c.barrier()?;
    // sub-groups: evens and odds
    let groups: Vec<Vec<usize>> = vec![(0..n).step_by(2).collect(), (1..n).step_by(2).collect()];
    let sub = c.split("parity", &groups)?.expect("every rank is in one parity group");
    assert_eq!(sub.size(), groups[r % 2].len());
    assert!(sub.name().starts_with("parity["), "{}", sub.name());
    let x = t(&[r as f32], DType::F32);
    sub.all_reduce(&x, ReduceOp::Sum)?;
    assert_eq!(x.to_vec_f32()?, vec![groups[r % 2].iter().sum::<usize>() as f32]);
    // a split this rank is not part of
    assert!(c.split("first", &[vec![0]])?.is_none() == (r != 0));
    Ok(bits)
}

#[test]
fn thread_backend_runs_every_collective() {
    for n in [1, 2, 4] {
        let bits = all_ok(run_ranks(n, Duration::from_secs(20), |_, c| exercise(&*c))).unwrap();
        assert!(bits.windows(2).all(|w| w[0] == w[1]), "reductions differ between ranks for n={n}");
    }
}

#[test]
fn tcp_backend_runs_every_collective() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let n = 3;
    let bits = all_ok(run_ranks(n, Duration::from_secs(20), |rank, _| {
        let env =
            DistEnv { rank, world_size: n, local_rank: rank, master_port: port, source: "test", ..DistEnv::single() };
        let c: Arc<dyn Communicator> = tcp_world(&env, Duration::from_secs(20))?;
        exercise(&*c)
    }))
    .unwrap();
    assert!(bits.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn a_rank_that_skips_a_collective_fails_every_rank_by_name() {
    let res = run_ranks(3, Duration::from_millis(500), |r, c| -> Result<(), CommError> {
        let x = t(&[1.0], DType::F32);
        c.all_reduce(&x, ReduceOp::Sum)?;
        if r != 2 {
            c.all_reduce(&x, ReduceOp::Sum)?; // rank 2 skips this one
        }
        c.barrier()?;
        Ok(())
    });
    for (r, x) in res.into_iter().enumerate() {
        let e = x.expect("no panic").expect_err("every rank must fail");
        let msg = e.to_string();
        assert!(
            msg.contains("all_reduce") || msg.contains("barrier"),
            "rank {r}: the error names the collective: {msg}"
        );
        assert!(msg.contains("world[0, 1, 2]"), "rank {r}: names the group: {msg}");
        if r != 2 {
            // Ranks 0 and 1 see rank 2's barrier where the all-reduce should be.
            assert!(matches!(&e, CommError::Mismatch { peer: 2, .. }), "rank {r}: {e}");
        }
    }
}

#[test]
fn a_rank_that_never_comes_times_out_naming_it() {
    let res = run_ranks(3, Duration::from_millis(300), |r, c| -> Result<(), CommError> {
        if r == 1 {
            // Rank 1 is stuck elsewhere (alive, past the others' timeout), then leaves.
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        c.all_reduce(&t(&[1.0], DType::F32), ReduceOp::Sum)
    });
    for r in [0, 2] {
        let e = res[r].as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(e, CommError::Timeout { op: "all_reduce", missing, .. } if missing == &vec![1]), "{e}");
    }
}

/// A thread rank whose work ends (here with an error, before a collective the others are in)
/// makes their waits for it fail at once, naming it, rather than after the timeout (an hour
/// here: were the notice missing, the test would hang); `all_ok` reports the rank's own error
/// over the others' "it left".
#[test]
fn a_rank_that_fails_releases_the_others_at_once() {
    let res = run_ranks(3, Duration::from_secs(3600), |r, c| -> Result<(), CommError> {
        let x = t(&[1.0], DType::F32);
        c.all_reduce(&x, ReduceOp::Sum)?;
        if r == 2 {
            return Err(CommError::Env("rank 2's own failure".into()));
        }
        c.all_reduce(&x, ReduceOp::Sum)
    });
    for r in [0, 1] {
        let e = res[r].as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(e, CommError::Link { op: "all_reduce", peer: 2, .. }), "rank {r}: {e}");
        assert!(e.to_string().contains(ferrotron_comm::PEER_LEFT), "rank {r}: {e}");
    }
    let e = all_ok(res).unwrap_err();
    assert!(e.starts_with("rank 2:") && e.contains("own failure"), "{e}");
}
