//! The typed MoE spec (Megatron's --num-experts, --moe-* flags) and its factory: a layer whose
//! `LayerSpec::mlp` is `MlpSpec::Custom(Arc::new(moe_spec))` gets a [`MoeLayer`] in place of
//! its dense MLP.

use crate::bias::ExpertBiases;
use crate::global::GlobalCounts;
use crate::layer::MoeLayer;
use crate::metrics::MoeMetrics;
use ferrotron_comm::Communicator;
use ferrotron_core::{Module, ParamTableBuilder, Result, invalid};
use ferrotron_kernels::{Capacity, Groups, Score};
use ferrotron_transformer::spec::{Activation, FactoryCx, ModuleFactory, ParamCount};
use std::sync::Arc;

/// How the router balances the experts' load (--moe-router-load-balancing-type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadBalancing {
    /// GShard / Switch Transformer's loss over the micro-batch (`aux_loss`, Megatron's default),
    /// weighted by --moe-aux-loss-coeff.
    AuxLoss,
    /// DeepSeek's sequence-level loss (`seq_aux_loss`): the same loss taken over each sequence
    /// of the micro-batch and averaged over them, weighted by --moe-aux-loss-coeff.
    SeqAuxLoss,
    /// Megatron's global-batch loss (`global_aux_loss`): the same loss with each expert's count
    /// summed over the data-parallel ranks too and averaged over the step's micro-batches so far
    /// (`global.rs`), weighted by --moe-aux-loss-coeff.
    GlobalAuxLoss,
    /// None (`none`).
    None,
}

/// The top-k router's choices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterSpec {
    /// Experts per token (--moe-router-topk, default 2).
    pub topk: usize,
    /// Softmax over all experts before the top-k (--moe-router-pre-softmax); by default the
    /// softmax runs over the chosen k (Mixtral's renormalised weights).
    pub pre_softmax: bool,
    /// --moe-router-topk-scaling-factor.
    pub topk_scaling_factor: Option<f32>,
    pub load_balancing: LoadBalancing,
    /// --moe-aux-loss-coeff (default 0).
    pub aux_loss_coeff: f32,
    /// --moe-z-loss-coeff (default none).
    pub z_loss_coeff: Option<f32>,
    /// --moe-router-score-function (softmax, sigmoid, sqrtsoftplus).
    pub score: Score,
    /// --moe-router-num-groups with --moe-router-group-topk: group-limited routing.
    pub groups: Option<Groups>,
    /// --moe-router-enable-expert-bias at --moe-router-bias-update-rate: aux-loss-free balancing
    /// (`bias.rs`), a per-expert score function only.
    pub expert_bias_update_rate: Option<f32>,
    /// --moe-router-dtype fp32: the router's product (and so its logits) in fp32 whatever the
    /// model's dtype.
    pub fp32: bool,
    /// --moe-expert-capacity-factor with --moe-token-drop-policy: each expert takes at most its
    /// capacity of a micro-batch's token copies on this rank (`Capacity::per_expert`), the others
    /// skip it (no weight, no gradient). None: dropless.
    pub capacity: Option<Capacity>,
    /// --moe-router-force-load-balancing (a benchmark of balanced experts): the router's logits
    /// replaced by standard normal ones, their gradient passed to the real logits unchanged
    /// (Megatron's RandomSTE). Here keyed by sample, position and expert (`TokenKey`), so every
    /// layout and a recomputed forward draw the same ones.
    pub force_load_balancing: bool,
}

impl Default for RouterSpec {
    fn default() -> Self {
        RouterSpec {
            topk: 2,
            pre_softmax: false,
            topk_scaling_factor: None,
            load_balancing: LoadBalancing::AuxLoss,
            aux_loss_coeff: 0.0,
            z_loss_coeff: None,
            score: Score::Softmax,
            groups: None,
            expert_bias_update_rate: None,
            fp32: false,
            capacity: None,
            force_load_balancing: false,
        }
    }
}

