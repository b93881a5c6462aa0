//! `--log-params-norm`: the logged norm is that of the saved parameters (the oracle: the
//! checkpoint's whole tensors, summed here in f64), and the same under layouts that split,
//! replicate or shard them (tensor × pipeline parallel, data parallel with the distributed
//! optimizer). `--log-num-zeros-in-grad`: the logged count against the corpus's unused token
//! ids, and under the same layouts.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Launch, Paths, Settings, TrainArgs};
use ferrotron_trainer::train::train;

/// `key` of each training line of a metrics file, by iteration.
fn logged(file: &std::path::Path, key: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["iteration"].as_u64()?, v.get(key)?.as_f64()?))
        })
        .collect()
}

fn norms(file: &std::path::Path) -> Vec<(u64, f64)> {
    logged(file, "params_norm")
}

/// `s` as tensor × pipeline parallel 2 × 2 and as data parallel 2 with the distributed
/// optimizer (buckets of `bucket` elements, or the default).
fn layouts(s: &Settings, bucket: Option<usize>) -> [Settings; 2] {
    let mut tp_pp = s.clone();
    tp_pp.tensor_model_parallel_size = 2;
    tp_pp.pipeline_model_parallel_size = 2;
    let mut dp = s.clone();
    dp.use_distributed_optimizer = true;
    if bucket.is_some() {
        dp.ddp_bucket_size = bucket;
    }
    [tp_pp, dp]
}

#[test]
fn params_norm_is_the_saved_parameters_norm_in_any_layout() {
    let s1 = settings(&TrainArgs { log_params_norm: true, num_layers: Some(4), ..tiny_args(false) });
    let dir = tmp("params-norm");
    let metrics = dir.join("one.jsonl");
    train(&s1, &Paths { save: Some(dir.join("ck")), metrics: Some(metrics.clone()), ..Paths::default() }).unwrap();
    let one = norms(&metrics);
    assert_eq!(one.len(), 8, "a norm at each log line: {one:?}");
    let ck = checkpoint::load_params(&dir.join("ck")).unwrap();
    let want = ck.tensors.values().flat_map(|(_, v)| v.iter()).map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let last = one.last().unwrap().1;
    assert!((last - want).abs() <= 1e-5 * want, "logged {last}, the checkpoint's {want}");
    assert!(one.windows(2).any(|w| w[0].1 != w[1].1), "the norm moves as the model trains: {one:?}");

    let [tp_pp, dp] = layouts(&s1, None);
    for (tag, s, n) in [("tp2 × pp2", &tp_pp, 4), ("dp2 distributed", &dp, 2)] {
        let file = dir.join(format!("{n}.jsonl"));
        train(s, &Paths { launch: Launch::Threads(n), metrics: Some(file.clone()), ..Paths::default() }).unwrap();
        close(tag, &norms(&file), &one);
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn zeros(file: &std::path::Path) -> Vec<(u64, f64)> {
    logged(file, "num_zeros_in_grad")
}

/// `--log-num-zeros-in-grad`: with untied embeddings the input-embedding row of every token id
/// the corpus never holds has a zero gradient at every step (the oracle: at least hidden × those
/// ids, counted from the built-in corpus here), and the count is the same, exactly, when tensor
/// and pipeline parallelism split the rows, and within a few elements when the distributed
/// optimizer sums the data-parallel halves (a sum may cancel to an exact zero).
#[test]
fn num_zeros_in_grad_counts_each_gradient_once_in_any_layout() {
    let args = TrainArgs {
        log_num_zeros_in_grad: true,
        untie_embeddings_and_output_weights: true,
        num_layers: Some(4),
        ..tiny_args(false)
    };
    let s1 = settings(&args);
    let dir = tmp("num-zeros");
    let metrics = dir.join("one.jsonl");
    train(&s1, &Paths { metrics: Some(metrics.clone()), ..Paths::default() }).unwrap();
    let one = zeros(&metrics);
    assert_eq!(one.len(), 8, "a count at each log line: {one:?}");
    // Byte tokens, the end of a document as id 0.
    let mut used = [false; 256];
    used[0] = true;
    for d in ferrotron_data::corpus::documents(s1.seed, s1.corpus_docs) {
        d.bytes().for_each(|b| used[b as usize] = true);
    }
    let unused = used.iter().filter(|u| !**u).count() as f64;
    assert!(unused > 100.0, "{unused} ids never used");
    for &(i, n) in &one {
        assert!(n >= 32.0 * unused && n < 51_648.0 / 2.0, "iteration {i}: {n} zeros, {unused} rows of 32 unused");
    }
    // Small buckets: every bucket is sharded over both ranks, so each holds some of the
    // embedding's zero rows.
    let [tp_pp, dp] = layouts(&s1, Some(1000));
    for (tag, s, n, slack) in [("tp2 × pp2", &tp_pp, 4, 0.0), ("dp2 distributed", &dp, 2, 4.0)] {
        let file = dir.join(format!("{n}.jsonl"));
        train(s, &Paths { launch: Launch::Threads(n), metrics: Some(file.clone()), ..Paths::default() }).unwrap();
        let got = zeros(&file);
        assert_eq!(got.len(), one.len(), "{tag}");
        for ((i, a), (_, b)) in got.iter().zip(&one) {
            assert!((a - b).abs() <= slack, "{tag} iteration {i}: {a} zeros, one rank {b}");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
