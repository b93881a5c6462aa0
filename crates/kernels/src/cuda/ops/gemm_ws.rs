//! Our own bf16 GEMM kernels (kernels/gemm.cu: wgmma, TMA, warp-specialised) for the MLP's
//! products with a GeLU epilogue, which cuBLASLt runs up to 1.33× slower than without one, and
//! for the plain bf16 products. Off by default (`FERROTRON_OWN_GEMM=1` for the fused products,
//! still behind cuBLASLt's; `FERROTRON_OWN_GEMM_PLAIN=1` for the plain ones): the callers in
//! gemm.rs try these first when on and fall back to cuBLASLt where `fits` says no.

use super::*;
use crate::cuda::OwnGemmBuild as Build;
use crate::cuda::tma::TmaMap;

/// kernels/gemm.cu's tiles: a warpgroup's GM_BM × GM_BN outputs, GM_BK deep.
const BM: usize = 128;
const BN: usize = 128;
const BK: usize = 64;

impl Build {
    /// A block's tile: rows (kernels/gemm.cu `BM`) and columns (`BN`).
    fn tile(self) -> (usize, usize) {
        match self {
            Build::M256 => (2 * BM, BN),
            Build::N256 | Build::N256Clusters2 => (BM, 2 * BN),
            Build::PingPong | Build::Clusters2 => (BM, BN),
        }
    }
    /// Rows of a staging buffer: the TMA box of the outputs (kernels/gemm.cu `RB`).
    fn staged_rows(self) -> usize {
        if matches!(self, Build::N256 | Build::N256Clusters2) { BM / 2 } else { BM }
    }
    fn cooperative(self) -> bool {
        matches!(self, Build::M256 | Build::N256 | Build::N256Clusters2)
    }
    /// Blocks a cluster.
    fn cluster(self) -> usize {
        if matches!(self, Build::Clusters2 | Build::N256Clusters2) { 2 } else { 1 }
    }
    /// The stages (A and B tiles: kernels/gemm.cu `S`), 64 KiB of staging buffers and 2 · S + 2
    /// mbarriers.
    fn smem(self) -> usize {
        let stages = if self.cooperative() { 3 } else { 5 };
        let (rows, cols) = self.tile();
        stages * (rows + cols) * BK * 2 + 64 * 1024 + (2 * stages + 2) * 8
    }
    fn suffix(self) -> &'static str {
        match self {
            Build::PingPong => "",
            Build::Clusters2 => "_c2",
            Build::M256 => "_m256",
            Build::N256 => "_n256",
            Build::N256Clusters2 => "_n256c2",
        }
    }
}

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

/// Whether this thread's build takes this product (the callers check their switches): an sm_90
/// device whose wgmma kernels this thread allows, every dimension at least one tile (so no TMA
/// box is larger than its matrix), n and k multiples of 8 and every address 16-byte aligned
/// (TMA's rules for rows; the epilogue's paired columns).
pub fn fits(be: &B, (m, n, k): (usize, usize, usize), ptrs: &[u64]) -> bool {
    let build = crate::cuda::own_gemm_build();
    let (rows, cols) = build.tile();
    be.use_wgmma()
        && m >= rows
        && n >= cols
        && k >= BK
        && n % 8 == 0
        && k % 8 == 0
        && be.smem_optin >= build.smem()
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
    let build = crate::cuda::own_gemm_build();
    let (cl, (rows, cols), smem) = (build.cluster(), build.tile(), build.smem() as u32);
    // B's boxes: 64 columns by the tile's columns K-major (by half that when a cluster shares
    // it), 64 × 64 MN-major.
    let (name, bmap) = match (epi, b_kmajor) {
        (Epi::Gelu, true) => ("gemm_gelu_tn", TmaMap::matrix(b, n, k, cols / cl)?),
        (Epi::DGelu, false) => ("gemm_dgelu_nn", TmaMap::matrix(b, k, n, 64)?),
        (Epi::Plain, true) => ("gemm_plain_tn", TmaMap::matrix(b, n, k, cols / cl)?),
        (Epi::Plain, false) => ("gemm_plain_nn", TmaMap::matrix(b, k, n, 64)?),
        (e, t) => return Err(ferrotron_core::invalid("gemm_ws", format!("no kernel for {e:?} with B K-major {t}"))),
    };
    let name = format!("{name}{}_bf16", build.suffix());
    let amap = TmaMap::matrix(a, m, k, rows)?;
    let omap = TmaMap::matrix(out, m, n, build.staged_rows())?;
    let xmap = if aux == 0 { TmaMap::unused() } else { TmaMap::matrix(aux, m, n, build.staged_rows())? };
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
    let units = m.div_ceil(rows).div_ceil(cl) * n.div_ceil(cols);
    if cl == 1 {
        let grid = units.min(be.sms as usize) as u32;
        return be.launch(&name, grid, 384, smem, &args);
    }
    let resident = be.launch_cluster(&name, (0, 384, smem, cl as u32), &[])? as usize;
    let grid = (units.min(resident) * cl) as u32;
    be.launch_cluster(&name, (grid, 384, smem, cl as u32), &args).map(drop)
}
