//! Mixture-of-experts routing and combining, Megatron-Core's top-k router.
//!
//! Shapes: logits, dlogits [N, E] (N tokens, E experts); probs, dprobs and experts [N, K] (the K
//! experts a token goes to, best first); yp, dyp [N·K, C] (the tokens' copies sorted by expert);
//! slot [N, K] (the row of yp holding token n's j-th copy); y, dy [N, C].
//!
//! - `topk_route`: the K largest selection scores of a row (ties to the lower expert), then either
//!   softmax over those K logits (Megatron's default, Mixtral's renormalised top-k) or, with
//!   `pre_softmax`, the softmax over all E read at the K places; with a per-expert score function
//!   (`Score::Sigmoid`, DeepSeek-V3's) f(x) at the K places renormalised to sum to 1 (K > 1); all
//!   times `scale`. The selection scores are the logits (softmax), the softmax (`pre_softmax`) or
//!   f(x) plus an optional per-expert bias that steers the choice but not the weights, limited to
//!   a row's best expert groups when `Groups` is set.
//! - `router_loss`: the load-balancing loss E / (K·T²) · Σ_e (Σ_n S[n, e]) · c_e (S the softmax
//!   over all experts, or f(x) normalised over the row for a per-expert score; c_e the copies
//!   routed to e; T the tokens the counts were taken over) and the z-loss
//!   Σ_n logsumexp(logits_n)² / total_tokens (the mean over the micro-batch); the gradient
//!   `dlogits` of grad_scale · (a·aux + z·zloss) is written (`=`); the counts are constants, as in
//!   Megatron.
//! - `unpermute`: y[n] = Σ_j probs[n, j] · yp[slot[n, j]], summed in j order; its backward writes
//!   dyp (each row of yp has one reader) and dprobs[n, j] = ⟨yp[slot[n, j]], dy[n]⟩. A copy an
//!   expert's capacity left out (`drop_over_capacity`, slot `DROPPED`) adds nothing and its
//!   dprobs is 0: Megatron multiplies the weights by the kept-copies mask, so no gradient reaches
//!   a dropped weight, while the kept ones keep the weights the top-k gave them.

use crate::real::Real;
use rayon::prelude::*;

/// Softmax of `x` into `s` (max subtracted), returning log Σ exp(x).
fn softmax_row<T: Real>(x: &[T], s: &mut [T]) -> T {
    let m = x.iter().copied().fold(T::neg_infinity(), T::max);
    let mut sum = T::zero();
    for (o, &v) in s.iter_mut().zip(x) {
        *o = (v - m).exp();
        sum += *o;
    }
    s.iter_mut().for_each(|o| *o = *o / sum);
    m + sum.ln()
}

/// The `k` largest entries of `row`, best first; ties go to the lower index. Entries at −∞ (the
/// experts a group limit left out) are taken only when nothing else is left.
fn topk<T: Real>(row: &[T], out: &mut [u32]) {
    for j in 0..out.len() {
        let mut best: Option<usize> = None;
        for (e, &v) in row.iter().enumerate() {
            if out[..j].contains(&(e as u32)) {
                continue;
            }
            if best.is_none_or(|b| v > row[b]) {
                best = Some(e);
            }
        }
        out[j] = best.unwrap_or(0) as u32;
    }
}

/// What a token's logit becomes before the top-k (Megatron's --moe-router-score-function).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Score {
    /// Softmax over the experts (before the top-k with `pre_softmax`, else over the chosen k).
    #[default]
    Softmax,
    /// σ(x) per expert (DeepSeek-V3), the chosen k's scores renormalised to sum to 1 when k > 1.
    Sigmoid,
    /// √softplus(x) per expert, renormalised as `Sigmoid`.
    SqrtSoftplus,
}

