//! CUDA backend (feature `cuda`). The sources in the top-level kernels/ folder are embedded, compiled
//! by NVRTC for the device's architecture on first use into a CUBIN (NVRTC runs ptxas itself, so
//! loading leaves the driver nothing to compile; PTX for the driver to compile is the fallback),
//! cached on disk keyed by source hash + arch (`$FERROTRON_CACHE_DIR`, else
//! `~/.cache/ferrotron/ptx`; `prebuild_kernels` fills it ahead, no GPU needed), and loaded once
//! per device. GEMMs go
//! through cuBLASLt (bf16: `lt`, algorithms cached per shape (timed by `tune` on request), GeLU epilogues) and cuBLAS (exact f32). Memory comes from cudarc's stream-ordered allocations (the driver's memory pool
//! caches them; no cudaMalloc per step).

mod choices;
mod lt;
pub(crate) mod ops;
mod tma;
mod tune;

pub use tune::{Tuned, gemm_tuning_report, set_gemm_tuning};

use cudarc::cublas::CudaBlas;
use cudarc::cublaslt::CudaBlasLT;
use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx};
use ferrotron_core::cuda::CudaDevice;
use ferrotron_core::{Device, Error, Result, Storage, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// All kernel sources, in one module: the common header first.
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../../kernels/common.cuh")),
    ("elementwise.cu", include_str!("../../../../kernels/elementwise.cu")),
    ("norm.cu", include_str!("../../../../kernels/norm.cu")),
    ("loss.cu", include_str!("../../../../kernels/loss.cu")),
    ("optim.cu", include_str!("../../../../kernels/optim.cu")),
    ("rope.cu", include_str!("../../../../kernels/rope.cu")),
    ("embedding.cu", include_str!("../../../../kernels/embedding.cu")),
    ("moe.cu", include_str!("../../../../kernels/moe.cu")),
    ("ssm.cu", include_str!("../../../../kernels/ssm.cu")),
    ("ssd_chunk.cu", include_str!("../../../../kernels/ssd_chunk.cu")),
    ("ssd_chunk_tc.cu", include_str!("../../../../kernels/ssd_chunk_tc.cu")),
    ("attention.cu", include_str!("../../../../kernels/attention.cu")),
    ("flash.cu", include_str!("../../../../kernels/flash.cu")),
    ("wgmma.cuh", include_str!("../../../../kernels/wgmma.cuh")),
    ("flash_mma.cu", include_str!("../../../../kernels/flash_mma.cu")),
    ("flash_bwd_mma.cu", include_str!("../../../../kernels/flash_bwd_mma.cu")),
    ("gemm.cu", include_str!("../../../../kernels/gemm.cu")),
    ("fp8.cu", include_str!("../../../../kernels/fp8.cu")),
];

pub fn source() -> String {
    SOURCES.iter().map(|(name, s)| format!("// ---- {name}\n{s}\n")).collect()
}

pub(crate) struct Backend {
    pub dev: CudaDevice,
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// bf16 GEMMs (fp32 accumulation): the handle, and our descriptors' workspace and algorithm
    /// cache (`lt`).
    pub blas_lt: CudaBlasLT,
    lt: lt::Lt,
    /// f32 GEMMs: cuBLAS in its default math mode is true fp32 (cuBLASLt's f32 path in cudarc is TF32).
    pub blas: CudaBlas,
    /// The kernels were compiled for sm_90a: the wgmma kernels (kernels/wgmma.cuh) may run.
    pub wgmma: bool,
    /// Streaming multiprocessors: the grid of the persistent kernels.
    pub sms: u32,
    /// The device converts to FP8 and cuBLASLt multiplies FP8 (sm_89 and later).
    pub fp8: bool,
    /// Shared memory one block may opt into (bytes): 227 KB on Hopper, 99 KB on sm_86/sm_89.
    pub smem_optin: usize,
    /// Two u32 counters, zero between launches: the dynamic tile walks of the persistent flash
    /// forward and backward take their tiles from the first, and each launch's last block clears
    /// both (kernels/flash_mma.cu and flash_bwd_mma.cu `DYN`). One per device suffices: every
    /// kernel runs on its one stream.
    pub tile_counter: ferrotron_core::cuda::CudaStorage,
    /// One u64 (two u32 words): the samples a replayed CUDA graph's step is ahead of the captured
    /// step. The dropout kernels captured in a graph take its address and add it to their keys'
    /// first sample (`crate::set_draw_shift`); eager ones do not read it.
    pub draw_shift: Mutex<ferrotron_core::cuda::CudaStorage>,
    /// Clusters of a kernel that can be resident at once, by kernel name (`launch_cluster`).
    clusters: Mutex<HashMap<String, u32>>,
    /// The embedding backward's f32 sums and row flags for a bf16 main_grad, zero between calls
    /// (kernels/embedding.cu `embedding_flush` clears what it used); the last is in use. Grown by
    /// a larger one, the smaller ones kept: a CUDA graph captured with one replays its addresses.
    pub emb_scratch: Mutex<Vec<EmbScratch>>,
}

/// `Backend::emb_scratch`: room for `floats` f32 sums and `rows` u32 flags.
pub(crate) struct EmbScratch {
    pub sums: ferrotron_core::cuda::CudaStorage,
    pub flags: ferrotron_core::cuda::CudaStorage,
    pub floats: usize,
    pub rows: usize,
}

static BACKENDS: Mutex<Vec<(usize, Arc<Backend>)>> = Mutex::new(Vec::new());

static POISON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Tests turn this on: every CUDA op output is filled with NaN before its kernel runs.
pub fn set_poisoning(on: bool) {
    POISON.store(on, std::sync::atomic::Ordering::Relaxed);
}

pub(crate) fn poisoning() -> bool {
    POISON.load(std::sync::atomic::Ordering::Relaxed)
}

