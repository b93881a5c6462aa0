//! Attention: the reference kernels, flash (SIMT) and the tensor-core kernels.

use super::*;
use crate::cpu::attention::{AttnDims, AttnMask};
use crate::cpu::attn_sink::SinkDims;
use crate::cuda::tma::TmaMap;

/// The reference attention kernels' shape arguments: the CPU's dims and mask plus the scale.
pub struct AttnShape<'a> {
    pub dims: &'a AttnDims,
    /// Without `docs` (the GPU's are `docs` below).
    pub mask: AttnMask<'static>,
    pub scale: f32,
    /// Document starts u32 [B, T] (`AttnCfg::docs`): the reference and tensor-core kernels take
    /// them (`fwd_kernel` and `bwd_plan` pick builds that do); the SIMT flash kernels do not.
    pub docs: Option<&'a Tensor>,
}

/// The document-starts argument: the tensor's address, or null.
fn docs_arg(a: &AttnShape) -> Result<Arg> {
    a.docs.map_or(Ok(Arg::Ptr(0)), |d| ptr("attn", d))
}

/// kernels/attention.cu `AttnDrop`, field for field: the dropout key of the probabilities and
/// its threshold (0: no dropout) and scale.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AttnDropArgs {
    seed: u64,
    stream: u64,
    base: u64,
    batch_stride: u64,
    head_offset: u64,
    threshold: u32,
    scale: f32,
    /// The device's draw shift (`Backend::draw_shift`), or 0 without dropout.
    shift: u64,
    /// `AttnDropout::tiles`, or zeros.
    tiles_t: u64,
    tiles_s: u64,
}

// SAFETY: plain data, laid out as the kernels' `AttnDrop` (five u64, a u32, an f32, a pointer,
// two u64: 72 bytes).
unsafe impl cudarc::driver::DeviceRepr for AttnDropArgs {}

/// The call's dropout key as a kernel argument (zeros without dropout).
fn drop_arg(be: &B, a: &AttnShape) -> Arg {
    Arg::Drop(a.mask.dropout.map_or_else(AttnDropArgs::default, |d| AttnDropArgs {
        seed: d.seed,
        stream: d.stream,
        base: d.base,
        batch_stride: d.batch_stride,
        head_offset: d.head_offset,
        threshold: crate::dropout::threshold16(d.p),
        scale: (1.0 / (1.0 - d.p as f64)) as f32,
        shift: be.draw_shift_ptr(),
        tiles_t: d.tiles.map_or(0, |t| t.0),
        tiles_s: d.tiles.map_or(0, |t| t.1),
    }))
}

/// Whether the call drops probabilities (the tensor-core kernels' `_drop` builds).
fn drops(a: &AttnShape) -> bool {
    a.mask.dropout.is_some()
}

fn attn_tail(a: &AttnShape) -> [Arg; 8] {
    let d = a.dims;
    [
        n(d.t),
        n(d.s),
        n(d.hq),
        n(d.hkv),
        n(d.d),
        Arg::F32(a.scale),
        Arg::I64(a.mask.causal as i64),
        n(a.mask.window.unwrap_or(0)),
    ]
}

fn attn_launch(be: &B, name: &str, a: &AttnShape, args: Vec<Arg>) -> Result<()> {
    let shared = (a.dims.s * 4) as u32;
    if shared > 48 * 1024 {
        return Err(Error::NotImplemented {
            op: "attention",
            device: format!(
                "cuda with {} keys (the reference kernel holds one score row in 48 KiB of shared memory)",
                a.dims.s
            ),
        });
    }
    be.launch(name, (a.dims.b * a.dims.hq * a.dims.t) as u32, 128, shared, &args)
}

/// Head dims with a flash kernel (kernels/flash.cu); others use the reference kernel.
const FLASH_DIMS: [usize; 3] = [32, 64, 128];
/// Threads per flash block: 32 rows × a quad of 4.
const FLASH_THREADS: u32 = 128;

fn flash(a: &AttnShape) -> bool {
    FLASH_DIMS.contains(&a.dims.d) && a.docs.is_none()
}

/// The head dim of multi-latent attention (DeepSeek-V2/V3, Kimi-K2: 128 + 64 rotary columns for Q
/// and K, V padded to them): simpler builds than at 64 and 128 (kernels/flash_mma.cu).
const WIDE: usize = 192;

/// Head dims with tensor-core kernels (bf16), in order.
pub(crate) const TC_HEAD_DIMS: [usize; 3] = [64, 128, WIDE];

/// Dynamic shared memory of the tensor-core kernels that stream K/V: two stages of a 64-key K
/// tile and V tile of `row` bf16 per key (head dim + 8 padded for ldmatrix; the head dim itself in
/// wgmma's 128-byte swizzled layout).
fn kv_stages(row: usize) -> u32 {
    (2 * 2 * 64 * row * 2) as u32
}

/// Warpgroups per block of a wgmma attention kernel (`_wgN_` in its name), from the `compiled`
/// choices: `default`, or `FERROTRON_FLASH_WG=N` where N was compiled (to measure the others;
/// every variant is compiled into each process, so the choices are kept few).
fn wg_blocks(compiled: &[usize], default: usize) -> usize {
    static CHOICE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let choice = CHOICE.get_or_init(|| std::env::var("FERROTRON_FLASH_WG").ok().and_then(|v| v.parse().ok()));
    match choice {
        Some(n) if compiled.contains(n) => *n,
        _ => default,
    }
}

/// Key-tile size of the warp-specialised forward: 128 (S = Q·Kᵀ as one m64n128 product per
/// k-step, half the per-tile softmax overhead per key); `FERROTRON_FLASH_FWD=ws64` gives 64 (kept
/// to measure against).
fn fwd_ws_keys() -> usize {
    static CHOICE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| if std::env::var("FERROTRON_FLASH_FWD").as_deref() == Ok("ws64") { 64 } else { 128 })
}

/// A tensor-core attention kernel's launch: name, rows (or keys) per block, threads, dynamic
/// shared memory.
struct TcLaunch {
    name: String,
    rows: usize,
    threads: u32,
    shared: u32,
}

