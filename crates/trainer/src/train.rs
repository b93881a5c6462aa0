//! The training loop: gradient accumulation over micro-batches, AdamW step, logging, evaluation,
//! checkpointing and resume.

use crate::checkpoint;
use crate::settings::{Paths, Settings};
use anyhow::Context;
use ferrotron_core::{Cx, DType, Device, ParamTable, Tensor};
use ferrotron_data::{Sampler, TokenSplit, Tokenizer, corpus, split_documents};
use ferrotron_optim::{AdamConfig, LrSchedule, Optimizer};
use ferrotron_transformer::{Batch, GptModel};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::io::Write;
use std::time::Instant;

/// One line of metrics.jsonl.
#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Metric {
    Train {
        iteration: u64,
        loss: f64,
        lr: f64,
        grad_norm: f64,
        tokens_per_s: f64,
        elapsed_s: f64,
        consumed_samples: u64,
    },
    Eval {
        iteration: u64,
        loss: f64,
    },
}

/// What a run reports when it ends.
#[derive(Debug, Clone)]
pub struct Summary {
    /// (iteration, training loss) for every iteration run.
    pub losses: Vec<(u64, f64)>,
    /// (iteration, validation loss), including iteration 0 for a fresh run.
    pub evals: Vec<(u64, f64)>,
    pub checkpoints: Vec<std::path::PathBuf>,
}

/// The data the run trains and evaluates on.
pub struct Data {
    pub tokenizer: Tokenizer,
    pub train: TokenSplit,
    pub valid: TokenSplit,
}

impl Data {
    pub fn build(s: &Settings) -> anyhow::Result<Data> {
        let tokenizer = Tokenizer::new(s.tokenizer()?)?;
        let docs = corpus::documents(s.seed, s.corpus_docs);
        let (train, valid) = split_documents(&docs, &tokenizer, 0.05);
        train.check(s.seq_length)?;
        valid.check(s.seq_length)?;
        Ok(Data { tokenizer, train, valid })
    }
}

fn batch(split: &TokenSplit, indices: &[usize], seq: usize, dev: &Device) -> anyhow::Result<Batch> {
    let (mut tokens, mut labels) = (Vec::with_capacity(indices.len() * seq), Vec::with_capacity(indices.len() * seq));
    for &i in indices {
        let s = split.sample(i, seq);
        tokens.extend_from_slice(&s[..seq]);
        labels.extend_from_slice(&s[1..]);
    }
    let b = indices.len();
    Ok(Batch {
        tokens: Tensor::from_vec(tokens, [b, seq], dev)?,
        labels: Tensor::from_vec(labels, [b, seq], dev)?,
        loss_mask: Tensor::from_vec(vec![1f32; b * seq], [b, seq], dev)?,
    })
}

/// Mean validation loss over `eval_iters` micro-batches taken in order from the start of the split.
pub fn evaluate(model: &GptModel, table: &ParamTable, data: &Data, s: &Settings) -> anyhow::Result<f64> {
    let dev = table.flat_params().device().clone();
    let n = data.valid.num_samples(s.seq_length);
    let cx = Cx { params: table, training: false };
    let mut total = 0.0;
    for it in 0..s.eval_iters as usize {
        let idx: Vec<usize> = (0..s.micro_batch_size).map(|j| (it * s.micro_batch_size + j) % n).collect();
        total += model.forward(&cx, &batch(&data.valid, &idx, s.seq_length, &dev)?)?.0;
    }
    Ok(total / s.eval_iters as f64)
}

struct Metrics(Option<std::fs::File>);

impl Metrics {
    fn write(&mut self, m: &Metric) -> anyhow::Result<()> {
        if let Some(f) = &mut self.0 {
            writeln!(f, "{}", serde_json::to_string(m)?)?;
        }
        Ok(())
    }
}

