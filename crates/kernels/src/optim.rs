//! In-place optimizer ops over flat fp32 buffers: AdamW, squared norms and scaling.

use crate::{check, cpu};
use ferrotron_core::{DType, Device, Result, Tensor, invalid};

pub use crate::cpu::optim::{AdamW, Sgd};

/// One AdamW step on param/m/v (f32, updated in place) from grad (f32), all the same shape.
pub fn adamw_step(param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor, h: &AdamW) -> Result<()> {
    const OP: &str = "adamw_step";
    for t in [param, grad, m, v] {
        check::dtype(OP, t, DType::F32)?;
        check::shape(OP, t, param.dims())?;
    }
    if h.step == 0 {
        return Err(invalid(OP, "step counts from 1"));
    }
    if !distinct(&[param, grad, m, v]) {
        return Err(invalid(OP, "param, grad, m and v must be distinct buffers"));
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[param, grad, m, v])? {
        return crate::cuda::ops::adamw(&g, param, grad, m, v, h);
    }
    check::on_cpu(OP, &[param, grad, m, v])?;
    let g = grad.read_f32()?;
    param.update_f32(OP, |p| {
        m.update_f32(OP, |mm| v.update_f32(OP, |vv| cpu::optim::adamw_step(p, &g, mm, vv, h)))
    })???;
    Ok(())
}

/// One run of a flat buffer for [`adamw_runs`]: `len` elements at `flat` in the gradient and
/// parameter buffers and at `state` in the master weights and moments, with weight decay or not,
/// at the main learning rate or the decoupled one (the embedding and output layer's,
/// `adam_state::LR_DECOUPLED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdamRun {
    pub flat: usize,
    pub state: usize,
    pub len: usize,
    pub decay: bool,
    pub decoupled: bool,
}

/// An optimizer's runs, built once: on a GPU also as a table on the device (eight u32 per run,
/// kernels/optim.cu; the flags word: 1 weight decay, 2 the decoupled rate), so a step uploads
/// nothing (a copy from pageable memory would wait for the stream).
pub struct AdamRuns {
    runs: Vec<AdamRun>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    table: Option<Tensor>,
    /// Blocks of the GPU launch: ADAM_CHUNK-element chunks over all runs.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    chunks: usize,
}

/// Elements per block of the GPU update (`ADAM_CHUNK` in kernels/optim.cu).
const ADAM_CHUNK: usize = 2048;

impl AdamRuns {
    pub fn new(runs: Vec<AdamRun>, device: &Device) -> Result<Self> {
        let chunks: usize = runs.iter().map(|r| r.len.div_ceil(ADAM_CHUNK)).sum();
        if chunks > i32::MAX as usize {
            return Err(invalid(
                "adamw_runs",
                format!("{chunks} chunks of {ADAM_CHUNK} elements: more than one launch's grid (2^31 − 1 blocks)"),
            ));
        }
        let table = if runs.is_empty() || matches!(device, Device::Cpu) {
            None
        } else {
            let lohi = |x: usize| [x as u32, (x as u64 >> 32) as u32];
            let mut first = 0u32;
            let mut words = Vec::with_capacity(8 * runs.len());
            for r in &runs {
                let ([f0, f1], [s0, s1], [l0, l1]) = (lohi(r.flat), lohi(r.state), lohi(r.len));
                let flags = r.decay as u32 | (r.decoupled as u32) << 1;
                words.extend([f0, f1, s0, s1, l0, l1, flags, first]);
                first += r.len.div_ceil(ADAM_CHUNK) as u32;
            }
            let n = words.len();
            Some(Tensor::from_vec(words, [n], device)?)
        };
        Ok(AdamRuns { runs, table, chunks })
    }
}