/// How a forward kernel's blocks cover the query tiles: one block each (the warp-specialised
/// kernels also take batch × heads as their last argument), or at most one block per SM walking
/// them all (`cuda::flash_persist`).
#[derive(Clone, Copy, PartialEq)]
enum FwdGrid {
    Tiles,
    WsTiles,
    WsPersistent,
    /// The same with K and V copied by TMA (the kernel reads the two tensor maps).
    WsTilesTma,
    WsPersistentTma,
    /// Persistent with TMA and the dynamic tile walk (`cuda::flash_dyn`).
    WsDynamicTma,
}

/// The tensor-core forward for head dim `d` over `t` query rows. On sm_90, wgmma: the
/// warp-specialised kernel (two consumer warpgroups, a producer warpgroup; 128-key tiles, or 64
/// with `FERROTRON_FLASH_FWD=ws64`), or where `cuda::flash_fwd_ws` says no, 64 rows per warpgroup
/// and NW warpgroups per block sharing the K/V tiles in lockstep. Otherwise mma.sync, 4 warps:
/// two m-tiles per warp at head dim 64 from 2048 rows on (H200, 16k tokens per call: 112 →
/// 141–176 TFLOP/s from 2k to 16k, but slower at 1k than one m-tile); one otherwise (at 128 two
/// do not fit the registers). With attention dropout (`drop`): the `_drop` builds, the
/// warp-specialised one (two consumers, TMA, the dynamic walk) where those are on, else two
/// warpgroups in lockstep on sm_90, else mma.sync with one m-tile. Head dim 192 (`WIDE`): two
/// warpgroups in lockstep on sm_90, else mma.sync with one m-tile, dropout or not. With document
/// masks (`docs`): the warp-specialised `_docs` build (two consumers, TMA, the dynamic walk) where
/// those are on and there is no dropout, else the lockstep or mma.sync builds, which take them too.
fn fwd_kernel(be: &B, d: usize, t: usize, drop: bool, docs: bool) -> (TcLaunch, FwdGrid) {
    if d == WIDE {
        let drop = if drop { "_drop" } else { "" };
        let l = if be.use_wgmma() {
            TcLaunch { name: format!("flash_fwd_wg2{drop}_bf16_{d}"), rows: 128, threads: 256, shared: kv_stages(d) }
        } else {
            TcLaunch { name: format!("flash_fwd_mma{drop}_bf16_{d}"), rows: 64, threads: 128, shared: kv_stages(d + 8) }
        };
        return (l, FwdGrid::Tiles);
    }
    if docs && !drop && d != WIDE && ws_drop(be) {
        let grid = FwdGrid::WsDynamicTma;
        let shared = ws_fwd_shared(d, 128, 2, q_by_tma(grid, d));
        let name = format!("flash_fwd_ws2tpdk128_docs_bf16_{d}");
        return (TcLaunch { name, rows: 128, threads: 384, shared }, grid);
    }
    if drop && ws_drop(be) && !docs {
        let grid = FwdGrid::WsDynamicTma;
        let shared = ws_fwd_shared(d, 128, 2, q_by_tma(grid, d));
        let name = format!("flash_fwd_ws2tpdk128_drop_bf16_{d}");
        return (TcLaunch { name, rows: 128, threads: 384, shared }, grid);
    }
    if drop {
        let l = if be.use_wgmma() {
            TcLaunch { name: format!("flash_fwd_wg2_drop_bf16_{d}"), rows: 128, threads: 256, shared: kv_stages(d) }
        } else {
            TcLaunch { name: format!("flash_fwd_mma_drop_bf16_{d}"), rows: 64, threads: 128, shared: kv_stages(d + 8) }
        };
        return (l, FwdGrid::Tiles);
    }
    if be.use_wgmma() && crate::cuda::flash_fwd_ws() && !docs {
        // H200, 16k tokens per call, causal, 1k / 2k / 4k / 8k / 16k (kernels/README.md v28):
        // head dim 128 337 / 460 / 563 / 633 / 706 TFLOP/s with 128-key tiles and TMA copies
        // (64-key tiles by cp.async: 299 / 387 / 455 / 507 / 569), head dim 64 221–466.
        let keys = fwd_ws_keys();
        // Persistent, one block per SM, with the dynamic walk (kernels/flash_mma.cu `DYN`; H200,
        // 16k tokens per call, head dim 128: 356 / 477 / 574 / 639 / 712 → 381 / 509 / 600 / 661
        // / 696 TFLOP/s at 1k / 2k / 4k / 8k / 16k against one block per tile; the 1.3B step's
        // forward 346 → 322 µs a layer; head dim 64 level with the static persistent walk). The
        // static walk (all heads' heaviest tiles first) had lost at head dim 128 (456 → 404 at
        // 2k): its order streamed every head's K/V from DRAM at once; the dynamic walk's head
        // groups keep theirs in L2 (without the groups it too fell to 401 at 2k).
        // TMA copies (kernels/flash_mma.cu `TMA`) built for every choice but 64-key tiles at
        // head dim 64. `FERROTRON_FLASH_PERSIST=0`: one block per tile; `FERROTRON_FLASH_DYN=0`:
        // the static walk at head dim 64, one block per tile at 128.
        let tma = crate::cuda::flash_tma() && !(d == 64 && keys == 64);
        let allowed = crate::cuda::flash_persist() != Some(false) && keys == 128;
        let dynamic = allowed && crate::cuda::flash_dyn() && tma;
        let persistent = dynamic || (allowed && crate::cuda::flash_persist().unwrap_or(true) && d == 64);
        let p = match (persistent, dynamic) {
            (true, true) => "pd",
            (true, false) => "p",
            _ => "",
        };
        let tm = if tma { "t" } else { "" };
        let k = if keys == 64 { String::new() } else { format!("k{keys}") };
        // Three consumer warpgroups (192 query rows a tile; kernels/flash_mma.cu `NC`) with the
        // dynamic walk at head dim 64 from 2k rows on. H200, 16k tokens per call, causal, 1k / 2k
        // / 4k / 8k / 16k: 284 / 358 / 412 / 448 / 470 TFLOP/s with two, 281 / 389 / 460 / 508 /
        // 536 with three (at 1k a 192-row tile leaves more of the causal mask's work unused).
        let nc = match crate::cuda::flash_fwd_consumers() {
            _ if !(dynamic && d == 64) => 2,
            Some(n) => n,
            None if t >= 2048 => 3,
            None => 2,
        };
        let name = format!("flash_fwd_ws{nc}{tm}{p}{k}_bf16_{d}");
        let grid = match (persistent, tma, dynamic) {
            (true, true, true) => FwdGrid::WsDynamicTma,
            (true, true, false) => FwdGrid::WsPersistentTma,
            (true, false, _) => FwdGrid::WsPersistent,
            (false, true, _) => FwdGrid::WsTilesTma,
            (false, false, _) => FwdGrid::WsTiles,
        };
        let shared = ws_fwd_shared(d, keys, nc, q_by_tma(grid, d));
        (TcLaunch { name, rows: 64 * nc, threads: 128 * (nc as u32 + 1), shared }, grid)
    } else if be.use_wgmma() {
        // H200, 16k tokens per call (NW = 1 was L2-bound): D 64 NW 2 (178–246 TFLOP/s over 1k–16k;
        // 4: 144–227, 1: 137–168); D 128 NW 3 from 2k rows (190–243), 2 at 1k (156 vs 145).
        let nw = if d == 64 { 2 } else { wg_blocks(&[2, 3], if t >= 2048 { 3 } else { 2 }) };
        let name = format!("flash_fwd_wg{nw}_bf16_{d}");
        (TcLaunch { name, rows: 64 * nw, threads: 128 * nw as u32, shared: kv_stages(d) }, FwdGrid::Tiles)
    } else if d == 64 && t >= 2048 {
        (
            TcLaunch { name: "flash_fwd_mma_bf16_64x2".into(), rows: 128, threads: 128, shared: kv_stages(d + 8) },
            FwdGrid::Tiles,
        )
    } else {
        (
            TcLaunch { name: format!("flash_fwd_mma_bf16_{d}"), rows: 64, threads: 128, shared: kv_stages(d + 8) },
            FwdGrid::Tiles,
        )
    }
}

