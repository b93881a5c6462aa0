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
        encode(addr, &dims, &strides, &[64, 1, rows as u32, 1])
            .map_err(|e| cuda_err(&format!("TMA map of [{b}, {t}, {heads}, {d}] bf16 rows, {rows}-row boxes"), e))
    }

    /// A row-major bf16 matrix [rows, cols] at `addr` (`cols` contiguous), boxes of 64 columns by
    /// `box_rows` rows (the GEMM's A and B tiles, kernels/gemm.cu). `addr` 16-byte aligned and
    /// `cols` a multiple of 8 (the driver's rules for the row stride).
    pub(crate) fn matrix(addr: u64, rows: usize, cols: usize, box_rows: usize) -> Result<Self> {
        if rows == 0 || cols == 0 {
            return Ok(Self::unused());
        }
        encode(addr, &[cols as u64, rows as u64], &[(cols * 2) as u64], &[64, box_rows as u32])
            .map_err(|e| cuda_err(&format!("TMA map of a [{rows}, {cols}] bf16 matrix, {box_rows}-row boxes"), e))
    }
}

/// cuTensorMapEncodeTiled for bf16 with the 128-byte swizzle: `dims` innermost first, `strides`
/// the bytes between neighbours along dims 1.., `boxes` the box's extent along each.
fn encode(
    addr: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
) -> std::result::Result<TmaMap, cudarc::driver::DriverError> {
    debug_assert!(dims.len() == boxes.len() && strides.len() + 1 == dims.len());
    let unit = [1u32; 5];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array holds the rank's (or rank − 1's) entries; the driver only encodes (it
    // reads no device memory here).
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            dims.len() as u32,
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
    .map(|()| TmaMap(map))
}
