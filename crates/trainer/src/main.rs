//! `ferrotron`: train (`ferrotron train --preset tiny`), start ranks (`ferrotron launch
//! --nproc-per-node N -- train …`) and sample (`ferrotron generate --load DIR`).

use clap::{Parser, Subcommand};
use ferrotron_trainer::generate::{GenerateArgs, generate};
use ferrotron_trainer::settings::{Settings, TrainArgs};
use std::path::PathBuf;

// Training allocates and frees the same large activation buffers every step; glibc returns big
// blocks to the OS each time (page faults were ~10% of a CPU step), mimalloc keeps them.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "ferrotron", version, about = "Megatron-style LLM training in Rust", args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a model (Megatron flag names; see --help).
    Train(Box<TrainArgs>),
    /// Start one process per GPU on this node (torchrun-style): `launch --nproc-per-node 8 -- train …`.
    Launch(ferrotron_trainer::launch::LaunchArgs),
    /// Print a pipeline schedule's per-stage order of forward (F) and backward (B) passes.
    Schedule {
        #[arg(long)]
        pipeline_model_parallel_size: usize,
        /// Micro-batches per step on one data-parallel rank.
        #[arg(long)]
        num_micro_batches: usize,
        /// Model chunks per pipeline rank (interleaved 1F1B when more than 1).
        #[arg(long, default_value_t = 1)]
        virtual_stages: usize,
    },
    /// Sample text from a checkpoint.
    Generate {
        #[arg(long)]
        load: PathBuf,
        #[arg(long, default_value = "")]
        prompt: String,
        #[arg(long, default_value_t = 200)]
        max_new_tokens: usize,
        #[arg(long, default_value_t = 0.8)]
        temperature: f32,
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn run() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Train(args) => {
            let (settings, paths) = Settings::resolve(&args)?;
            let summary = ferrotron_trainer::train::train(&settings, &paths)?;
            if let (Some((_, first)), Some((it, last))) = (summary.evals.first(), summary.evals.last()) {
                eprintln!("done: validation loss {first:.4} -> {last:.4} at iteration {it}");
            }
            Ok(())
        }
        Cmd::Launch(a) => ferrotron_trainer::launch::launch(&a),
        Cmd::Schedule { pipeline_model_parallel_size: pp, num_micro_batches: m, virtual_stages: v } => {
            if pp == 0 || v == 0 {
                anyhow::bail!("--pipeline-model-parallel-size and --virtual-stages must be at least 1");
            }
            let kind = ferrotron_optim::schedule_kind(pp, v);
            print!("{}", ferrotron_parallel::pipeline::render(kind, pp, m)?);
            Ok(())
        }
        Cmd::Generate { load, prompt, max_new_tokens, temperature, top_k, seed } => {
            let text =
                generate(&GenerateArgs { load: &load, prompt: &prompt, max_new_tokens, temperature, top_k, seed })?;
            println!("{text}");
            Ok(())
        }
    }
}

fn main() {
    if let Err(e) = run() {
        // One line: the error and its causes, joined.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
