//! bf16 GEMMs on cuBLASLt through descriptors of our own, for two things cudarc's `Matmul` does
//! not do: the heuristic's algorithm cached per problem (cudarc asks the heuristic on every call)
//! and the epilogues that fuse the MLP's GeLU into its GEMMs: forward D = gelu(A·B + bias) with
//! the pre-activation kept as the aux output, backward D = (A·B) ∘ gelu'(aux).
//!
//! FP8 operands (`matmul_fp8`: E4M3 or E5M2, each with a device-resident f32 scale_inv read by
//! the GEMM itself, so no host synchronisation) take the same descriptors; cuBLASLt takes them
//! only as TN (A transposed, B not) and never both E5M2.
//!
//! Column-major, as cuBLASLt sees it: D [m, n] (ld ldc) = op(A) [m, k] · op(B) [k, n]; the bias
//! has one value per row of D (per output feature of a linear layer), aux has D's shape (ld m).

use super::{Backend, tune};
use cudarc::cublaslt::sys::{
    self, cublasLtEpilogue_t as Epi, cublasLtMatmulDescAttributes_t as DescAttr,
    cublasLtMatmulPreferenceAttributes_t as PrefAttr, cublasLtMatrixLayoutAttribute_t as LayoutAttr,
};
use cudarc::cublaslt::{MatmulConfig, MatmulShared, result};
use cudarc::driver::{CudaSlice, DevicePtr};
use ferrotron_core::{Error, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// What runs after the product.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Epilogue {
    None,
    Bias(u64),
    /// gelu(A·B + bias) into D, A·B + bias into `aux`.
    GeluAux {
        bias: Option<u64>,
        aux: u64,
    },
    /// (A·B) ∘ gelu'(aux) into D.
    DGelu {
        aux: u64,
    },
}

impl Epilogue {
    fn code(self) -> Epi {
        match self {
            Epilogue::None => Epi::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias(_) => Epi::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAux { bias: Some(_), .. } => Epi::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::GeluAux { bias: None, .. } => Epi::CUBLASLT_EPILOGUE_GELU_AUX,
            Epilogue::DGelu { .. } => Epi::CUBLASLT_EPILOGUE_DGELU,
        }
    }
}

/// The problem an algorithm was chosen for: shapes, layouts, epilogue and the pointers'
/// alignment (the heuristic is told the real alignment, so its choice holds only for it).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Key {
    ta: bool,
    tb: bool,
    m: u64,
    n: u64,
    k: u64,
    lds: [i64; 3],
    batch: i32,
    strides: [i64; 3],
    epilogue: i32,
    align: u32,
    out: Out,
    /// FP8 operand types (A, B; true for E5M2), None for bf16.
    fp8: Option<(bool, bool)>,
    /// Split-K sums in fp32 only (`set_fp32_split_k_sums`).
    fp32_sums: bool,
}

/// The per-device cuBLASLt state: workspace and the algorithm cache.
pub(crate) struct Lt {
    workspace: CudaSlice<u8>,
    /// None: the heuristic found no algorithm (asked once; the caller composes the op instead).
    algos: Mutex<HashMap<Key, Option<sys::cublasLtMatmulAlgo_t>>>,
    /// Choices timed under sustained load in this or an earlier run (`choices`), by problem.
    stored: Mutex<super::choices::Choices>,
}

/// Hopper's recommended cuBLASLt workspace (NVIDIA: 32 MiB on sm_90, 4 MiB before).
const WORKSPACE: usize = 32 << 20;

