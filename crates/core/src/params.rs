//! The parameter table: every parameter's metadata, and flat buffers with typed views.
//!
//! Parameters live in one flat buffer (the model dtype) and their gradients in one flat fp32
//! main_grad buffer, both laid out by the same table; each parameter is a view (`Tensor::view`).
//! DDP buckets, the distributed optimizer and checkpoints are all built from this one table.
//! Initial values are drawn per parameter from Philox with a stream derived from the parameter's
//! name and the element's global index, so they do not depend on how the model is split.

use crate::rng::Philox;
use crate::{DType, Device, Error, Result, Shape, Tensor};

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    Normal {
        std: f32,
    },
    /// Uniform on [lo, hi) (PyTorch's Conv1d default is ±1/√fan_in).
    Uniform {
        lo: f32,
        hi: f32,
    },
    /// ln u for u uniform on [lo, hi): Mamba's A_log (A from 1 to 16).
    LogUniform {
        lo: f32,
        hi: f32,
    },
    /// Mamba's dt bias: softplus⁻¹(dt) for dt = exp(u), u uniform on [ln min, ln max), dt at
    /// least `floor`; softplus of it starts each head's step size between min and max.
    DtBias {
        min: f32,
        max: f32,
        floor: f32,
    },
}

impl Init {
    /// Random values from element `offset` of `rng`'s stream into `out` (constants ignore it).
    fn fill(self, rng: &Philox, offset: u64, out: &mut [f32]) {
        let uniform = |out: &mut [f32], f: &dyn Fn(f64) -> f64| {
            rng.fill_uniform(offset, out);
            out.iter_mut().for_each(|v| *v = f(*v as f64) as f32);
        };
        match self {
            Init::Zeros => out.fill(0.0),
            Init::Ones => out.fill(1.0),
            Init::Normal { std } => rng.fill_normal(offset, 0.0, std, out),
            Init::Uniform { lo, hi } => uniform(out, &|u| lo as f64 + u * (hi - lo) as f64),
            Init::LogUniform { lo, hi } => uniform(out, &|u| (lo as f64 + u * (hi - lo) as f64).ln()),
            Init::DtBias { min, max, floor } => uniform(out, &|u| {
                let (a, b) = ((min as f64).ln(), (max as f64).ln());
                let dt = (a + u * (b - a)).exp().max(floor as f64);
                // softplus⁻¹(dt) = dt + ln(1 − e^(−dt))
                dt + (-(-dt).exp_m1()).ln()
            }),
        }
    }
}

/// How the split dim of a tensor-parallel parameter divides into blocks, each cut across the
/// ranks on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocks {
    /// `n` equal blocks (1: the dim as one block; 2: SwiGLU's gate|value fc1).
    Equal(usize),
    /// Blocks of these lengths along the dim, in order, zeros past the last: Mamba's in_proj
    /// (z | x | B | C | dt) and its convolution (x | B | C), whose blocks differ in length.
    Sizes([usize; 5]),
}

impl Blocks {
    /// How many blocks.
    pub fn count(&self) -> usize {
        match self {
            Blocks::Equal(n) => *n,
            Blocks::Sizes(s) => s.iter().take_while(|&&x| x > 0).count(),
        }
    }

    /// Block `k`'s (start, length) along a dim of length `g`.
    pub fn span(&self, k: usize, g: usize) -> (usize, usize) {
        match self {
            Blocks::Equal(n) => (k * (g / n), g / n),
            Blocks::Sizes(s) => (s[..k].iter().sum(), s[k]),
        }
    }
}

/// Which part of a parameter a tensor-parallel rank holds along `ParamMeta::split_dim`: the dim
/// is seen as `blocks`, each cut into `size` equal parts, and this rank holds part `rank` of
/// every block, in block order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
    pub blocks: Blocks,
}

impl Shard {
    pub const WHOLE: Shard = Shard { rank: 0, size: 1, blocks: Blocks::Equal(1) };

    /// A rank's part of a dim cut as one block.
    pub fn of(rank: usize, size: usize) -> Shard {
        Shard { rank, size, blocks: Blocks::Equal(1) }
    }

    /// Whether the blocks make up a dim of length `g` and each divides into `size` parts.
    pub fn divides(&self, g: usize) -> bool {
        let n = self.blocks.count();
        let fits = match self.blocks {
            Blocks::Equal(n) => n > 0 && g % n == 0,
            Blocks::Sizes(s) => s[n..].iter().all(|&x| x == 0) && s.iter().sum::<usize>() == g,
        };
        self.size > 0
            && self.rank < self.size
            && n > 0
            && fits
            && (0..n).all(|k| self.blocks.span(k, g).1 % self.size == 0)
    }

    /// Global index along the split dim of local index `l`, for a global length `g`.
    pub fn global_index(&self, l: usize, g: usize) -> usize {
        self.locate(l, g).0
    }

