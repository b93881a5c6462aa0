//! The tiny presets' first 20 training steps (at lr 1e-3: see `losses_of`) on CUDA against the
//! CPU run of the same recipe (feature `cuda`; runs on the GPU machine): fp32 within 1e-4
//! relative loss, bf16 within 2e-2. GPT-2 style (`tiny`), Llama style (`llama-tiny`: RoPE in
//! place on the fused QKV, GQA, SwiGLU, RMSNorm), mixture of experts (`mixtral-tiny`) and a
//! Mamba-2 hybrid (`mamba-tiny`); the last two also tensor-parallel on two thread ranks, the
//! hybrid context-parallel too.
#![cfg(feature = "cuda")]

use ferrotron_core::Device;
use ferrotron_trainer::settings::{Paths, ProfileRange, Settings, TrainArgs};
use ferrotron_trainer::train::train;

fn losses(preset: &str, bf16: bool, device: Device) -> Vec<f64> {
    losses_with(preset, bf16, device, None)
}

fn losses_with(preset: &str, bf16: bool, device: Device, hidden_dropout: Option<f64>) -> Vec<f64> {
    losses_of(TrainArgs { preset: Some(preset.into()), bf16, hidden_dropout, ..TrainArgs::default() }, device)
}

/// 20 steps of `args` (one evaluation at the end) on `device`: the training losses. At lr 1e-3
/// rather than the presets' 3e-3: at 3e-3 the tiny run spikes at step 10 (loss 4.1 → 5.7, on
/// the CPU and the GPU alike, in Megatron's sample order), after which two runs that differ in
/// bf16 rounding drift apart by more than the rounding (the CPU's bf16 and fp32-grad runs by
/// 0.3%, the GPU's by 4% at step 20). What is compared here is the kernels, not that chaos.
fn losses_of(args: TrainArgs, device: Device) -> Vec<f64> {
    let args = TrainArgs {
        train_iters: Some(20),
        eval_interval: Some(20),
        eval_iters: Some(1),
        lr: Some(1e-3),
        no_progress: true,
        ..args
    };
    let (s, paths): (Settings, Paths) = Settings::resolve(&args).unwrap();
    // The resolved launch kept: --nproc N runs N thread ranks (sharing the one GPU).
    let summary = train(&s, &Paths { device, launch: paths.launch, ..Paths::default() }).unwrap();
    summary.losses.into_iter().map(|(_, l)| l).collect()
}

#[test]
fn tiny_preset_cuda_matches_cpu() {
    matches_cpu("tiny");
}

#[test]
fn llama_tiny_preset_cuda_matches_cpu() {
    matches_cpu("llama-tiny");
}

/// Mixture of experts (8 SwiGLU experts, top-2, load-balancing and z-losses): the routing
/// kernels, the sort's read-back and each expert's products on the GPU.
#[test]
fn mixtral_tiny_preset_cuda_matches_cpu() {
    matches_cpu("mixtral-tiny");
}

/// DeepSeek-V3's routing on the GPU: sigmoid scores, 4 groups of 2 experts (a token's 2 from its
/// 2 best groups), the expert bias moved each step, the sequence-level balancing loss and fp32
/// routers, bf16 on CUDA against bf16 on the CPU.
#[test]
fn deepseek_routing_cuda_matches_cpu() {
    let args = || TrainArgs {
        preset: Some("mixtral-tiny".into()),
        bf16: true,
        moe_router_score_function: Some("sigmoid".into()),
        moe_router_num_groups: Some(4),
        moe_router_group_topk: Some(2),
        moe_router_enable_expert_bias: true,
        moe_router_load_balancing_type: Some("seq_aux_loss".into()),
        moe_router_dtype: Some("fp32".into()),
        ..TrainArgs::default()
    };
    bf16_cuda_matches_cpu("deepseek routing", args);
}

/// Token dropping on the GPU: mixtral-tiny at capacity factor 0.5 (by the routing weights, read
/// back from the device; the combine and its backward skip the dropped copies), the same split
/// onto expert parallelism (two thread ranks sharing the GPU, each dropping among its own
/// micro-batch), against one CPU rank, fp32 within 1e-4.
#[test]
fn mixtral_capacity_cuda_matches_cpu() {
    let capped = |a: TrainArgs| TrainArgs {
        moe_expert_capacity_factor: Some(0.5),
        moe_token_dispatcher_type: Some("alltoall".into()),
        ..a
    };
    split_matches_cpu("mixtral-tiny", "capacity 0.5", capped, capped);
    split_matches_cpu("mixtral-tiny", "capacity 0.5 dp2 ep2", capped, |a| TrainArgs {
        expert_model_parallel_size: Some(2),
        nproc: Some(2),
        ..capped(a)
    });
}

/// The global-batch load-balancing loss (global_aux_loss) on the GPU, its running counts kept on
/// the device: one rank against one CPU rank, and dp2 × ep2 (two thread ranks sharing the GPU,
/// micro-batches of 4) against one CPU rank with micro-batches of 8 and half the coefficient
/// (the same run: `tests/moe.rs`'s oracle), fp32 within 1e-4.
#[test]
fn global_balancing_loss_cuda_matches_cpu() {
    let global = |a: TrainArgs| TrainArgs {
        moe_router_load_balancing_type: Some("global_aux_loss".into()),
        micro_batch_size: Some(4),
        global_batch_size: Some(16),
        ..a
    };
    split_matches_cpu("mixtral-tiny", "global aux loss", global, global);
    split_matches_cpu(
        "mixtral-tiny",
        "global aux loss dp2 ep2",
        |a| TrainArgs { micro_batch_size: Some(8), moe_aux_loss_coeff: Some(5e-3), ..global(a) },
        |a| TrainArgs { expert_model_parallel_size: Some(2), nproc: Some(2), ..global(a) },
    );
}

/// Megatron's unfused GeLU (erf: --no-bias-gelu-fusion) on the GPU, against one CPU rank, fp32
/// within 1e-4.
#[test]
fn erf_gelu_cuda_matches_cpu() {
    let erf = |a: TrainArgs| TrainArgs { no_bias_gelu_fusion: true, ..a };
    split_matches_cpu("tiny", "erf GeLU", erf, erf);
}

