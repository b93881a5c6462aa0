//! RoPE, the embedding lookup and its scatter-add, the QKV split/merge.

use super::*;
use ferrotron_core::cuda::CudaStorage;

pub fn rope(be: &B, x: &Tensor, cfg: &crate::RopeCfg, sign: f32) -> Result<Tensor> {
    let d = x.dims();
    let y = new(be, x.shape().clone(), x.dtype())?;
    rope_heads(be, x, &y, (d[0] * d[1], d[1], d[2], d[3]), cfg, sign, 0)?;
    Ok(y)
}

/// RoPE in place on the query and key heads of fused QKV [B, T, hkv·(g + 2)·d] (rope.cu: the
/// value heads, every (g + 2)th, are skipped).
pub fn rope_qkv_(
    be: &B,
    qkv: &Tensor,
    (hkv, g, d): (usize, usize, usize),
    cfg: &crate::RopeCfg,
    sign: f32,
) -> Result<()> {
    let dm = qkv.dims();
    rope_heads(be, qkv, qkv, (dm[0] * dm[1], dm[1], hkv * (g + 2), d), cfg, sign, g + 2)
}

/// x, y viewed as [rows, h, hd] at positions row % t; `period` > 0 only in place (x == y).
fn rope_heads(
    be: &B,
    x: &Tensor,
    y: &Tensor,
    (rows, t, h, hd): (usize, usize, usize, usize),
    cfg: &crate::RopeCfg,
    sign: f32,
    period: usize,
) -> Result<()> {
    let sfx = sfx("rope", x.dtype())?;
    let half = cfg.rot / 2;
    // rope.cu's four Llama 3.1 scaling parameters; factor 0 is none.
    let s = cfg.scaling.unwrap_or(crate::RopeScaling {
        factor: 0.0,
        low_freq_factor: 0.0,
        high_freq_factor: 0.0,
        original_max_position_embeddings: 0.0,
    });
    // YaRN's factor (0: none), ramp ends and factor on cos and sin (1 without).
    let (yf, (ylow, yhigh), ym) = match cfg.yarn {
        Some(y) => (y.factor, y.range(cfg.rot, cfg.base), y.attention_factor()),
        None => (0.0, (0.0, 1.0), 1.0),
    };
    // The linear interpolation's divisor of positions (1: none).
    let interp = cfg.interpolation.unwrap_or(1.0);
    let scale = [
        s.factor,
        s.low_freq_factor,
        s.high_freq_factor,
        s.original_max_position_embeddings,
        yf,
        ylow,
        yhigh,
        ym,
        interp,
    ]
    .map(Arg::F64);
    // rope.cu's `rope_pos`: a split at row t or later is none.
    let (at, spos) = cfg.split.map_or((t, 0), |s| (s.at, s.pos));
    if half % 8 == 0 && (hd - cfg.rot) % 8 == 0 && aligned16(&[x, y])? {
        // Eight pairs per thread, the angles from a table filled once per call (rope.cu).
        let cs = new(be, [t, half, 2], DType::F32)?;
        let mut args = vec![ptr("rope", &cs)?, n(t), n(cfg.rot), n(cfg.pos0), n(at), n(spos), Arg::F64(cfg.base)];
        args.extend(scale);
        ew(be, "rope_table", t * half, &args)?;
        let args = [
            ptr("rope", x)?,
            ptr("rope", y)?,
            ptr("rope", &cs)?,
            n(rows),
            n(t),
            n(h),
            n(hd),
            n(cfg.rot),
            Arg::F32(sign),
            n(period),
            n(cfg.interleaved as usize),
        ];
        return ew(be, &format!("rope_{sfx}_v8"), rows * h * (half / 8 + (hd - cfg.rot) / 8), &args);
    }
    let work = rows * h * (half + (hd - cfg.rot));
    let mut args = vec![
        ptr("rope", x)?,
        ptr("rope", y)?,
        n(rows),
        n(t),
        n(h),
        n(hd),
        n(cfg.rot),
        n(cfg.pos0),
        n(at),
        n(spos),
        Arg::F64(cfg.base),
    ];
    args.extend(scale);
    args.extend([Arg::F32(sign), n(period), n(cfg.interleaved as usize)]);
    ew(be, &format!("rope_{sfx}"), work, &args)
}

pub fn embedding_fwd(be: &B, ids: &Tensor, table: &Tensor, vocab_start: usize) -> Result<Tensor> {
    let c = table.dims()[1];
    let mut shape = ids.dims().to_vec();
    shape.push(c);
    let out = new(be, shape, table.dtype())?;
    let name = format!("embedding_fwd_{}", sfx("embedding_fwd", table.dtype())?);
    ew8(
        be,
        &name,
        out.elem_count(),
        c,
        &[
            ptr("emb", ids)?,
            ptr("emb", table)?,
            ptr("emb", &out)?,
            n(ids.elem_count()),
            n(c),
            n(vocab_start),
            n(table.dims()[0]),
        ],
    )?;
    Ok(out)
}

pub fn embedding_bwd(be: &B, ids: &Tensor, dout: &Tensor, dtable: &Tensor, vocab_start: usize) -> Result<()> {
    if dtable.dtype() != DType::F32 {
        return Err(Error::NotImplemented { op: "embedding_bwd", device: "cuda into a non-f32 gradient table".into() });
    }
    let c = dtable.dims()[1];
    let sfx = sfx("embedding_bwd", dout.dtype())?;
    let args = [
        ptr("emb", ids)?,
        ptr("emb", dout)?,
        ptr("emb", dtable)?,
        n(ids.elem_count()),
        n(c),
        n(vocab_start),
        n(dtable.dims()[0]),
    ];
    if crate::cuda::deterministic() {
        // Every row's sums in position order (kernels/embedding.cu `embedding_bwd_rows`): the
        // atomics' order depends on scheduling.
        let blocks = dtable.dims()[0].div_ceil(64) as u32;
        return be.launch(&format!("embedding_bwd_rows_{sfx}"), blocks, 256, 0, &args);
    }
    ew(be, &format!("embedding_bwd_{sfx}"), dout.elem_count(), &args)
}

