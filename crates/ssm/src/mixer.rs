//! Mamba-2's mixer (Megatron-Core's MambaMixer; parameter names as Megatron's and Hugging Face's
//! Mamba2).
//!
//! Shapes: h [B, T, C] (C the hidden size); d_inner = H·P; Cd = d_inner + 2·G·N.
//!   z   = h · W_zᵀ                     [B, T, d_inner]   (in_proj rows 0 .. d_inner)
//!   xbc = h · W_xbcᵀ                   [B, T, Cd]        (in_proj rows d_inner .. d_inner + Cd)
//!   dt  = h · W_dtᵀ                    [B, T, H]         (in_proj's last H rows)
//!   u   = silu(conv1d(xbc) + b)        [B, T, Cd]        (causal, depthwise, K taps)
//!   y   = scan(u, dt)                  [B, T, d_inner]   (x | B | C of u; D's skip inside)
//!   g   = rmsnorm_G(y · silu(z)) · w   [B, T, d_inner]   (per group of heads, or over all)
//!   out = g · W_outᵀ                   [B, T, C]
//! in_proj's three products read row ranges of one weight (views), so the stored parameter is
//! Megatron's single `in_proj.weight` [d_inner + Cd + H, C].
//!
//! Backward: the chain in reverse; dh = dz·W_z + dxbc·W_xbc + ddt·W_dt (the last two added
//! in place). Weight gradients go into main_grad (`=` on a parameter's first write in a step,
//! `+=` after: `ParamTable::grad_acc`); the conv, scan and norm parameters' small f32 gradients
//! are added there.
//!
//! FP8 (`Module::set_fp8`, Megatron's --fp8-format): in_proj's three products and out_proj run
//! as FP8 linear layers (`ferrotron_parallel::linear::fp8_product`), each in_proj block with its
//! own scales (under delayed scaling its own slot, `{in_proj}.{z|xbc|dt}`), their input
//! gradients summed; the forward keeps their FP8 transposed inputs instead of h and g.
//!
//! Tensor parallelism (Megatron's layout): each of t ranks holds H/t heads and G/t groups, so
//! in_proj is column-parallel with each of its blocks z | x | B | C | dt cut across the ranks
//! (unequal blocks: `Blocks::Sizes`), the convolution's channels x | B | C likewise, dt_bias, A_log,
//! D and the norm weight by heads, out_proj row-parallel. Everything between the two products
//! is per head or per group, so it runs on the rank's own; the input enters the group as a
//! column-parallel linear's does (gathered over the sequence with sequence parallelism) and the
//! output leaves it as a row-parallel one's (summed, or reduce-scattered). The gated norm must
//! then be per group (each rank normalises whole groups).
//!
//! Context parallelism (Megatron's MambaContextParallel): a rank holds two chunks of each
//! sequence (`ContextParallel`), and the convolution and scan need every row. Around them an
//! all-to-all trades the rank's rows of its heads for every row of 1/cp of them
//! (`ContextParallel::to_channels`: xbc by its x | B | C blocks, dt by heads; y back with
//! `to_sequence`), so each runs on [B, T, …] of its share; the products and the gated norm stay
//! on the rank's rows. The convolution's channels, dt_bias, A_log and D are whole on every
//! context-parallel rank and each uses its share: its gradients fill that share, zeros the rest,
//! and the data × context-parallel gradient reduction sums the shares.

use crate::context::{MixerCp, Rows};
use crate::spec::{MambaDims, MambaSpec};
use ferrotron_core::{
    Blocks, Cx, Fp8Linear, Fp8Recipe, Init, Module, ParamId, ParamMeta, ParamTableBuilder, Result, Saved, Shard,
    Tensor, invalid,
};
use ferrotron_kernels as k;
use ferrotron_parallel::TensorParallel;
use ferrotron_parallel::linear::{fp8_product, fp8_product_bwd, product, product_bwd};
use ferrotron_transformer::spec::ModuleFactory;

