use crate::util::*;
use ferrotron_core::{DType, Device, Tensor};
use ferrotron_kernels::{self as k, cpu::moe as m};
use proptest::prelude::*;

fn softmax(x: &[f64]) -> Vec<f64> {
    let mx = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = x.iter().map(|v| (v - mx).exp()).sum();
    x.iter().map(|v| (v - mx).exp() / z).collect()
}

/// The naive router: indices sorted by (−logit, index), then the weights.
fn route_ref(logits: &[f64], e: usize, r: &k::TopK) -> (Vec<f64>, Vec<u32>) {
    let (mut probs, mut experts) = (vec![], vec![]);
    for row in logits.chunks(e) {
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        let top = &order[..r.k];
        let w = if r.pre_softmax {
            let s = softmax(row);
            top.iter().map(|&i| s[i]).collect()
        } else {
            softmax(&top.iter().map(|&i| row[i]).collect::<Vec<_>>())
        };
        probs.extend(w.iter().map(|p| p * r.scale as f64));
        experts.extend(top.iter().map(|&i| i as u32));
    }
    (probs, experts)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn route_fwd_and_fd(n in 1usize..6, e in 1usize..8, kk in 1usize..4, pre_softmax: bool, scaled: bool, seed: u64) {
        let kk = kk.min(e);
        let r = k::TopK { k: kk, pre_softmax, scale: if scaled { 2.5 } else { 1.0 } };
        let x: Vec<f64> = randv(n * e, seed).iter().map(|v| v * 2.0).collect();
        let (p, ix) = k::moe_route(&t32(&Device::Cpu, &x, &[n, e]), &r).unwrap();
        let (want_p, want_ix) = route_ref(&x, e, &r);
        prop_assert_eq!(ix.to_vec::<u32>().unwrap(), want_ix.clone());
        assert_close(&host(&p), &want_p, 1e-5, 1e-6, "probs");

        let dp = randv(n * kk, seed ^ 5);
        let mut dl = vec![f64::NAN; n * e];
        m::topk_route_bwd(&x, &want_ix, &dp, e, kk, pre_softmax, r.scale as f64, &mut dl);
        fd_check(&x, &dl, |x| {
            let (mut p, mut ix) = (vec![0.0; n * kk], vec![0u32; n * kk]);
            m::topk_route(x, e, kk, pre_softmax, r.scale as f64, &mut p, &mut ix);
            dot(&p, &dp)
        }, "route dlogits");
        // The tensor op gives the same gradient.
        let got = k::moe_route_bwd(&t32(&Device::Cpu, &x, &[n, e]), &ix, &t32(&Device::Cpu, &dp, &[n, kk]), &r).unwrap();
        assert_close(&host(&got), &dl, 1e-4, 1e-5, "moe_route_bwd");
    }

    #[test]
    fn router_loss_values_and_fd(n in 1usize..6, e in 1usize..8, kk in 1usize..3, extra in 0usize..5, seed: u64) {
        let kk = kk.min(e);
        let x = randv(n * e, seed);
        let counts: Vec<f64> = (0..e).map(|i| ((i * 7 + seed as usize % 5) % (n + 2)) as f64).collect();
        let total = n + extra;
        let c = m::RouterLossCoeffs { topk: kk, total_tokens: total as f64, aux: 0.3, z: 0.05, grad_scale: 0.5 };
        // Naive values.
        let s: Vec<Vec<f64>> = x.chunks(e).map(softmax).collect();
        let aux_ref: f64 = (0..e).map(|j| s.iter().map(|r| r[j]).sum::<f64>() * counts[j]).sum::<f64>()
            * e as f64 / (kk as f64 * (total * total) as f64);
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
        let rl = k::RouterLoss { topk: kk, total_tokens: total, aux_coeff: 0.3, z_coeff: 0.05, grad_scale: 0.5 };
        let (v, d) = k::moe_router_loss(&t32(&Device::Cpu, &x, &[n, e]), &t32(&Device::Cpu, &counts, &[e]), &rl).unwrap();
        assert_close(&host(&v), &[aux_ref, z_ref], 1e-5, 1e-6, "moe_router_loss values");
        assert_close(&host(&d), &dl, 1e-4, 1e-6, "moe_router_loss dlogits");
    }

    #[test]
    fn sort_and_combine(n in 1usize..7, e in 1usize..6, kk in 1usize..3, c in 1usize..5, seed: u64) {
        let kk = kk.min(e);
        let dev = Device::Cpu;
        let x: Vec<f64> = randv(n * e, seed);
        let (probs, experts) = k::moe_route(&t32(&dev, &x, &[n, e]), &k::TopK { k: kk, pre_softmax: false, scale: 1.0 }).unwrap();
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

#[test]
fn bad_routing_input_is_named() {
    let dev = Device::Cpu;
    let logits = t32(&dev, &randv(6, 1), &[2, 3]);
    let e = k::moe_route(&logits, &k::TopK { k: 4, pre_softmax: false, scale: 1.0 }).unwrap_err().to_string();
    assert!(e.contains("top-k 4") && e.contains("3 experts"), "{e}");
    let experts = Tensor::from_vec(vec![0u32, 5], [2, 1], &dev).unwrap();
    let e = k::moe_sort(&experts, 3).unwrap_err().to_string();
    assert!(e.contains("expert index 5"), "{e}");
    let probs = t32(&dev, &[1.0, 1.0], &[2, 1]);
    let dup = Tensor::from_vec(vec![0u32, 0], [2, 1], &dev).unwrap();
    let yp = t32(&dev, &randv(4, 2), &[2, 2]);
    let e = k::moe_unpermute_bwd(&yp, &dup, &probs, &t32(&dev, &randv(4, 3), &[2, 2])).unwrap_err().to_string();
    assert!(e.contains("not a permutation"), "{e}");
    let e =
        k::moe_unpermute(&yp, &Tensor::from_vec(vec![0u32, 2], [2, 1], &dev).unwrap(), &probs).unwrap_err().to_string();
    assert!(e.contains("slot 2"), "{e}");
    assert!(
        k::moe_route(
            &Tensor::zeros([2, 3], DType::U32, &dev).unwrap(),
            &k::TopK { k: 1, pre_softmax: false, scale: 1.0 }
        )
        .is_err()
    );
}
