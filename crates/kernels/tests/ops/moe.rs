use crate::util::*;
use ferrotron_core::{DType, Device, Tensor};
use ferrotron_kernels::{self as k, cpu::moe as m};
use proptest::prelude::*;

fn softmax(x: &[f64]) -> Vec<f64> {
    let mx = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = x.iter().map(|v| (v - mx).exp()).sum();
    x.iter().map(|v| (v - mx).exp() / z).collect()
}

fn f_score(s: k::Score, x: f64) -> f64 {
    match s {
        k::Score::SqrtSoftplus => x.exp().ln_1p().sqrt(),
        _ => 1.0 / (1.0 + (-x).exp()),
    }
}

/// Indices of `v` sorted by (−value, index).
fn order(v: &[f64]) -> Vec<usize> {
    let mut o: Vec<usize> = (0..v.len()).collect();
    o.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap().then(a.cmp(&b)));
    o
}

/// The naive router: the selection scores (logits, softmax, or f(x) + bias), the group limit by
/// sorting each group, the experts sorted by (−score, index), then the weights.
fn route_ref(logits: &[f64], e: usize, r: &k::TopK, bias: Option<&[f64]>) -> (Vec<f64>, Vec<u32>) {
    let (mut probs, mut experts) = (vec![], vec![]);
    for row in logits.chunks(e) {
        let mut sel: Vec<f64> = match r.score {
            k::Score::Softmax if r.pre_softmax => softmax(row),
            k::Score::Softmax => row.to_vec(),
            s => row.iter().map(|&x| f_score(s, x)).collect(),
        };
        if let Some(b) = bias {
            sel.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        }
        if let Some(g) = r.groups {
            let size = e / g.num;
            let per = r.k / g.topk;
            let gs: Vec<f64> = sel.chunks(size).map(|grp| order(grp)[..per].iter().map(|&i| grp[i]).sum()).collect();
            let keep = &order(&gs)[..g.topk];
            for (j, grp) in sel.chunks_mut(size).enumerate() {
                if !keep.contains(&j) {
                    grp.fill(f64::NEG_INFINITY);
                }
            }
        }
        let top = &order(&sel)[..r.k];
        let w: Vec<f64> = match r.score {
            k::Score::Softmax if r.pre_softmax => {
                let s = softmax(row);
                top.iter().map(|&i| s[i]).collect()
            }
            k::Score::Softmax => softmax(&top.iter().map(|&i| row[i]).collect::<Vec<_>>()),
            s => {
                let f: Vec<f64> = top.iter().map(|&i| f_score(s, row[i])).collect();
                let d: f64 = if r.k > 1 { f.iter().sum::<f64>() + 1e-20 } else { 1.0 };
                f.iter().map(|v| v / d).collect()
            }
        };
        probs.extend(w.iter().map(|p| p * r.scale as f64));
        experts.extend(top.iter().map(|&i| i as u32));
    }
    (probs, experts)
}