/// --rotary-percent 0.5 on the GPU (llama-tiny's heads of 32: 16 features rotate in place in the
/// fused QKV, the rest pass), against one CPU rank, fp32 within 1e-4.
#[test]
fn partial_rotary_cuda_matches_cpu() {
    let half = |a: TrainArgs| TrainArgs { rotary_percent: Some(0.5), ..a };
    split_matches_cpu("llama-tiny", "rotary percent 0.5", half, half);
}

/// --rotary-seq-len-interpolation-factor 4 on the GPU (the fused in-place RoPE's angle table),
/// against one CPU rank, fp32 within 1e-4.
#[test]
fn interpolated_rope_cuda_matches_cpu() {
    let pi = |a: TrainArgs| TrainArgs { rotary_seq_len_interpolation_factor: Some(4.0), ..a };
    split_matches_cpu("llama-tiny", "rope interpolation 4", pi, pi);
}

/// --rotary-interleaved on the GPU (the fused in-place RoPE's eight-pair kernel on adjacent
/// pairs), against one CPU rank, fp32 within 1e-4.
#[test]
fn interleaved_rope_cuda_matches_cpu() {
    let il = |a: TrainArgs| TrainArgs { rotary_interleaved: true, ..a };
    split_matches_cpu("llama-tiny", "interleaved rope", il, il);
}

/// --decoupled-lr on the GPU (the update's runs at the decoupled rate from the device state),
/// against one CPU rank, fp32 within 1e-4.
#[test]
fn decoupled_lr_cuda_matches_cpu() {
    let d = |a: TrainArgs| TrainArgs { decoupled_lr: Some(1e-2), decoupled_min_lr: Some(1e-3), ..a };
    split_matches_cpu("llama-tiny", "decoupled lr", d, d);
}

/// --attention-output-gate on the GPU (the gates cut out of the projection, the sigmoid gate
/// kernels), with QK-norm and without, against one CPU rank, fp32 within 1e-4.
#[test]
fn attention_output_gate_cuda_matches_cpu() {
    let gate = |a: TrainArgs| TrainArgs { attention_output_gate: true, ..a };
    split_matches_cpu("llama-tiny", "output gate", gate, gate);
    let gate_qk = |a: TrainArgs| TrainArgs { attention_output_gate: true, qk_layernorm: true, ..a };
    split_matches_cpu("llama-tiny", "output gate, QK-norm", gate_qk, gate_qk);
}

/// --softmax-type on the GPU (the sink kernels on the core attention's (o, lse)): off-by-one and
/// learnable, with QK-norm and without, and learnable under cp2 on two thread ranks (the
/// chunk-major lse), against one CPU rank in fp32 within 1e-4; learnable in bf16 at head dim 64
/// (on the flash kernels' lse) within 2e-2. (bf16 under cp2 passed for 16 steps, then met the
/// tiny run's loss spike at step 17 with 2.4% between the CPU's and the GPU's rounding: chaos,
/// not the kernels; its layout is the fp32 case here.)
#[test]
fn sink_softmax_cuda_matches_cpu() {
    for kind in ["off-by-one", "learnable"] {
        let f = |a: TrainArgs| TrainArgs { softmax_type: Some(kind.into()), ..a };
        split_matches_cpu("llama-tiny", kind, f, f);
        let qk = |a: TrainArgs| TrainArgs { qk_layernorm: true, ..f(a) };
        split_matches_cpu("llama-tiny", &format!("{kind}, QK-norm"), qk, qk);
    }
    let learnable = |a: TrainArgs| TrainArgs { softmax_type: Some("learnable".into()), ..a };
    let cp2 = |a: TrainArgs| TrainArgs { context_parallel_size: Some(2), nproc: Some(2), ..learnable(a) };
    split_matches_cpu("llama-tiny", "learnable, cp2", learnable, cp2);
    let bf16 = || TrainArgs {
        preset: Some("llama-tiny".into()),
        bf16: true,
        kv_channels: Some(64),
        ..learnable(TrainArgs::default())
    };
    bf16_cuda_matches_cpu("learnable sink, head dim 64", bf16);
}

/// --reset-position-ids on the GPU (the batch's learned-position ids looked up and their
/// gradient scattered by id), one rank and tp2 with sequence parallelism on two thread ranks,
/// against one CPU rank, fp32 within 1e-4.
#[test]
fn reset_position_ids_cuda_matches_cpu() {
    let reset = |a: TrainArgs| TrainArgs { reset_position_ids: true, ..a };
    split_matches_cpu("tiny", "reset positions", reset, reset);
    let tp2 = |a: TrainArgs| TrainArgs {
        tensor_model_parallel_size: Some(2),
        sequence_parallel: true,
        nproc: Some(2),
        ..reset(a)
    };
    split_matches_cpu("tiny", "reset positions, tp2 sp", reset, tp2);
}

/// --reset-attention-mask on the GPU (document starts uploaded with each micro-batch; fp32
/// attention on the reference kernels, bf16 at head dim 64 on the flash kernels' `_docs` builds),
/// Llama-style and GPT-2 style with --reset-position-ids, one rank, tp2 with sequence parallelism
/// and a2a cp2 on two thread ranks, against one CPU rank, fp32 within 1e-4; and bf16 within
/// bf16's tolerance.
#[test]
fn reset_attention_mask_cuda_matches_cpu() {
    let masks = |a: TrainArgs| TrainArgs { reset_attention_mask: true, ..a };
    split_matches_cpu("llama-tiny", "document masks", masks, masks);
    let both = |a: TrainArgs| TrainArgs { reset_position_ids: true, ..masks(a) };
    let tp2 = |a: TrainArgs| TrainArgs {
        tensor_model_parallel_size: Some(2),
        sequence_parallel: true,
        nproc: Some(2),
        ..both(a)
    };
    split_matches_cpu("tiny", "document masks and reset positions, tp2 sp", both, tp2);
    let bf16 = || TrainArgs { preset: Some("llama-tiny".into()), bf16: true, ..masks(TrainArgs::default()) };
    bf16_cuda_matches_cpu("document masks", bf16);
    // Head dim 64: the flash kernels' `_docs` builds in training.
    bf16_cuda_matches_cpu("document masks, head dim 64", || TrainArgs { kv_channels: Some(64), ..bf16() });
    // All-to-all context parallelism (two thread ranks sharing the GPU): whole rows' starts.
    split_matches_cpu("llama-tiny", "document masks, a2a cp2", masks, |a| TrainArgs {
        context_parallel_size: Some(2),
        cp_comm_type: Some(vec!["a2a".into()]),
        nproc: Some(2),
        ..masks(a)
    });
}