impl Score {
    /// f(x) for the per-expert scores (Sigmoid, SqrtSoftplus).
    fn f<T: Real>(self, x: T) -> T {
        match self {
            Score::Softmax | Score::Sigmoid => T::one() / (T::one() + (-x).exp()),
            Score::SqrtSoftplus => softplus(x).sqrt(),
        }
    }
    /// f'(x) from x and f(x).
    fn df<T: Real>(self, x: T, f: T) -> T {
        match self {
            Score::Softmax | Score::Sigmoid => f * (T::one() - f),
            // d√sp/dx = σ(x) / (2√sp); √sp underflows to 0 only where σ does too.
            Score::SqrtSoftplus if f > T::zero() => T::one() / (T::one() + (-x).exp()) / (T::c(2.0) * f),
            Score::SqrtSoftplus => T::zero(),
        }
    }
}

fn softplus<T: Real>(x: T) -> T {
    if x > T::c(20.0) { x } else { x.exp().ln_1p() }
}

/// The renormalisation's guard against a zero sum (Megatron's 1e-20).
const NORM_EPS: f64 = 1e-20;

/// Group-limited routing (DeepSeek's, Megatron's --moe-router-num-groups / --moe-router-group-topk):
/// the experts in `num` equal groups of consecutive indices, each group scored by the sum of its
/// k / `topk` best selection scores, and a token's k experts taken from its `topk` best groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Groups {
    pub num: usize,
    pub topk: usize,
}

/// A router's choices, as `topk_route` and its backward take them.
#[derive(Clone, Copy, Debug)]
pub struct Routing<'a, T> {
    pub k: usize,
    pub pre_softmax: bool,
    pub scale: T,
    pub score: Score,
    pub groups: Option<Groups>,
    /// Added to the scores for the choice alone, not the weights (DeepSeek-V3's expert bias; a
    /// per-expert score function only).
    pub bias: Option<&'a [T]>,
}

impl<T: Real> Routing<'_, T> {
    /// Plain top-k routing of `k` with softmax over the chosen k, times `scale`.
    pub fn top(k: usize, pre_softmax: bool, scale: T) -> Routing<'static, T> {
        Routing { k, pre_softmax, scale, score: Score::Softmax, groups: None, bias: None }
    }

    /// The row's scores the choice is made on, into `sel`.
    fn selection(&self, row: &[T], sel: &mut [T]) {
        match self.score {
            Score::Softmax if self.pre_softmax => {
                softmax_row(row, sel);
            }
            Score::Softmax => sel.copy_from_slice(row),
            s => sel.iter_mut().zip(row).for_each(|(o, &x)| *o = s.f(x)),
        }
        if let Some(b) = self.bias {
            sel.iter_mut().zip(b).for_each(|(o, &b)| *o += b);
        }
        if let Some(g) = self.groups {
            limit_to_groups(sel, g, self.k);
        }
    }
}

/// Sets the selection scores outside the row's best `g.topk` groups to −∞.
fn limit_to_groups<T: Real>(sel: &mut [T], g: Groups, k: usize) {
    let size = sel.len() / g.num;
    let per = (k / g.topk).max(1).min(size);
    let mut best = vec![0u32; per];
    let scores: Vec<T> = sel
        .chunks(size)
        .map(|grp| {
            topk(grp, &mut best);
            best.iter().map(|&i| grp[i as usize]).sum()
        })
        .collect();
    let mut chosen = vec![0u32; g.topk];
    topk(&scores, &mut chosen);
    for (j, grp) in sel.chunks_mut(size).enumerate() {
        if !chosen.contains(&(j as u32)) {
            grp.fill(T::neg_infinity());
        }
    }
}

