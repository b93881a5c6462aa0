//! Runs on a machine with several GPUs (no cargo needed there, only the built binaries):
//!
//! - `gpu-parity [BIN] [--gpus N]`: the tiny GPT for 20 steps on one GPU, then under every
//!   layout that fits N GPUs (TP, SP, PP 1F1B and interleaved, DP with the distributed optimizer
//!   and overlap, and combinations), each through `ferrotron launch` with NCCL; compares each
//!   step's loss with the one-GPU run (fp32 within 1e-4 relative, bf16 within 2e-2).
//! - `bench --scaling [BIN] [--gpus N] [--plot FILE]`: weak scaling of GPT 1.3B (micro-batch 8 per
//!   GPU, DP 1 → N, distributed optimizer), the same at N GPUs without overlapping the grad
//!   reduce and the param gather (and
//!   both at micro-batch 1, where communication is a larger share of the step), TP2 of the same
//!   model, and with 4+ GPUs GPT 6.7B under TP/PP layouts (`scaling_rows`); tokens/s,
//!   TFLOP/s per GPU, MFU and efficiency per row, and an SVG plot of throughput against GPU count.
//!
//! Every run gets NCCL_NVLS_ENABLE=0 unless the caller set it, and a deadline after which its
//! process group is killed (a hung collective must not hang the table). `PARITY_LAYOUTS` and
//! `BENCH_ROWS` (comma-separated parts of row names, e.g. `6.7b,dp2 overlap`) run a subset, so a
//! short device lease can take the rows that matter.

use anyhow::{Context, bail};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// GPUs on this machine (/dev/nvidiaN).
fn gpu_count() -> usize {
    (0..64).take_while(|i| Path::new(&format!("/dev/nvidia{i}")).exists()).count()
}

/// (binary, --gpus, --plot, the rest) from `[BIN] [--gpus N] [--plot FILE]`.
fn parse(args: &[String], default_bin: PathBuf) -> anyhow::Result<(PathBuf, usize, Option<PathBuf>)> {
    let (mut bin, mut gpus, mut plot) = (default_bin, gpu_count(), None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--gpus" => gpus = it.next().context("--gpus N")?.parse().context("--gpus N")?,
            "--plot" => plot = Some(PathBuf::from(it.next().context("--plot FILE")?)),
            _ => bin = PathBuf::from(a),
        }
    }
    if gpus == 0 && std::env::var("PARITY_DEVICE").as_deref() != Ok("cpu") {
        bail!("no GPU found (/dev/nvidia0): pass --gpus N on a GPU machine");
    }
    Ok((bin, gpus, plot))
}

/// One `ferrotron train` run (launched over `nproc` processes when above 1), killed at `deadline`;
/// returns the metrics lines of rank 0, the output and the wall time.
fn train(
    bin: &Path,
    nproc: usize,
    args: &[String],
    deadline: Duration,
    tag: &str,
) -> anyhow::Result<(String, String, f64)> {
    let dir = std::env::temp_dir().join(format!("ferrotron-multi-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cmd = Command::new(bin);
    if nproc > 1 {
        // A fresh port per run: a killed run's port may linger in TIME_WAIT.
        let port = 29500 + (std::process::id() as usize + tag.len() * 37 + nproc) % 2000;
        cmd.args(["launch", "--nproc-per-node", &nproc.to_string(), "--master-port", &port.to_string(), "--"]);
    }
    // Metrics only: no checkpoint is written (saving a 1.3B model takes longer than the run).
    cmd.arg("train").args(args).arg("--metrics-file").arg(dir.join("metrics.jsonl")).arg("--no-progress");
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        cmd.env("NCCL_NVLS_ENABLE", "0");
    }
    let log = std::fs::File::create(std::env::temp_dir().join(format!("ferrotron-multi-{tag}.log")))?;
    cmd.stdout(log.try_clone()?).stderr(log).process_group(0);
    let start = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("running {}", bin.display()))?;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if start.elapsed() > deadline {
            // The run's own process group: the launcher and every rank it started.
            // SAFETY: signals a process group this function created; no memory is touched.
            unsafe {
                libc::killpg(child.id() as libc::pid_t, libc::SIGKILL);
            }
            let _ = child.wait();
            bail!("{tag}: no result after {deadline:?} (killed; log in {})", std::env::temp_dir().display());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let wall = start.elapsed().as_secs_f64();
    let log = std::fs::read_to_string(std::env::temp_dir().join(format!("ferrotron-multi-{tag}.log")))?;
    if !status.success() {
        let tail: Vec<&str> = log.lines().rev().take(4).collect();
        bail!("{tag}: {status}: {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | "));
    }
    let m = std::fs::read_to_string(dir.join("metrics.jsonl")).with_context(|| format!("{tag}: metrics.jsonl"))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok((m, log, wall))
}

