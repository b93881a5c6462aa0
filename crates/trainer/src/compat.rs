//! Megatron's flags that choose among implementations of one computation (fusions, backends,
//! loaders, optimizer-state dtypes) or spell another flag: what Megatron's scripts pass, so that
//! they run unchanged. A switch whose every value computes the same run here is accepted; a
//! value that would change the run is refused by name, the fix in the message; a shorthand is
//! turned into the flag it stands for.

use crate::settings::TrainArgs;
use anyhow::bail;

/// Checks the switches and expands the shorthands, on the merged flags.
pub(crate) fn apply(a: &mut TrainArgs) -> anyhow::Result<()> {
    if a.recompute_activations {
        match a.recompute_granularity.as_deref() {
            None | Some("selective") => a.recompute_granularity = Some("selective".into()),
            Some(g) => bail!(
                "--recompute-activations is --recompute-granularity selective, which --recompute-granularity {g} contradicts: drop one"
            ),
        }
    }
    if a.use_rotary_position_embeddings {
        a.position_embedding_type = Some("rope".into());
    }
    if let Some(n) = a.num_virtual_stages_per_pipeline_rank.filter(|&n| n > 1) {
        if a.num_layers_per_virtual_pipeline_stage.is_some() {
            bail!(
                "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage both set the virtual stages: give one"
            );
        }
        let pp = a.pipeline_model_parallel_size.unwrap_or(1);
        let Some(layers) = a.num_layers else {
            bail!(
                "--num-virtual-stages-per-pipeline-rank {n} divides --num-layers, which is not given: add it (or mark a hybrid pattern's stages with '|')"
            );
        };
        // The embedding and the loss count as layers where the split counts them (Megatron's).
        let layers =
            layers + a.account_for_embedding_in_pipeline_split as usize + a.account_for_loss_in_pipeline_split as usize;
        if layers % (pp * n) != 0 {
            bail!(
                "--num-virtual-stages-per-pipeline-rank {n}: --num-layers {layers} (with any layer --account-for-…-in-pipeline-split counts) is not divisible by --pipeline-model-parallel-size {pp} × {n}"
            );
        }
        a.num_layers_per_virtual_pipeline_stage = Some(layers / (pp * n));
    }
    if let Some(g) = a.microbatch_group_size_per_virtual_pipeline_stage {
        let pp = a.pipeline_model_parallel_size.unwrap_or(1);
        if g != pp {
            bail!(
                "--microbatch-group-size-per-virtual-pipeline-stage {g}: only the pipeline size ({pp}, Megatron's default) is built; drop it"
            );
        }
    }
    if a.no_position_embedding && a.position_embedding_type.as_deref() != Some("rope") {
        a.position_embedding_type = Some("none".into());
    }
    let one_of = |flag: &str, v: &Option<String>, ok: &[&str], why: &str| -> anyhow::Result<()> {
        match v {
            Some(x) if !ok.contains(&x.as_str()) => bail!("{flag} {x}: {why} (accepted: {})", ok.join(", ")),
            _ => Ok(()),
        }
    };
    one_of(
        "--distributed-backend",
        &a.distributed_backend,
        &["nccl", "gloo"],
        "ranks on a GPU talk NCCL, on the CPU their own transport",
    )?;
    one_of(
        "--transformer-impl",
        &a.transformer_impl,
        &["transformer_engine", "local"],
        "the layers are Ferrotron's own either way",
    )?;
    one_of(
        "--attention-backend",
        &a.attention_backend,
        &["auto", "flash", "fused", "unfused", "local"],
        "attention is Ferrotron's flash kernels wherever they apply",
    )?;
    one_of(
        "--dataloader-type",
        &a.dataloader_type,
        &["single", "cyclic"],
        "samples are read in Megatron's pretraining-sampler order (single) or its random sampler's (cyclic); external (a loader of your own) is not built",
    )?;
    one_of("--rerun-mode", &a.rerun_mode, &["disabled"], "the rerun state machine is not built")?;
    one_of(
        "--moe-flex-dispatcher-backend",
        &a.moe_flex_dispatcher_backend,
        &["deepep", "hybridep"],
        "the experts' tokens travel by all-to-all whichever transport is named",
    )?;
    one_of(
        "--cross-entropy-fusion-impl",
        &a.cross_entropy_fusion_impl,
        &["native", "te"],
        "the cross-entropy is Ferrotron's fused kernel either way",
    )?;
    one_of(
        "--dist-ckpt-format",
        &a.dist_ckpt_format,
        &["torch_dist"],
        "Ferrotron writes its one sharded format in torch_dist's place",
    )?;
    match a.no_weight_decay_cond_type.as_deref() {
        None => {}
        Some("apply_wd_to_qk_layernorm") => a.apply_wd_to_qk_layernorm = true,
        Some(o) => bail!(
            "--no-weight-decay-cond-type {o}: the one type is apply_wd_to_qk_layernorm (now --apply-wd-to-qk-layernorm)"
        ),
    }
    if a.init_method_xavier_uniform {
        bail!("--init-method-xavier-uniform: the weights start from N(0, --init-method-std); drop it");
    }
    if a.enable_gpt_oss {
        bail!(
            "--enable-gpt-oss (ModelOpt's gpt-oss mode) puts YaRN rotary features on grouped-query attention, which is not built here (YaRN is multi-latent attention's): drop it for plain RoPE; gpt-oss's layers are --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --softmax-type learnable --window-attn-skip-freq 2"
        );
    }
    if a.checkpoint_activations {
        bail!(
            "--checkpoint-activations is Megatron's old spelling: use --recompute-granularity full --recompute-method uniform"
        );
    }
    const MODULES: [&str; 7] = ["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"];
    if let Some(m) = a.recompute_modules.iter().find(|m| !MODULES.contains(&m.as_str())) {
        bail!("--recompute-modules {m}: not one of Megatron's modules ({})", MODULES.join(", "));
    }
    layer_spec(a)?;
    precision_aware(a)?;
    if let Some(f) = a.optimizer_offload_fraction.filter(|&f| f != 1.0) {
        bail!(
            "--optimizer-offload-fraction {f}: splitting the optimizer between the host and the GPU is not built; offload all of it (1.0) or none"
        );
    }
    one_of("--optimizer", &a.optimizer, &["adam", "sgd"], "Megatron's two: adam (AdamW) and sgd")?;
    if a.sgd_momentum.is_some() && a.optimizer.as_deref() != Some("sgd") {
        bail!("--sgd-momentum is SGD's: add --optimizer sgd (or drop it)");
    }
    if a.apply_residual_connection_post_layernorm {
        eprintln!(
            "warning: --apply-residual-connection-post-layernorm is read by no Megatron Core layer: the residual is the layer's input, as there"
        );
    }
    if !a.hierarchical_context_parallel_sizes.is_empty() {
        bail!(
            "--hierarchical-context-parallel-sizes {:?} sizes --cp-comm-type a2a+p2p's groups, which is not built: use --cp-comm-type a2a (all-to-all over the whole context-parallel group) or allgather / p2p",
            a.hierarchical_context_parallel_sizes
        );
    }
    if let Some(p) = &a.wandb_project {
        bail!("--wandb-project {p}: Weights & Biases logging is not built; --tensorboard-dir writes the same scalars");
    }
    if a.fp8_param_gather {
        bail!(
            "--fp8-param-gather: FP8 parameters are not built (the parameters stay bf16, gathered in bf16 and cast to FP8 in each forward); drop it"
        );
    }
    if a.use_torch_fsdp2 {
        bail!("--use-torch-fsdp2: FSDP is not built; --use-distributed-optimizer shards the optimizer state");
    }
    Ok(())
}