/// The workspace offered to the heuristic and to each product: all of it, or
/// `FERROTRON_GEMM_WORKSPACE_MB` (at most 32) to measure against: PyTorch offers 1 MiB and gets
/// the same algorithms for the forward products, yet its attention-projection and fc2 products
/// took 7% less time in its step than ours (benches/NOTES.md, session 20); 0 loses the fused dGeLU
/// epilogue (session 21).
fn offered_workspace() -> usize {
    static MB: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MB.get_or_init(|| {
        std::env::var("FERROTRON_GEMM_WORKSPACE_MB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(WORKSPACE, |mb| (mb << 20).min(WORKSPACE))
    })
}

impl Lt {
    pub fn new(stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<Lt> {
        let workspace = stream.alloc_zeros::<u8>(WORKSPACE).map_err(|e| lt_err("workspace", e))?;
        // The stored choices hold for this GPU model and cuBLASLt build only.
        let gpu = stream.context().name().unwrap_or_else(|_| "unknown GPU".into());
        // SAFETY: a plain query of the loaded library's version.
        let version = unsafe { sys::cublasLtGetVersion() };
        let stored =
            super::choices::Choices::load(super::choices::dir().as_deref(), &format!("{gpu} cuBLASLt {version}"));
        Ok(Lt { workspace, algos: Mutex::new(HashMap::new()), stored: Mutex::new(stored) })
    }
}

fn lt_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("cuBLASLt {what}: {e:?}"))
}

/// Largest power of two (up to 256) dividing every address.
fn alignment(ptrs: &[u64]) -> u32 {
    ptrs.iter().filter(|&&p| p != 0).map(|p| 1u32 << p.trailing_zeros().min(8)).min().unwrap_or(256)
}

// RAII guards for the descriptors of one call.
struct Desc(sys::cublasLtMatmulDesc_t);
impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_desc and destroyed once.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}
struct Layout(sys::cublasLtMatrixLayout_t);
impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by create_matrix_layout and destroyed once.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}
struct Pref(sys::cublasLtMatmulPreference_t);
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_pref and destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

fn set_desc<T>(d: &Desc, attr: DescAttr, v: &T) -> Result<()> {
    // SAFETY: `v` is a live value of the attribute's type, read for its size only.
    unsafe { result::set_matmul_desc_attribute(d.0, attr, v as *const T as *const c_void, size_of::<T>()) }
        .map_err(|e| lt_err("matmul descriptor", e))
}

fn layout(ty: sys::cudaDataType_t, rows: u64, cols: u64, ld: i64, batch: i32, stride: i64) -> Result<Layout> {
    let l = Layout(result::create_matrix_layout(ty, rows, cols, ld).map_err(|e| lt_err("layout", e))?);
    if batch > 1 {
        // SAFETY: as set_desc.
        unsafe {
            result::set_matrix_layout_attribute(
                l.0,
                LayoutAttr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                &batch as *const i32 as *const c_void,
                size_of::<i32>(),
            )
            .map_err(|e| lt_err("layout", e))?;
            result::set_matrix_layout_attribute(
                l.0,
                LayoutAttr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                &stride as *const i64 as *const c_void,
                size_of::<i64>(),
            )
            .map_err(|e| lt_err("layout", e))?;
        }
    }
    Ok(l)
}

/// Whether cuBLASLt has no algorithm for a problem (the caller may then compose the op instead).
pub(crate) fn unsupported(e: &Error) -> bool {
    matches!(e, Error::Cuda(m) if m.contains("CUBLAS_STATUS_NOT_SUPPORTED"))
}

/// D = epilogue(op(A)·op(B)) + beta·D on bf16 device addresses `a`, `b`, `d` (fp32 accumulation).
/// `cfg` as cudarc's (its `transc`, `alpha` and `stride_bias` are not used).
///
/// # Safety
/// The addresses must hold the matrices `cfg` describes (and the epilogue's bias [m] / aux [m, n]).
pub(crate) unsafe fn matmul(be: &Backend, cfg: &MatmulConfig, a: u64, b: u64, d: u64, epi: Epilogue) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { run(be, cfg, a, b, d, epi, Out::Bf16) }
}

/// D = op(A)·op(B) + beta·D for bf16 A, B and an fp32 D (the weight gradient into fp32 main_grad).
///
/// # Safety
/// As `matmul`, with D fp32.
pub(crate) unsafe fn matmul_into_f32(be: &Backend, cfg: &MatmulConfig, a: u64, b: u64, d: u64) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { run(be, cfg, a, b, d, Epilogue::None, Out::F32) }
}