thread_local! {
    static WGMMA: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
    static DETERMINISTIC: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static FP32_SPLIT_K_SUMS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static FLASH_WS: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static FLASH_PERSIST: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static FLASH_TMA: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static FLASH_DYN: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static FLASH_BWD_DYN: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static FLASH_GROUP_HEADS: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    static FLASH_FWD_CONSUMERS: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    static FLASH_BIAS_GRAD: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static FLASH_BIAS_GRAD_RUNS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static NORM_FUSED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static NORM_BWD: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
    static OWN_GEMM: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static OWN_GEMM_RUNS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static OWN_GEMM_PLAIN: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static OWN_GEMM_BUILD: std::cell::Cell<Option<OwnGemmBuild>> = const { std::cell::Cell::new(None) };
}

/// Whether this thread's wgmma flash kernels are the warp-specialised ones, forward and backward
/// (head dims 64 and 128; default on: `FERROTRON_FLASH_FWD=wg` or `FERROTRON_FLASH_BWD=wg` in the
/// environment turns one direction off, to the kernels whose warpgroups run in lockstep). Tests
/// set it to run both kinds.
pub fn set_flash_ws(on: bool) {
    FLASH_WS.with(|w| w.set(Some(on)));
}

/// One direction's choice: this thread's `set_flash_ws`, else whether its variable says `wg`.
fn flash_ws(var: &'static str, env: &'static std::sync::OnceLock<bool>) -> bool {
    FLASH_WS.with(|w| w.get()).unwrap_or_else(|| *env.get_or_init(|| std::env::var(var).as_deref() != Ok("wg")))
}

pub(crate) fn flash_fwd_ws() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    flash_ws("FERROTRON_FLASH_FWD", &ENV)
}

/// Whether the warp-specialised forward runs persistent (one block per SM walking the query
/// tiles; kernels/flash_mma.cu `PERSIST`): this thread's `set_flash_persist`, else
/// `FERROTRON_FLASH_PERSIST=1` or `=0`, else None (the head dim decides: `fwd_kernel`). Tests set
/// it to run both kinds.
pub fn set_flash_persist(on: bool) {
    FLASH_PERSIST.with(|w| w.set(Some(on)));
}

pub(crate) fn flash_persist() -> Option<bool> {
    static ENV: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    FLASH_PERSIST.with(|w| w.get()).or_else(|| {
        *ENV.get_or_init(|| match std::env::var("FERROTRON_FLASH_PERSIST").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        })
    })
}

/// Whether the warp-specialised forward (128-key tiles, TMA) runs persistent with the dynamic tile
/// walk (kernels/flash_mma.cu `DYN`: tiles from a global counter, heads in groups whose K/V share
/// L2), at either head dim: this thread's `set_flash_dyn`, else on unless `FERROTRON_FLASH_DYN=0`
/// (then head dim 64 takes the static persistent walk, 128 one block per tile).
pub fn set_flash_dyn(on: bool) {
    FLASH_DYN.with(|w| w.set(Some(on)));
}

pub(crate) fn flash_dyn() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    opt_out(&FLASH_DYN, "FERROTRON_FLASH_DYN", &ENV)
}

/// Whether the warp-specialised backward (TMA) may run persistent with the dynamic tile walk
/// (kernels/flash_bwd_mma.cu `DYN`; `bwd_plan` takes it up to 8k tokens): this thread's
/// `set_flash_bwd_dyn`, else on unless `FERROTRON_FLASH_BWD_DYN=0`; `FERROTRON_FLASH_PERSIST=0`
/// turns it off too.
pub fn set_flash_bwd_dyn(on: bool) {
    FLASH_BWD_DYN.with(|w| w.set(Some(on)));
}

pub(crate) fn flash_bwd_dyn() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    opt_out(&FLASH_BWD_DYN, "FERROTRON_FLASH_BWD_DYN", &ENV)
}

/// The dynamic walks' heads per group: this thread's `set_flash_group_heads` (tests: several
/// groups on small shapes), else as many heads as keep `FERROTRON_FLASH_GROUP_MB` (default 16)
/// MiB of what their tiles share (the forward: a query head's K and V; the backward: a K/V
/// head's Q and dO), `bytes_per_head` each, at least one.
pub fn set_flash_group_heads(heads: Option<usize>) {
    FLASH_GROUP_HEADS.with(|w| w.set(heads));
}

pub(crate) fn flash_group_heads(bytes_per_head: usize) -> usize {
    static MB: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    FLASH_GROUP_HEADS
        .with(|w| w.get())
        .unwrap_or_else(|| {
            let mb = *MB.get_or_init(|| {
                std::env::var("FERROTRON_FLASH_GROUP_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(16)
            });
            (mb << 20) / bytes_per_head.max(1)
        })
        .max(1)
}

/// Whether the warp-specialised forward copies its K and V tiles by TMA (one thread, tensor maps:
/// `tma`) where a TMA build of its kernel exists, or by 128 producer threads' cp.async: this
/// thread's `set_flash_tma`, else `FERROTRON_FLASH_TMA=0` turns it off. Tests set it to run both.
pub fn set_flash_tma(on: bool) {
    FLASH_TMA.with(|w| w.set(Some(on)));
}

pub(crate) fn flash_tma() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    opt_out(&FLASH_TMA, "FERROTRON_FLASH_TMA", &ENV)
}

/// The consumer warpgroups of the head dim 64 forward with the dynamic walk (kernels/flash_mma.cu
/// `NC`: 2, 128 query rows a tile, or 3, 192): this thread's `set_flash_fwd_consumers`, else
/// `FERROTRON_FLASH_FWD_CONSUMERS` (2 or 3), else None (the sequence length decides:
/// `fwd_kernel`). Tests set it to run both.
pub fn set_flash_fwd_consumers(n: Option<usize>) {
    FLASH_FWD_CONSUMERS.with(|w| w.set(n));
}

pub(crate) fn flash_fwd_consumers() -> Option<usize> {
    static ENV: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    FLASH_FWD_CONSUMERS
        .with(|w| w.get())
        .or_else(|| {
            *ENV.get_or_init(|| std::env::var("FERROTRON_FLASH_FWD_CONSUMERS").ok().and_then(|v| v.parse().ok()))
        })
        .map(|n| if n == 3 { 3 } else { 2 })
}