/// --qk-l2-norm on the GPU (the RMSNorm kernels at a unit scale over each query and key head),
/// against one CPU rank, fp32 within 1e-4.
#[test]
fn qk_l2_norm_cuda_matches_cpu() {
    let l2 = |a: TrainArgs| TrainArgs { qk_l2_norm: true, ..a };
    split_matches_cpu("llama-tiny", "qk l2 norm", l2, l2);
}

/// --apply-layernorm-1p on the GPU (the norm kernels' 1 + w, LayerNorm and RMSNorm with QK-norm),
/// against one CPU rank, fp32 within 1e-4.
#[test]
fn zero_centred_norms_cuda_match_cpu() {
    let gpt = |a: TrainArgs| TrainArgs { apply_layernorm_1p: true, ..a };
    split_matches_cpu("tiny", "zero-centred LayerNorm", gpt, gpt);
    let llama = |a: TrainArgs| TrainArgs { apply_layernorm_1p: true, qk_layernorm: true, ..a };
    split_matches_cpu("llama-tiny", "zero-centred RMSNorm", llama, llama);
}

/// --log-memory-to-tensorboard on the GPU: every log line of metrics.jsonl carries the pool's
/// bytes, allocated at most its high and the reserved bytes, the model's parameters and optimizer state at least.
#[test]
fn memory_is_logged_on_the_gpu() {
    let dir = std::env::temp_dir().join(format!("ferrotron-cuda-mem-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let metrics = dir.join("metrics.jsonl");
    let args = TrainArgs {
        preset: Some("llama-tiny".into()),
        train_iters: Some(4),
        log_interval: Some(2),
        eval_interval: Some(4),
        eval_iters: Some(1),
        log_memory_to_tensorboard: true,
        tensorboard_dir: Some(dir.join("tb")),
        no_progress: true,
        ..TrainArgs::default()
    };
    let (s, _) = Settings::resolve(&args).unwrap();
    let gpu = Device::cuda(0).expect("a CUDA device");
    train(&s, &Paths { device: gpu, metrics: Some(metrics.clone()), ..Paths::default() }).unwrap();
    let params = s.model_config().unwrap().num_params() as u64;
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "train")
        .collect();
    assert_eq!(lines.len(), 2);
    for v in &lines {
        let b = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {v}"));
        let (a, m, r) = (b("mem_allocated_bytes"), b("mem_max_allocated_bytes"), b("mem_reserved_bytes"));
        eprintln!("allocated {a} max {m} reserved {r} ({params} parameters)");
        assert!(a <= m && a <= r, "{v}");
        // fp32 parameters, main_grad, master weights and two moments.
        assert!(a >= 5 * 4 * params, "{a} bytes for {params} parameters");
    }
    assert!(std::fs::read_dir(dir.join("tb")).unwrap().count() == 1);
    let _ = std::fs::remove_dir_all(dir);
}

/// Shared experts with their sigmoid gate (Qwen-MoE's) on the GPU, under tensor parallelism
/// (two thread ranks sharing it: the gate's score gradient summed over them), against one CPU
/// rank, fp32 within 1e-4.
#[test]
fn shared_expert_gate_cuda_matches_cpu() {
    let gated =
        |a: TrainArgs| TrainArgs { moe_shared_expert_intermediate_size: Some(64), moe_shared_expert_gate: true, ..a };
    split_matches_cpu("mixtral-tiny", "gated shared experts tp2", gated, |a| TrainArgs {
        tensor_model_parallel_size: Some(2),
        nproc: Some(2),
        ..gated(a)
    });
}

/// Multi-token prediction (two depths at weight 0.5: the rolled tokens' and the concatenation's
/// strided copies, each depth's head with its own loss scale), GPT-2 style (tied, learned
/// positions) and Llama style, the latter also under tensor parallelism with sequence
/// parallelism and under context parallelism (the depths' inputs rolled along the whole
/// sequences before the split; two thread ranks sharing the GPU each time), against one CPU rank,
/// fp32 within 1e-4.
#[test]
fn mtp_cuda_matches_cpu() {
    let mtp = |a: TrainArgs| TrainArgs { mtp_num_layers: Some(2), mtp_loss_scaling_factor: Some(0.5), ..a };
    split_matches_cpu("tiny", "mtp", mtp, mtp);
    split_matches_cpu("llama-tiny", "mtp", mtp, mtp);
    split_matches_cpu("llama-tiny", "mtp tp2 sp", mtp, |a| TrainArgs {
        tensor_model_parallel_size: Some(2),
        sequence_parallel: true,
        nproc: Some(2),
        ..mtp(a)
    });
    split_matches_cpu("llama-tiny", "mtp cp2", mtp, |a| TrainArgs {
        context_parallel_size: Some(2),
        nproc: Some(2),
        ..mtp(a)
    });
}

/// Multi-latent attention (the latent projections, the shared rotary key gathered per head by a
/// row gather and its gradient scattered back, the de-interleaving product, the core attention at
/// an odd head width on the general kernels), with a query latent and without, with YaRN, alone and under
/// tensor parallelism with sequence parallelism or context parallelism (two thread ranks sharing
/// the GPU), against one CPU rank, fp32 within 1e-4.
#[test]
fn mla_cuda_matches_cpu() {
    let mla = |a: TrainArgs| TrainArgs {
        multi_latent_attention: true,
        q_lora_rank: Some(32),
        kv_lora_rank: Some(24),
        qk_head_dim: Some(16),
        qk_pos_emb_head_dim: Some(8),
        v_head_dim: Some(12),
        ..a
    };
    let direct = |a: TrainArgs| TrainArgs { q_lora_rank: None, ..mla(a) };
    split_matches_cpu("llama-tiny", "mla", mla, mla);
    split_matches_cpu("llama-tiny", "mla tp2 sp", mla, |a| TrainArgs {
        tensor_model_parallel_size: Some(2),
        sequence_parallel: true,
        nproc: Some(2),
        ..mla(a)
    });
    split_matches_cpu("llama-tiny", "mla without a query latent", direct, direct);
    split_matches_cpu("llama-tiny", "mla cp2", mla, |a| TrainArgs {
        context_parallel_size: Some(2),
        nproc: Some(2),
        ..mla(a)
    });
    // YaRN at factor 40 (the rotary kernel's blended frequencies and scaled cos / sin).
    let yarn = |a: TrainArgs| TrainArgs { rotary_scaling_factor: Some(40.0), mscale_all_dim: Some(1.0), ..mla(a) };
    split_matches_cpu("llama-tiny", "mla yarn", yarn, yarn);
}

/// Multi-latent attention at DeepSeek-V2/V3's head widths (Q/K 128 + 64 rotary, V 128: head dim
/// 192 once padded), bf16: the flash kernels at head dim 192 inside training, 20 steps on the GPU
/// against bf16 on the CPU, on one rank and cp2; and narrower heads padded up to 64 on the GPU.
#[test]
fn mla_deepseek_widths_bf16_cuda_matches_cpu() {
    let args = || TrainArgs {
        preset: Some("llama-tiny".into()),
        bf16: true,
        multi_latent_attention: true,
        kv_lora_rank: Some(32),
        qk_head_dim: Some(128),
        qk_pos_emb_head_dim: Some(64),
        v_head_dim: Some(128),
        ..TrainArgs::default()
    };
    bf16_cuda_matches_cpu("mla head dim 192", args);
    // Under context parallelism (two thread ranks sharing the GPU): the kernels on a rank's query
    // chunks against the gathered keys.
    let cp2 = || TrainArgs { context_parallel_size: Some(2), nproc: Some(2), ..args() };
    bf16_cuda_matches_cpu("mla head dim 192 cp2", cp2);
    // Narrower heads (16 + 8, v 12): padded to 64 on the GPU (`attention_padded_width`), to 24
    // on the CPU.
    let narrow = || TrainArgs { qk_head_dim: Some(16), qk_pos_emb_head_dim: Some(8), v_head_dim: Some(12), ..args() };
    bf16_cuda_matches_cpu("mla head dim 24 padded to 64", narrow);
}

/// The deepseek-v3-tiny preset (MLA with YaRN, grouped sigmoid experts with the expert bias, a
/// dense first layer, one MTP depth) on the GPU against one CPU rank, fp32 within 1e-4.
#[test]
fn deepseek_v3_tiny_preset_cuda_matches_cpu() {
    split_matches_cpu("deepseek-v3-tiny", "fp32", |a| a, |a| a);
}

/// Mamba-2 hybrid (the convolution, the chunked scan, the gated norm beside attention layers).
#[test]
fn mamba_tiny_preset_cuda_matches_cpu() {
    matches_cpu("mamba-tiny");
}

/// The scan on tensor cores (bf16 with head dim and state multiples of 32; mamba-tiny's 16 state
/// channels take the f32-FMA kernels): mamba-tiny with heads of 32 and 32 state channels, bf16 on
/// CUDA against bf16 on the CPU.
#[test]
fn mamba_tensor_core_scan_cuda_matches_cpu() {
    let args = || TrainArgs {
        preset: Some("mamba-tiny".into()),
        bf16: true,
        mamba_state_dim: Some(32),
        mamba_head_dim: Some(32),
        ..TrainArgs::default()
    };
    bf16_cuda_matches_cpu("mamba tensor cores", args);
}

/// --fp8-format with --fp8-recipe tensorwise on the GPU: the quantization kernels (amax, then
/// the cast writing q and qᵀ) and cuBLASLt's FP8 products (E4M3 forward, E5M2 gradients, the
/// weight gradient into fp32 main_grad) inside training: llama-tiny (SwiGLU, no biases), tiny
/// (GeLU and biases: the bias epilogue, the GeLU outside the products), mixtral-tiny (each
/// expert's token list padded to whole 16-row tiles) and E4M3 gradients under
/// tp2 × sp on two thread ranks sharing it, against the CPU's emulation, within bf16's 2e-2.
#[test]
fn fp8_cuda_matches_cpu() {
    let fp8 = |preset: &'static str, format: &'static str| {
        move || TrainArgs {
            preset: Some(preset.into()),
            bf16: true,
            fp8_format: Some(format.into()),
            fp8_recipe: Some("tensorwise".into()),
            ..TrainArgs::default()
        }
    };
    bf16_cuda_matches_cpu("fp8 hybrid llama-tiny", fp8("llama-tiny", "hybrid"));
    bf16_cuda_matches_cpu("fp8 hybrid tiny", fp8("tiny", "hybrid"));
    bf16_cuda_matches_cpu("fp8 hybrid mixtral-tiny", fp8("mixtral-tiny", "hybrid"));
    bf16_cuda_matches_cpu("fp8 e4m3 tp2 sp", || TrainArgs {
        tensor_model_parallel_size: Some(2),
        sequence_parallel: true,
        nproc: Some(2),
        ..fp8("llama-tiny", "e4m3")()
    });
}

/// --fp8-recipe delayed on the GPU: the cast by a given scale that also maxes the tensor's amax
/// into its history slot, `fp8_delayed_update` after every pass, the recompute's copy of the
/// forward scales: llama-tiny with an amax history of 4 under `max`, mixtral-tiny, GPT's tiny
/// (GeLU in the cast of fc2's input) alone and under tp2 × sp, mamba-tiny
/// (the mixers' in_proj blocks and out_proj in FP8), and tp2 × sp
/// (the amaxes reduced over the two thread ranks sharing the GPU) with full recompute, against
/// the CPU's emulation within bf16's 2e-2.
#[test]
fn fp8_delayed_cuda_matches_cpu() {
    let delayed = |preset: &'static str| {
        move || TrainArgs {
            preset: Some(preset.into()),
            bf16: true,
            fp8_format: Some("hybrid".into()),
            fp8_recipe: Some("delayed".into()),
            ..TrainArgs::default()
        }
    };
    bf16_cuda_matches_cpu("fp8 delayed llama-tiny history 4 max", || TrainArgs {
        fp8_amax_history_len: Some(4),
        fp8_amax_compute_algo: Some("max".into()),
        ..delayed("llama-tiny")()
    });
    bf16_cuda_matches_cpu("fp8 delayed mixtral-tiny", delayed("mixtral-tiny"));
    // GPT's GeLU inside the casts of fc2's input and fc1's output gradient, alone and over tp2
    // (llama-tiny's SwiGLU rides in fc2's input cast in the two cases above).
    bf16_cuda_matches_cpu("fp8 delayed tiny", delayed("tiny"));
    bf16_cuda_matches_cpu("fp8 delayed tiny tp2 sp", || TrainArgs {
        tensor_model_parallel_size: Some(2),
        sequence_parallel: true,
        nproc: Some(2),
        ..delayed("tiny")()
    });
    bf16_cuda_matches_cpu("fp8 delayed mamba-tiny (32 heads of 2)", || TrainArgs {
        mamba_head_dim: Some(2),
        ..delayed("mamba-tiny")()
    });
    bf16_cuda_matches_cpu("fp8 delayed tp2 sp full recompute", || TrainArgs {
        tensor_model_parallel_size: Some(2),
        sequence_parallel: true,
        nproc: Some(2),
        recompute_granularity: Some("full".into()),
        recompute_method: Some("uniform".into()),
        recompute_num_layers: Some(1),
        ..delayed("llama-tiny")()
    });
}