pub struct MambaMixer {
    /// This rank's sizes (the whole mixer's heads, groups and width over the tensor-parallel
    /// size); the hidden size whole.
    pub dims: MambaDims,
    pub in_proj: ParamId,
    pub conv_weight: ParamId,
    pub conv_bias: ParamId,
    pub dt_bias: ParamId,
    pub a_log: ParamId,
    pub d: ParamId,
    pub norm: ParamId,
    pub out_proj: ParamId,
    eps: f64,
    /// Column groups of the gated norm on this rank: the head groups', or 1 (the whole width).
    norm_groups: usize,
    tp: TensorParallel,
    /// Context parallelism over more than one rank, or None.
    cp: Option<MixerCp>,
    /// The sizes the convolution and scan run at: `dims` with the heads, groups and width over
    /// the context-parallel size.
    seq_dims: MambaDims,
    /// In FP8 (module header): in_proj's z, xbc and dt blocks, then out_proj.
    fp8: Option<[Fp8Linear; 4]>,
}

impl MambaMixer {
    /// Registers the parameters under `prefix` (e.g. `decoder.layers.0.mixer`), this rank's part
    /// of each under `tp`. Init as Megatron's: in_proj normal(std), out_proj normal(out_std), the
    /// convolution PyTorch's default uniform (±1/√K), dt_bias softplus⁻¹ of a log-uniform step,
    /// A_log ln U(1, 16), D and the norm ones; every value drawn at its index in the whole tensor,
    /// so any layout starts from the same model.
    pub fn new(
        p: &mut ParamTableBuilder,
        prefix: &str,
        spec: &MambaSpec,
        dims: MambaDims,
        std: f32,
        out_std: f32,
        tp: &TensorParallel,
    ) -> Result<Self> {
        let t = tp.size();
        // Whole groups a rank (and so whole heads: the groups divide them), normalised on their own.
        spec.validate_tp(t).map_err(|m| invalid("MambaMixer::new", m))?;
        let (c, h, cd, kk, di, gn) =
            (dims.hidden, dims.heads, dims.conv_dim(), dims.conv_kernel, dims.d_inner, dims.groups * dims.state);
        let part = |blocks| Shard { rank: tp.rank(), size: t, blocks };
        let heads = Shard::of(tp.rank(), t);
        let split = |p: &mut ParamTableBuilder, name: &str, shape: Vec<usize>, dim, sh, init, decay| {
            p.add(ParamMeta::split(format!("{prefix}.{name}"), shape, dim, sh, init, decay)?)
        };
        let bound = 1.0 / (kk as f32).sqrt();
        let conv_init = Init::Uniform { lo: -bound, hi: bound };
        let in_blocks = part(Blocks::Sizes([di, di, gn, gn, h]));
        let conv_blocks = part(Blocks::Sizes([di, gn, gn, 0, 0]));
        let dt_init = Init::DtBias { min: spec.dt_min, max: spec.dt_max, floor: spec.dt_floor };
        let a_init = Init::LogUniform { lo: spec.a_init.0, hi: spec.a_init.1 };
        let local = MambaDims { d_inner: di / t, heads: h / t, groups: dims.groups / t, ..dims };
        let cp = match spec.context_parallel.clone().filter(|c| c.size() > 1) {
            Some(c) => Some(MixerCp::new(c, local, t)?),
            None => None,
        };
        let seq_dims = cp.as_ref().map_or(local, |c| c.seq);
        Ok(MambaMixer {
            in_proj: split(p, "in_proj.weight", vec![dims.in_proj_out(), c], 0, in_blocks, Init::Normal { std }, true)?,
            conv_weight: split(p, "conv1d.weight", vec![cd, 1, kk], 0, conv_blocks, conv_init, true)?,
            conv_bias: split(p, "conv1d.bias", vec![cd], 0, conv_blocks, conv_init, false)?,
            dt_bias: split(p, "dt_bias", vec![h], 0, heads, dt_init, false)?,
            a_log: split(p, "A_log", vec![h], 0, heads, a_init, false)?,
            d: split(p, "D", vec![h], 0, heads, Init::Ones, false)?,
            norm: split(p, "norm.weight", vec![di], 0, heads, Init::Ones, false)?,
            out_proj: split(p, "out_proj.weight", vec![c, di], 1, heads, Init::Normal { std: out_std }, true)?,
            dims: local,
            eps: spec.norm_eps,
            norm_groups: if spec.norm_per_group { local.groups } else { 1 },
            tp: tp.clone(),
            cp,
            seq_dims,
            fp8: None,
        })
    }