/// A switch on by default: this thread's setting in `cell`, else off only where `var` is `0` in
/// the environment (read once).
fn opt_out(
    cell: &'static std::thread::LocalKey<std::cell::Cell<Option<bool>>>,
    var: &'static str,
    env: &'static std::sync::OnceLock<bool>,
) -> bool {
    cell.with(|w| w.get()).unwrap_or_else(|| *env.get_or_init(|| std::env::var(var).as_deref() != Ok("0")))
}

/// A switch off by default: this thread's setting in `cell`, else on only where `var` is `1` in
/// the environment (read once).
fn opt_in(
    cell: &'static std::thread::LocalKey<std::cell::Cell<Option<bool>>>,
    var: &'static str,
    env: &'static std::sync::OnceLock<bool>,
) -> bool {
    cell.with(|w| w.get()).unwrap_or_else(|| *env.get_or_init(|| std::env::var(var).as_deref() == Ok("1")))
}

/// Whether the flash backward on the fused projection output writes the first pass of the QKV
/// bias gradient's column sums from its own dQ, dK and dV tiles (`attention_bwd_qkv_into`: no
/// read of dQKV for the bias): this thread's `set_flash_bias_grad`, else on unless
/// `FERROTRON_FLASH_BIAS_GRAD=0`. Tests set it to run both.
pub fn set_flash_bias_grad(on: bool) {
    FLASH_BIAS_GRAD.with(|w| w.set(Some(on)));
}

/// How many backwards on this thread summed the bias in their own kernels (tests check that the
/// path they compare was taken).
pub fn flash_bias_grad_runs() -> u64 {
    FLASH_BIAS_GRAD_RUNS.with(|c| c.get())
}

pub(crate) fn count_flash_bias_grad_run() {
    FLASH_BIAS_GRAD_RUNS.with(|c| c.set(c.get() + 1));
}

pub(crate) fn flash_bias_grad() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    opt_out(&FLASH_BIAS_GRAD, "FERROTRON_FLASH_BIAS_GRAD", &ENV)
}

/// Whether the norm backwards compute their parameter gradients' first pass in the same launch
/// where the width allows (kernels/norm.cu `norm_bwd_cols`): this thread's `set_norm_fused`, else
/// on unless `FERROTRON_NORM_FUSED=0`. Tests set it to run both.
pub fn set_norm_fused(on: bool) {
    NORM_FUSED.with(|w| w.set(Some(on)));
}

pub(crate) fn norm_fused() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    opt_out(&NORM_FUSED, "FERROTRON_NORM_FUSED", &ENV)
}

/// The fused norm backward's build (kernels/norm.cu `norm_bwd_cols`'s V): this thread's
/// `set_norm_bwd_build`, else `FERROTRON_NORM_BWD` = v6np (the default since session 47: a
/// LayerNorm's bias sums in shared memory, no L2 prefetch of the next row; 4–5% faster than v5
/// on the H200 at 124M), v6 (with the prefetch) or v5 (registers for the bias sums, the
/// prefetch). A lab switch for A/B runs; tests set it to run every build.
pub fn set_norm_bwd_build(build: &str) {
    NORM_BWD.with(|w| w.set(Some(norm_bwd_suffix(build))));
}

fn norm_bwd_suffix(build: &str) -> &'static str {
    match build {
        "v6" => "_v6",
        "v6np" => "_v6np",
        _ => "",
    }
}

/// The build's kernel-name suffix.
pub(crate) fn norm_bwd_build() -> &'static str {
    static ENV: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    NORM_BWD.with(|w| w.get()).unwrap_or_else(|| {
        ENV.get_or_init(|| norm_bwd_suffix(std::env::var("FERROTRON_NORM_BWD").as_deref().unwrap_or("v6np")))
    })
}

/// Whether the MLP's products with a GeLU epilogue run on our own GEMM kernels (kernels/gemm.cu)
/// where they fit, instead of cuBLASLt's epilogues: this thread's `set_own_gemm`, else off unless
/// `FERROTRON_OWN_GEMM=1` (off by default while they are slower than cuBLASLt: kernels/README.md).
/// Tests set it to run both.
pub fn set_own_gemm(on: bool) {
    OWN_GEMM.with(|w| w.set(Some(on)));
}

pub(crate) fn own_gemm() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    opt_in(&OWN_GEMM, "FERROTRON_OWN_GEMM", &ENV)
}

/// Whether the plain bf16 products (no epilogue but a bias: bf16 out, nothing accumulated) run on
/// our own GEMM kernels where they fit, instead of cuBLASLt: this thread's `set_own_gemm_plain`,
/// else off unless `FERROTRON_OWN_GEMM_PLAIN=1`. Tests set it to run both.
pub fn set_own_gemm_plain(on: bool) {
    OWN_GEMM_PLAIN.with(|w| w.set(Some(on)));
}

pub(crate) fn own_gemm_plain() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    opt_in(&OWN_GEMM_PLAIN, "FERROTRON_OWN_GEMM_PLAIN", &ENV)
}

/// Which build of our GEMM kernels runs (kernels/gemm.cu; kernels/README.md has each one's
/// figures).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnGemmBuild {
    /// Two consumer warpgroups taking 128 × 128 tiles in turn (ping-pong), single blocks.
    PingPong,
    /// The same in clusters of two blocks that copy B once for both (TMA multicast; `_c2`).
    Clusters2,
    /// Both consumers on one 256 × 128 tile (`_m256`), the epilogue sliced over the next tile's
    /// k-steps.
    M256,
    /// Both consumers on one 128 × 256 tile, one m64n256 wgmma a k16 each (`_n256`): the main
    /// loop level with cuBLASLt's at 124M.
    N256,
    /// `N256` in clusters of two blocks that copy B once for both (`_n256c2`).
    N256Clusters2,
}

