//! The MoE layer against a naive per-token reference, its gradients against finite differences
//! (the router's losses included, at a loss scale), and a GPT with MoE layers end to end.

use ferrotron_core::{Cx, DType, Device, Draw, Module, ParamTable, ParamTableBuilder, Saved, Tensor, rng::Philox};
use ferrotron_kernels as k;
use ferrotron_moe::{Groups, LoadBalancing, MoeMetrics, MoeSpec, RouterSpec, Score};
use ferrotron_parallel::{ProcessGroups, TensorParallel};
use ferrotron_transformer::dropout::TokenKey;
use ferrotron_transformer::spec::{
    Activation, AttentionSpec, FactoryCx, GluParams, LayerSpec, MlpSpec, ModuleFactory, NormKind, PositionEmbedding,
    SoftmaxType,
};
use ferrotron_transformer::{Batch, GptModel, TransformerConfig};
use std::sync::Arc;

const C: usize = 8;

fn spec(activation: Activation, bias: bool, pre_softmax: bool) -> MoeSpec {
    MoeSpec {
        num_experts: 4,
        ffn_hidden_size: 6,
        activation,
        bias,
        // Shared experts in the GeLU cases (with biases), none in the SwiGLU ones.
        shared_expert_ffn: (activation == Activation::Gelu).then_some(5),
        shared_expert_gate: false,
        router: RouterSpec {
            topk: 2,
            pre_softmax,
            topk_scaling_factor: if pre_softmax { Some(1.5) } else { None },
            load_balancing: LoadBalancing::AuxLoss,
            aux_loss_coeff: 0.3,
            z_loss_coeff: Some(0.05),
            ..RouterSpec::default()
        },
        expert_parallel_size: 1,
        expert_tensor_parallel_size: None,
        ep_group: None,
        cp_group: None,
        dp_group: None,
        metrics: MoeMetrics::default(),
        global_counts: Default::default(),
        biases: Default::default(),
    }
}

/// DeepSeek-V3's routing in small: sigmoid scores, 3 groups of 2 experts of which the best
/// group (by the sum of its two) holds a token's 2, an expert bias, weights scaled by 2.5.
fn deepseek_spec() -> MoeSpec {
    let mut s = spec(Activation::SwiGlu, false, false);
    s.num_experts = 6;
    s.router.score = Score::Sigmoid;
    s.router.groups = Some(Groups { num: 3, topk: 1 });
    s.router.expert_bias_update_rate = Some(1e-3);
    s.router.topk_scaling_factor = Some(2.5);
    s
}

/// Token dropping at 0.6 of an even share (the router's losses on, counted before the drop); by
/// position, so that a finite-difference step cannot move which copies are dropped.
fn capped() -> MoeSpec {
    let mut s = spec(Activation::Gelu, true, false);
    s.router.capacity = Some(k::Capacity { factor: 0.6, policy: k::DropPolicy::Position });
    s
}

/// Bias values that move some tokens' choices.
const BIAS: [f32; 6] = [0.3, -0.2, 0.1, 0.0, -0.4, 0.25];

fn layer(s: &MoeSpec, seed: u64) -> (Box<dyn Module>, ParamTable) {
    let tp = TensorParallel::new(ProcessGroups::single().tp, false);
    let mut p = ParamTableBuilder::default();
    let cx = FactoryCx { prefix: "decoder.layers.0.mlp", hidden: C, std: 0.5, out_std: 0.3, tp: &tp };
    let m = s.build(&cx, &mut p).unwrap();
    let table = p.build(&Device::Cpu, DType::F32, seed).unwrap();
    if s.bias {
        // Non-zero biases, so that the reference checks where they enter.
        for id in table.ids().filter(|&id| table.meta(id).name.ends_with(".bias")) {
            let b = table.param(id).unwrap();
            let n = b.elem_count();
            b.copy_from_f32(&(0..n).map(|i| 0.1 * (i as f32 - 2.0)).collect::<Vec<_>>()).unwrap();
        }
    }
    (m, table)
}

fn randn(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut v = vec![0f32; n];
    Philox::new(seed).fill_normal(0, 0.0, std, &mut v);
    v
}

fn get(t: &ParamTable, name: &str) -> Vec<f64> {
    let id = t.ids().find(|&id| t.meta(id).name == name).unwrap_or_else(|| panic!("no parameter {name}"));
    t.param(id).unwrap().to_vec_f32().unwrap().into_iter().map(f64::from).collect()
}

/// y = W x (+ b) for W [out, in].
fn lin(w: &[f64], b: Option<&[f64]>, x: &[f64]) -> Vec<f64> {
    let n = x.len();
    w.chunks(n)
        .enumerate()
        .map(|(o, row)| row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>() + b.map_or(0.0, |b| b[o]))
        .collect()
}

/// Indices sorted by (−value, index).
fn order(v: &[f64]) -> Vec<usize> {
    let mut o: Vec<usize> = (0..v.len()).collect();
    o.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap().then(a.cmp(&b)));
    o
}

/// The layer's output for one token, computed the plain way (`bias`: the expert bias's values).
fn reference(t: &ParamTable, s: &MoeSpec, x: &[f64], bias: Option<&[f64]>) -> Vec<f64> {
    let (top, w) = route_reference(t, s, x, bias);
    combine_reference(t, s, x, &top, &w)
}

/// One token's experts and weights, computed the plain way.
fn route_reference(t: &ParamTable, s: &MoeSpec, x: &[f64], bias: Option<&[f64]>) -> (Vec<usize>, Vec<f64>) {
    let pre = "decoder.layers.0.mlp";
    route_logits_reference(s, &lin(&get(t, &format!("{pre}.router.weight")), None, x), bias)
}

