//! The central layout test: a tiny GPT (GPT-2 style and Llama style) trained for 5 steps under
//! tensor parallelism (2, 4) × sequence parallelism × data parallelism (1, 2) × the distributed
//! optimizer, on thread ranks, against the same model on one rank: per-step losses within 1e-5
//! relative and the gathered parameters after the steps within 1e-5.

mod common;

use common::*;
use ferrotron_comm::{Communicator, all_ok, run_ranks};
use ferrotron_core::{DType, Device, Draw};
use ferrotron_optim::{AdamConfig, GradSync, Optimizer, train_step};
use ferrotron_parallel::{Layout, ProcessGroups, TensorParallel};
use ferrotron_transformer::mla::MlaSpec;
use ferrotron_transformer::{Batch, GptModel, MtpSpec, TransformerConfig};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, Debug)]
struct Run {
    tp: usize,
    sp: bool,
    dp: usize,
    distributed: bool,
    overlap: bool,
    /// `--overlap-param-gather` (distributed optimizer only).
    gather: bool,
    /// Hidden dropout 0.2 and attention dropout 0.1, each micro-batch drawing from its first
    /// sample's place in the run.
    dropout: bool,
    /// Llama style with multi-latent attention and one multi-token prediction depth.
    latent: bool,
    /// --optimizer-cpu-offload: the update staged through the host's compact buffers.
    offload: bool,
}

struct Outcome {
    losses: Vec<f64>,
    params: BTreeMap<String, Vec<f32>>,
    state_bytes: usize,
    flat_len: usize,
}

fn train(run: Run, llama: bool, world: Arc<dyn Communicator>) -> Result<Outcome, String> {
    let layout = Layout::new(world.size(), run.tp, 1, 1, 1).map_err(|e| e.to_string())?;
    let g = ProcessGroups::new(world, layout).map_err(|e| e.to_string())?;
    let tp = TensorParallel::new(g.tp.clone(), run.sp);
    let (hidden_dropout, attention_dropout) = if run.dropout { (0.2, 0.1) } else { (0.0, 0.0) };
    let mut cfg = TransformerConfig { hidden_dropout, attention_dropout, ..config(llama) };
    if run.latent {
        cfg.kv_channels = None;
        cfg.layer.attention.qk_layernorm = false;
        let mla = MlaSpec {
            q_lora_rank: Some(12),
            kv_lora_rank: 10,
            qk_head_dim: 6,
            qk_pos_emb_head_dim: 4,
            v_head_dim: 5,
            yarn: None,
        };
        cfg.layer.attention.mla = Some(mla);
        cfg.mtp = Some(MtpSpec { num_layers: 1, loss_scaling_factor: 0.5 });
    }
    let (model, table) =
        GptModel::build_parallel(cfg, &tp, &Device::Cpu, DType::F32, 1234, run.dp).map_err(|e| e.to_string())?;
    // Adam divides by √v + eps. Where a gradient is rounding noise around zero (the key bias: a
    // per-row shift of the attention scores, which softmax ignores, so its exact gradient is 0),
    // eps 1e-8 turns noise of 1e-10 into steps of ±lr/100 that differ between summation orders;
    // eps 1e-5 keeps the update a smooth function of the gradient, so layouts can be compared.
    // Small buckets so that several overlap with the backward.
    let mut sync = GradSync::new(&table, g.dp_cp.clone(), g.tp.clone(), 2000, run.distributed, run.overlap)
        .with_overlap_param_gather(run.gather);
    let adam =
        AdamConfig { weight_decay: 0.1, clip_grad: 0.5, eps: 1e-5, cpu_offload: run.offload, ..AdamConfig::default() };
    let mut opt = Optimizer::new_parallel(&table, adam, &sync, g.mp.clone(), g.tp.rank()).map_err(|e| e.to_string())?;
    assert_eq!(opt.offloaded(), run.offload);
    let (d, dp) = (g.dp.rank(), g.dp.size());
    let mut losses = vec![];
    for step in 0..STEPS {
        let micros: Vec<Batch> = (0..GLOBAL_MICROS / dp)
            .map(|m| {
                let j = m * dp + d;
                let first_sample = ((step * GLOBAL_MICROS + j) * MICRO) as u64;
                micro_batch(j).with_draw(Draw { seed: 7, first_sample })
            })
            .collect();
        let out = train_step(&model, &table, &mut sync, &mut opt, &micros, 1e-2).map_err(|e| e.to_string())?;
        assert!(out.applied);
        losses.push(out.loss);
    }
    Ok(Outcome { losses, params: whole_params(&table, &g), state_bytes: opt.state_bytes(), flat_len: table.flat_len() })
}