pub fn topk_route<T: Real>(logits: &[T], e: usize, r: &Routing<T>, probs: &mut [T], experts: &mut [u32]) {
    let k = r.k;
    probs.par_chunks_mut(k).zip(experts.par_chunks_mut(k)).zip(logits.par_chunks(e)).for_each(|((p, ix), row)| {
        let mut sel = vec![T::zero(); e];
        r.selection(row, &mut sel);
        topk(&sel, ix);
        match r.score {
            Score::Softmax if r.pre_softmax => {
                softmax_row(row, &mut sel);
                p.iter_mut().zip(ix.iter()).for_each(|(o, &i)| *o = sel[i as usize]);
            }
            Score::Softmax => {
                let chosen: Vec<T> = ix.iter().map(|&i| row[i as usize]).collect();
                softmax_row(&chosen, p);
            }
            s => {
                p.iter_mut().zip(ix.iter()).for_each(|(o, &i)| *o = s.f(row[i as usize]));
                if k > 1 {
                    let d = p.iter().copied().sum::<T>() + T::c(NORM_EPS);
                    p.iter_mut().for_each(|o| *o = *o / d);
                }
            }
        }
        p.iter_mut().for_each(|o| *o = r.scale * *o);
    });
}

/// dlogits (`=`) of Σ dprobs · probs with the choice `experts` held fixed (the bias and the
/// group limit change only the choice).
pub fn topk_route_bwd<T: Real>(
    logits: &[T],
    experts: &[u32],
    dprobs: &[T],
    e: usize,
    r: &Routing<T>,
    dlogits: &mut [T],
) {
    let (k, scale) = (r.k, r.scale);
    dlogits.par_chunks_mut(e).zip(logits.par_chunks(e)).enumerate().for_each(|(n, (dl, row))| {
        let (ix, dp) = (&experts[n * k..(n + 1) * k], &dprobs[n * k..(n + 1) * k]);
        dl.fill(T::zero());
        match r.score {
            Score::Softmax if r.pre_softmax => {
                let mut s = vec![T::zero(); e];
                softmax_row(row, &mut s);
                let mut g = vec![T::zero(); e];
                ix.iter().zip(dp).for_each(|(&i, &d)| g[i as usize] += scale * d);
                let dot: T = s.iter().zip(&g).map(|(&a, &b)| a * b).sum();
                dl.iter_mut().zip(s.iter().zip(&g)).for_each(|(o, (&si, &gi))| *o = si * (gi - dot));
            }
            Score::Softmax => {
                let sel: Vec<T> = ix.iter().map(|&i| row[i as usize]).collect();
                let mut q = vec![T::zero(); k];
                softmax_row(&sel, &mut q);
                let dot: T = q.iter().zip(dp).map(|(&a, &d)| a * scale * d).sum();
                for ((&i, &qi), &d) in ix.iter().zip(&q).zip(dp) {
                    dl[i as usize] = qi * (scale * d - dot);
                }
            }
            s => {
                let f: Vec<T> = ix.iter().map(|&i| s.f(row[i as usize])).collect();
                // p_j = scale · f_j / D (D = Σ f + ε) when k > 1, else scale · f_j.
                let ds: Vec<T> = if k > 1 {
                    let d = f.iter().copied().sum::<T>() + T::c(NORM_EPS);
                    let dot: T = f.iter().zip(dp).map(|(&a, &b)| a * b).sum();
                    dp.iter().map(|&g| scale * (g / d - dot / (d * d))).collect()
                } else {
                    dp.iter().map(|&g| scale * g).collect()
                };
                for ((&i, &fi), &g) in ix.iter().zip(&f).zip(&ds) {
                    dl[i as usize] += g * s.df(row[i as usize], fi);
                }
            }
        }
    });
}

/// Coefficients of `router_loss`.
#[derive(Clone, Copy, Debug)]
pub struct RouterLossCoeffs<T> {
    pub topk: usize,
    /// Tokens the expert counts were taken over, and the z-loss's mean's count: the micro-batch's
    /// (more than these rows when its tokens lie on several context-parallel ranks).
    pub total_tokens: T,
    pub aux: T,
    pub z: T,
    pub grad_scale: T,
    /// The load-balancing loss's probabilities: the softmax, or a per-expert score function's
    /// values normalised over the row (Megatron's scores for the auxiliary loss).
    pub score: Score,
    /// Sequences the rows (consecutive, equal runs) and `counts` ([seqs, E]) are split into:
    /// 1 for the micro-batch's loss, the batch size for DeepSeek's sequence-level loss (the mean
    /// over sequences of each sequence's own loss).
    pub seqs: usize,
}