    /// Local index `l` along the split dim (global length `g`): its global index and how many
    /// local indices from `l` on stay contiguous in both (the rest of its block's part).
    pub fn locate(&self, l: usize, g: usize) -> (usize, usize) {
        let mut first = 0;
        for k in 0..self.blocks.count() {
            let (start, len) = self.blocks.span(k, g);
            let part = len / self.size;
            if l < first + part {
                return (start + self.rank * part + (l - first), first + part - l);
            }
            first += part;
        }
        (g, 1) // past the part: out of range for any caller that checked its bounds
    }

    /// Global index `x` along the split dim (length `g`): this rank's local index of it and the
    /// run from there, or None where another rank holds it.
    pub fn local_of(&self, x: usize, g: usize) -> Option<(usize, usize)> {
        let mut first = 0;
        for k in 0..self.blocks.count() {
            let (start, len) = self.blocks.span(k, g);
            let part = len / self.size;
            if x < start + len {
                let w = x - start;
                return (w / part == self.rank).then(|| (first + w % part, part - w % part));
            }
            first += part;
        }
        None
    }
}

/// Everything the layers above need to know about one parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamMeta {
    /// Stable Megatron-style name, e.g. `decoder.layers.3.self_attention.linear_qkv.weight`.
    pub name: String,
    /// Shape held by this rank.
    pub local_shape: Shape,
    /// Shape of the whole parameter across tensor-parallel ranks.
    pub global_shape: Shape,
    /// Dimension split across tensor-parallel ranks, if any.
    pub split_dim: Option<usize>,
    /// This rank's part along `split_dim` (`Shard::WHOLE` when not split).
    pub shard: Shard,
    /// Same value on every tensor-parallel rank (counted once in norms).
    pub replicated: bool,
    /// Replicated, but used on sequence shards, so each tensor-parallel rank holds part of its
    /// gradient: the grads are summed over the tensor-parallel group before the step.
    pub sequence_parallel: bool,
    /// A copy of a parameter another pipeline stage owns (the tied output weight on the last
    /// stage): its grads are summed with the owner's, and norms count it once.
    pub pipeline_copy: bool,
    pub init: Init,
    /// Megatron applies no weight decay to biases and norm weights.
    pub weight_decay: bool,
    /// An expert's parameter (Megatron's `allreduce = False`): held by one expert-parallel rank,
    /// its gradient averaged over the expert-data-parallel group instead of the data-parallel
    /// one. Expert parameters lie first in the flat buffers (`ParamTable::expert_range`).
    pub expert: bool,
    /// Not trained (Megatron's --freeze-LM / --freeze-ViT): the optimizer leaves it as it is and
    /// its gradient counts in no norm.
    pub frozen: bool,
    /// The word embedding or the output layer (any stage's copy; Megatron's
    /// `is_embedding_or_output_parameter`): trained at --decoupled-lr where one is given.
    pub embedding_or_output: bool,
}

impl ParamMeta {
    /// A parameter held whole on every rank.
    pub fn replicated(name: impl Into<String>, shape: impl Into<Shape>, init: Init, weight_decay: bool) -> Self {
        let shape = shape.into();
        ParamMeta {
            name: name.into(),
            local_shape: shape.clone(),
            global_shape: shape,
            split_dim: None,
            shard: Shard::WHOLE,
            replicated: true,
            sequence_parallel: false,
            pipeline_copy: false,
            init,
            weight_decay,
            expert: false,
            frozen: false,
            embedding_or_output: false,
        }
    }

    /// A parameter split along `dim` across tensor-parallel ranks; `shard`'s blocks must make up
    /// `global_shape[dim]`, each a multiple of `shard.size`.
    pub fn split(
        name: impl Into<String>,
        global_shape: impl Into<Shape>,
        dim: usize,
        shard: Shard,
        init: Init,
        weight_decay: bool,
    ) -> Result<Self> {
        let (name, global_shape) = (name.into(), global_shape.into());
        let g = global_shape.dims().get(dim).copied().unwrap_or(0);
        if !shard.divides(g) {
            return Err(Error::InvalidArgument {
                op: "ParamMeta::split",
                msg: format!(
                    "`{name}`: dimension {dim} of {:?} cannot be split into {} parts ({:?})",
                    global_shape.dims(),
                    shard.size,
                    shard.blocks
                ),
            });
        }
        let mut local = global_shape.dims().to_vec();
        local[dim] /= shard.size;
        Ok(ParamMeta {
            name,
            local_shape: local.into(),
            global_shape,
            split_dim: Some(dim),
            shard,
            replicated: false,
            sequence_parallel: false,
            pipeline_copy: false,
            init,
            weight_decay,
            expert: false,
            frozen: false,
            embedding_or_output: false,
        })
    }

    /// Marks a replicated parameter whose gradient is computed on sequence shards.
    pub fn on_sequence_shards(mut self, yes: bool) -> Self {
        self.sequence_parallel = yes && self.replicated;
        self
    }
}

/// Index of a parameter in its table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParamId(pub usize);

