//! Pipeline parallelism and activation recompute against one rank: a tiny 4-layer GPT (GPT-2 and
//! Llama styles) for 5 steps under PP 2 and 4, uneven first/last stages, interleaved 1F1B with 2
//! virtual stages, and TP 2 × PP 2 × DP 2 (8 thread ranks) with sequence parallelism and the
//! distributed optimizer; each with recompute off, selective and full. Per-step losses within 1e-5
//! relative and every parameter (gathered over TP, from whichever stage holds it) within 1e-5.
//! And the saved-activation bytes of full and selective recompute, against the layer sizes.

mod common;

use common::*;
use ferrotron_comm::{Communicator, all_ok, run_ranks};
use ferrotron_core::{DType, Device, Draw};
use ferrotron_optim::{AdamConfig, GradSync, Optimizer, train_step, train_step_pipelined};
use ferrotron_parallel::pipeline::stage_layers;
use ferrotron_parallel::{Layout, ProcessGroups, TensorParallel};
use ferrotron_transformer::recompute::{Granularity, Method};
use ferrotron_transformer::{Batch, GptModel, Recompute, TransformerConfig};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const LAYERS: usize = 4;

#[derive(Clone, Copy, Debug)]
struct Run {
    tp: usize,
    pp: usize,
    vpp: usize,
    dp: usize,
    sp: bool,
    distributed: bool,
    /// `--overlap-param-gather`.
    gather: bool,
    first_last: Option<(usize, usize)>,
    recompute: Recompute,
    /// Hidden dropout 0.2 and attention dropout 0.1, each micro-batch drawing from its first
    /// sample's place in the run.
    dropout: bool,
}

struct Outcome {
    losses: Vec<f64>,
    params: BTreeMap<String, Vec<f32>>,
}

fn adam() -> AdamConfig {
    // eps as in tests/layouts.rs (keeps Adam's update smooth where a gradient is rounding noise).
    AdamConfig { weight_decay: 0.1, clip_grad: 0.5, eps: 1e-5, ..AdamConfig::default() }
}

fn train(run: Run, llama: bool, world: Arc<dyn Communicator>) -> Result<Outcome, String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let layout = Layout::new(world.size(), run.tp, run.pp, 1, 1).map_err(|x| e(&x))?;
    let g = ProcessGroups::new(world, layout).map_err(|x| e(&x))?;
    let tp = TensorParallel::new(g.tp.clone(), run.sp);
    let (first, last) = run.first_last.map_or((None, None), |(f, l)| (Some(f), Some(l)));
    let plan = stage_layers(LAYERS, run.pp, run.vpp, g.pp.rank(), first, last).map_err(|x| e(&x))?;
    let dropout = if run.dropout { 0.2 } else { 0.0 };
    let (model, table) = GptModel::build_stage(
        TransformerConfig { hidden_dropout: dropout, attention_dropout: dropout / 2.0, ..config_layers(llama, LAYERS) },
        &tp,
        &plan,
        run.recompute,
        &Device::Cpu,
        DType::F32,
        1234,
        run.dp,
    )
    .map_err(|x| e(&x))?;
    let mut sync = GradSync::new(&table, g.dp_cp.clone(), g.tp.clone(), 1500, run.distributed, false)
        .with_overlap_param_gather(run.gather);
    if let (Some(id), Some(embd)) = (model.tied_weight(), &g.embd) {
        sync = sync.with_tied(table.range(id), embd.clone());
    }
    let mut opt = Optimizer::new_parallel(&table, adam(), &sync, g.mp.clone(), g.tp.rank()).map_err(|x| e(&x))?;
    let (d, dp) = (g.dp.rank(), g.dp.size());
    let mut losses = vec![];
    for step in 0..STEPS {
        let micros: Vec<Batch> = (0..GLOBAL_MICROS / dp)
            .map(|m| {
                let j = m * dp + d;
                micro_batch(j).with_draw(Draw { seed: 7, first_sample: ((step * GLOBAL_MICROS + j) * MICRO) as u64 })
            })
            .collect();
        let out = train_step_pipelined(&model, &table, &mut sync, &mut opt, &g.pipeline, &g.pp, &micros, 1e-2)
            .map_err(|x| e(&x))?;
        losses.push(out.loss);
    }
    Ok(Outcome { losses, params: whole_params(&table, &g) })
}

fn check(run: Run, llama: bool, one: &Outcome) {
    let world = run.tp * run.pp * run.dp;
    let outs = all_ok(run_ranks(world, Duration::from_secs(60), |_, w| train(run, llama, w))).unwrap();
    let mut seen = BTreeMap::new();
    for (r, o) in outs.iter().enumerate() {
        let what = format!("{} {run:?} rank {r}", if llama { "llama" } else { "gpt" });
        for (s, (a, b)) in o.losses.iter().zip(&one.losses).enumerate() {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: step {s} loss {a} vs {b}");
        }
        for (n, v) in &o.params {
            close(v, &one.params[n], &format!("{what}: {n}"));
            seen.insert(n.clone(), ());
        }
    }
    assert_eq!(seen.len(), one.params.len(), "every parameter lives on some stage");
}