/// The scatter-add into a bf16 main_grad table (`--grad-reduce-in-bf16`) through the device's
/// persistent f32 scratch (kernels/embedding.cu `embedding_bwd_flag`, `embedding_flush`): each
/// touched row summed in f32 and rounded into the table once. Returns false, queuing nothing,
/// where this path does not apply: another table dtype, deterministic mode (whose row order the
/// atomics do not keep), or a scratch that would have to grow inside a CUDA graph capture.
pub fn embedding_bwd_scratch(be: &B, ids: &Tensor, dout: &Tensor, dtable: &Tensor, vocab_start: usize) -> Result<bool> {
    if dtable.dtype() != DType::BF16 || crate::cuda::deterministic() {
        return Ok(false);
    }
    let (rows, c) = (dtable.dims()[0], dtable.dims()[1]);
    let mut all = be.emb_scratch.lock().unwrap_or_else(|e| e.into_inner());
    if all.last().is_none_or(|s| s.floats < rows * c || s.rows < rows) {
        if be.dev.is_capturing() {
            return Ok(false);
        }
        let (floats, frows) = all.last().map_or((0, 0), |s| (s.floats, s.rows));
        let (floats, frows) = (floats.max(rows * c), frows.max(rows));
        all.push(crate::cuda::EmbScratch {
            sums: CudaStorage::zeros(&be.dev, DType::F32, floats)?,
            flags: CudaStorage::zeros(&be.dev, DType::U32, frows)?,
            floats,
            rows: frows,
        });
    }
    let Some(s) = all.last() else { return Ok(false) };
    let (sums, flags) = (Arg::Ptr(s.sums.raw_ptr(&be.dev)), Arg::Ptr(s.flags.raw_ptr(&be.dev)));
    let (idp, nn, cc, vs, vr) = (ptr("emb", ids)?, n(ids.elem_count()), n(c), n(vocab_start), n(rows));
    // Four columns a thread (one vector reduction) where the rows allow.
    let (wide, per) = if c % 4 == 0 { ("4", 4) } else { ("", 1) };
    let flag = format!("embedding_bwd_flag{wide}_{}", sfx("embedding_bwd", dout.dtype())?);
    ew(be, &flag, dout.elem_count() / per, &[idp, ptr("emb", dout)?, sums, flags, nn, cc, vs, vr])?;
    // A warp per position.
    ew(be, "embedding_flush_bf16", ids.elem_count() * 32, &[idp, sums, flags, ptr("emb", dtable)?, nn, cc, vs, vr])?;
    Ok(true)
}

/// kernels/embedding.cu `pos_emb_bwd`: dout [b, l, c] into the table's rows start.. (f32 or bf16).
pub fn position_embedding_bwd(
    be: &B,
    dout: &Tensor,
    dtable: &Tensor,
    (b, l, c): (usize, usize, usize),
    start: usize,
) -> Result<()> {
    let name = format!(
        "pos_emb_bwd_{}_{}",
        sfx("position_embedding_bwd", dout.dtype())?,
        sfx("position_embedding_bwd", dtable.dtype())?
    );
    ew(be, &name, l * c, &[ptr("emb", dout)?, ptr("emb", dtable)?, n(b), n(l), n(c), n(start)])
}

/// The QKV split/merge over `len` elements of head segments of `d`: eight per thread when d divides
/// by 8 and every tensor is 16-byte aligned, else a warp per segment.
fn qkv_launch(be: &B, name: &str, len: usize, d: usize, ts: &[&Tensor], args: &[Arg]) -> Result<()> {
    if d % 8 == 0 && aligned16(ts)? {
        ew(be, &format!("{name}_v8"), len / 8, args)
    } else {
        ew(be, name, len / d.max(1) * 32, args)
    }
}

pub fn qkv_split(be: &B, x: &Tensor, hkv: usize, g: usize, d: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let q = new(be, [b, t, hkv * g, d], x.dtype())?;
    let k = new(be, [b, t, hkv, d], x.dtype())?;
    let v = new(be, [b, t, hkv, d], x.dtype())?;
    let name = format!("qkv_split_{}", sfx("qkv_split", x.dtype())?);
    qkv_launch(
        be,
        &name,
        x.elem_count(),
        d,
        &[x, &q, &k, &v],
        &[ptr("qkv", x)?, ptr("qkv", &q)?, ptr("qkv", &k)?, ptr("qkv", &v)?, n(b * t), n(hkv), n(g), n(d)],
    )?;
    Ok((q, k, v))
}

pub fn qkv_merge(be: &B, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, t, hq, d) = (q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]);
    let hkv = k.dims()[2];
    let g = hq / hkv;
    let x = new(be, [b, t, hkv * (g + 2) * d], q.dtype())?;
    let name = format!("qkv_merge_{}", sfx("qkv_merge", q.dtype())?);
    qkv_launch(
        be,
        &name,
        x.elem_count(),
        d,
        &[q, k, v, &x],
        &[ptr("qkv", q)?, ptr("qkv", k)?, ptr("qkv", v)?, ptr("qkv", &x)?, n(b * t), n(hkv), n(g), n(d)],
    )?;
    Ok(x)
}