/// Returns (load-balancing loss, z-loss), both without their coefficients. With `c.seqs` > 1 the
/// load-balancing loss is the mean over sequences of E / (K·T_s²) · Σ_e (Σ_{n in s} S[n, e]) ·
/// c[s, e] (T_s = total_tokens / seqs, a whole sequence's tokens).
pub fn router_loss<T: Real>(logits: &[T], e: usize, counts: &[T], c: RouterLossCoeffs<T>, dlogits: &mut [T]) -> (T, T) {
    let seqs = c.seqs.max(1);
    let per_seq = c.total_tokens / T::c(seqs as f64);
    let w = T::c(e as f64) / (T::c((c.topk * seqs) as f64) * per_seq * per_seq);
    let rows_per_seq = (logits.len() / e.max(1) / seqs).max(1);
    // Per row: (Σ_e S[n, e] c_e, lse_n²), the softmax written into dlogits' row first.
    let rows: Vec<(T, T)> = dlogits
        .par_chunks_mut(e)
        .zip(logits.par_chunks(e))
        .enumerate()
        .map(|(n, (dl, row))| {
            let s = (n / rows_per_seq).min(seqs - 1);
            let counts = &counts[s * e..(s + 1) * e];
            let lse = softmax_row(row, dl);
            let dz = c.z * T::c(2.0) * lse / c.total_tokens;
            let sc = match c.score {
                Score::Softmax => {
                    let sc: T = dl.iter().zip(counts).map(|(&s, &cnt)| s * cnt).sum();
                    // d aux / d logits = S ⊙ (w·c − Σ S w c); d z / d logits = 2·lse·S / N.
                    for (o, &cnt) in dl.iter_mut().zip(counts) {
                        let s = *o;
                        *o = c.grad_scale * (c.aux * s * (w * cnt - w * sc) + dz * s);
                    }
                    sc
                }
                score => {
                    // S = f / D (D = Σ f + ε): d aux / d x_e = f'_e · (w·c_e − Σ S w c) / D.
                    let f: Vec<T> = row.iter().map(|&x| score.f(x)).collect();
                    let d = f.iter().copied().sum::<T>() + T::c(NORM_EPS);
                    let sc: T = f.iter().zip(counts).map(|(&v, &cnt)| v / d * cnt).sum();
                    for (((o, &cnt), &x), &fv) in dl.iter_mut().zip(counts).zip(row).zip(&f) {
                        let soft = *o;
                        let daux = score.df(x, fv) * (w * cnt - w * sc) / d;
                        *o = c.grad_scale * (c.aux * daux + dz * soft);
                    }
                    sc
                }
            };
            (sc, lse * lse)
        })
        .collect();
    let (sc, z2) = rows.iter().fold((T::zero(), T::zero()), |(a, b), &(x, y)| (a + x, b + y));
    (w * sc, z2 / c.total_tokens)
}

pub fn unpermute<T: Real>(yp: &[T], slot: &[u32], probs: &[T], c: usize, k: usize, y: &mut [T]) {
    y.par_chunks_mut(c).enumerate().for_each(|(n, o)| {
        o.fill(T::zero());
        for j in (0..k).filter(|&j| slot[n * k + j] != DROPPED) {
            let (r, p) = (slot[n * k + j] as usize, probs[n * k + j]);
            o.iter_mut().zip(&yp[r * c..(r + 1) * c]).for_each(|(a, &b)| *a += p * b);
        }
    });
}