/// One token's experts and weights from its router logits.
fn route_logits_reference(s: &MoeSpec, logits: &[f64], bias: Option<&[f64]>) -> (Vec<usize>, Vec<f64>) {
    let logits = logits.to_vec();
    let soft = |v: &[f64]| {
        let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = v.iter().map(|a| (a - m).exp()).sum();
        v.iter().map(|a| (a - m).exp() / z).collect::<Vec<_>>()
    };
    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
    let softmax = s.router.score == Score::Softmax;
    // The scores the experts are chosen by: the logits, or σ(logits) plus the bias, within the
    // best groups (each scored by its k / group-top-k best).
    let mut sel: Vec<f64> = if softmax { logits.clone() } else { logits.iter().map(|&v| sigmoid(v)).collect() };
    if let Some(b) = bias {
        sel.iter_mut().zip(b).for_each(|(o, b)| *o += b);
    }
    if let Some(g) = s.router.groups {
        let size = s.num_experts / g.num;
        let per = s.router.topk / g.topk;
        let scores: Vec<f64> = sel.chunks(size).map(|grp| order(grp)[..per].iter().map(|&i| grp[i]).sum()).collect();
        let keep = order(&scores)[..g.topk].to_vec();
        for (j, grp) in sel.chunks_mut(size).enumerate() {
            if !keep.contains(&j) {
                grp.fill(f64::NEG_INFINITY);
            }
        }
    }
    let top = order(&sel)[..s.router.topk].to_vec();
    let scale = s.router.topk_scaling_factor.unwrap_or(1.0) as f64;
    let w: Vec<f64> = if !softmax {
        let f: Vec<f64> = top.iter().map(|&e| sigmoid(logits[e])).collect();
        let d: f64 = f.iter().sum();
        f.iter().map(|v| scale * v / d).collect()
    } else if s.router.pre_softmax {
        let p = soft(&logits);
        top.iter().map(|&e| scale * p[e]).collect()
    } else {
        soft(&top.iter().map(|&e| logits[e]).collect::<Vec<_>>()).into_iter().map(|p| scale * p).collect()
    };
    (top, w)
}

/// One token's output from its experts `top` at weights `w` (a dropped copy left out of both).
fn combine_reference(t: &ParamTable, s: &MoeSpec, x: &[f64], top: &[usize], w: &[f64]) -> Vec<f64> {
    let pre = "decoder.layers.0.mlp";
    let mut y = vec![0.0; x.len()];
    for (&e, &p) in top.iter().zip(w) {
        let ex = format!("{pre}.experts.local_experts.{e}");
        let bias = |n: &str| s.bias.then(|| get(t, &format!("{ex}.{n}.bias")));
        let h = lin(&get(t, &format!("{ex}.linear_fc1.weight")), bias("linear_fc1").as_deref(), x);
        let f = s.ffn_hidden_size;
        let a: Vec<f64> = match s.activation {
            Activation::Gelu => h
                .iter()
                .map(|&v| 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh()))
                .collect(),
            Activation::SwiGlu => (0..f).map(|i| h[i] / (1.0 + (-h[i]).exp()) * h[f + i]).collect(),
            Activation::SquaredRelu => h.iter().map(|v| v.max(0.0).powi(2)).collect(),
            Activation::QuickGelu => h.iter().map(|&v| v / (1.0 + (-1.702 * v).exp())).collect(),
            Activation::GeluExact => {
                h.iter().map(|&v| 0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2))).collect()
            }
            Activation::QuickGeGlu(g) => {
                let c = g.clamp.unwrap_or(f64::INFINITY);
                let qgelu = |z: f64| z / (1.0 + (-1.702 * z).exp());
                (0..f).map(|i| qgelu(h[i].min(c)) * (h[f + i].clamp(-c, c) + g.offset)).collect()
            }
        };
        let o = lin(&get(t, &format!("{ex}.linear_fc2.weight")), bias("linear_fc2").as_deref(), &a);
        y.iter_mut().zip(&o).for_each(|(y, o)| *y += p * o);
    }
    if s.shared_expert_ffn.is_some() {
        let o = dense(t, &format!("{pre}.shared_experts"), s, x);
        // The gate: σ(x · gate_weightᵀ) on the shared experts' output.
        let gate = match s.shared_expert_gate {
            true => 1.0 / (1.0 + (-lin(&get(t, &format!("{pre}.shared_experts.gate_weight")), None, x)[0]).exp()),
            false => 1.0,
        };
        y.iter_mut().zip(&o).for_each(|(y, o)| *y += gate * o);
    }
    y
}

/// A dense MLP the plain way (GeLU here: the shared-expert cases).
fn dense(t: &ParamTable, prefix: &str, s: &MoeSpec, x: &[f64]) -> Vec<f64> {
    assert_eq!(s.activation, Activation::Gelu);
    let bias = |n: &str| s.bias.then(|| get(t, &format!("{prefix}.{n}.bias")));
    let h = lin(&get(t, &format!("{prefix}.linear_fc1.weight")), bias("linear_fc1").as_deref(), x);
    let a: Vec<f64> = h
        .iter()
        .map(|&v| 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh()))
        .collect();
    lin(&get(t, &format!("{prefix}.linear_fc2.weight")), bias("linear_fc2").as_deref(), &a)
}

#[test]
fn forward_matches_the_per_token_reference() {
    for (act, bias, pre, gated) in [
        (Activation::SwiGlu, false, false, false),
        (Activation::Gelu, true, true, false),
        (Activation::Gelu, false, false, true),
        (Activation::SquaredRelu, true, false, false),
        (Activation::QuickGelu, false, true, false),
        // gpt-oss's experts: the gated quick GeLU with its offset and a clamp that holds inputs.
        (Activation::QuickGeGlu(GluParams { offset: 1.0, clamp: Some(0.3) }), true, false, false),
    ] {
        let s = MoeSpec { shared_expert_gate: gated, ..spec(act, bias, pre) };
        let (m, table) = layer(&s, 7);
        let (b, t) = (3, 5);
        let x = randn(b * t * C, 11, 1.0);
        let (y, saved) =
            m.forward(&Cx::new(&table, true), &Tensor::from_vec(x.clone(), [b, t, C], &Device::Cpu).unwrap()).unwrap();
        assert_eq!(y.dims(), &[b, t, C]);
        let y = y.to_vec_f32().unwrap();
        // Every expert is used by some token (so the test sees all of them).
        let experts = saved.tensors[2].to_vec::<u32>().unwrap();
        assert!((0..4).all(|e| experts.contains(&e)), "{experts:?}");
        for n in 0..b * t {
            let xr: Vec<f64> = x[n * C..(n + 1) * C].iter().map(|&v| v as f64).collect();
            let want = reference(&table, &s, &xr, None);
            for (i, (&g, w)) in y[n * C..(n + 1) * C].iter().zip(&want).enumerate() {
                assert!((g as f64 - w).abs() < 1e-5 + 1e-5 * w.abs(), "{act:?} token {n}[{i}]: {g} vs {w}");
            }
        }
    }
}