/// AdamW over every run (one launch on a GPU), each updated master weight also rounded into
/// `params` at the run's flat offset: the same bits as [`adamw_step`] per run (`h.weight_decay`
/// where the run has `decay`, else none) followed by [`copy_`](crate::copy_) of the master weights
/// into the parameters. master is f32; exp_avg and exp_avg_sq f32 or bf16 each (Megatron's
/// precision-aware optimizer: a bf16 moment is widened, moved on and used in f32, then stored
/// rounded to nearest even); grads f32 or bf16 (a bf16 main_grad, widened exactly); params any
/// float type.
/// With `state` (an [`adam_state`] tensor that [`adam_prepare`] settled, on the same device) the
/// learning rates (a `decoupled` run's its own), weight decay, clip factor, step count and
/// whether to update at all come from it instead of `h`, so the host need not read anything back
/// first; without one every run steps at `h.lr`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_runs(
    master: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    grads: &Tensor,
    params: &Tensor,
    runs: &AdamRuns,
    h: &AdamW,
    state: Option<&Tensor>,
) -> Result<()> {
    const OP: &str = "adamw_runs";
    if h.step == 0 && state.is_none() {
        return Err(invalid(OP, "step counts from 1"));
    }
    let all = [master, exp_avg, exp_avg_sq, grads, params];
    if !check_runs(OP, &all, 2, runs, state)? {
        return Ok(());
    }
    // The state on the parameters' device (every tensor's device checked at once).
    let every: Vec<&Tensor> = all.iter().copied().chain(state).collect();
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &every)? {
        let table = runs.table.as_ref().ok_or_else(|| invalid(OP, "the runs were built for the CPU"))?;
        let x = crate::cuda::ops::AdamTensors { p: master, m: exp_avg, v: exp_avg_sq, g: grads, params, state };
        return crate::cuda::ops::adamw_runs(&g, &x, table, runs.chunks, h);
    }
    check::on_cpu(OP, &every)?;
    // (the step, the decoupled runs' learning rate)
    let (h, lr_decoupled) = match state.map(host_step).transpose()? {
        Some(None) => return Ok(()),
        Some(Some(s)) => {
            (AdamW { grad_scale: s.grad_scale, step: s.steps, lr: s.lr, weight_decay: s.wd, ..*h }, s.lr_decoupled)
        }
        None => (*h, h.lr),
    };
    for r in &runs.runs {
        let wd = if r.decay { h.weight_decay } else { 0.0 };
        let lr = if r.decoupled { lr_decoupled } else { h.lr };
        let (p, m, v) =
            (master.view(r.state, [r.len])?, exp_avg.view(r.state, [r.len])?, exp_avg_sq.view(r.state, [r.len])?);
        // A bf16 main_grad or moment widened first (exactly): adamw_step takes f32.
        let wide = |t: Tensor| if t.dtype() == DType::F32 { Ok(t) } else { crate::cast(&t, DType::F32) };
        let g = wide(grads.view(r.flat, [r.len])?)?;
        let (mw, vw) = (wide(m.clone())?, wide(v.clone())?);
        adamw_step(&p, &g, &mw, &vw, &AdamW { weight_decay: wd, lr, ..h })?;
        // The moments rounded back where they are bf16 (no-op views where they are f32).
        for (narrow, w) in [(&m, &mw), (&v, &vw)] {
            if !narrow.shares_storage(w) {
                crate::copy_(narrow, w)?;
            }
        }
        crate::copy_(&params.view(r.flat, [r.len])?, &p)?;
    }
    Ok(())
}