#[allow(clippy::too_many_arguments)]
pub fn unpermute_bwd<T: Real>(
    yp: &[T],
    slot: &[u32],
    probs: &[T],
    dy: &[T],
    c: usize,
    k: usize,
    dyp: &mut [T],
    dprobs: &mut [T],
) {
    dprobs.par_chunks_mut(k).enumerate().for_each(|(n, dp)| {
        let g = &dy[n * c..(n + 1) * c];
        for (j, d) in dp.iter_mut().enumerate() {
            *d = match slot[n * k + j] {
                DROPPED => T::zero(),
                r => yp[r as usize * c..(r as usize + 1) * c].iter().zip(g).map(|(&a, &b)| a * b).sum(),
            };
        }
    });
    // Rows of dyp in token order: each is written once.
    for n in 0..slot.len() / k.max(1) {
        let g = &dy[n * c..(n + 1) * c];
        for j in (0..k).filter(|&j| slot[n * k + j] != DROPPED) {
            let (r, p) = (slot[n * k + j] as usize, probs[n * k + j]);
            dyp[r * c..(r + 1) * c].iter_mut().zip(g).for_each(|(o, &b)| *o = p * b);
        }
    }
}

/// The expert of a token copy that an expert's capacity left out: it has no row and no weight.
pub const DROPPED: u32 = u32::MAX;

/// Which copies an expert keeps when more than its capacity chose it (Megatron's
/// --moe-token-drop-policy).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DropPolicy {
    /// The copies with the largest routing weights (`probs`, Megatron's default); equal weights
    /// keep the earlier token.
    #[default]
    Probs,
    /// The earliest tokens (`position`).
    Position,
}

/// Token dropping: `experts` and `probs` are [N, K] row-major; each expert keeps at most
/// `capacity` of the copies routed to it, chosen by `policy`, and every other copy's expert
/// becomes `DROPPED`.
pub fn drop_over_capacity<T: Real>(
    experts: &[u32],
    probs: &[T],
    num_experts: usize,
    capacity: usize,
    policy: DropPolicy,
) -> Vec<u32> {
    let mut by_expert: Vec<Vec<usize>> = vec![vec![]; num_experts];
    for (i, &e) in experts.iter().enumerate() {
        if let Some(b) = by_expert.get_mut(e as usize) {
            b.push(i);
        }
    }
    let mut out = experts.to_vec();
    for copies in by_expert.iter_mut().filter(|c| c.len() > capacity) {
        if policy == DropPolicy::Probs {
            // Stable: equal weights keep token order.
            copies.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap_or(std::cmp::Ordering::Equal));
        }
        copies[capacity..].iter().for_each(|&i| out[i] = DROPPED);
    }
    out
}

/// Sorts the tokens' copies by expert: `perm[row]` is the token of each row (experts in order,
/// tokens ascending within one, as Megatron's permute), `slot[n·K + j]` the row of token n's j-th
/// copy (`DROPPED` for a dropped copy, which gets no row), `counts[e]` the rows of expert e.
pub fn sort_by_expert(experts: &[u32], k: usize, num_experts: usize) -> (Vec<u32>, Vec<u32>, Vec<usize>) {
    let mut counts = vec![0usize; num_experts];
    experts.iter().filter(|&&x| x != DROPPED).for_each(|&x| counts[x as usize] += 1);
    let mut next: Vec<usize> = counts
        .iter()
        .scan(0, |acc, &c| {
            let start = *acc;
            *acc += c;
            Some(start)
        })
        .collect();
    let mut perm = vec![0u32; counts.iter().sum()];
    let mut slot = vec![DROPPED; experts.len()];
    for (i, &x) in experts.iter().enumerate().filter(|&(_, &x)| x != DROPPED) {
        let row = next[x as usize];
        next[x as usize] += 1;
        perm[row] = (i / k.max(1)) as u32;
        slot[i] = row as u32;
    }
    (perm, slot, counts)
}
