//! TMA tensor maps: what a kernel's copying thread hands to `cp.async.bulk.tensor` so that one
//! instruction moves a whole tile into shared memory, in the 128-byte swizzle wgmma reads
//! (kernels/wgmma.cuh), rows past the tensor's end zero-filled. The warp-specialised flash
//! forward takes its K and V tiles this way; a map is encoded on the host per launch (a few
//! hundred nanoseconds) and passed by value as a `__grid_constant__` parameter.

use super::cuda_err;
use cudarc::driver::sys;
use ferrotron_core::Result;

/// A `CUtensorMap` (128 bytes, 64-byte aligned) as a kernel argument.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct TmaMap(sys::CUtensorMap);

// SAFETY: plain bytes the driver encoded, passed to kernels that declare the same 128-byte,
// 64-byte-aligned parameter (`TmaMap` in kernels/wgmma.cuh).
unsafe impl cudarc::driver::DeviceRepr for TmaMap {}

impl TmaMap {
    /// A map no copy reads (the kernels built without TMA take the parameter all the same).
    pub(crate) fn unused() -> Self {
        TmaMap(sys::CUtensorMap { opaque: [0; 16] })
    }

    /// bf16 rows `[b, t, heads, d]` at `addr` (a head's `d` elements contiguous, `heads · d`
    /// between rows: the attention kernels' `Place`), boxes of 64 columns of one head by `rows`
    /// rows (a head dim 128 tile takes two copies). `addr` and the row stride must be 16-byte
    /// aligned, `d` a multiple of 64.
    pub(crate) fn rows(addr: u64, b: usize, t: usize, heads: usize, d: usize, rows: usize) -> Result<Self> {
        if b == 0 || t == 0 || heads == 0 {
            return Ok(Self::unused()); // an empty tensor: no tile is ever copied from it
        }
        let dims = [d as u64, heads as u64, t as u64, b as u64];
        // Bytes between neighbours along dims 1.. (dim 0 is contiguous).
        let strides = [(d * 2) as u64, (heads * d * 2) as u64, (t * heads * d * 2) as u64];
        let boxes = [64u32, 1, rows as u32, 1];
        let unit = [1u32; 4];
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        // SAFETY: every array holds the rank's (4) or rank − 1's entries; the driver only
        // encodes (it reads no device memory here).
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                4,
                addr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                unit.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .map_err(|e| cuda_err(&format!("TMA map of [{b}, {t}, {heads}, {d}] bf16 rows, {rows}-row boxes"), e))?;
        Ok(TmaMap(map))
    }
}
