//! Tensor-parallel layers on thread ranks against the same layers on one rank: outputs, input
//! gradients and the gathered parameter gradients agree, with and without sequence parallelism.

use ferrotron_comm::{all_ok, run_ranks};
use ferrotron_core::{Cx, DType, Device, Module, ParamTable, ParamTableBuilder, Tensor};
use ferrotron_parallel::{
    ColumnParallelLinear, ProcessGroups, RowParallelLinear, TensorParallel, VocabParallelCe, VocabParallelEmbedding,
    gather_param, vocab_parallel_ce_bwd, vocab_parallel_ce_fwd,
};
use std::time::Duration;

struct Run {
    y: Vec<f32>,
    dx: Vec<f32>,
    loss: Vec<f32>,
    /// Whole gradients, by parameter name.
    grads: Vec<(String, Vec<f32>)>,
}

const B: usize = 2;
const T: usize = 4;
const C: usize = 8;
const F: usize = 12;
const V: usize = 10; // real vocabulary; padded to 16

/// embedding → column (2 blocks + SwiGLU when `blocks` is 2) → row → column(gather_output) →
/// row(!input_is_parallel) → vocab-parallel logits + CE, on one rank of a group.
fn run(tp: &TensorParallel, blocks: usize) -> Result<Run, Box<dyn std::error::Error + Send + Sync>> {
    let mut p = ParamTableBuilder::default();
    let emb = VocabParallelEmbedding::new(&mut p, "emb", V, 16, C, 1.0, tp)?;
    let c1 = ColumnParallelLinear::new(&mut p, "c1", C, F * blocks, true, 0.3, tp, blocks)?;
    let r1 = RowParallelLinear::new(&mut p, "r1", F, C, true, 0.3, tp)?;
    let c2 = ColumnParallelLinear::new(&mut p, "c2", C, F, true, 0.3, tp, 1)?.with_gather_output(true);
    let r2 = RowParallelLinear::new(&mut p, "r2", F, C, false, 0.3, tp)?.with_input_is_parallel(false);
    let table: ParamTable = p.build(&Device::Cpu, DType::F32, 5)?;
    let cx = Cx::new(&table, true);
    let ids: Vec<u32> = (0..B * T).map(|i| (i * 7 % V) as u32).collect();
    let ids = Tensor::from_vec(ids, [B, T], &Device::Cpu)?;
    let x = emb.forward(&cx, &ids)?;
    let (h, s1) = c1.forward(&cx, &x)?;
    // SwiGLU turns this rank's [gate | value] blocks into its slice of F.
    let a = if blocks == 2 { ferrotron_kernels::swiglu(&h)? } else { h.clone() };
    let (y1, s2) = r1.forward(&cx, &a)?;
    let (h2, s3) = c2.forward(&cx, &y1)?;
    let (y, s4) = r2.forward(&cx, &h2)?;
    // Logits through the tied embedding (vocab-parallel).
    let yfull = tp.enter(&y)?;
    let w = cx.params.param(emb.weight)?;
    let logits = ferrotron_kernels::matmul(&yfull, &w, false, true)?.reshape([B * T, 16 / tp.size()])?;
    let labels = Tensor::from_vec((0..B * T).map(|i| (i * 3 % V) as u32).collect::<Vec<_>>(), [B * T], &Device::Cpu)?;
    let ce = VocabParallelCe { vocab_size: V, padded_vocab_size: 16 };
    let (loss, lse) = vocab_parallel_ce_fwd(ce, tp, &logits, &labels, None)?;
    let dloss = Tensor::from_f32(&[0.1; B * T], [B * T], DType::F32, &Device::Cpu)?;
    let dlogits = vocab_parallel_ce_bwd(ce, tp, &logits, &labels, None, &lse, &dloss)?;
    ferrotron_kernels::matmul_into(&table.grad(emb.weight)?, &dlogits, &yfull.reshape([B * T, C])?, true, false, true)?;
    let dy = tp.enter_bwd(&ferrotron_kernels::matmul(&dlogits, &w, false, false)?.reshape(yfull.dims().to_vec())?)?;
    let dh2 = r2.backward(&cx, s4, &dy)?;
    let dy1 = c2.backward(&cx, s3, &dh2)?;
    let da = r1.backward(&cx, s2, &dy1)?;
    let dh = if blocks == 2 { ferrotron_kernels::swiglu_bwd(&h, &da)? } else { da };
    let dx = c1.backward(&cx, s1, &dh)?;
    emb.backward(&cx, &ids, &dx)?;
    let mut grads = vec![];
    for id in table.ids() {
        let m = table.meta(id);
        let g = table.grad(id)?;
        if m.sequence_parallel {
            tp.all_reduce(&g)?;
        }
        grads.push((m.name.clone(), gather_param(&tp.comm, m, &g)?));
    }
    let gather = |t: &Tensor| -> Result<Vec<f32>, ferrotron_core::Error> { tp.exit_bwd(t)?.to_vec_f32() };
    Ok(Run { y: gather(&y)?, dx: gather(&dx)?, loss: loss.to_vec_f32()?, grads })
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn layers_on_tp_ranks_match_one_rank() {
    for blocks in [1, 2] {
        let one = run(&TensorParallel::new(ProcessGroups::single().tp, false), blocks).unwrap();
        for tp in [2, 4] {
            for sp in [false, true] {
                let runs = all_ok(run_ranks(tp, Duration::from_secs(30), |_, world| {
                    let layout = ferrotron_parallel::Layout::new(tp, tp, 1, 1, 1).unwrap();
                    let g = ProcessGroups::new(world, layout).unwrap();
                    run(&TensorParallel::new(g.tp.clone(), sp), blocks)
                }))
                .unwrap();
                for (r, got) in runs.iter().enumerate() {
                    let what = format!("tp {tp} sp {sp} blocks {blocks} rank {r}");
                    close(&got.y, &one.y, &format!("{what} y"));
                    close(&got.dx, &one.dx, &format!("{what} dx"));
                    close(&got.loss, &one.loss, &format!("{what} loss"));
                    for ((n, g), (n1, g1)) in got.grads.iter().zip(&one.grads) {
                        assert_eq!(n, n1);
                        // Padding rows of the embedding differ in count, not in value: compare real rows.
                        let len = if n == "emb" { V * C } else { g1.len() };
                        close(&g[..len], &g1[..len], &format!("{what} grad {n}"));
                    }
                }
            }
        }
    }
}