/// FP8 operands: each one's type and the device address of its f32 scale_inv (D = A's scale_inv
/// · B's scale_inv · A·B (+ bias) + beta·C).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fp8In {
    pub a_e5m2: bool,
    pub b_e5m2: bool,
    pub a_scale_inv: u64,
    pub b_scale_inv: u64,
}

/// D = op(A)·op(B)·scales (+ bias) + beta·D for FP8 A and B (`cfg.transa` set, `cfg.transb`
/// not) into a bf16 D (`out_f32` false) or an fp32 D (the weight gradient into main_grad).
///
/// # Safety
/// As `matmul`, with A and B one byte an element and the scale addresses each holding one f32.
pub(crate) unsafe fn matmul_fp8(
    be: &Backend,
    cfg: &MatmulConfig,
    (a, b, d): (u64, u64, u64),
    epi: Epilogue,
    fp8: Fp8In,
    out_f32: bool,
) -> Result<()> {
    let out = if out_f32 { Out::F32 } else { Out::Bf16 };
    // SAFETY: the caller's guarantee.
    unsafe { run_typed(be, cfg, a, b, d, epi, out, Some(fp8)) }
}

/// The element type of C and D.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Out {
    Bf16,
    F32,
}

impl Out {
    fn cuda(self) -> sys::cudaDataType_t {
        match self {
            Out::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
            Out::F32 => sys::cudaDataType_t::CUDA_R_32F,
        }
    }
    fn bytes(self) -> usize {
        match self {
            Out::Bf16 => 2,
            Out::F32 => 4,
        }
    }
}

unsafe fn run(be: &Backend, cfg: &MatmulConfig, a: u64, b: u64, d: u64, epi: Epilogue, out: Out) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { run_typed(be, cfg, a, b, d, epi, out, None) }
}