/// Megatron's --spec MODULE FUNCTION. Its Mamba stack spec is what a hybrid run builds; given
/// without a pattern or ratios it is pretrain_mamba.py's default, every layer Mamba (ratios 0).
/// Its GPT layer specs (Transformer Engine's, local) build the same layers here.
fn layer_spec(a: &mut TrainArgs) -> anyhow::Result<()> {
    const MAMBA: [&str; 2] = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"];
    const GPT: &str = "megatron.core.models.gpt.gpt_layer_specs";
    const GPT_SPECS: [&str; 2] = ["get_gpt_layer_with_transformer_engine_spec", "get_gpt_layer_local_spec"];
    // Given twice, the last one holds (as argparse's).
    let [module, function] = match a.spec.as_slice() {
        [] => return Ok(()),
        [.., m, f] => [m.as_str(), f.as_str()],
        [one] => bail!("--spec {one}: give a module and a function"),
    };
    let hybrid = a.hybrid_layer_pattern.is_some()
        || a.hybrid_override_pattern.is_some()
        || a.hybrid_attention_ratio.is_some()
        || a.hybrid_mlp_ratio.is_some();
    if [module, function] == MAMBA {
        if !hybrid {
            a.hybrid_attention_ratio = Some(0.0);
        }
        return Ok(());
    }
    if module == GPT && GPT_SPECS.contains(&function) {
        if hybrid {
            bail!(
                "--spec {module} {function} is a GPT layer spec, but the hybrid flags place Mamba layers: use --spec {} {}",
                MAMBA[0],
                MAMBA[1]
            );
        }
        return Ok(());
    }
    bail!(
        "--spec {module} {function}: Ferrotron builds its layer specs from the flags; the specs it accepts are {} {} (Mamba hybrids) and {GPT} {}",
        MAMBA[0],
        MAMBA[1],
        GPT_SPECS.join(" / ")
    )
}