/// A mixture-of-experts MLP: `num_experts` experts of `ffn_hidden_size`, `router.topk` per token.
#[derive(Clone, Debug)]
pub struct MoeSpec {
    /// --num-experts.
    pub num_experts: usize,
    /// Each expert's hidden width (--moe-ffn-hidden-size; Megatron defaults it to --ffn-hidden-size).
    pub ffn_hidden_size: usize,
    pub activation: Activation,
    /// Biases on the experts' linear layers (--add-bias-linear).
    pub bias: bool,
    /// Shared experts: a dense MLP of this width that every token also runs through, its output
    /// added to the routed experts' (--moe-shared-expert-intermediate-size; DeepSeek's and
    /// Qwen-MoE's shared experts, ungated).
    pub shared_expert_ffn: Option<usize>,
    /// The shared experts' output scaled per token by σ(x · gate_weightᵀ)
    /// (--moe-shared-expert-gate, Qwen-MoE's `shared_expert_gate`).
    pub shared_expert_gate: bool,
    pub router: RouterSpec,
    /// --expert-model-parallel-size: the experts are split over this many ranks, each holding
    /// num_experts / size of them, tokens dispatched to them by all-to-all.
    pub expert_parallel_size: usize,
    /// --expert-tensor-parallel-size: None (or the tensor-parallel size), every expert split over
    /// the tensor-parallel group; 1, every expert whole under tensor (and sequence) parallelism,
    /// each tensor-parallel rank routing its own slice of the sequence (Megatron's etp 1, where
    /// the expert-parallel group spans tensor-parallel ranks: `Layout::with_expert_tp`).
    pub expert_tensor_parallel_size: Option<usize>,
    /// The expert-parallel group the layers dispatch over: set, on each rank, by whoever built
    /// the process groups (`with_group`); needed when `expert_parallel_size` is above 1.
    pub ep_group: Option<ExpertGroup>,
    /// The context-parallel group (`with_context_parallel`), or None: under context parallelism a
    /// micro-batch's tokens lie on several ranks, and the load-balancing loss counts them all.
    pub cp_group: Option<ExpertGroup>,
    /// The data-parallel group (`with_data_parallel`), or None: the global load-balancing loss
    /// counts every data-parallel rank's tokens.
    pub dp_group: Option<ExpertGroup>,
    /// Where the layers record their routers' loss values.
    pub metrics: MoeMetrics,
    /// The global load-balancing loss's running counts, reset by the trainer after each step.
    pub global_counts: GlobalCounts,
    /// The layers' expert biases (with `router.expert_bias_update_rate`), for the trainer's
    /// update and checkpoints.
    pub biases: ExpertBiases,
}

/// A rank's expert-parallel communicator (the `ep` group of `ProcessGroups`).
#[derive(Clone)]
pub struct ExpertGroup(pub Arc<dyn Communicator>);

impl std::fmt::Debug for ExpertGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExpertGroup({})", self.0.name())
    }
}

impl MoeSpec {
    /// `num_experts` experts of width `ffn_hidden_size` without biases, routed by `router`, no
    /// shared experts, one expert-parallel rank (the groups set later by `with_group` and
    /// `with_context_parallel`).
    pub fn new(num_experts: usize, ffn_hidden_size: usize, activation: Activation, router: RouterSpec) -> MoeSpec {
        MoeSpec {
            num_experts,
            ffn_hidden_size,
            activation,
            bias: false,
            shared_expert_ffn: None,
            shared_expert_gate: false,
            router,
            expert_parallel_size: 1,
            expert_tensor_parallel_size: None,
            ep_group: None,
            cp_group: None,
            dp_group: None,
            metrics: MoeMetrics::default(),
            global_counts: GlobalCounts::default(),
            biases: ExpertBiases::default(),
        }
    }

