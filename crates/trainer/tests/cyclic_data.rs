//! --dataloader-type cyclic through the trainer: the run reads another order than the single
//! sampler's (training and validation losses differ), a resumed run reads on where the straight
//! one stood (bit for bit), and data sharding decides which samples a data-parallel rank reads.
//! (The order itself against PyTorch's randperm and Megatron's sampler: ferrotron-data's
//! tests/cyclic_sampler.rs.)

mod common;

use common::*;
use ferrotron_trainer::settings::{Launch, Paths, TrainArgs};
use ferrotron_trainer::train::train;

fn cyclic(a: TrainArgs) -> TrainArgs {
    TrainArgs { dataloader_type: Some("cyclic".into()), ..a }
}

#[test]
fn cyclic_order_trains_resumes_and_shards() {
    let single = run(&settings(&tiny_args(false)), 1);
    let s = settings(&cyclic(tiny_args(false)));
    assert_eq!(s.dataloader_type, "cyclic");
    let one = run(&s, 1);
    assert_ne!(one.losses, single.losses, "the order changed nothing");
    assert_ne!(one.evals, single.evals, "the validation order changed nothing");
    let dir = tmp("cyclic-resume");
    let first = train(&s, &Paths { save: Some(dir.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
    assert_eq!(bits(&first.losses), bits(&one.losses[..4]));
    let rest = train(&s, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap();
    assert_eq!(bits(&rest.losses), bits(&one.losses[4..]), "resumed where the straight run stood");
    let _ = std::fs::remove_dir_all(&dir);
    // Two data-parallel ranks: each its own bucket (sharding), or every rank strided over one
    // permutation of the whole split: two different runs.
    let dp = |a: TrainArgs| train(&settings(&a), &Paths { launch: Launch::Threads(2), ..Paths::default() }).unwrap();
    let sharded = dp(TrainArgs { nproc: Some(2), ..cyclic(tiny_args(false)) });
    let whole = dp(TrainArgs { nproc: Some(2), no_data_sharding: true, ..cyclic(tiny_args(false)) });
    assert_ne!(sharded.losses, whole.losses);
}
