//! Row-major GEMM on the `gemm` crate.
//!
//! Shapes: C[m,n] (+)= alpha · op(A)[m,k] · op(B)[k,n], where A is stored [m,k] (or [k,m] when `ta`)
//! and B is stored [k,n] (or [n,k] when `tb`). Backward of C = op(A)op(B):
//!   dA = dC · op(B)ᵀ (stored transposed when `ta`), dB = op(A)ᵀ · dC (stored transposed when `tb`).

use crate::real::Real;
use gemm::Parallelism;

/// Work (m·n·k) above which one GEMM uses all threads; below it batched callers parallelise instead.
const PAR_WORK: usize = 1 << 18;

/// A row-major matrix operand: data with explicit row and column strides.
#[derive(Clone, Copy)]
pub struct MatRef<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// `rows × cols` logical matrix stored row-major with leading dimension `ld`, optionally transposed
    /// (then stored as `cols × rows`).
    pub fn new(data: &'a [T], ld: usize, transposed: bool) -> Self {
        if transposed { MatRef { data, rs: 1, cs: ld } } else { MatRef { data, rs: ld, cs: 1 } }
    }
}

/// C[m,n] = alpha·A·B + (accumulate ? C : 0), C with row stride `ldc`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
    alpha: T,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                c[i * ldc..i * ldc + n].iter_mut().for_each(|x| *x = T::zero());
            }
        }
        return;
    }
    let span = |r: MatRef<'_, T>, rows: usize, cols: usize| (rows - 1) * r.rs + (cols - 1) * r.cs;
    assert!(span(a, m, k) < a.data.len(), "gemm: A too short");
    assert!(span(b, k, n) < b.data.len(), "gemm: B too short");
    assert!((m - 1) * ldc + n <= c.len(), "gemm: C too short");
    let par = if parallel && m * n * k >= PAR_WORK { Parallelism::Rayon(0) } else { Parallelism::None };
    // SAFETY: the asserts above bound every index the kernel touches; C does not alias A or B since
    // it is a distinct &mut borrow.
    unsafe { gemm_raw(m, n, k, a, b, c.as_mut_ptr(), ldc, accumulate, alpha, par) }
}

/// The `gemm` crate call behind every CPU GEMM: C[m,n] = alpha·A·B (+ C when `accumulate`), C at
/// `c` with row stride `ldc`. Threaded (`Parallelism::Rayon`) with A stored transposed (the weight
/// gradient dYᵀ·X: m output features, k tokens): C's rows in blocks, one per thread, each a
/// serial product: on 2 cores equal to the gemm crate's own threading or up to 16% faster at the
/// tiny preset's shapes when the machine is idle, 1.2–1.6× while another process loads it
/// (benches/NOTES.md); each element is still summed by one thread over all of k (the trainer's
/// losses are the same bits). Otherwise the crate's threading.
///
/// # Safety
/// A and B hold every element their strides reach for m×k and k×n; `c` is valid for writes of
/// every element of m rows of stride `ldc` (and initialised where `accumulate` reads it), and
/// aliases neither.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    c: *mut T,
    ldc: usize,
    accumulate: bool,
    alpha: T,
    par: Parallelism,
) {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads();
    if matches!(par, Parallelism::Rayon(_)) && a.rs == 1 && a.cs > 1 && threads > 1 && m >= 32 * threads {
        let rows = m.div_ceil(threads).next_multiple_of(16);
        let out = OutPtr(c);
        (0..m.div_ceil(rows)).into_par_iter().for_each(|i| {
            let (r0, o) = (i * rows, out);
            let a = MatRef { data: &a.data[r0..], rs: 1, cs: a.cs };
            // SAFETY: block i reads A's columns and writes C's rows [r0, r0 + rows) only, within
            // the caller's contract.
            unsafe {
                gemm_raw(rows.min(m - r0), n, k, a, b, o.0.add(r0 * ldc), ldc, accumulate, alpha, Parallelism::None)
            }
        });
        return;
    }
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c,
            1,
            ldc as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::one(),
            alpha,
            false,
            false,
            false,
            par,
        );
    }
}

/// Dense C[m,n] (+)= alpha·op(A)·op(B) with A, B packed (leading dimension = stored row length).
#[allow(clippy::too_many_arguments)]
pub fn gemm<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    ta: bool,
    b: &[T],
    tb: bool,
    c: &mut [T],
    accumulate: bool,
    alpha: T,
) {
    let a = MatRef::new(a, if ta { m } else { k }, ta);
    let b = MatRef::new(b, if tb { k } else { n }, tb);
    gemm_strided(m, n, k, a, b, c, n, accumulate, alpha, true);
}

