//! Column- and row-parallel linear layers, y = x·Wᵀ + b with W [out, in] split across the
//! tensor-parallel group.
//!
//! Column: W split along out (dim 0); input replicated (or gathered along T under sequence
//! parallelism); output split along features unless `gather_output`.
//! Row: W split along in (dim 1); input split along features (`input_is_parallel`, else sliced
//! here); partial outputs summed (or reduce-scattered along T); the bias is added once, after.
//!
//! Backward follows the region mappings of `tp`: dx = dy·W, then the entry's backward; parameter
//! grads are added (`+=`) into main_grad from the whole (gathered) activations.
//!
//! With an FP8 format (`fp8`, Megatron's --fp8-format) each rank's products run in FP8 with
//! per-tensor scales (`k::fp8_linear_fwd` / `k::fp8_linear_bwd`): the forward keeps the FP8 xᵀ
//! instead of x, and the GeLU stays out of the products' epilogues. Tensorwise scales are per
//! rank, of the tensors each rank multiplies (Transformer Engine's current scaling without an
//! amax reduction), so a split layer quantizes its weight shards and row-parallel inputs apart;
//! delayed scales come from the layer's slot (`Fp8Linear::slot`), whose amaxes the trainer
//! reduces over the ranks, so every rank quantizes by the whole tensor's.

use crate::tp::TensorParallel;
use ferrotron_core::{
    Blocks, Cx, Fp8Linear, Init, MetaTensors, Module, ParamId, ParamMeta, ParamTableBuilder, Result, Saved, Shard,
    Tensor, invalid,
};
use ferrotron_kernels::{self as k, Fp8, Fp8Act, Fp8Copies, Fp8Scaling};

fn saved_one<'a>(op: &'static str, s: &'a Saved) -> Result<&'a Tensor> {
    s.tensors.first().ok_or_else(|| invalid(op, "nothing saved by forward"))
}

/// dW += dyᵀ·x, db += Σ dy over rows (or = where the step reaches them first: `grad_acc`).
fn param_grads(cx: &Cx, w: ParamId, b: Option<ParamId>, x: &Tensor, dy: &Tensor) -> Result<()> {
    let (out, inp) = (dy.shape().last(), x.shape().last());
    let rows = dy.elem_count() / out.max(1);
    let (dw, acc) = cx.params.grad_acc(w)?;
    k::matmul_into(&dw, &dy.reshape([rows, out])?, &x.reshape([rows, inp])?, true, false, acc)?;
    if let Some(b) = b {
        let (db, acc) = cx.params.grad_acc(b)?;
        k::bias_grad_into(&db, dy, acc)?;
    }
    Ok(())
}

/// Delayed scaling's handles of slot `i`'s forward operands (x, w): the scales from `scales`
/// (the state's, or a recompute's replayed copy), the amax slots where the pass records.
fn forward_slots(t: &MetaTensors, scales: &Tensor, i: usize, record: bool) -> Result<[(Tensor, Option<Tensor>); 2]> {
    let at = |v: &Tensor, j: usize| v.view(j, [1]);
    let amax = |j: usize| record.then(|| at(&t.fwd_history, j)).transpose();
    Ok([(at(scales, 2 * i)?, amax(2 * i)?), (at(scales, 2 * i + 1)?, amax(2 * i + 1)?)])
}

fn by((scale, amax): &(Tensor, Option<Tensor>)) -> Fp8Scaling<'_> {
    Fp8Scaling { scale, amax: amax.as_ref() }
}

/// y = x·wᵀ (+ bias where given) on this rank, in FP8 where `fp8`, and what the backward keeps
/// (x, or the FP8 xᵀ and, under delayed scaling, the scale w was quantized by; none of it in an
/// evaluation's FP8 forward). Under delayed scaling a training forward records x's and w's
/// amaxes in their slots, and a recomputed one (`Cx::fp8_replay`) quantizes by the scales its
/// first run used and records nothing. Also ferrotron-transformer's replicated `Linear` in FP8.
pub fn product(
    cx: &Cx,
    w: ParamId,
    bias: Option<ParamId>,
    x: &Tensor,
    fp8: Option<&Fp8Linear>,
) -> Result<(Tensor, Saved)> {
    let w = cx.params.param(w)?;
    let b = bias.map(|b| cx.params.param(b)).transpose()?;
    if let Some(f) = fp8 {
        return fp8_product(cx, &w, b.as_ref(), x, f);
    }
    let y = match b {
        Some(b) => k::matmul_bias(x, &w, &b, false, true)?,
        None => k::matmul(x, &w, false, true)?,
    };
    Ok((y, Saved::new(vec![x.clone()], vec![])))
}