fn reference(llama: bool, dropout: bool) -> Outcome {
    reference_run(llama, dropout, false)
}

fn reference_run(llama: bool, dropout: bool, latent: bool) -> Outcome {
    let run = Run {
        tp: 1,
        sp: false,
        dp: 1,
        distributed: false,
        overlap: false,
        gather: false,
        dropout,
        latent,
        offload: false,
    };
    all_ok(run_ranks(1, Duration::from_secs(60), |_, w| train(run, llama, w))).unwrap().remove(0)
}

fn check(run: Run, llama: bool, one: &Outcome) {
    let world = run.tp * run.dp;
    let outs = all_ok(run_ranks(world, Duration::from_secs(60), |_, w| train(run, llama, w))).unwrap();
    for (r, o) in outs.iter().enumerate() {
        let what = format!("{} {run:?} rank {r}", if llama { "llama" } else { "gpt" });
        for (s, (a, b)) in o.losses.iter().zip(&one.losses).enumerate() {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: step {s} loss {a} vs {b}");
        }
        assert_eq!(o.params.len(), one.params.len());
        for ((n, a), (n1, b)) in o.params.iter().zip(&one.params) {
            assert_eq!(n, n1);
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}: {n}[{i}] {x} vs {y}");
            }
        }
        if run.distributed {
            // Optimizer state is sharded: exactly 1/DP of the padded buffer's 12 bytes/element.
            assert_eq!(o.state_bytes * run.dp, 12 * o.flat_len, "{what}");
        } else {
            assert_eq!(o.state_bytes, 12 * o.flat_len, "{what}");
        }
    }
}

fn all_layouts(llama: bool) {
    let one = reference(llama, false);
    assert!(one.losses[STEPS - 1] < one.losses[0], "the reference run learns: {:?}", one.losses);
    for tp in [2, 4] {
        for sp in [false, true] {
            for dp in [1, 2] {
                for distributed in [false, true] {
                    let overlap = dp > 1 && (sp ^ distributed);
                    let gather = distributed && dp > 1 && sp;
                    check(
                        Run { tp, sp, dp, distributed, overlap, gather, dropout: false, latent: false, offload: false },
                        llama,
                        &one,
                    );
                }
            }
        }
    }
    // Pure data parallelism, with and without overlap; the sharded update offloaded with it.
    for overlap in [false, true] {
        check(
            Run {
                tp: 1,
                sp: false,
                dp: 2,
                distributed: true,
                overlap,
                gather: overlap,
                dropout: false,
                latent: false,
                offload: overlap,
            },
            llama,
            &one,
        );
        let run = Run {
            tp: 1,
            sp: false,
            dp: 2,
            distributed: false,
            overlap,
            gather: false,
            dropout: false,
            latent: false,
            offload: false,
        };
        check(run, llama, &one);
    }
}

/// Hidden dropout draws its masks by global sample, position and column, attention dropout by
/// global sample, head, query and key: tensor parallelism (the outputs replicated; each rank its
/// heads), sequence parallelism (each rank its part of every sequence) and data parallelism (each
/// rank its micro-batches) train as one rank does, step for step; and dropout does change the run.
#[test]
fn dropout_layouts_match_one_rank() {
    for llama in [false, true] {
        let one = reference(llama, true);
        let plain = reference(llama, false);
        assert!(one.losses[STEPS - 1] < one.losses[0], "the run with dropout learns: {:?}", one.losses);
        assert_ne!(one.losses[0], plain.losses[0], "dropout 0.2 left the first loss unchanged");
        let run = |tp, sp, dp, distributed| Run {
            tp,
            sp,
            dp,
            distributed,
            overlap: false,
            gather: false,
            dropout: true,
            latent: false,
            offload: false,
        };
        check(run(2, false, 1, false), llama, &one);
        check(run(2, true, 2, true), llama, &one);
        check(run(4, true, 1, false), llama, &one);
        check(run(1, false, 2, false), llama, &one);
    }
}

