//! `ferrotron`: train (`ferrotron train --preset tiny`), start ranks (`ferrotron launch
//! --nproc-per-node N -- train …`), sample (`ferrotron generate --load DIR`) and convert Hugging
//! Face checkpoints (`ferrotron convert`).

use clap::{Parser, Subcommand};
use ferrotron_trainer::generate::{GenerateArgs, generate};
use ferrotron_trainer::settings::{Settings, TrainArgs};
use std::path::PathBuf;

// Training allocates and frees the same large activation buffers every step; glibc returns big
// blocks to the OS each time (page faults were ~10% of a CPU step), mimalloc keeps them.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

// Part of the mimalloc C library linked above (libmimalloc-sys's `extended` bindings name them
// but need a crate this workspace does not vendor).
unsafe extern "C" {
    fn mi_option_get(option: std::ffi::c_int) -> std::ffi::c_long;
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// mimalloc hands a free page back to the OS a second after its last use, and the next use
/// faults and clears it again (huge-page clearing was ≈ 5% of the tiny CPU step). A CPU training
/// run reuses the same buffers every step, so it keeps them: 40 tiny steps took 33–38k page
/// faults with purging and ≈ 390 without, task-clock −6–8% over three alternating runs. (A GPU
/// run's host memory, e.g. a large model's initialisation, is still returned.) Option 15 is
/// `mi_option_purge_delay` in the mimalloc v3 that libmimalloc-sys 0.1.49 builds; it is only
/// changed while it holds that option's default (1000 ms), i.e. where the number means it and
/// `MIMALLOC_PURGE_DELAY` has not set it.
fn keep_freed_pages() {
    const PURGE_DELAY: std::ffi::c_int = 15;
    // SAFETY: plain option reads and writes of the linked allocator; no memory is involved.
    unsafe {
        if mi_option_get(PURGE_DELAY) == 1000 {
            mi_option_set(PURGE_DELAY, -1);
        }
    }
}

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
    /// JSON lines into a Megatron indexed dataset (tools/preprocess_data.py's flags) for --data-path.
    Preprocess(ferrotron_trainer::preprocess::PreprocessArgs),
    /// A folder's indexed datasets into one (tools/merge_datasets.py's flags): `merge-datasets
    /// --input DIR --output-prefix PREFIX`.
    MergeDatasets(ferrotron_trainer::merge::MergeArgs),
    /// Hugging Face checkpoints to Ferrotron's and back, Megatron-LM's to Ferrotron's (convert.py's
    /// flags): `convert --loader hf|megatron --saver ferrotron --load-dir DIR --save-dir CKPT`.
    Convert(ferrotron_trainer::convert::ConvertArgs),
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
            if matches!(paths.device, ferrotron_core::Device::Cpu) {
                keep_freed_pages();
            }
            let summary = ferrotron_trainer::train::train(&settings, &paths)?;
            if let (true, Some((_, first)), Some((it, last))) =
                (summary.logs, summary.evals.first(), summary.evals.last())
            {
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
        Cmd::Preprocess(a) => {
            for w in ferrotron_trainer::preprocess::preprocess(&a)? {
                eprintln!("{}.bin/.idx: {} documents, {} tokens", w.prefix.display(), w.documents, w.tokens);
            }
            Ok(())
        }
        Cmd::MergeDatasets(a) => {
            let m = ferrotron_trainer::merge::merge(&a)?;
            eprintln!(
                "{}.bin/.idx: {} documents, {} tokens from {} datasets",
                a.output_prefix.display(),
                m.documents,
                m.tokens,
                m.inputs.len()
            );
            Ok(())
        }
        Cmd::Convert(a) => {
            let done = ferrotron_trainer::convert::convert(&a)?;
            eprintln!("{}: {} tensors of a {} written", done.dir.display(), done.tensors, done.what);
            if done.left_out > 0 {
                eprintln!(
                    "left out {} multi-token prediction tensors (mtp.*): a {} has no place for them",
                    done.left_out, done.what
                );
            }
            if a.saver == "ferrotron" {
                eprintln!(
                    "train on it: ferrotron train --load {} --finetune --use-checkpoint-args [data and training flags]",
                    a.save_dir.display()
                );
            } else if a.saver != "hf" {
                eprintln!(
                    "load it in Megatron-LM: --load {} --ckpt-format torch_dist with the model's flags (or --use-checkpoint-args); weights only, its optimizer starts afresh",
                    a.save_dir.display()
                );
                if let Err(why) = &done.tokenizer {
                    eprintln!("tokenizer: {why}");
                }
            } else {
                match &done.tokenizer {
                    Ok(files) => eprintln!("tokenizer files copied: {}", files.join(", ")),
                    Err(why) => eprintln!("no tokenizer files written: {why}"),
                }
            }
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

#[cfg(test)]
mod tests {
    /// Option 15 must still be mimalloc's purge delay (default 1000 ms) in the linked
    /// libmimalloc-sys: after an upgrade that renumbers the options, `keep_freed_pages` would
    /// quietly do nothing, and this fails instead.
    #[test]
    fn option_15_is_the_purge_delay() {
        // SAFETY: option reads of the linked allocator.
        let before = unsafe { super::mi_option_get(15) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(before, 1000, "option 15 no longer holds mimalloc's purge-delay default");
        }
        super::keep_freed_pages();
        let after = unsafe { super::mi_option_get(15) };
        assert_eq!(after, if before == 1000 { -1 } else { before });
    }
}
