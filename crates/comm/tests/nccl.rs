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