/// `product`'s FP8 half on a weight given as a tensor (a view of part of a parameter: Mamba's
/// in_proj blocks, each its own FP8 layer).
pub fn fp8_product(cx: &Cx, w: &Tensor, b: Option<&Tensor>, x: &Tensor, f: &Fp8Linear) -> Result<(Tensor, Saved)> {
    fp8_product_of(cx, w, b, x, f, None)
}

/// `fp8_product` of x, or of act(x) (`act`: x is the activation's input; `k::fp8_linear_fwd_after`).
fn fp8_product_of(
    cx: &Cx,
    w: &Tensor,
    b: Option<&Tensor>,
    x: &Tensor,
    f: &Fp8Linear,
    act: Option<Fp8Act>,
) -> Result<(Tensor, Saved)> {
    let fwd = |x: &Tensor, w: &Tensor, b, format, training, delayed| match act {
        Some(a) => k::fp8_linear_fwd_after(a, x, w, b, format, training, delayed),
        None => k::fp8_linear_fwd(x, w, b, format, training, delayed),
    };
    // An evaluation's forward writes no transposed copy: nothing runs backward.
    let (y, xt, used) = match &f.slot {
        None => fwd(x, w, b, f.format, cx.training, None)?,
        Some(slot) => {
            let t = slot.metas.tensors()?;
            let scales = cx.fp8_replay.unwrap_or(&t.fwd_scale);
            let record = cx.training && cx.fp8_replay.is_none();
            let [sx, sw] = forward_slots(&t, scales, slot.index, record)?;
            fwd(x, w, b, f.format, cx.training, Some([by(&sx), by(&sw)]))?
        }
    };
    // [xᵀ, its scale_inv] and under delayed scaling [the scale of w, the scale of x].
    let used = used.map(|[x, w]| vec![w, x]).unwrap_or_default();
    let kept = xt.map_or_else(Vec::new, |t| [vec![t.data, t.scale_inv], used].concat());
    Ok((y, Saved::new(kept, vec![])))
}

/// `fp8_product`'s backward: dx, and the weight gradient into `dw` (a main_grad or a view of
/// one) added or stored as `acc` says.
pub fn fp8_product_bwd(
    op: &'static str,
    w: &Tensor,
    dw: (&Tensor, bool),
    saved: &Saved,
    dy: &Tensor,
    f: &Fp8Linear,
) -> Result<Tensor> {
    fp8_product_bwd_of(op, w, dw, saved, dy, f, None)
}

/// `fp8_product_bwd` of dy, or (`dgelu`: h, this layer's output, and its bias gradient's
/// destination) of dy = gelu_bwd(h, da) for da given as dy, with the bias gradient summed from
/// it (`k::fp8_linear_bwd_dgelu`).
fn fp8_product_bwd_of(
    op: &'static str,
    w: &Tensor,
    (dw, acc): (&Tensor, bool),
    saved: &Saved,
    dy: &Tensor,
    f: &Fp8Linear,
    dgelu: Option<(&Tensor, Option<(&Tensor, bool)>)>,
) -> Result<Tensor> {
    let xt = xt_of(op, saved)?;
    let bwd = |delayed| match dgelu {
        Some((h, bias)) => k::fp8_linear_bwd_dgelu(dy, h, bias, w, &xt, (dw, acc), f.format, delayed),
        None => k::fp8_linear_bwd(dy, w, &xt, (dw, acc), f.format, delayed),
    };
    match (&f.slot, saved.tensors.as_slice()) {
        (Some(slot), [_, _, w_scale, _]) => {
            let t = slot.metas.tensors()?;
            let (s, a) = (t.bwd_scale.view(slot.index, [1])?, t.bwd_history.view(slot.index, [1])?);
            bwd(Some((Fp8Scaling { scale: &s, amax: Some(&a) }, w_scale)))
        }
        (None, [_, _]) => bwd(None),
        _ => Err(invalid(op, "the forward saved no FP8 input")),
    }
}

/// The forward's FP8 xᵀ from what it saved (and, under delayed scaling, the scales after it).
fn xt_of(op: &'static str, saved: &Saved) -> Result<Fp8> {
    match saved.tensors.as_slice() {
        [data, scale_inv] | [data, scale_inv, _, _] => Ok(Fp8 { data: data.clone(), scale_inv: scale_inv.clone() }),
        _ => Err(invalid(op, "the forward saved no FP8 input")),
    }
}

