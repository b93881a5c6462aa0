//! Context-parallel core attention on thread ranks against causal attention over the whole
//! sequence on one CPU rank: each rank's output rows, and its rows of dq, dk and dv, agree. The
//! ranks run on the CPU, and with the `cuda` feature also on one GPU (thread ranks sharing it,
//! in f32 and bf16: the flash kernels on the chunk blocks and the merge kernel).

use ferrotron_comm::{all_ok, run_ranks};
use ferrotron_core::{DType, Device, Tensor, rng::Philox};
use ferrotron_kernels::{self as k, AttnCfg, AttnDropout, RopeCfg};
use ferrotron_parallel::{ContextParallel, CpCommType};
use std::time::Duration;

fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    Philox::new(seed).fill_normal(0, 0.0, 1.0, &mut v);
    v
}

/// Rows `pos(i)` of each batch row of a host [B, T, W] array, for i in 0..rows.
fn rows_of(x: &[f32], b: usize, t: usize, w: usize, rows: usize, pos: impl Fn(usize) -> usize) -> Vec<f32> {
    let mut out = Vec::new();
    for bb in 0..b {
        for i in 0..rows {
            out.extend_from_slice(&x[(bb * t + pos(i)) * w..][..w]);
        }
    }
    out
}

/// Elementwise within `tol` (relative, with as much absolute) in f32; in bf16 within `tol` of
/// the largest magnitude (each value rounded to 8 bits of mantissa).
fn close(got: &[f32], want: &[f32], tol: f32, elementwise: bool, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0f32, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = if elementwise { tol + tol * w.abs() } else { tol * scale };
        assert!((g - w).abs() <= bound, "{what}[{i}]: {g} against {w}");
    }
}

#[test]
fn every_rank_gets_its_rows_of_whole_sequence_attention() {
    for kind in [CpCommType::AllGather, CpCommType::AllToAll] {
        rows_of_whole_sequence_attention(&Device::Cpu, DType::F32, 2e-5, kind);
    }
}

#[cfg(feature = "cuda")]
#[test]
fn every_rank_gets_its_rows_of_whole_sequence_attention_on_a_gpu() {
    let dev = Device::cuda(0).expect("a CUDA device for the cuda tests");
    for kind in [CpCommType::AllGather, CpCommType::AllToAll] {
        rows_of_whole_sequence_attention(&dev, DType::F32, 1e-4, kind);
        rows_of_whole_sequence_attention(&dev, DType::BF16, 3e-2, kind);
    }
}