/// Dynamic shared memory of the warp-specialised forward (kernels/flash_mma.cu `flash_fwd_ws`):
/// FW_STAGES (3) stages of K and V tiles of `keys` rows, the two Q tiles (64·nc rows) of the builds
/// that copy Q (`q_tiles`: `q_by_tma`), 16 slots of 8 bytes (mbarriers, tile indices), the `nc`
/// consumers' O tiles of 64 padded rows (`fwd_store_staged`): 231,552 bytes at head dim 128.
fn ws_fwd_shared(d: usize, keys: usize, nc: usize, q_tiles: bool) -> u32 {
    let q = if q_tiles { 2 * 64 * nc * d * 2 } else { 0 };
    (3 * 2 * keys * d * 2 + q + 16 * 8 + nc * 64 * (d + 8) * 2) as u32
}

/// Whether the forward with attention dropout runs the warp-specialised `_drop` build (TMA copies,
/// the dynamic walk: kernels/flash_mma.cu `FLASH_WS_DROP`; the `_docs` build likewise): on sm_90
/// where the warp-specialised forward, its 128-key tiles, TMA and the dynamic walk are all on;
/// else the lockstep `_drop` build. (`bwd_plan` decides the backward's by its own switches, and not in deterministic mode.)
fn ws_drop(be: &B) -> bool {
    be.use_wgmma()
        && crate::cuda::flash_fwd_ws()
        && fwd_ws_keys() == 128
        && crate::cuda::flash_tma()
        && crate::cuda::flash_persist() != Some(false)
        && crate::cuda::flash_dyn()
}

/// Whether the forward kernel of `grid` copies Q by TMA too (kernels/flash_mma.cu `QT`): the
/// persistent TMA builds at head dim 64.
fn q_by_tma(grid: FwdGrid, d: usize) -> bool {
    matches!(grid, FwdGrid::WsPersistentTma | FwdGrid::WsDynamicTma) && d == 64
}

/// The tensor-core backward's kernels: with wgmma and unless deterministic, one kernel for dK, dV
/// and dQ (keys per block; dQ's 64 × 64 pieces added into fp32 tiles by bulk reductions), else the
/// dQ kernel (query rows per block) and the dK/dV kernel. At head dim 64 up to 2048 rows the two
/// kernels measured faster (H200, 16k tokens per call, swizzled tiles: 152 and 182 TFLOP/s
/// against 142 and 176 at 1k and 2k; equal at 4k, the one kernel ahead from 8k).
enum BwdKernels {
    /// The one kernel; `Some(ws)` for the warp-specialised one, which takes four tensor maps
    /// (read when `ws.tma`: kernels/flash_bwd_mma.cu `TMA`).
    Fused(TcLaunch, Option<WsBwd>),
    Split(TcLaunch, TcLaunch),
}

/// The warp-specialised backward's build: copies by TMA; persistent with the dynamic walk
/// (kernels/flash_bwd_mma.cu `DYN`, TMA builds only).
#[derive(Clone, Copy)]
struct WsBwd {
    tma: bool,
    dynamic: bool,
}

