//! NCCL at world size 1 on the first GPU (feature `cuda`; run on the GPU machine).
#![cfg(feature = "cuda")]

use ferrotron_comm::{Communicator, DistEnv, NcclComm, ReduceOp};
use ferrotron_core::{DType, Device, Tensor};
use std::time::Duration;

#[test]
fn world_of_one_reduces_to_itself() {
    let Device::Cuda(dev) = Device::cuda(0).expect("a CUDA device") else { unreachable!() };
    let comm = NcclComm::new(&dev, &DistEnv::single(), Duration::from_secs(30)).expect("NCCL init");
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    let vals: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    for dt in [DType::F32, DType::BF16] {
        let t = Tensor::from_f32(&vals, [1000], dt, &Device::Cuda(dev.clone())).unwrap();
        let before = t.to_vec_f32().unwrap();
        comm.all_reduce(&t, ReduceOp::Sum).unwrap();
        comm.all_reduce(&t.view(10, [20]).unwrap(), ReduceOp::Max).unwrap();
        comm.broadcast(&t, 0).unwrap();
        assert_eq!(t.to_vec_f32().unwrap(), before, "{dt}");
    }
}

#[test]
fn world_of_one_runs_every_collective_and_splits() {
    let Device::Cuda(dev) = Device::cuda(0).expect("a CUDA device") else { unreachable!() };
    let comm = NcclComm::new(&dev, &DistEnv::single(), Duration::from_secs(30)).expect("NCCL init");
    let d = Device::Cuda(dev.clone());
    let vals: Vec<f32> = (0..12).map(|i| i as f32 - 3.5).collect();
    let x = Tensor::from_f32(&vals, [6, 2], DType::F32, &d).unwrap();
    let out = Tensor::zeros([6, 2], DType::F32, &d).unwrap();
    comm.reduce_scatter(&x, &out, ReduceOp::Sum).unwrap();
    assert_eq!(out.to_vec_f32().unwrap(), vals);
    let out = Tensor::zeros([6, 2], DType::F32, &d).unwrap();
    comm.all_gather(&x, &out).unwrap();
    assert_eq!(out.to_vec_f32().unwrap(), vals);
    // On the communicator's stream, the compute stream waiting only at wait_async (then the read).
    let out = Tensor::zeros([6, 2], DType::F32, &d).unwrap();
    comm.all_gather_async(&x, &out).unwrap();
    comm.wait_async().unwrap();
    assert_eq!(out.to_vec_f32().unwrap(), vals);
    assert_eq!(comm.all_gather_v(&x, &[6]).unwrap().to_vec_f32().unwrap(), vals);
    assert_eq!(comm.all_to_all_v(&x, &[6], &[6]).unwrap().to_vec_f32().unwrap(), vals);
    comm.barrier().unwrap();
    let sub = comm.split("tp", &[vec![0]]).unwrap().expect("rank 0 is in the group");
    assert_eq!((sub.rank(), sub.size(), sub.name()), (0, 1, "tp[0]"));
    sub.all_reduce(&x, ReduceOp::Avg).unwrap();
    assert_eq!(x.to_vec_f32().unwrap(), vals);
    // Each communicator has its own stream: a gather left running on the world's while the
    // split group reduces (ordered, the compute stream waiting for that one only), then a
    // grouped send/recv to itself on the split group, then the world's wait.
    let big: Vec<f32> = (0..1 << 20).map(|i| (i % 977) as f32).collect();
    let bx = Tensor::from_f32(&big, [1 << 20], DType::F32, &d).unwrap();
    let bout = Tensor::zeros([1 << 20], DType::F32, &d).unwrap();
    comm.all_gather_async(&bx, &bout).unwrap();
    let y = Tensor::from_f32(&vals, [6, 2], DType::F32, &d).unwrap();
    sub.all_reduce(&y, ReduceOp::Sum).unwrap();
    let back = Tensor::zeros([6, 2], DType::F32, &d).unwrap();
    ferrotron_comm::exchange(&[
        ferrotron_comm::P2p::Send { comm: sub.as_ref(), t: &y, dst: 0 },
        ferrotron_comm::P2p::Recv { comm: sub.as_ref(), t: &back, src: 0 },
    ])
    .unwrap();
    assert_eq!(back.to_vec_f32().unwrap(), vals);
    comm.wait_async().unwrap();
    assert_eq!(bout.to_vec_f32().unwrap(), big);
}