fn score_of(i: u8) -> k::Score {
    [k::Score::Softmax, k::Score::Sigmoid, k::Score::SqrtSoftplus][i as usize % 3]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn route_fwd_and_fd(n in 1usize..6, e in 1usize..8, kk in 1usize..4, pre_softmax: bool, scaled: bool, score in 0u8..3, seed: u64) {
        let kk = kk.min(e);
        let score = score_of(score);
        let r = k::TopK { score, ..k::TopK::new(kk, pre_softmax, if scaled { 2.5 } else { 1.0 }) };
        let x: Vec<f64> = randv(n * e, seed).iter().map(|v| v * 2.0).collect();
        let (p, ix) = k::moe_route(&t32(&Device::Cpu, &x, &[n, e]), &r, None).unwrap();
        let (want_p, want_ix) = route_ref(&x, e, &r, None);
        prop_assert_eq!(ix.to_vec::<u32>().unwrap(), want_ix.clone());
        assert_close(&host(&p), &want_p, 1e-5, 1e-6, "probs");

        let dp = randv(n * kk, seed ^ 5);
        let mut dl = vec![f64::NAN; n * e];
        let r64 = m::Routing { k: kk, pre_softmax, scale: r.scale as f64, score, groups: None, bias: None };
        m::topk_route_bwd(&x, &want_ix, &dp, e, &r64, &mut dl);
        fd_check(&x, &dl, |x| {
            let (mut p, mut ix) = (vec![0.0; n * kk], vec![0u32; n * kk]);
            m::topk_route(x, e, &r64, &mut p, &mut ix);
            dot(&p, &dp)
        }, "route dlogits");
        // The tensor op gives the same gradient.
        let got = k::moe_route_bwd(&t32(&Device::Cpu, &x, &[n, e]), &ix, &t32(&Device::Cpu, &dp, &[n, kk]), &r).unwrap();
        assert_close(&host(&got), &dl, 1e-4, 1e-5, "moe_route_bwd");
    }

    /// Group-limited routing and the expert bias: the choice as the naive router makes it; the
    /// weights' gradient with the choice fixed (the bias and groups move only the choice).
    #[test]
    fn grouped_and_biased_routes_match_naive(
        n in 1usize..6, groups in 1usize..5, size in 1usize..5, gk in 1usize..5, per in 1usize..3,
        score in 0u8..3, biased: bool, pre_softmax: bool, seed: u64,
    ) {
        let (e, gk) = (groups * size, gk.min(groups));
        let kk = (gk * per).min(gk * size);
        let score = score_of(score);
        let biased = biased && score != k::Score::Softmax;
        let r = k::TopK { score, groups: Some(k::Groups { num: groups, topk: gk }), ..k::TopK::new(kk, pre_softmax, 1.5) };
        let x: Vec<f64> = randv(n * e, seed).iter().map(|v| v * 3.0).collect();
        let b: Vec<f64> = randv(e, seed ^ 9).iter().map(|v| v * 0.5).collect();
        let bias = biased.then(|| t32(&Device::Cpu, &b, &[e]));
        let (p, ix) = k::moe_route(&t32(&Device::Cpu, &x, &[n, e]), &r, bias.as_ref()).unwrap();
        let (want_p, want_ix) = route_ref(&x, e, &r, biased.then_some(&b[..]));
        prop_assert_eq!(ix.to_vec::<u32>().unwrap(), want_ix.clone());
        assert_close(&host(&p), &want_p, 1e-5, 1e-6, "probs");
        // The weights as a function of the logits at the chosen experts.
        let dp = randv(n * kk, seed ^ 5);
        let r64 = m::Routing { k: kk, pre_softmax, scale: 1.5, score, groups: None, bias: None };
        let mut dl = vec![f64::NAN; n * e];
        m::topk_route_bwd(&x, &want_ix, &dp, e, &r64, &mut dl);
        let weights = |x: &[f64]| -> f64 {
            let mut total = 0.0;
            for (t, row) in x.chunks(e).enumerate() {
                let chosen = &want_ix[t * kk..(t + 1) * kk];
                let w: Vec<f64> = match score {
                    k::Score::Softmax if pre_softmax => { let s = softmax(row); chosen.iter().map(|&i| s[i as usize]).collect() }
                    k::Score::Softmax => softmax(&chosen.iter().map(|&i| row[i as usize]).collect::<Vec<_>>()),
                    s => {
                        let f: Vec<f64> = chosen.iter().map(|&i| f_score(s, row[i as usize])).collect();
                        let d: f64 = if kk > 1 { f.iter().sum::<f64>() + 1e-20 } else { 1.0 };
                        f.iter().map(|v| v / d).collect()
                    }
                };
                total += w.iter().zip(&dp[t * kk..]).map(|(w, d)| 1.5 * w * d).sum::<f64>();
            }
            total
        };
        fd_check(&x, &dl, weights, "grouped route dlogits");
    }

    #[test]
    fn router_loss_values_and_fd(
        n_per in 1usize..5, seqs in 1usize..4, e in 1usize..8, kk in 1usize..3, extra in 0usize..3, score in 0u8..3, seed: u64,
    ) {
        // `seqs` sequences of n_per rows here (of n_per + extra tokens each in the whole
        // micro-batch): 1 is the micro-batch's loss, more DeepSeek's sequence-level one.
        let (kk, n) = (kk.min(e), n_per * seqs);
        let x = randv(n * e, seed);
        let counts: Vec<f64> = (0..seqs * e).map(|i| ((i * 7 + seed as usize % 5) % (n_per + 2)) as f64).collect();
        let (per_seq, total) = (n_per + extra, (n_per + extra) * seqs);
        let score = score_of(score);
        let c = m::RouterLossCoeffs { topk: kk, total_tokens: total as f64, aux: 0.3, z: 0.05, grad_scale: 0.5, score, seqs };
        // Naive values: the softmax, or f(x) normalised over the row.
        let s: Vec<Vec<f64>> = x.chunks(e).map(|r| match score {
            k::Score::Softmax => softmax(r),
            s => { let f: Vec<f64> = r.iter().map(|&v| f_score(s, v)).collect(); let d: f64 = f.iter().sum::<f64>() + 1e-20; f.iter().map(|v| v / d).collect() }
        }).collect();
        // The mean over sequences of each one's loss, E / (K·T_s²) Σ_e c[s, e] Σ_{rows of s} S.
        let aux_ref: f64 = (0..seqs).map(|q| {
            let rows = &s[q * n_per..(q + 1) * n_per];
            (0..e).map(|j| rows.iter().map(|r| r[j]).sum::<f64>() * counts[q * e + j]).sum::<f64>()
                * e as f64 / (kk as f64 * (per_seq * per_seq) as f64)
        }).sum::<f64>() / seqs as f64;
        let z_ref: f64 = x.chunks(e).map(|r| {
            let mx = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + r.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
            lse * lse
        }).sum::<f64>() / total as f64; // the mean over the micro-batch's tokens, these n among them
        let mut dl = vec![f64::NAN; n * e];
        let (aux, z) = m::router_loss(&x, e, &counts, c, &mut dl);
        assert_close(&[aux, z], &[aux_ref, z_ref], 1e-12, 1e-12, "aux, z");
        fd_check(&x, &dl, |x| {
            let mut d = vec![0.0; n * e];
            let (a, z) = m::router_loss(x, e, &counts, c, &mut d);
            c.grad_scale * (c.aux * a + c.z * z)
        }, "router loss dlogits");
        // The tensor op in f32.
        let rl = k::RouterLoss { topk: kk, total_tokens: total, aux_coeff: 0.3, z_coeff: 0.05, grad_scale: 0.5, score, seqs };
        let shape = if seqs > 1 { vec![seqs, e] } else { vec![e] };
        let (v, d) = k::moe_router_loss(&t32(&Device::Cpu, &x, &[n, e]), &t32(&Device::Cpu, &counts, &shape), &rl).unwrap();
        assert_close(&host(&v), &[aux_ref, z_ref], 1e-5, 1e-6, "moe_router_loss values");
        assert_close(&host(&d), &dl, 1e-4, 1e-6, "moe_router_loss dlogits");
    }

    #[test]
    fn sort_and_combine(n in 1usize..7, e in 1usize..6, kk in 1usize..3, c in 1usize..5, seed: u64) {
        let kk = kk.min(e);
        let dev = Device::Cpu;
        let x: Vec<f64> = randv(n * e, seed);
        let (probs, experts) = k::moe_route(&t32(&dev, &x, &[n, e]), &k::TopK::new(kk, false, 1.0), None).unwrap();
        let sort = k::moe_sort(&experts, e).unwrap();
        let (ix, perm, slot) = (experts.to_vec::<u32>().unwrap(), sort.perm.to_vec::<u32>().unwrap(), sort.slot.to_vec::<u32>().unwrap());
        // Rows grouped by expert in order, tokens ascending within each; slot inverts perm.
        let mut row = 0;
        for ex in 0..e {
            let toks: Vec<u32> = (0..n as u32).filter(|&t| ix[t as usize * kk..(t as usize + 1) * kk].contains(&(ex as u32))).collect();
            prop_assert_eq!(sort.tokens_per_expert[ex], toks.len());
            prop_assert_eq!(&perm[row..row + toks.len()], &toks[..]);
            row += toks.len();
        }
        for t in 0..n {
            for j in 0..kk {
                let r = slot[t * kk + j] as usize;
                prop_assert_eq!(perm[r] as usize, t);
                let first = sort.tokens_per_expert[..ix[t * kk + j] as usize].iter().sum::<usize>();
                prop_assert!(r >= first && r < first + sort.tokens_per_expert[ix[t * kk + j] as usize]);
            }
        }
        // Combine against the naive sum; its backward is exact for a linear map.
        let yp = randv(n * kk * c, seed ^ 3);
        let pv = host(&probs);
        let y = k::moe_unpermute(&t32(&dev, &yp, &[n * kk, c]), &sort.slot, &probs).unwrap();
        let want: Vec<f64> = (0..n).flat_map(|t| {
            let (yp, pv, slot) = (&yp, &pv, &slot);
            (0..c).map(move |i| (0..kk).map(|j| pv[t * kk + j] * yp[slot[t * kk + j] as usize * c + i]).sum())
        }).collect();
        assert_close(&host(&y), &want, 1e-5, 1e-6, "moe_unpermute");
        let dy = randv(n * c, seed ^ 4);
        let (dyp, dp) = k::moe_unpermute_bwd(&t32(&dev, &yp, &[n * kk, c]), &sort.slot, &probs, &t32(&dev, &dy, &[n, c])).unwrap();
        let (mut dyp64, mut dp64) = (vec![f64::NAN; n * kk * c], vec![f64::NAN; n * kk]);
        m::unpermute_bwd(&yp, &slot, &pv, &dy, c, kk, &mut dyp64, &mut dp64);
        assert_close(&host(&dyp), &dyp64, 1e-5, 1e-6, "dyp");
        assert_close(&host(&dp), &dp64, 1e-5, 1e-6, "dprobs");
        let f = |yp: &[f64], pv: &[f64]| { let mut y = vec![0.0; n * c]; m::unpermute(yp, &slot, pv, c, kk, &mut y); dot(&y, &dy) };
        fd_check(&yp, &dyp64, |v| f(v, &pv), "unpermute dyp");
        fd_check(&pv, &dp64, |v| f(&yp, v), "unpermute dprobs");
    }
}