/// With attention dropout (`drop`): the `_drop` builds, the fused one on wgmma unless
/// deterministic, else the two mma.sync ones. Head dim 192 (`WIDE`): the two kernels, on wgmma
/// where it runs (without dropout). With document masks (`docs`): the warp-specialised `_docs`
/// build where the `_drop` one would run and there is no dropout, else the two kernels as in
/// deterministic mode (the lockstep fused builds do not take the starts).
fn bwd_plan(be: &B, d: usize, t: usize, drop: bool, docs: bool) -> BwdKernels {
    let wgmma = be.use_wgmma() && !crate::cuda::deterministic();
    // The warp-specialised build with TMA and the dynamic walk (the `_drop` and `_docs` ones).
    let ws_dyn = wgmma
        && crate::cuda::flash_bwd_ws()
        && crate::cuda::flash_tma()
        && crate::cuda::flash_bwd_dyn()
        && crate::cuda::flash_persist() != Some(false);
    if docs && !drop && d != WIDE && ws_dyn {
        let name = format!("flash_bwd_dkvq_ws2td_docs_bf16_{d}");
        let ws = WsBwd { tma: true, dynamic: true };
        return BwdKernels::Fused(TcLaunch { name, rows: 128, threads: 384, shared: ws_shared(d) }, Some(ws));
    }
    if d == WIDE || docs {
        // Both kernels write each element once (deterministic either way); with dropout mma.sync.
        let (dq, dkv) = if drop { bwd_kernels(d, false, "_drop") } else { bwd_kernels(d, be.use_wgmma(), "") };
        return BwdKernels::Split(dq, dkv);
    }
    if drop && ws_dyn {
        let name = format!("flash_bwd_dkvq_ws2td_drop_bf16_{d}");
        let ws = WsBwd { tma: true, dynamic: true };
        return BwdKernels::Fused(TcLaunch { name, rows: 128, threads: 384, shared: ws_shared(d) }, Some(ws));
    }
    if drop {
        let (dq, dkv) = bwd_kernels(d, false, "_drop");
        if !wgmma {
            return BwdKernels::Split(dq, dkv);
        }
        let (_, dkv) = bwd_kernels(d, true, "");
        return BwdKernels::Fused(fused_dkvq(dkv, d, "_drop"), None);
    }
    let (dq, dkv) = bwd_kernels(d, be.use_wgmma(), "");
    // The warp-specialised kernel (kernels/flash_bwd_mma.cu `flash_bwd_dkvq_ws`; H200, 16k tokens
    // per call, D 64: 217–411 TFLOP/s over 1k–16k (v24) against 166–229 for the plan below, which
    // `cuda::set_flash_ws(false)` or FERROTRON_FLASH_BWD=wg keeps).
    if wgmma && crate::cuda::flash_bwd_ws() {
        // Persistent with the dynamic walk (kernels/flash_bwd_mma.cu `DYN`; H200, 16k tokens per
        // call, head dim 128: 303 / 393 / 463 / 515 / 568 → 320 / 413 / 490 / 536 / 552 TFLOP/s
        // at 1k / 2k / 4k / 8k / 16k against one block per key tile, head dim 64 +1–2% to 4k and
        // −3% at 16k; in the running steps the backward 262 → 243 µs a 124M layer, 2388 → 2206
        // a Llama-1B one, the 1.3B step's attention 33.8 → 32.4 ms): up to 8k tokens.
        let tma = crate::cuda::flash_tma();
        let dynamic = tma && t <= 8192 && crate::cuda::flash_bwd_dyn() && crate::cuda::flash_persist() != Some(false);
        let t = match (tma, dynamic) {
            (true, true) => "td",
            (true, false) => "t",
            _ => "",
        };
        let name = format!("flash_bwd_dkvq_ws2{t}_bf16_{d}");
        let ws = WsBwd { tma, dynamic };
        return BwdKernels::Fused(TcLaunch { name, rows: 128, threads: 384, shared: ws_shared(d) }, Some(ws));
    }
    if !wgmma || (d == 64 && t <= 2048) {
        return BwdKernels::Split(dq, dkv);
    }
    BwdKernels::Fused(fused_dkvq(dkv, d, ""), None)
}

/// The fused dK/dV/dQ kernel (`flash_bwd_dkvq_wgNW{sfx}_bf16_D`) of the wgmma dK/dV launch `dkv`:
/// its shared memory plus dSᵀ of one step (the block's keys × 64 rows) and two 64 × 64 fp32 dQ
/// staging buffers per warpgroup.
fn fused_dkvq(dkv: TcLaunch, d: usize, sfx: &str) -> TcLaunch {
    let nw = dkv.rows / 64;
    let shared = dkv.shared + (64 * nw * 64 * 2 + nw * 2 * 4096 * 4) as u32;
    TcLaunch { name: format!("flash_bwd_dkvq_wg{nw}{sfx}_bf16_{d}"), shared, ..dkv }
}

/// The warp-specialised backward's dynamic shared memory (kernels/flash_bwd_mma.cu, above
/// `bw_stages`): K and V (128 keys), the stages' (Q, dO) tiles, the dSᵀ buffers, two consumers'
/// double dQ staging, the stages' (lse, delta) rows, 2 · stages + 6 mbarriers and two tile-index
/// slots (8 bytes each).
fn ws_shared(d: usize) -> u32 {
    let (stages, dss) = if d == 64 { (3, 1) } else { (2, 2) };
    let bytes = 2 * 128 * d * 2 + stages * 2 * 64 * d * 2 + dss * 2 * 64 * 64 * 2 + 2 * 2 * 4096 * 4;
    (bytes + stages * 2 * 64 * 4 + (2 * stages + 8) * 8) as u32
}

/// The tensor-core backward's dQ kernel (query rows per block) and dK/dV kernel (keys per block):
/// wgmma on sm_90 (tiles unpadded, 128-byte swizzled; NW warpgroups of 64 rows or keys sharing
/// the streamed tiles: `wg`), mma.sync elsewhere (4 warps, rows padded for ldmatrix); `sfx` after
/// the kind (`_drop`: the dropout builds, mma.sync only).
fn bwd_kernels(d: usize, wg: bool, sfx: &str) -> (TcLaunch, TcLaunch) {
    let (kind, nw, row) = if wg {
        // H200: D 64 NW 1 (129–180 TFLOP/s; 2: 112–172), D 128 NW 2 (142–214; 1: 131–169).
        let nw = if d == 64 { 1 } else { 2 };
        (format!("wg{nw}"), nw, d)
    } else {
        ("mma".to_string(), 1, d + 8)
    };
    let threads = 128 * nw as u32;
    // At head dim 192 (`WIDE`) the dQ kernel keeps the Q and dO tiles in shared memory after the
    // K/V stages, and the dK/dV kernel runs as two roles of 128 threads (kernels/flash_bwd_mma.cu
    // `QS`, `ROLE`).
    let wide = d == WIDE;
    let q_tiles = if wide { 2 * 64 * nw * row * 2 } else { 0 } as u32;
    let dq = TcLaunch {
        name: format!("flash_bwd_dq_{kind}{sfx}_bf16_{d}"),
        rows: 64 * nw,
        threads,
        shared: kv_stages(row) + q_tiles,
    };
    // K and V tiles, two stages of 64-row (Q, dO) tiles and of the rows' (lse, delta); the
    // two roles share 64 keys.
    let (keys, threads) = if wide { (64, 256) } else { (64 * nw, threads) };
    let shared = ((2 * keys + 4 * 64) * row * 2 + 4 * 64 * 4) as u32;
    let dkv = TcLaunch { name: format!("flash_bwd_dkv_{kind}{sfx}_bf16_{d}"), rows: keys, threads, shared };
    (dq, dkv)
}