fn recomputes() -> [Recompute; 3] {
    [
        Recompute::default(),
        Recompute { granularity: Granularity::Selective, ..Recompute::default() },
        Recompute { granularity: Granularity::Full, method: Method::Uniform, num_layers: 1 },
    ]
}

fn all(llama: bool) {
    let base = Run {
        tp: 1,
        pp: 1,
        vpp: 1,
        dp: 1,
        sp: false,
        distributed: false,
        gather: false,
        first_last: None,
        recompute: Recompute::default(),
        dropout: false,
    };
    let one = all_ok(run_ranks(1, Duration::from_secs(60), |_, w| train(base, llama, w))).unwrap().remove(0);
    assert!(one.losses[STEPS - 1] < one.losses[0]);
    for recompute in recomputes() {
        for run in [
            Run { pp: 2, ..base },
            Run { pp: 4, ..base },
            Run { pp: 2, first_last: Some((1, 3)), ..base },
            Run { pp: 2, vpp: 2, ..base },
            Run { tp: 2, pp: 2, dp: 2, sp: true, distributed: true, ..base },
        ] {
            check(Run { recompute, ..run }, llama, &one);
        }
    }
    // Block recompute of the first layer of each stage, interleaved.
    let block = Recompute { granularity: Granularity::Full, method: Method::Block, num_layers: 1 };
    check(Run { pp: 2, vpp: 2, recompute: block, ..base }, llama, &one);
    // The distributed optimizer's gathers waiting for each stage's next forward, interleaved.
    check(Run { pp: 2, vpp: 2, dp: 2, distributed: true, gather: true, ..base }, llama, &one);
    // Hidden and attention dropout: every stage, chunk and data-parallel rank draws the one-rank
    // run's masks, the recomputed forwards (full and of the core attention alone) too.
    let drop = Run { dropout: true, ..base };
    let one = all_ok(run_ranks(1, Duration::from_secs(60), |_, w| train(drop, llama, w))).unwrap().remove(0);
    for recompute in recomputes() {
        check(Run { pp: 2, vpp: 2, recompute, ..drop }, llama, &one);
    }
    check(Run { tp: 2, pp: 2, dp: 2, sp: true, distributed: true, ..drop }, llama, &one);
}

#[test]
fn gpt2_style_pipelines_match_one_rank() {
    all(false);
}

#[test]
fn llama_style_pipelines_match_one_rank() {
    all(true);
}

/// Saved-activation bytes of one micro-batch (GPT-2 style, f32, one rank) with and without
/// recompute, against what each layer keeps: without recompute a layer holds its input x, the
/// LayerNorm inputs and statistics, the QKV input, Q, K, V, the attention output (twice: as
/// attention output and as projection input) and its log-sum-exp, and the MLP's fc1 input,
/// pre-activation and fc2 input; full recompute keeps x alone; selective drops the attention
/// output (both references) and the log-sum-exp.
#[test]
fn recompute_saves_the_expected_bytes() {
    let peak = |recompute| {
        let g = ProcessGroups::single();
        let tp = TensorParallel::new(g.tp.clone(), false);
        let plan = stage_layers(LAYERS, 1, 1, 0, None, None).unwrap();
        let (model, table) =
            GptModel::build_stage(config_layers(false, LAYERS), &tp, &plan, recompute, &Device::Cpu, DType::F32, 1, 1)
                .unwrap();
        let mut sync = GradSync::new(&table, g.dp_cp.clone(), g.tp.clone(), 1 << 20, false, false);
        let mut opt = Optimizer::new_parallel(&table, adam(), &sync, g.mp.clone(), 0).unwrap();
        train_step(&model, &table, &mut sync, &mut opt, &[micro_batch(0)], 1e-3).unwrap().saved_peak_bytes
    };
    let c = config_layers(false, LAYERS);
    let (b, t, h, f, heads) = (MICRO, SEQ, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads);
    let (btc, btf, bt, bht) = (b * t * h, b * t * f, b * t, b * heads * t);
    let layer = 4 * (9 * btc + 2 * btf + 4 * bt + bht);
    let none = peak(Recompute::default());
    let full = peak(Recompute { granularity: Granularity::Full, method: Method::Uniform, num_layers: 1 });
    let selective = peak(Recompute { granularity: Granularity::Selective, ..Recompute::default() });
    assert_eq!(none - full, LAYERS * (layer - 4 * btc), "full recompute keeps only each layer's input");
    assert_eq!(none - selective, LAYERS * 4 * (2 * btc + bht), "selective drops the core attention's outputs");
    // Uniform groups of 2 keep one input per 2 layers.
    let pairs = peak(Recompute { granularity: Granularity::Full, method: Method::Uniform, num_layers: 2 });
    assert_eq!(pairs, full - LAYERS / 2 * 4 * btc);
}