/// The numbers after `"key":` in the train lines of a metrics file, in order.
pub(crate) fn series(metrics: &str, key: &str) -> Vec<f64> {
    let pat = format!("\"{key}\":");
    metrics
        .lines()
        .filter(|l| l.contains("\"kind\":\"train\""))
        .filter_map(|l| l.split(&pat).nth(1)?.split([',', '}']).next()?.parse().ok())
        .collect()
}

/// The last train loss when every train line has a finite one (metrics.jsonl writes a NaN or
/// infinite loss as null): a bench figure from a run whose loss blew up is not a figure.
pub fn last_finite_loss(metrics: &str) -> Option<f64> {
    let lines = metrics.lines().filter(|l| l.contains("\"kind\":\"train\"")).count();
    let losses = series(metrics, "loss");
    match losses.last() {
        Some(l) if losses.len() == lines && losses.iter().all(|x| x.is_finite()) => Some(*l),
        _ => None,
    }
}

/// Median of a train series without its first step (which compiles kernels and warms the
/// allocator); 0 when nothing is left.
pub fn steady_median(metrics: &str, key: &str) -> f64 {
    let mut v = series(metrics, key);
    if v.is_empty() {
        return 0.0;
    }
    v.remove(0);
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Total tokens over total time of the train lines after the first (each line one log window of
/// equal tokens): the harmonic mean of their rates. 0 when there is no second line.
pub fn steady_rate(metrics: &str, key: &str) -> f64 {
    let v = series(metrics, key);
    let rest = v.get(1..).unwrap_or(&[]);
    if rest.is_empty() || !rest.iter().all(|r| r.is_finite() && *r > 0.0) {
        return 0.0;
    }
    rest.len() as f64 / rest.iter().map(|r| 1.0 / r).sum::<f64>()
}

/// Whether the row `name` is among those the environment variable `var` names (all when unset).
fn chosen(var: &str, name: &str) -> bool {
    selected(std::env::var(var).ok().as_deref(), name)
}

fn selected(filter: Option<&str>, name: &str) -> bool {
    filter.is_none_or(|f| f.split(',').map(str::trim).any(|part| !part.is_empty() && name.contains(part)))
}

pub(crate) fn owned(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// The layouts of `n` GPUs for the tiny presets (4 layers, 4 heads): (name, flags).
fn parity_layouts(n: usize) -> Vec<(String, Vec<String>)> {
    let (nn, tp, pp) = (n.to_string(), "--tensor-model-parallel-size", "--pipeline-model-parallel-size");
    let (distopt, overlap, gather) = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather");
    let mut v: Vec<(String, Vec<&str>)> = vec![
        (format!("dp{n}"), vec![]),
        (format!("dp{n} distopt"), vec![distopt]),
        (format!("dp{n} distopt overlap"), vec![distopt, overlap, gather]),
    ];
    if 4usize.is_multiple_of(n) {
        v.push((format!("tp{n}"), vec![tp, &nn]));
        v.push((format!("tp{n} sp"), vec![tp, &nn, "--sequence-parallel"]));
        v.push((format!("pp{n} 1f1b"), vec![pp, &nn]));
        if n == 2 {
            v.push(("pp2 interleaved v2".into(), vec![pp, "2", "--num-layers-per-virtual-pipeline-stage", "1"]));
        }
    }
    // Context parallel: each sequence (128 tokens) in 2n chunks.
    v.push((format!("cp{n}"), vec!["--context-parallel-size", &nn]));
    let dp = (n / 4).to_string();
    if n.is_multiple_of(4) {
        v.push((format!("tp2 pp2 dp{dp} sp distopt"), vec![tp, "2", pp, "2", "--sequence-parallel", distopt]));
        v.push((format!("cp2 tp2 dp{dp} sp"), vec!["--context-parallel-size", "2", tp, "2", "--sequence-parallel"]));
    }
    v.into_iter().map(|(k, f)| (k, owned(&f))).collect()
}

/// `gpu-parity`: see the module doc.
pub fn parity(args: &[String], default_bin: PathBuf) -> anyhow::Result<()> {
    let (bin, gpus, _) = parse(args, default_bin)?;
    // PARITY_DEVICE=cpu runs the same table over TCP processes (a check of this tool off the GPU).
    let device = std::env::var("PARITY_DEVICE").unwrap_or_else(|_| "cuda".into());
    let base = owned(&[
        "--device",
        &device,
        "--preset",
        "tiny",
        "--train-iters",
        "20",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--log-interval",
        "1",
        "--eval-interval",
        "1000000",
        "--eval-iters",
        "1",
        "--save-interval",
        "1000000",
        "--corpus-docs",
        "2000",
        "--seed",
        "1234",
    ]);
    let deadline =
        Duration::from_secs(std::env::var("PARITY_DEADLINE_S").ok().and_then(|v| v.parse().ok()).unwrap_or(90));
    let mut failed = 0;
    println!(
        "| GPUs | layout | precision | steps | max relative loss difference vs 1 GPU | tolerance | result | wall s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (precision, extra, tol) in [("fp32", vec![], 1e-4), ("bf16", owned(&["--bf16"]), 2e-2)] {
        let args1: Vec<String> = base.iter().chain(&extra).cloned().collect();
        let (m, _, wall) = train(&bin, 1, &args1, deadline, &format!("ref-{precision}"))?;
        let want = series(&m, "loss");
        println!("| 1 | single GPU (reference) | {precision} | {} | - | - | - | {wall:.1} |", want.len());
        for n in (2..=gpus).filter(|n| gpus.is_multiple_of(*n)) {
            for (name, flags) in parity_layouts(n).into_iter().filter(|l| chosen("PARITY_LAYOUTS", &l.0)) {
                // bf16 is checked on the data- and tensor-parallel layouts (its tolerance is loose).
                if precision == "bf16" && !(name.ends_with("distopt") || name.ends_with(" sp")) {
                    continue;
                }
                let a: Vec<String> = args1.iter().chain(&flags).cloned().collect();
                let tag = format!("{precision}-{}", name.replace(' ', "-"));
                match train(&bin, n, &a, deadline, &tag) {
                    Ok((m, _, wall)) => {
                        let got = series(&m, "loss");
                        let diff = want
                            .iter()
                            .zip(&got)
                            .map(|(a, b)| (a - b).abs() / a.abs().max(1e-12))
                            .fold(0.0f64, f64::max);
                        let ok = got.len() == want.len() && diff <= tol;
                        failed += usize::from(!ok);
                        let verdict = if ok { "pass" } else { "FAIL" };
                        println!(
                            "| {n} | {name} | {precision} | {} | {diff:.2e} | {tol:.0e} | {verdict} | {wall:.1} |",
                            got.len()
                        );
                    }
                    Err(e) => {
                        failed += 1;
                        println!("| {n} | {name} | {precision} | - | - | {tol:.0e} | FAIL: {e} | - |");
                    }
                }
            }
        }
    }
    if failed > 0 {
        bail!("{failed} layout(s) did not match the one-GPU run");
    }
    Ok(())
}

/// One row of the scaling table.
struct Row {
    name: String,
    preset: &'static str,
    gpus: usize,
    micro: usize,
    global_batch: usize,
    flags: Vec<String>,
    /// A weak-scaling point of GPT 1.3B over data parallelism (plotted, efficiency vs 1 GPU).
    weak: bool,
}

/// The rows for `gpus` GPUs: 1.3B weak scaling (micro-batch 8 per GPU, DP 1 → N, distributed
/// optimizer, grad reduce and param gather overlapped), the same at N without overlap, 1.3B with
/// TP2; with 4 or more GPUs GPT 6.7B under TP/PP layouts (micro-batch 2, 8 micro-batches per step
/// so pipelines fill).
fn scaling_rows(gpus: usize) -> Vec<Row> {
    let (tp, pp) = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size");
    let (distopt, overlap, gather) = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather");
    let row = |name: String, preset, gpus, micro, global_batch, flags: &[&str], weak| Row {
        name,
        preset,
        gpus,
        micro,
        global_batch,
        flags: owned(flags),
        weak,
    };
    let mut rows = vec![];
    let mut n = 1;
    while n <= gpus {
        rows.push(row(format!("1.3b dp{n} overlap"), "1.3b", n, 8, 8 * n, &[distopt, overlap, gather], true));
        n *= 2;
    }
    let top = rows.last().map_or(1, |r: &Row| r.gpus);
    if top > 1 {
        rows.push(row(format!("1.3b dp{top} no overlap"), "1.3b", top, 8, 8 * top, &[distopt], false));
        // Micro-batch 1: an eighth of the compute per step against the same gradient and
        // parameter traffic, so that overlap on vs off shows even on NVLink at 2 GPUs.
        rows.push(row(
            format!("1.3b dp{top} micro 1 overlap"),
            "1.3b",
            top,
            1,
            top,
            &[distopt, overlap, gather],
            false,
        ));
        rows.push(row(format!("1.3b dp{top} micro 1 no overlap"), "1.3b", top, 1, top, &[distopt], false));
        rows.push(row(format!("1.3b tp2 dp{}", top / 2), "1.3b", top, 8, 8 * top / 2, &[tp, "2", distopt], false));
    }
    // The larger GPT's layouts (GPT 6.7B does not fit one H200 with fp32 master weights and Adam
    // state: 6.7B × 18 bytes is 121 GB before activations).
    let layouts: &[(usize, &str, &[&str])] = &[
        (2, "tp2", &[tp, "2"]),
        (2, "pp2", &[pp, "2"]),
        (4, "tp4", &[tp, "4"]),
        (4, "tp2 pp2", &[tp, "2", pp, "2"]),
        (8, "tp8", &[tp, "8"]),
        (8, "tp4 pp2", &[tp, "4", pp, "2"]),
    ];
    for &(n, name, flags) in layouts.iter().filter(|l| l.0 <= gpus) {
        rows.push(row(format!("6.7b {name}"), "6.7b", n, 2, 16, flags, false));
    }
    rows
}

/// `bench --scaling`: see the module doc.
pub fn scaling(args: &[String], default_bin: PathBuf) -> anyhow::Result<()> {
    let (bin, gpus, plot) = parse(args, default_bin)?;
    let iters = std::env::var("BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(6u64);
    let deadline =
        Duration::from_secs(std::env::var("BENCH_DEADLINE_S").ok().and_then(|v| v.parse().ok()).unwrap_or(300));
    println!("| run | GPUs | micro × global batch | tokens/s | TFLOP/s per GPU | MFU | weak-scaling efficiency |");
    println!("|---|---|---|---|---|---|---|");
    let mut points: Vec<(usize, f64)> = Vec::new();
    let mut one = None;
    for r in scaling_rows(gpus).into_iter().filter(|r| chosen("BENCH_ROWS", &r.name)) {
        let n = r.gpus;
        let mut a = owned(&["--device", "cuda", "--bf16", "--preset", r.preset, "--log-interval", "1"]);
        a.extend(owned(&["--eval-interval", "1000000", "--eval-iters", "1", "--corpus-docs", "3000"]));
        a.extend(owned(&["--micro-batch-size", &r.micro.to_string()]));
        a.extend(owned(&["--global-batch-size", &r.global_batch.to_string(), "--train-iters", &iters.to_string()]));
        a.extend(r.flags);
        let shape = format!("{} × {}", r.micro, r.global_batch);
        match train(&bin, n, &a, deadline, &r.name.replace(' ', "-")) {
            Ok((m, log, _)) => {
                let t = steady_median(&m, "tokens_per_s");
                let flops = crate::header_flops_per_token(&log).unwrap_or(0.0);
                let per_gpu = t * flops / n as f64;
                if r.weak && n == 1 {
                    one = Some(t);
                }
                let eff = match (r.weak, one) {
                    (true, Some(o)) => format!("{:.1}%", 100.0 * t / (o * n as f64)),
                    _ => String::new(),
                };
                let (name, tf, mfu) = (&r.name, per_gpu / 1e12, 100.0 * per_gpu / 989e12);
                println!("| {name} | {n} | {shape} | {t:.0} | {tf:.1} | {mfu:.1}% | {eff} |");
                if r.weak {
                    points.push((n, t));
                }
            }
            Err(e) => println!("| {} | {n} | {shape} | FAIL: {e} | | | |", r.name),
        }
    }
    if let Some(p) = plot {
        std::fs::write(&p, svg(&points)).with_context(|| format!("writing {}", p.display()))?;
        println!("plot: {}", p.display());
    }
    Ok(())
}

/// Throughput against GPU count, with the ideal line from one GPU.
fn svg(points: &[(usize, f64)]) -> String {
    let (w, h, m) = (480.0, 320.0, 50.0);
    let max_n = points.iter().map(|p| p.0).max().unwrap_or(1).max(2) as f64;
    let one = points.first().map_or(1.0, |p| p.1);
    let max_t = points.iter().map(|p| p.1).fold(one * max_n, f64::max);
    let x = |n: f64| m + (n - 1.0) / (max_n - 1.0) * (w - 2.0 * m);
    let y = |t: f64| h - m - t / max_t * (h - 2.0 * m);
    let line: Vec<String> = points.iter().map(|&(n, t)| format!("{:.1},{:.1}", x(n as f64), y(t))).collect();
    let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\">\n");
    s += &format!(
        "<line x1=\"{m}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{}\" stroke=\"black\"/>\n",
        h - m,
        w - m,
        h - m,
        h - m
    );
    s += &format!(
        "<line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"gray\" stroke-dasharray=\"4\"/>\n",
        x(1.0),
        y(one),
        x(max_n),
        y(one * max_n)
    );
    s += &format!("<polyline fill=\"none\" stroke=\"blue\" stroke-width=\"2\" points=\"{}\"/>\n", line.join(" "));
    for &(n, t) in points {
        s += &format!("<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"blue\"/>\n", x(n as f64), y(t));
        s += &format!("<text x=\"{:.1}\" y=\"{}\" font-size=\"11\">{n}</text>\n", x(n as f64) - 3.0, h - m + 15.0);
        s += &format!("<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\">{t:.0}</text>\n", x(n as f64) + 5.0, y(t) - 5.0);
    }
    s += &format!("<text x=\"{}\" y=\"{}\" font-size=\"12\">GPUs</text>\n", w / 2.0, h - 10.0);
    s += &format!("<text x=\"5\" y=\"{}\" font-size=\"12\">tokens/s (GPT 1.3B, dashed: ideal)</text>\n", m - 15.0);
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaling_rows_fit_their_gpu_counts() {
        let rows = scaling_rows(8);
        let weak: Vec<usize> = rows.iter().filter(|r| r.weak).map(|r| r.gpus).collect();
        assert_eq!(weak, [1, 2, 4, 8]);
        for r in &rows {
            let arg = |k: &str| r.flags.iter().position(|f| f == k).map_or(1, |i| r.flags[i + 1].parse().unwrap());
            let (tp, pp) = (arg("--tensor-model-parallel-size"), arg("--pipeline-model-parallel-size"));
            assert_eq!(r.gpus % (tp * pp), 0, "{}", r.name);
            let dp = r.gpus / (tp * pp);
            assert_eq!(r.global_batch % (r.micro * dp), 0, "{}", r.name);
            assert!(r.global_batch / (r.micro * dp) >= pp, "{}: too few micro-batches to fill the pipeline", r.name);
        }
        let two = scaling_rows(2);
        assert!(two.iter().all(|r| r.gpus <= 2));
        let larger: Vec<&str> = two.iter().filter(|r| r.preset == "6.7b").map(|r| r.name.as_str()).collect();
        assert_eq!(larger, ["6.7b tp2", "6.7b pp2"]);
        assert_eq!(scaling_rows(1).len(), 1);
    }

    #[test]
    fn row_filters_take_parts_of_names() {
        let names: Vec<String> = scaling_rows(2).into_iter().map(|r| r.name).collect();
        let pick = |f| names.iter().filter(|n| selected(f, n)).cloned().collect::<Vec<_>>();
        assert_eq!(pick(None), names);
        assert_eq!(pick(Some("6.7b, dp2 overlap")), ["1.3b dp2 overlap", "6.7b tp2", "6.7b pp2"]);
        assert!(pick(Some("")).is_empty());
        assert!(pick(Some("no such row")).is_empty());
    }

    #[test]
    fn steady_median_skips_the_first_step_and_eval_lines() {
        let m = [
            r#"{"kind":"eval","iteration":0,"loss":5.0}"#,
            r#"{"kind":"train","iteration":1,"loss":4.0,"tokens_per_s":10.0}"#,
            r#"{"kind":"train","iteration":2,"loss":3.0,"tokens_per_s":300.0}"#,
            r#"{"kind":"train","iteration":3,"loss":2.0,"tokens_per_s":200.0}"#,
            r#"{"kind":"train","iteration":4,"loss":1.0,"tokens_per_s":100.0}"#,
        ]
        .join("\n");
        assert_eq!(series(&m, "loss"), [4.0, 3.0, 2.0, 1.0]);
        assert_eq!(last_finite_loss(&m), Some(1.0));
        let blown = m.replace(r#""loss":3.0"#, r#""loss":null"#);
        assert_eq!(last_finite_loss(&blown), None);
        assert_eq!(last_finite_loss(""), None);
        assert_eq!(steady_median(&m, "tokens_per_s"), 200.0);
        assert_eq!(steady_median("", "tokens_per_s"), 0.0);
        // 3 windows of equal tokens at 300, 200, 100 per second: 3 / (1/300 + 1/200 + 1/100).
        let r = steady_rate(&m, "tokens_per_s");
        assert!((r - 3.0 / (1.0 / 300.0 + 1.0 / 200.0 + 1.0 / 100.0)).abs() < 1e-9, "{r}");
        assert_eq!(steady_rate(&m.lines().take(2).collect::<Vec<_>>().join("\n"), "tokens_per_s"), 0.0);
    }

    #[test]
    fn parity_layouts_divide_the_tiny_model() {
        for n in [2, 4, 8] {
            for (name, flags) in parity_layouts(n) {
                let arg = |k: &str| flags.iter().position(|f| f == k).map_or(1, |i| flags[i + 1].parse().unwrap());
                let (tp, pp, cp): (usize, usize, usize) = (
                    arg("--tensor-model-parallel-size"),
                    arg("--pipeline-model-parallel-size"),
                    arg("--context-parallel-size"),
                );
                assert_eq!(n % (tp * pp * cp), 0, "{name}");
                assert_eq!(128 % (2 * cp), 0, "{name}: the tiny model's sequence splits into 2 × cp chunks");
                assert!(4 % tp == 0 && 4 % pp == 0, "{name}: the tiny model has 4 heads and 4 layers");
            }
        }
    }
}