/// SGD with momentum (`Sgd`, `cpu::optim::sgd_step`'s rule) over the runs of one flat buffer:
/// `master` and `momentum` (f32, the state's layout) updated in place from `grads` (f32, or bf16
/// widened), each new master weight written into `params` (rounded to their dtype). With a step
/// `state` (`adam_prepare`'s), its clip factor, learning rates (a `decoupled` run's its own),
/// weight decay and skip flag replace `h`'s.
pub fn sgd_runs(
    master: &Tensor,
    momentum: &Tensor,
    grads: &Tensor,
    params: &Tensor,
    runs: &AdamRuns,
    h: &Sgd,
    state: Option<&Tensor>,
) -> Result<()> {
    const OP: &str = "sgd_runs";
    let all = [master, momentum, grads, params];
    if !check_runs(OP, &all, 0, runs, state)? {
        return Ok(());
    }
    let every: Vec<&Tensor> = all.iter().copied().chain(state).collect();
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &every)? {
        let table = runs.table.as_ref().ok_or_else(|| invalid(OP, "the runs were built for the CPU"))?;
        let x = crate::cuda::ops::SgdTensors { p: master, buf: momentum, g: grads, params, state };
        return crate::cuda::ops::sgd_runs(&g, &x, table, runs.chunks, h);
    }
    check::on_cpu(OP, &every)?;
    let (h, lr_decoupled) = match state.map(host_step).transpose()? {
        Some(None) => return Ok(()),
        Some(Some(s)) => (Sgd { grad_scale: s.grad_scale, lr: s.lr, weight_decay: s.wd, ..*h }, s.lr_decoupled),
        None => (*h, h.lr),
    };
    for r in &runs.runs {
        let one = Sgd {
            weight_decay: if r.decay { h.weight_decay } else { 0.0 },
            lr: if r.decoupled { lr_decoupled } else { h.lr },
            ..h
        };
        let (p, b) = (master.view(r.state, [r.len])?, momentum.view(r.state, [r.len])?);
        let g = grads.view(r.flat, [r.len])?;
        let g = if g.dtype() == DType::F32 { g } else { crate::cast(&g, DType::F32)? };
        let gv = g.read_f32()?;
        p.update_f32(OP, |pv| b.update_f32(OP, |bv| cpu::optim::sgd_step(pv, &gv, bv, &one)))??;
        crate::copy_(&params.view(r.flat, [r.len])?, &p)?;
    }
    Ok(())
}

/// The checks both run updates make: `bufs` = the state buffers (the f32 master weights, then
/// the moments: the first `moments` of them f32 or bf16, any others f32), then the gradients (f32
/// or bf16) and the parameters; the state, distinct storage, every run inside the flat buffer and
/// the state. False: no run, nothing to do.
fn check_runs(
    op: &'static str,
    bufs: &[&Tensor],
    moments: usize,
    runs: &AdamRuns,
    state: Option<&Tensor>,
) -> Result<bool> {
    let [state_bufs @ .., grads, params] = bufs else { return Err(invalid(op, "no buffers")) };
    for (i, t) in state_bufs.iter().enumerate() {
        // The master weights are f32; the moments (AdamW's, `moments` of them) f32 or bf16.
        if i == 0 || i > moments || t.dtype() != DType::BF16 {
            check::dtype(op, t, DType::F32)?;
        }
        check::shape(op, t, state_bufs[0].dims())?;
    }
    if grads.dtype() != DType::BF16 {
        check::dtype(op, grads, DType::F32)?;
    }
    if let Some(st) = state {
        check::dtype(op, st, DType::F32)?;
        check::shape(op, st, &[adam_state::LEN])?;
    }
    check::float(op, params)?;
    check::shape(op, params, grads.dims())?;
    if !distinct(bufs) {
        return Err(invalid(op, "the state buffers, the gradients and the parameters must be distinct buffers"));
    }
    let (flat_len, state_len) = (grads.elem_count(), state_bufs.first().map_or(0, |t| t.elem_count()));
    if let Some(r) = runs.runs.iter().find(|r| r.flat + r.len > flat_len || r.state + r.len > state_len) {
        return Err(invalid(
            op,
            format!("run {r:?} reaches past the flat buffer ({flat_len}) or the state ({state_len})"),
        ));
    }
    Ok(!runs.runs.is_empty())
}

/// The step state's values a CPU update reads (`adam_state`).
struct HostStep {
    grad_scale: f32,
    steps: u64,
    lr: f32,
    wd: f32,
    lr_decoupled: f32,
}

/// `state`'s step, or None where it is skipped (a non-finite gradient norm).
fn host_step(state: &Tensor) -> Result<Option<HostStep>> {
    let s = state.read_f32()?;
    Ok((s[adam_state::APPLIED] != 0.0).then(|| HostStep {
        grad_scale: s[adam_state::GRAD_SCALE],
        steps: s[adam_state::STEPS] as u64,
        lr: s[adam_state::LR],
        wd: s[adam_state::WD],
        lr_decoupled: s[adam_state::LR_DECOUPLED],
    }))
}