/// Token dropping against the naive capacity: each expert keeps ⌈N·k / E · factor⌉ of the copies
/// routed to it (the largest weights, or the earliest tokens), the others leave their token's
/// output; the weights of the kept ones are not renormalised.
#[test]
fn capacity_drops_the_reference_copies() {
    for (policy, factor) in [(k::DropPolicy::Probs, 0.6), (k::DropPolicy::Position, 0.75), (k::DropPolicy::Probs, 4.0)]
    {
        let mut s = spec(Activation::SwiGlu, false, false);
        s.router.capacity = Some(k::Capacity { factor, policy });
        let (m, table) = layer(&s, 7);
        let (b, t) = (3, 5);
        let x = randn(b * t * C, 11, 1.0);
        let (y, saved) =
            m.forward(&Cx::new(&table, true), &Tensor::from_vec(x.clone(), [b, t, C], &Device::Cpu).unwrap()).unwrap();
        let y = y.to_vec_f32().unwrap();
        let rows: Vec<Vec<f64>> = x.chunks(C).map(|r| r.iter().map(|&v| v as f64).collect()).collect();
        let routes: Vec<(Vec<usize>, Vec<f64>)> = rows.iter().map(|xr| route_reference(&table, &s, xr, None)).collect();
        let (kk, n) = (s.router.topk, b * t);
        let capacity = ((n * kk) as f64 / s.num_experts as f64 * factor).ceil() as usize;
        let mut kept = vec![vec![true; kk]; n];
        for e in 0..s.num_experts {
            let mut copies: Vec<(usize, usize)> =
                (0..n).flat_map(|i| (0..kk).map(move |j| (i, j))).filter(|&(i, j)| routes[i].0[j] == e).collect();
            if policy == k::DropPolicy::Probs {
                copies.sort_by(|a, b| routes[b.0].1[b.1].partial_cmp(&routes[a.0].1[a.1]).unwrap());
            }
            copies.iter().skip(capacity).for_each(|&(i, j)| kept[i][j] = false);
        }
        let dropped = kept.iter().flatten().filter(|k| !**k).count();
        assert_eq!(dropped > 0, factor < 1.0, "{policy:?} {factor}: {dropped} dropped");
        // The saved sort has a row for each kept copy only.
        assert_eq!(saved.tensors[3].elem_count(), n * kk - dropped);
        for i in 0..n {
            let (top, w): (Vec<usize>, Vec<f64>) =
                (0..kk).filter(|&j| kept[i][j]).map(|j| (routes[i].0[j], routes[i].1[j])).unzip();
            let want = combine_reference(&table, &s, &rows[i], &top, &w);
            for (c, (&g, w)) in y[i * C..(i + 1) * C].iter().zip(&want).enumerate() {
                assert!((g as f64 - w).abs() < 1e-5 + 1e-5 * w.abs(), "{policy:?} token {i}[{c}]: {g} vs {w}");
            }
        }
    }
}

/// The router-loss values at this forward, from its logits and the counts its load-balancing
/// loss takes (a plain top-k of the scores).
fn router_values(s: &MoeSpec, saved: &Saved) -> (f64, f64) {
    let logits = &saved.tensors[0];
    let plain = k::TopK { score: s.router.score, ..k::TopK::new(s.router.topk, s.router.pre_softmax, 1.0) };
    let sort = k::moe_sort(&k::moe_route(logits, &plain, None).unwrap().1, s.num_experts).unwrap();
    let counts: Vec<f32> = sort.tokens_per_expert.iter().map(|&c| c as f32).collect();
    let l = k::RouterLoss {
        topk: s.router.topk,
        total_tokens: logits.dims()[0],
        aux_coeff: 0.0,
        z_coeff: 0.0,
        grad_scale: 0.0,
        score: s.router.score,
        seqs: 1,
    };
    let (v, _) =
        k::moe_router_loss(logits, &Tensor::from_vec(counts, [s.num_experts], &Device::Cpu).unwrap(), &l).unwrap();
    let v = v.to_vec_f32().unwrap();
    (v[0] as f64, v[1] as f64)
}

/// Directional finite differences of ⟨y, r⟩ + g·(a·aux + z·zloss) for every parameter and the
/// input, against the backward run at loss scale g with dy = r; once more with r = 0, where the
/// router's losses are all there is.
#[test]
fn gradients_match_finite_differences_with_the_router_losses() {
    let cases = [
        (spec(Activation::SwiGlu, false, false), 1.0),
        (spec(Activation::Gelu, true, true), 1.0),
        (spec(Activation::SwiGlu, false, true), 0.0),
        (deepseek_spec(), 1.0),
        (deepseek_spec(), 0.0),
        (capped(), 1.0),
        (capped(), 0.0),
        (MoeSpec { shared_expert_gate: true, ..spec(Activation::Gelu, true, false) }, 1.0),
    ];
    for (s, r_std) in cases {
        let act = s.activation;
        let (m, table) = layer(&s, 3);
        if let Some(b) = s.biases.layers().first() {
            b.set_values(&BIAS).unwrap();
        }
        let (n, g) = (12, 0.7f32);
        let x = Tensor::from_vec(randn(n * C, 5, 1.0), [n, C], &Device::Cpu).unwrap();
        let r = randn(n * C, 6, r_std);
        let (a, z) = (s.router.aux_loss_coeff as f64, s.router.z_loss_coeff.unwrap() as f64);
        let objective = |x: &Tensor| {
            let (y, saved) = m.forward(&Cx::new(&table, true), x).unwrap();
            let dot: f64 = y.to_vec_f32().unwrap().iter().zip(&r).map(|(a, b)| *a as f64 * *b as f64).sum();
            let (aux, zl) = router_values(&s, &saved);
            (dot + g as f64 * (a * aux + z * zl), routing(&saved))
        };
        // The choice, the copies a capacity kept (their slots) and the load-balancing loss's
        // counts, which a step must not move.
        fn routing(saved: &Saved) -> Vec<u32> {
            [&saved.tensors[2], &saved.tensors[4], &saved.tensors[7]]
                .iter()
                .flat_map(|t| t.to_vec::<u32>().unwrap())
                .collect()
        }
        let cx = Cx::new(&table, true).with_grad_scale(g);
        let (_, saved) = m.forward(&cx, &x).unwrap();
        let routed = routing(&saved);
        let dx = m.backward(&cx, saved, &Tensor::from_vec(r.clone(), [n, C], &Device::Cpu).unwrap()).unwrap();
        let values = s.metrics.take().unwrap();
        assert_eq!(values.layers, 1, "one layer recorded its router losses");
        assert!(values.load_balancing_sum > 0.0 && values.z_sum > 0.0, "{values:?}");

        let h = 1e-3f32;
        let check = |name: &str, base: &Tensor, analytic: &[f32], eval: &dyn Fn(&Tensor) -> (f64, Vec<u32>)| {
            let u = randn(base.elem_count(), name.len() as u64 + 99, 1.0);
            let shift =
                |sgn: f32| base.update_f32("t", |v| v.iter_mut().zip(&u).for_each(|(x, d)| *x += sgn * d)).unwrap();
            shift(h);
            let (lp, rp) = eval(&x);
            shift(-2.0 * h);
            let (lm, rm) = eval(&x);
            shift(h);
            assert!(rp == routed && rm == routed, "{name}: the step changed the routing; pick another seed");
            let numeric = (lp - lm) / (2.0 * h as f64);
            let want: f64 = analytic.iter().zip(&u).map(|(a, b)| *a as f64 * *b as f64).sum();
            assert!(
                (numeric - want).abs() <= 1e-2 * want.abs() + 1e-3,
                "{act:?} {name}: finite difference {numeric} vs backward {want}"
            );
        };
        for id in table.ids() {
            let grad = table.grad(id).unwrap().to_vec_f32().unwrap();
            check(&table.meta(id).name, &table.param(id).unwrap(), &grad, &|x| objective(x));
        }
        let xc = x.clone();
        check("input", &xc, &dx.to_vec_f32().unwrap(), &|x| objective(x));
    }
}