/// Each case: (cp, batch, seq, query heads, key/value heads, head dim, dropout, window, document
/// masks: the whole rows' starts, row r cut every 5 + 3r positions).
fn rows_of_whole_sequence_attention(dev: &Device, dtype: DType, tol: f32, kind: CpCommType) {
    let cpu = Device::Cpu;
    let both = [
        (2usize, 2usize, 8usize, 4usize, 2usize, 8usize, false, None, false),
        // Attention dropout (chunks of 16: each block whole tiles of the sequence's mask).
        (2, 2, 64, 4, 2, 8, true, None, false),
        // Head dim 64: the GPU's flash kernels on 64-row chunks, without and with dropout.
        (2, 1, 256, 4, 2, 64, false, None, false),
        (2, 1, 256, 4, 2, 64, true, None, false),
    ];
    let by_kind: &[_] = match kind {
        // Head counts the all-to-all cannot split.
        CpCommType::AllGather => &[(4, 1, 16, 2, 1, 4, false, None, false), (3, 2, 12, 2, 2, 4, false, None, false)],
        // Three ranks of GQA heads; a sliding window (the all-gather refuses one), with dropout.
        CpCommType::AllToAll => &[
            (3, 2, 12, 6, 3, 4, false, None, false),
            (2, 1, 64, 4, 2, 8, false, Some(20), false),
            (2, 2, 64, 4, 4, 8, true, Some(9), false),
            // Document masks (the all-gather refuses them): whole rows of the rank's heads.
            (2, 2, 32, 4, 2, 8, false, None, true),
            (3, 2, 48, 6, 3, 8, true, None, true),
            (2, 1, 256, 4, 2, 64, false, None, true),
        ],
    };
    for &(cp, b, t, hq, hkv, d, drop, window, docs) in both.iter().chain(by_kind) {
        // The whole sequence's mask: the same key on one rank and on every cp rank.
        let batch_stride = AttnDropout::blocks_per_sample(hq, t, t);
        let dropout = AttnDropout {
            p: 0.2,
            seed: 5,
            stream: 6,
            base: 3 * batch_stride,
            batch_stride,
            head_offset: 0,
            tiles: None,
        };
        let starts: Vec<u32> = (0..b).flat_map(|r| (0..t).map(move |i| (i - i % (5 + 3 * r)) as u32)).collect();
        let starts_on = |dev: &Device| docs.then(|| Tensor::from_vec(starts.clone(), [b, t], dev)).transpose();
        let cpu_starts = starts_on(&cpu).unwrap();
        let cfg = AttnCfg { dropout: drop.then_some(dropout), window, docs: cpu_starts.as_ref(), ..AttnCfg::default() };
        let (nq, nk) = (b * t * hq * d, b * t * hkv * d);
        let (q, kk, v, dout) = (normal(nq, 1), normal(nk, 2), normal(nk, 3), normal(nq, 4));
        // One rank: the whole sequence, with RoPE at positions 0..t.
        let rope = RopeCfg::new(d, 10000.0);
        let whole = |x: &[f32], h: usize| Tensor::from_vec(x.to_vec(), [b, t, h, d], &cpu).unwrap();
        let (qr, kr) = (k::rope_fwd(&whole(&q, hq), &rope).unwrap(), k::rope_fwd(&whole(&kk, hkv), &rope).unwrap());
        let (o, lse) = k::attention_fwd(&qr, &kr, &whole(&v, hkv), &cfg).unwrap();
        let (dq, dk, dv) = k::attention_bwd(&qr, &kr, &whole(&v, hkv), &o, &lse, &whole(&dout, hq), &cfg).unwrap();
        let (dq, dk) = (k::rope_bwd(&dq, &rope).unwrap(), k::rope_bwd(&dk, &rope).unwrap());
        // lse [B, H, T] as rows [B, T, H], to take each rank's rows of it.
        let lse = lse.transpose(1, 2).unwrap().contiguous().unwrap().to_vec_f32().unwrap();
        let (o, dq, dk, dv) =
            (o.to_vec_f32().unwrap(), dq.to_vec_f32().unwrap(), dk.to_vec_f32().unwrap(), dv.to_vec_f32().unwrap());
        let ranks = all_ok(run_ranks(cp, Duration::from_secs(30), |_, comm| {
            let ctx = ContextParallel::new(comm).with_kind(kind);
            let c = ctx.chunk_len(t)?;
            let dev_starts = starts_on(dev)?;
            let cfg = AttnCfg { docs: dev_starts.as_ref(), ..cfg };
            let local = |x: &[f32], h: usize| {
                let rows = rows_of(x, b, t, h * d, 2 * c, |i| ctx.position(c, i));
                Tensor::from_f32(&rows, [b, 2 * c, h, d], dtype, dev)
            };
            let rope = ctx.rope(&rope, 2 * c);
            let (ql, kl, vl) =
                (k::rope_fwd(&local(&q, hq)?, &rope)?, k::rope_fwd(&local(&kk, hkv)?, &rope)?, local(&v, hkv)?);
            let (ol, lsel) = ctx.attention_fwd(&ql, &kl, &vl, &cfg)?;
            let (dql, dkl, dvl) = ctx.attention_bwd(&ql, &kl, &vl, &ol, &lsel, &local(&dout, hq)?, &cfg)?;
            let (dql, dkl) = (k::rope_bwd(&dql, &rope)?, k::rope_bwd(&dkl, &rope)?);
            let want = |x: &[f32], w: usize| rows_of(x, b, t, w, 2 * c, |i| ctx.position(c, i));
            let mut parts = vec![
                (ol.to_vec_f32()?, want(&o, hq * d)),
                (dql.to_vec_f32()?, want(&dq, hq * d)),
                (dkl.to_vec_f32()?, want(&dk, hkv * d)),
                (dvl.to_vec_f32()?, want(&dv, hkv * d)),
            ];
            if kind == CpCommType::AllToAll {
                // The rank's rows of the whole lse, in k::attention_fwd's layout (the sink
                // softmax reads it).
                assert_eq!(lsel.dims(), [b, hq, 2 * c]);
                parts.push((lsel.transpose(1, 2)?.contiguous()?.to_vec_f32()?, want(&lse, hq)));
            }
            Ok::<_, ferrotron_core::Error>(parts)
        }))
        .unwrap();
        for (r, parts) in ranks.iter().enumerate() {
            for ((got, want), what) in parts.iter().zip(["o", "dq", "dk", "dv", "lse"]) {
                close(
                    got,
                    want,
                    tol,
                    dtype == DType::F32,
                    &format!(
                        "{dev} {dtype} {kind:?} cp {cp} dropout {drop} window {window:?} docs {docs} rank {r} {what}"
                    ),
                );
            }
        }
    }
}

