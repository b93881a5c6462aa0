//! `ferrotron generate`: sample text from a checkpoint (temperature, top-k), seeded.

use crate::checkpoint;
use anyhow::bail;
use ferrotron_core::{Cx, DType, Device, Tensor, rng::Philox};
use ferrotron_data::Tokenizer;
use ferrotron_transformer::GptModel;
use std::path::Path;

pub struct GenerateArgs<'a> {
    pub load: &'a Path,
    pub prompt: &'a str,
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub seed: u64,
}

/// Prompt followed by the sampled continuation.
pub fn generate(a: &GenerateArgs) -> anyhow::Result<String> {
    if a.temperature.is_nan() || a.temperature < 0.0 {
        bail!("--temperature {} must be >= 0", a.temperature);
    }
    crate::settings::check_dir(a.load, "--load")?;
    let ck = checkpoint::open(a.load, false)?;
    let s = &ck.state().settings;
    let dtype = if s.bf16 { DType::BF16 } else { DType::F32 };
    let config = s.model_config()?;
    // The MoE layers' expert biases steer their routing: the checkpoint's, not zeros.
    let biases = ferrotron_models::moe_spec(&config)
        .filter(|m| m.router.expert_bias_update_rate.is_some())
        .map(|m| m.biases.clone());
    let (model, table) = GptModel::build(config, &Device::Cpu, dtype, s.seed)?;
    checkpoint::restore_params(ck.as_ref(), &table)?;
    if let Some(b) = biases {
        checkpoint::restore_biases(ck.as_ref(), &b.layers(), false)?;
    }
    let tok = Tokenizer::new(s.tokenizer()?)?;
    let mut ids = tok.encode(a.prompt)?;
    if ids.is_empty() {
        ids.push(tok.eod());
    }
    let vocab = tok.vocab_size();
    let cx = Cx::new(&table, false);
    let rng = Philox::new(a.seed).with_stream(0x67656e);
    for step in 0..a.max_new_tokens {
        let ctx = &ids[ids.len().saturating_sub(s.seq_length)..];
        let t = ctx.len();
        let logits = model.logits(&cx, &Tensor::from_vec(ctx.to_vec(), [1, t], &Device::Cpu)?)?.to_vec_f32()?;
        let row = &logits[(t - 1) * model.config.padded_vocab_size(1)..][..vocab];
        let next = sample(row, a.temperature, a.top_k, &rng, step as u64);
        if next == tok.eod() {
            break;
        }
        ids.push(next);
    }
    Ok(tok.decode(&ids)?)
}

/// Greedy at temperature 0; otherwise softmax(logits / T) over the top-k (all when k = 0).
fn sample(logits: &[f32], temperature: f32, top_k: usize, rng: &Philox, step: u64) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if temperature == 0.0 {
        return order[0] as u32;
    }
    let k = if top_k == 0 { order.len() } else { top_k.min(order.len()) };
    let max = logits[order[0]];
    let w: Vec<f64> = order[..k].iter().map(|&i| (((logits[i] - max) / temperature) as f64).exp()).collect();
    let total: f64 = w.iter().sum();
    let mut u = [0f32];
    rng.fill_uniform(step, &mut u);
    let mut target = u[0] as f64 * total;
    for (j, wj) in w.iter().enumerate() {
        if target < *wj {
            return order[j] as u32;
        }
        target -= wj;
    }
    order[k - 1] as u32
}
