//! `--log-progress`: Megatron's progress.txt in the --save folder, for following a run across
//! many jobs. One line per event, written by rank 0, in Megatron's format (tab-separated):
//!
//!   `{local time %Y-%m-%d %H:%M:%S}\tJob ID: {SLURM_JOB_ID}\t# GPUs: {world size}\t{event}`
//!
//! Events: `Starting job` when a run starts; at each checkpoint `Saved checkpoint` (under
//! --async-save `Saving async checkpoint` when the save is handed to the background, then `Saved
//! async checkpoint\tIteration: N` when it is committed) with `Iteration`, this job's throughput
//! (model FLOPs since it started over its wall time and GPUs), the cumulative throughput (since
//! the first `Starting job` of the latest stretch of jobs at this world size, from the FLOPs the
//! last committed checkpoint before it had), the model FLOPs so far (kept in each checkpoint, so
//! they go on across jobs) and the tokens so far in billions. Numbers as Python prints them
//! (`1.23e+15`), so Megatron's own reader of the file reads ours.

use anyhow::Context;
use chrono::{Local, NaiveDateTime};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

const FILE: &str = "progress.txt";
const TIME: &str = "%Y-%m-%d %H:%M:%S";

pub struct ProgressLog {
    path: PathBuf,
    world: usize,
    /// The model FLOPs done before this job (from the checkpoint it resumed).
    flops_at_start: f64,
    started: Instant,
}

impl ProgressLog {
    /// Appends `Starting job` to `save`/progress.txt (creating the folder and file).
    pub fn start(save: &Path, world: usize, flops_so_far: f64) -> anyhow::Result<Self> {
        std::fs::create_dir_all(save).with_context(|| format!("--log-progress: cannot create {}", save.display()))?;
        let log = ProgressLog { path: save.join(FILE), world, flops_at_start: flops_so_far, started: Instant::now() };
        log.append("Starting job")?;
        Ok(log)
    }

    /// A checkpoint of `iteration` saved (`committed`: written; otherwise handed to the
    /// background writer) with `flops` model FLOPs and `tokens` trained tokens so far.
    pub fn saved(&self, iteration: u64, flops: f64, tokens: u64, committed: bool) -> anyhow::Result<()> {
        let per_gpu = |flops: f64, secs: f64| flops / (secs.max(1e-9) * 1e12 * self.world as f64);
        let job = per_gpu(flops - self.flops_at_start, self.started.elapsed().as_secs_f64());
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        let cumulative = match cumulative_start(&text, self.world) {
            Some((since, flops_then)) => {
                let secs = (Local::now().naive_local() - since).as_seconds_f64();
                per_gpu(flops - flops_then, secs)
            }
            None => job,
        };
        let what = if committed { "Saved checkpoint" } else { "Saving async checkpoint" };
        self.append(&format!(
            "{what}\tIteration: {iteration}\tJob throughput: {job:.1} TFLOP/s/GPU\tCumulative throughput: {cumulative:.1} TFLOP/s/GPU\tFloating-point operations: {}\tTokens (in billions): {:.2}",
            python_exp(flops),
            tokens as f64 / 1e9
        ))
    }

    /// An asynchronous save of `iteration` committed.
    pub fn committed(&self, iteration: u64) -> anyhow::Result<()> {
        self.append(&format!("Saved async checkpoint\tIteration: {iteration}"))
    }

    fn append(&self, event: &str) -> anyhow::Result<()> {
        let job = std::env::var("SLURM_JOB_ID").unwrap_or_default();
        let line = format!("{}\tJob ID: {job}\t# GPUs: {}\t{event}\n", Local::now().format(TIME), self.world);
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("--log-progress: cannot open {}", self.path.display()))?;
        f.write_all(line.as_bytes()).with_context(|| format!("--log-progress: cannot write {}", self.path.display()))
    }
}