#[test]
fn a_window_or_a_full_mask_is_refused_by_name() {
    let r = all_ok(run_ranks(2, Duration::from_secs(5), |_, comm| {
        let ctx = ContextParallel::new(comm);
        let x = Tensor::zeros([1, 4, 1, 4], DType::F32, &Device::Cpu)?;
        let cfg = AttnCfg { window: Some(2), ..AttnCfg::default() };
        Ok::<_, ferrotron_core::Error>(ctx.attention_fwd(&x, &x, &x, &cfg).unwrap_err().to_string())
    }))
    .unwrap();
    assert!(r[0].contains("sliding window") && r[0].contains("--context-parallel-size"), "{}", r[0]);
}

#[test]
fn the_all_gather_refuses_document_masks_naming_the_all_to_all() {
    let r = all_ok(run_ranks(2, Duration::from_secs(5), |_, comm| {
        let ctx = ContextParallel::new(comm);
        let x = Tensor::zeros([1, 4, 1, 4], DType::F32, &Device::Cpu)?;
        let docs = Tensor::from_vec(vec![0u32, 0, 2, 2, 2, 2, 2, 2], [1, 8], &Device::Cpu)?;
        let cfg = AttnCfg { docs: Some(&docs), ..AttnCfg::default() };
        Ok::<_, ferrotron_core::Error>(ctx.attention_fwd(&x, &x, &x, &cfg).unwrap_err().to_string())
    }))
    .unwrap();
    assert!(r[0].contains("document-wise") && r[0].contains("--cp-comm-type a2a"), "{}", r[0]);
}

#[test]
fn the_all_to_all_refuses_heads_it_cannot_split() {
    let r = all_ok(run_ranks(2, Duration::from_secs(5), |_, comm| {
        let ctx = ContextParallel::new(comm).with_kind(CpCommType::AllToAll);
        let (q, kv) = (
            Tensor::zeros([1, 4, 2, 4], DType::F32, &Device::Cpu)?,
            Tensor::zeros([1, 4, 1, 4], DType::F32, &Device::Cpu)?,
        );
        Ok::<_, ferrotron_core::Error>(ctx.attention_fwd(&q, &kv, &kv, &AttnCfg::default()).unwrap_err().to_string())
    }))
    .unwrap();
    assert!(r[0].contains("1 query groups") && r[0].contains("--cp-comm-type allgather"), "{}", r[0]);
}
