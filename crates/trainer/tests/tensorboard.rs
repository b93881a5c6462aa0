//! `--tensorboard-dir`: the event writer's bytes against TensorBoard's own writer
//! (fixtures/tensorboard/make_tb_fixture.py wrote events.bin), and a run's scalars read back
//! from its event file under Megatron's tags.

mod common;

use common::*;
use ferrotron_trainer::settings::{Launch, Paths, TrainArgs};
use ferrotron_trainer::tensorboard::EventWriter;
use ferrotron_trainer::train::{Summary, train};
use std::collections::BTreeMap;

/// The fixture's scalars (make_tb_fixture.py's SCALARS).
const SCALARS: [(f64, i64, &str, f32); 7] = [
    (1733270400.25, 1, "lm loss", 5.5456),
    (1733270400.5, 1, "learning-rate", 0.0),
    (1733270401.75, 2, "lm loss", 5.5491),
    (1733270401.75, 2, "grad-norm", 2.025),
    (1733270402.0, 128, "lm loss vs samples", 4.25),
    (1733270402.0, 0, "batch-size", 8.0),
    (1733270403.125, 300000, "lm loss validation ppl", 1.0e30),
];

#[test]
fn events_are_tensorboards_own_bytes() {
    let dir = tmp("tb-bytes");
    let mut w = EventWriter::create(&dir, 1733270400.0).unwrap();
    for (wall, step, tag, value) in SCALARS {
        w.scalar(tag, value, step, wall).unwrap();
    }
    w.flush().unwrap();
    let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
    assert!(name.starts_with("events.out.tfevents.1733270400."), "{name}");
    let got = std::fs::read(w.path()).unwrap();
    let want = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tensorboard/events.bin")).unwrap();
    assert_eq!(got, want);
    let _ = std::fs::remove_dir_all(dir);
}

/// The scalars of an event file by tag: (step, value) in order. Checks each record's framing
/// (lengths and CRCs are TensorBoard's; the bytes test above pins them) and decodes the protos.
fn read_events(bytes: &[u8]) -> BTreeMap<String, Vec<(i64, f32)>> {
    fn varint(b: &[u8], at: &mut usize) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let x = b[*at];
            *at += 1;
            v |= ((x & 0x7f) as u64) << shift;
            if x < 0x80 {
                return v;
            }
            shift += 7;
        }
    }
    // (field, wire type, payload range or value) of one message.
    fn fields(b: &[u8]) -> Vec<(u64, std::ops::Range<usize>)> {
        let (mut at, mut out) = (0, vec![]);
        while at < b.len() {
            let key = varint(b, &mut at);
            let len = match key & 7 {
                0 => {
                    let s = at;
                    varint(b, &mut at);
                    out.push((key >> 3, s..at));
                    continue;
                }
                1 => 8,
                5 => 4,
                2 => varint(b, &mut at) as usize,
                w => panic!("wire type {w}"),
            };
            out.push((key >> 3, at..at + len));
            at += len;
        }
        out
    }
    let mut out: BTreeMap<String, Vec<(i64, f32)>> = BTreeMap::new();
    let mut at = 0;
    let mut first = true;
    while at < bytes.len() {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        let data = &bytes[at + 12..at + 12 + len];
        at += 16 + len;
        let f = fields(data);
        if first {
            assert!(f.iter().any(|(n, r)| *n == 3 && &data[r.clone()] == b"brain.Event:2"), "the version record first");
            first = false;
            continue;
        }
        let step = f.iter().find(|(n, _)| *n == 2).map_or(0, |(_, r)| varint(&data[r.clone()], &mut 0) as i64);
        let (_, summary) = f.iter().find(|(n, _)| *n == 5).expect("a summary");
        for (_, value) in fields(&data[summary.clone()]) {
            let v = &data[summary.start + value.start..summary.start + value.end];
            let vf = fields(v);
            let tag = vf.iter().find(|(n, _)| *n == 1).map(|(_, r)| String::from_utf8(v[r.clone()].to_vec()).unwrap());
            let x = vf.iter().find(|(n, _)| *n == 2).map(|(_, r)| f32::from_le_bytes(v[r.clone()].try_into().unwrap()));
            out.entry(tag.unwrap()).or_default().push((step, x.unwrap()));
        }
    }
    out
}

