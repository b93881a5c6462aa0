//! --weight-decay-incr-style linear|cosine with --start-weight-decay / --end-weight-decay:
//! Megatron's weight decay schedule over the run's samples. The step's weight decay follows the
//! samples consumed, so a run stopped and resumed takes the same updates as one straight (bit for
//! bit), the schedule changes the run against a constant weight decay, and what Megatron asserts
//! against is refused by name. --apply-wd-to-qk-layernorm puts the decay on the QK-norms too.

mod common;

use common::*;
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

fn rising(style: &str) -> TrainArgs {
    TrainArgs {
        weight_decay_incr_style: Some(style.into()),
        start_weight_decay: Some(0.0),
        end_weight_decay: Some(0.5),
        lr: Some(1e-2),
        ..tiny_args(true)
    }
}

#[test]
fn scheduled_weight_decay_resumes_bit_for_bit_and_changes_the_run() {
    for style in ["linear", "cosine"] {
        let s = settings(&rising(style));
        // 8 iterations of 8 samples: linear 0 → 0.5 over 64 samples.
        let w = s.wd_schedule().unwrap();
        assert_eq!((w.incr, w.wd_at(0), w.wd_at(64)), (64.0, 0.0, 0.5));
        let straight = run(&s, 1);
        let dir = tmp(&format!("wd-{style}"));
        let first = train(&s, &Paths { save: Some(dir.clone()), exit_interval: Some(4), ..Paths::default() }).unwrap();
        let second = train(&s, &Paths { load: Some(dir.clone()), ..Paths::default() }).unwrap();
        assert_eq!(bits(&straight.losses), [bits(&first.losses), bits(&second.losses)].concat(), "{style}");
        let (zero, half) =
            (run(&settings(&constant(rising(style), 0.0)), 1), run(&settings(&constant(rising(style), 0.5)), 1));
        // The first update at weight decay 0 (the schedule's start): as the run without decay.
        assert_eq!(bits(&straight.losses[..2]), bits(&zero.losses[..2]), "{style}: the first update at 0");
        assert_ne!(bits(&straight.losses), bits(&zero.losses), "{style}: the decay rises");
        assert_ne!(bits(&straight.losses), bits(&half.losses), "{style}: not 0.5 throughout");
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// `a` at a constant weight decay.
fn constant(a: TrainArgs, wd: f32) -> TrainArgs {
    TrainArgs {
        weight_decay: Some(wd),
        weight_decay_incr_style: None,
        start_weight_decay: None,
        end_weight_decay: None,
        ..a
    }
}

#[test]
fn what_megatron_asserts_against_is_refused_by_name() {
    let refused = |a: TrainArgs| format!("{:#}", Settings::resolve(&a).unwrap_err());
    let e = refused(TrainArgs { start_weight_decay: Some(0.1), ..tiny_args(false) });
    assert!(e.contains("add --weight-decay-incr-style linear or cosine"), "{e}");
    let e = refused(TrainArgs { end_weight_decay: None, ..rising("linear") });
    assert!(
        e.contains("--weight-decay-incr-style linear needs both --start-weight-decay and --end-weight-decay"),
        "{e}"
    );
    let e = refused(TrainArgs { weight_decay_incr_style: Some("exponential".into()), ..tiny_args(false) });
    assert!(e.contains("--weight-decay-incr-style exponential: use constant, linear or cosine"), "{e}");
}

/// --apply-wd-to-qk-layernorm: weight decay on the QK-norms' parameters (Megatron's name test)
/// and on no other norm or bias: with QK-norm it changes the run; without QK-norm, or at weight
/// decay 0, it changes nothing (bit for bit).
#[test]
fn qk_layernorm_weight_decay_reaches_the_qk_norms_only() {
    let base = |qk_layernorm: bool, wd: f32| TrainArgs {
        qk_layernorm,
        weight_decay: Some(wd),
        lr: Some(1e-2),
        ..tiny_args(true)
    };
    let with = |a: TrainArgs| TrainArgs { apply_wd_to_qk_layernorm: true, ..a };
    let losses = |a: TrainArgs| bits(&run(&settings(&a), 1).losses);
    assert_ne!(losses(with(base(true, 0.5))), losses(base(true, 0.5)), "the QK-norms decayed");
    assert_eq!(losses(with(base(false, 0.5))), losses(base(false, 0.5)), "no QK-norm: nothing else decayed");
    assert_eq!(losses(with(base(true, 0.0))), losses(base(true, 0.0)), "weight decay 0");
    // Megatron's older spelling.
    let cond = |t: &str| TrainArgs { no_weight_decay_cond_type: Some(t.into()), ..base(true, 0.5) };
    assert!(settings(&cond("apply_wd_to_qk_layernorm")).apply_wd_to_qk_layernorm);
    let e = format!("{:#}", Settings::resolve(&cond("all")).unwrap_err());
    assert!(e.contains("--no-weight-decay-cond-type all"), "{e}");
    // The name test picks the QK-norms' weights, not the layers' or the final norm.
    let s = settings(&base(true, 0.5));
    let (_, table) = ferrotron_transformer::GptModel::build(
        s.model_config().unwrap(),
        &ferrotron_core::Device::Cpu,
        ferrotron_core::DType::F32,
        1,
    )
    .unwrap();
    let picked: Vec<&str> = table
        .metas()
        .iter()
        .filter(|m| ferrotron_trainer::settings::qk_layernorm_param(m))
        .map(|m| m.name.as_str())
        .collect();
    assert_eq!(picked.len(), 4, "{picked:?}");
    assert!(
        picked.iter().all(|n| n.ends_with("q_layernorm.weight") || n.ends_with("k_layernorm.weight")),
        "{picked:?}"
    );
}