/// `--overlap-param-gather`: after a step the buckets past the first are still to come (the flat
/// buffer holds last step's values outside this rank's shards), the next forward or
/// `settle_params` brings them, and then every bit equals the gathers done at once.
#[test]
fn overlapped_param_gathers_wait_for_the_forward() {
    let step = |gather: bool| {
        all_ok(run_ranks(2, Duration::from_secs(60), move |_, w| -> Result<_, String> {
            let g = ProcessGroups::new(w, Layout::new(2, 1, 1, 1, 1).unwrap()).map_err(|e| e.to_string())?;
            let tp = TensorParallel::new(g.tp.clone(), false);
            let (model, table) = GptModel::build_parallel(config(false), &tp, &Device::Cpu, DType::F32, 1234, 2)
                .map_err(|e| e.to_string())?;
            let mut sync = GradSync::new(&table, g.dp_cp.clone(), g.tp.clone(), 2000, true, false)
                .with_overlap_param_gather(gather);
            let adam = AdamConfig { eps: 1e-5, ..AdamConfig::default() };
            let mut opt = Optimizer::new_parallel(&table, adam, &sync, g.mp.clone(), 0).map_err(|e| e.to_string())?;
            let micros = vec![micro_batch(g.dp.rank())];
            let before = table.flat_params().to_vec_f32().map_err(|e| e.to_string())?;
            train_step(&model, &table, &mut sync, &mut opt, &micros, 1e-2).map_err(|e| e.to_string())?;
            let raw = table.flat_params().to_vec_f32().map_err(|e| e.to_string())?;
            table.settle_params().map_err(|e| e.to_string())?;
            let settled = table.flat_params().to_vec_f32().map_err(|e| e.to_string())?;
            Ok((before, raw, settled, sync.plan.clone()))
        }))
        .unwrap()
    };
    let (now, later) = (step(false), step(true));
    for (r, ((_, raw_now, settled_now, _), (before, raw, settled, plan))) in now.iter().zip(&later).enumerate() {
        assert_eq!(raw_now, settled_now, "rank {r}: gathered at once, nothing pending");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(settled), bits(settled_now), "rank {r}: the same parameters either way");
        // The lowest bucket went out at once; in the highest the other rank's shard is stale.
        assert!(plan.buckets.len() > 2, "several buckets: {:?}", plan.buckets);
        let top = &plan.buckets[0];
        let other = plan.buckets[0].start + (1 - r) * top.len() / 2..plan.buckets[0].start + (2 - r) * top.len() / 2;
        assert_eq!(raw[other.clone()], before[other.clone()], "rank {r}: the top bucket waits for the forward");
        assert_ne!(settled[other.clone()], before[other], "rank {r}: and then arrives");
        let low = plan.buckets.last().unwrap().clone();
        assert_eq!(raw[low.clone()], settled[low], "rank {r}: the lowest bucket went out at once");
    }
}

/// Multi-latent attention (its replicated down projections, the shared rotary key's gradient
/// summed over each rank's heads) and a multi-token prediction depth, together: tensor parallel
/// 2 and 4, with and without sequence parallelism, × data parallel with the distributed
/// optimizer, as one rank, parameter for parameter.
#[test]
fn mla_and_mtp_layouts_match_one_rank() {
    let one = reference_run(true, false, true);
    assert!(
        one.params.keys().any(|n| n.contains("linear_kv_down_proj"))
            && one.params.keys().any(|n| n.starts_with("mtp."))
    );
    assert!(one.losses[STEPS - 1] < one.losses[0], "the reference run learns: {:?}", one.losses);
    for (tp, sp, dp, distributed) in
        [(2, false, 1, false), (2, true, 1, false), (2, true, 2, true), (4, true, 1, false), (1, false, 2, true)]
    {
        let overlap = dp > 1;
        check(
            Run { tp, sp, dp, distributed, overlap, gather: false, dropout: false, latent: true, offload: false },
            true,
            &one,
        );
    }
}

#[test]
fn gpt2_style_layouts_match_one_rank() {
    all_layouts(false);
}

#[test]
fn llama_style_layouts_match_one_rank() {
    all_layouts(true);
}

#[test]
fn a_tp_size_that_does_not_divide_is_named_at_build() {
    let outs = run_ranks(3, Duration::from_secs(10), |_, w| {
        let g = ProcessGroups::new(w, Layout::new(3, 3, 1, 1, 1).unwrap()).unwrap();
        let tp = TensorParallel::new(g.tp.clone(), false);
        GptModel::build_parallel(config(true), &tp, &Device::Cpu, DType::F32, 0, 1).err().map(|e| e.to_string())
    });
    for o in outs {
        let e = o.unwrap().expect("TP 3 cannot split 8 heads");
        assert!(e.contains("--num-attention-heads 8") && e.contains("--tensor-model-parallel-size 3"), "{e}");
    }
}