/// `batch` independent GEMMs over consecutive packed matrices; parallel across the batch when each
/// is small.
#[allow(clippy::too_many_arguments)]
pub fn gemm_batched<T: Real>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    ta: bool,
    b: &[T],
    tb: bool,
    c: &mut [T],
    accumulate: bool,
    alpha: T,
) {
    assert!(c.len() >= batch * m * n, "gemm: output too short");
    // SAFETY: `c` holds the batch's m·n outputs, initialised (read when accumulating).
    unsafe { batched_into(batch, m, n, k, a, ta, b, tb, OutPtr(c.as_mut_ptr()), accumulate, alpha) }
}

/// A raw output pointer that may cross to the pool's threads (each writes its own matrices).
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);
// SAFETY: the batch's tasks write disjoint ranges of one allocation that outlives them.
unsafe impl<T> Send for OutPtr<T> {}
unsafe impl<T> Sync for OutPtr<T> {}

/// `gemm_batched` into a new buffer, C = alpha·op(A)·op(B): the output is written straight into
/// fresh memory (the gemm crate does not read C when not accumulating), so it is never zeroed
/// first — a zeroing pass was ~3% of a small model's CPU step.
#[allow(clippy::too_many_arguments)]
pub fn gemm_batched_new<T: Real>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    ta: bool,
    b: &[T],
    tb: bool,
    alpha: T,
) -> Vec<T> {
    let len = batch * m * n;
    if k == 0 || len == 0 {
        return vec![T::zero(); len];
    }
    let mut c: Vec<T> = Vec::with_capacity(len);
    // SAFETY: the capacity holds the batch's outputs; not accumulating, every element is written
    // without being read.
    unsafe {
        batched_into(batch, m, n, k, a, ta, b, tb, OutPtr(c.as_mut_ptr()), false, alpha);
        c.set_len(len);
    }
    c
}

/// The batch loop of `gemm_batched(_new)`: matrix i of A, B and `out` at i·m·k, i·k·n, i·m·n;
/// in parallel across the batch when each product is small, one parallel product at a time
/// otherwise.
///
/// # Safety
/// `out` is valid for batch·m·n elements: written by every product, and also read (so it must be
/// initialised) when `accumulate`.
#[allow(clippy::too_many_arguments)]
unsafe fn batched_into<T: Real>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    ta: bool,
    b: &[T],
    tb: bool,
    out: OutPtr<T>,
    accumulate: bool,
    alpha: T,
) {
    use rayon::prelude::*;
    let (sa, sb, sc) = (m * k, k * n, m * n);
    if sc == 0 {
        return;
    }
    if k == 0 {
        // An empty sum: C = 0 (or unchanged when accumulating), as gemm_strided.
        if !accumulate {
            for i in 0..batch * sc {
                // SAFETY: within the batch·m·n elements of the caller's contract.
                unsafe { out.0.add(i).write(T::zero()) };
            }
        }
        return;
    }
    assert!(a.len() >= batch * sa && b.len() >= batch * sb, "gemm: operands too short");
    let big = m * n * k >= PAR_WORK;
    let run = |i: usize| {
        let am = MatRef::new(&a[i * sa..(i + 1) * sa], if ta { m } else { k }, ta);
        let bm = MatRef::new(&b[i * sb..(i + 1) * sb], if tb { k } else { n }, tb);
        let par = if big { Parallelism::Rayon(0) } else { Parallelism::None };
        let o = out;
        // SAFETY: matrix i owns elements [i·sc, (i+1)·sc) of `out` (the caller's contract); A and
        // B are in bounds (checked above, packed with the strides MatRef::new gives).
        unsafe { gemm_raw(m, n, k, am, bm, o.0.add(i * sc), n, accumulate, alpha, par) }
    };
    if big {
        (0..batch).for_each(run);
    } else {
        (0..batch).into_par_iter().for_each(run);
    }
}

/// Gradients of C = op(A)·op(B) for one (possibly batched) product: dA and dB are written (`=`), or
/// added to when `accumulate` (the `+=` into main_grad rule).
#[allow(clippy::too_many_arguments)]
pub fn gemm_bwd<T: Real>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    ta: bool,
    b: &[T],
    tb: bool,
    dc: &[T],
    da: Option<&mut [T]>,
    db: Option<&mut [T]>,
    accumulate: bool,
) {
    if let Some(da) = da {
        if !ta {
            // dA[m,k] = dC[m,n] · op(B)ᵀ
            gemm_batched(batch, m, k, n, dc, false, b, !tb, da, accumulate, T::one());
        } else {
            // dA stored [k,m] = op(B)[k,n] · dCᵀ
            gemm_batched(batch, k, m, n, b, tb, dc, true, da, accumulate, T::one());
        }
    }
    if let Some(db) = db {
        if !tb {
            // dB[k,n] = op(A)ᵀ[k,m] · dC[m,n]
            gemm_batched(batch, k, n, m, a, !ta, dc, false, db, accumulate, T::one());
        } else {
            // dB stored [n,k] = dCᵀ[n,m] · op(A)[m,k]
            gemm_batched(batch, n, k, m, dc, true, a, ta, db, accumulate, T::one());
        }
    }
}