/// Collects parameter metadata while a model is built.
#[derive(Default, Debug, Clone)]
pub struct ParamTableBuilder {
    metas: Vec<ParamMeta>,
}

impl ParamTableBuilder {
    /// Parameters added so far.
    pub fn len(&self) -> usize {
        self.metas.len()
    }
    pub fn is_empty(&self) -> bool {
        self.metas.is_empty()
    }
    /// Marks every parameter added since the first `start` as an expert's (`ParamMeta::expert`).
    pub fn mark_expert_since(&mut self, start: usize) {
        self.metas.iter_mut().skip(start).for_each(|m| m.expert = true);
    }

    /// Marks `id` as the word embedding or the output layer (`ParamMeta::embedding_or_output`).
    pub fn mark_embedding_or_output(&mut self, id: ParamId) {
        if let Some(m) = self.metas.get_mut(id.0) {
            m.embedding_or_output = true;
        }
    }

    /// The declarations, without building the table.
    pub fn into_metas(self) -> Vec<ParamMeta> {
        self.metas
    }

    pub fn add(&mut self, meta: ParamMeta) -> Result<ParamId> {
        if self.metas.iter().any(|m| m.name == meta.name) {
            return Err(Error::InvalidArgument {
                op: "ParamTable",
                msg: format!("duplicate parameter name `{}`", meta.name),
            });
        }
        self.metas.push(meta);
        Ok(ParamId(self.metas.len() - 1))
    }

    /// Allocates the buffers on `device`, params in `dtype`, grads in f32, and initialises from `seed`.
    pub fn build(self, device: &Device, dtype: DType, seed: u64) -> Result<ParamTable> {
        self.build_padded(device, dtype, seed, 1)
    }

    /// As `build`, with the flat buffers padded (with zeros) to a multiple of `multiple` elements,
    /// so that data-parallel buckets split evenly. Expert parameters come first, in their own
    /// region padded to a multiple of `multiple` too (the expert-data-parallel size divides the
    /// data-parallel one), then the rest; each region in the order the parameters were added.
    pub fn build_padded(self, device: &Device, dtype: DType, seed: u64, multiple: usize) -> Result<ParamTable> {
        let m = multiple.max(1);
        let mut offsets = vec![0; self.metas.len()];
        let mut at = 0;
        for expert in [true, false] {
            for (i, meta) in self.metas.iter().enumerate().filter(|(_, meta)| meta.expert == expert) {
                offsets[i] = at;
                at += meta.local_shape.elem_count();
            }
            at = at.div_ceil(m) * m;
        }
        let expert_len = if self.metas.iter().any(|x| x.expert) {
            self.metas.iter().filter(|x| x.expert).map(|x| x.local_shape.elem_count()).sum::<usize>().div_ceil(m) * m
        } else {
            0
        };
        let total = self.metas.iter().map(|x| x.local_shape.elem_count()).sum();
        let mut host = vec![0f32; at];
        let mut draws = Vec::new();
        // Each parameter's own slice of the buffer, in flat order (init_values borrows them all).
        let mut order: Vec<usize> = (0..self.metas.len()).collect();
        order.sort_by_key(|&i| offsets[i]);
        let mut rest = &mut host[..];
        let mut pos = 0;
        for i in order {
            let meta = &self.metas[i];
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(offsets[i] - pos);
            let (mine, tail) = tail.split_at_mut(meta.local_shape.elem_count());
            rest = tail;
            pos = offsets[i] + mine.len();
            init_values(meta, seed, mine, &mut draws);
        }
        fill_all(draws);
        let params = Tensor::from_f32(&host, [at], dtype, device)?;
        let grads = Tensor::zeros([at], DType::F32, device)?;
        let written = std::sync::Mutex::new(vec![true; self.metas.len()]);
        Ok(ParamTable {
            metas: self.metas,
            offsets,
            total,
            expert_len,
            params,
            grads,
            written,
            pending: Default::default(),
        })
    }
}

/// Random draws still to make: the generator, the counter of the first element, the init, where.
type Draw<'a> = (Philox, u64, Init, &'a mut [f32]);

/// Element i of the whole parameter draws Philox counter i of the parameter's stream, so a shard
/// holds exactly the values of its part of the unsplit parameter. Constant inits are written
/// here; random ones are queued in `draws` (see `fill_all`).
fn init_values<'a>(m: &ParamMeta, seed: u64, out: &'a mut [f32], draws: &mut Vec<Draw<'a>>) {
    let init = m.init;
    if let Init::Zeros | Init::Ones = init {
        return init.fill(&Philox::new(seed), 0, out);
    }
    let rng = Philox::new(seed).with_stream(crate::rng::fnv1a64(&m.name));
    let Some(d) = m.split_dim else { return draws.push((rng, 0, init, out)) };
    let (local, global) = (m.local_shape.dims(), m.global_shape.dims());
    let inner: usize = local[d + 1..].iter().product();
    let outer: usize = local[..d].iter().product();
    let runs = split_runs(m.shard, local[d], global[d]);
    let mut rest = out;
    for o in 0..outer {
        for &(n, g0) in &runs {
            let start = (o * global[d] + g0) * inner;
            let (run, tail) = std::mem::take(&mut rest).split_at_mut(n * inner);
            rest = tail;
            draws.push((rng, start as u64, init, run));
        }
    }
}

