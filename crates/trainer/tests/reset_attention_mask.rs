//! --reset-attention-mask: document-wise attention masks, each token seeing only its own
//! document in a sample. It changes a run whose samples hold several documents, trains under
//! tensor (with sequence), pipeline and all-to-all context parallelism as one rank does,
//! recomputes bit for bit, goes with --reset-position-ids, and is refused by name where it is
//! not built. (The masks against
//! Megatron's rule: the data crate's unit test; a packed document trained as if alone, and the
//! gradients: the transformer crate's gradcheck; the kernels: tests/ops/attention.rs.)

mod common;

use common::*;
use ferrotron_trainer::settings::{Settings, TrainArgs};

fn masks(a: TrainArgs) -> TrainArgs {
    TrainArgs { reset_attention_mask: true, ..a }
}

#[test]
fn document_masks_train_as_one_rank_under_tp_and_pp() {
    let s = settings(&masks(tiny_args(true)));
    assert!(s.reset_attention_mask);
    let one = run(&s, 1);
    assert!(one.losses.iter().all(|(_, l)| l.is_finite()), "{:?}", one.losses);
    assert_ne!(bits(&one.losses), bits(&run(&settings(&tiny_args(true)), 1).losses), "the masks changed nothing");
    follows_tp_sp_and_pp(&s, &one);
    // Recomputed forwards (full, one layer a group; selective: the core attention) take the
    // micro-batch's masks again: the same bits.
    for granularity in ["full", "selective"] {
        let mut r = s.clone();
        r.recompute_granularity = Some(granularity.into());
        if granularity == "full" {
            r.recompute_method = Some("uniform".into());
            r.recompute_num_layers = Some(1);
        }
        assert_eq!(bits(&run(&r, 1).losses), bits(&one.losses), "{granularity} recompute");
    }
}

/// GPT-2 style (learned positions) with both resets, Megatron's usual pair for packed documents:
/// each differs from the other alone, and two data-parallel ranks follow one.
#[test]
fn document_masks_go_with_reset_position_ids() {
    let both = settings(&masks(TrainArgs { reset_position_ids: true, ..tiny_args(false) }));
    let one = run(&both, 1);
    let positions_only = run(&settings(&TrainArgs { reset_position_ids: true, ..tiny_args(false) }), 1);
    let masks_only = run(&settings(&masks(tiny_args(false))), 1);
    assert_ne!(bits(&one.losses), bits(&positions_only.losses));
    assert_ne!(bits(&one.losses), bits(&masks_only.losses));
    follows("dp2", &run(&both, 2), &one);
}

/// Under --cp-comm-type a2a each rank carries the whole rows' document starts and the attention
/// runs on whole rows of its heads: cp2 (with MLA too, and with dp2) follows one rank.
#[test]
fn document_masks_train_as_one_rank_under_all_to_all_context_parallelism() {
    let cp = |s: &Settings, n: usize| {
        let mut s = s.clone();
        s.context_parallel_size = n;
        s.cp_comm_type = vec!["a2a".into()];
        s
    };
    let llama = settings(&masks(tiny_args(true)));
    let one = run(&llama, 1);
    follows("a2a cp2", &run(&cp(&llama, 2), 2), &one);
    follows("a2a cp2 × dp2", &run(&cp(&llama, 2), 4), &one);
    let mla = settings(&masks(mla_args()));
    assert_ne!(bits(&run(&settings(&mla_args()), 1).losses), bits(&run(&mla, 1).losses), "MLA's masks changed nothing");
    follows("a2a cp2, multi-latent attention", &run(&cp(&mla, 2), 2), &run(&mla, 1));
}

#[test]
fn where_the_masks_are_not_built_they_are_refused_by_name() {
    refused(
        masks(TrainArgs { context_parallel_size: Some(2), ..tiny_args(true) }),
        2,
        "--reset-attention-mask with --context-parallel-size 2 needs --cp-comm-type a2a",
    );
    refused(
        masks(TrainArgs {
            context_parallel_size: Some(2),
            cp_comm_type: Some(vec!["a2a".into(), "allgather".into()]),
            ..tiny_args(true)
        }),
        2,
        "needs --cp-comm-type a2a for every layer",
    );
    refused(
        masks(TrainArgs { img_h: Some(8), img_w: Some(8), patch_dim: Some(4), ..tiny_args(true) }),
        1,
        "--reset-attention-mask with a vision encoder",
    );
}