/// `product`'s backward: dx = dy·w, with `param_grads`. Under delayed scaling dy is quantized by
/// its slot's scale and its amax recorded.
pub fn product_bwd(
    op: &'static str,
    cx: &Cx,
    (w, b): (ParamId, Option<ParamId>),
    saved: &Saved,
    dy: &Tensor,
    fp8: Option<&Fp8Linear>,
) -> Result<Tensor> {
    let Some(f) = fp8 else {
        param_grads(cx, w, b, saved_one(op, saved)?, dy)?;
        return k::matmul(dy, &cx.params.param(w)?, false, false);
    };
    let (dw, acc) = cx.params.grad_acc(w)?;
    let dx = fp8_product_bwd(op, &cx.params.param(w)?, (&dw, acc), saved, dy, f)?;
    if let Some(b) = b {
        let (db, acc) = cx.params.grad_acc(b)?;
        k::bias_grad_into(&db, dy, acc)?;
    }
    Ok(dx)
}

#[derive(Debug, Clone)]
pub struct ColumnParallelLinear {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    pub in_features: usize,
    /// Whole output width (all ranks).
    pub out_features: usize,
    pub gather_output: bool,
    pub tp: TensorParallel,
    /// The products in FP8 (module header).
    pub fp8: Option<Fp8Linear>,
}

impl ColumnParallelLinear {
    /// `blocks` > 1 when the output is several equal blocks each split separately (SwiGLU's
    /// gate|value: 2), so that every rank holds its part of each block.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        std: f32,
        tp: &TensorParallel,
        blocks: usize,
    ) -> Result<Self> {
        let shard = Shard { rank: tp.rank(), size: tp.size(), blocks: Blocks::Equal(blocks) };
        let weight = p.add(ParamMeta::split(
            format!("{prefix}.weight"),
            [out_features, in_features],
            0,
            shard,
            Init::Normal { std },
            true,
        )?)?;
        let bias = if bias {
            Some(p.add(ParamMeta::split(format!("{prefix}.bias"), [out_features], 0, shard, Init::Zeros, false)?)?)
        } else {
            None
        };
        Ok(ColumnParallelLinear {
            weight,
            bias,
            in_features,
            out_features,
            gather_output: false,
            tp: tp.clone(),
            fp8: None,
        })
    }

    pub fn with_gather_output(mut self, yes: bool) -> Self {
        self.gather_output = yes;
        self
    }

    /// `forward` then GeLU: (gelu(y), y, saved), with the GeLU in the GEMM's epilogue where the
    /// device has one (`k::linear_gelu`). `backward` takes the saved values as from `forward`.
    pub fn forward_gelu(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Tensor, Saved)> {
        if self.gather_output || self.fp8.is_some() {
            let (y, s) = self.forward(cx, x)?;
            return Ok((k::gelu(&y)?, y, s));
        }
        let x = self.tp.enter(x)?;
        let b = self.bias.map(|b| cx.params.param(b)).transpose()?;
        let (a, y) = k::linear_gelu(&x, &cx.params.param(self.weight)?, b.as_ref())?;
        Ok((a, y, Saved::new(vec![x], vec![])))
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let x = self.tp.enter(x)?;
        let (y, saved) = product(cx, self.weight, self.bias, &x, self.fp8.as_ref())?;
        let y = if self.gather_output { self.tp.gather_last(&y)? } else { y };
        Ok((y, saved))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_with(cx, saved, dy, self.bias)
    }
}

impl ColumnParallelLinear {
    /// `backward` for a caller whose own kernel already summed dy into the bias gradient (the
    /// flash backward writing dQKV: `k::attention_bwd_qkv_into`); the weight's gradient and dx as
    /// `backward`. Only where dy is this rank's output as is (no `gather_output`).
    pub fn backward_bias_summed(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        if self.gather_output {
            return Err(invalid("ColumnParallelLinear::backward_bias_summed", "the output is gathered: use backward"));
        }
        self.backward_with(cx, saved, dy, None)
    }

    /// `backward(gelu_bwd(h, da))` for h this layer's output and da the gradient of gelu(h). In
    /// FP8 the gradient's cast forms gelu_bwd(h, da) and sums the bias gradient from it
    /// (`k::fp8_linear_bwd_dgelu`), so it is never written; otherwise `gelu_bwd` runs first.
    pub fn backward_after_gelu(&self, cx: &Cx, saved: Saved, da: &Tensor, h: &Tensor) -> Result<Tensor> {
        let Some(f) = self.fp8.as_ref().filter(|_| !self.gather_output) else {
            return self.backward(cx, saved, &k::gelu_bwd(h, da)?);
        };
        let op = "ColumnParallelLinear::backward_after_gelu";
        let (dw, acc) = cx.params.grad_acc(self.weight)?;
        let db = self.bias.map(|b| cx.params.grad_acc(b)).transpose()?;
        let bias = db.as_ref().map(|(db, acc)| (db, *acc));
        let dx = fp8_product_bwd_of(op, &cx.params.param(self.weight)?, (&dw, acc), &saved, da, f, Some((h, bias)))?;
        self.tp.enter_bwd(&dx)
    }