    /// Checks every value, naming the flag and the fix.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let r = &self.router;
        if self.num_experts == 0 {
            return Err("--num-experts must be at least 1".into());
        }
        if self.ffn_hidden_size == 0 {
            return Err("--moe-ffn-hidden-size must be at least 1".into());
        }
        if self.shared_expert_ffn == Some(0) {
            return Err("--moe-shared-expert-intermediate-size must be at least 1 (or leave it out)".into());
        }
        if self.shared_expert_gate && self.shared_expert_ffn.is_none() {
            return Err(
                "--moe-shared-expert-gate gates the shared experts: add --moe-shared-expert-intermediate-size".into()
            );
        }
        if r.topk == 0 || r.topk > self.num_experts {
            return Err(format!(
                "--moe-router-topk {} must be between 1 and --num-experts {}",
                r.topk, self.num_experts
            ));
        }
        if !(r.aux_loss_coeff.is_finite() && r.aux_loss_coeff >= 0.0) {
            return Err(format!(
                "--moe-aux-loss-coeff {} must be a finite value ≥ 0 (1e-2 is usual)",
                r.aux_loss_coeff
            ));
        }
        if let Some(z) = r.z_loss_coeff.filter(|z| !(z.is_finite() && *z >= 0.0)) {
            return Err(format!("--moe-z-loss-coeff {z} must be a finite value ≥ 0 (1e-3 is usual)"));
        }
        if let Some(s) = r.topk_scaling_factor.filter(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(format!("--moe-router-topk-scaling-factor {s} must be positive"));
        }
        let topk = ferrotron_kernels::TopK {
            score: r.score,
            groups: r.groups,
            ..ferrotron_kernels::TopK::new(r.topk, false, 1.0)
        };
        if let Err(m) = topk.check(self.num_experts) {
            return Err(format!("--moe-router-num-groups / --moe-router-group-topk: {m}"));
        }
        if let Some(rate) = r.expert_bias_update_rate {
            if r.score == Score::Softmax {
                return Err(
                    "--moe-router-enable-expert-bias needs a per-expert score: add --moe-router-score-function sigmoid"
                        .into(),
                );
            }
            if !(rate.is_finite() && rate >= 0.0) {
                return Err(format!("--moe-router-bias-update-rate {rate} must be a finite value ≥ 0 (1e-3 is usual)"));
            }
        }
        if let Some(f) = r.capacity.map(|c| c.factor).filter(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(format!(
                "--moe-expert-capacity-factor {f} must be a finite value above 0 (1.0 is an even share; leave it out for no dropping)"
            ));
        }
        let ep = self.expert_parallel_size;
        if ep == 0 || self.num_experts % ep != 0 {
            return Err(format!(
                "--num-experts {} is not divisible by --expert-model-parallel-size {ep}: each expert-parallel rank holds an equal share",
                self.num_experts
            ));
        }
        Ok(())
    }

    /// This spec for a rank of expert-parallel group `ep` (its size must be
    /// `expert_parallel_size`).
    pub fn with_group(&self, ep: Arc<dyn Communicator>) -> MoeSpec {
        MoeSpec { ep_group: Some(ExpertGroup(ep)), ..self.clone() }
    }

    /// This spec for a rank of context-parallel group `cp` (more than one rank): the routers'
    /// losses count every rank's tokens of the micro-batch.
    pub fn with_context_parallel(&self, cp: Arc<dyn Communicator>) -> MoeSpec {
        MoeSpec { cp_group: Some(ExpertGroup(cp)), ..self.clone() }
    }

    /// This spec for a rank of data-parallel group `dp`: the global load-balancing loss counts
    /// every rank's tokens of the micro-batch (the other losses are each rank's own).
    pub fn with_data_parallel(&self, dp: Arc<dyn Communicator>) -> MoeSpec {
        MoeSpec { dp_group: Some(ExpertGroup(dp)), ..self.clone() }
    }

    /// fc1's output width per expert: F, or 2F gate|value for SwiGLU.
    fn fc1_out(&self) -> usize {
        self.activation.fc1_blocks() * self.ffn_hidden_size
    }

    /// Parameters of one expert at width `hidden`.
    pub fn expert_params(&self, hidden: usize) -> usize {
        self.mlp_params(hidden, self.ffn_hidden_size)
    }

    /// Parameters of the shared experts and their gate (0 without).
    pub fn shared_params(&self, hidden: usize) -> usize {
        self.shared_expert_ffn
            .map_or(0, |f| self.mlp_params(hidden, f) + if self.shared_expert_gate { hidden } else { 0 })
    }

    /// A dense MLP of width `f` with the experts' activation and biases.
    fn mlp_params(&self, hidden: usize, f: usize) -> usize {
        let f1 = self.fc1_out() / self.ffn_hidden_size.max(1) * f;
        hidden * f1 + f * hidden + if self.bias { f1 + hidden } else { 0 }
    }
}

impl ModuleFactory for MoeSpec {
    fn build(&self, cx: &FactoryCx, params: &mut ParamTableBuilder) -> Result<Box<dyn Module>> {
        self.validate().map_err(|m| invalid("MoeSpec", m))?;
        self.validate_tp(cx.tp.size()).map_err(|m| invalid("MoeSpec", m))?;
        Ok(Box::new(MoeLayer::new(params, cx, self)?))
    }

    /// The whole model's count (every rank's experts), as Megatron reports it.
    fn param_count(&self, hidden: usize) -> Option<ParamCount> {
        let (router, expert) = (self.num_experts * hidden + self.shared_params(hidden), self.expert_params(hidden));
        Some(ParamCount { total: router + self.num_experts * expert, active: router + self.router.topk * expert })
    }

    /// Each expert (and the shared experts) split as a dense MLP is: their widths must divide.
    fn validate_tp(&self, tp: usize) -> std::result::Result<(), String> {
        let etp = self.expert_tensor_parallel_size.unwrap_or(tp);
        if etp != tp && etp != 1 {
            return Err(format!(
                "--expert-tensor-parallel-size {etp} is neither 1 nor --tensor-model-parallel-size {tp}: only those two are built; pick one"
            ));
        }
        // Whole experts under tensor parallelism: only the shared experts (the dense tensor-
        // parallel MLP's layout) split.
        let routed = (etp == tp).then_some(self.ffn_hidden_size);
        let widths =
            [("--moe-ffn-hidden-size", routed), ("--moe-shared-expert-intermediate-size", self.shared_expert_ffn)];
        for (flag, w) in widths {
            if let Some(w) = w.filter(|w| w % tp != 0) {
                return Err(format!(
                    "{flag} {w} is not divisible by --tensor-model-parallel-size {tp}: each rank holds an equal part of every expert"
                ));
            }
        }
        Ok(())
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