#[test]
fn a_runs_scalars_are_megatrons_tags() {
    let dir = tmp("tb-run");
    let args = TrainArgs {
        tensorboard_dir: Some(dir.clone()),
        log_interval: Some(2),
        log_validation_ppl_to_tensorboard: true,
        log_world_size_to_tensorboard: true,
        log_num_zeros_in_grad: true,
        // On the CPU: accepted, nothing logged (no device memory pool).
        log_memory_to_tensorboard: true,
        ..tiny_args(false)
    };
    let s = settings(&args);
    let sum = train(&s, &Paths::default()).unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let ev = read_events(&std::fs::read(&files[0]).unwrap());
    let as_f32 = |l: &[(u64, f64)]| l.iter().map(|&(i, x)| (i as i64, x as f32)).collect::<Vec<_>>();
    let logged: Vec<(u64, f64)> = sum.losses.iter().filter(|(i, _)| i % 2 == 0).cloned().collect();
    assert_eq!(ev["lm loss"], as_f32(&logged));
    let norms: Vec<(u64, f64)> = sum.grad_norms.iter().filter(|(i, _)| i % 2 == 0).cloned().collect();
    assert_eq!(ev["grad-norm"], as_f32(&norms));
    assert_eq!(ev["lm loss validation"], as_f32(&sum.evals));
    let ppl: Vec<(i64, f32)> = sum.evals.iter().map(|&(i, l)| (i as i64, l.exp() as f32)).collect();
    assert_eq!(ev["lm loss validation ppl"], ppl);
    // "vs samples": the same values at the samples consumed (8 a step).
    let by_samples: Vec<(i64, f32)> = as_f32(&logged).into_iter().map(|(i, x)| (8 * i, x)).collect();
    assert_eq!(ev["lm loss vs samples"], by_samples);
    for tag in ["learning-rate", "learning-rate vs samples", "batch-size", "batch-size vs samples"] {
        assert_eq!(ev[tag].len(), logged.len(), "{tag}");
    }
    assert!(ev["batch-size"].iter().all(|&(_, b)| b == 8.0));
    assert!(ev["world-size"].len() == logged.len() && ev["world-size"].iter().all(|&(_, w)| w == 1.0));
    assert!(ev["num-zeros"].len() == logged.len() && ev["num-zeros vs samples"].len() == logged.len());
    assert!(!ev.keys().any(|k| k.starts_with("mem-")), "no memory on the CPU: {:?}", ev.keys());
    let _ = std::fs::remove_dir_all(dir);
}

/// --moe-per-layer-logging: each layer's router losses under Megatron's tags (every layer,
/// dense ones 0), their mean over the MoE layers the logged aggregate, and under expert and
/// pipeline parallelism (each layer held by some ranks only) one rank's values.
#[test]
fn moe_per_layer_logging_gives_each_layers_router_losses() {
    let dir = tmp("tb-moe-layers");
    let args = TrainArgs {
        tensorboard_dir: Some(dir.clone()),
        log_interval: Some(2),
        num_layers: Some(4),
        num_experts: Some(4),
        moe_ffn_hidden_size: Some(24),
        moe_router_topk: Some(2),
        moe_aux_loss_coeff: Some(0.01),
        moe_z_loss_coeff: Some(0.001),
        moe_layer_freq: Some("[1,0,1,1]".into()),
        moe_per_layer_logging: true,
        ..tiny_args(true)
    };
    let s = settings(&args);
    let one = train(&s, &Paths::default()).unwrap();
    assert_eq!(one.router_losses_per_layer.len(), one.router_losses.len());
    for ((i, layers), &(j, lb, z)) in one.router_losses_per_layer.iter().zip(&one.router_losses) {
        assert_eq!((i, layers.len()), (&j, 4));
        assert_eq!(layers[1], (0.0, 0.0), "the dense layer");
        assert!(layers.iter().enumerate().all(|(l, &(a, b))| l == 1 || (a > 0.0 && b > 0.0)), "{layers:?}");
        let mean = |f: fn(&(f64, f64)) -> f64| [0, 2, 3].iter().map(|&l| f(&layers[l])).sum::<f64>() / 3.0;
        assert!(
            (mean(|p| p.0) - lb).abs() < 1e-6 * lb && (mean(|p| p.1) - z).abs() < 1e-6 * z,
            "{layers:?} vs {lb} {z}"
        );
    }
    let ev = read_events(&std::fs::read(std::fs::read_dir(&dir).unwrap().next().unwrap().unwrap().path()).unwrap());
    for l in 0..4 {
        let want: Vec<(i64, f32)> =
            one.router_losses_per_layer.iter().map(|(i, v)| (*i as i64, v[l].0 as f32)).collect();
        assert_eq!(ev[&format!("moe/load_balancing_loss_layer_{l}")], want, "layer {l}");
        assert_eq!(ev[&format!("moe/z_loss_layer_{l}")].len(), want.len());
    }
    let close = |tag: &str, got: &Summary| {
        for ((_, a), (_, b)) in got.router_losses_per_layer.iter().zip(&one.router_losses_per_layer) {
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x.0 - y.0).abs() <= 1e-4 * y.0.abs() && (x.1 - y.1).abs() <= 1e-4 * y.1.abs(),
                    "{tag}: {a:?} vs {b:?}"
                );
            }
        }
        assert_eq!(got.router_losses_per_layer.len(), one.router_losses_per_layer.len(), "{tag}");
    };
    let mut ep = settings(&TrainArgs { tensorboard_dir: None, ..args.clone() });
    ep.moe.as_mut().unwrap().expert_model_parallel_size = 2;
    close("ep2", &train(&ep, &Paths { launch: Launch::Threads(2), ..Paths::default() }).unwrap());
    let mut pp = settings(&TrainArgs { tensorboard_dir: None, ..args });
    pp.pipeline_model_parallel_size = 2;
    close("pp2", &train(&pp, &Paths { launch: Launch::Threads(2), ..Paths::default() }).unwrap());
    let _ = std::fs::remove_dir_all(dir);
}
