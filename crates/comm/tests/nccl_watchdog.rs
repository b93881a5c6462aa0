//! The NCCL watchdog on one GPU (feature `cuda`; run on the GPU machine): a receive nobody sends
//! to never finishes; after the timeout the communicator is aborted and the next call fails
//! naming the operation and group instead of hanging. Its own binary: the aborted communicator
//! must not share a process with other tests.
#![cfg(feature = "cuda")]

use ferrotron_comm::{CommError, Communicator, DistEnv, NcclComm, ReduceOp};
use ferrotron_core::{DType, Device, Tensor};
use std::time::{Duration, Instant};

#[test]
fn an_unmatched_receive_times_out_with_a_named_error() {
    let Device::Cuda(dev) = Device::cuda(0).expect("a CUDA device") else { unreachable!() };
    let comm = NcclComm::new(&dev, &DistEnv::single(), Duration::from_secs(2)).expect("NCCL init");
    let d = Device::Cuda(dev.clone());
    // Host tensors travel through the device.
    let host = Tensor::from_vec(vec![1.5f32, -2.0], [2], &Device::Cpu).unwrap();
    comm.all_reduce(&host, ReduceOp::Sum).unwrap();
    assert_eq!(host.to_vec_f32().unwrap(), vec![1.5, -2.0]);
    let t = Tensor::zeros([1 << 20], DType::F32, &d).unwrap();
    comm.recv(&t, 0).unwrap(); // enqueued; never matched
    let start = Instant::now();
    let err = loop {
        std::thread::sleep(Duration::from_millis(200));
        if let Err(e) = comm.all_reduce(&t, ReduceOp::Sum) {
            break e;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no timeout after 30 s");
    };
    assert!(matches!(err, CommError::Stuck { op: "recv", .. }), "{err}");
    assert!(err.to_string().contains("world[0]"), "{err}");
}