/// Whether no two of `ts` share storage (the in-place updates read and write each once).
fn distinct(ts: &[&Tensor]) -> bool {
    ts.iter().enumerate().all(|(i, a)| ts[i + 1..].iter().all(|b| !a.shares_storage(b)))
}

/// Σ x² in f64 (deterministic order).
pub fn sum_sq(x: &Tensor) -> Result<f64> {
    sum_sq_all(&[x])
}

/// Σ over tensors of Σ x², tensor by tensor in order (the same bits as adding their `sum_sq`s),
/// with one read back from the device for all of them.
pub fn sum_sq_all(ts: &[&Tensor]) -> Result<f64> {
    const OP: &str = "sum_sq_all";
    for t in ts {
        check::float(OP, t)?;
    }
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, ts)? {
        return crate::cuda::ops::sum_sq_all(&g, ts);
    }
    check::on_cpu(OP, ts)?;
    let mut total = 0.0;
    for t in ts {
        total += cpu::optim::sum_sq(&t.read_f32()?);
    }
    Ok(total)
}

/// √(Σ over tensors of Σ x²), the global L2 norm used for gradient clipping.
pub fn global_l2_norm(ts: &[&Tensor]) -> Result<f64> {
    Ok(sum_sq_all(ts)?.sqrt())
}

/// The slots of an optimizer's step state: an f32 tensor of `LEN` elements on the parameters'
/// device that [`adam_prepare`] writes and [`adamw_runs`] reads, so a training step queues its
/// update without reading the gradient norm back (kernels/optim.cu `ADAM_*`).
pub mod adam_state {
    /// The clip factor applied to the gradients.
    pub const GRAD_SCALE: usize = 0;
    /// The global gradient L2 norm (before clipping).
    pub const GRAD_NORM: usize = 1;
    /// 1 when the update applies, 0 when the norm was not finite (the step is skipped).
    pub const APPLIED: usize = 2;
    /// lr / (1 − β1ᵗ) for the step count t below.
    pub const STEP_SIZE: usize = 3;
    /// √(1 − β2ᵗ).
    pub const BC2_SQRT: usize = 4;
    /// Updates applied so far (an integer, exact in f32 up to 2²⁴ steps).
    pub const STEPS: usize = 5;
    /// This step's learning rate: written by the host before the step is queued, so a replayed
    /// CUDA graph of the step reads each step's own.
    pub const LR: usize = 6;
    /// This step's weight decay, written with the learning rate (Megatron's
    /// --weight-decay-incr-style moves it over the run).
    pub const WD: usize = 7;
    /// This step's learning rate of the decoupled runs (the embedding and output layer under
    /// --decoupled-lr; the main rate without it), written with the other two.
    pub const LR_DECOUPLED: usize = 8;
    /// 1 − lr·weight_decay, the factor decayed weights are multiplied by.
    pub const DECAY: usize = 9;
    /// `STEP_SIZE` and `DECAY` at the decoupled learning rate.
    pub const STEP_SIZE_DECOUPLED: usize = 10;
    pub const DECAY_DECOUPLED: usize = 11;
    pub const LEN: usize = 12;
}

/// What [`adam_prepare`] needs besides Σ g² and the learning rate and weight decay in the state:
/// the betas and the clip threshold (0: no clipping).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamPrep {
    pub beta1: f32,
    pub beta2: f32,
    pub clip_grad: f32,
}

/// Σ over tensors of Σ x² as a one-element f32 tensor on `device` (their device), without reading
/// anything back: on a GPU fixed per-block partials then one block adding them in a fixed order,
/// on the CPU [`sum_sq_all`]. Either way the same bits every run.
pub fn sum_sq_dev(ts: &[&Tensor], device: &Device) -> Result<Tensor> {
    on_device("sum_sq_dev", ts, device, Reduce::SumSq)
}