/// Megatron's reading of progress.txt: the time of the first `Starting job` line since the world
/// size last changed, and the FLOPs of the last committed checkpoint before that line (an async
/// save counts once its `Saved async checkpoint` line follows). Lines it cannot read are passed.
pub fn cumulative_start(text: &str, world: usize) -> Option<(NaiveDateTime, f64)> {
    let field = |s: &str| s.split_once(": ").map(|(_, v)| v.to_string());
    let (mut start, mut latest, mut uncommitted) = (None, 0.0, None);
    for line in text.lines() {
        let t: Vec<&str> = line.trim().split('\t').collect();
        let Some(size) = t.get(2).and_then(|s| field(s)).and_then(|v| v.parse::<usize>().ok()) else { continue };
        let event = t.get(3).copied().unwrap_or("");
        let flops = || t.get(7).and_then(|s| field(s)).and_then(|v| v.parse::<f64>().ok());
        match event {
            "Saved checkpoint" => latest = flops().unwrap_or(latest),
            "Saving async checkpoint" => uncommitted = flops(),
            "Saved async checkpoint" => latest = uncommitted.take().unwrap_or(latest),
            _ => {}
        }
        if size != world {
            start = None;
            continue;
        }
        if event == "Starting job" && start.is_none() {
            start = NaiveDateTime::parse_from_str(t[0], TIME).ok().map(|time| (time, latest));
        }
    }
    start
}

/// `x` as Python's `f"{x:.2e}"` writes it: two decimals, a signed exponent of two digits or more.
pub fn python_exp(x: f64) -> String {
    let s = format!("{x:.2e}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let e: i32 = exp.parse().unwrap_or(0);
            format!("{mantissa}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
        }
        None => s, // inf, NaN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_as_python_does() {
        assert_eq!(python_exp(1.234e15), "1.23e+15");
        assert_eq!(python_exp(0.0), "0.00e+00");
        assert_eq!(python_exp(5e-7), "5.00e-07");
        assert_eq!(python_exp(1e100), "1.00e+100");
    }

    /// Megatron's rules: the start restarts where the world size changes, keeps the first
    /// `Starting job` after, and takes the FLOPs of the last committed save before it (an async
    /// save only once committed).
    #[test]
    fn the_cumulative_start_follows_megatrons_reading() {
        let line = |t: &str, gpus: usize, event: &str| format!("2026-12-0{t}\tJob ID: 7\t# GPUs: {gpus}\t{event}\n");
        let saved = |it: u64, flops: f64, what: &str| {
            format!(
                "{what}\tIteration: {it}\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: {}\tTokens (in billions): 0.01",
                python_exp(flops)
            )
        };
        let mut text = String::new();
        text += &line("1 00:00:00", 8, "Starting job");
        text += &line("1 01:00:00", 8, &saved(10, 1e15, "Saved checkpoint"));
        text += &line("2 00:00:00", 16, "Starting job");
        text += &line("2 01:00:00", 16, &saved(20, 3e15, "Saving async checkpoint"));
        text += &line("2 01:00:05", 16, "Saved async checkpoint\tIteration: 20");
        text += &line("3 00:00:00", 16, "Starting job");
        text += &line("3 01:00:00", 16, &saved(30, 5e15, "Saving async checkpoint"));
        let at = |d: &str| NaiveDateTime::parse_from_str(&format!("2026-12-0{d}"), TIME).unwrap();
        // At 16 GPUs: from the job that began on the 2nd, with the FLOPs of the save before it.
        assert_eq!(cumulative_start(&text, 16), Some((at("2 00:00:00"), 1e15)));
        // A job at 8 GPUs now: no start at this size since the last change.
        assert_eq!(cumulative_start(&text, 8), None);
        text += &line("4 00:00:00", 8, "Starting job");
        // The async save of iteration 30 was never committed: the FLOPs are iteration 20's.
        assert_eq!(cumulative_start(&text, 8), Some((at("4 00:00:00"), 3e15)));
        // A line not in the format is passed over.
        assert_eq!(cumulative_start(&format!("garbage\n{text}"), 8), Some((at("4 00:00:00"), 3e15)));
    }
}
