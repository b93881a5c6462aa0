//! Sample order against Megatron-Core's own code: tests/fixtures/megatron_gpt_order.json holds
//! what Megatron-Core's GPTDataset, BlendedDataset and split arithmetic give for two small indexed
//! datasets (make_megatron_gpt_order.py runs them); every sample of every case must match, in
//! order, as must numpy's RandomState shuffles and the split boundaries.

use ferrotron_data::{
    IndexedDataset, NumpyGenerator, NumpyRandomState, Part, Sequences, TokenSplit, parse_split, split_of, split_ranges,
    whole_split,
};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn oracle() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("megatron_gpt_order.json")).unwrap()).unwrap()
}

fn parts(v: &Value) -> Vec<Part> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let ds = IndexedDataset::open(fixtures().join(p[1].as_str().unwrap())).unwrap();
            (p[0].as_f64(), Arc::new(Sequences::Indexed(Arc::new(ds))))
        })
        .collect()
}

fn all_samples(s: &TokenSplit) -> Vec<Vec<u64>> {
    (0..s.num_samples()).map(|i| s.sample(i).unwrap().into_iter().map(u64::from).collect()).collect()
}

fn want_samples(v: &Value) -> Option<Vec<Vec<u64>>> {
    v.as_array()
        .map(|a| a.iter().map(|s| s.as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()).collect())
}

#[test]
fn numpy_random_state_shuffles_as_numpy() {
    for c in oracle()["shuffles"].as_array().unwrap() {
        let (seed, n) = (c["seed"].as_u64().unwrap() as u32, c["n"].as_u64().unwrap() as u32);
        let mut x: Vec<u32> = (0..n).collect();
        NumpyRandomState::new(seed).shuffle(&mut x);
        let want: Vec<u32> = c["order"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(x, want, "seed {seed}, {n} elements");
    }
}

#[test]
fn numpy_default_rng_draws_the_mock_lengths_as_numpy() {
    let o = oracle();
    let m = &o["mock_lengths"];
    let got = NumpyGenerator::new(0).integers_u32(1, 4096, m["count"].as_u64().unwrap() as usize);
    let want = |k: &str| m[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect::<Vec<_>>();
    assert_eq!(got[..64], want("first")[..]);
    assert_eq!(got[got.len() - 8..], want("last")[..]);
    assert_eq!(got.iter().map(|&x| x as u64).sum::<u64>(), m["sum"].as_u64().unwrap());
}

#[test]
fn split_ranges_are_megatron_cores() {
    for c in oracle()["splits"].as_array().unwrap() {
        let (split, n) = (c["split"].as_str().unwrap(), c["n"].as_u64().unwrap() as usize);
        let want: Vec<Option<(usize, usize)>> = c["ranges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().map(|r| (r[0].as_u64().unwrap() as usize, r[1].as_u64().unwrap() as usize)))
            .collect();
        let got: Vec<Option<(usize, usize)>> =
            split_ranges(n, parse_split(split).unwrap()).iter().map(|r| r.as_ref().map(|r| (r.start, r.end))).collect();
        assert_eq!(got, want, "--split {split} of {n} sequences");
    }
}

#[test]
fn every_sample_is_megatrons_in_megatrons_order() {
    let o = oracle();
    let cases = o["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 10);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let seq = c["seq_length"].as_u64().unwrap() as usize;
        let seed = c["seed"].as_u64().unwrap() as u32;
        let size = |k: usize| c["sizes"][k].as_u64().unwrap();
        for (k, key) in [(0, "train"), (1, "valid")] {
            let got = if let Some(m) = c.get("mock") {
                let seqs = Sequences::mock(m["vocab_size"].as_u64().unwrap() as u32, m["eod"].as_u64().unwrap() as u32);
                let split = parse_split("1,1,1").unwrap();
                split_of(&[(None, Arc::new(seqs))], split, k, size(k), seq, seed, None).unwrap()
            } else if c["data"].is_array() {
                let split = parse_split(c["split"].as_str().unwrap()).unwrap();
                split_of(&parts(&c["data"]), split, k, size(k), seq, seed, None).unwrap()
            } else {
                let data = &c[if k == 0 { "train_data" } else { "valid_data" }];
                Some(whole_split(&parts(data), k, size(k), seq, seed, None).unwrap())
            };
            let want = want_samples(&c[key]);
            // The mock cases keep the first samples and the count.
            if let Some(n) = c.get("num_samples") {
                let g = got.as_ref().unwrap();
                assert_eq!(g.num_samples() as u64, n[k].as_u64().unwrap(), "{name}: {key} samples");
                let first: Vec<Vec<u64>> = (0..want.as_ref().unwrap().len())
                    .map(|i| g.sample(i).unwrap().into_iter().map(u64::from).collect())
                    .collect();
                assert_eq!(Some(first), want, "{name}: {key}");
                continue;
            }
            let got = got.as_ref().map(all_samples);
            assert_eq!(got.as_ref().map(Vec::len), want.as_ref().map(Vec::len), "{name}: {key} samples");
            assert_eq!(got, want, "{name}: {key}");
            if let Some(w) = &want {
                assert!(w.len() as u64 >= size(k), "{name}: {key} has the samples asked for");
                assert!(w.iter().all(|s| s.len() == seq + 1));
            }
        }
    }
}