/// Whether the tensor-core kernels take these tensors: bf16, head dim 64, 128 or 192 (`WIDE`), and
/// every tile source 16-byte aligned (their loads move 16 bytes at a time; a view at an odd offset
/// is not).
fn mma_ok(q: &Tensor, tiles: &[&Tensor], a: &AttnShape) -> Result<bool> {
    if q.dtype() != DType::BF16 || !TC_HEAD_DIMS.contains(&a.dims.d) || tiles.iter().any(|t| t.dtype() != DType::BF16) {
        return Ok(false);
    }
    aligned16(tiles)
}

/// A tensor's address as `ptr` gives it.
fn addr(a: Arg) -> u64 {
    match a {
        Arg::Ptr(p) => p,
        _ => unreachable!("a tensor's address is a pointer"),
    }
}

/// The rows' head counts of K/V and of Q as the kernels' `Place` reads them: with `fused`, every
/// head sits among its group's G + 2 (G query heads, then K, then V); else their own tensors.
fn map_heads(d: &AttnDims, fused: bool) -> (usize, usize) {
    let slots = d.hkv * (d.hq / d.hkv + 2);
    if fused { (slots, slots) } else { (d.hkv, d.hq) }
}

/// The tensor-core forward over Q, K, V at `qkv` (separate tensors, or with `fused` the projection
/// output's slots: kernels/flash_mma.cu `Place`), into (o, lse).
fn tc_fwd(be: &B, qkv: [Arg; 3], fused: bool, a: &AttnShape) -> Result<(Tensor, Tensor)> {
    let d = a.dims;
    let o = new(be, [d.b, d.t, d.hq, d.d], DType::BF16)?;
    let lse = new(be, [d.b, d.hq, d.t], DType::F32)?;
    let mut args = qkv.to_vec();
    args.extend([ptr("attn", &o)?, ptr("attn", &lse)?]);
    args.extend(attn_tail(a));
    args.push(Arg::I64(fused as i64));
    let (l, grid) = fwd_kernel(be, d.d, d.t, drops(a), a.docs.is_some());
    let (bh, tiles) = (d.b * d.hq, d.t.div_ceil(l.rows));
    let blocks = match grid {
        FwdGrid::Tiles => {
            args.push(docs_arg(a)?);
            if drops(a) {
                args.push(drop_arg(be, a));
            }
            bh * tiles
        }
        _ => {
            args.push(n(bh));
            // The tensor maps of K and V and, with persistence, of Q (its query tiles);
            // unused ones for the cp.async builds.
            let (kv_heads, q_heads) = map_heads(d, fused);
            let [q, k, v] = qkv.map(addr);
            let tma = matches!(grid, FwdGrid::WsTilesTma | FwdGrid::WsPersistentTma | FwdGrid::WsDynamicTma);
            let maps = [
                if tma { TmaMap::rows(k, d.b, d.s, kv_heads, d.d, fwd_ws_keys())? } else { TmaMap::unused() },
                if tma { TmaMap::rows(v, d.b, d.s, kv_heads, d.d, fwd_ws_keys())? } else { TmaMap::unused() },
                if q_by_tma(grid, d.d) { TmaMap::rows(q, d.b, d.t, q_heads, d.d, l.rows)? } else { TmaMap::unused() },
            ];
            args.extend(maps.map(Arg::Map));
            // The dynamic walk's heads per group (by the bytes of K and V a query head reads:
            // GQA's query heads of one group share theirs) and its counters.
            let kv_per_head = d.s * d.d * 2 * 2 * d.hkv / d.hq;
            args.push(n(crate::cuda::flash_group_heads(kv_per_head)));
            args.push(Arg::Ptr(be.tile_counter.raw_ptr(&be.dev)));
            if drops(a) {
                args.push(drop_arg(be, a));
            }
            if a.docs.is_some() {
                args.push(docs_arg(a)?);
            }
            let persistent = matches!(grid, FwdGrid::WsPersistent | FwdGrid::WsPersistentTma | FwdGrid::WsDynamicTma);
            if persistent { (bh * tiles).min(be.sms as usize) } else { bh * tiles }
        }
    };
    be.launch(&l.name, blocks as u32, l.threads, l.shared, &args)?;
    Ok((o, lse))
}

/// Q, K and V's addresses in the fused projection output [B, T, Hkv·(G+2)·D]: its start, then G
/// and G + 1 heads on (each K/V group's heads sit (G + 2)·D apart, `Place` in the kernels).
fn fused_ptrs(qkv: &Tensor, a: &AttnShape) -> Result<[Arg; 3]> {
    let base = addr(ptr("attn", qkv)?);
    let (g, head_bytes) = ((a.dims.hq / a.dims.hkv) as u64, (a.dims.d * qkv.dtype().size_in_bytes()) as u64);
    Ok([Arg::Ptr(base), Arg::Ptr(base + g * head_bytes), Arg::Ptr(base + (g + 1) * head_bytes)])
}

/// The forward reading Q, K, V in place from the fused projection output; None where the
/// tensor-core kernels do not apply (the caller splits).
pub fn attention_fwd_qkv(be: &B, qkv: &Tensor, a: &AttnShape) -> Result<Option<(Tensor, Tensor)>> {
    if !mma_ok(qkv, &[qkv], a)? {
        return Ok(None);
    }
    tc_fwd(be, fused_ptrs(qkv, a)?, true, a).map(Some)
}