impl OwnGemmBuild {
    /// Every build, in the order of `FERROTRON_OWN_GEMM_BUILD`'s words (lab_env.rs).
    pub const ALL: [OwnGemmBuild; 5] = [Self::PingPong, Self::Clusters2, Self::M256, Self::N256, Self::N256Clusters2];

    /// `FERROTRON_OWN_GEMM_BUILD`'s values: `pingpong`, `c2`, `m256`, `n256`, `n256c2`.
    pub fn parse(s: &str) -> Option<Self> {
        crate::lab_env::OWN_GEMM_BUILDS.iter().position(|w| *w == s).map(|i| Self::ALL[i])
    }
}

// One word per build: the lab switch check and the parser read the same list.
const _: () = assert!(crate::lab_env::OWN_GEMM_BUILDS.len() == OwnGemmBuild::ALL.len());

/// Which build of our GEMM kernels runs where they are on (`set_own_gemm`): this thread's
/// `set_own_gemm_build`, else `FERROTRON_OWN_GEMM_BUILD` (`pingpong`, `c2`, `m256`, `n256` or
/// `n256c2`), else ping-pong. Tests set it to run every build.
pub fn set_own_gemm_build(b: OwnGemmBuild) {
    OWN_GEMM_BUILD.with(|w| w.set(Some(b)));
}

pub(crate) fn own_gemm_build() -> OwnGemmBuild {
    static ENV: std::sync::OnceLock<OwnGemmBuild> = std::sync::OnceLock::new();
    OWN_GEMM_BUILD.with(|w| w.get()).unwrap_or_else(|| {
        *ENV.get_or_init(|| {
            std::env::var("FERROTRON_OWN_GEMM_BUILD")
                .ok()
                .and_then(|v| OwnGemmBuild::parse(&v))
                .unwrap_or(OwnGemmBuild::PingPong)
        })
    })
}

/// How many products on this thread ran on our own GEMM kernels (tests check that the path they
/// compare was taken).
pub fn own_gemm_runs() -> u64 {
    OWN_GEMM_RUNS.with(|c| c.get())
}

pub(crate) fn count_own_gemm_run() {
    OWN_GEMM_RUNS.with(|c| c.set(c.get() + 1));
}

pub(crate) fn flash_bwd_ws() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    flash_ws("FERROTRON_FLASH_BWD", &ENV)
}

/// Whether this thread's ops must give the same bits on every run (off by default, as Megatron's
/// `--deterministic-mode`): on, the flash backward computes dQ in its own kernel instead of adding
/// it from the dK/dV kernel by bulk reductions in scheduling order (two more matrix products per
/// tile), and the embedding's scatter-add sums each row in position order instead of by atomics.
pub fn set_deterministic(on: bool) {
    DETERMINISTIC.with(|d| d.set(on));
}

pub(crate) fn deterministic() -> bool {
    DETERMINISTIC.with(|d| d.get())
}

/// Whether this thread's cuBLASLt products must add split-K partial sums in fp32 (off by default;
/// Megatron's --disable-bf16-reduced-precision-matmul, PyTorch's
/// `allow_bf16_reduced_precision_reduction = False`): on, the heuristic is offered only
/// algorithms that reduce in the compute type or not at all. Off, its own first choice may add a
/// bf16 output's partial sums in bf16 (the tuned alternatives never do).
pub fn set_fp32_split_k_sums(on: bool) {
    FP32_SPLIT_K_SUMS.with(|d| d.set(on));
}

pub(crate) fn fp32_split_k_sums() -> bool {
    FP32_SPLIT_K_SUMS.with(|d| d.get())
}

/// Whether this thread's ops may use the Hopper wgmma kernels where the device has them (on by
/// default). Tests and benches turn it off to run the mma.sync kernels on an sm_90 GPU too.
pub fn set_wgmma(on: bool) {
    WGMMA.with(|w| w.set(on));
}

impl Backend {
    /// The device has the wgmma kernels and this thread allows them.
    pub(crate) fn use_wgmma(&self) -> bool {
        self.wgmma && WGMMA.with(|w| w.get())
    }

    /// The address of `draw_shift` for a dropout kernel being captured into a CUDA graph, else 0
    /// (null): eager kernels take their keys as given, whatever a graph last set the shift to.
    pub(crate) fn draw_shift_ptr(&self) -> u64 {
        if !self.dev.is_capturing() {
            return 0;
        }
        self.draw_shift.lock().unwrap_or_else(|e| e.into_inner()).raw_ptr(&self.dev)
    }

    /// Sets `draw_shift` to `samples`, queued on the stream like the kernels that read it.
    pub(crate) fn set_draw_shift(&self, samples: u64) -> Result<()> {
        let words = ferrotron_core::CpuStorage::U32(vec![samples as u32, (samples >> 32) as u32]);
        self.draw_shift.lock().unwrap_or_else(|e| e.into_inner()).write_range(&self.dev, 0, &words)
    }
}

/// Whether the kernels that wait for their predecessor (`waits_on_predecessor`) launch with
/// programmatic dependent launch (Hopper): `FERROTRON_PDL=1`. Off by default: built, not yet
/// measured.
fn pdl() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENV.get_or_init(|| std::env::var("FERROTRON_PDL").as_deref() == Ok("1"))
}