/// --moe-router-force-load-balancing: the layer routes by standard normal logits R, those of
/// `k::normal` at the layer's `TokenKey` for the micro-batch's draw, whatever the router's
/// weights: the forward is the per-token reference on R, and doubling the router's weights changes
/// no output. The router's gradient is the straight-through one, xᵀ · dR: finite differences of
/// the reference on R + h · x·Uᵀ along random directions U match it; the experts' gradients match
/// finite differences of the layer itself.
#[test]
fn forced_balancing_routes_by_random_logits_straight_through() {
    let mut s = spec(Activation::Gelu, true, false);
    (s.router.aux_loss_coeff, s.router.z_loss_coeff, s.router.force_load_balancing) = (0.0, None, true);
    let (m, table) = layer(&s, 3);
    let (b, t, e) = (2, 6, s.num_experts);
    let xv = randn(b * t * C, 5, 1.0);
    let x = Tensor::from_vec(xv.clone(), [b, t, C], &Device::Cpu).unwrap();
    let draw = Draw { seed: 17, first_sample: 40 };
    let cx = Cx::new(&table, true).with_draw(Some(draw));
    let key = TokenKey::new("decoder.layers.0.mlp.router.force_load_balancing", e, None);
    let r = k::normal([b, t, e], DType::F32, &Device::Cpu, &key.key("test", draw, &[b, t, e]).unwrap()).unwrap();
    let r: Vec<f64> = r.to_vec_f32().unwrap().into_iter().map(f64::from).collect();
    let xr = |n: usize| xv[n * C..(n + 1) * C].iter().map(|&v| v as f64).collect::<Vec<_>>();
    // ⟨y, dy⟩ of the reference with logits L per token.
    let dy = randn(b * t * C, 6, 1.0);
    let objective = |logits: &dyn Fn(usize) -> Vec<f64>| -> (f64, Vec<Vec<usize>>) {
        let mut tops = vec![];
        let mut dot = 0.0;
        for n in 0..b * t {
            let (top, w) = route_logits_reference(&s, &logits(n), None);
            let y = combine_reference(&table, &s, &xr(n), &top, &w);
            dot += y.iter().zip(&dy[n * C..]).map(|(a, b)| a * *b as f64).sum::<f64>();
            tops.push(top);
        }
        (dot, tops)
    };
    let (y, saved) = m.forward(&cx, &x).unwrap();
    let y = y.to_vec_f32().unwrap();
    for n in 0..b * t {
        let (top, w) = route_logits_reference(&s, &r[n * e..(n + 1) * e], None);
        let want = combine_reference(&table, &s, &xr(n), &top, &w);
        for (i, (&g, w)) in y[n * C..(n + 1) * C].iter().zip(&want).enumerate() {
            assert!((g as f64 - w).abs() < 1e-5 + 1e-5 * w.abs(), "token {n}[{i}]: {g} vs {w}");
        }
    }
    // The router's weights change nothing forward.
    let router = table.id("decoder.layers.0.mlp.router.weight").unwrap();
    k::scale_(&table.param(router).unwrap(), 2.0).unwrap();
    assert_eq!(m.forward(&cx, &x).unwrap().0.to_vec_f32().unwrap(), y);
    k::scale_(&table.param(router).unwrap(), 0.5).unwrap();
    m.backward(&cx, saved, &Tensor::from_vec(dy.clone(), [b, t, C], &Device::Cpu).unwrap()).unwrap();
    let dw = table.grad(router).unwrap().to_vec_f32().unwrap();
    assert!(dw.iter().any(|&g| g != 0.0), "the router gets a gradient");
    let (_, routed) = objective(&|n| r[n * e..(n + 1) * e].to_vec());
    for seed in [1, 2] {
        let u: Vec<f64> = randn(e * C, 90 + seed, 1.0).into_iter().map(f64::from).collect();
        // The reference is f64: a small step keeps the routing.
        let h = 1e-6;
        let at = |sgn: f64| {
            objective(&|n| {
                let xu = lin(&u, None, &xr(n));
                (0..e).map(|j| r[n * e + j] + sgn * h * xu[j]).collect()
            })
        };
        let ((lp, tp), (lm, tm)) = (at(1.0), at(-1.0));
        assert!(tp == routed && tm == routed, "the step moved the routing; pick another seed");
        let numeric = (lp - lm) / (2.0 * h);
        let analytic: f64 = dw.iter().zip(&u).map(|(a, b)| *a as f64 * b).sum();
        assert!((numeric - analytic).abs() <= 1e-3 * analytic.abs() + 1e-4, "router: {numeric} vs {analytic}");
    }
    // An expert's weight by finite differences of the layer itself (the routing fixed by R).
    let w1 = table.id("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight").unwrap();
    let g1 = table.grad(w1).unwrap().to_vec_f32().unwrap();
    let u = randn(g1.len(), 77, 1.0);
    let shift = |sgn: f32| {
        table.param(w1).unwrap().update_f32("t", |v| v.iter_mut().zip(&u).for_each(|(x, d)| *x += sgn * d)).unwrap()
    };
    let dot = || {
        m.forward(&cx, &x).unwrap().0.to_vec_f32().unwrap().iter().zip(&dy).map(|(a, b)| (a * b) as f64).sum::<f64>()
    };
    shift(1e-3);
    let lp = dot();
    shift(-2e-3);
    let lm = dot();
    shift(1e-3);
    let numeric = (lp - lm) / 2e-3;
    let analytic: f64 = g1.iter().zip(&u).map(|(a, b)| (a * b) as f64).sum();
    assert!((numeric - analytic).abs() <= 1e-2 * analytic.abs() + 1e-3, "expert 1 fc1: {numeric} vs {analytic}");
    // Without the micro-batch's draw a training forward is refused by name.
    let e = m.forward(&Cx::new(&table, true), &x).unwrap_err().to_string();
    assert!(e.contains("--moe-router-force-load-balancing") && e.contains("with_draw"), "{e}");
}