pub fn attention_fwd(be: &B, q: &Tensor, k: &Tensor, v: &Tensor, a: &AttnShape) -> Result<(Tensor, Tensor)> {
    if mma_ok(q, &[q, k, v], a)? {
        // Tensor cores (kernels/flash_mma.cu).
        return tc_fwd(be, [ptr("attn", q)?, ptr("attn", k)?, ptr("attn", v)?], false, a);
    }
    let o = new(be, q.shape().clone(), q.dtype())?;
    let lse = new(be, [a.dims.b, a.dims.hq, a.dims.t], DType::F32)?;
    let mut args = vec![ptr("attn", q)?, ptr("attn", k)?, ptr("attn", v)?, ptr("attn", &o)?, ptr("attn", &lse)?];
    args.extend(attn_tail(a));
    let sfx = sfx("attention_fwd", q.dtype())?;
    if flash(a) {
        args.push(drop_arg(be, a));
        let d = a.dims;
        let grid = d.b * d.hq * d.t.div_ceil(32);
        be.launch(&format!("flash_fwd_{sfx}_{}", d.d), grid as u32, FLASH_THREADS, 0, &args)?;
    } else {
        args.extend([docs_arg(a)?, drop_arg(be, a)]);
        attn_launch(be, &format!("attn_fwd_{sfx}"), a, args)?;
    }
    Ok((o, lse))
}

/// Where the tensor-core backward reads Q, K, V and writes dQ, dK, dV (bf16): separate tensors,
/// or with `fused` the slots of the projection output and of its gradient (`Place`).
struct TcQkv {
    qkv: [Arg; 3],
    grads: [Arg; 3],
    fused: bool,
}

/// The tensor-core backward: delta, then the fused dK/dV/dQ kernel and the dQ tiles' pass to
/// bf16, or the dQ and dK/dV kernels (`bwd_plan`). `partials` ([B·T / 64, width of dQKV] f32,
/// only where `bias_partials_ok`): the first pass of dQKV's column sums, written by the kernels
/// that write dQKV.
fn tc_bwd(
    be: &B,
    x: &TcQkv,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    a: &AttnShape,
    partials: Option<&Tensor>,
) -> Result<()> {
    let d = a.dims;
    let delta = new(be, [d.b, d.hq, d.t], DType::F32)?;
    // delta = rowsum(dO∘O): d / 8 threads per row rounded up to a power of two (8, 16, 32 at head
    // dims 64, 128, 192), 16-byte loads (every tile aligned here); `zero`: fp32 tiles it clears
    // on the way.
    let launch_delta = |zero: Option<&Tensor>| -> Result<()> {
        let (rows, lanes) = (d.b * d.t * d.hq, (d.d / 8).next_power_of_two());
        let (z, zn) = match zero {
            Some(t) => (ptr("attn", t)?, t.elem_count()),
            None => (Arg::Ptr(0), 0),
        };
        let args = [
            ptr("attn", o)?,
            ptr("attn", dout)?,
            ptr("attn", &delta)?,
            n(rows),
            n(d.t),
            n(d.hq),
            n(d.d),
            n(lanes),
            z,
            n(zn),
        ];
        let threads = (rows * lanes).max(zn / 8);
        be.launch("flash_bwd_delta_bf16", threads.div_ceil(256) as u32, 256, 0, &args)
    };
    let [dq, dk, dv] = x.grads;
    let head = |outs: &[Arg]| -> Result<Vec<Arg>> {
        let mut v = x.qkv.to_vec();
        v.extend([ptr("attn", lse)?, ptr("attn", &delta)?, ptr("attn", dout)?]);
        v.extend_from_slice(outs);
        v.extend(attn_tail(a));
        v.push(Arg::I64(x.fused as i64));
        Ok(v)
    };
    // The dropout builds take the key last.
    let key = |mut v: Vec<Arg>| {
        if drops(a) {
            v.push(drop_arg(be, a));
        }
        v
    };
    match bwd_plan(be, d.d, d.t, drops(a), a.docs.is_some()) {
        BwdKernels::Fused(l, ws) => {
            // dQ's fp32 tiles (64 rows × 64 columns per batch and head, rows padded to 64, sums
            // of dS·K without the softmax scale), cleared by the delta kernel (never poisoned).
            let dqa = new(be, [d.b, d.hq, d.t.div_ceil(64) * 64, d.d], DType::F32)?;
            launch_delta(Some(&dqa))?;
            let mut grid = d.b * d.hkv * d.s.div_ceil(l.rows);
            let mut args = head(&[dk, dv, ptr("attn", &dqa)?])?;
            if let Some(WsBwd { tma, dynamic }) = ws {
                // K and V (the block's 128 keys), Q and dO (64-row tiles).
                let (kv_heads, q_heads) = map_heads(d, x.fused);
                let [q, k, v] = x.qkv.map(addr);
                let dop = addr(ptr("attn", dout)?);
                let maps = if tma {
                    [
                        TmaMap::rows(k, d.b, d.s, kv_heads, d.d, 128)?,
                        TmaMap::rows(v, d.b, d.s, kv_heads, d.d, 128)?,
                        TmaMap::rows(q, d.b, d.t, q_heads, d.d, 64)?,
                        TmaMap::rows(dop, d.b, d.t, d.hq, d.d, 64)?,
                    ]
                } else {
                    [TmaMap::unused(); 4]
                };
                args.extend(maps.map(Arg::Map));
                args.extend(partial_args(partials)?);
                // The dynamic walk's K/V heads per group (by the Q and dO bytes a K/V head's
                // tiles read) and its counters; persistent, one block per SM.
                let qdo_per_kv_head = d.hq / d.hkv * d.t * d.d * 2 * 2;
                args.extend([n(d.b * d.hkv), n(crate::cuda::flash_group_heads(qdo_per_kv_head))]);
                args.push(Arg::Ptr(be.tile_counter.raw_ptr(&be.dev)));
                if a.docs.is_some() {
                    args.push(docs_arg(a)?);
                }
                if dynamic {
                    grid = grid.min(be.sms as usize);
                }
            }
            be.launch(&l.name, grid as u32, l.threads, l.shared, &key(args))?;
            // Then to bf16 with the scale applied: one block per 64 × 64 tile.
            let tiles = d.b * d.hq * d.t.div_ceil(64) * (d.d / 64);
            let fused = Arg::I64(x.fused as i64);
            let mut args = vec![ptr("attn", &dqa)?, dq, n(d.t), n(d.hq), n(d.d), n(d.hkv), fused, Arg::F32(a.scale)];
            args.extend(partial_args(partials)?);
            be.launch("flash_dq_tiles_bf16", tiles as u32, 256, 0, &args)
        }
        BwdKernels::Split(dql, dkvl) => {
            if partials.is_some() {
                return Err(ferrotron_core::invalid("attention_bwd_qkv", "bias partials need the fused backward"));
            }
            launch_delta(None)?;
            // These builds take the document starts (or null) before the dropout key.
            let with_docs = |mut v: Vec<Arg>| -> Result<Vec<Arg>> {
                v.push(docs_arg(a)?);
                Ok(key(v))
            };
            let grid = d.b * d.hq * d.t.div_ceil(dql.rows);
            be.launch(&dql.name, grid as u32, dql.threads, dql.shared, &with_docs(head(&[dq])?)?)?;
            let grid = d.b * d.hkv * d.s.div_ceil(dkvl.rows);
            be.launch(&dkvl.name, grid as u32, dkvl.threads, dkvl.shared, &with_docs(head(&[dk, dv])?)?)
        }
    }
}

