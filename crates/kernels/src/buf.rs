//! Output buffers for CPU kernels that write every element: no zeroing pass first. Zeroed
//! outputs (`vec![0.0; n]`, mimalloc clearing a reused block) were ≈ 5% of the CPU training step,
//! spread over a dozen ops (benches/NOTES.md).

use crate::real::Real;

/// `n` elements of unspecified value. Debug builds (the tests) fill them with NaN, so an element
/// a kernel leaves unwritten shows in every test that checks its values.
///
/// # Safety
/// Each element must be written before it is read.
pub(crate) unsafe fn uninit<T: Real>(n: usize) -> Vec<T> {
    if cfg!(debug_assertions) {
        return vec![T::c(f64::NAN); n];
    }
    let mut v = Vec::with_capacity(n);
    // SAFETY: the capacity is n; f32 and f64 have no invalid bit patterns, and the caller writes
    // each element before reading it.
    #[allow(clippy::uninit_vec)]
    unsafe {
        v.set_len(n)
    };
    v
}