/// The precision-aware optimizer's bf16 moments and bf16 main grads (`adamw_runs_*_m*_v*`) in a
/// bf16 llama-tiny run, against the CPU's.
#[test]
fn bf16_moments_cuda_match_cpu() {
    let args = || TrainArgs {
        preset: Some("llama-tiny".into()),
        bf16: true,
        use_precision_aware_optimizer: true,
        exp_avg_dtype: Some("bf16".into()),
        exp_avg_sq_dtype: Some("bf16".into()),
        main_grads_dtype: Some("bf16".into()),
        ..TrainArgs::default()
    };
    bf16_cuda_matches_cpu("bf16 moments", args);
}

/// --optimizer-cpu-offload on the GPU: the gradients down, the update on the host, the
/// parameters back up (a run-by-run copy from the host's compact buffers), against the CPU.
#[test]
fn cpu_offload_cuda_matches_cpu() {
    let args = || TrainArgs {
        preset: Some("llama-tiny".into()),
        bf16: true,
        optimizer_cpu_offload: true,
        ..TrainArgs::default()
    };
    bf16_cuda_matches_cpu("cpu offload", args);
}

/// `args` (a bf16 run) for 20 steps on the GPU and on the CPU: every loss within 2e-2.
fn bf16_cuda_matches_cpu(tag: &str, args: impl Fn() -> TrainArgs) {
    let gpu = Device::cuda(0).expect("a CUDA device");
    let (cpu, cuda) = (losses_of(args(), Device::Cpu), losses_of(args(), gpu));
    eprintln!("{tag}\ncpu bf16 {cpu:?}\ncuda bf16 {cuda:?}");
    assert_eq!(cuda.len(), 20);
    for (i, (c, g)) in cpu.iter().zip(&cuda).enumerate() {
        assert!((c - g).abs() <= 2e-2 * c.abs(), "{tag} step {}: cpu bf16 {c} vs cuda bf16 {g}", i + 1);
    }
}