/// How many elements of `ts` are zero (±0; NaN is not), as a one-element f32 tensor on `device`
/// (their device), without reading anything back: counted exactly per block in f64 on a GPU
/// (`sum_sq_dev`'s partials), rounded to f32 once at the end (exact below 2²⁴, within 2⁻²⁴
/// relative above). Megatron's --log-num-zeros-in-grad counts in f32 too.
pub fn count_zeros_dev(ts: &[&Tensor], device: &Device) -> Result<Tensor> {
    on_device("count_zeros_dev", ts, device, Reduce::Zeros)
}

/// What `on_device` reduces every element of the tensors to.
#[derive(Clone, Copy)]
enum Reduce {
    SumSq,
    Zeros,
}

/// `what` over every tensor (float, all on `device`) as a one-element f32 tensor on `device`.
fn on_device(op: &'static str, ts: &[&Tensor], device: &Device, what: Reduce) -> Result<Tensor> {
    for t in ts {
        check::float(op, t)?;
        if t.device().name() != device.name() {
            return Err(invalid(op, "every tensor must be on the given device"));
        }
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let g = crate::cuda::backend(d)?;
        return match what {
            Reduce::SumSq => crate::cuda::ops::sum_sq_dev(&g, ts),
            Reduce::Zeros => crate::cuda::ops::count_zeros_dev(&g, ts),
        };
    }
    let v = match what {
        Reduce::SumSq => sum_sq_all(ts)?,
        Reduce::Zeros => {
            let mut n = 0;
            for t in ts {
                n += cpu::optim::count_zeros(&t.read_f32()?);
            }
            n as f64
        }
    };
    Tensor::from_vec(vec![v as f32], [1], device)
}

/// Settles one step in `state` (an [`adam_state`] tensor whose `LR`, `WD` and `LR_DECOUPLED`
/// slots hold this step's learning rates and weight decay) from `sq` = Σ g² (one f32, summed
/// across ranks, on the same device): the norm √sq, the clip factor clip / (norm + 10⁻⁶) when the
/// norm exceeds a positive `clip_grad` (else 1), whether the update applies (a finite norm), the
/// step count moved on when it does, the bias corrections for that count and the decay factors
/// (each learning rate's step size and decay). Queued work only on a GPU (one thread).
pub fn adam_prepare(sq: &Tensor, state: &Tensor, p: &AdamPrep) -> Result<()> {
    const OP: &str = "adam_prepare";
    check::dtype(OP, sq, DType::F32)?;
    check::shape(OP, sq, &[1])?;
    check::dtype(OP, state, DType::F32)?;
    check::shape(OP, state, &[adam_state::LEN])?;
    #[cfg(feature = "cuda")]
    if let Some(g) = crate::cuda::gpu(OP, &[sq, state])? {
        return crate::cuda::ops::adam_prepare(&g, sq, state, p);
    }
    check::on_cpu(OP, &[sq, state])?;
    let norm = (sq.read_f32()?[0] as f64).sqrt();
    state.update_f32(OP, |s| settle(s, norm, p))?;
    Ok(())
}

/// `adam_prepare`'s arithmetic on the CPU (kernels/optim.cu `adam_prepare` on a GPU).
fn settle(s: &mut [f32], norm: f64, p: &AdamPrep) {
    use adam_state::*;
    let ok = norm.is_finite();
    let t = s[STEPS] as f64 + if ok { 1.0 } else { 0.0 };
    s[GRAD_NORM] = norm as f32;
    s[GRAD_SCALE] =
        if p.clip_grad > 0.0 && norm > p.clip_grad as f64 { (p.clip_grad as f64 / (norm + 1e-6)) as f32 } else { 1.0 };
    s[APPLIED] = if ok { 1.0 } else { 0.0 };
    s[STEPS] = t as f32;
    let bc1 = 1.0 - (p.beta1 as f64).powf(t);
    s[STEP_SIZE] = (s[LR] as f64 / bc1) as f32;
    s[STEP_SIZE_DECOUPLED] = (s[LR_DECOUPLED] as f64 / bc1) as f32;
    s[BC2_SQRT] = (1.0 - (p.beta2 as f64).powf(t)).sqrt() as f32;
    s[DECAY] = 1.0 - s[LR] * s[WD];
    s[DECAY_DECOUPLED] = 1.0 - s[LR_DECOUPLED] * s[WD];
}