/// The kernels whose first statement is `pdl_wait()` (kernels/common.cuh): they may be launched
/// to start while the kernel before them drains, since they touch no memory before it has
/// finished. A kernel on this list without the wait would race its predecessor; the NVRTC test
/// checks every one of them in the compiled PTX.
pub(crate) fn waits_on_predecessor(name: &str) -> bool {
    let v8 = name.ends_with("_v8") || name.ends_with("_v8n1");
    matches!(name, "col_sum_f32" | "col_sums3_f32" | "col_sum_bf16" | "col_sums3_bf16")
        || name.starts_with("layernorm_bwd_cols_")
        || name.starts_with("rmsnorm_bwd_cols_")
        || (v8
            && ["layernorm_fwd_", "layernorm_bwd_", "rmsnorm_fwd_", "rmsnorm_bwd_", "bias_grad_", "norm_param_grad_"]
                .iter()
                .any(|p| name.starts_with(p)))
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

fn cache_dir() -> Option<std::path::PathBuf> {
    if let Some(d) = std::env::var_os("FERROTRON_CACHE_DIR") {
        return Some(std::path::PathBuf::from(d).join("ptx"));
    }
    std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache/ferrotron/ptx"))
}

/// The file of kernels/ built for `arch` as `ext` (cubin or ptx) in the cache folder `dir`.
fn cache_file(dir: Option<std::path::PathBuf>, src: &str, arch: &str, ext: &str) -> Option<std::path::PathBuf> {
    dir.map(|d| d.join(format!("{:016x}-{arch}.{ext}", ferrotron_core::rng::fnv1a64(src))))
}

/// PTX for `arch` (e.g. `sm_90`), from the disk cache or compiled now: what the driver compiles
/// when the CUBIN does not load.
fn ptx(arch: &str) -> Result<Ptx> {
    let src = source();
    let cached = cache_file(cache_dir(), &src, arch, "ptx");
    if let Some(p) = &cached {
        if let Ok(text) = std::fs::read_to_string(p) {
            return Ok(Ptx::from_src(text));
        }
    }
    let ptx = compile(&src, arch)?;
    if let Some(p) = &cached {
        // The cache is an optimisation: failing to write it is not an error.
        let _ = std::fs::create_dir_all(p.parent().unwrap_or(p)).and_then(|_| std::fs::write(p, ptx.to_src()));
    }
    Ok(ptx)
}

/// The CUBIN for `arch`, from the disk cache or compiled now (and cached).
fn cubin(arch: &str) -> Result<Vec<u8>> {
    cubin_in(cache_dir(), arch)
}

/// `cubin` with the cache in `dir` (None: none).
fn cubin_in(dir: Option<std::path::PathBuf>, arch: &str) -> Result<Vec<u8>> {
    let src = source();
    let cached = cache_file(dir, &src, arch, "cubin");
    if let Some(bytes) = cached.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok(bytes);
    }
    let bin = compile_cubin(&src, arch)?;
    if let Some(p) = &cached {
        // Written whole under another name, then renamed: a reader never sees half a file.
        let tmp = p.with_extension(format!("cubin.{}", std::process::id()));
        let _ = std::fs::create_dir_all(p.parent().unwrap_or(p))
            .and_then(|_| std::fs::write(&tmp, &bin))
            .and_then(|_| std::fs::rename(&tmp, p));
    }
    Ok(bin)
}

/// Compiles kernels/ for `arch` (e.g. `sm_90a`) into the disk cache now, so a later first use on
/// a GPU only loads it (the GPU machine's fresh start then skips a minute of compiling). Needs
/// NVRTC, not a GPU. Returns the cache file.
pub fn prebuild_kernels(arch: &str) -> Result<std::path::PathBuf> {
    prebuild_in(cache_dir(), arch)
}

fn prebuild_in(dir: Option<std::path::PathBuf>, arch: &str) -> Result<std::path::PathBuf> {
    let path = cache_file(dir.clone(), &source(), arch, "cubin")
        .ok_or_else(|| Error::Cuda("no kernel cache folder: set FERROTRON_CACHE_DIR (or HOME)".into()))?;
    cubin_in(dir, arch)?;
    if !path.exists() {
        return Err(Error::Cuda(format!("the kernel cache file {} could not be written", path.display())));
    }
    Ok(path)
}

/// The kernels loaded on `dev` for `arch`: the CUBIN, else (a driver that refuses it) the PTX.
fn load_kernels(dev: &CudaDevice, arch: &str) -> Result<Arc<CudaModule>> {
    let ctx = dev.context();
    match cubin(arch).and_then(|b| ctx.load_module(Ptx::from_binary(b)).map_err(|e| cuda_err(arch, e))) {
        Ok(m) => Ok(m),
        Err(first) => ptx(arch)
            .and_then(|p| ctx.load_module(p).map_err(|e| cuda_err(arch, e)))
            .map_err(|e| Error::Cuda(format!("loading kernels/ for {arch}: as CUBIN: {first}; as PTX: {e}"))),
    }
}

/// `src` through NVRTC for the real architecture `arch` into a CUBIN; needs the library, not a
/// GPU.
fn compile_cubin(src: &str, arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    // SAFETY: only probes for the shared library.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Cuda("the NVRTC library (libnvrtc.so) was not found: add the CUDA toolkit's lib folder (or PyTorch's nvidia/cuda_nvrtc/lib) to LD_LIBRARY_PATH".into()));
    }
    let csrc = std::ffi::CString::new(src).map_err(|_| Error::Cuda("kernels/ holds a NUL byte".into()))?;
    let prog = result::create_program(&csrc, None).map_err(|e| cuda_err("NVRTC program", e))?;
    let opts = [format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    // SAFETY: `prog` is live (created above, destroyed once below) and `csrc` outlives it.
    let out = unsafe {
        let built = result::compile_program(prog, &opts).map_err(|e| {
            let log = result::get_program_log(prog)
                .map(|l| std::ffi::CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                .unwrap_or_default();
            Error::Cuda(format!("NVRTC compile of kernels/ for {arch}: {e:?}\n{log}"))
        });
        let bin = built.and_then(|_| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| cuda_err("NVRTC CUBIN size", e))?;
            let mut bin = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast()).result().map_err(|e| cuda_err("NVRTC CUBIN", e))?;
            Ok(bin)
        });
        let _ = result::destroy_program(prog);
        bin
    };
    match out {
        Ok(bin) if !bin.is_empty() => Ok(bin),
        Ok(_) => Err(Error::Cuda(format!("NVRTC gave no CUBIN for {arch} (a virtual architecture?)"))),
        Err(e) => Err(e),
    }
}