/// Mamba tensor parallelism on the GPU: two thread ranks sharing it, each with half the heads and
/// groups (its parts of in_proj's z | x | B | C | dt blocks and of the convolution's channels, the
/// scan and the gated norm on its own heads, out_proj's partial sums added over the ranks),
/// against one CPU rank, fp32 within 1e-4.
#[test]
fn mamba_tensor_parallel_cuda_matches_cpu() {
    tp2_matches_cpu("mamba-tiny", false);
}

/// --cp-comm-type a2a on the GPU (two thread ranks sharing it): q, k, v and the output traded
/// between rows and heads by strided rectangle copies around an all-to-all, the flash kernels
/// over the whole sequence on each rank's heads; plain, with a sliding window, with the learned
/// sink softmax (on the lse traded back) and per layer beside the all-gather; against one CPU
/// rank, fp32 within 1e-4.
#[test]
fn all_to_all_context_parallel_cuda_matches_cpu() {
    let a2a = |kinds: &[&str], a: TrainArgs| TrainArgs {
        context_parallel_size: Some(2),
        cp_comm_type: Some(kinds.iter().map(|k| k.to_string()).collect()),
        nproc: Some(2),
        ..a
    };
    split_matches_cpu("llama-tiny", "a2a cp2", |a| a, |a| a2a(&["a2a"], a));
    let window = |a: TrainArgs| TrainArgs { window_size: Some("(24,0)".into()), ..a };
    split_matches_cpu("llama-tiny", "a2a cp2 window", window, |a| a2a(&["a2a"], window(a)));
    let sink = |a: TrainArgs| TrainArgs { softmax_type: Some("learnable".into()), ..a };
    split_matches_cpu("llama-tiny", "a2a cp2 learned sink", sink, |a| a2a(&["a2a"], sink(a)));
    split_matches_cpu(
        "llama-tiny",
        "cp2 a2a | allgather per layer",
        |a| a,
        |a| a2a(&["a2a", "allgather", "a2a", "p2p"], a),
    );
}

/// --moe-router-force-load-balancing on the GPU: the routers' random logits drawn by the normal
/// kernel (Box–Muller on the same Philox words as the CPU), alone and under ep2 × edp2 on two
/// thread ranks sharing it, against one CPU rank, fp32 within 1e-4.
#[test]
fn forced_load_balancing_cuda_matches_cpu() {
    let forced = |a: TrainArgs| TrainArgs { moe_router_force_load_balancing: true, ..a };
    split_matches_cpu("mixtral-tiny", "forced balancing", forced, forced);
    split_matches_cpu("mixtral-tiny", "forced balancing ep2", forced, |a| TrainArgs {
        expert_model_parallel_size: Some(2),
        nproc: Some(2),
        ..forced(a)
    });
}

/// --optimizer sgd on the GPU (kernels/optim.cu `sgd_runs_*`, clip factor and rates from the
/// device state), one rank and dp2 with the distributed optimizer on two thread ranks sharing it,
/// against one CPU rank, fp32 within 1e-4.
#[test]
fn sgd_cuda_matches_cpu() {
    let sgd = |a: TrainArgs| TrainArgs { optimizer: Some("sgd".into()), lr: Some(0.05), ..a };
    split_matches_cpu("llama-tiny", "sgd", sgd, sgd);
    split_matches_cpu("llama-tiny", "sgd dp2 distributed", sgd, |a| TrainArgs {
        use_distributed_optimizer: true,
        nproc: Some(2),
        ..sgd(a)
    });
}

