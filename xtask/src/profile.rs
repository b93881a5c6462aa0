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
    fn output_without_csv_or_with_odd_units_is_an_error() {
        assert!(kernel_times("==PROF== no kernels\n").unwrap_err().to_string().contains("no CSV header"));
        let odd = CSV.replace("\"us\"", "\"cycle\"");
        assert!(kernel_times(&odd).unwrap_err().to_string().contains("unknown duration unit"));
    }
}
