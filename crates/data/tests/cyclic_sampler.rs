//! --dataloader-type cyclic: `torch_randperm` against PyTorch's own permutations
//! (fixtures/torch_randperm.json, written by make_torch_randperm.py on a machine with PyTorch),
//! and `CyclicSampler` against Megatron's MegatronPretrainingRandomSampler's arithmetic, read off
//! its iteration: each rank's micro-batches over epochs, with and without data sharding.

use ferrotron_data::{CyclicSampler, torch_randperm};

#[test]
fn torch_randperm_is_pytorchs() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/torch_randperm.json"))
        .expect("the fixture");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() > 40 && cases.iter().any(|c| c["n"] == 20000));
    for c in cases {
        let (n, seed) = (c["n"].as_u64().unwrap() as usize, c["seed"].as_u64().unwrap());
        let want: Vec<usize> = c["perm"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        assert_eq!(torch_randperm(n, seed), want, "randperm({n}) at seed {seed}");
    }
}

/// Megatron's sampler as a generator over epochs: the micro-batches rank `rank` yields, in order,
/// until `count` of them (its __iter__ re-entered at each epoch's end, as Megatron's cyclic
/// iterator does).
fn megatron(total: usize, mb: usize, dp: usize, rank: usize, sharding: bool, count: usize) -> Vec<Vec<usize>> {
    let (mut consumed, mut out) = (0usize, vec![]);
    let active = total - total % (mb * dp);
    while out.len() < count {
        let (epoch, cur) = (consumed / active, consumed % active);
        let idx: Vec<usize> = if sharding {
            let bucket = total / (mb * dp) * mb;
            torch_randperm(bucket, epoch as u64)[cur / dp..].iter().map(|&x| rank * bucket + x).collect()
        } else {
            let full = total / mb * mb;
            torch_randperm(full, epoch as u64)[cur..].iter().skip(rank).step_by(dp).copied().collect()
        };
        for b in idx.chunks_exact(mb) {
            consumed += mb * dp;
            out.push(b.to_vec());
            if out.len() == count {
                break;
            }
        }
    }
    out
}

/// Without sharding the cases keep Megatron's ranks in step (each rank's strided share of the
/// bucket holds the epoch's micro-batches exactly; see sampler.rs for where Megatron's do not).
#[test]
fn micro_batches_follow_megatrons_sampler_over_epochs() {
    for (total, mb, dp, sharding) in
        [(20, 2, 1, true), (23, 2, 2, true), (23, 2, 2, false), (40, 3, 4, true), (38, 2, 3, false)]
    {
        let s = CyclicSampler::new("train", total, mb, dp, sharding).unwrap();
        assert_eq!(s.epoch_len() as usize, total - total % (mb * dp));
        let count = 3 * total / (mb * dp) + 2;
        for rank in 0..dp {
            let want = megatron(total, mb, dp, rank, sharding, count);
            let got: Vec<Vec<usize>> = (0..count).map(|j| s.micro_batch((j * mb * dp) as u64, rank).unwrap()).collect();
            assert_eq!(got, want, "total {total}, mb {mb}, dp {dp}, sharding {sharding}, rank {rank}");
        }
        // One epoch reads distinct samples over all ranks; the next epoch another order.
        let per_epoch = s.epoch_len() as usize / (mb * dp);
        let mut seen: Vec<usize> = (0..per_epoch)
            .flat_map(|j| (0..dp).map(move |r| (j, r)))
            .flat_map(|(j, r)| s.micro_batch((j * mb * dp) as u64, r).unwrap())
            .collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), per_epoch * mb * dp, "an epoch repeats no sample");
        assert!(seen.iter().all(|&i| i < total));
        let next: Vec<usize> = s.micro_batch(s.epoch_len(), 0).unwrap();
        assert_ne!(next, s.micro_batch(0, 0).unwrap(), "epoch 1 draws its own order");
    }
    let e = CyclicSampler::new("valid", 3, 2, 2, true).unwrap_err().to_string();
    assert!(e.contains("valid split's 3 samples") && e.contains("--micro-batch-size"), "{e}");
    let s = CyclicSampler::new("train", 10, 2, 2, true).unwrap();
    assert!(s.micro_batch(3, 0).is_err() && s.micro_batch(0, 2).is_err());
}
