//! N steps straight equals N/2 steps, save, load, N/2 steps: the same losses and parameters, bit
//! for bit (f32 and bf16 with fp32 master weights).

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::Paths;
use ferrotron_trainer::train::train;

fn check(llama: bool, bf16: bool) {
    let mut args = tiny_args(llama);
    args.bf16 = bf16;
    let s = settings(&args);
    let tag = format!("resume-{llama}-{bf16}");
    let straight_dir = tmp(&format!("{tag}-a"));
    let straight = train(
        &s,
        &Paths {
            save: Some(straight_dir.clone()),
            load: None,
            progress: false,
            exit_interval: None,
            device: Default::default(),
        },
    )
    .unwrap();

    // First half (the same 8-iteration run, stopped by --exit-interval), then resume its checkpoint.
    let half_dir = tmp(&format!("{tag}-b"));
    let first = train(
        &s,
        &Paths {
            save: Some(half_dir.clone()),
            load: None,
            progress: false,
            exit_interval: Some(4),
            device: Default::default(),
        },
    )
    .unwrap();
    assert_eq!(first.losses.len(), 4);
    let resume_dir = tmp(&format!("{tag}-c"));
    let second = train(
        &s,
        &Paths {
            save: Some(resume_dir.clone()),
            load: Some(half_dir.clone()),
            progress: false,
            exit_interval: None,
            device: Default::default(),
        },
    )
    .unwrap();

    let tail: Vec<u64> = straight.losses[4..].iter().map(|(_, l)| l.to_bits()).collect();
    let resumed: Vec<u64> = second.losses.iter().map(|(_, l)| l.to_bits()).collect();
    assert_eq!(second.losses.first().map(|x| x.0), Some(5));
    let head: Vec<u64> = straight.losses[..4].iter().map(|(_, l)| l.to_bits()).collect();
    assert_eq!(head, first.losses.iter().map(|(_, l)| l.to_bits()).collect::<Vec<_>>());
    assert_eq!(tail, resumed, "losses differ after resume: {:?} vs {:?}", &straight.losses[4..], second.losses);
    let a = checkpoint::load(&straight_dir).unwrap();
    let b = checkpoint::load(&resume_dir).unwrap();
    assert_eq!(a.state.iteration, 8);
    assert_eq!(b.state.iteration, 8);
    assert!(a.params.iter().zip(&b.params).all(|(x, y)| x.to_bits() == y.to_bits()), "params differ");
    assert!(a.master.iter().zip(&b.master).all(|(x, y)| x.to_bits() == y.to_bits()), "master weights differ");
    for d in [straight_dir, half_dir, resume_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn gpt2_style_resume_is_bit_exact() {
    check(false, false);
}

#[test]
fn llama_style_bf16_resume_is_bit_exact() {
    check(true, true);
}