    fn backward_with(&self, cx: &Cx, saved: Saved, dy: &Tensor, bias: Option<ParamId>) -> Result<Tensor> {
        let dy = if self.gather_output { self.tp.split_last(dy)? } else { dy.clone() };
        let op = "ColumnParallelLinear::backward";
        let dx = product_bwd(op, cx, (self.weight, bias), &saved, &dy, self.fp8.as_ref())?;
        self.tp.enter_bwd(&dx)
    }
}

#[derive(Debug, Clone)]
pub struct RowParallelLinear {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    /// Whole input width (all ranks).
    pub in_features: usize,
    pub out_features: usize,
    pub input_is_parallel: bool,
    pub tp: TensorParallel,
    /// The products in FP8 (module header).
    pub fp8: Option<Fp8Linear>,
}

impl RowParallelLinear {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        std: f32,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let shard = Shard::of(tp.rank(), tp.size());
        let weight = p.add(ParamMeta::split(
            format!("{prefix}.weight"),
            [out_features, in_features],
            1,
            shard,
            Init::Normal { std },
            true,
        )?)?;
        let bias = if bias {
            let m = ParamMeta::replicated(format!("{prefix}.bias"), [out_features], Init::Zeros, false);
            Some(p.add(m.on_sequence_shards(tp.sp()))?)
        } else {
            None
        };
        Ok(RowParallelLinear {
            weight,
            bias,
            in_features,
            out_features,
            input_is_parallel: true,
            tp: tp.clone(),
            fp8: None,
        })
    }

    pub fn with_input_is_parallel(mut self, yes: bool) -> Self {
        self.input_is_parallel = yes;
        self
    }

    /// For a caller that drops this layer's input and recomputes it for the backward (selective
    /// recompute of the core attention): `forward`'s saved values without the input, keeping
    /// delayed scaling's scales of x and w.
    pub fn drop_input(&self, saved: &mut Saved) {
        let keep = if self.fp8.as_ref().is_some_and(|f| f.slot.is_some()) { 2 } else { 0 };
        let n = saved.tensors.len();
        saved.tensors.drain(..n.saturating_sub(keep));
    }

    /// `forward`'s saved values again from the recomputed input `x` and what `drop_input` kept:
    /// x, or its FP8 transpose (the forward's bytes: the same x quantizes alike, by the same
    /// scale under delayed scaling).
    pub fn saved_for_input(&self, x: &Tensor, kept: Saved) -> Result<Saved> {
        const OP: &str = "RowParallelLinear::saved_for_input";
        let Some(f) = &self.fp8 else { return Ok(Saved::new(vec![x.clone()], vec![])) };
        let (xt, scales) = match (&f.slot, kept.tensors.as_slice()) {
            (None, []) => (k::quantize_fp8(x, f.format.forward(), Fp8Copies::Transposed)?.1, vec![]),
            (Some(_), [_, x_scale]) => {
                let (_, xt, _) = k::quantize_fp8_scaled(x, f.format.forward(), Fp8Copies::Transposed, x_scale, None)?;
                (xt, kept.tensors)
            }
            _ => return Err(invalid(OP, "the kept values are not drop_input's")),
        };
        let xt = xt.ok_or_else(|| invalid(OP, "no transposed copy"))?;
        Ok(Saved::new([vec![xt.data, xt.scale_inv], scales].concat(), vec![]))
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, cx: &Cx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let x = if self.input_is_parallel { x.clone() } else { self.tp.split_last(x)? };
        self.forward_split(cx, &x, product)
    }

    fn backward(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, None, true)
    }

    fn out_bias(&self) -> Option<ParamId> {
        self.bias
    }

    fn backward_without_out_bias(&self, cx: &Cx, saved: Saved, dy: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, None, false)
    }
}

/// `product` in FP8 of act(h) (`fp8_product_of`).
fn product_after(
    cx: &Cx,
    w: ParamId,
    b: Option<ParamId>,
    h: &Tensor,
    fp8: Option<&Fp8Linear>,
    act: Fp8Act,
) -> Result<(Tensor, Saved)> {
    let f = fp8.ok_or_else(|| invalid("RowParallelLinear::forward_after", "the layer is not in FP8"))?;
    let (w, b) = (cx.params.param(w)?, b.map(|b| cx.params.param(b)).transpose()?);
    fp8_product_of(cx, &w, b.as_ref(), h, f, Some(act))
}