proptest! {
    /// Token dropping against a naive capacity: each expert keeps ⌈N·k / E · factor⌉ of its
    /// copies (the largest weights, ties to the earlier copy, or the earliest); the sort gives
    /// dropped copies no row, and the combine and its backward skip them (finite differences).
    #[test]
    fn drop_and_combine(n in 1usize..9, e in 1usize..6, kk in 1usize..3, c in 1usize..4, factor in 0.1f64..1.5, by_position: bool, seed: u64) {
        let kk = kk.min(e);
        let dev = Device::Cpu;
        let (probs, experts) = k::moe_route(&t32(&dev, &randv(n * e, seed), &[n, e]), &k::TopK::new(kk, false, 1.0), None).unwrap();
        let policy = if by_position { k::DropPolicy::Position } else { k::DropPolicy::Probs };
        let cap = k::Capacity { factor, policy };
        let kept = k::moe_drop(&experts, &probs, e, &cap).unwrap();
        let (ix, kx, pv) = (experts.to_vec::<u32>().unwrap(), kept.to_vec::<u32>().unwrap(), host(&probs));
        let capacity = ((n * kk) as f64 / e as f64 * factor).ceil() as usize;
        prop_assert_eq!(cap.per_expert(n, kk, e), capacity);
        for ex in 0..e as u32 {
            let mut copies: Vec<usize> = (0..n * kk).filter(|&i| ix[i] == ex).collect();
            if !by_position {
                copies.sort_by(|&a, &b| pv[b].partial_cmp(&pv[a]).unwrap().then(a.cmp(&b)));
            }
            for (r, &i) in copies.iter().enumerate() {
                prop_assert_eq!(kx[i], if r < capacity { ex } else { k::DROPPED }, "copy {} of expert {}", i, ex);
            }
        }
        let sort = k::moe_sort(&kept, e).unwrap();
        let slot = sort.slot.to_vec::<u32>().unwrap();
        // The same sort in one read, with the counts before the drop beside it.
        let capped = k::moe_sort_capped(&experts, &probs, e, &cap).unwrap();
        prop_assert_eq!(capped.slot.to_vec::<u32>().unwrap(), slot.clone());
        prop_assert_eq!(capped.perm.to_vec::<u32>().unwrap(), sort.perm.to_vec::<u32>().unwrap());
        prop_assert_eq!(&capped.tokens_per_expert, &sort.tokens_per_expert);
        let routed: Vec<usize> = (0..e as u32).map(|x| ix.iter().filter(|&&y| y == x).count()).collect();
        prop_assert_eq!(&capped.routed_per_expert, &routed);
        let rows = kx.iter().filter(|&&x| x != k::DROPPED).count();
        prop_assert_eq!(sort.perm.dims(), &[rows]);
        prop_assert_eq!(sort.tokens_per_expert.iter().sum::<usize>(), rows);
        for (i, &x) in kx.iter().enumerate() {
            prop_assert_eq!(slot[i] == k::DROPPED, x == k::DROPPED);
        }
        let yp = randv(rows * c, seed ^ 3);
        let y = k::moe_unpermute(&t32(&dev, &yp, &[rows, c]), &sort.slot, &probs).unwrap();
        let want: Vec<f64> = (0..n).flat_map(|t| {
            let (yp, pv, slot) = (&yp, &pv, &slot);
            (0..c).map(move |i| (0..kk).filter(|&j| slot[t * kk + j] != k::DROPPED).map(|j| pv[t * kk + j] * yp[slot[t * kk + j] as usize * c + i]).sum())
        }).collect();
        assert_close(&host(&y), &want, 1e-5, 1e-6, "dropped moe_unpermute");
        let dy = randv(n * c, seed ^ 4);
        let (dyp, dp) = k::moe_unpermute_bwd(&t32(&dev, &yp, &[rows, c]), &sort.slot, &probs, &t32(&dev, &dy, &[n, c])).unwrap();
        prop_assert_eq!(dyp.dims(), &[rows, c]);
        let f = |yp: &[f64], pv: &[f64]| { let mut y = vec![0.0; n * c]; m::unpermute(yp, &slot, pv, c, kk, &mut y); dot(&y, &dy) };
        fd_check(&yp, &host(&dyp), |v| f(v, &pv), "dropped unpermute dyp");
        fd_check(&pv, &host(&dp), |v| f(&yp, v), "dropped unpermute dprobs");
    }
}