    /// The scan's sizes for b sequences of t rows (the whole sequence under context parallelism).
    fn scan_dims(&self, b: usize, t: usize) -> k::ScanDims {
        let d = &self.seq_dims;
        k::ScanDims { batch: b, seq: t, heads: d.heads, head_dim: d.head_dim, groups: d.groups, state: d.state }
    }

    /// Parameter `id`'s rows of this rank's share, contiguous (the parameter itself without
    /// context parallelism).
    fn param_share(cx: &Cx, id: ParamId, rows: Option<&Rows>) -> Result<Tensor> {
        let p = cx.params.param(id)?;
        let Some(rows) = rows else { return Ok(p) };
        if let [(at, 0, len)] = rows[..] {
            return p.narrow0(at..at + len);
        }
        let mut dims = p.dims().to_vec();
        dims[0] = rows.iter().map(|r| r.2).sum();
        let out = Tensor::empty(dims, p.dtype(), p.device())?;
        for &(at, to, len) in rows {
            out.narrow0(to..to + len)?.copy_from(&p.narrow0(at..at + len)?)?;
        }
        Ok(out)
    }

    /// main_grad of `id` += g for a share's rows (g holds the share's rows only; the rest of
    /// main_grad is zeroed on its first write this step), or for every row without one.
    fn add_grad_share(cx: &Cx, id: ParamId, g: &Tensor, rows: Option<&Rows>) -> Result<()> {
        let Some(rows) = rows else { return Self::add_grad(cx, id, g) };
        let (dst, acc) = cx.params.grad_acc(id)?;
        if !acc {
            dst.zero_()?;
        }
        let mut dims = dst.dims().to_vec();
        dims[0] = rows.iter().map(|r| r.2).sum();
        let g = g.reshape(dims)?;
        for &(at, from, len) in rows {
            k::add_(&dst.narrow0(at..at + len)?, &g.narrow0(from..from + len)?)?;
        }
        Ok(())
    }

    /// in_proj's row ranges: z, xbc, dt.
    fn in_parts(&self, w: &Tensor) -> Result<[Tensor; 3]> {
        let (di, cd) = (self.dims.d_inner, self.dims.conv_dim());
        Ok([w.narrow0(0..di)?, w.narrow0(di..di + cd)?, w.narrow0(di + cd..di + cd + self.dims.heads)?])
    }

    /// main_grad of `id` += g (or = g on its first write this step); g f32, same element count.
    fn add_grad(cx: &Cx, id: ParamId, g: &Tensor) -> Result<()> {
        let (dst, acc) = cx.params.grad_acc(id)?;
        let g = g.reshape(dst.dims().to_vec())?;
        if acc { k::add_(&dst, &g) } else { k::copy_(&dst, &g) }
    }
}

impl Module for MambaMixer {
    /// in_proj's three blocks and out_proj in FP8 (module header).
    fn set_fp8(&mut self, fp8: Option<&Fp8Recipe>) -> Result<()> {
        self.fp8 = fp8.map(|r| {
            let w = self.in_proj;
            [r.linear_part(w, "z"), r.linear_part(w, "xbc"), r.linear_part(w, "dt"), r.linear(self.out_proj)]
        });
        Ok(())
    }