/// Megatron's precision-aware optimizer: --exp-avg-dtype / --exp-avg-sq-dtype bf16 keep AdamW's
/// moments in bf16, --main-grads-dtype bf16 is a bf16 main_grad (--grad-reduce-in-bf16 here);
/// each needs --use-precision-aware-optimizer, as in Megatron. fp16 and fp8 state (per-tensor
/// scaled in Transformer Engine) and fp16 master weights are refused by name.
fn precision_aware(a: &mut TrainArgs) -> anyhow::Result<()> {
    let flags = [
        ("--main-grads-dtype", &a.main_grads_dtype, &["fp32", "bf16"][..]),
        ("--main-params-dtype", &a.main_params_dtype, &["fp32"][..]),
        ("--exp-avg-dtype", &a.exp_avg_dtype, &["fp32", "bf16"][..]),
        ("--exp-avg-sq-dtype", &a.exp_avg_sq_dtype, &["fp32", "bf16"][..]),
    ];
    for (flag, v, ok) in flags {
        let Some(v) = v.as_deref().filter(|&v| v != "fp32") else { continue };
        if !ok.contains(&v) {
            let why = match (flag, v) {
                ("--main-params-dtype", "fp16" | "bf16") => "master weights below fp32 are not built: they stay fp32",
                (_, "fp16" | "fp8") => "fp16 and fp8 optimizer state (scaled per tensor) are not built: use bf16",
                _ => "not one of Megatron's dtypes",
            };
            bail!("{flag} {v}: {why} (accepted: {})", ok.join(", "));
        }
        if !a.use_precision_aware_optimizer {
            bail!("{flag} {v} sets the precision-aware optimizer's state: add --use-precision-aware-optimizer");
        }
        if a.optimizer.as_deref().is_some_and(|o| o != "adam") {
            bail!("{flag} {v}: the precision-aware optimizer is Adam's: use --optimizer adam");
        }
    }
    if a.main_grads_dtype.as_deref() == Some("bf16") {
        if !a.bf16 {
            bail!("--main-grads-dtype bf16 keeps bf16 training's gradients in bf16: add --bf16");
        }
        a.grad_reduce_in_bf16 = true;
    }
    Ok(())
}