/// Mamba context parallelism on the GPU: two thread ranks sharing it, each two chunks of every
/// sequence; the mixers trade rows for heads (strided rectangle copies around an all-to-all),
/// each rank scanning the whole sequence for half the heads, the attention layer gathering K and
/// V; against one CPU rank, fp32 within 1e-4.
#[test]
fn mamba_context_parallel_cuda_matches_cpu() {
    split_matches_cpu(
        "mamba-tiny",
        "cp2",
        |a| a,
        |a| TrainArgs { context_parallel_size: Some(2), nproc: Some(2), ..a },
    );
}

/// --calculate-per-token-loss with the routers' losses on the GPU (their gradients at 1 / the
/// micro-batch's token share, a host-side scale into the router-loss kernel), alone and under
/// dp2 × ep2 on two thread ranks sharing it, against one CPU rank, fp32 within 1e-4.
#[test]
fn per_token_router_losses_cuda_match_cpu() {
    let per_token = |a: TrainArgs| TrainArgs { calculate_per_token_loss: true, moe_z_loss_coeff: Some(1e-2), ..a };
    split_matches_cpu("mixtral-tiny", "per token", per_token, per_token);
    split_matches_cpu("mixtral-tiny", "per token dp2 ep2", per_token, |a| TrainArgs {
        expert_model_parallel_size: Some(2),
        nproc: Some(2),
        ..per_token(a)
    });
}

/// Mixture of experts under tensor and sequence parallelism on the GPU: every SwiGLU expert split
/// over two thread ranks sharing it, the sequence gathered around the layer, against one CPU
/// rank, fp32 within 1e-4.
#[test]
fn mixtral_tensor_parallel_cuda_matches_cpu() {
    tp2_matches_cpu("mixtral-tiny", true);
}

/// Whole experts under tensor and sequence parallelism on the GPU (--expert-tensor-parallel-size
/// 1, expert parallel 2 over the tensor-parallel pair): each thread rank routes its own slice of
/// the sequence and dispatches it to the other's experts by all-to-all; against one CPU rank,
/// fp32 within 1e-4.
#[test]
fn mixtral_whole_experts_cuda_matches_cpu() {
    split_matches_cpu(
        "mixtral-tiny",
        "tp2 sp etp1 ep2",
        |a| a,
        |a| TrainArgs {
            tensor_model_parallel_size: Some(2),
            sequence_parallel: true,
            expert_tensor_parallel_size: Some(1),
            expert_model_parallel_size: Some(2),
            nproc: Some(2),
            ..a
        },
    );
}

/// `preset` under tp2 (with sequence parallelism where `sp`) on two thread ranks sharing the GPU
/// against one CPU rank: fp32 within 1e-4 at each of 20 steps.
fn tp2_matches_cpu(preset: &str, sp: bool) {
    split_matches_cpu(
        preset,
        "tp2",
        |a| a,
        |a| TrainArgs { tensor_model_parallel_size: Some(2), sequence_parallel: sp, nproc: Some(2), ..a },
    );
}

/// `preset` in the layout `split` gives its flags (thread ranks sharing the GPU) against one CPU
/// rank: fp32 within 1e-4 at each of 20 steps.
fn split_matches_cpu(
    preset: &str,
    tag: &str,
    on_cpu: impl Fn(TrainArgs) -> TrainArgs,
    split: impl Fn(TrainArgs) -> TrainArgs,
) {
    let gpu = Device::cuda(0).expect("a CUDA device");
    let args = || TrainArgs { preset: Some(preset.into()), ..TrainArgs::default() };
    let (cpu, cuda) = (losses_of(on_cpu(args()), Device::Cpu), losses_of(split(args()), gpu));
    eprintln!("{preset} {tag}\ncpu fp32 {cpu:?}\ncuda {tag} fp32 {cuda:?}");
    assert_eq!(cuda.len(), 20);
    for (i, (c, g)) in cpu.iter().zip(&cuda).enumerate() {
        assert!((c - g).abs() <= 1e-4 * c.abs(), "{preset} step {}: cpu {c} vs cuda {tag} {g}", i + 1);
    }
}

fn matches_cpu(preset: &str) {
    let gpu = Device::cuda(0).expect("a CUDA device");
    let cpu = losses(preset, false, Device::Cpu);
    let f32_gpu = losses(preset, false, gpu.clone());
    let bf16_gpu = losses(preset, true, gpu);
    let bf16_cpu = losses(preset, true, Device::Cpu);
    eprintln!("{preset}\ncpu fp32 {cpu:?}\ncuda fp32 {f32_gpu:?}\ncpu bf16 {bf16_cpu:?}\ncuda bf16 {bf16_gpu:?}");
    assert_eq!(cpu.len(), 20);
    for (i, (c, g)) in cpu.iter().zip(&f32_gpu).enumerate() {
        assert!((c - g).abs() <= 1e-4 * c.abs(), "{preset} step {}: cpu fp32 {c} vs cuda fp32 {g}", i + 1);
    }
    assert_eq!(bf16_gpu.len(), 20);
    for (i, (c, b)) in bf16_cpu.iter().zip(&bf16_gpu).enumerate() {
        assert!((c - b).abs() <= 2e-2 * c.abs(), "{preset} step {}: cpu bf16 {c} vs cuda bf16 {b}", i + 1);
    }
}

/// Qwen2's attention (`--add-qkv-bias` on the Llama-style preset: the QKV product's bias
/// before RoPE, no other linear bias): CUDA against the CPU, fp32 within 1e-4.
#[test]
fn qkv_bias_cuda_matches_cpu() {
    let gpu = Device::cuda(0).expect("a CUDA device");
    let args = TrainArgs { preset: Some("llama-tiny".into()), add_qkv_bias: true, ..TrainArgs::default() };
    let cpu = losses_of(args.clone(), Device::Cpu);
    let cuda = losses_of(args, gpu);
    eprintln!("qkv bias\ncpu {cpu:?}\ncuda {cuda:?}");
    assert_eq!(cuda.len(), 20);
    for (i, (c, g)) in cpu.iter().zip(&cuda).enumerate() {
        assert!((c - g).abs() <= 1e-4 * c.abs(), "step {}: cpu {c} vs cuda {g}", i + 1);
    }
}

