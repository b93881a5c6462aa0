//! `MambaSpec`: Megatron's --mamba-* flags as a typed spec, and the factory a hybrid model's `M`
//! layers are built from (`ferrotron_transformer::spec::Hybrid::mixer`).

use crate::mixer::MambaMixer;
use ferrotron_core::{Module, ParamTableBuilder, Result};
use ferrotron_parallel::ContextParallel;
use ferrotron_transformer::spec::{FactoryCx, ModuleFactory, ParamCount};

/// A Mamba-2 mixer's sizes. Defaults are Megatron-Core's MambaMixer's.
#[derive(Clone, Debug)]
pub struct MambaSpec {
    /// State channels per group, N (--mamba-state-dim; 128).
    pub state_dim: usize,
    /// Channels per head, P (--mamba-head-dim; 64).
    pub head_dim: usize,
    /// Groups sharing B and C, G (--mamba-num-groups; 8).
    pub groups: usize,
    /// Heads (--mamba-num-heads); None: expand · hidden / head_dim.
    pub heads: Option<usize>,
    /// d_inner = expand · hidden when `heads` is None (2).
    pub expand: usize,
    /// Causal convolution width (4).
    pub conv_kernel: usize,
    /// The gated norm's epsilon (1e-5).
    pub norm_eps: f64,
    /// The gated norm per group of heads (Megatron's and mamba_ssm's, true) or over the whole
    /// width (transformers' Mamba2, false; `--mamba-norm-ungrouped`).
    pub norm_per_group: bool,
    /// dt's initial range and floor (0.001, 0.1, 1e-4) and A's initial range (1, 16).
    pub dt_min: f32,
    pub dt_max: f32,
    pub dt_floor: f32,
    pub a_init: (f32, f32),
    /// The context-parallel group (`with_context_parallel`, more than one rank), or None: each
    /// mixer then trades its rows of every head for every row of its share of the heads around
    /// the convolution and scan.
    pub context_parallel: Option<ContextParallel>,
}

/// Equal sizes (the context-parallel group is where a spec runs, not what it is).
impl PartialEq for MambaSpec {
    fn eq(&self, o: &Self) -> bool {
        let key = |s: &Self| (s.state_dim, s.head_dim, s.groups, s.heads, s.expand, s.conv_kernel, s.norm_per_group);
        let floats = |s: &Self| {
            [s.norm_eps, s.dt_min as f64, s.dt_max as f64, s.dt_floor as f64, s.a_init.0 as f64, s.a_init.1 as f64]
        };
        key(self) == key(o) && floats(self) == floats(o)
    }
}

impl Default for MambaSpec {
    fn default() -> Self {
        MambaSpec {
            state_dim: 128,
            head_dim: 64,
            groups: 8,
            heads: None,
            expand: 2,
            conv_kernel: 4,
            norm_eps: 1e-5,
            norm_per_group: true,
            dt_min: 0.001,
            dt_max: 0.1,
            dt_floor: 1e-4,
            a_init: (1.0, 16.0),
            context_parallel: None,
        }
    }
}

/// The mixer's derived sizes for one hidden width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MambaDims {
    pub hidden: usize,
    pub d_inner: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state: usize,
    pub conv_kernel: usize,
}

impl MambaDims {
    /// Columns of the convolution's input and output: x | B | C.
    pub fn conv_dim(&self) -> usize {
        self.d_inner + 2 * self.groups * self.state
    }
    /// Rows of in_proj's weight: z | x | B | C | dt.
    pub fn in_proj_out(&self) -> usize {
        self.d_inner + self.conv_dim() + self.heads
    }
}

impl MambaSpec {
    /// This spec for a rank of context-parallel group `cp` (more than one rank; at one, the spec
    /// as it is).
    pub fn with_context_parallel(&self, cp: ContextParallel) -> MambaSpec {
        MambaSpec { context_parallel: (cp.size() > 1).then_some(cp), ..self.clone() }
    }

    /// Whether a tensor-parallel rank's groups split over `cp` context-parallel ranks, or repeat
    /// over them (Megatron splits the heads of a tensor-parallel rank over its context-parallel
    /// ranks, each with the groups its heads read); the error names the fix. The heads' split is
    /// checked when the mixer is built (their count depends on the hidden size).
    pub fn validate_cp(&self, tp: usize, cp: usize) -> std::result::Result<(), String> {
        let g = self.groups / tp.max(1);
        if cp > 1 && g > 0 && g % cp != 0 && cp % g != 0 {
            return Err(format!(
                "--context-parallel-size {cp} splits each tensor-parallel rank's {g} Mamba groups (--mamba-num-groups {} over --tensor-model-parallel-size {tp}) over its context-parallel ranks: the two must divide one another",
                self.groups
            ));
        }
        Ok(())
    }