#[allow(clippy::too_many_arguments)]
unsafe fn run_typed(
    be: &Backend,
    cfg: &MatmulConfig,
    a: u64,
    b: u64,
    d: u64,
    epi: Epilogue,
    out: Out,
    fp8: Option<Fp8In>,
) -> Result<()> {
    let (batch, [sa, sb, sc]) = match cfg.batch_size {
        Some(n) if n > 1 => (n, [cfg.stride_a.unwrap_or(0), cfg.stride_b.unwrap_or(0), cfg.stride_c.unwrap_or(0)]),
        _ => (1, [0, 0, 0]),
    };
    let (bias, aux) = match epi {
        Epilogue::None => (0, 0),
        Epilogue::Bias(p) => (p, 0),
        Epilogue::GeluAux { bias, aux } => (bias.unwrap_or(0), aux),
        Epilogue::DGelu { aux } => (0, aux),
    };
    let align = alignment(&[a, b, d, aux]);
    let bf = sys::cudaDataType_t::CUDA_R_16BF;
    let f8 = |e5m2: bool| {
        if e5m2 { sys::cudaDataType_t::CUDA_R_8F_E5M2 } else { sys::cudaDataType_t::CUDA_R_8F_E4M3 }
    };
    let (ta, tb) = fp8.map_or((bf, bf), |f| (f8(f.a_e5m2), f8(f.b_e5m2)));
    let (a_rows, a_cols) = if cfg.transa { (cfg.k, cfg.m) } else { (cfg.m, cfg.k) };
    let (b_rows, b_cols) = if cfg.transb { (cfg.n, cfg.k) } else { (cfg.k, cfg.n) };
    let la = layout(ta, a_rows, a_cols, cfg.lda, batch, sa)?;
    let lb = layout(tb, b_rows, b_cols, cfg.ldb, batch, sb)?;
    let ld = layout(out.cuda(), cfg.m, cfg.n, cfg.ldc, batch, sc)?;
    let desc = Desc(
        result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F)
            .map_err(|e| lt_err("matmul descriptor", e))?,
    );
    set_desc(&desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSA, &(cfg.transa as i32))?;
    set_desc(&desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSB, &(cfg.transb as i32))?;
    set_desc(&desc, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi.code())?;
    if bias != 0 {
        set_desc(&desc, DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
    }
    if let Some(f) = fp8 {
        set_desc(&desc, DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &f.a_scale_inv)?;
        set_desc(&desc, DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &f.b_scale_inv)?;
    }
    if aux != 0 {
        set_desc(&desc, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux)?;
        set_desc(&desc, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &(cfg.m as i64))?;
    }
    let key = Key {
        ta: cfg.transa,
        tb: cfg.transb,
        m: cfg.m,
        n: cfg.n,
        k: cfg.k,
        lds: [cfg.lda, cfg.ldb, cfg.ldc],
        batch,
        strides: [sa, sb, sc],
        epilogue: epi.code() as i32,
        align,
        out,
        fp8: fp8.map(|f| (f.a_e5m2, f.b_e5m2)),
        fp32_sums: super::fp32_split_k_sums(),
    };
    let lt = &be.lt;
    let handle = *be.blas_lt.handle();
    let stream = be.dev.stream();
    let (w, _w) = lt.workspace.device_ptr(stream);
    // One product with `algo` into `dst` (D, or a scratch matrix of D's size while timing).
    let launch = |algo: &sys::cublasLtMatmulAlgo_t, dst: u64| {
        // SAFETY: the caller guarantees the addresses (`dst` is D or as large as D); alpha/beta
        // are f32 as the descriptor's scale type.
        unsafe {
            result::matmul(
                handle,
                desc.0,
                &cfg.alpha as *const f32 as *const c_void,
                &cfg.beta as *const f32 as *const c_void,
                a as *const c_void,
                la.0,
                b as *const c_void,
                lb.0,
                dst as *const c_void,
                ld.0,
                dst as *mut c_void,
                ld.0,
                algo,
                w as *mut c_void,
                offered_workspace(),
                stream.cu_stream() as *mut _,
            )
        }
        .map_err(|e| lt_err("matmul", e))
    };
    let cached = lt.algos.lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied();
    let algo = match cached {
        Some(Some(a)) => a,
        Some(None) => return Err(lt_err("heuristic (cached)", sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)),
        None => {
            let found = candidates(handle, &desc, [&la, &lb, &ld], align, key.fp32_sums);
            // Only candidates whose split-K partial sums add up in fp32 (or that have none) may
            // replace the heuristic's own choice: a bf16 output summed in bf16 differs by several
            // ulps (an op test caught one: −1.789 for −1.75).
            let eligible =
                |i: usize, a: &sys::cublasLtMatmulAlgo_t| i == 0 || matches!(out, Out::F32) || sums_in_fp32(a);
            // A choice timed under load in this or an earlier run (`choices`), where one is stored.
            let stored_as = format!("{key:?}");
            let stored = match &found {
                Ok(v) if v.len() > 1 && !super::deterministic() && !tune::off() => {
                    let i = lt.stored.lock().unwrap_or_else(|e| e.into_inner()).get(&stored_as);
                    i.filter(|&i| i < v.len() && eligible(i, &v[i])).map(|i| v[i])
                }
                _ => None,
            };
            let remember = match &found {
                _ if stored.is_some() => Some(stored),
                Ok(v) if v.is_empty() => Some(None),
                Ok(v) if v.len() > 1 && tune::enabled(matches!(epi, Epilogue::DGelu { .. })) => {
                    let all = v;
                    let v: Vec<_> = v.iter().enumerate().filter(|&(i, a)| eligible(i, a)).map(|(_, a)| *a).collect();
                    // Time the candidates where they cannot disturb D: in D itself when the
                    // product overwrites it (beta 0; the chosen one runs after), else in scratch.
                    let extent = (batch as i64 - 1) * sc + cfg.ldc * cfg.n as i64;
                    let bytes = extent as usize * out.bytes();
                    let scratch = if cfg.beta == 0.0 { None } else { tune::scratch(stream, bytes) };
                    let dst = match &scratch {
                        Some(s) => Some(s.device_ptr(stream).0),
                        None if cfg.beta == 0.0 => Some(d),
                        None => None,
                    };
                    Some(Some(match dst {
                        Some(dst) => {
                            let op = |t: bool| if t { 'T' } else { 'N' };
                            let problem = || {
                                let (m, n, k, b) = (key.m, key.n, key.k, key.batch);
                                let (ta, tb) = (op(key.ta), op(key.tb));
                                format!("{m}×{n}×{k} {ta}{tb} batch {b} epilogue {epi:?} out {out:?}")
                            };
                            let best = tune::fastest(stream, problem, &v, |algo| launch(algo, dst));
                            if tune::hold_ms().is_some()
                                && let Some(i) = all.iter().position(|a| a.data == best.data)
                            {
                                lt.stored.lock().unwrap_or_else(|e| e.into_inner()).put(&stored_as, i);
                            }
                            best
                        }
                        None => v[0],
                    }))
                }
                Ok(v) => Some(Some(v[0])),
                Err(_) => None,
            };
            if let Some(r) = remember {
                lt.algos.lock().unwrap_or_else(|e| e.into_inner()).insert(key, r);
            }
            match (found, remember) {
                (Ok(_), Some(Some(a))) => a,
                (Err(e), _) => return Err(lt_err(&format!("heuristic ({epi:?}, {}×{}×{})", cfg.m, cfg.n, cfg.k), e)),
                _ => {
                    let e = sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED;
                    return Err(lt_err(&format!("heuristic ({epi:?}, {}×{}×{})", cfg.m, cfg.n, cfg.k), e));
                }
            }
        }
    };
    launch(&algo, d)
}