impl RowParallelLinear {
    /// `forward(act(h))` for h the activation's input, the same values and saved state. In FP8
    /// the input's cast applies the activation (`k::fp8_linear_fwd_after`), so act(h) is never
    /// written; otherwise it runs first. (In bf16 a GeLU rides in fc1's GEMM epilogue instead:
    /// `ColumnParallelLinear::forward_gelu`.)
    pub fn forward_after(&self, cx: &Cx, act: Fp8Act, h: &Tensor) -> Result<(Tensor, Saved)> {
        // A GeLU is elementwise, so splitting h first splits gelu(h) alike; a SwiGLU's halves are
        // not split so.
        if self.fp8.is_none() || (act == Fp8Act::Swiglu && !self.input_is_parallel) {
            let a = match act {
                Fp8Act::Gelu => k::gelu(h)?,
                Fp8Act::Swiglu => k::swiglu(h)?,
            };
            return self.forward(cx, &a);
        }
        let h = if self.input_is_parallel { h.clone() } else { self.tp.split_last(h)? };
        self.forward_split(cx, &h, |cx, w, b, h, fp8| product_after(cx, w, b, h, fp8, act))
    }

    /// The forward on this rank's input slice `x`, its product by `mul` (`product`'s signature).
    fn forward_split(
        &self,
        cx: &Cx,
        x: &Tensor,
        mul: impl Fn(&Cx, ParamId, Option<ParamId>, &Tensor, Option<&Fp8Linear>) -> Result<(Tensor, Saved)>,
    ) -> Result<(Tensor, Saved)> {
        match (self.tp.size(), self.bias) {
            // Alone: the bias rides in the GEMM epilogue.
            (1, Some(b)) => mul(cx, self.weight, Some(b), x, self.fp8.as_ref()),
            (_, b) => {
                let (y, saved) = mul(cx, self.weight, None, x, self.fp8.as_ref())?;
                let y = self.tp.exit(&y)?;
                let y = match b.filter(|_| self.tp.adds_bias()) {
                    Some(b) => k::bias_add(&y, &cx.params.param(b)?)?,
                    None => y,
                };
                Ok((y, saved))
            }
        }
    }

    /// `backward` followed by the GeLU backward of the layer before (whose pre-activation is
    /// `h`): gelu_bwd(h, dx), fused into the input-gradient GEMM where the device allows
    /// (`k::matmul_dgelu`).
    pub fn backward_dgelu(&self, cx: &Cx, saved: Saved, dy: &Tensor, h: &Tensor) -> Result<Tensor> {
        self.backward_parts(cx, saved, dy, Some(h), true)
    }

    /// The backward with the GeLU backward of the layer before (`dgelu_of`: its pre-activation)
    /// or not, and with the bias gradient (`bias_grad`) or without it (`out_bias`'s contract).
    pub fn backward_parts(
        &self,
        cx: &Cx,
        saved: Saved,
        dy: &Tensor,
        dgelu_of: Option<&Tensor>,
        bias_grad: bool,
    ) -> Result<Tensor> {
        let h = dgelu_of;
        if let Some(b) = self.bias.filter(|_| bias_grad) {
            // Under sequence parallelism dy is this rank's sequence slice: a partial bias grad,
            // summed over the group with the other sequence-parallel grads before the step.
            let (db, acc) = cx.params.grad_acc(b)?;
            k::bias_grad_into(&db, dy, acc)?;
        }
        let dy = self.tp.exit_bwd(dy)?;
        let op = "RowParallelLinear::backward";
        // The GeLU backward rides in the input-gradient product's epilogue where it can (bf16).
        let fused = h.filter(|_| self.input_is_parallel && self.fp8.is_none());
        let dx = match fused {
            Some(h) => {
                param_grads(cx, self.weight, None, saved_one(op, &saved)?, &dy)?;
                k::matmul_dgelu(&dy, &cx.params.param(self.weight)?, h)?
            }
            None => product_bwd(op, cx, (self.weight, None), &saved, &dy, self.fp8.as_ref())?,
        };
        match (self.input_is_parallel, h) {
            (true, Some(h)) if fused.is_none() => k::gelu_bwd(h, &dx),
            (true, _) => Ok(dx),
            (false, None) => self.tp.gather_last(&dx),
            (false, Some(h)) => k::gelu_bwd(h, &self.tp.gather_last(&dx)?),
        }
    }
}
