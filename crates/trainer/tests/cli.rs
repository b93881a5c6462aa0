//! The `ferrotron` binary end to end: a short run whose loss falls and whose files parse, bad flags
//! that fail with one line naming the flag, corrupt checkpoints, and a save that fails midway.

mod common;

use common::tmp;
use std::path::Path;
use std::process::{Command, Output};

const TINY: &[&str] = &[
    "train",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "64",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "8",
    "--global-batch-size",
    "16",
    "--eval-iters",
    "2",
    "--log-interval",
    "2",
    "--corpus-docs",
    "400",
    "--no-progress",
];

fn run(extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(TINY).args(extra).output().expect("run ferrotron")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn short_run_learns_and_writes_parseable_files() {
    let dir = tmp("cli-run");
    let d = dir.to_str().unwrap();
    let o = run(&[
        "--train-iters",
        "30",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "3",
        "--eval-interval",
        "15",
        "--save-interval",
        "15",
        "--save",
        d,
        "--deterministic-mode", // accepted; CPU runs are deterministic anyway
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // metrics.jsonl: every line is JSON; eval loss falls from iteration 0 to the end.
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str(l).expect("metrics line is JSON")).collect();
    let evals: Vec<(u64, f64)> = lines
        .iter()
        .filter(|v| v["kind"] == "eval")
        .map(|v| (v["iteration"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect();
    assert_eq!(evals.first().map(|e| e.0), Some(0));
    assert_eq!(evals.last().map(|e| e.0), Some(30));
    let (start, end) = (evals[0].1, evals.last().unwrap().1);
    assert!(end < start - 1.0, "validation loss {start} -> {end} did not fall");
    assert!(lines.iter().filter(|v| v["kind"] == "train").all(|v| v["tokens_per_s"].as_f64().unwrap() > 0.0));
    // The host's least time per step is a step's own time on CPU: above zero, and no more than the
    // window's mean step (16 × 32 tokens a step).
    for v in lines.iter().filter(|v| v["kind"] == "train") {
        let (host, tps) = (v["host_ms_min"].as_f64().unwrap(), v["tokens_per_s"].as_f64().unwrap());
        assert!(host > 0.0 && host <= 1e3 * 512.0 / tps * 1.001, "host {host} ms, {tps} tokens/s");
    }
    // Checkpoint files parse, the tracker names the last one.
    assert_eq!(std::fs::read_to_string(dir.join("latest_checkpointed_iteration.txt")).unwrap().trim(), "30");
    let state: toml::Table = std::fs::read_to_string(dir.join("iter_0000030/state.toml")).unwrap().parse().unwrap();
    assert_eq!(state["iteration"].as_integer(), Some(30));
    assert!(dir.join("iter_0000015/model_optim_rank00000.safetensors").is_file());
    // generate reads it back.
    let g = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["generate", "--load", d, "--prompt", "Once", "--max-new-tokens", "20"])
        .output()
        .unwrap();
    assert!(g.status.success(), "{}", stderr(&g));
    assert!(String::from_utf8_lossy(&g.stdout).starts_with("Once"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn metrics_file_without_save_writes_no_checkpoint() {
    let dir = tmp("cli-metrics");
    let f = dir.join("sub/m.jsonl");
    let o = run(&["--train-iters", "4", "--eval-interval", "2", "--metrics-file", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&f).unwrap();
    let train = text.lines().filter(|l| l.contains("\"kind\":\"train\"")).count();
    assert_eq!(train, 2, "log interval 2 over 4 iterations:\n{text}");
    assert_eq!(std::fs::read_dir(dir.join("sub")).unwrap().count(), 1, "only the metrics file");
    let _ = std::fs::remove_dir_all(dir);
}

/// The rate each iteration trains at, as Megatron's scheduler gives it (it steps after each
/// update): iteration k at k − 1 completed iterations, so under a warmup the first update runs at
/// --lr-warmup-init (default 0).
#[test]
fn iteration_k_trains_at_the_rate_of_k_minus_one_completed_iterations() {
    let dir = tmp("cli-lr");
    let f = dir.join("m.jsonl");
    let lrs = |extra: &[&str]| -> Vec<f64> {
        let mut a = vec!["--train-iters", "5", "--log-interval", "1", "--lr", "1e-3", "--min-lr", "1e-4"];
        a.extend_from_slice(&["--lr-warmup-iters", "3", "--lr-decay-style", "linear", "--eval-interval", "5"]);
        a.extend_from_slice(&["--metrics-file", f.to_str().unwrap()]);
        a.extend_from_slice(extra);
        let _ = std::fs::remove_file(&f); // a run appends to the file
        let o = run(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        let text = std::fs::read_to_string(&f).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["kind"] == "train")
            .map(|v| v["lr"].as_f64().unwrap())
            .collect()
    };
    // Warmup over 3 of 5 iterations, then linear decay to --min-lr at iteration 5 (4 completed).
    let want = [0.0, 1e-3 / 3.0, 2e-3 / 3.0, 1e-3, 1e-4 + 0.5 * 9e-4];
    let got = lrs(&[]);
    assert_eq!(got.len(), 5);
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() < 1e-12, "iteration {}: lr {g}, want {w}", k + 1);
    }
    let init = lrs(&["--lr-warmup-init", "1e-4"]);
    assert!((init[0] - 1e-4).abs() < 1e-15 && (init[1] - 4e-4).abs() < 1e-12, "{init:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[track_caller]
fn fails_naming(extra: &[&str], needle: &str) {
    let o = run(extra);
    assert!(!o.status.success(), "accepted {extra:?}");
    let e = stderr(&o);
    assert_eq!(e.trim_end().lines().count(), 1, "not one line: {e}");
    assert!(e.contains(needle), "{extra:?}: {e}");
}

#[test]
fn bad_flags_fail_with_one_line_naming_the_flag() {
    fails_naming(&["--hidden-size", "30"], "--hidden-size 30 is not divisible by --num-attention-heads 4");
    fails_naming(&["--num-query-groups", "3"], "--num-query-groups 3");
    fails_naming(&["--seq-length", "64"], "--max-position-embeddings");
    fails_naming(&["--global-batch-size", "12"], "--global-batch-size 12");
    fails_naming(
        &["--load", "/nonexistent/ferrotron", "--exit-on-missing-checkpoint"],
        "--load /nonexistent/ferrotron: holds no checkpoint",
    );
    fails_naming(&["--preset", "huge"], "--preset huge: unknown preset");
    fails_naming(&["--lr-decay-style", "sqrt"], "--lr-decay-style sqrt");
    fails_naming(&["--hidden-dropout", "1"], "--hidden-dropout 1 must be in [0, 1)");
    fails_naming(&["--window-size", "(4,2)"], "--window-size (4,2): write (left,right)");
    fails_naming(&["--device", "tpu"], "use cpu, cuda or cuda:N");
    fails_naming(&["--ckpt-format", "torch"], "--ckpt-format torch: Ferrotron writes one checkpoint format");
    fails_naming(&["--profile"], "--profile opens a CUDA profiler range: run with --device cuda");
    fails_naming(
        &["--profile", "--profile-step-start", "5", "--profile-step-end", "5"],
        "--profile-step-end 5 must be greater",
    );
    fails_naming(&["--profile-step-start", "3"], "take effect with --profile");
    fails_naming(&["--profile-ranks", "0", "1"], "take effect with --profile");
    fails_naming(&["--profile-trace", "steps.json"], "take effect with --profile");
    fails_naming(&["--data-path", "/nonexistent/ferrotron/data"], "/nonexistent/ferrotron/data.idx: No such file");
    fails_naming(&["--data-path", "/nonexistent/a", "--split", "98,x"], "--split 98,x: give up to three");
    fails_naming(&["--vocab-file", "vocab.json"], "belong to GPT2BPETokenizer, not the byte tokenizer");
    fails_naming(
        &["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/vocab.json"],
        "/nonexistent/vocab.json: No such file",
    );
    #[cfg(not(feature = "cuda"))]
    fails_naming(&["--device", "cuda:1"], "rebuild with `--features cuda`");
}

/// The implementation switches Megatron's scripts pass run unchanged: the same losses as
/// without them (printed to every digit); a shorthand takes the flag it stands for; values that
/// would change the run are refused by name; --log-throughput adds TFLOP/s per GPU to each line.
#[test]
fn megatrons_script_switches_run_as_the_plain_flags() {
    let losses = |o: &Output| -> Vec<String> {
        // Training lines ("iteration 2/4: loss 5.5335 lr …") and validation losses alike.
        stderr(o).lines().filter_map(|l| l.split(" loss ").nth(1).map(|x| x[..6].to_string())).collect()
    };
    let plain = run(&["--train-iters", "4"]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let switches = [
        "--train-iters",
        "4",
        "--distributed-backend",
        "nccl",
        "--use-mcore-models",
        "--transformer-impl",
        "transformer_engine",
        "--attention-backend",
        "flash",
        "--attention-softmax-in-fp32",
        "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion",
        "--no-bias-dropout-fusion",
        "--no-rope-fusion",
        "--no-gradient-accumulation-fusion",
        "--cross-entropy-loss-fusion",
        "--moe-permute-fusion",
        "--no-async-tensor-model-parallel-allreduce",
        "--accumulate-allreduce-grads-in-fp32",
        "--manual-gc",
        "--manual-gc-interval",
        "100",
        "--tp-comm-overlap",
        "--overlap-p2p-communication",
        "--no-create-attention-mask-in-dataloader",
        "--mmap-bin-files",
        "--ckpt-fully-parallel-save",
        "--ckpt-fully-parallel-load",
        "--num-workers",
        "2",
        "--dataloader-type",
        "single",
        "--timing-log-level",
        "2",
        "--empty-unused-memory-level",
        "0",
        "--rotary-percent",
        "1.0",
        "--rerun-mode",
        "disabled",
        "--use-precision-aware-optimizer",
        "--overlap-cpu-optimizer-d2h-h2d",
        "--optimizer-offload-fraction",
        "1.0",
        "--main-grads-dtype",
        "fp32",
        "--exp-avg-dtype",
        "fp32",
        "--log-throughput",
        "--optimizer",
        "adam",
        "--no-load-rng",
        "--no-save-rng",
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        "--use-cpu-initialization",
        "--initial-loss-scale",
        "65536",
        "--loss-scale-window",
        "1000",
        "--hysteresis",
        "2",
        "--min-loss-scale",
        "1",
        "--dist-ckpt-strictness",
        "log_all",
        "--ckpt-assume-constant-structure",
        "--auto-detect-ckpt-format",
        "--bias-swiglu-fusion",
        "--no-persist-layer-norm",
        "--defer-embedding-wgrad-compute",
        "--rotary-seq-len-interpolation-factor",
        "1",
        "--test-data-path",
        "unread",
        // The MoE scripts' transports and fusions (DeepEP, the fused router, TE's
        // cross-entropy), accepted on a dense model too, and recompute modules.
        "--moe-enable-deepep",
        "--moe-flex-dispatcher-backend",
        "deepep",
        "--moe-flex-dispatcher-num-sms",
        "32",
        "--moe-router-fusion",
        "--cross-entropy-fusion-impl",
        "te",
        "--delay-wgrad-compute",
        "--overlap-moe-expert-parallel-comm",
        "--te-rng-tracker",
        "--recompute-modules",
        "core_attn",
        "moe_act",
        "--pipeline-model-parallel-layout",
        "None",
        "--openai-gelu",
        "--no-overlap-p2p-communication",
        "--overlap-param-gather-with-optimizer-step",
        "--no-align-param-gather",
        "--ddp-average-in-collective",
        "--ddp-pad-buckets-for-high-nccl-busbw",
        "--ddp-num-buckets",
        "4",
        "--use-dist-ckpt",
        "--dist-ckpt-format",
        "torch_dist",
        "--num-dataset-builder-threads",
        "2",
        "--dataloader-fast-cache-load",
        "--dataloader-defer-npy-index-mmap",
        "--apply-residual-connection-post-layernorm",
    ];
    let with = run(&switches);
    assert!(with.status.success(), "{}", stderr(&with));
    assert_eq!(losses(&with), losses(&plain));
    assert_eq!(losses(&plain).len(), 5, "two training lines, three validation losses: {}", stderr(&plain));
    assert!(stderr(&with).lines().filter(|l| l.contains("TFLOP/s/GPU")).count() == 2, "{}", stderr(&with));
    // --recompute-activations is selective recompute: the same losses as its long form.
    let sel = run(&["--train-iters", "4", "--recompute-granularity", "selective"]);
    assert_eq!(losses(&run(&["--train-iters", "4", "--recompute-activations"])), losses(&sel));
    fails_naming(&["--recompute-activations", "--recompute-granularity", "full"], "contradicts");
    // --no-position-embedding: no learned positions (their parameters gone), and beside rope
    // nothing changes.
    use ferrotron_trainer::settings::{Settings, TrainArgs};
    let pe = |t: &str| {
        let a =
            TrainArgs { position_embedding_type: Some(t.into()), no_position_embedding: true, ..Default::default() };
        Settings::resolve(&a).unwrap().0.position_embedding_type
    };
    assert_eq!((pe("learned_absolute").as_str(), pe("rope").as_str()), ("none", "rope"));
    fails_naming(&["--dataloader-type", "external"], "--dataloader-type external");
    fails_naming(&["--hierarchical-context-parallel-sizes", "2", "2"], "a2a+p2p's groups, which is not built");
    fails_naming(&["--transformer-impl", "inference"], "--transformer-impl inference");
    let rope = |p: &'static str| ["--position-embedding-type", "rope", "--rotary-percent", p];
    fails_naming(&rope("0.4"), "--rotary-percent 0.4 rotates ⌊8 · 0.4⌋ = 3 features");
    fails_naming(&rope("1.5"), "--rotary-percent 1.5 must be in (0, 1]");
    fails_naming(&["--main-grads-dtype", "bf16"], "--main-grads-dtype bf16");
    fails_naming(&["--exp-avg-sq-dtype", "bf16"], "add --use-precision-aware-optimizer");
    fails_naming(&["--optimizer-offload-fraction", "0.3"], "offload all of it (1.0) or none");
    fails_naming(&["--optimizer-cpu-offload", "--cuda-graph-impl", "local"], "which a graph cannot hold");
    let aware = |f: &'static str, v: &'static str| ["--use-precision-aware-optimizer", f, v];
    fails_naming(&aware("--main-grads-dtype", "bf16"), "--main-grads-dtype bf16 keeps bf16 training's gradients");
    fails_naming(&aware("--exp-avg-dtype", "fp16"), "fp16 and fp8 optimizer state");
    fails_naming(&aware("--exp-avg-sq-dtype", "fp8"), "use bf16");
    fails_naming(&aware("--main-params-dtype", "fp16"), "master weights below fp32 are not built");
    fails_naming(&[&aware("--exp-avg-dtype", "bf16")[..], &["--optimizer", "sgd"]].concat(), "is Adam's");
    fails_naming(&["--wandb-project", "x"], "--tensorboard-dir writes the same scalars");
    fails_naming(&["--use-torch-fsdp2"], "FSDP is not built");
    fails_naming(&["--fp8-param-gather"], "--fp8-param-gather: FP8 parameters are not built");
    fails_naming(&["--optimizer", "lamb"], "--optimizer lamb");
    fails_naming(&["--moe-flex-dispatcher-backend", "nccl"], "--moe-flex-dispatcher-backend nccl");
    fails_naming(&["--cross-entropy-fusion-impl", "apex"], "--cross-entropy-fusion-impl apex");
    fails_naming(&["--recompute-modules", "attn"], "--recompute-modules attn: not one of Megatron's modules");
    fails_naming(
        &["--moe-router-force-load-balancing"],
        "--moe-router-force-load-balancing configures mixture-of-experts layers",
    );
    fails_naming(&["--pipeline-model-parallel-layout", "Et|txL"], "'x' is not a piece");
    fails_naming(&["--dist-ckpt-format", "zarr"], "--dist-ckpt-format zarr");
    fails_naming(&["--decoupled-min-lr", "1e-4"], "--decoupled-min-lr 0.0001 is what --decoupled-lr decays to");
    fails_naming(&["--init-method-xavier-uniform"], "--init-method-xavier-uniform");
    fails_naming(&["--checkpoint-activations"], "--recompute-granularity full");
    fails_naming(&["--fp8-format", "hybrid"], "--fp8-format hybrid needs --bf16");
    fails_naming(&["--rotary-seq-len-interpolation-factor", "2"], "--position-embedding-type is learned_absolute");
    fails_naming(
        &["--rotary-interleaved"],
        "--rotary-interleaved lays out rotary pairs, but --position-embedding-type is learned_absolute",
    );
    fails_naming(&["--microbatch-group-size-per-virtual-pipeline-stage", "3"], "only the pipeline size");
    let resolved = |a: TrainArgs| Settings::resolve(&a).unwrap().0;
    let rope = resolved(TrainArgs { use_rotary_position_embeddings: true, ..Default::default() });
    assert_eq!(rope.position_embedding_type, "rope");
    let vpp = resolved(TrainArgs {
        num_layers: Some(8),
        pipeline_model_parallel_size: Some(2),
        num_virtual_stages_per_pipeline_rank: Some(2),
        nproc: Some(2),
        ..Default::default()
    });
    assert_eq!(vpp.num_layers_per_virtual_pipeline_stage, Some(2));
    // --use-checkpoint-opt_param-scheduler: the saved run's schedule wins over the flags'.
    let dir = tmp("ck-scheduler");
    let save = dir.to_str().unwrap();
    let o = run(&[
        "--train-iters",
        "2",
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-5",
        "--weight-decay-incr-style",
        "cosine",
        "--start-weight-decay",
        "0.01",
        "--end-weight-decay",
        "0.2",
        "--save",
        save,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The newer spelling of the flag (Megatron's dataclass arguments), through the binary.
    let o = run(&["--train-iters", "2", "--load", save, "--use-checkpoint-opt-param-scheduler"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let again = |take: bool| TrainArgs {
        load: Some(dir.clone()),
        lr: Some(5e-3),
        use_checkpoint_opt_param_scheduler: take,
        ..Default::default()
    };
    assert_eq!(resolved(again(true)).lr, 1e-3);
    assert_eq!((resolved(again(true)).min_lr, resolved(again(false)).lr), (1e-5, 5e-3));
    let wd = |s: Settings| (s.weight_decay_incr_style, s.start_weight_decay, s.end_weight_decay);
    assert_eq!(wd(resolved(again(true))), (Some("cosine".into()), Some(0.01), Some(0.2)));
    assert_eq!(wd(resolved(again(false))), (None, None, None));
    let e = format!(
        "{:#}",
        Settings::resolve(&TrainArgs { use_checkpoint_opt_param_scheduler: true, ..Default::default() }).unwrap_err()
    );
    assert!(e.contains("add --load"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

fn rank_process(rank: usize, world: usize, port: &str, extra: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(TINY)
        .args(["--train-iters", "4", "--eval-interval", "4", "--distributed-timeout-s", "20"])
        .args(extra)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Two CPU processes under torchrun's variables (TCP backend), tensor parallel: both finish and
/// rank 0 prints the layout table and the losses.
#[test]
fn two_processes_train_over_tcp() {
    let port = free_port();
    let tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"];
    let kids: Vec<_> = (0..2).map(|r| rank_process(r, 2, &port, &tp)).collect();
    let outs: Vec<Output> = kids.into_iter().map(|k| k.wait_with_output().unwrap()).collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}", stderr(o));
    }
    let e0 = stderr(&outs[0]);
    assert!(e0.contains("layout: tp 2 × dp 1") && e0.contains("iteration 4/4"), "{e0}");
    assert!(!stderr(&outs[1]).contains("iteration 4/4"), "only rank 0 logs");
}

/// `ferrotron launch` starts the ranks with torchrun's variables (DP 2 here) and passes NCCL_*
/// through; a failing rank stops the launch with an error. The two processes save a sharded
/// checkpoint in the background (each its share of the distributed optimizer), which one process
/// resumes.
#[test]
fn launch_starts_every_rank() {
    let port = free_port();
    let dir = tmp("cli-launch-save");
    let d = dir.to_str().unwrap();
    let mut args = vec!["launch", "--nproc-per-node", "2", "--master-port", &port, "--"];
    args.extend_from_slice(TINY);
    args.extend_from_slice(&["--train-iters", "2", "--eval-interval", "2", "--distributed-timeout-s", "20"]);
    args.extend_from_slice(&["--save", d, "--async-save", "--use-distributed-optimizer"]);
    let o = Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(&args).env("NCCL_NVLS_ENABLE", "0").output().unwrap();
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("layout: tp 1 × dp 2") && e.contains("iteration 2/2"), "{e}");
    // Rank 0 alone prints the summary: another rank's line once cut into its "iteration 2/2".
    assert_eq!(e.matches("done: validation loss").count(), 1, "{e}");
    let state = ferrotron_trainer::checkpoint::read_state(&dir).unwrap();
    let files: Vec<&str> = state.tensor_files.iter().map(|f| f.file.as_str()).collect();
    assert_eq!(files, ["model_optim_rank00000.safetensors", "model_optim_rank00001.safetensors"]);
    let resumed = run(&["--train-iters", "3", "--eval-interval", "3", "--load", d]);
    assert!(resumed.status.success() && stderr(&resumed).contains("iteration 3/3"), "{}", stderr(&resumed));
    let _ = std::fs::remove_dir_all(dir);
    let port = free_port();
    let mut args = vec!["launch", "--nproc-per-node", "2", "--master-port", &port, "--"];
    args.extend_from_slice(TINY);
    args.extend_from_slice(&["--tensor-model-parallel-size", "3"]);
    let o = Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(&args).output().unwrap();
    assert!(!o.status.success() && stderr(&o).contains("local rank"), "{}", stderr(&o));
}

/// A rank that never starts: the other fails within the timeout, naming the missing rank.
#[test]
fn a_missing_process_is_named() {
    let port = free_port();
    let mut k = rank_process(0, 2, &port, &["--distributed-timeout-s", "2"]);
    let status = k.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut k.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("rendezvous") && err.contains("[1]"), "{err}");
}

/// `--window-size (4,0)`: each token sees itself and the 4 before it (sequences of 32); the loss
/// falls, to another value than without the window.
#[test]
fn a_sliding_window_run_learns() {
    let args = |window: bool| {
        let mut a = vec!["--train-iters", "20", "--lr", "3e-3", "--eval-interval", "20"];
        if window {
            a.extend(["--window-size", "(4,0)"]);
        }
        run(&a)
    };
    let val = |o: &Output, it: u32| -> f64 {
        let e = stderr(o);
        assert!(o.status.success(), "{e}");
        let line = e.lines().find(|l| l.starts_with(&format!("iteration {it}: validation loss"))).unwrap().to_owned();
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let (windowed, full) = (args(true), args(false));
    assert!(val(&windowed, 20) < val(&windowed, 0) - 0.5, "{}", stderr(&windowed));
    assert_ne!(val(&windowed, 20), val(&full, 20), "the window changed nothing");
}

/// `--nproc 4`: thread ranks, TP 2 × DP 2 with every switch on (hidden dropout too); the loss
/// falls.
#[test]
fn thread_ranks_train_with_every_switch() {
    let o = run(&[
        "--nproc",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--hidden-dropout",
        "0.1",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "5000",
        "--train-iters",
        "20",
        "--lr",
        "3e-3",
        "--eval-interval",
        "20",
    ]);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("layout: tp 2 × dp 2"), "{e}");
    let first = e.lines().find(|l| l.starts_with("iteration 0: validation loss")).unwrap();
    let last = e.lines().find(|l| l.starts_with("iteration 20: validation loss")).unwrap();
    let val = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
    assert!(val(last) < val(first) - 0.5, "{first} / {last}");
    // Each rank holds half the optimizer state of a DP-1 rank.
    assert!(e.lines().filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit())).count() >= 4, "{e}");
}

/// `--nproc 4`: TP 2 × PP 2 with full recompute; the per-stage saved bytes are printed.
#[test]
fn thread_ranks_train_a_pipeline() {
    let o = run(&[
        "--nproc",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--recompute-granularity",
        "full",
        "--train-iters",
        "12",
        "--lr",
        "3e-3",
        "--eval-interval",
        "12",
    ]);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(
        e.contains("layout: tp 2 × dp 1 × pp 2") && e.contains("saved activations at peak (per rank): stage 0"),
        "{e}"
    );
    let first = e.lines().find(|l| l.starts_with("iteration 0: validation loss")).unwrap();
    let last = e.lines().find(|l| l.starts_with("iteration 12: validation loss")).unwrap();
    let val = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
    assert!(val(last) < val(first) - 0.3, "{first} / {last}");
}

#[test]
fn schedule_prints_the_timeline() {
    let o = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["schedule", "--pipeline-model-parallel-size", "2", "--num-micro-batches", "3"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "stage 0: F0 F1 B0 F2 B1 B2\nstage 1: F0 B0 F1 B1 F2 B2\n");
    let o = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["schedule", "--pipeline-model-parallel-size", "2", "--num-micro-batches", "3", "--virtual-stages", "2"])
        .output()
        .unwrap();
    assert!(
        !o.status.success() && stderr(&o).contains("multiple of --pipeline-model-parallel-size 2"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn layouts_that_do_not_fit_are_named() {
    let mut bad = vec!["--nproc", "3", "--tensor-model-parallel-size", "2"];
    let o = run(&bad);
    assert!(!o.status.success() && stderr(&o).contains("--tensor-model-parallel-size 2"), "{}", stderr(&o));
    bad = vec!["--nproc", "4", "--tensor-model-parallel-size", "4", "--num-query-groups", "2"];
    let o = run(&bad);
    assert!(
        stderr(&o).contains("--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
        "{}",
        stderr(&o)
    );
    let o = run(&["--nproc", "2", "--global-batch-size", "8", "--micro-batch-size", "8"]);
    assert!(stderr(&o).contains("data-parallel size 2"), "{}", stderr(&o));
    // Pipelines: layers that do not divide, interleaving without enough micro-batches, virtual
    // stages that do not divide.
    let o = run(&["--nproc", "4", "--pipeline-model-parallel-size", "4", "--num-layers", "6"]);
    assert!(stderr(&o).contains("6 layers do not divide evenly over 4 pipeline stages"), "{}", stderr(&o));
    let o = run(&[
        "--nproc",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers",
        "4",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--global-batch-size",
        "8",
    ]);
    assert!(stderr(&o).contains("multiple of --pipeline-model-parallel-size 2"), "{}", stderr(&o));
    let o =
        run(&["--nproc", "2", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"]);
    assert!(stderr(&o).contains("--num-layers-per-virtual-pipeline-stage 3 does not divide"), "{}", stderr(&o));
}

/// The loss printed on the training line that starts with `at` ("iteration 4/4"), as printed.
fn loss_line(o: &Output, at: &str) -> String {
    let e = stderr(o);
    let line = e.lines().rfind(|l| l.starts_with(&format!("{at}: loss "))).unwrap_or_else(|| panic!("{e}"));
    line.split_whitespace().nth(3).unwrap().to_string()
}

/// Megatron's scripts pass one folder as --save and --load: the first run finds nothing there
/// and starts from the initialisation (a warning says so), the next resumes from what it saved.
/// A run that needs a checkpoint (--exit-on-missing-checkpoint, --finetune) is refused instead,
/// and iteration folders without their tracker are named, not trained over.
#[test]
fn one_folder_for_save_and_load_starts_then_resumes() {
    let dir = tmp("cli-save-load");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let last_loss = |o: &Output| loss_line(o, "iteration 4/4");
    let straight = run(&["--train-iters", "4", "--eval-interval", "2"]);
    assert!(straight.status.success(), "{}", stderr(&straight));

    let first = run(&["--train-iters", "2", "--eval-interval", "2", "--save", d, "--load", d]);
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(stderr(&first).contains("no checkpoint there yet; starting from the initialisation"), "{}", stderr(&first));
    let second = run(&["--train-iters", "4", "--eval-interval", "2", "--save", d, "--load", d]);
    assert!(second.status.success(), "{}", stderr(&second));
    assert!(stderr(&second).contains("at iteration 2") && !stderr(&second).contains("no checkpoint"));
    assert_eq!(last_loss(&second), last_loss(&straight), "the resumed run is the straight run");

    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = empty.to_str().unwrap();
    fails_naming(&["--load", e, "--exit-on-missing-checkpoint"], "holds no checkpoint");
    fails_naming(&["--load", e, "--finetune"], "--finetune needs one");
    // Without --load, what it would take is moot (Megatron's Mixtral example passes --no-load-optim so).
    let o = run(&["--train-iters", "1", "--no-load-optim"]);
    assert!(o.status.success() && stderr(&o).contains("without --load they do nothing"), "{}", stderr(&o));
    std::fs::remove_file(dir.join("latest_checkpointed_iteration.txt")).unwrap();
    fails_naming(
        &["--train-iters", "6", "--save", d, "--load", d],
        "holds iter_0000002, iter_0000004 but no latest_checkpointed_iteration.txt: pass --ckpt-step N",
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Megatron's non-persistent checkpoints: between --save-interval's, every
/// --non-persistent-save-interval iterations into SAVE/non_persistent, which keeps the newest two
/// at most; a run that died after one loads it (it is newer than the last persistent one) and
/// goes on as the straight run does.
#[test]
fn non_persistent_checkpoints_resume_the_newest() {
    let dir = tmp("cli-non-persistent");
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let last = |o: &Output| loss_line(o, "iteration 6/6");
    let common = ["--train-iters", "6", "--eval-interval", "6", "--log-interval", "1"];
    let straight = run(&common);
    assert!(straight.status.success(), "{}", stderr(&straight));
    let np = ["--save", d, "--save-interval", "4", "--non-persistent-save-interval", "1"];
    let o = run(&[&common[..], &np].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let np_dir = dir.join("non_persistent");
    let mut kept: Vec<String> = std::fs::read_dir(&np_dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str().filter(|n| n.starts_with("iter_")).map(String::from))
        .collect();
    kept.sort();
    assert_eq!(kept, ["iter_0000003", "iter_0000005"], "the newest and the one before it");
    assert_eq!(std::fs::read_to_string(np_dir.join("latest_checkpointed_iteration.txt")).unwrap().trim(), "5");
    // The run as if it had died after iteration 5: the persistent tracker at 4.
    std::fs::remove_dir_all(dir.join("iter_0000006")).unwrap();
    std::fs::write(dir.join("latest_checkpointed_iteration.txt"), "4\n").unwrap();
    let resumed = run(&[&common[..], &["--load", d]].concat());
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert!(stderr(&resumed).contains("the non-persistent checkpoint of iteration 5"), "{}", stderr(&resumed));
    assert!(stderr(&resumed).contains("at iteration 5"), "{}", stderr(&resumed));
    assert_eq!(last(&resumed), last(&straight), "the resumed run is the straight run");
    // A persistent checkpoint newer than the non-persistent one wins.
    std::fs::write(dir.join("latest_checkpointed_iteration.txt"), "4\n").unwrap();
    std::fs::write(np_dir.join("latest_checkpointed_iteration.txt"), "3\n").unwrap();
    let o = run(&[&common[..], &["--load", d]].concat());
    assert!(
        o.status.success()
            && stderr(&o).contains("at iteration 4")
            && !stderr(&o).contains("the non-persistent checkpoint"),
        "{}",
        stderr(&o)
    );
    fails_naming(&["--non-persistent-save-interval", "2"], "add --save FOLDER");
    let same = ["--save", d, "--non-persistent-save-interval", "2", "--non-persistent-global-ckpt-dir", d];
    fails_naming(&same, "is the --save folder, whose older checkpoints it would delete");
    fails_naming(
        &["--save", d, "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local"],
        "use global",
    );
    let _ = std::fs::remove_dir_all(dir);
}

fn corrupt_first_byte(p: &Path) {
    let mut b = std::fs::read(p).unwrap();
    b[100] ^= 0xff;
    std::fs::write(p, b).unwrap();
}

#[test]
fn corrupt_checkpoint_is_an_error_and_failed_save_loses_nothing() {
    let dir = tmp("cli-corrupt");
    let d = dir.to_str().unwrap();
    let o = run(&["--train-iters", "2", "--eval-interval", "2", "--save", d]);
    assert!(o.status.success(), "{}", stderr(&o));

    // A save that fails midway (the tracker cannot be replaced) leaves iteration 2 as the latest.
    std::fs::create_dir_all(dir.join(".latest_checkpointed_iteration.txt.tmp/blocker")).unwrap();
    let o = run(&["--train-iters", "4", "--eval-interval", "2", "--save", d, "--load", d]);
    assert!(!o.status.success());
    assert_eq!(std::fs::read_to_string(dir.join("latest_checkpointed_iteration.txt")).unwrap().trim(), "2");
    // The same when the shards are written in the background: the run fails when the save
    // completes, not later, and iteration 2 stays the latest.
    let o = run(&["--train-iters", "4", "--eval-interval", "2", "--save", d, "--load", d, "--async-save"]);
    assert!(!o.status.success() && stderr(&o).contains("latest_checkpointed_iteration.txt.tmp"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(dir.join("latest_checkpointed_iteration.txt")).unwrap().trim(), "2");
    let resumed = run(&["--train-iters", "3", "--eval-interval", "3", "--load", d]);
    assert!(resumed.status.success(), "iteration 2 no longer loads: {}", stderr(&resumed));
    std::fs::remove_dir_all(dir.join(".latest_checkpointed_iteration.txt.tmp")).unwrap();

    // Flipped bytes in the tensor file: caught by the checksum, named as corrupt.
    corrupt_first_byte(&dir.join("iter_0000002/model_optim_rank00000.safetensors"));
    let o = Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(["generate", "--load", d]).output().unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("corrupt checkpoint"), "{}", stderr(&o));
    // A garbled tracker is named too.
    std::fs::write(dir.join("latest_checkpointed_iteration.txt"), "banana").unwrap();
    fails_naming(&["--load", d], "corrupt tracker");
    let _ = std::fs::remove_dir_all(dir);
}

/// `ferrotron preprocess --input INPUT --output-prefix PREFIX` with `extra`.
fn preprocess(input: &Path, prefix: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["preprocess", "--input", input.to_str().unwrap(), "--output-prefix", prefix.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn preprocess_writes_what_train_data_path_reads() {
    use ferrotron_data::{IndexedDataset, Tokenizer, TokenizerKind, corpus};
    let dir = tmp("cli-preprocess");
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("docs.jsonl");
    let docs = corpus::documents(7, 300);
    let mut lines: Vec<String> = docs.iter().map(|d| serde_json::json!({ "text": d, "id": 1 }).to_string()).collect();
    lines.insert(1, String::new()); // blank lines are skipped
    std::fs::write(&input, lines.join("\n")).unwrap();
    let prefix = dir.join("corpus");
    let o = preprocess(&input, &prefix, &["--tokenizer-type", "byte", "--append-eod", "--workers", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let written = dir.join("corpus_text_document");
    assert!(stderr(&o).contains("300 documents"), "{}", stderr(&o));
    let ds = IndexedDataset::open(&written).unwrap();
    let tok = Tokenizer::new(TokenizerKind::Byte).unwrap();
    let want: Vec<u32> = docs
        .iter()
        .flat_map(|d| {
            let mut t = tok.encode(d).unwrap();
            t.push(tok.eod());
            t
        })
        .collect();
    let mut got = vec![0; want.len()];
    ds.read(0, &mut got).unwrap();
    assert_eq!((ds.num_documents(), ds.num_tokens()), (300, want.len() as u64));
    assert_eq!(got, want);
    // train takes it.
    let o = run(&["--train-iters", "2", "--data-path", written.to_str().unwrap(), "--split", "9,1"]);
    assert!(o.status.success(), "{}", stderr(&o));

    // Megatron's --partitions 3 deals the lines out round-robin and joins the partitions in
    // order; with --keep-sequential-samples they are contiguous and the order is the input's.
    let encoded = |text: &str| -> Vec<u32> { [tok.encode(text).unwrap(), vec![tok.eod()]].concat() };
    let dealt: Vec<u32> = (0..3)
        .flat_map(|p| lines.iter().skip(p).step_by(3))
        .filter(|l| !l.is_empty())
        .flat_map(|l| encoded(serde_json::from_str::<serde_json::Value>(l).unwrap()["text"].as_str().unwrap()))
        .collect();
    for (extra, want) in [(&[][..], &dealt), (&["--keep-sequential-samples"][..], &got)] {
        let prefix = dir.join("parts");
        let o = preprocess(
            &input,
            &prefix,
            &[&["--tokenizer-type", "byte", "--append-eod", "--partitions", "3", "--log-interval", "100"], extra]
                .concat(),
        );
        assert!(o.status.success() && stderr(&o).contains("processed 300 documents"), "{}", stderr(&o));
        let ds = IndexedDataset::open(dir.join("parts_text_document")).unwrap();
        let mut parts = vec![0; want.len()];
        ds.read(0, &mut parts).unwrap();
        assert_eq!(ds.num_documents(), 300);
        assert!(parts == *want, "{extra:?}: not in Megatron's partition order");
    }
    assert_ne!(dealt, got, "the dealt order differs from the input's");
    let o = preprocess(&input, &prefix, &["--tokenizer-type", "byte", "--split-sentences"]);
    assert!(!o.status.success() && stderr(&o).contains("--split-sentences: sentence splitting"), "{}", stderr(&o));

    // A line that is not JSON is named, and no dataset appears.
    std::fs::write(&input, "{\"text\": \"a\"}\n{text: b}\n").unwrap();
    let bad = dir.join("bad");
    let o = preprocess(&input, &bad, &["--tokenizer-type", "byte"]);
    assert!(!o.status.success() && stderr(&o).contains("line 2 is not a JSON object"), "{}", stderr(&o));
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.iter().all(|n| !n.to_string_lossy().starts_with("bad")), "left behind: {left:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `merge-datasets` (tools/merge_datasets.py's flags): three shards of a corpus preprocessed
/// apart and merged (in the order of their names, an unrelated file beside them ignored, an
/// earlier merge's output in the folder not taken as an input) are byte for byte the corpus
/// preprocessed whole; a folder with a .bin but no .idx is refused by name.
#[test]
fn merge_datasets_joins_shards_as_one_preprocessing() {
    let dir = tmp("cli-merge");
    let shards = dir.join("shards");
    std::fs::create_dir_all(&shards).unwrap();
    let docs = ferrotron_data::corpus::documents(11, 90);
    let jsonl =
        |d: &[String]| d.iter().map(|t| serde_json::json!({ "text": t }).to_string() + "\n").collect::<String>();
    let byte_level = |input: &Path, prefix: &Path| {
        let o = preprocess(input, prefix, &["--tokenizer-type", "byte", "--append-eod"]);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    for (k, part) in docs.chunks(30).enumerate() {
        let input = dir.join(format!("part{k}.jsonl"));
        std::fs::write(&input, jsonl(part)).unwrap();
        byte_level(&input, &shards.join(format!("part{k}")));
    }
    std::fs::write(shards.join("README.txt"), "not a dataset").unwrap();
    let whole = dir.join("whole.jsonl");
    std::fs::write(&whole, jsonl(&docs)).unwrap();
    byte_level(&whole, &dir.join("whole"));
    let merge = |out: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .args(["merge-datasets", "--input", shards.to_str().unwrap(), "--output-prefix", out.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let out = shards.join("merged");
    for _ in 0..2 {
        // The second run finds the first's output among the shards and leaves it out.
        let o = merge(&out);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stderr(&o).contains("90 documents") && stderr(&o).contains("from 3 datasets"), "{}", stderr(&o));
        for ext in ["bin", "idx"] {
            let read = |p: std::path::PathBuf| std::fs::read(p).unwrap();
            assert_eq!(
                read(shards.join(format!("merged.{ext}"))),
                read(dir.join(format!("whole_text_document.{ext}")))
            );
        }
    }
    std::fs::remove_file(shards.join("part1_text_document.idx")).unwrap();
    let o = merge(&dir.join("again"));
    assert!(!o.status.success() && stderr(&o).contains("part1_text_document.idx is missing"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(dir);
}

/// Megatron's TikTokenizer through the command line: preprocess writes the fixture vocabulary's
/// ids (each document ended by `</s>`, id 2), train reads them with the same flags, the
/// checkpoint keeps the tokenizer's flags (--use-checkpoint-args and resume rebuild it), and a
/// flag that belongs to it is refused with another tokenizer.
#[test]
fn tiktokenizer_preprocesses_trains_and_resumes() {
    use ferrotron_data::{IndexedDataset, Tokenizer, TokenizerFlags, TokenizerKind, corpus};
    let vocab = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tests/fixtures/tiktoken/vocab.json");
    let entries = serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&vocab).unwrap()).unwrap();
    let size = (10 + entries.as_array().unwrap().len()).to_string();
    let v = vocab.to_str().unwrap();
    let tik = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", v, "--tiktoken-pattern", "v2"];
    let tik = [&tik[..], &["--tiktoken-num-special-tokens", "10", "--vocab-size", &size]].concat();
    let dir = tmp("cli-tiktoken");
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("docs.jsonl");
    let docs = corpus::documents(3, 200);
    let lines: Vec<String> = docs.iter().map(|d| serde_json::json!({ "text": d }).to_string()).collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let prefix = dir.join("tik");
    let o = preprocess(&input, &prefix, &[&tik[..], &["--append-eod"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let flags = TokenizerFlags {
        vocab_size: Some(size.parse().unwrap()),
        model: Some(&vocab),
        tiktoken_pattern: Some("v2"),
        tiktoken_num_special_tokens: Some(10),
        tiktoken_special_tokens: None,
    };
    let tok = Tokenizer::new(TokenizerKind::from_flags("TikTokenizer", &flags).unwrap()).unwrap();
    let mut want = tok.encode(&docs[0]).unwrap();
    want.push(2);
    let ds = IndexedDataset::open(dir.join("tik_text_document")).unwrap();
    let mut got = vec![0u32; ds.sequence_length(0) as usize];
    ds.read(ds.sequence_start(0), &mut got).unwrap();
    assert_eq!(got, want);
    let data = dir.join("tik_text_document");
    let save = dir.join("ckpt");
    let (d, s) = (data.to_str().unwrap(), save.to_str().unwrap());
    let o = run(&[&tik[..], &["--train-iters", "2", "--data-path", d, "--split", "9,1", "--save", s]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    // Resumed without the tokenizer flags: the checkpoint's are taken with the model's.
    let o = run(&["--train-iters", "3", "--data-path", d, "--split", "9,1", "--load", s, "--use-checkpoint-args"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("iteration 3/"), "{}", stderr(&o));
    // Megatron's mock-data scripts pass --tiktoken-pattern with other tokenizers: ignored, named.
    let o = run(&["--train-iters", "1", "--tiktoken-pattern", "v2", "--tiktoken-num-special-tokens", "10"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = "--tokenizer-type byte does not read --tiktoken-pattern, --tiktoken-num-special-tokens: ignored";
    assert!(stderr(&o).contains(want), "{}", stderr(&o));
    fails_naming(&["--tokenizer-type", "TikTokenizer", "--tokenizer-model", v], "--tiktoken-pattern v1 or v2");
    let _ = std::fs::remove_dir_all(dir);
}

/// Megatron's Llama2Tokenizer on a SentencePiece model: preprocessing writes BOS, the pieces and
/// EOS per document (what Megatron's preprocess_data.py writes with --append-eod), training reads
/// them with the model's vocabulary (a --vocab-size beside it is ignored, as there), and a resume
/// takes the tokenizer from the checkpoint.
#[test]
fn llama2_tokenizer_preprocesses_trains_and_resumes() {
    use ferrotron_data::{IndexedDataset, Tokenizer, TokenizerKind, corpus};
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tests/fixtures/sentencepiece/llama_bpe.model");
    let m = model.to_str().unwrap();
    let spm = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", m];
    let dir = tmp("cli-llama2-tokenizer");
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("docs.jsonl");
    let docs = corpus::documents(5, 200);
    let lines: Vec<String> = docs.iter().map(|d| serde_json::json!({ "text": d }).to_string()).collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let prefix = dir.join("spm");
    let o = preprocess(&input, &prefix, &[&spm[..], &["--append-eod", "--vocab-size", "128256"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("does not read --vocab-size"), "{}", stderr(&o));
    let tok = Tokenizer::new(TokenizerKind::parse_with("Llama2Tokenizer", None, Some(&model)).unwrap()).unwrap();
    let ds = IndexedDataset::open(dir.join("spm_text_document")).unwrap();
    for (i, doc) in docs.iter().enumerate().take(3) {
        let mut got = vec![0u32; ds.sequence_length(i) as usize];
        ds.read(ds.sequence_start(i), &mut got).unwrap();
        let mut want = tok.encode(doc).unwrap();
        want.push(tok.eod());
        assert_eq!((got[0], got.last()), (1, Some(&2)), "BOS first, EOS last");
        assert_eq!(got, want);
    }
    let data = dir.join("spm_text_document");
    let save = dir.join("ckpt");
    let (d, s) = (data.to_str().unwrap(), save.to_str().unwrap());
    let o = run(&[
        &spm[..],
        &["--vocab-size", "128256", "--train-iters", "2", "--data-path", d, "--split", "9,1", "--save", s],
    ]
    .concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("does not read --vocab-size (the vocabulary is the file's)"), "{}", stderr(&o));
    let o = run(&["--train-iters", "3", "--data-path", d, "--split", "9,1", "--load", s, "--use-checkpoint-args"]);
    assert!(o.status.success() && stderr(&o).contains("iteration 3/"), "{}", stderr(&o));
    let state = std::fs::read_to_string(save.join("iter_0000002/state.toml")).unwrap();
    assert!(state.contains("tokenizer-type = \"Llama2Tokenizer\""), "{state}");
    fails_naming(&["--tokenizer-type", "Llama2Tokenizer"], "Llama2Tokenizer needs --tokenizer-model FILE.model");
    let _ = std::fs::remove_dir_all(dir);
}

/// Megatron's --exit-duration-in-mins and --exit-signal-handler: the run saves and stops after
/// the iteration in which its time ran out, or in which it got SIGTERM (as a scheduler sends
/// before preempting a job); the checkpoint is that iteration's.
#[test]
fn a_run_stops_and_saves_when_its_time_is_up_or_on_sigterm() {
    use std::io::BufRead;
    let dir = tmp("cli-exit-duration");
    let d = dir.to_str().unwrap();
    let o = run(&["--train-iters", "50", "--save", d, "--exit-duration-in-mins", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("exiting at iteration 1 (--exit-duration-in-mins)"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(dir.join("latest_checkpointed_iteration.txt")).unwrap().trim(), "1");
    let _ = std::fs::remove_dir_all(&dir);

    let dir = tmp("cli-exit-signal");
    let d = dir.to_str().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(TINY)
        .args(["--train-iters", "100000", "--log-interval", "1", "--save", d, "--exit-signal-handler"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen += &line;
        seen.push('\n');
        if line.starts_with("iteration 2/") {
            break;
        }
    }
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    seen.extend(lines.map(|l| l.unwrap() + "\n"));
    let status = child.wait().unwrap();
    assert!(status.success(), "{seen}");
    let at = seen.lines().find_map(|l| l.strip_prefix("exiting at iteration ")).unwrap_or_else(|| panic!("{seen}"));
    assert!(at.ends_with("(SIGTERM, --exit-signal-handler)"), "{at}");
    let iteration: u64 = at.split(' ').next().unwrap().parse().unwrap();
    assert!(iteration >= 2, "{at}");
    let saved = std::fs::read_to_string(dir.join("latest_checkpointed_iteration.txt")).unwrap();
    assert_eq!(saved.trim().parse::<u64>().unwrap(), iteration);
    let _ = std::fs::remove_dir_all(dir);
}