/// The shard's local indices along the split dim as runs that are contiguous in the whole
/// parameter too: (length, global index of the first), in local order. One draw per run and
/// outer index, not per local index: a row-parallel weight split along its last dim would
/// otherwise queue a draw per element (GPT 6.7B under TP2: ≈ 1e9 draws, over 100 GB of host
/// memory before the first step).
fn split_runs(shard: Shard, local: usize, global: usize) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for l in 0..local {
        let g = shard.global_index(l, global);
        match runs.last_mut() {
            Some((n, g0)) if *g0 + *n == g => *n += 1,
            _ => runs.push((1, g)),
        }
    }
    runs
}

/// Makes the random draws on every core. Each element depends on its counter alone (Philox is
/// counter-based), so how the work is cut changes no value; a 1.3B model's 1.3e9 draws took most
/// of a minute on one thread.
fn fill_all(draws: Vec<Draw<'_>>) {
    const PIECE: usize = 1 << 16;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).max(1);
    let total: usize = draws.iter().map(|d| d.3.len()).sum();
    let threads = if total <= 2 * PIECE { 1 } else { threads };
    let mut groups: Vec<Vec<Draw<'_>>> = (0..threads).map(|_| Vec::new()).collect();
    let mut next = 0;
    for (rng, start, init, out) in draws {
        for (k, piece) in out.chunks_mut(PIECE).enumerate() {
            groups[next % threads].push((rng, start + (k * PIECE) as u64, init, piece));
            next += 1;
        }
    }
    let run = |group: Vec<Draw<'_>>| {
        for (rng, start, init, out) in group {
            init.fill(&rng, start, out);
        }
    };
    if threads == 1 {
        groups.into_iter().for_each(run);
        return;
    }
    std::thread::scope(|s| {
        for g in groups.into_iter().filter(|g| !g.is_empty()) {
            s.spawn(move || run(g));
        }
    });
}

/// Parameter values still arriving into the flat buffer: the distributed optimizer's all-gathers
/// put off until the next forward reaches each bucket (`--overlap-param-gather`). `wait` returns
/// once every element of the flat range holds its new value (issuing what it must, in the same
/// order on every rank, and may issue more ahead).
pub trait PendingParams: Send + Sync {
    fn wait(&self, range: std::ops::Range<usize>) -> Result<()>;
}

/// Parameter metadata plus the flat parameter and main_grad buffers. main_grad is fp32 unless
/// `set_grad_dtype` makes it bf16 (Megatron's `--grad-reduce-in-bf16`: weight gradients leave
/// their GEMMs in bf16, the data-parallel reduction and the optimizer read half the bytes).
///
/// main_grad is zeroed lazily in a training step: `defer_zero_grads` marks every parameter's
/// gradient stale instead of clearing 4 bytes per parameter, the first backward op to reach a
/// parameter writes its gradient (`grad_acc` says which: a weight-gradient GEMM with beta = 0, a
/// column sum that stores), later ones add, and `settle_grads` zeroes what no op reached before
/// anything reads the buffer. Architecture invariant: every reader of `flat_grads` in a deferred
/// step settles the range it reads first; `grad` settles its parameter itself.
///
/// Likewise the parameters, when their gathers are pending (`set_pending`): `param` waits for
/// its own range, and every reader of `flat_params`' values calls `settle_params` first.
pub struct ParamTable {
    metas: Vec<ParamMeta>,
    offsets: Vec<usize>,
    total: usize,
    /// The expert parameters' region, `0..expert_len` (0: none).
    expert_len: usize,
    params: Tensor,
    grads: Tensor,
    /// Per parameter: its main_grad view holds a value (zero or sums) rather than a stale one.
    written: std::sync::Mutex<Vec<bool>>,
    /// Parameter values still arriving (`set_pending`), if any.
    pending: std::sync::Mutex<Option<std::sync::Arc<dyn PendingParams>>>,
}

