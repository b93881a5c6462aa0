//! GPU timelines from Chrome traces: Ferrotron's `--profile-trace` file and PyTorch's profiler
//! trace (`export_chrome_trace`) read the same way, for `cargo xtask trace` and `bench
//! --gpu-trace`. Pure text in, text out, so it is tested here without a GPU.
//!
//! What it answers that `--gpu-profile` (ncu, each kernel alone at an idle card's clock) cannot:
//! how long a running step leaves the GPU idle between kernels, and what the kernels take at the
//! clock a loaded, power-capped card holds.
//!
//! Steps are told apart by the optimizer: a step ends where a run of AdamW kernels ends
//! (Ferrotron's `adamw_runs`, PyTorch's fused Adam), so the first step traced, whose start the
//! trace cuts, is left out and every figure is over whole steps.

use crate::profile::KernelTime;
use anyhow::{Context, bail};

/// One GPU activity (kernel, copy, memset): name and times in µs.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub name: String,
    pub start: f64,
    pub end: f64,
}

/// The GPU activities of a Chrome trace, in start order: events with `ph` "X" and a category
/// of Kineto's GPU ones ("kernel", "gpu_memcpy", "gpu_memset"); the rest (CPU ops, runtime calls,
/// annotations) is skipped.
pub fn spans(json: &str) -> anyhow::Result<Vec<Span>> {
    let v: serde_json::Value = serde_json::from_str(json).context("not a JSON trace")?;
    let events = v.get("traceEvents").and_then(|e| e.as_array()).context("no \"traceEvents\" array in the trace")?;
    let mut out = Vec::new();
    for e in events {
        let cat = e.get("cat").and_then(|c| c.as_str()).unwrap_or("");
        if e.get("ph").and_then(|p| p.as_str()) != Some("X") || !matches!(cat, "kernel" | "gpu_memcpy" | "gpu_memset") {
            continue;
        }
        let name = e.get("name").and_then(|n| n.as_str()).unwrap_or("?").to_string();
        let (Some(ts), Some(dur)) = (e.get("ts").and_then(num), e.get("dur").and_then(num)) else {
            bail!("GPU event {name:?} has no numeric ts/dur");
        };
        out.push(Span { name, start: ts, end: ts + dur });
    }
    out.sort_by(|a, b| a.start.total_cmp(&b.start));
    Ok(out)
}