fn progress(total: u64, start: u64, show: bool) -> ProgressBar {
    let pb = if show { ProgressBar::new(total) } else { ProgressBar::hidden() };
    pb.set_style(
        ProgressStyle::with_template("{bar:30} it {pos}/{len} | {msg} | ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_position(start);
    pb
}

/// Trains on `paths.device` from `settings`, resuming from `paths.load` when set.
pub fn train(s: &Settings, paths: &Paths) -> anyhow::Result<Summary> {
    let data = Data::build(s)?;
    let dtype = if s.bf16 { DType::BF16 } else { DType::F32 };
    let dev = paths.device.clone();
    let (model, table) = GptModel::build(s.model_config()?, &dev, dtype, s.seed)?;
    let mut opt = Optimizer::new(
        &table,
        AdamConfig {
            beta1: s.adam_beta1,
            beta2: s.adam_beta2,
            eps: 1e-8,
            weight_decay: s.weight_decay,
            clip_grad: s.clip_grad,
        },
    )?;
    let sched = LrSchedule {
        lr: s.lr,
        min_lr: s.min_lr,
        warmup_iters: s.lr_warmup_iters,
        decay_iters: s.train_iters,
        style: s.decay_style()?,
    };
    let (mut iteration, mut consumed) = (0u64, 0u64);
    if let Some(dir) = &paths.load {
        let ck = checkpoint::load(dir)?;
        checkpoint::check_matches(&ck.state, &table)?;
        table.flat_params().copy_from_f32(&ck.params)?;
        opt.load_state(&ck.master, &ck.exp_avg, &ck.exp_avg_sq, ck.state.optimizer_step)?;
        (iteration, consumed) = (ck.state.iteration, ck.state.consumed_samples);
        eprintln!("resumed from {} at iteration {iteration}", dir.display());
    }
    let mut metrics = Metrics(match &paths.save {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("--save {}: cannot create the folder", d.display()))?;
            Some(std::fs::OpenOptions::new().create(true).append(true).open(d.join("metrics.jsonl"))?)
        }
        None => None,
    });
    let mut summary = Summary { losses: vec![], evals: vec![], checkpoints: vec![] };
    eprintln!(
        "{dev}: {} parameters ({:.2} MFLOP/token), {} layers, hidden {}, {} heads; data: {} train / {} valid tokens; {} micro-batches of {} per step",
        table.numel(),
        model.config.flops_per_token() / 1e6,
        s.num_layers,
        s.hidden_size,
        s.num_attention_heads,
        data.train.tokens.len(),
        data.valid.tokens.len(),
        s.num_micro_batches(),
        s.micro_batch_size
    );
    if iteration == 0 {
        let l = evaluate(&model, &table, &data, s)?;
        eprintln!("iteration 0: validation loss {l:.4}");
        metrics.write(&Metric::Eval { iteration: 0, loss: l })?;
        summary.evals.push((0, l));
    }
    let mut sampler = Sampler::new(data.train.num_samples(s.seq_length), s.seed);
    let pb = progress(s.train_iters, iteration, paths.progress);
    let start = Instant::now();
    let tokens_per_step = (s.global_batch_size * s.seq_length) as f64;
    let mut window = (Instant::now(), 0u64);
    while iteration < s.train_iters {
        iteration += 1;
        table.zero_grads()?;
        let cx = Cx { params: &table, training: true };
        let mut loss = 0.0;
        let micro = s.num_micro_batches();
        for _ in 0..micro {
            let idx: Vec<usize> = (0..s.micro_batch_size as u64).map(|j| sampler.index(consumed + j)).collect();
            consumed += s.micro_batch_size as u64;
            let (l, saved) = model.forward(&cx, &batch(&data.train, &idx, s.seq_length, &dev)?)?;
            model.backward(&cx, saved, 1.0 / micro as f32)?;
            loss += l / micro as f64;
        }
        let lr = sched.lr_at(iteration);
        let stats = opt.step(&table, lr as f32)?;
        summary.losses.push((iteration, loss));
        window.1 += 1;
        if iteration % s.log_interval == 0 || iteration == s.train_iters {
            let secs = window.0.elapsed().as_secs_f64();
            let tps = tokens_per_step * window.1 as f64 / secs.max(1e-9);
            window.1 = 0;
            let m = Metric::Train {
                iteration,
                loss,
                lr,
                grad_norm: stats.grad_norm,
                tokens_per_s: tps,
                elapsed_s: start.elapsed().as_secs_f64(),
                consumed_samples: consumed,
            };
            metrics.write(&m)?;
            pb.set_message(format!("loss {loss:.4} | lr {lr:.2e} | {tps:.0} tok/s"));
            if pb.is_hidden() {
                eprintln!(
                    "iteration {iteration}/{}: loss {loss:.4} lr {lr:.3e} grad-norm {:.3} {tps:.0} tokens/s",
                    s.train_iters, stats.grad_norm
                );
            }
        }
        pb.set_position(iteration);
        if iteration % s.eval_interval == 0 || iteration == s.train_iters {
            let l = evaluate(&model, &table, &data, s)?;
            pb.suspend(|| eprintln!("iteration {iteration}: validation loss {l:.4}"));
            metrics.write(&Metric::Eval { iteration, loss: l })?;
            summary.evals.push((iteration, l));
        }
        let exit = paths.exit_interval.is_some_and(|e| iteration % e == 0);
        if let Some(dir) = &paths.save {
            if iteration % s.save_interval == 0 || iteration == s.train_iters || exit {
                let d = checkpoint::save(dir, &table, opt.state(), iteration, consumed, s)?;
                pb.suspend(|| eprintln!("saved {}", d.display()));
                summary.checkpoints.push(d);
            }
        }
        if exit {
            pb.suspend(|| eprintln!("exiting at iteration {iteration} (--exit-interval)"));
            break;
        }
        if window.1 == 0 {
            // A window of training steps starts after this iteration's logging, eval and save.
            window.0 = Instant::now();
        }
    }
    pb.finish_and_clear();
    Ok(summary)
}
