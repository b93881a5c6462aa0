//! `ferrotron merge-datasets`: every PREFIX.bin / PREFIX.idx pair of a folder into one indexed
//! dataset, with the flags of Megatron's `tools/merge_datasets.py` (`--input DIR
//! --output-prefix PREFIX`): the pairs in the order of their names, each one's documents after
//! the last's, tokens copied as they are. Preprocess shards of a corpus in parallel, then merge.
//! The output appears only once whole (`IndexedBuilder`).

use anyhow::{Context, bail};
use ferrotron_data::{IndexedBuilder, IndexedDataset};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Clone, Debug)]
pub struct MergeArgs {
    /// A folder of PREFIX.bin / PREFIX.idx pairs (other files are left alone).
    #[arg(long)]
    pub input: PathBuf,
    /// The merged dataset: OUTPUT_PREFIX.bin and .idx.
    #[arg(long)]
    pub output_prefix: PathBuf,
    /// Refused: merging multimodal indexes (a mode byte per sequence) is not built.
    #[arg(long)]
    pub multimodal: bool,
}

/// What `merge` wrote.
pub struct Merged {
    pub inputs: Vec<PathBuf>,
    pub documents: usize,
    pub tokens: u64,
}

pub fn merge(a: &MergeArgs) -> anyhow::Result<Merged> {
    if a.multimodal {
        bail!("--multimodal: merging multimodal indexed datasets (a mode byte per sequence) is not built");
    }
    let entries = std::fs::read_dir(&a.input).with_context(|| format!("--input {}", a.input.display()))?;
    let mut prefixes = BTreeSet::new();
    for e in entries {
        let path = e.with_context(|| format!("--input {}", a.input.display()))?.path();
        let ext = path.extension().and_then(|x| x.to_str());
        if path.is_file() && matches!(ext, Some("bin" | "idx")) {
            prefixes.insert(path.with_extension(""));
        }
    }
    // PREFIX + ".bin" (a prefix may hold dots of its own).
    let file = |p: &Path, ext: &str| PathBuf::from(format!("{}.{ext}", p.display()));
    let out_bin = file(&a.output_prefix, "bin").canonicalize().ok();
    let mut inputs = Vec::new();
    for p in prefixes {
        for ext in ["bin", "idx"] {
            if !file(&p, ext).is_file() {
                bail!("{} is missing: every input needs its .bin and its .idx", file(&p, ext).display());
            }
        }
        // An earlier merge's output in the same folder is not an input to this one.
        if out_bin.is_some() && file(&p, "bin").canonicalize().ok() == out_bin {
            continue;
        }
        inputs.push(p);
    }
    let Some(first) = inputs.first() else {
        bail!("--input {}: no .bin / .idx pair to merge", a.input.display());
    };
    let dtype = IndexedDataset::open(first)?.dtype();
    let mut b = IndexedBuilder::create(&a.output_prefix, dtype)?;
    let mut tokens = 0;
    for p in &inputs {
        let ds = IndexedDataset::open(p)?;
        tokens += ds.num_tokens();
        b.add_dataset(&ds)?;
    }
    let documents = b.num_documents();
    b.finish()?;
    Ok(Merged { inputs, documents, tokens })
}