/// Sigmoid scores, group-limited choice and the expert bias against the naive router; the bias
/// moves some tokens' experts (the same tokens route otherwise without it).
#[test]
fn deepseek_routing_matches_the_reference() {
    let s = deepseek_spec();
    let (m, table) = layer(&s, 7);
    let (b, t) = (4, 6);
    let x = randn(b * t * C, 11, 1.0);
    let xt = Tensor::from_vec(x.clone(), [b, t, C], &Device::Cpu).unwrap();
    let (_, unbiased) = m.forward(&Cx::new(&table, false), &xt).unwrap();
    let bias = &s.biases.layers()[0];
    assert_eq!(bias.name, "decoder.layers.0.mlp.router.expert_bias");
    bias.set_values(&BIAS).unwrap();
    let (y, saved) = m.forward(&Cx::new(&table, false), &xt).unwrap();
    let y = y.to_vec_f32().unwrap();
    let (e0, e1) = (unbiased.tensors[2].to_vec::<u32>().unwrap(), saved.tensors[2].to_vec::<u32>().unwrap());
    assert_ne!(e0, e1, "the bias changed no token's experts");
    let b64: Vec<f64> = BIAS.iter().map(|&v| v as f64).collect();
    for n in 0..b * t {
        let xr: Vec<f64> = x[n * C..(n + 1) * C].iter().map(|&v| v as f64).collect();
        let want = reference(&table, &s, &xr, Some(&b64));
        for (i, (&g, w)) in y[n * C..(n + 1) * C].iter().zip(&want).enumerate() {
            assert!((g as f64 - w).abs() < 1e-5 + 1e-5 * w.abs(), "token {n}[{i}]: {g} vs {w}");
        }
    }
}

/// The bias moves by the rate against each expert's load over the backwards since the last
/// update (a forward alone counts nothing), summed by the caller's collective.
#[test]
fn expert_bias_moves_against_the_load() {
    let s = deepseek_spec();
    let (m, table) = layer(&s, 7);
    let n = 30;
    let x = Tensor::from_vec(randn(n * C, 4, 1.0), [n, C], &Device::Cpu).unwrap();
    let cx = Cx::new(&table, true);
    let mut want = vec![0usize; 6];
    for _ in 0..2 {
        let (_, saved) = m.forward(&cx, &x).unwrap();
        let counts = saved.tensors[6].to_vec::<u32>().unwrap();
        want.iter_mut().zip(&counts).for_each(|(w, &c)| *w += c as usize);
        m.backward(&cx, saved, &Tensor::zeros([n, C], DType::F32, &Device::Cpu).unwrap()).unwrap();
    }
    m.forward(&cx, &x).unwrap(); // not counted: no backward
    let rate = 0.01;
    // Two "ranks" with the same counts: the sum doubles every count, the signs stay.
    s.biases
        .update(rate, |v| {
            v.iter_mut().for_each(|c| *c *= 2.0);
            Ok(())
        })
        .unwrap();
    let mean = want.iter().sum::<usize>() as f64 / 6.0;
    let got = s.biases.layers()[0].values();
    for (e, (&g, &c)) in got.iter().zip(&want).enumerate() {
        let step = if (c as f64) < mean {
            rate
        } else if (c as f64) > mean {
            -rate
        } else {
            0.0
        };
        assert_eq!(g, step, "expert {e}: {c} copies against a mean of {mean}");
    }
    assert!(got.iter().any(|&v| v != 0.0), "{want:?}");
    // Nothing counted since: the bias stays.
    s.biases.update(rate, |_| Ok(())).unwrap();
    assert_eq!(s.biases.layers()[0].values(), got);
}