/// `--grad-reduce-in-bf16` (bf16 main_grad: weight gradients out of bf16 GEMMs, column sums and
/// the embedding's scatter-add rounded once, AdamW reading bf16): CUDA against the CPU run with
/// the same flag, and against CUDA's fp32 main_grad, both within bf16's 2e-2.
#[test]
fn bf16_main_grad_cuda_matches_cpu() {
    let gpu = Device::cuda(0).expect("a CUDA device");
    for preset in ["tiny", "llama-tiny"] {
        let args = TrainArgs { preset: Some(preset.into()), bf16: true, ..TrainArgs::default() };
        let narrow = TrainArgs { grad_reduce_in_bf16: true, ..args.clone() };
        let cpu = losses_of(narrow.clone(), Device::Cpu);
        let cuda = losses_of(narrow, gpu.clone());
        let wide = losses_of(args, gpu.clone());
        eprintln!("{preset}\ncpu bf16 grads {cpu:?}\ncuda bf16 grads {cuda:?}\ncuda f32 grads {wide:?}");
        assert_eq!(cuda.len(), 20);
        for (i, ((c, g), w)) in cpu.iter().zip(&cuda).zip(&wide).enumerate() {
            assert!((c - g).abs() <= 2e-2 * c.abs(), "{preset} step {}: cpu {c} vs cuda {g}", i + 1);
            assert!((w - g).abs() <= 2e-2 * w.abs(), "{preset} step {}: f32 grads {w} vs bf16 {g}", i + 1);
        }
    }
}

/// Hidden dropout 0.1 (fp32): the CUDA kernel draws the CPU's masks, so the runs stay as close as
/// without dropout; and dropout changes the run.
#[test]
fn tiny_preset_with_hidden_dropout_cuda_matches_cpu() {
    let gpu = Device::cuda(0).expect("a CUDA device");
    let cpu = losses_with("tiny", false, Device::Cpu, Some(0.1));
    let cuda = losses_with("tiny", false, gpu, Some(0.1));
    assert_eq!(cpu.len(), 20);
    for (i, (c, g)) in cpu.iter().zip(&cuda).enumerate() {
        assert!((c - g).abs() <= 1e-4 * c.abs(), "step {}: cpu {c} vs cuda {g} with dropout", i + 1);
    }
    assert_ne!(cpu, losses("tiny", false, Device::Cpu), "dropout 0.1 changed nothing");
}

/// `--attention-dropout 0.1` on both tiny presets: fp32 (the SIMT flash kernels, head dim 32)
/// within 1e-4 of the CPU, and bf16 with two heads of 64 (the tensor-core `_drop` kernels) within
/// 2e-2; the GPU draws the CPU's mask, and dropout changes the run.
#[test]
fn attention_dropout_cuda_matches_cpu() {
    let gpu = Device::cuda(0).expect("a CUDA device");
    for preset in ["tiny", "llama-tiny"] {
        for (bf16, heads, tol) in [(false, None, 1e-4), (true, Some(2), 2e-2)] {
            let args = |dropout: f64| TrainArgs {
                preset: Some(preset.into()),
                bf16,
                num_attention_heads: heads,
                num_query_groups: heads.map(|_| 1),
                attention_dropout: Some(dropout),
                ..TrainArgs::default()
            };
            let cpu = losses_of(args(0.1), Device::Cpu);
            let cuda = losses_of(args(0.1), gpu.clone());
            eprintln!("{preset} bf16 {bf16}\ncpu {cpu:?}\ncuda {cuda:?}");
            assert_eq!(cpu.len(), 20);
            for (i, (c, g)) in cpu.iter().zip(&cuda).enumerate() {
                assert!((c - g).abs() <= tol * c.abs(), "{preset} bf16 {bf16} step {}: cpu {c} vs cuda {g}", i + 1);
            }
            assert_ne!(cpu, losses_of(args(0.0), Device::Cpu), "{preset}: attention dropout changed nothing");
        }
    }
}

/// gpt-oss's gated quick GeLU (`--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value
/// 0.5`, the clamp holding many inputs) in the dense MLPs and in the experts, fp32: CUDA's kernels
/// against the CPU's, 20 steps within 1e-4, and the activation changes the run.
#[test]
fn quick_geglu_cuda_matches_cpu() {
    let gpu = Device::cuda(0).expect("a CUDA device");
    for preset in ["llama-tiny", "mixtral-tiny"] {
        let args = || TrainArgs {
            preset: Some(preset.into()),
            quick_geglu: true,
            glu_linear_offset: Some(1.0),
            activation_func_clamp_value: Some(0.5),
            ..TrainArgs::default()
        };
        let cpu = losses_of(args(), Device::Cpu);
        let cuda = losses_of(args(), gpu.clone());
        assert_eq!(cpu.len(), 20);
        for (i, (c, g)) in cpu.iter().zip(&cuda).enumerate() {
            assert!((c - g).abs() <= 1e-4 * c.abs(), "{preset} step {}: cpu {c} vs cuda {g}", i + 1);
        }
        assert_ne!(cpu, losses(preset, false, Device::Cpu), "{preset}: the activation changed nothing");
    }
}

/// `--window-size (16,0)` (each token sees itself and 16 before it) on both tiny presets, fp32:
/// the flash kernels' window mask against the CPU's, and the window changes the run; on the
/// Llama-style one also in every second layer only (`--window-attn-skip-freq 2`).
#[test]
fn sliding_window_cuda_matches_cpu() {
    let gpu = Device::cuda(0).expect("a CUDA device");
    for (preset, skip) in [("tiny", None), ("llama-tiny", None), ("llama-tiny", Some("2"))] {
        let args = || TrainArgs {
            preset: Some(preset.into()),
            window_size: Some("(16,0)".into()),
            window_attn_skip_freq: skip.map(str::to_string),
            ..TrainArgs::default()
        };
        let cpu = losses_of(args(), Device::Cpu);
        let cuda = losses_of(args(), gpu.clone());
        assert_eq!(cpu.len(), 20);
        for (i, (c, g)) in cpu.iter().zip(&cuda).enumerate() {
            assert!(
                (c - g).abs() <= 1e-4 * c.abs(),
                "{preset} {skip:?} step {}: cpu {c} vs cuda {g} with a window",
                i + 1
            );
        }
        assert_ne!(cpu, losses(preset, false, Device::Cpu), "{preset}: the window changed nothing");
    }
}