/// `src` through NVRTC for `arch`; needs the library, not a GPU.
fn compile(src: &str, arch: &str) -> Result<Ptx> {
    // SAFETY: only probes for the shared library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Cuda("the NVRTC library (libnvrtc.so) was not found: add the CUDA toolkit's lib folder (or PyTorch's nvidia/cuda_nvrtc/lib) to LD_LIBRARY_PATH".into()));
    }
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| cuda_err("NVRTC compile of kernels/", e))
}

/// The backend of `dev`, created on first use.
pub(crate) fn backend(dev: &CudaDevice) -> Result<Arc<Backend>> {
    let mut all = BACKENDS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, b)) = all.iter().find(|(o, _)| *o == dev.ordinal()) {
        return Ok(b.clone());
    }
    crate::check_lab_switches()?;
    let (major, minor) = dev.context().compute_capability().map_err(|e| cuda_err("compute capability", e))?;
    // sm_90a (Hopper's arch-specific features: wgmma) runs on sm_90 devices only; a driver or
    // NVRTC that cannot take it leaves the plain sm_90 build (mma.sync attention).
    let plain = format!("sm_{major}{minor}");
    let hopper = (major, minor) == (9, 0);
    let a = hopper.then(|| load_kernels(dev, "sm_90a"));
    let (module, wgmma) = match a {
        Some(Ok(m)) => (m, true),
        _ => (load_kernels(dev, &plain)?, false),
    };
    // SAFETY: only probes for the shared libraries.
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(Error::Cuda(
            "the cuBLASLt library (libcublasLt.so) was not found: add the CUDA toolkit's lib folder (or PyTorch's nvidia/cublas/lib) to LD_LIBRARY_PATH".into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(Error::Cuda(
            "the cuBLAS library (libcublas.so) was not found: add the CUDA toolkit's lib folder (or PyTorch's nvidia/cublas/lib) to LD_LIBRARY_PATH".into(),
        ));
    }
    let blas_lt = CudaBlasLT::new(dev.stream().clone()).map_err(|e| cuda_err("cuBLASLt", e))?;
    let blas = CudaBlas::new(dev.stream().clone()).map_err(|e| cuda_err("cuBLAS", e))?;
    let lt = lt::Lt::new(dev.stream())?;
    let sm_attr = cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    let sms = dev.context().attribute(sm_attr).map_err(|e| cuda_err("multiprocessor count", e))?.max(1) as u32;
    let optin = cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    let smem_optin =
        dev.context().attribute(optin).map_err(|e| cuda_err("shared memory per block", e))?.max(0) as usize;
    let functions = Mutex::new(HashMap::new());
    let tile_counter = ferrotron_core::cuda::CudaStorage::zeros(dev, ferrotron_core::DType::U32, 2)?;
    let draw_shift = Mutex::new(ferrotron_core::cuda::CudaStorage::zeros(dev, ferrotron_core::DType::U32, 2)?);
    let b = Arc::new(Backend {
        dev: dev.clone(),
        module,
        functions,
        blas_lt,
        blas,
        lt,
        wgmma,
        sms,
        fp8: (major, minor) >= (8, 9),
        smem_optin,
        tile_counter,
        draw_shift,
        clusters: Mutex::new(HashMap::new()),
        emb_scratch: Mutex::new(Vec::new()),
    });
    all.push((dev.ordinal(), b.clone()));
    Ok(b)
}

/// A kernel argument.
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Map(tma::TmaMap),
    /// An attention dropout key (kernels/attention.cu `AttnDrop`), by value.
    Drop(ops::AttnDropArgs),
}

impl Backend {
    fn function(&self, name: &str) -> Result<CudaFunction> {
        let mut f = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(func) = f.get(name) {
            return Ok(func.clone());
        }
        let func = self.module.load_function(name).map_err(|e| cuda_err(&format!("kernel {name}"), e))?;
        f.insert(name.into(), func.clone());
        Ok(func)
    }

