//! Our own bf16 GEMM kernels (kernels/gemm.cu: wgmma, TMA, two warpgroups taking turns) for the
//! MLP's products with a GeLU epilogue, which cuBLASLt runs up to 1.33× slower than without one.
//! Off by default (`FERROTRON_OWN_GEMM=1`; their main loop is still 0.88–0.90× cuBLASLt's): the
//! callers in gemm.rs try these first when on and fall back to cuBLASLt where `fits` says no.

use super::*;
use crate::cuda::tma::TmaMap;

/// kernels/gemm.cu's tile and stages: GM_BM × GM_BN outputs, GM_BK deep, GM_S stages.
const BM: usize = 128;
const BN: usize = 128;
const BK: usize = 64;
const STAGES: usize = 5;
/// The stages (A and B tiles), four staging buffers of BM × 64 outputs and 2 · STAGES + 2 mbarriers.
const SMEM: usize = STAGES * (BM + BN) * BK * 2 + 4 * BM * 64 * 2 + (2 * STAGES + 2) * 8;

/// Which epilogue (kernels/gemm.cu `EPI_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epi {
    /// out = gelu(h), aux = h = A·Bᵀ + bias.
    Gelu,
    /// out = (A·B) ∘ gelu'(aux).
    DGelu,
    /// out = A·op(B) (+ bias).
    Plain,
}

/// Whether the kernels take this product: an sm_90 device whose wgmma kernels this thread allows,
/// the switch on (`cuda::set_own_gemm`), every dimension at least one tile (so no TMA box is
/// larger than its matrix), n and k multiples of 8 and every address 16-byte aligned (TMA's rules
/// for rows; the epilogue's paired columns).
pub fn fits(be: &B, (m, n, k): (usize, usize, usize), ptrs: &[u64]) -> bool {
    be.use_wgmma()
        && crate::cuda::own_gemm()
        && m >= BM
        && n >= BN
        && k >= BK
        && n % 8 == 0
        && k % 8 == 0
        && be.smem_optin >= SMEM
        && ptrs.iter().all(|p| p % 16 == 0)
}

/// out [m, n] = epilogue(a [m, k] · op(b)), with `b` [n, k] (`b_kmajor`: A·Bᵀ) or [k, n] (A·B);
/// `aux` the GeLU's h (written by `Gelu`, read by `DGelu`), `bias` [n] or 0. Addresses of
/// contiguous bf16 tensors the caller sized and checked with `fits`.
#[allow(clippy::too_many_arguments)]
pub fn launch(
    be: &B,
    epi: Epi,
    (a, b, out, aux, bias): (u64, u64, u64, u64, u64),
    b_kmajor: bool,
    (m, n, k): (usize, usize, usize),
) -> Result<()> {
    // Clusters of two blocks sharing B (the `_c2` kernels) unless turned off.
    let cl: u32 = if crate::cuda::own_gemm_clusters() { 2 } else { 1 };
    let sfx = if cl == 2 { "_c2" } else { "" };
    // B's boxes: 64 columns by BN rows K-major (by half that when a cluster shares it), 64 × 64 MN-major.
    let (name, bmap) = match (epi, b_kmajor) {
        (Epi::Gelu, true) => ("gemm_gelu_tn", TmaMap::matrix(b, n, k, BN / cl as usize)?),
        (Epi::DGelu, false) => ("gemm_dgelu_nn", TmaMap::matrix(b, k, n, 64)?),
        (Epi::Plain, true) => ("gemm_plain_tn", TmaMap::matrix(b, n, k, BN / cl as usize)?),
        (Epi::Plain, false) => ("gemm_plain_nn", TmaMap::matrix(b, k, n, 64)?),
        (e, t) => return Err(ferrotron_core::invalid("gemm_ws", format!("no kernel for {e:?} with B K-major {t}"))),
    };
    let name = format!("{name}{sfx}_bf16");
    let amap = TmaMap::matrix(a, m, k, BM)?;
    let omap = TmaMap::matrix(out, m, n, BM)?;
    let xmap = if aux == 0 { TmaMap::unused() } else { TmaMap::matrix(aux, m, n, BM)? };
    let args = [
        Arg::Map(amap),
        Arg::Map(bmap),
        Arg::Map(omap),
        Arg::Map(xmap),
        Arg::Ptr(bias),
        Arg::I64(m as i64),
        Arg::I64(n as i64),
        Arg::I64(k as i64),
    ];
    // Persistent: as many blocks (clusters) as can be resident, no more than there are tiles
    // (pairs of m-tiles with clusters).
    let units = m.div_ceil(BM).div_ceil(cl as usize) * n.div_ceil(BN);
    if cl == 1 {
        let grid = units.min(be.sms as usize) as u32;
        return be.launch(&name, grid, 384, SMEM as u32, &args);
    }
    let resident = be.launch_cluster(&name, (0, 384, SMEM as u32, cl), &[])? as usize;
    let grid = units.min(resident) as u32 * cl;
    be.launch_cluster(&name, (grid, 384, SMEM as u32, cl), &args).map(drop)
}