/// DeepSeek's sequence-level load-balancing loss: its recorded value is the mean over the
/// batch's sequences of each one's loss (from the forward's logits and choice, the plain way),
/// and the input gradient at dy = 0 (that loss and the z-loss alone) matches finite differences.
#[test]
fn sequence_level_balancing_loss_matches_the_reference() {
    let mut s = spec(Activation::SwiGlu, false, false);
    s.router.load_balancing = LoadBalancing::SeqAuxLoss;
    s.router.z_loss_coeff = None;
    let (m, table) = layer(&s, 5);
    let (b, t, g) = (3, 5, 0.7f32);
    let x = Tensor::from_vec(randn(b * t * C, 8, 1.0), [b, t, C], &Device::Cpu).unwrap();
    // The loss the plain way: per sequence, E / (K·T²) Σ_e c[e] Σ_t softmax(logits)[t, e].
    let seq_loss = |saved: &Saved| -> f64 {
        let (logits, experts) = (saved.tensors[0].to_vec_f32().unwrap(), saved.tensors[2].to_vec::<u32>().unwrap());
        let (e, kk) = (s.num_experts, s.router.topk);
        let mut total = 0.0;
        for q in 0..b {
            let mut counts = vec![0.0f64; e];
            experts[q * t * kk..(q + 1) * t * kk].iter().for_each(|&x| counts[x as usize] += 1.0);
            let mut probs = vec![0.0f64; e];
            for row in logits[q * t * e..(q + 1) * t * e].chunks(e) {
                let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                let z: f64 = row.iter().map(|&v| (v as f64 - mx).exp()).sum();
                probs.iter_mut().zip(row).for_each(|(p, &v)| *p += (v as f64 - mx).exp() / z);
            }
            total += probs.iter().zip(&counts).map(|(p, c)| p * c).sum::<f64>() * e as f64 / (kk * t * t) as f64;
        }
        total / b as f64
    };
    let cx = Cx::new(&table, true).with_grad_scale(g);
    let (_, saved) = m.forward(&cx, &x).unwrap();
    let (want, routed) = (seq_loss(&saved), saved.tensors[2].to_vec::<u32>().unwrap());
    let dx = m.backward(&cx, saved, &Tensor::zeros([b, t, C], DType::F32, &Device::Cpu).unwrap()).unwrap();
    let got = s.metrics.take().unwrap().load_balancing_sum;
    assert!((got - want).abs() < 1e-5 * want.abs(), "recorded {got} vs {want}");
    // Against the micro-batch's loss: a different value for these counts.
    assert!(seq_loss_differs_from_batch(&s, m.as_ref(), &table, &x, want));
    let a = s.router.aux_loss_coeff as f64;
    let u = randn(b * t * C, 77, 1.0);
    let h = 1e-3f32;
    let eval = |sgn: f32| {
        let xs = x.to_vec_f32().unwrap().iter().zip(&u).map(|(v, d)| v + sgn * h * d).collect::<Vec<_>>();
        let (_, sv) =
            m.forward(&Cx::new(&table, true), &Tensor::from_vec(xs, [b, t, C], &Device::Cpu).unwrap()).unwrap();
        assert_eq!(sv.tensors[2].to_vec::<u32>().unwrap(), routed, "the step changed the routing");
        g as f64 * a * seq_loss(&sv)
    };
    let numeric = (eval(1.0) - eval(-1.0)) / (2.0 * h as f64);
    let analytic: f64 = dx.to_vec_f32().unwrap().iter().zip(&u).map(|(a, b)| *a as f64 * *b as f64).sum();
    assert!(
        (numeric - analytic).abs() <= 1e-2 * analytic.abs() + 1e-4,
        "finite difference {numeric} vs backward {analytic}"
    );
}

/// The micro-batch's loss (aux_loss) of the same forward differs from the sequences' mean.
fn seq_loss_differs_from_batch(s: &MoeSpec, m: &dyn Module, table: &ParamTable, x: &Tensor, seq: f64) -> bool {
    let (_, saved) = m.forward(&Cx::new(table, true), x).unwrap();
    let mut plain = s.clone();
    plain.router.load_balancing = LoadBalancing::AuxLoss;
    let (batch, _) = router_values(&plain, &saved);
    (batch - seq).abs() > 1e-4 * seq.abs()
}

#[test]
fn param_count_is_the_built_tables() {
    for (act, bias, gated) in
        [(Activation::SwiGlu, false, false), (Activation::Gelu, true, false), (Activation::Gelu, true, true)]
    {
        let s = MoeSpec { shared_expert_gate: gated, ..spec(act, bias, false) };
        let (_, table) = layer(&s, 1);
        assert_eq!(table.id("decoder.layers.0.mlp.shared_experts.gate_weight").is_some(), gated);
        let c = s.param_count(C).unwrap();
        assert_eq!(c.total, table.numel());
        assert_eq!(c.active, C * 4 + s.shared_params(C) + 2 * s.expert_params(C));
        assert_eq!(s.shared_params(C) > 0, bias, "shared experts in the GeLU case");
    }
}

#[test]
fn bad_specs_are_named() {
    let mut s = spec(Activation::SwiGlu, false, false);
    s.router.topk = 5;
    assert!(s.validate().unwrap_err().contains("--moe-router-topk 5"));
    let mut s = spec(Activation::SwiGlu, false, false);
    s.expert_parallel_size = 3;
    assert!(s.validate().unwrap_err().contains("not divisible by --expert-model-parallel-size 3"));
    // A size above 1 needs the group to dispatch over.
    s.expert_parallel_size = 2;
    let tp = TensorParallel::new(ProcessGroups::single().tp, false);
    let cx = FactoryCx { prefix: "m", hidden: C, std: 0.1, out_std: 0.1, tp: &tp };
    let e = s.build(&cx, &mut ParamTableBuilder::default()).err().unwrap().to_string();
    assert!(e.contains("expert-parallel group of 2 ranks"), "{e}");
    // Tensor parallelism splits every expert: its width must divide.
    let mut s = spec(Activation::SwiGlu, false, false);
    s.ffn_hidden_size = 9;
    assert!(
        s.validate_tp(2)
            .unwrap_err()
            .contains("--moe-ffn-hidden-size 9 is not divisible by --tensor-model-parallel-size 2")
    );
    s.ffn_hidden_size = 10;
    assert!(s.validate_tp(2).is_ok());
    let mut s = spec(Activation::SwiGlu, false, false);
    s.router.aux_loss_coeff = f32::NAN;
    assert!(s.validate().unwrap_err().contains("--moe-aux-loss-coeff"));
    let mut s = deepseek_spec();
    s.router.score = Score::Softmax;
    assert!(s.validate().unwrap_err().contains("--moe-router-enable-expert-bias needs a per-expert score"));
    let mut s = deepseek_spec();
    s.router.groups = Some(Groups { num: 4, topk: 2 });
    let e = s.validate().unwrap_err();
    assert!(e.contains("--moe-router-num-groups") && e.contains("6 experts cannot be split into 4"), "{e}");
    let s = MoeSpec { shared_expert_gate: true, ..spec(Activation::SwiGlu, false, false) };
    assert!(s.validate().unwrap_err().contains("--moe-shared-expert-gate gates the shared experts"));
    let mut s = capped();
    s.router.capacity = Some(k::Capacity { factor: 0.0, policy: k::DropPolicy::Probs });
    assert!(s.validate().unwrap_err().contains("--moe-expert-capacity-factor 0 must be a finite value above 0"));
}