    fn forward(&self, cx: &Cx, h: &Tensor) -> Result<(Tensor, Saved)> {
        if h.dims().len() != 3 || h.dims()[2] != self.dims.hidden {
            return Err(invalid(
                "MambaMixer::forward",
                format!("input {:?} is not [B, T, {}]", h.dims(), self.dims.hidden),
            ));
        }
        // With sequence parallelism h holds this rank's positions: the products take them all.
        let h = &self.tp.enter(h)?;
        let (b, t) = (h.dims()[0], h.dims()[1]);
        let rows = b * t;
        let [wz, wx, wdt] = self.in_parts(&cx.params.param(self.in_proj)?)?;
        let (z, xbc, dt, mut products) = match &self.fp8 {
            Some([fz, fx, fdt, _]) => {
                let (z, sz) = fp8_product(cx, &wz, None, h, fz)?;
                let (xbc, sx) = fp8_product(cx, &wx, None, h, fx)?;
                let (dt, sdt) = fp8_product(cx, &wdt, None, h, fdt)?;
                (z, xbc, dt, vec![sz, sx, sdt])
            }
            None => (
                k::matmul(h, &wz, false, true)?,
                k::matmul(h, &wx, false, true)?,
                k::matmul(h, &wdt, false, true)?,
                vec![],
            ),
        };
        // Under context parallelism the convolution and scan take every row of this rank's share.
        let (di, nh) = (self.dims.d_inner, self.dims.heads);
        let (xbc, dt) = match &self.cp {
            Some(c) => (c.xbc_to_heads(&xbc)?, c.cp.to_channels(&dt, &[nh])?),
            None => (xbc, dt),
        };
        let shares = self.cp.as_ref().map(|c| c.share_rows());
        let (conv_rows, head_rows) = (shares.as_ref().map(|s| &s.0), shares.as_ref().map(|s| &s.1));
        let u = k::conv1d_silu(
            &xbc,
            &Self::param_share(cx, self.conv_weight, conv_rows)?,
            &Self::param_share(cx, self.conv_bias, conv_rows)?,
        )?;
        let (dt_bias, a_log, d) = (
            Self::param_share(cx, self.dt_bias, head_rows)?,
            Self::param_share(cx, self.a_log, head_rows)?,
            Self::param_share(cx, self.d, head_rows)?,
        );
        let prm = k::ScanParams { dt_bias: &dt_bias, a_log: &a_log, d: &d };
        let (y, states) = k::ssd_scan(&u, &dt, &prm, &self.scan_dims(b, xbc.dims()[1]))?;
        let y = match &self.cp {
            Some(c) => c.cp.to_sequence(&y, &[di])?,
            None => y,
        };
        let (y2, z2) = (y.reshape([rows, di])?, z.reshape([rows, di])?);
        let (g, rstd) = k::gated_rmsnorm(&y2, &z2, &cx.params.param(self.norm)?, self.norm_groups, self.eps)?;
        let g = g.reshape([b, t, di])?;
        let (out, s_out) = product(cx, self.out_proj, None, &g, self.fp8.as_ref().map(|f| &f[3]))?;
        let out = self.tp.exit(&out)?; // this rank's heads' share, summed over the group
        if self.fp8.is_some() {
            // The products keep their FP8 inputs: h and g are not needed again.
            products.push(s_out);
            return Ok((out, Saved::new(vec![z2, xbc, u, dt, states, y2, rstd], products)));
        }
        Ok((out, Saved::new(vec![h.clone(), z2, xbc, u, dt, states, y2, rstd, g], vec![])))
    }

