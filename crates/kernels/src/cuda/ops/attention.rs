//! Attention: the reference kernels, flash (SIMT) and the tensor-core kernels.

use super::*;
use crate::cpu::attention::{AttnDims, AttnMask};

/// The reference attention kernels' shape arguments: the CPU's dims and mask plus the scale.
pub struct AttnShape<'a> {
    pub dims: &'a AttnDims,
    pub mask: AttnMask,
    pub scale: f32,
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
    FLASH_DIMS.contains(&a.dims.d)
}

/// Dynamic shared memory of the tensor-core kernels that stream K/V: two stages of a 64-key K
/// tile and V tile, rows padded by 8 bf16.
fn kv_stages(d: usize) -> u32 {
    (2 * 2 * 64 * (d + 8) * 2) as u32
}

/// The tensor-core forward for head dim `d` over `t` query rows, and its query rows per block (4
/// warps × 16 rows × m-tiles per warp: `FLASH_MMA` in kernels/flash_mma.cu). Two m-tiles per warp
/// at head dim 64 from 2048 rows on (H200, 16k tokens per call: 112 → 141–176 TFLOP/s from 2k to
/// 16k, but slower at 1k than one m-tile); one otherwise (at 128 two do not fit the registers).
fn fwd_kernel(d: usize, t: usize) -> (String, usize) {
    if d == 64 && t >= 2048 { ("flash_fwd_mma_bf16_64x2".into(), 128) } else { (format!("flash_fwd_mma_bf16_{d}"), 64) }
}

/// Whether the tensor-core kernels take these tensors: bf16, head dim 64 or 128, and every tile
/// source 16-byte aligned (their loads move 16 bytes at a time; a view at an odd offset is not).
fn mma_ok(q: &Tensor, tiles: &[&Tensor], a: &AttnShape) -> Result<bool> {
    if q.dtype() != DType::BF16 || !matches!(a.dims.d, 64 | 128) || tiles.iter().any(|t| t.dtype() != DType::BF16) {
        return Ok(false);
    }
    aligned16(tiles)
}

pub fn attention_fwd(be: &B, q: &Tensor, k: &Tensor, v: &Tensor, a: &AttnShape) -> Result<(Tensor, Tensor)> {
    let o = new(be, q.shape().clone(), q.dtype())?;
    let lse = new(be, [a.dims.b, a.dims.hq, a.dims.t], DType::F32)?;
    let mut args = vec![ptr("attn", q)?, ptr("attn", k)?, ptr("attn", v)?, ptr("attn", &o)?, ptr("attn", &lse)?];
    args.extend(attn_tail(a));
    let sfx = sfx("attention_fwd", q.dtype())?;
    if mma_ok(q, &[q, k, v], a)? {
        // Tensor cores (kernels/flash_mma.cu): 64 query rows per block of 4 warps.
        let d = a.dims;
        let (name, rows) = fwd_kernel(d.d, d.t);
        be.launch(&name, (d.b * d.hq * d.t.div_ceil(rows)) as u32, FLASH_THREADS, kv_stages(d.d), &args)?;
    } else if flash(a) {
        let d = a.dims;
        let grid = d.b * d.hq * d.t.div_ceil(32);
        be.launch(&format!("flash_fwd_{sfx}_{}", d.d), grid as u32, FLASH_THREADS, 0, &args)?;
    } else {
        attn_launch(be, &format!("attn_fwd_{sfx}"), a, args)?;
    }
    Ok((o, lse))
}

/// Flash backward: dQ (and delta = rowsum(dO∘O)) per query tile, then dK/dV per key tile; no
/// atomics, so the result does not depend on scheduling. Gradients in bf16 from the tensor-core
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
    let delta = new(be, [d.b, d.hq, d.t], DType::F32)?;
    if mma_ok(q, &[q, k, v, dout], a)? {
        // Tensor cores (kernels/flash_bwd_mma.cu), gradients straight in bf16.
        let dq = new(be, q.shape().clone(), DType::BF16)?;
        let (dk, dv) = (new(be, k.shape().clone(), DType::BF16)?, new(be, v.shape().clone(), DType::BF16)?);
        let rows = d.b * d.t * d.hq;
        let args = [ptr("attn", o)?, ptr("attn", dout)?, ptr("attn", &delta)?, n(rows), n(d.t), n(d.hq), n(d.d)];
        be.launch("flash_bwd_delta_bf16", rows.div_ceil(8) as u32, 256, 0, &args)?;
        let head = |outs: &[&Tensor]| -> Result<Vec<Arg>> {
            let mut v = vec![ptr("attn", q)?, ptr("attn", k)?, ptr("attn", v)?, ptr("attn", lse)?];
            v.extend([ptr("attn", &delta)?, ptr("attn", dout)?]);
            for t in outs {
                v.push(ptr("attn", t)?);
            }
            v.extend(attn_tail(a));
            Ok(v)
        };
        let grid = d.b * d.hq * d.t.div_ceil(64);
        be.launch(
            &format!("flash_bwd_dq_mma_bf16_{}", d.d),
            grid as u32,
            FLASH_THREADS,
            kv_stages(d.d),
            &head(&[&dq])?,
        )?;
        // K and V tiles, two stages of (Q, dO) tiles and of the rows' (lse, delta).
        let shared = ((2 * 64 + 4 * 64) * (d.d + 8) * 2 + 4 * 64 * 4) as u32;
        let grid = d.b * d.hkv * d.s.div_ceil(64);
        be.launch(&format!("flash_bwd_dkv_mma_bf16_{}", d.d), grid as u32, FLASH_THREADS, shared, &head(&[&dk, &dv])?)?;
        return Ok((dq, dk, dv));
    }
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
    if flash(a) {
        let (dq, dk, dv) = flash_bwd(be, q, k, v, o, lse, dout, a)?;
        let dt = dout.dtype();
        if dq.dtype() == dt {
            return Ok((dq, dk, dv));
        }
        return Ok((cast(be, &dq, dt)?, cast(be, &dk, dt)?, cast(be, &dv, dt)?));
    }
    // dk and dv are sums of fp32 atomics: they must start at zero (never poisoned).
    let dev = Device::Cuda(be.dev.clone());
    let dq = new(be, q.shape().clone(), DType::F32)?;
    let (dk, dv) =
        (Tensor::zeros(k.shape().clone(), DType::F32, &dev)?, Tensor::zeros(v.shape().clone(), DType::F32, &dev)?);
    let mut args = vec![
        ptr("attn", q)?,
        ptr("attn", k)?,
        ptr("attn", v)?,
        ptr("attn", o)?,
        ptr("attn", lse)?,
        ptr("attn", dout)?,
        ptr("attn", &dq)?,
        ptr("attn", &dk)?,
        ptr("attn", &dv)?,
    ];
    args.extend(attn_tail(a));
    attn_launch(be, &format!("attn_bwd_{}", sfx("attention_bwd", q.dtype())?), a, args)?;
    let dt = dout.dtype();
    if dt == DType::F32 {
        return Ok((dq, dk, dv));
    }
    Ok((cast(be, &dq, dt)?, cast(be, &dk, dt)?, cast(be, &dv, dt)?))
}