/// Whether an algorithm's split-K partial sums (if it splits K) are added in the compute type:
/// the in-place and output-type reduction schemes add them in the output's type.
fn sums_in_fp32(algo: &sys::cublasLtMatmulAlgo_t) -> bool {
    let get = |attr| {
        let (mut value, mut written) = (0u32, 0usize);
        // SAFETY: `algo` is a live algorithm from the heuristic; both attributes are u32.
        let st = unsafe {
            sys::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                &mut value as *mut u32 as *mut c_void,
                size_of::<u32>(),
                &mut written,
            )
        };
        (st == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(value)
    };
    let splits = get(sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
    let scheme = get(sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
    let compute = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
    matches!(splits, Some(0 | 1)) || scheme == Some(compute)
}

/// Up to `tune::candidates()` algorithms from the heuristic, best first, for pointers of `align`
/// bytes' alignment and our workspace; with `fp32_sums`, only those that add split-K partial sums
/// in the compute type (or split nothing).
fn candidates(
    handle: sys::cublasLtHandle_t,
    desc: &Desc,
    [la, lb, ld]: [&Layout; 3],
    align: u32,
    fp32_sums: bool,
) -> std::result::Result<Vec<sys::cublasLtMatmulAlgo_t>, cudarc::cublaslt::result::CublasError> {
    let pref = Pref(result::create_matmul_pref()?);
    let workspace = offered_workspace();
    // SAFETY: each attribute is given a live value of its type.
    unsafe {
        result::set_matmul_pref_attribute(
            pref.0,
            PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &workspace as *const usize as *const c_void,
            size_of::<usize>(),
        )?;
        if fp32_sums {
            let none = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
            let mask = none | sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
            result::set_matmul_pref_attribute(
                pref.0,
                PrefAttr::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                &mask as *const u32 as *const c_void,
                size_of::<u32>(),
            )?;
        }
        for attr in [
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ] {
            result::set_matmul_pref_attribute(pref.0, attr, &align as *const u32 as *const c_void, size_of::<u32>())?;
        }
    }
    // SAFETY: a plain C struct of integers and an opaque array, for cuBLASLt to fill.
    let n = tune::candidates();
    let mut found: Vec<sys::cublasLtMatmulHeuristicResult_t> = (0..n).map(|_| unsafe { std::mem::zeroed() }).collect();
    let mut count = 0i32;
    // SAFETY: every descriptor is live for the call; `found` holds n results.
    unsafe {
        sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc.0,
            la.0,
            lb.0,
            ld.0,
            ld.0,
            pref.0,
            n as i32,
            found.as_mut_ptr(),
            &mut count,
        )
        .result()?;
    }
    let ok = sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS;
    Ok(found[..count.max(0) as usize].iter().filter(|h| h.state == ok).map(|h| h.algo).collect())
}