/// The bias-partial arguments of the warp-specialised backward and the dQ tiles' pass: the
/// partials' address and row width, or null.
fn partial_args(partials: Option<&Tensor>) -> Result<[Arg; 2]> {
    Ok(match partials {
        Some(p) => [ptr("attn", p)?, n(p.shape().last())],
        None => [Arg::Ptr(0), n(0)],
    })
}

/// Whether the backward's own kernels can write dQKV's column-sum partials: the warp-specialised
/// plan (the only one whose dK/dV kernel takes them), whole 64-row chunks (T % 64 == 0, so no
/// chunk straddles two sequences), and `cuda::flash_bias_grad` on.
fn bias_partials_ok(be: &B, a: &AttnShape) -> bool {
    let d = a.dims;
    crate::cuda::flash_bias_grad()
        && d.t % 64 == 0
        && d.s == d.t
        && matches!(bwd_plan(be, d.d, d.t, drops(a), a.docs.is_some()), BwdKernels::Fused(_, Some(_)))
}

/// The backward reading Q, K, V in place from the fused projection output and writing dQKV
/// [B, T, Hkv·(G+2)·D] (every slot written once); None where the tensor-core kernels do not apply.
/// With `db` (an f32 or bf16 [width] vector and whether to add into it) the kernels that write dQKV also
/// write the first pass of its column sums, and the second pass puts Σ rows of dQKV into db (the
/// QKV projection's bias gradient, without reading dQKV again) where `bias_partials_ok`; the bool
/// returned says whether that happened (else the caller sums).
pub fn attention_bwd_qkv(
    be: &B,
    qkv: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    a: &AttnShape,
    db: Option<(&Tensor, bool)>,
) -> Result<Option<(Tensor, bool)>> {
    if !mma_ok(qkv, &[qkv, dout, o], a)? {
        return Ok(None);
    }
    let dqkv = new(be, qkv.shape().clone(), DType::BF16)?;
    let x = TcQkv { qkv: fused_ptrs(qkv, a)?, grads: fused_ptrs(&dqkv, a)?, fused: true };
    let (rows, width) = (a.dims.b * a.dims.t, qkv.shape().last());
    let db = db.filter(|(db, _)| matches!(db.dtype(), DType::F32 | DType::BF16) && bias_partials_ok(be, a));
    let partials = db.map(|_| new(be, [rows / 64, width], DType::F32)).transpose()?;
    tc_bwd(be, &x, o, lse, dout, a, partials.as_ref())?;
    if let (Some(p), Some((db, acc))) = (&partials, db) {
        col_sum_to(be, p, rows / 64, width, db, acc)?;
        crate::cuda::count_flash_bias_grad_run();
    }
    Ok(Some((dqkv, partials.is_some())))
}

/// Flash backward: delta = rowsum(dO∘O), then either dK/dV per key tile with dQ summed into fp32
/// tiles by bulk reductions (wgmma, not deterministic) or dQ per query tile and dK/dV per key tile
/// with no sums across blocks (the same bits every run). Gradients in bf16 from the tensor-core
/// kernels, fp32 from the SIMT ones.
#[allow(clippy::too_many_arguments)]
fn flash_bwd(
    be: &B,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    a: &AttnShape,
) -> Result<(Tensor, Tensor, Tensor)> {
    let d = a.dims;
    let sfx = sfx("attention_bwd", q.dtype())?;
    if mma_ok(q, &[q, k, v, dout, o], a)? {
        // Tensor cores (kernels/flash_bwd_mma.cu), gradients in bf16.
        let dq = new(be, q.shape().clone(), DType::BF16)?;
        let (dk, dv) = (new(be, k.shape().clone(), DType::BF16)?, new(be, v.shape().clone(), DType::BF16)?);
        let at = |t: &Tensor| ptr("attn", t);
        let x = TcQkv { qkv: [at(q)?, at(k)?, at(v)?], grads: [at(&dq)?, at(&dk)?, at(&dv)?], fused: false };
        tc_bwd(be, &x, o, lse, dout, a, None)?;
        return Ok((dq, dk, dv));
    }
    let delta = new(be, [d.b, d.hq, d.t], DType::F32)?;
    let dq = new(be, q.shape().clone(), DType::F32)?;
    let (dk, dv) = (new(be, k.shape().clone(), DType::F32)?, new(be, v.shape().clone(), DType::F32)?);
    let mut args = vec![
        ptr("attn", q)?,
        ptr("attn", k)?,
        ptr("attn", v)?,
        ptr("attn", o)?,
        ptr("attn", lse)?,
        ptr("attn", dout)?,
        ptr("attn", &dq)?,
        ptr("attn", &delta)?,
    ];
    args.extend(attn_tail(a));
    args.push(drop_arg(be, a));
    be.launch(&format!("flash_bwd_dq_{sfx}_{}", d.d), (d.b * d.hq * d.t.div_ceil(32)) as u32, FLASH_THREADS, 0, &args)?;
    let mut args = vec![
        ptr("attn", q)?,
        ptr("attn", k)?,
        ptr("attn", v)?,
        ptr("attn", lse)?,
        ptr("attn", &delta)?,
        ptr("attn", dout)?,
        ptr("attn", &dk)?,
        ptr("attn", &dv)?,
    ];
    args.extend(attn_tail(a));
    args.push(drop_arg(be, a));
    be.launch(
        &format!("flash_bwd_dkv_{sfx}_{}", d.d),
        (d.b * d.hkv * d.s.div_ceil(32)) as u32,
        FLASH_THREADS,
        0,
        &args,
    )?;
    Ok((dq, dk, dv))
}