fn gpt(s: &MoeSpec) -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: C,
        num_attention_heads: 2,
        num_query_groups: 2,
        kv_channels: None,
        ffn_hidden_size: 12,
        seq_length: 6,
        max_position_embeddings: 6,
        vocab_size: 11,
        make_vocab_size_divisible_by: 1,
        position_embedding: PositionEmbedding::rope(10000.0),
        untie_embeddings_and_output_weights: true,
        layer: LayerSpec {
            norm: NormKind::RmsNorm,
            zero_centred_gamma: false,
            attention: AttentionSpec {
                bias: false,
                qkv_bias: false,
                qk_layernorm: false,
                qk_l2_norm: false,
                output_gate: false,
                softmax: SoftmaxType::Vanilla,
                window: None,
                causal: true,
                mla: None,
            },
            mlp: MlpSpec::Custom(Arc::new(s.clone())),
            other_mlp: None,
            hybrid: None,
            window_layers: None,
        },
        norm_epsilon: 1e-5,
        init_method_std: 0.3,
        embedding_init_method_std: None,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        mtp: None,
    }
}

fn batch() -> Batch {
    let dev = Device::Cpu;
    let ids = |s: u64| (0..12).map(|i| Philox::new(s).u32_at(i) % 11).collect::<Vec<_>>();
    Batch::unmasked(Tensor::from_vec(ids(1), [2, 6], &dev).unwrap(), Tensor::from_vec(ids(2), [2, 6], &dev).unwrap())
        .unwrap()
}

/// A GPT whose layers are MoE: the config counts its parameters as the table does, both layers
/// record their router losses, and the whole model's gradient (language-model loss + both
/// layers' router losses) matches finite differences along a random direction.
#[test]
fn gpt_with_moe_layers_counts_and_differentiates() {
    let s = spec(Activation::SwiGlu, false, false);
    let cfg = gpt(&s);
    let (model, table) = GptModel::build(cfg.clone(), &Device::Cpu, DType::F32, 4).unwrap();
    assert_eq!(cfg.num_params(), table.numel());
    assert!(cfg.active_params() < cfg.num_params());
    assert!(table.metas().iter().any(|m| m.name == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"));
    let b = batch();
    let (a, z) = (s.router.aux_loss_coeff as f64, s.router.z_loss_coeff.unwrap() as f64);
    let total = |table: &ParamTable| {
        let cx = Cx::new(table, true);
        let (loss, saved) = model.forward(&cx, &b).unwrap();
        // The layers' router losses come out of a backward; run one at scale 0 (adds nothing
        // that matters here: main_grad is rebuilt below) to read them.
        model.backward(&cx, saved, 0.0).unwrap();
        let v = s.metrics.take().unwrap();
        assert_eq!(v.layers, 2);
        loss + a * v.load_balancing_sum + z * v.z_sum
    };
    let f0 = total(&table);
    table.defer_zero_grads();
    let cx = Cx::new(&table, true);
    let (_, saved) = model.forward(&cx, &b).unwrap();
    model.backward(&cx, saved, 1.0).unwrap();
    assert!(s.metrics.take().unwrap().layers == 2 && f0.is_finite());
    let grads: Vec<Vec<f32>> = table.ids().map(|id| table.grad(id).unwrap().to_vec_f32().unwrap()).collect();
    let u: Vec<Vec<f32>> =
        table.ids().map(|id| randn(table.param(id).unwrap().elem_count(), id.0 as u64 + 7, 1.0)).collect();
    let shift = |sgn: f32| {
        for (id, d) in table.ids().zip(&u) {
            table.param(id).unwrap().update_f32("t", |v| v.iter_mut().zip(d).for_each(|(x, d)| *x += sgn * d)).unwrap();
        }
    };
    let h = 1e-3f32;
    shift(h);
    let fp = total(&table);
    shift(-2.0 * h);
    let fm = total(&table);
    shift(h);
    let numeric = (fp - fm) / (2.0 * h as f64);
    let analytic: f64 =
        grads.iter().zip(&u).flat_map(|(g, d)| g.iter().zip(d)).map(|(a, b)| *a as f64 * *b as f64).sum();
    assert!(
        (numeric - analytic).abs() <= 1e-2 * analytic.abs() + 1e-3,
        "finite difference {numeric} vs backward {analytic}"
    );
}

/// Expert parallelism over two thread ranks: each rank routes its own tokens, the all-to-all
/// sends them to the rank holding their experts and back. Against one rank that runs both ranks'
/// tokens through all the experts: the same outputs and input gradients per rank, each expert's
/// gradient (both ranks' tokens) on the rank that holds it, and the router's gradient summed
/// over the ranks.
#[test]
fn expert_parallel_dispatch_matches_one_rank() {
    // Dropless, then with a capacity (each rank's own tokens, as one rank running that batch).
    for capacity in [None, Some(k::Capacity { factor: 0.6, policy: k::DropPolicy::Probs })] {
        let mut s = spec(Activation::SwiGlu, false, false);
        s.router.capacity = capacity;
        let (n, g) = (9, 0.5f32);
        let xs: Vec<Vec<f32>> = (0..2).map(|r| randn(n * C, 40 + r, 1.0)).collect();
        let dys: Vec<Vec<f32>> = (0..2).map(|r| randn(n * C, 50 + r, 1.0)).collect();
        let t = |v: &[f32]| Tensor::from_vec(v.to_vec(), [n, C], &Device::Cpu).unwrap();
        // One rank: both token sets through every expert, gradients accumulated.
        let (m, table) = layer(&s, 8);
        let cx = Cx::new(&table, true).with_grad_scale(g);
        let mut want = vec![];
        for r in 0..2 {
            let (y, saved) = m.forward(&cx, &t(&xs[r])).unwrap();
            let dx = m.backward(&cx, saved, &t(&dys[r])).unwrap();
            want.push((y.to_vec_f32().unwrap(), dx.to_vec_f32().unwrap()));
        }
        let grad = |table: &ParamTable, name: &str| {
            let id = table.id(name).unwrap_or_else(|| panic!("no {name}"));
            table.grad(id).unwrap().to_vec_f32().unwrap()
        };
        let names: Vec<String> = table.metas().iter().map(|m| m.name.clone()).collect();
        let close = |what: &str, a: &[f32], b: &[f32]| {
            assert_eq!(a.len(), b.len(), "{what}");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() <= 1e-5 + 1e-5 * y.abs(), "{what}[{i}]: {x} (2 ranks) vs {y} (1 rank)");
            }
        };
        let results = ferrotron_comm::run_ranks(2, std::time::Duration::from_secs(30), |rank, comm| {
            let mut s2 = s.clone();
            s2.expert_parallel_size = 2;
            let s2 = s2.with_group(comm);
            let (m2, table2) = layer(&s2, 8);
            let cx = Cx::new(&table2, true).with_grad_scale(g);
            let (y, saved) = m2.forward(&cx, &t(&xs[rank])).unwrap();
            let dx = m2.backward(&cx, saved, &t(&dys[rank])).unwrap();
            let grads: Vec<(String, Vec<f32>)> =
                table2.metas().iter().map(|m| (m.name.clone(), grad(&table2, &m.name))).collect();
            let experts: Vec<bool> = table2.metas().iter().map(|m| m.expert).collect();
            (y.to_vec_f32().unwrap(), dx.to_vec_f32().unwrap(), grads, experts, table2.expert_range())
        });
        let mut router = vec![0f32; 4 * C];
        let mut seen = std::collections::BTreeSet::new();
        for (rank, r) in results.into_iter().enumerate() {
            let (y, dx, grads, experts, expert_range) = r.unwrap();
            close(&format!("rank {rank} output"), &y, &want[rank].0);
            close(&format!("rank {rank} input gradient"), &dx, &want[rank].1);
            // Two of the four experts each, named by their global index; the router on both.
            assert_eq!(grads.len(), 1 + 2 * 2, "{:?}", grads.iter().map(|g| &g.0).collect::<Vec<_>>());
            // The experts' fc1 [2·6, C] and fc2 [C, 6], first in the flat buffer.
            assert_eq!((expert_range.len(), experts.iter().filter(|&&e| e).count()), (2 * (2 * 6 * C + C * 6), 4));
            for (name, g) in grads {
                if name.ends_with("router.weight") {
                    router.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
                    continue;
                }
                assert!(
                    name.contains(&format!("local_experts.{}", 2 * rank))
                        || name.contains(&format!("local_experts.{}", 2 * rank + 1)),
                    "{name} on rank {rank}"
                );
                close(&name, &g, &grad(&table, &name));
                seen.insert(name);
            }
        }
        assert_eq!(seen.len(), names.iter().filter(|n| n.contains("local_experts")).count(), "every expert held once");
        close("router gradient summed over the ranks", &router, &grad(&table, "decoder.layers.0.mlp.router.weight"));
    }
}