/// `--eod-mask-loss` (a loss mask made on the host from each batch's end-of-document ids, a
/// different count every micro-batch) and `--mock-data` on both tiny presets, fp32: CUDA within
/// 1e-4 of the CPU, and the mask changes the run.
#[test]
fn eod_mask_loss_and_mock_data_cuda_match_cpu() {
    let gpu = Device::cuda(0).expect("a CUDA device");
    for preset in ["tiny", "llama-tiny"] {
        for mock_data in [false, true] {
            let args = |eod_mask_loss| TrainArgs {
                preset: Some(preset.into()),
                eod_mask_loss,
                mock_data,
                ..TrainArgs::default()
            };
            let cpu = losses_of(args(true), Device::Cpu);
            let cuda = losses_of(args(true), gpu.clone());
            assert_eq!(cpu.len(), 20);
            for (i, (c, g)) in cpu.iter().zip(&cuda).enumerate() {
                assert!(
                    (c - g).abs() <= 1e-4 * c.abs(),
                    "{preset} mock {mock_data} step {}: cpu {c} vs cuda {g}",
                    i + 1
                );
            }
            assert_ne!(cpu, losses_of(args(false), Device::Cpu), "{preset}: --eod-mask-loss changed nothing");
        }
    }
}

/// The tiny preset for 4 steps, one evaluation at the end: the profiling tests' run.
fn tiny_four_steps() -> Settings {
    let args = TrainArgs {
        preset: Some("tiny".into()),
        train_iters: Some(4),
        eval_interval: Some(4),
        eval_iters: Some(1),
        no_progress: true,
        ..TrainArgs::default()
    };
    Settings::resolve(&args).unwrap().0
}

/// `--profile`'s range around steps 2–3 with no profiler attached: the driver's start and stop
/// calls must succeed and training go on past them. (That ncu records inside the range, and only
/// there, is what `cargo xtask bench --gpu-profile` relies on: its parse fails on an empty
/// profile.)
#[test]
fn training_runs_through_a_profiler_range_with_no_profiler_attached() {
    let s = tiny_four_steps();
    let range = ProfileRange { start: 1, end: 3, ranks: vec![0], trace: None };
    let paths = Paths { device: Device::cuda(0).expect("a CUDA device"), profile: Some(range), ..Paths::default() };
    let summary = train(&s, &paths).unwrap();
    assert_eq!(summary.losses.len(), 4);
    assert!(summary.losses.iter().all(|(_, l)| l.is_finite()), "{:?}", summary.losses);
}

/// `--profile-trace`: the range's GPU timeline through CUPTI, written as a Chrome trace. Steps 2
/// and 3 are traced, so the file holds (at least: the tests of this binary share the GPU, and a
/// trace is process-wide) their two optimizer updates and their batches' uploads, each activity
/// with an end after its start, in start order. (`cargo xtask trace` reading such files is tested
/// in xtask.)
#[test]
fn a_traced_range_writes_the_gpu_timeline_of_its_steps() {
    let s = tiny_four_steps();
    let dir = std::env::temp_dir().join(format!("ferrotron-cuda-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("steps.json");
    let range = ProfileRange { start: 1, end: 3, ranks: vec![0], trace: Some(file.clone()) };
    let paths = Paths { device: Device::cuda(0).expect("a CUDA device"), profile: Some(range), ..Paths::default() };
    let summary = train(&s, &paths).unwrap();
    assert_eq!(summary.losses.len(), 4);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(v["ferrotron"]["steps"].as_u64(), Some(2));
    let ev = v["traceEvents"].as_array().unwrap();
    let named = |p: &str| ev.iter().filter(|e| e["name"].as_str().is_some_and(|n| n.contains(p))).count();
    assert!(named("adamw_runs") >= 2, "{} updates in {} events", named("adamw_runs"), ev.len());
    let uploads = ev.iter().filter(|e| e["cat"] == "gpu_memcpy" && e["args"]["bytes"].as_u64() > Some(0)).count();
    assert!(uploads >= 2, "{uploads} uploads");
    let ts: Vec<f64> = ev.iter().map(|e| e["ts"].as_f64().unwrap()).collect();
    assert!(ts.windows(2).all(|w| w[0] <= w[1]), "start order");
    assert!(ev.iter().all(|e| e["dur"].as_f64().is_some_and(|d| d >= 0.0)));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A GPU run's sharded checkpoint (written in the background, `--async-save`) resumes on the
/// GPU bit for bit under `--deterministic-mode` (the straight run's last four losses), and on the
/// CPU within bf16's 2e-2 of them: the parameters and the optimizer state went through the
/// files whole.
#[test]
fn a_gpu_checkpoint_resumes_on_the_gpu_bit_for_bit_and_on_the_cpu() {
    let gpu = Device::cuda(0).expect("a CUDA device");
    let args = TrainArgs {
        preset: Some("llama-tiny".into()),
        bf16: true,
        train_iters: Some(8),
        eval_interval: Some(8),
        eval_iters: Some(1),
        lr: Some(1e-3),
        no_progress: true,
        ..TrainArgs::default()
    };
    let (s, _): (Settings, Paths) = Settings::resolve(&args).unwrap();
    let dir = std::env::temp_dir().join(format!("ferrotron-cuda-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let on = |device: &Device| Paths { device: device.clone(), deterministic: true, ..Paths::default() };
    let straight = train(&s, &on(&gpu)).unwrap();
    let half = Paths { save: Some(dir.clone()), exit_interval: Some(4), async_save: true, ..on(&gpu) };
    train(&s, &half).unwrap();
    let resumed = train(&s, &Paths { load: Some(dir.clone()), ..on(&gpu) }).unwrap();
    let on_cpu = train(&s, &Paths { load: Some(dir.clone()), ..on(&Device::Cpu) }).unwrap();
    let bits = |l: &[(u64, f64)]| l.iter().map(|(i, x)| (*i, x.to_bits())).collect::<Vec<_>>();
    eprintln!("straight {:?}\nresumed {:?}\non the cpu {:?}", straight.losses, resumed.losses, on_cpu.losses);
    assert_eq!(bits(&resumed.losses), bits(&straight.losses[4..]));
    assert_eq!(on_cpu.losses.len(), 4);
    for ((i, c), (_, g)) in on_cpu.losses.iter().zip(&resumed.losses) {
        assert!((c - g).abs() <= 2e-2 * g.abs(), "iteration {i}: cpu {c} vs cuda {g}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