impl ParamTable {
    pub fn metas(&self) -> &[ParamMeta] {
        &self.metas
    }
    pub fn meta(&self, id: ParamId) -> &ParamMeta {
        &self.metas[id.0]
    }
    /// Marks the parameters `which` picks as frozen (`ParamMeta::frozen`); returns how many.
    /// Set before the optimizer is built, which reads it.
    pub fn freeze(&mut self, which: impl Fn(&ParamMeta) -> bool) -> usize {
        let mut n = 0;
        for m in self.metas.iter_mut().filter(|m| which(m)) {
            m.frozen = true;
            n += 1;
        }
        n
    }
    /// Puts weight decay on the parameters `which` picks (`ParamMeta::weight_decay`; Megatron's
    /// --apply-wd-to-qk-layernorm); returns how many. Set before the optimizer is built.
    pub fn decay(&mut self, which: impl Fn(&ParamMeta) -> bool) -> usize {
        let mut n = 0;
        for m in self.metas.iter_mut().filter(|m| which(m)) {
            m.weight_decay = true;
            n += 1;
        }
        n
    }
    pub fn len(&self) -> usize {
        self.metas.len()
    }
    pub fn is_empty(&self) -> bool {
        self.metas.is_empty()
    }
    /// Total elements across all parameters.
    pub fn numel(&self) -> usize {
        self.total
    }
    /// Length of the flat buffers (`numel` plus padding).
    pub fn flat_len(&self) -> usize {
        self.params.elem_count()
    }
    /// The flat range holding the expert parameters (`ParamMeta::expert`), padding included;
    /// empty without any. The other parameters lie above it.
    pub fn expert_range(&self) -> std::ops::Range<usize> {
        0..self.expert_len
    }
    /// Flat element range of parameter `id` in both buffers.
    pub fn range(&self, id: ParamId) -> std::ops::Range<usize> {
        let o = self.offsets[id.0];
        o..o + self.metas[id.0].local_shape.elem_count()
    }
    pub fn id(&self, name: &str) -> Option<ParamId> {
        self.metas.iter().position(|m| m.name == name).map(ParamId)
    }
    pub fn ids(&self) -> impl Iterator<Item = ParamId> + '_ {
        (0..self.metas.len()).map(ParamId)
    }
    /// The parameter as a view of the flat buffer (its pending values waited for first).
    pub fn param(&self, id: ParamId) -> Result<Tensor> {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(p) = pending {
            p.wait(self.range(id))?;
        }
        self.params.view(self.offsets[id.0], self.metas[id.0].local_shape.clone())
    }

    /// Parameter values will arrive through `p` (see `PendingParams`); whatever was pending
    /// before is settled first.
    pub fn set_pending(&self, p: std::sync::Arc<dyn PendingParams>) -> Result<()> {
        self.settle_params()?;
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
        Ok(())
    }

    /// Waits until every parameter value has arrived, so `flat_params` can be read.
    pub fn settle_params(&self) -> Result<()> {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner()).take();
        match pending {
            Some(p) => p.wait(0..self.flat_len()),
            None => Ok(()),
        }
    }
    /// Its main_grad view, holding a value: zeroed first if a deferred step has not
    /// reached it yet (so adding into it is always right).
    pub fn grad(&self, id: ParamId) -> Result<Tensor> {
        let reached = self.written()[id.0];
        if !reached {
            self.settle_grads(self.range(id))?;
        }
        self.grad_view(id)
    }

    fn grad_view(&self, id: ParamId) -> Result<Tensor> {
        self.grads.view(self.offsets[id.0], self.metas[id.0].local_shape.clone())
    }

    fn written(&self) -> std::sync::MutexGuard<'_, Vec<bool>> {
        self.written.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// For a backward op that produces this parameter's gradient: its main_grad view and whether
    /// to add into it (`true`) or overwrite it (`false`: the first op to reach it in a deferred
    /// step). Either way the view holds a value afterwards, so the op must write or add all of it.
    pub fn grad_acc(&self, id: ParamId) -> Result<(Tensor, bool)> {
        let v = self.grad_view(id)?;
        let mut w = self.written();
        let acc = w[id.0];
        w[id.0] = true;
        Ok((v, acc))
    }

    /// `grad_acc` for parameters one op produces together (a norm's weight and bias): one
    /// answer for all. Should some hold a value and others not, those are zeroed and all add.
    pub fn grads_acc(&self, ids: &[ParamId]) -> Result<(Vec<Tensor>, bool)> {
        let views = ids.iter().map(|&id| self.grad_view(id)).collect::<Result<Vec<_>>>()?;
        let flags: Vec<bool> = {
            let w = self.written();
            ids.iter().map(|id| w[id.0]).collect()
        };
        if flags.iter().all(|&f| f) || flags.iter().all(|&f| !f) {
            let mut w = self.written();
            ids.iter().for_each(|id| w[id.0] = true);
            return Ok((views, flags.first().copied().unwrap_or(true)));
        }
        for &id in ids {
            self.settle_grads(self.range(id))?;
        }
        Ok((views, true))
    }

    /// The flat parameter buffer. While gathers are pending (`set_pending`), `settle_params`
    /// before reading its values.
    pub fn flat_params(&self) -> &Tensor {
        &self.params
    }
    /// The flat main_grad buffer. In a deferred step (`defer_zero_grads`), `settle_grads` the
    /// range to be read first.
    pub fn flat_grads(&self) -> &Tensor {
        &self.grads
    }
    /// The main_grad buffer's dtype: f32 (the default) or bf16.
    pub fn grad_dtype(&self) -> DType {
        self.grads.dtype()
    }

    /// Reallocates main_grad, zeroed, as `dtype` (f32 or bf16), before any gradient is taken: the
    /// old buffer is freed first, so the switch never holds both. Should the new one not fit, the
    /// old dtype's buffer is made again (zeroed) and the error returned.
    pub fn set_grad_dtype(&mut self, dtype: DType) -> Result<()> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(Error::InvalidArgument {
                op: "ParamTable::set_grad_dtype",
                msg: format!("main_grad is f32 or bf16, not {dtype}"),
            });
        }
        if dtype == self.grads.dtype() {
            return Ok(());
        }
        let (n, old, device) = (self.grads.elem_count(), self.grads.dtype(), self.grads.device().clone());
        self.grads = Tensor::zeros([0], dtype, &device)?;
        self.written().iter_mut().for_each(|w| *w = true);
        match Tensor::zeros([n], dtype, &device) {
            Ok(g) => {
                self.grads = g;
                Ok(())
            }
            Err(e) => {
                self.grads = Tensor::zeros([n], old, &device)?;
                Err(e)
            }
        }
    }

    /// Zeroes main_grad now (one memset of the flat buffer).
    pub fn zero_grads(&self) -> Result<()> {
        self.grads.zero_()?;
        self.written().iter_mut().for_each(|w| *w = true);
        Ok(())
    }

    /// Starts a step whose backward writes each gradient first and adds after (see the type's
    /// doc): no memset.
    pub fn defer_zero_grads(&self) {
        self.written().iter_mut().for_each(|w| *w = false);
    }

    /// Zeroes the main_grad of every parameter overlapping the flat `range` that no backward op
    /// has reached since `defer_zero_grads` (neighbours as one memset), so the range can be read.
    pub fn settle_grads(&self, range: std::ops::Range<usize>) -> Result<()> {
        let mut w = self.written();
        let mut span: Option<std::ops::Range<usize>> = None;
        let clear = |s: &mut Option<std::ops::Range<usize>>| -> Result<()> {
            if let Some(r) = s.take() {
                self.grads.view(r.start, [r.len()])?.zero_()?;
            }
            Ok(())
        };
        for i in 0..self.metas.len() {
            let r = self.range(ParamId(i));
            if w[i] || r.end <= range.start || r.start >= range.end || r.is_empty() {
                if w[i] {
                    clear(&mut span)?;
                }
                continue;
            }
            w[i] = true;
            span = match span {
                // Parameters lie back to back within a region: one memset for neighbours.
                Some(s) if s.end == r.start => Some(s.start..r.end),
                Some(s) => {
                    clear(&mut Some(s))?;
                    Some(r)
                }
                None => Some(r),
            };
        }
        clear(&mut span)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(dtype: DType) -> ParamTable {
        let mut b = ParamTableBuilder::default();
        b.add(ParamMeta::replicated("a.weight", [2, 3], Init::Normal { std: 0.02 }, true)).unwrap();
        b.add(ParamMeta::replicated("a.bias", [3], Init::Zeros, false)).unwrap();
        b.add(ParamMeta::replicated("n.weight", [3], Init::Ones, false)).unwrap();
        b.build(&Device::Cpu, dtype, 7).unwrap()
    }

    /// A deferred step: the first op to reach a gradient stores, later ones add; settling zeroes
    /// only the gradients no op reached, so stale values never survive into a read.
    #[test]
    fn deferred_zeroing_stores_first_then_adds_and_settles_the_rest() {
        let t = table(DType::F32);
        t.flat_grads().update_f32("t", |g| g.fill(9.0)).unwrap(); // last step's values
        t.defer_zero_grads();
        let (w, acc) = t.grad_acc(ParamId(0)).unwrap();
        assert!(!acc, "first op of the step stores");
        w.update_f32("t", |g| g.fill(1.0)).unwrap();
        assert!(t.grad_acc(ParamId(0)).unwrap().1, "the next one adds");
        // A norm's weight and bias together: one reached (by grad), one not: both add, the
        // unreached one cleared first.
        let (g, acc) = t.grads_acc(&[ParamId(1), ParamId(2)]).unwrap();
        assert!(!acc && g.len() == 2, "neither reached: store");
        t.defer_zero_grads();
        assert_eq!(t.grad(ParamId(1)).unwrap().to_vec_f32().unwrap(), vec![0.0; 3], "grad() settles");
        let (_, acc) = t.grads_acc(&[ParamId(1), ParamId(2)]).unwrap();
        assert!(acc, "one reached: add");
        assert_eq!(t.grad(ParamId(2)).unwrap().to_vec_f32().unwrap(), vec![0.0; 3], "the other cleared");
        // Parameter 0 unreached this time: settling clears it and leaves the others.
        t.grad(ParamId(1)).unwrap().update_f32("t", |g| g.fill(2.0)).unwrap();
        t.settle_grads(0..t.flat_len()).unwrap();
        assert_eq!(t.flat_grads().to_vec_f32().unwrap(), [vec![0.0; 6], vec![2.0; 3], vec![0.0; 3]].concat());
        t.zero_grads().unwrap();
        assert!(t.grad_acc(ParamId(0)).unwrap().1, "after an eager zero every op adds");
    }

    /// Pending parameter values: `param` waits for its own range only, `settle_params` for all
    /// and then drops the hook; a new hook settles the old one first.
    #[test]
    fn pending_params_are_waited_for_by_range() {
        struct Log(std::sync::Mutex<Vec<std::ops::Range<usize>>>);
        impl PendingParams for Log {
            fn wait(&self, range: std::ops::Range<usize>) -> Result<()> {
                self.0.lock().unwrap().push(range);
                Ok(())
            }
        }
        let t = table(DType::F32);
        let log = std::sync::Arc::new(Log(Default::default()));
        t.set_pending(log.clone()).unwrap();
        t.param(ParamId(1)).unwrap();
        t.param(ParamId(2)).unwrap();
        assert_eq!(*log.0.lock().unwrap(), vec![6..9, 9..12]);
        t.settle_params().unwrap();
        t.param(ParamId(0)).unwrap();
        assert_eq!(*log.0.lock().unwrap(), vec![6..9, 9..12, 0..12], "settled, then no more waits");
        let second = std::sync::Arc::new(Log(Default::default()));
        t.set_pending(log.clone()).unwrap();
        t.set_pending(second.clone()).unwrap();
        assert_eq!(log.0.lock().unwrap().last(), Some(&(0..t.flat_len())), "the old hook settled");
        assert!(second.0.lock().unwrap().is_empty());
    }

    /// main_grad in bf16: every view takes the new dtype, zeroed; f16 and the like are refused.
    #[test]
    fn grads_can_be_held_in_bf16() {
        let mut t = table(DType::BF16);
        assert_eq!(t.grad_dtype(), DType::F32, "fp32 main_grad by default");
        t.flat_grads().update_f32("t", |g| g.fill(3.0)).unwrap();
        t.set_grad_dtype(DType::BF16).unwrap();
        assert_eq!(t.grad_dtype(), DType::BF16);
        assert_eq!(t.flat_grads().elem_count(), t.flat_len());
        let g = t.grad(ParamId(0)).unwrap();
        assert_eq!((g.dtype(), g.dims()), (DType::BF16, &[2usize, 3][..]));
        assert_eq!(t.flat_grads().to_vec_f32().unwrap(), vec![0.0; t.flat_len()], "zeroed");
        let e = t.set_grad_dtype(DType::F16).unwrap_err().to_string();
        assert!(e.contains("f32 or bf16"), "{e}");
        assert_eq!(t.grad_dtype(), DType::BF16, "a refused switch keeps the buffer");
    }

    #[test]
    fn views_tile_the_flat_buffers() {
        let t = table(DType::F32);
        assert_eq!(t.numel(), 12);
        let w = t.param(ParamId(0)).unwrap();
        assert_eq!(w.dims(), &[2, 3]);
        assert_eq!(t.param(ParamId(2)).unwrap().to_vec_f32().unwrap(), vec![1.0; 3]);
        t.grad(ParamId(1)).unwrap().update_f32("t", |g| g.fill(5.0)).unwrap();
        let flat = t.flat_grads().to_vec_f32().unwrap();
        assert_eq!(&flat[6..9], &[5.0; 3]);
        assert_eq!(flat.iter().filter(|&&x| x != 0.0).count(), 3);
    }

    #[test]
    fn init_depends_on_name_and_seed_not_order() {
        let a = table(DType::F32);
        let mut b = ParamTableBuilder::default();
        b.add(ParamMeta::replicated("n.weight", [3], Init::Ones, false)).unwrap();
        b.add(ParamMeta::replicated("a.weight", [2, 3], Init::Normal { std: 0.02 }, true)).unwrap();
        let b = b.build(&Device::Cpu, DType::F32, 7).unwrap();
        let wa = a.param(a.id("a.weight").unwrap()).unwrap().to_vec_f32().unwrap();
        let wb = b.param(b.id("a.weight").unwrap()).unwrap().to_vec_f32().unwrap();
        assert_eq!(wa, wb);
        assert!(wa.iter().all(|x| x.abs() < 0.2) && wa.iter().any(|&x| x != 0.0));
    }

    #[test]
    fn shards_hold_their_part_of_the_whole() {
        // [6, 4] split along dim 0 into 3 parts of 2 blocks (SwiGLU-style), and along dim 1.
        for (dim, blocks) in [(0, Blocks::Equal(2)), (0, Blocks::Equal(1)), (1, Blocks::Equal(1))] {
            let whole = {
                let mut b = ParamTableBuilder::default();
                b.add(ParamMeta::replicated("w", [6, 4], Init::Normal { std: 1.0 }, true)).unwrap();
                b.build(&Device::Cpu, DType::F32, 3).unwrap().flat_params().to_vec_f32().unwrap()
            };
            let size = if dim == 0 { 3 } else { 2 };
            let mut got = vec![f32::NAN; 24];
            for rank in 0..size {
                let shard = Shard { rank, size, blocks };
                let mut b = ParamTableBuilder::default();
                b.add(ParamMeta::split("w", [6, 4], dim, shard, Init::Normal { std: 1.0 }, true).unwrap()).unwrap();
                let local = b.build(&Device::Cpu, DType::F32, 3).unwrap().flat_params().to_vec_f32().unwrap();
                let ld = if dim == 0 { 6 / size } else { 4 / size };
                for (i, v) in local.iter().enumerate() {
                    let (r, c) = if dim == 0 { (i / 4, i % 4) } else { (i / ld, i % ld) };
                    let (gr, gc) = if dim == 0 { (shard.global_index(r, 6), c) } else { (r, shard.global_index(c, 4)) };
                    got[gr * 4 + gc] = *v;
                }
            }
            assert_eq!(got, whole, "dim {dim}, {blocks:?}");
        }
        let e = ParamMeta::split("w", [6, 4], 0, Shard::of(0, 4), Init::Zeros, true);
        assert!(e.unwrap_err().to_string().contains("`w`"));
        // Unequal blocks: each must divide by the ranks and together make up the dim.
        let bad = |sizes| !Shard { rank: 0, size: 2, blocks: Blocks::Sizes(sizes) }.divides(10);
        assert!(bad([4, 3, 3, 0, 0]) && bad([4, 4, 0, 0, 0]) && bad([4, 0, 6, 0, 0]));
        assert!(!bad([4, 2, 4, 0, 0]));
    }

    #[test]
    fn split_parameters_draw_in_runs() {
        // Contiguous shards are one run; SwiGLU-style shards (2 blocks) one run per block.
        assert_eq!(split_runs(Shard::of(1, 2), 4, 8), [(4, 4)]);
        assert_eq!(split_runs(Shard { rank: 1, size: 2, blocks: Blocks::Equal(2) }, 4, 8), [(2, 2), (2, 6)]);
        // Unequal blocks (4 | 2 | 4 of 10): rank 1 holds 2..4, 5..6 and 8..10.
        let mamba_like = Shard { rank: 1, size: 2, blocks: Blocks::Sizes([4, 2, 4, 0, 0]) };
        assert_eq!(split_runs(mamba_like, 5, 10), [(2, 2), (1, 5), (2, 8)]);
        for l in 0..5 {
            let (x, _) = mamba_like.locate(l, 10);
            assert_eq!(mamba_like.local_of(x, 10).map(|p| p.0), Some(l), "local {l} ↔ global {x}");
        }
        assert_eq!((mamba_like.local_of(0, 10), mamba_like.local_of(4, 10)), (None, None));
        assert_eq!(split_runs(Shard::WHOLE, 5, 5), [(5, 0)]);
        // A row-parallel weight ([out, in] split along in): one draw per row, not per element.
        let m = ParamMeta::split("w", [64, 1024], 1, Shard::of(1, 2), Init::Normal { std: 1.0 }, true).unwrap();
        let mut out = vec![0f32; 64 * 512];
        let mut draws = Vec::new();
        init_values(&m, 3, &mut out, &mut draws);
        assert_eq!(draws.len(), 64);
    }

    #[test]
    fn parallel_init_equals_one_serial_fill() {
        // Several 64k pieces per parameter and more pieces than cores: the threads' cut of the
        // work must not show in the values.
        let mut b = ParamTableBuilder::default();
        b.add(ParamMeta::replicated("big.weight", [300, 700], Init::Normal { std: 0.5 }, true)).unwrap();
        b.add(ParamMeta::replicated("small.bias", [5], Init::Ones, false)).unwrap();
        b.add(ParamMeta::replicated("other.weight", [70_001], Init::Normal { std: 2.0 }, true)).unwrap();
        let t = b.build(&Device::Cpu, DType::F32, 11).unwrap();
        for (name, n, std) in [("big.weight", 210_000, 0.5), ("other.weight", 70_001, 2.0)] {
            let mut want = vec![0f32; n];
            Philox::new(11).with_stream(crate::rng::fnv1a64(name)).fill_normal(0, 0.0, std, &mut want);
            let got = t.param(t.id(name).unwrap()).unwrap().to_vec_f32().unwrap();
            assert!(got.len() == n && got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}");
        }
        assert_eq!(t.param(t.id("small.bias").unwrap()).unwrap().to_vec_f32().unwrap(), vec![1.0; 5]);
    }

    #[test]
    fn duplicate_names_are_rejected() {
        let mut b = ParamTableBuilder::default();
        b.add(ParamMeta::replicated("x", [1], Init::Zeros, false)).unwrap();
        assert!(b.add(ParamMeta::replicated("x", [1], Init::Zeros, false)).is_err());
    }
}