/// Context parallelism over two thread ranks: one micro-batch's tokens split between them, each
/// rank's output gradient doubled (its language-model loss is the micro-batch's mean × cp: the
/// trainer's token count over cp) at the same `grad_scale`, the layer doubling the router losses'
/// share itself. Against one rank holding
/// all the tokens at the plain scale: the same outputs and input gradients per rank (the
/// router's losses count every rank's tokens: summed counts, the micro-batch's total), and every
/// parameter's gradient, averaged over the two ranks as data × context-parallel averaging does,
/// equal to the one rank's. Top-2 routing on exactly the same inputs, so the expert choices match.
#[test]
fn context_parallel_router_losses_count_the_whole_micro_batch() {
    let s = spec(Activation::SwiGlu, false, false);
    let (n, g) = (9, 0.5f32);
    let x = randn(2 * n * C, 60, 1.0);
    let dy = randn(2 * n * C, 61, 1.0);
    let t = |v: &[f32], rows: usize| Tensor::from_vec(v.to_vec(), [rows, C], &Device::Cpu).unwrap();
    let (m, table) = layer(&s, 8);
    let cx = Cx::new(&table, true).with_grad_scale(g);
    let (y, saved) = m.forward(&cx, &t(&x, 2 * n)).unwrap();
    let dx = m.backward(&cx, saved, &t(&dy, 2 * n)).unwrap();
    let (y, dx) = (y.to_vec_f32().unwrap(), dx.to_vec_f32().unwrap());
    let values = s.metrics.take().unwrap();
    let names: Vec<String> = table.metas().iter().map(|m| m.name.clone()).collect();
    let grad = |table: &ParamTable, name: &str| table.grad(table.id(name).unwrap()).unwrap().to_vec_f32().unwrap();
    let close = |what: &str, a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (p, q)) in a.iter().zip(b).enumerate() {
            assert!((p - q).abs() <= 1e-5 + 1e-5 * q.abs(), "{what}[{i}]: {p} (2 ranks) vs {q} (1 rank)");
        }
    };
    let results = ferrotron_comm::run_ranks(2, std::time::Duration::from_secs(30), |rank, comm| {
        let s2 = MoeSpec { metrics: MoeMetrics::default(), ..s.clone() }.with_context_parallel(comm);
        let (m2, table2) = layer(&s2, 8);
        let cx = Cx::new(&table2, true).with_grad_scale(g);
        let rows = rank * n * C..(rank + 1) * n * C;
        let (y2, saved) = m2.forward(&cx, &t(&x[rows.clone()], n)).unwrap();
        // The output's gradient at the rank's loss scale: its language-model share is doubled too.
        let dy2: Vec<f32> = dy[rows].iter().map(|v| 2.0 * v).collect();
        let dx2 = m2.backward(&cx, saved, &t(&dy2, n)).unwrap();
        let grads: Vec<Vec<f32>> = names.iter().map(|name| grad(&table2, name)).collect();
        (y2.to_vec_f32().unwrap(), dx2.to_vec_f32().unwrap(), grads, s2.metrics.take().unwrap())
    });
    let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    for (rank, (y2, dx2, _, _)) in results.iter().enumerate() {
        let rows = rank * n * C..(rank + 1) * n * C;
        close(&format!("rank {rank} output"), y2, &y[rows.clone()]);
        let want: Vec<f32> = dx[rows].iter().map(|v| 2.0 * v).collect();
        close(&format!("rank {rank} input gradient (×2)"), dx2, &want);
    }
    for (i, name) in names.iter().enumerate() {
        let mean: Vec<f32> = results[0].2[i].iter().zip(&results[1].2[i]).map(|(a, b)| (a + b) / 2.0).collect();
        close(&format!("{name}, averaged over the ranks"), &mean, &grad(&table, name));
    }
    // The recorded values: each rank's share ×2, so their mean is the whole micro-batch's.
    let lb = (results[0].3.load_balancing_sum + results[1].3.load_balancing_sum) / 2.0;
    let z = (results[0].3.z_sum + results[1].3.z_sum) / 2.0;
    assert!((lb - values.load_balancing_sum).abs() < 1e-5 && (z - values.z_sum).abs() < 1e-5, "{lb} {z} vs {values:?}");
}
