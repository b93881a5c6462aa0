//! Captured scratch memsets taken off the graph's chain (graph_hoist.rs) keep the order the lanes
//! need (feature `cuda`; runs on the GPU machine). A binary of its own: a capture records all
//! work queued on the device's stream.
#![cfg(feature = "cuda")]

use cudarc::driver::{CudaSlice, DevicePtr, sys};
use ferrotron_core::cuda::{CudaDevice, set_graph_hoist};
use ferrotron_core::graph_hoist::Hoisted;

/// 64 MiB a buffer: copies long enough (≈ 40 µs) that a memset moved before the copy that reads
/// its lane's previous value would overwrite that value first.
const N: usize = 64 << 20;

/// Three pieces of work, each a memset of its lane's scratch and a copy out of it, on lanes 0, 1,
/// 0: the second memset of lane 0 may run once the first piece's copy is done, not before. With
/// the memsets moved (two of three: the first has nothing before it) every replay still copies
/// out 1, 2 and 3; without, nothing moves and the same values come out.
#[test]
fn scratch_memsets_move_off_the_chain_and_keep_their_order() {
    let dev = CudaDevice::new(0).expect("a CUDA device");
    let s = dev.stream().clone();
    let alloc = || s.alloc_zeros::<u8>(N).unwrap();
    let (r0, r1) = (alloc(), alloc());
    let outs = [alloc(), alloc(), alloc()];
    let p = |b: &CudaSlice<u8>| b.device_ptr(&s).0;
    dev.register_scratch(p(&r0), N, 900);
    dev.register_scratch(p(&r1), N, 901);
    // SAFETY: whole buffers allocated above, on their own stream.
    let memset = |dst: u64, v: u8| unsafe { sys::cuMemsetD8Async(dst, v, N, s.cu_stream()) }.result().unwrap();
    let copy = |dst: u64, src: u64| unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, N, s.cu_stream()) }.result().unwrap();
    for hoist in [false, true] {
        set_graph_hoist(hoist);
        let (g, ()) = dev
            .capture(|| -> ferrotron_core::Result<()> {
                for (i, (lane, r)) in [(900, &r0), (901, &r1), (900, &r0)].into_iter().enumerate() {
                    dev.in_lane(lane, || -> ferrotron_core::Result<()> {
                        memset(p(r), i as u8 + 1);
                        copy(p(&outs[i]), p(r));
                        Ok(())
                    })?;
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(g.hoisted(), hoist.then_some(Hoisted { moved: 2, memsets: 3 }), "hoist {hoist}");
        for replay in 0..4 {
            for o in &outs {
                memset(p(o), 0);
            }
            g.launch().unwrap();
            for (i, o) in outs.iter().enumerate() {
                let got = s.clone_dtoh(o).unwrap();
                let wrong = got.iter().filter(|&&v| v != i as u8 + 1).count();
                assert_eq!(wrong, 0, "hoist {hoist}, replay {replay}: output {i} has {wrong} bytes not {}", i + 1);
            }
        }
        g.release().unwrap();
    }
}
