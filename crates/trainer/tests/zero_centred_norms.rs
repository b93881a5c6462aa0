//! --apply-layernorm-1p (zero-centred norm weights: scale 1 + w, w from 0). In f32 it is the plain
//! model under another parametrisation (norm weights get no weight decay, so the same updates move
//! w where the plain run moves 1 + w): the losses follow the plain run's, the saved norm weights
//! are the plain run's less 1, it trains under tensor and sequence parallelism as one rank does,
//! round-trips through the model flags, and a checkpoint resumes only under the flag it was saved
//! with.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Paths, TrainArgs};
use ferrotron_trainer::train::train;

#[test]
fn zero_centred_norms_train_as_plain_norms_at_one_plus_w() {
    for llama in [false, true] {
        let tag = format!("1p-{llama}");
        // QK-norm in the Llama-style run: its norms are zero-centred too.
        let base = TrainArgs { qk_layernorm: llama, ..tiny_args(llama) };
        let args = TrainArgs { apply_layernorm_1p: true, ..base.clone() };
        let s = settings(&args);
        let c = s.model_config().unwrap();
        assert!(c.layer.zero_centred_gamma);
        assert!(ferrotron_trainer::settings::model_args(&c).apply_layernorm_1p);

        let (dir, plain_dir) = (tmp(&format!("{tag}-a")), tmp(&format!("{tag}-b")));
        let one = train(&s, &Paths { save: Some(dir.clone()), ..Paths::default() }).unwrap();
        let plain = train(&settings(&base), &Paths { save: Some(plain_dir.clone()), ..Paths::default() }).unwrap();
        follows(&format!("llama {llama}: plain norms"), &plain, &one);
        let (a, b) = (checkpoint::load_params(&dir).unwrap(), checkpoint::load_params(&plain_dir).unwrap());
        let mut norms = 0;
        for (name, (_, w)) in a.tensors.iter().filter(|(n, _)| n.ends_with("layernorm.weight")) {
            let (_, pw) = &b.tensors[name];
            for (x, y) in w.iter().zip(pw) {
                assert!((x + 1.0 - y).abs() <= 1e-4, "llama {llama} {name}: {x} + 1 vs plain {y}");
            }
            assert!(w.iter().any(|&x| x != 0.0), "{name} trained");
            norms += 1;
        }
        let per_layer = if llama { 4 } else { 2 };
        assert_eq!(norms, 2 * per_layer + 1, "llama {llama}: the layers' and the final norm");

        let mut tp = s.clone();
        tp.tensor_model_parallel_size = 2;
        tp.sequence_parallel = true;
        follows(&format!("llama {llama}: tp2 with SP"), &run(&tp, 2), &one);

        // Resumed without the flag its weights would scale by 1 less: refused, naming it.
        let without = settings(&TrainArgs { train_iters: Some(10), ..base });
        let e = train(&without, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap_err();
        assert!(format!("{e:#}").contains("saved with --apply-layernorm-1p and this run is without it"), "{e:#}");
        let with = settings(&TrainArgs { train_iters: Some(10), ..args });
        let resumed = train(&with, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap();
        assert_eq!(resumed.losses.iter().map(|l| l.0).collect::<Vec<_>>(), [9, 10]);
        for d in [dir, plain_dir] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}