    fn backward(&self, cx: &Cx, saved: Saved, dout: &Tensor) -> Result<Tensor> {
        const OP: &str = "MambaMixer::backward";
        let bad = || invalid(OP, "saved tensors do not match forward");
        let Saved { mut tensors, children } = saved;
        // Without FP8 h and g lie first and last; with it the products' saved inputs are children.
        let (h, g) = if self.fp8.is_none() {
            let g = tensors.pop().ok_or_else(bad)?;
            (Some(tensors.remove(0)), Some(g))
        } else {
            (None, None)
        };
        let [z2, xbc, u, dt, states, y2, rstd]: [Tensor; 7] = tensors.try_into().map_err(|_| bad())?;
        // Every row the products took (under sequence parallelism the gathered sequence).
        let dout = self.tp.exit_bwd(dout)?;
        let (b, t) = (dout.dims()[0], dout.dims()[1]);
        let (rows, c, di) = (b * t, self.dims.hidden, self.dims.d_inner);
        let dout2 = dout.reshape([rows, c])?;
        let mut products = children.into_iter();
        let dg = match (&self.fp8, &g) {
            (Some(f), _) => {
                let s_out = products.next_back().ok_or_else(bad)?;
                product_bwd(OP, cx, (self.out_proj, None), &s_out, &dout2, Some(&f[3]))?
            }
            (None, Some(g)) => {
                let dg = k::matmul(&dout2, &cx.params.param(self.out_proj)?, false, false)?;
                let (dw, acc) = cx.params.grad_acc(self.out_proj)?;
                k::matmul_into(&dw, &dout2, &g.reshape([rows, di])?, true, false, acc)?;
                dg
            }
            (None, None) => return Err(bad()),
        };

        let nw = cx.params.param(self.norm)?;
        let (dy, dz, dnw) = k::gated_rmsnorm_bwd(&dg, &y2, &z2, &nw, &rstd, self.norm_groups)?;
        Self::add_grad(cx, self.norm, &dnw)?;

        let shares = self.cp.as_ref().map(|c| c.share_rows());
        let (conv_rows, head_rows) = (shares.as_ref().map(|s| &s.0), shares.as_ref().map(|s| &s.1));
        let (dt_bias, a_log, d) = (
            Self::param_share(cx, self.dt_bias, head_rows)?,
            Self::param_share(cx, self.a_log, head_rows)?,
            Self::param_share(cx, self.d, head_rows)?,
        );
        let prm = k::ScanParams { dt_bias: &dt_bias, a_log: &a_log, d: &d };
        let dy = dy.reshape([b, t, di])?;
        let dy = match &self.cp {
            Some(c) => c.cp.to_channels(&dy, &[di])?,
            None => dy,
        };
        let sg = k::ssd_scan_bwd(&u, &dt, &prm, &self.scan_dims(b, u.dims()[1]), &states, &dy)?;
        Self::add_grad_share(cx, self.dt_bias, &sg.dt_bias, head_rows)?;
        Self::add_grad_share(cx, self.a_log, &sg.a_log, head_rows)?;
        Self::add_grad_share(cx, self.d, &sg.d, head_rows)?;

        let cw = Self::param_share(cx, self.conv_weight, conv_rows)?;
        let cb = Self::param_share(cx, self.conv_bias, conv_rows)?;
        let (dxbc, dcw, dcb) = k::conv1d_silu_bwd(&xbc, &cw, &cb, &sg.dxbc)?;
        Self::add_grad_share(cx, self.conv_weight, &dcw, conv_rows)?;
        Self::add_grad_share(cx, self.conv_bias, &dcb, conv_rows)?;
        let nh = self.dims.heads;
        let (dxbc, ddt) = match &self.cp {
            Some(c) => (c.dxbc_to_sequence(&dxbc)?, c.cp.to_sequence(&sg.ddt_raw, &[nh])?),
            None => (dxbc, sg.ddt_raw),
        };

        // dh = dz·W_z + dxbc·W_xbc + ddt·W_dt; each part's weight gradient into its rows.
        let [wz, wx, wdt] = self.in_parts(&cx.params.param(self.in_proj)?)?;
        let (dw_in, acc) = cx.params.grad_acc(self.in_proj)?;
        let [gz, gx, gdt] = self.in_parts(&dw_in)?;
        let dxbc2 = dxbc.reshape([rows, self.dims.conv_dim()])?;
        let ddt2 = ddt.reshape([rows, self.dims.heads])?;
        let dh = match (&self.fp8, h) {
            (Some([fz, fx, fdt, _]), _) => {
                let mut dh = None;
                for ((w, gw, dpart), f) in
                    [(&wz, &gz, &dz), (&wx, &gx, &dxbc2), (&wdt, &gdt, &ddt2)].into_iter().zip([fz, fx, fdt])
                {
                    let s = products.next().ok_or_else(bad)?;
                    let d = fp8_product_bwd(OP, w, (gw, acc), &s, dpart, f)?;
                    match &dh {
                        Some(sum) => k::add_(sum, &d)?,
                        None => dh = Some(d),
                    }
                }
                dh.ok_or_else(bad)?
            }
            (None, Some(h)) => {
                let h2 = h.reshape([rows, c])?;
                let dh = k::matmul(&dz, &wz, false, false)?;
                k::matmul_into(&dh, &dxbc2, &wx, false, false, true)?;
                k::matmul_into(&dh, &ddt2, &wdt, false, false, true)?;
                for (gw, dpart) in [(&gz, &dz), (&gx, &dxbc2), (&gdt, &ddt2)] {
                    k::matmul_into(gw, dpart, &h2, true, false, acc)?;
                }
                dh
            }
            (None, None) => return Err(bad()),
        };
        self.tp.enter_bwd(&dh.reshape([b, t, c])?)
    }
}