#[test]
fn bad_routing_input_is_named() {
    let dev = Device::Cpu;
    let logits = t32(&dev, &randv(6, 1), &[2, 3]);
    let e = k::moe_route(&logits, &k::TopK::new(4, false, 1.0), None).unwrap_err().to_string();
    assert!(e.contains("top-k 4") && e.contains("3 experts"), "{e}");
    let bias = t32(&dev, &[0.0; 3], &[3]);
    let e = k::moe_route(&logits, &k::TopK::new(1, false, 1.0), Some(&bias)).unwrap_err().to_string();
    assert!(e.contains("expert bias") && e.contains("sigmoid"), "{e}");
    let sig = k::TopK { score: k::Score::Sigmoid, ..k::TopK::new(1, false, 1.0) };
    let e = k::moe_route(&logits, &sig, Some(&t32(&dev, &[0.0; 2], &[2]))).unwrap_err().to_string();
    assert!(e.contains("shape"), "{e}");
    let grouped = |num, topk, kk| k::TopK { groups: Some(k::Groups { num, topk }), ..k::TopK::new(kk, false, 1.0) };
    let e = k::moe_route(&logits, &grouped(2, 1, 1), None).unwrap_err().to_string();
    assert!(e.contains("3 experts cannot be split into 2 equal groups"), "{e}");
    let e = k::moe_route(&logits, &grouped(3, 1, 2), None).unwrap_err().to_string();
    assert!(e.contains("group top-k 1 of 3 groups of 1 experts cannot hold top-k 2"), "{e}");
    let rl = |seqs, total_tokens| k::RouterLoss {
        topk: 1,
        total_tokens,
        aux_coeff: 1.0,
        z_coeff: 0.0,
        grad_scale: 1.0,
        score: k::Score::Softmax,
        seqs,
    };
    let e = k::moe_router_loss(&logits, &t32(&dev, &[1.0; 6], &[2, 3]), &rl(3, 6)).unwrap_err().to_string();
    assert!(e.contains("shape"), "{e}");
    let e = k::moe_router_loss(&logits, &t32(&dev, &[1.0; 9], &[3, 3]), &rl(3, 6)).unwrap_err().to_string();
    assert!(e.contains("2 rows (6 tokens in all) do not split into 3 sequences"), "{e}");
    let experts = Tensor::from_vec(vec![0u32, 5], [2, 1], &dev).unwrap();
    let e = k::moe_sort(&experts, 3).unwrap_err().to_string();
    assert!(e.contains("expert index 5"), "{e}");
    let cap = k::Capacity { factor: 0.0, policy: k::DropPolicy::Probs };
    let e = k::moe_drop(&experts, &t32(&dev, &[1.0, 1.0], &[2, 1]), 6, &cap).unwrap_err().to_string();
    assert!(e.contains("capacity factor 0"), "{e}");
    let probs = t32(&dev, &[1.0, 1.0], &[2, 1]);
    let dup = Tensor::from_vec(vec![0u32, 0], [2, 1], &dev).unwrap();
    let yp = t32(&dev, &randv(4, 2), &[2, 2]);
    let e = k::moe_unpermute_bwd(&yp, &dup, &probs, &t32(&dev, &randv(4, 3), &[2, 2])).unwrap_err().to_string();
    assert!(e.contains("not a permutation"), "{e}");
    // A row no kept copy names (one dropped, two rows).
    let one = Tensor::from_vec(vec![1u32, k::DROPPED], [2, 1], &dev).unwrap();
    let e = k::moe_unpermute_bwd(&yp, &one, &probs, &t32(&dev, &randv(4, 3), &[2, 2])).unwrap_err().to_string();
    assert!(e.contains("not a permutation"), "{e}");
    let e =
        k::moe_unpermute(&yp, &Tensor::from_vec(vec![0u32, 2], [2, 1], &dev).unwrap(), &probs).unwrap_err().to_string();
    assert!(e.contains("slot 2"), "{e}");
    assert!(
        k::moe_route(&Tensor::zeros([2, 3], DType::U32, &dev).unwrap(), &k::TopK::new(1, false, 1.0), None).is_err()
    );
}