pub fn attention_bwd(
    be: &B,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    a: &AttnShape,
) -> Result<(Tensor, Tensor, Tensor)> {
    if flash(a) || mma_ok(q, &[q, k, v, dout, o], a)? {
        let (dq, dk, dv) = flash_bwd(be, q, k, v, o, lse, dout, a)?;
        let dt = dout.dtype();
        if dq.dtype() == dt {
            return Ok((dq, dk, dv));
        }
        return Ok((cast(be, &dq, dt)?, cast(be, &dk, dt)?, cast(be, &dv, dt)?));
    }
    // dk and dv are sums of fp32 atomics: they must start at zero (never poisoned). Deterministic
    // mode leaves them to `attn_bwd_kv`, which writes every element.
    let det = crate::cuda::deterministic();
    let dev = Device::Cuda(be.dev.clone());
    let dq = new(be, q.shape().clone(), DType::F32)?;
    let (dk, dv) = if det {
        (new(be, k.shape().clone(), DType::F32)?, new(be, v.shape().clone(), DType::F32)?)
    } else {
        (Tensor::zeros(k.shape().clone(), DType::F32, &dev)?, Tensor::zeros(v.shape().clone(), DType::F32, &dev)?)
    };
    let s = sfx("attention_bwd", q.dtype())?;
    let inputs = [q, k, v, o, lse, dout].map(|t| ptr("attn", t)).into_iter().collect::<Result<Vec<_>>>()?;
    let mut args = inputs.clone();
    args.extend([ptr("attn", &dq)?, ptr("attn", &dk)?, ptr("attn", &dv)?]);
    args.extend(attn_tail(a));
    args.push(Arg::I64(!det as i64));
    args.extend([docs_arg(a)?, drop_arg(be, a)]);
    attn_launch(be, &format!("attn_bwd_{s}"), a, args)?;
    if det {
        // One block per (batch, kv head, key row): p and ds of 128 query rows at a time, then the
        // row's dk and dv columns, all in shared memory.
        const ROWS: usize = 128;
        let mut args = inputs;
        args.extend([ptr("attn", &dk)?, ptr("attn", &dv)?]);
        args.extend(attn_tail(a));
        args.extend([docs_arg(a)?, drop_arg(be, a)]);
        let dm = a.dims;
        let shared = (2 * ROWS + 2 * dm.d) * 4;
        be.launch(&format!("attn_bwd_kv_{s}"), (dm.b * dm.hkv * dm.s) as u32, ROWS as u32, shared as u32, &args)?;
    }
    let dt = dout.dtype();
    if dt == DType::F32 {
        return Ok((dq, dk, dv));
    }
    Ok((cast(be, &dq, dt)?, cast(be, &dk, dt)?, cast(be, &dv, dt)?))
}

/// kernels/attention.cu `attn_merge_*`: one 64-thread block per (batch, row, head).
pub fn attention_merge_(be: &B, o: &Tensor, lse: &Tensor, o_part: &Tensor, lse_part: &Tensor) -> Result<()> {
    let d = o.dims();
    let name = format!("attn_merge_{}", sfx("attention_merge_", o_part.dtype())?);
    let args = [
        ptr("attention_merge_", o)?,
        ptr("attention_merge_", lse)?,
        ptr("attention_merge_", o_part)?,
        ptr("attention_merge_", lse_part)?,
        n(d[1]),
        n(d[2]),
        n(d[3]),
    ];
    be.launch(&name, (d[0] * d[1] * d[2]) as u32, 64, 0, &args)
}

/// Rows a block of the sink kernels covers: one warp each.
const SINK_ROWS: usize = 8;

/// kernels/attention.cu `attn_sink_*`: one warp per (batch, row, head).
pub fn attention_sink_(be: &B, o: &Tensor, lse: &Tensor, sink: &Tensor, dims: SinkDims) -> Result<()> {
    const OP: &str = "attention_sink_";
    let (b, t, h, d, nc) = dims;
    let name = format!("attn_sink_{}", sfx(OP, o.dtype())?);
    let args = [ptr(OP, o)?, ptr(OP, lse)?, ptr(OP, sink)?, n(b), n(t), n(h), n(d), n(nc)];
    be.launch(&name, (b * t * h).div_ceil(SINK_ROWS) as u32, 32 * SINK_ROWS as u32, 0, &args)
}

/// kernels/attention.cu `attn_sink_bwd_*`: [B, T, H] f32 terms, one warp per row.
pub fn attention_sink_bwd(
    be: &B,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    sink: &Tensor,
    dims: SinkDims,
) -> Result<Tensor> {
    const OP: &str = "attention_sink_bwd";
    let (b, t, h, d, nc) = dims;
    let term = new(be, [b, t, h], DType::F32)?;
    let name = format!("attn_sink_bwd_{}", sfx(OP, o.dtype())?);
    let args =
        [ptr(OP, o)?, ptr(OP, lse)?, ptr(OP, d_o)?, ptr(OP, sink)?, ptr(OP, &term)?, n(b), n(t), n(h), n(d), n(nc)];
    be.launch(&name, (b * t * h).div_ceil(SINK_ROWS) as u32, 32 * SINK_ROWS as u32, 0, &args)?;
    Ok(term)
}