    /// Launches `name` with `grid` × `block` threads and `shared` bytes of dynamic shared memory.
    /// A grid of 0 blocks (no rows, no chunks, no tiles) launches nothing: one block would index
    /// row 0 of outputs that have none.
    pub fn launch(&self, name: &str, grid: u32, block: u32, shared: u32, args: &[Arg]) -> Result<()> {
        if grid == 0 {
            return Ok(());
        }
        let func = self.function(name)?;
        let stream = self.dev.stream();
        if shared > 48 * 1024 {
            // Past 48 KiB a kernel must opt in to its dynamic shared memory.
            let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            func.set_attribute(attr, shared as i32).map_err(|e| cuda_err(&format!("shared memory of {name}"), e))?;
        }
        if self.wgmma && pdl() && waits_on_predecessor(name) {
            return self.launch_ex(name, &func, (grid, block, shared, 1), args, true);
        }
        let mut b = stream.launch_builder(&func);
        for a in args {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::I64(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::F64(v) => b.arg(v),
                Arg::Map(m) => b.arg(m),
                Arg::Drop(d) => b.arg(d),
            };
        }
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: shared };
        // SAFETY: every caller passes pointers to live allocations sized for the shapes it passes,
        // in the order the kernel declares them.
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err(&format!("launching {name}"), e))?;
        Ok(())
    }

    /// `launch` for a kernel whose blocks run in clusters of `cluster` (sm_90; kernels/gemm.cu's
    /// `_c2` kernels): `grid` a multiple of it. Returns how many clusters of the kernel can be
    /// resident at once when `grid` is 0 (nothing launched): the grid of a persistent kernel.
    pub fn launch_cluster(
        &self,
        name: &str,
        (grid, block, shared, cluster): (u32, u32, u32, u32),
        args: &[Arg],
    ) -> Result<u32> {
        let func = self.function(name)?;
        if shared > 48 * 1024 {
            let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            func.set_attribute(attr, shared as i32).map_err(|e| cuda_err(&format!("shared memory of {name}"), e))?;
        }
        if grid == 0 {
            return self.max_clusters(name, &func, (block, shared, cluster));
        }
        self.launch_ex(name, &func, (grid, block, shared, cluster), args, false).map(|()| grid / cluster)
    }

    /// cuOccupancyMaxActiveClusters, cached per kernel name (its shared memory and cluster size
    /// are fixed per name).
    fn max_clusters(&self, name: &str, func: &CudaFunction, (block, shared, cluster): (u32, u32, u32)) -> Result<u32> {
        use cudarc::driver::sys;
        let mut cache = self.clusters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&n) = cache.get(name) {
            return Ok(n);
        }
        self.dev.stream().context().bind_to_thread().map_err(|e| cuda_err(&format!("clusters of {name}"), e))?;
        let mut attr = cluster_attr(cluster);
        let cfg = sys::CUlaunchConfig {
            gridDimX: cluster * self.sms,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.dev.stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: `cfg` and `attr` outlive the call; the function handle is live (loaded above).
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, func.cu_function(), &cfg) }
            .result()
            .map_err(|e| cuda_err(&format!("clusters of {name}"), e))?;
        if n <= 0 {
            return Err(Error::Cuda(format!("{name}: no cluster of {cluster} blocks fits on this device")));
        }
        cache.insert(name.to_string(), n as u32);
        Ok(n as u32)
    }

    /// `launch` through cuLaunchKernelEx: with programmatic stream serialisation (`pdl`: the
    /// kernel may be scheduled before its predecessor on the stream has finished, and waits in
    /// `pdl_wait`) or in clusters of `cluster` blocks (more than 1).
    fn launch_ex(
        &self,
        name: &str,
        func: &CudaFunction,
        (grid, block, shared, cluster): (u32, u32, u32, u32),
        args: &[Arg],
        pdl: bool,
    ) -> Result<()> {
        use cudarc::driver::sys;
        use std::ffi::c_void;
        let stream = self.dev.stream();
        stream.context().bind_to_thread().map_err(|e| cuda_err(&format!("launching {name}"), e))?;
        // The driver reads each argument through its pointer during the call; `args` outlives it.
        let mut params: Vec<*mut c_void> = args
            .iter()
            .map(|a| match a {
                Arg::Ptr(p) => p as *const u64 as *mut c_void,
                Arg::I64(v) => v as *const i64 as *mut c_void,
                Arg::F32(v) => v as *const f32 as *mut c_void,
                Arg::F64(v) => v as *const f64 as *mut c_void,
                Arg::Map(m) => m as *const tma::TmaMap as *mut c_void,
                Arg::Drop(d) => d as *const ops::AttnDropArgs as *mut c_void,
            })
            .collect();
        let mut attr = if pdl {
            // SAFETY: a zeroed attribute value is valid plain data; the field set is the one the id names.
            let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            a.value.programmaticStreamSerializationAllowed = 1;
            a
        } else {
            cluster_attr(cluster)
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as `launch`: the arguments match the kernel's parameters in order and type, and
        // point at live allocations; `params` and `attr` outlive the call.
        let r = unsafe { sys::cuLaunchKernelEx(&cfg, func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) };
        r.result().map_err(|e| cuda_err(&format!("launching {name} (cuLaunchKernelEx)"), e))
    }

    /// Grid size for a grid-stride loop over `n` elements.
    pub fn grid_for(n: usize) -> u32 {
        n.div_ceil(256).clamp(1, 65_535) as u32
    }
}

/// The launch attribute that groups a grid's blocks in clusters of `n` along x.
fn cluster_attr(n: u32) -> cudarc::driver::sys::CUlaunchAttribute {
    use cudarc::driver::sys;
    // SAFETY: a zeroed attribute value is valid plain data; the field set is the one the id names.
    let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    a.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: n, y: 1, z: 1 };
    a
}

/// The CUDA device all of `ts` live on, or None when they are CPU tensors (or there are none: a
/// pipeline rank whose parameters are all frozen sums no gradients).
pub(crate) fn device_of(op: &'static str, ts: &[&Tensor]) -> Result<Option<CudaDevice>> {
    let Some(Device::Cuda(d)) = ts.first().map(|t| t.device()) else { return Ok(None) };
    for t in ts {
        if !t.device().same(ts[0].device()) {
            return Err(Error::DeviceMismatch { op, a: ts[0].device().name(), b: t.device().name() });
        }
    }
    Ok(Some(d.clone()))
}

/// Device address of a tensor's first element (contiguous tensors only).
pub(crate) fn ptr(op: &'static str, t: &Tensor) -> Result<Arg> {
    if !t.is_contiguous() {
        return Err(Error::NotContiguous { op });
    }
    let Device::Cuda(d) = t.device() else {
        return Err(Error::DeviceMismatch { op, a: "cuda".into(), b: t.device().name() });
    };
    let g = t.storage();
    let Storage::Cuda(c) = &*g else { return Err(Error::DeviceMismatch { op, a: "cuda".into(), b: "cpu".into() }) };
    Ok(Arg::Ptr(c.raw_ptr(d) + (t.layout().offset() * t.dtype().size_in_bytes()) as u64))
}

/// The backend when all of `ts` are CUDA tensors on one device; None for CPU tensors.
pub(crate) fn gpu(op: &'static str, ts: &[&Tensor]) -> Result<Option<Arc<Backend>>> {
    match device_of(op, ts)? {
        Some(d) => backend(&d).map(Some),
        None => Ok(None),
    }
}

/// Whether `dev` runs the Hopper wgmma kernels (compiled for sm_90a) and this thread allows them
/// (`set_wgmma`): tests assert the paths that need them were taken.
pub fn wgmma_device(dev: &Device) -> Result<bool> {
    match dev {
        Device::Cuda(d) => Ok(backend(d)?.use_wgmma()),
        _ => Ok(false),
    }
}

