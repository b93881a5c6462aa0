//! Kernel time by name from Nsight Compute's CSV (`ncu --metrics gpu__time_duration.sum --csv`):
//! the table `cargo xtask bench --gpu-profile` prints. Pure text in, text out, so it is tested
//! here without a GPU.

use anyhow::{Context, bail};

/// One kernel name's total time (ms) and number of launches.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub ms: f64,
    pub calls: usize,
}

/// Splits one CSV line (ncu quotes every field; commas inside quotes stay in the field).
fn fields(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    for ch in line.chars() {
        match ch {
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    out.push(cur);
    out
}

/// Sums `gpu__time_duration.sum` per kernel name, largest first. ncu's other output (its own
/// `==PROF==` lines, the program's stdout) is skipped: only lines starting with a quote are CSV.
/// The duration's unit comes from the "Metric Unit" column (ns, us, ms, s).
pub fn kernel_times(csv: &str) -> anyhow::Result<Vec<KernelTime>> {
    let mut lines = csv.lines().filter(|l| l.starts_with('"')).map(fields);
    let header = lines.next().context("no CSV header in ncu's output (was the run profiled?)")?;
    let col = |n: &str| header.iter().position(|h| h == n).with_context(|| format!("ncu CSV has no {n:?} column"));
    let (kname, metric, unit, value) =
        (col("Kernel Name")?, col("Metric Name")?, col("Metric Unit")?, col("Metric Value")?);
    let mut by_name: Vec<KernelTime> = Vec::new();
    for row in lines {
        if row.get(metric).map(String::as_str) != Some("gpu__time_duration.sum") {
            continue;
        }
        let (Some(name), Some(u), Some(v)) = (row.get(kname), row.get(unit), row.get(value)) else { continue };
        let v: f64 = v.replace(',', "").parse().with_context(|| format!("duration {v:?} of {name}"))?;
        let ms = v * match u.as_str() {
            "ns" | "nsecond" => 1e-6,
            "us" | "usecond" => 1e-3,
            "ms" | "msecond" => 1.0,
            "s" | "second" => 1e3,
            other => bail!("unknown duration unit {other:?} for {name}"),
        };
        match by_name.iter_mut().find(|k| k.name == *name) {
            Some(k) => {
                k.ms += ms;
                k.calls += 1;
            }
            None => by_name.push(KernelTime { name: name.clone(), ms, calls: 1 }),
        }
    }
    by_name.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    Ok(by_name)
}

/// A markdown table of the first `top` kernels: time, share of all kernels' time, launches.
pub fn table(preset: &str, rows: &[KernelTime], top: usize) -> String {
    let total: f64 = rows.iter().map(|k| k.ms).sum();
    let calls: usize = rows.iter().map(|k| k.calls).sum();
    let mut s = format!("\n{preset}: {total:.1} ms of kernels over {calls} launches\n\n");
    s.push_str("| ms | share | launches | kernel |\n|---|---|---|---|\n");
    for k in rows.iter().take(top) {
        let name: String = k.name.chars().take(100).collect();
        s.push_str(&format!(
            "| {:.2} | {:.1}% | {} | {name} |\n",
            k.ms,
            100.0 * k.ms / total.max(f64::MIN_POSITIVE),
            k.calls
        ));
    }
    s
}

/// The part of a training step a kernel belongs to, from its name (Ferrotron's kernels/ names and
/// cuBLASLt's): what the bench notes add up by hand otherwise.
pub fn category(name: &str) -> &'static str {
    let has = |p: &[&str]| p.iter().any(|x| name.contains(x));
    if has(&["nvjet", "xmma", "gemm", "splitKreduce", "cutlass"]) {
        "GEMMs (cuBLASLt)"
    } else if has(&["flash_", "attn_"]) {
        "attention"
    } else if has(&["layernorm", "rmsnorm", "norm_param_grad"]) {
        "norms"
    } else if has(&["adamw", "sum_sq"]) {
        "optimizer (AdamW, grad norm)"
    } else if has(&["ce_fwd", "ce_bwd"]) {
        "cross-entropy"
    } else if has(&["qkv_split", "qkv_merge", "rope"]) {
        "qkv split/merge, RoPE"
    } else if has(&["bias_grad", "col_sum", "acc_"]) {
        "bias grads, main_grad adds"
    } else {
        "other elementwise"
    }
}

/// Time per `category`, largest first: a markdown table with each one's share.
pub fn category_table(rows: &[KernelTime]) -> String {
    let total: f64 = rows.iter().map(|k| k.ms).sum();
    let mut cats: Vec<(&str, f64, usize)> = Vec::new();
    for k in rows {
        let c = category(&k.name);
        match cats.iter_mut().find(|x| x.0 == c) {
            Some(x) => {
                x.1 += k.ms;
                x.2 += k.calls;
            }
            None => cats.push((c, k.ms, k.calls)),
        }
    }
    cats.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut s = String::from("\n| ms | share | launches | part of the step |\n|---|---|---|---|\n");
    for (c, ms, calls) in cats {
        s.push_str(&format!("| {ms:.2} | {:.1}% | {calls} | {c} |\n", 100.0 * ms / total.max(f64::MIN_POSITIVE)));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const CSV: &str = "==PROF== Connected to process 12\n\
iter 1 loss 8.6\n\
\"ID\",\"Process ID\",\"Kernel Name\",\"Context\",\"Metric Name\",\"Metric Unit\",\"Metric Value\"\n\
\"0\",\"12\",\"rope_bf16_v8\",\"1\",\"gpu__time_duration.sum\",\"us\",\"40.5\"\n\
\"1\",\"12\",\"void gemm<a, b>(x, y)\",\"1\",\"gpu__time_duration.sum\",\"ms\",\"1.25\"\n\
\"2\",\"12\",\"rope_bf16_v8\",\"1\",\"gpu__time_duration.sum\",\"ns\",\"9,500\"\n\
\"3\",\"12\",\"rope_bf16_v8\",\"1\",\"sm__throughput.avg\",\"%\",\"50\"\n";

    #[test]
    fn sums_per_kernel_in_ms_largest_first() {
        let k = kernel_times(CSV).unwrap();
        assert_eq!(k.len(), 2);
        assert_eq!((k[0].name.as_str(), k[0].calls), ("void gemm<a, b>(x, y)", 1));
        assert!((k[0].ms - 1.25).abs() < 1e-12);
        assert_eq!((k[1].name.as_str(), k[1].calls), ("rope_bf16_v8", 2));
        assert!((k[1].ms - 0.05).abs() < 1e-12, "{}", k[1].ms);
        let t = table("124m", &k, 1);
        assert!(t.contains("1.3 ms of kernels over 3 launches"), "{t}");
        assert!(t.contains("| 1.25 | 96.2% | 1 | void gemm<a, b>(x, y) |"), "{t}");
        assert!(!t.contains("rope"), "top 1 only: {t}");
    }

    #[test]
    fn kernels_add_up_by_part_of_the_step() {
        let rows = [
            ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 6.0, 3),
            ("void cublasLt::splitKreduce_kernel<32, 16>", 1.0, 2),
            ("flash_bwd_dkvq_wg1_bf16_64", 2.0, 1),
            ("layernorm_bwd_bf16_v8n1", 0.5, 4),
            ("adamw_runs_bf16", 0.5, 1),
        ]
        .map(|(n, ms, calls)| KernelTime { name: n.into(), ms, calls });
        assert_eq!(category(&rows[1].name), "GEMMs (cuBLASLt)");
        assert_eq!(category("qkv_split_bf16_v8"), "qkv split/merge, RoPE");
        assert_eq!(category("swiglu_fwd_bf16_v8"), "other elementwise");
        let t = category_table(&rows);
        assert!(t.contains("| 7.00 | 70.0% | 5 | GEMMs (cuBLASLt) |"), "{t}");
        assert!(t.contains("| 2.00 | 20.0% | 1 | attention |"), "{t}");
        assert!(t.find("GEMMs").unwrap() < t.find("attention").unwrap(), "largest first: {t}");
    }

    #[test]
    fn output_without_csv_or_with_odd_units_is_an_error() {
        assert!(kernel_times("==PROF== no kernels\n").unwrap_err().to_string().contains("no CSV header"));
        let odd = CSV.replace("\"us\"", "\"cycle\"");
        assert!(kernel_times(&odd).unwrap_err().to_string().contains("unknown duration unit"));
    }
}