/// A number, or a number written as a string (some Kineto versions quote large timestamps).
fn num(v: &serde_json::Value) -> Option<f64> {
    v.as_f64().or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// Whether a kernel is the optimizer's update (its last kernels in a step).
fn is_adam(name: &str) -> bool {
    name.contains("adamw_runs") || name.contains("FusedAdam") || name.contains("fused_adam")
}

/// Idle gaps are counted in these classes (µs): launch-sized, small, host-sized, long.
const GAP_CLASSES: [(f64, f64, &str); 4] =
    [(0.0, 2.0, "< 2 µs"), (2.0, 10.0, "2–10 µs"), (10.0, 100.0, "10–100 µs"), (100.0, f64::INFINITY, "≥ 100 µs")];

/// Whole steps of a timeline.
#[derive(Debug, Clone)]
pub struct Steps {
    /// Each whole step's (start, end) in µs: from the end of the step before's update to the end of its own.
    pub bounds: Vec<(f64, f64)>,
    /// The activities inside whole steps.
    pub spans: Vec<Span>,
    /// Busy time (the union of activities) per whole step, µs.
    pub busy: Vec<f64>,
    /// Idle gaps inside whole steps: (µs, the activity before, the one after).
    pub gaps: Vec<(f64, String, String)>,
}

/// Splits a timeline into whole steps (at least two updates needed: one to start the first
/// whole step, one to end it).
pub fn steps(all: &[Span]) -> anyhow::Result<Steps> {
    // Ends of runs of update kernels: an update kernel whose next activity is not one.
    let ends: Vec<f64> = all
        .iter()
        .enumerate()
        .filter(|(i, s)| is_adam(&s.name) && all.get(i + 1).is_none_or(|n| !is_adam(&n.name)))
        .map(|(_, s)| s.end)
        .collect();
    if ends.len() < 2 {
        bail!(
            "the trace holds {} optimizer update(s) (adamw_runs / FusedAdam): trace at least two steps to see one whole",
            ends.len()
        );
    }
    let bounds: Vec<(f64, f64)> = ends.windows(2).map(|w| (w[0], w[1])).collect();
    let (first, last) = (ends[0], ends[ends.len() - 1]);
    let spans: Vec<Span> = all.iter().filter(|s| s.start >= first && s.end <= last).cloned().collect();
    let mut busy = vec![0.0; bounds.len()];
    let mut gaps = Vec::new();
    let (mut k, mut reach, mut before) = (0usize, first, String::from("(step start)"));
    for s in &spans {
        while k + 1 < bounds.len() && s.start >= bounds[k].1 {
            k += 1;
        }
        if s.start > reach {
            gaps.push((s.start - reach, before.clone(), s.name.clone()));
        }
        // The part of this activity not already covered by earlier ones.
        let covered_from = s.start.max(reach);
        if s.end > covered_from {
            busy[k] += s.end - covered_from;
        }
        if s.end >= reach {
            reach = s.end;
            before = s.name.clone();
        }
    }
    Ok(Steps { bounds, spans, busy, gaps })
}

impl Steps {
    fn n(&self) -> f64 {
        self.bounds.len() as f64
    }
    /// Mean wall time per whole step, ms.
    pub fn wall_ms(&self) -> f64 {
        self.bounds.iter().map(|(a, b)| b - a).sum::<f64>() / self.n() / 1e3
    }
    /// Mean busy time per whole step, ms.
    pub fn busy_ms(&self) -> f64 {
        self.busy.iter().sum::<f64>() / self.n() / 1e3
    }
    /// Per gap class: (gaps per step, idle ms per step).
    pub fn gap_classes(&self) -> Vec<(&'static str, f64, f64)> {
        GAP_CLASSES
            .iter()
            .map(|&(lo, hi, label)| {
                let in_class = self.gaps.iter().filter(|g| g.0 >= lo && g.0 < hi);
                let (count, us) = in_class.fold((0usize, 0.0), |(c, t), g| (c + 1, t + g.0));
                (label, count as f64 / self.n(), us / self.n() / 1e3)
            })
            .collect()
    }
    /// Time and count per activity name over the whole steps (ms), for `profile::compare_table`.
    pub fn kernel_times(&self) -> Vec<KernelTime> {
        let mut by_name: Vec<KernelTime> = Vec::new();
        for s in &self.spans {
            let ms = (s.end - s.start) / 1e3;
            match by_name.iter_mut().find(|k| k.name == s.name) {
                Some(k) => {
                    k.ms += ms;
                    k.calls += 1;
                }
                None => by_name.push(KernelTime { name: s.name.clone(), ms, calls: 1 }),
            }
        }
        by_name.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        by_name
    }
}

/// The step table: wall, busy and idle time per whole step and the idle gaps by size, one column
/// per side (Ferrotron, then PyTorch where traced).
pub fn step_table(sides: &[(&str, &Steps)]) -> String {
    let mut s = String::from("\n| per whole step |");
    for (name, st) in sides {
        s.push_str(&format!(" {name} ({} steps) |", st.bounds.len()));
    }
    s.push_str(&format!("\n|---|{}\n", "---|".repeat(sides.len())));
    let row = |label: &str, f: &dyn Fn(&Steps) -> String| {
        let cells: String = sides.iter().map(|(_, st)| format!(" {} |", f(st))).collect();
        format!("| {label} |{cells}\n")
    };
    s.push_str(&row("GPU wall ms", &|st| format!("{:.2}", st.wall_ms())));
    s.push_str(&row("busy ms", &|st| format!("{:.2} ({:.1}%)", st.busy_ms(), 100.0 * st.busy_ms() / st.wall_ms())));
    s.push_str(&row("idle ms", &|st| format!("{:.2}", st.wall_ms() - st.busy_ms())));
    s.push_str(&row("activities", &|st| format!("{:.0}", st.spans.len() as f64 / st.n())));
    for (i, (_, _, label)) in GAP_CLASSES.iter().enumerate() {
        s.push_str(&row(&format!("idle gaps {label}: count, ms"), &|st| {
            let c = st.gap_classes()[i];
            format!("{:.1}, {:.3}", c.1, c.2)
        }));
    }
    s
}

/// The `top` longest idle gaps and the activities around them.
pub fn gap_table(side: &str, st: &Steps, top: usize) -> String {
    let mut g = st.gaps.clone();
    g.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut s = format!("\n{side}: longest idle gaps\n\n| µs | after | before |\n|---|---|---|\n");
    for (us, before, after) in g.iter().take(top) {
        let cut = |n: &str| n.chars().take(70).collect::<String>();
        s.push_str(&format!("| {us:.1} | {} | {} |\n", cut(before), cut(after)));
    }
    s
}

/// The `top` activities by GPU time per whole step: calls and µs a call beside the ms (names cut
/// to 90 characters), to see within a part of the step which kernel moved.
pub fn kernel_table(side: &str, st: &Steps, top: usize) -> String {
    let mut s = format!(
        "\n{side}: kernels by time per step\n\n| kernel | ms / step | calls / step | µs / call |\n|---|---|---|---|\n"
    );
    for k in st.kernel_times().iter().take(top) {
        let name: String = k.name.chars().take(90).collect();
        let (ms, calls) = (k.ms / st.n(), k.calls as f64 / st.n());
        s.push_str(&format!("| {name} | {ms:.3} | {calls:.1} | {:.1} |\n", 1e3 * ms / calls));
    }
    s
}

/// The `top` pairs of neighbouring activities (the one before an idle gap, the one after) with
/// the most idle time between them per step: where the gaps come from.
pub fn gap_pair_table(side: &str, st: &Steps, top: usize) -> String {
    let mut pairs: Vec<(String, String, usize, f64)> = Vec::new();
    for (us, before, after) in &st.gaps {
        let cut = |n: &str| n.chars().take(60).collect::<String>();
        let (b, a) = (cut(before), cut(after));
        match pairs.iter_mut().find(|p| p.0 == b && p.1 == a) {
            Some(p) => {
                p.2 += 1;
                p.3 += us;
            }
            None => pairs.push((b, a, 1, *us)),
        }
    }
    pairs.sort_by(|x, y| y.3.total_cmp(&x.3));
    let mut s = format!(
        "\n{side}: idle time by neighbours\n\n| after | before | gaps / step | µs / step |\n|---|---|---|---|\n"
    );
    for (b, a, n, us) in pairs.iter().take(top) {
        s.push_str(&format!("| {b} | {a} | {:.1} | {:.1} |\n", *n as f64 / st.n(), us / st.n()));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(name: &str, cat: &str, ts: f64, dur: f64) -> String {
        format!("{{\"name\":\"{name}\",\"cat\":\"{cat}\",\"ph\":\"X\",\"ts\":{ts},\"dur\":{dur},\"pid\":0,\"tid\":7}}")
    }

    /// Three updates, so two whole steps: [10, 40] and [40, 75].
    fn trace() -> String {
        let evs = [
            ev("gemm_a", "kernel", 0.0, 5.0),
            ev("adamw_runs_bf16", "kernel", 6.0, 4.0), // ends step 0 (cut) at 10
            ev("memcpy", "gpu_memcpy", 11.0, 1.0),     // gap 1
            ev("nvjet_fwd", "kernel", 12.5, 10.0),     // gap 0.5
            ev("flash_fwd", "kernel", 22.5, 5.0),
            ev("inner", "kernel", 23.0, 2.0), // inside flash_fwd (another stream): no busy time
            ev("layernorm", "kernel", 55.0, 5.0), // gap 27.5
            ev("cpu_op", "cpu_op", 30.0, 50.0), // not GPU: skipped
            ev("adamw_runs_bf16", "kernel", 60.0, 1.0),
            ev("adamw_runs_bf16", "kernel", 61.0, 1.0), // a run of two: the step ends at 62
            ev("gemm_b", "kernel", 200.0, 10.0),        // gap 138
            ev("FusedAdamMathFunctor", "kernel", 210.0, 2.0),
        ];
        format!("{{\"traceEvents\":[{}],\"ferrotron\":{{\"steps\":3}}}}", evs.join(","))
    }

    #[test]
    fn whole_steps_their_busy_time_and_gaps() {
        let all = spans(&trace()).unwrap();
        assert_eq!(all.len(), 11, "the CPU op is skipped");
        let st = steps(&all).unwrap();
        assert_eq!(st.bounds, vec![(10.0, 62.0), (62.0, 212.0)]);
        // Step 1: memcpy 1 + nvjet 10 + flash 5 (inner adds nothing) + layernorm 5 + adam 2 = 23.
        // Step 2: gemm_b 10 + adam 2 = 12.
        assert_eq!(st.busy, vec![23.0, 12.0]);
        let gaps: Vec<f64> = st.gaps.iter().map(|g| g.0).collect();
        assert_eq!(gaps, vec![1.0, 0.5, 27.5, 138.0]);
        assert_eq!((st.gaps[2].1.as_str(), st.gaps[2].2.as_str()), ("flash_fwd", "layernorm"));
        assert!((st.wall_ms() - 0.101).abs() < 1e-12, "{}", st.wall_ms());
        assert!((st.busy_ms() - 0.0175).abs() < 1e-12, "{}", st.busy_ms());
        let classes = st.gap_classes();
        assert_eq!(classes[0], ("< 2 µs", 1.0, 0.00075));
        assert_eq!((classes[2].1, classes[3].1), (0.5, 0.5));
        let k = st.kernel_times();
        assert_eq!((k[0].name.as_str(), k[0].calls), ("nvjet_fwd", 1));
        assert_eq!(k.iter().find(|x| x.name == "adamw_runs_bf16").unwrap().calls, 2);
        let t = step_table(&[("Ferrotron", &st), ("PyTorch", &st)]);
        assert!(t.contains("| GPU wall ms | 0.10 | 0.10 |"), "{t}");
        assert!(t.contains("| busy ms | 0.02 (17.3%) |"), "{t}");
        assert!(t.contains("| idle gaps ≥ 100 µs: count, ms | 0.5, 0.069 |"), "{t}");
        let kt = kernel_table("Ferrotron", &st, 2);
        assert!(kt.contains("| nvjet_fwd | 0.005 | 0.5 | 10.0 |"), "{kt}");
        assert!(kt.contains("| gemm_b | 0.005 | 0.5 | 10.0 |") && !kt.contains("layernorm"), "top 2 only: {kt}");
        let gp = gap_pair_table("Ferrotron", &st, 1);
        assert!(gp.contains("| adamw_runs_bf16 | gemm_b | 0.5 | 69.0 |") && !gp.contains("flash_fwd"), "{gp}");
        let g = gap_table("Ferrotron", &st, 2);
        assert!(g.contains("| 138.0 | adamw_runs_bf16 | gemm_b |"), "{g}");
        assert!(!g.contains("| 1.0 |"), "top 2 only: {g}");
    }

    #[test]
    fn too_few_updates_or_a_bad_trace_is_an_error() {
        let one = format!("{{\"traceEvents\":[{}]}}", ev("adamw_runs_f32", "kernel", 0.0, 1.0));
        let e = steps(&spans(&one).unwrap()).unwrap_err().to_string();
        assert!(e.contains("1 optimizer update(s)") && e.contains("at least two steps"), "{e}");
        assert!(spans("{}").unwrap_err().to_string().contains("traceEvents"));
        assert!(spans("not json").unwrap_err().to_string().contains("not a JSON trace"));
        let quoted = "{\"traceEvents\":[{\"name\":\"k\",\"cat\":\"kernel\",\"ph\":\"X\",\"ts\":\"5.5\",\"dur\":1}]}";
        assert_eq!(spans(quoted).unwrap()[0].end, 6.5);
    }
}