/// a [m, k] · bᵀ (b [n, k], `b_kmajor`) or a · b (b [k, n]) on our own GEMM kernel
/// (kernels/gemm.cu), bf16 out: None where it does not run (not an sm_90 device, the switch off,
/// a shape or alignment it does not take: `ops::gemm_ws::fits`). The MLP's GeLU products use the
/// same kernel with their epilogues; benches and tests time and check its main loop with this.
pub fn own_matmul(a: &Tensor, b: &Tensor, b_kmajor: bool) -> Result<Option<Tensor>> {
    const OP: &str = "own_matmul";
    let (&[m, k], &[b0, b1]) = (a.dims(), b.dims()) else {
        return Err(ferrotron_core::invalid(OP, "a and b must be matrices"));
    };
    let n = if b_kmajor { b0 } else { b1 };
    if (if b_kmajor { b1 } else { b0 }) != k || a.dtype() != ferrotron_core::DType::BF16 || b.dtype() != a.dtype() {
        return Err(ferrotron_core::invalid(
            OP,
            format!(
                "a {:?} and b {:?} do not multiply: give a [m, k] and b [n, k] (b_kmajor) or [k, n], both bf16",
                a.dims(),
                b.dims()
            ),
        ));
    }
    let Some(be) = gpu(OP, &[a, b])? else { return Ok(None) };
    let (pa, pb) = (ops::raw(OP, a)?, ops::raw(OP, b)?);
    // A fresh output is 256-byte aligned: only the inputs' addresses can fail the check.
    if !own_gemm() || !ops::gemm_ws::fits(&be, (m, n, k), &[pa, pb]) {
        return Ok(None);
    }
    let out = ops::new(&be, [m, n], a.dtype())?;
    let io = (pa, pb, ops::raw(OP, &out)?, 0, 0);
    ops::gemm_ws::launch(&be, ops::gemm_ws::Epi::Plain, io, b_kmajor, (m, n, k))?;
    count_own_gemm_run();
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    /// An op over no tensors (a pipeline rank whose parameters are all frozen sums no gradients)
    /// is CPU work, not a GPU lookup of a first tensor that is not there. No GPU needed.
    #[test]
    fn empty_tensor_lists_need_no_device() {
        assert!(super::device_of("sum_sq_all", &[]).unwrap().is_none());
        assert_eq!(crate::sum_sq_all(&[]).unwrap(), 0.0);
    }

    /// `own_matmul` names shapes that do not multiply (and dtypes it does not take) before it
    /// looks for a GPU, and leaves CPU tensors to the caller (None). No GPU needed.
    #[test]
    fn own_matmul_refuses_what_does_not_multiply() {
        use ferrotron_core::{DType, Device, Error, Tensor};
        let t = |r: usize, c: usize, dt| Tensor::zeros([r, c], dt, &Device::Cpu).unwrap();
        let bad = super::own_matmul(&t(4, 8, DType::BF16), &t(6, 5, DType::BF16), true).unwrap_err();
        assert!(matches!(&bad, Error::InvalidArgument { op: "own_matmul", msg } if msg.contains("[4, 8]")), "{bad}");
        let bad = super::own_matmul(&t(4, 8, DType::BF16), &t(6, 8, DType::BF16), false).unwrap_err();
        assert!(matches!(bad, Error::InvalidArgument { .. }), "b [6, 8] is not [k = 8, n]: {bad}");
        let bad = super::own_matmul(&t(4, 8, DType::F32), &t(6, 8, DType::F32), true).unwrap_err();
        assert!(bad.to_string().contains("bf16"), "{bad}");
        assert!(super::own_matmul(&t(4, 8, DType::BF16), &t(6, 8, DType::BF16), true).unwrap().is_none());
        assert!(super::own_matmul(&t(4, 8, DType::BF16), &t(8, 6, DType::BF16), false).unwrap().is_none());
    }

    /// kernels/ through NVRTC, the compiler the backend runs, for Hopper (sm_90a: wgmma) and for
    /// sm_80 (the other side of wgmma.cuh). NVRTC rejects what nvcc takes (a generic lambda is a
    /// host function to it), so `cargo xtask ptx` alone does not prove the kernels load. CI runs
    /// this with NVRTC 13.0 from PyPI, the GPU machine's version; no GPU needed.
    #[test]
    fn kernels_compile_under_nvrtc() {
        let src = super::source();
        for arch in ["sm_90a", "sm_80"] {
            let ptx = super::compile(&src, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
            let ptx = ptx.to_src();
            assert!(ptx.contains(".entry flash_bwd_dkvq_wg2_bf16_128"), "{arch}: a kernel is missing");
            if arch == "sm_90a" {
                // Every kernel that may launch before its predecessor finishes waits for it.
                let mut listed = 0;
                for entry in ptx.split(".entry ").skip(1) {
                    let name = entry.split('(').next().unwrap_or("").trim();
                    if super::waits_on_predecessor(name) {
                        listed += 1;
                        assert!(entry.contains("griddepcontrol.wait"), "{name} is launched early but never waits");
                    }
                }
                assert!(listed >= 20, "only {listed} kernels matched the programmatic-launch list");
            }
        }
        // The CUBIN the backend loads: an ELF image naming the kernels, cached where asked.
        let dir = std::env::temp_dir().join(format!("ferrotron-cubin-test-{}", std::process::id()));
        let path = super::prebuild_in(Some(dir.clone()), "sm_90a").unwrap_or_else(|e| panic!("sm_90a CUBIN: {e}"));
        let bin = std::fs::read(&path).unwrap();
        assert_eq!(&bin[..4], b"\x7fELF", "{}: not an ELF image", path.display());
        let name = b"flash_bwd_dkvq_wg2_bf16_128";
        assert!(bin.windows(name.len()).any(|w| w == name), "the CUBIN lacks a kernel");
        // A second call reads the cache: a file put in its place is what comes back.
        std::fs::write(&path, b"cached").unwrap();
        assert_eq!(super::cubin_in(Some(dir.clone()), "sm_90a").unwrap(), b"cached");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