    /// The sizes at `hidden`, checked; errors name the flag and the fix.
    pub fn dims(&self, hidden: usize) -> std::result::Result<MambaDims, String> {
        if self.head_dim == 0 || self.state_dim == 0 || self.groups == 0 || self.expand == 0 || self.conv_kernel == 0 {
            return Err(format!(
                "{self:?}: --mamba-head-dim, --mamba-state-dim and --mamba-num-groups must be positive"
            ));
        }
        let (heads, d_inner) = match self.heads {
            Some(h) => (h, h * self.head_dim),
            None => {
                let d = self.expand * hidden;
                if d % self.head_dim != 0 {
                    return Err(format!(
                        "--mamba-head-dim {} does not divide the mixer's width {d} ({} × --hidden-size {hidden}): pick a divisor or set --mamba-num-heads",
                        self.head_dim, self.expand
                    ));
                }
                (d / self.head_dim, d)
            }
        };
        if heads == 0 || heads % self.groups != 0 {
            return Err(format!(
                "--mamba-num-groups {} does not divide the {heads} Mamba heads: pick a divisor",
                self.groups
            ));
        }
        Ok(MambaDims {
            hidden,
            d_inner,
            heads,
            head_dim: self.head_dim,
            groups: self.groups,
            state: self.state_dim,
            conv_kernel: self.conv_kernel,
        })
    }
}

fn config_error(msg: String) -> ferrotron_core::Error {
    ferrotron_core::invalid("MambaSpec", msg)
}

impl ModuleFactory for MambaSpec {
    fn build(&self, cx: &FactoryCx, params: &mut ParamTableBuilder) -> Result<Box<dyn Module>> {
        if let Err(e) = self.validate_tp(cx.tp.size()) {
            return Err(config_error(e));
        }
        let dims = self.dims(cx.hidden).map_err(config_error)?;
        let cp = self.context_parallel.as_ref().map_or(1, |c| c.size());
        self.validate_cp(cx.tp.size(), cp).map_err(config_error)?;
        Ok(Box::new(MambaMixer::new(params, cx.prefix, self, dims, cx.std, cx.out_std, cx.tp)?))
    }

    fn param_count(&self, hidden: usize) -> Option<ParamCount> {
        let d = self.dims(hidden).ok()?;
        let n = d.in_proj_out() * hidden
            + d.conv_dim() * (d.conv_kernel + 1)
            + 3 * d.heads
            + d.d_inner
            + hidden * d.d_inner;
        Some(ParamCount { total: n, active: n })
    }

    /// The scan's own work, linear in the sequence: per token and head, the state update
    /// (4·N·P: decay, B·x product, add) and the read-out (2·N·P) forward, twice that backward.
    fn flops_per_token(&self, hidden: usize, _seq: usize) -> f64 {
        self.dims(hidden).map_or(0.0, |d| 18.0 * (d.d_inner * d.state) as f64)
    }

    /// Each rank takes whole groups (and so whole heads) and normalises them on its own (the
    /// heads' count, which depends on the hidden size, is checked when the mixer is built).
    fn validate_tp(&self, tp: usize) -> std::result::Result<(), String> {
        if tp > 1 && self.groups % tp != 0 {
            return Err(format!(
                "--tensor-model-parallel-size {tp} does not divide --mamba-num-groups {}: each rank takes whole groups; pick a divisor",
                self.groups
            ));
        }
        if tp > 1 && !self.norm_per_group {
            return Err(format!(
                "--mamba-norm-ungrouped normalises across every rank's heads: drop it for --tensor-model-parallel-size {tp}"
            ));
        }
        Ok(())
    }

    /// Under context parallelism the mixers must have been built with the group (the trainer
    /// gives the spec its group before building the model).
    fn validate_cp(&self, cp: usize) -> std::result::Result<(), String> {
        let built = self.context_parallel.as_ref().map_or(1, |c| c.size());
        if built != cp {
            return Err(format!(
                "the Mamba layers were built for {built} context-parallel rank(s), the model runs on {cp}: build the spec with MambaSpec::with_context_parallel"
            ));
        }
        Ok(())
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
