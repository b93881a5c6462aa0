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

/// The part of a training step a kernel belongs to, from its name: Ferrotron's kernels/ names,
/// cuBLASLt's, and the PyTorch reference's (cuDNN attention, Triton kernels named after the ops
/// they fuse, ATen's optimizer and reductions). GEMM epilogues stay GEMMs.
pub fn category(name: &str) -> &'static str {
    let has = |p: &[&str]| p.iter().any(|x| name.contains(x));
    if has(&["nvjet", "xmma", "gemm", "splitKreduce", "cutlass"]) {
        "GEMMs (cuBLASLt)"
    } else if has(&["flash_", "attn_", "sdpa", "fmha", "compute_dot_do_o", "convert_dq"]) {
        "attention"
    } else if has(&["layernorm", "rmsnorm", "norm_param_grad", "layer_norm", "rms_norm"]) {
        "norms"
    } else if has(&["adam", "sum_sq", "sum_partials", "FusedOpti", "multi_tensor_apply", "lpnorm", "NormTwoOps"]) {
        "optimizer (AdamW, grad norm)"
    } else if has(&["ce_fwd", "ce_bwd", "log_softmax", "nll_loss"]) {
        "cross-entropy"
    } else if has(&["gelu", "silu", "swiglu"]) {
        "activations (outside GEMM epilogues)"
    } else if has(&["qkv_split", "qkv_merge", "rope", "permute"]) {
        "qkv split/merge, RoPE"
    } else if has(&["bias_grad", "col_sum", "acc_", "fused_sum", "reduce_kernel"]) {
        "bias grads, main_grad adds"
    } else {
        "other elementwise"
    }
}

/// Milliseconds and launches.
type Side = (f64, usize);

/// (ms, launches) per `category`, in order of first appearance.
fn by_category(rows: &[KernelTime]) -> Vec<(&'static str, Side)> {
    let mut cats: Vec<(&'static str, Side)> = Vec::new();
    for k in rows {
        let c = category(&k.name);
        match cats.iter_mut().find(|x| x.0 == c) {
            Some((_, (ms, calls))) => {
                *ms += k.ms;
                *calls += k.calls;
            }
            None => cats.push((c, (k.ms, k.calls))),
        }
    }
    cats
}

/// Time and launches per `category` and training step (`steps` steps profiled on each side:
/// Ferrotron's, PyTorch's), Ferrotron beside PyTorch, larger first, then the total; with `theirs`
/// empty (not profiled) its columns are dashes. The last column is Ferrotron's time over
/// PyTorch's: below 1 is where Ferrotron is ahead.
pub fn compare_table(ours: &[KernelTime], theirs: &[KernelTime], steps: (f64, f64)) -> String {
    let (a, b) = (by_category(ours), by_category(theirs));
    let get = |v: &[(&str, Side)], n: &str| v.iter().find(|x| x.0 == n).map_or((0.0, 0), |x| x.1);
    let mut rows: Vec<(&str, Side, Side)> = Vec::new();
    for (n, _) in a.iter().chain(&b) {
        if !rows.iter().any(|r| r.0 == *n) {
            rows.push((n, get(&a, n), get(&b, n)));
        }
    }
    rows.sort_by(|x, y| y.1.0.max(y.2.0).total_cmp(&x.1.0.max(x.2.0)));
    let total = |v: &[(&str, Side)]| (v.iter().map(|x| x.1.0).sum::<f64>(), v.iter().map(|x| x.1.1).sum::<usize>());
    rows.push(("all kernels", total(&a), total(&b)));
    let torch = !theirs.is_empty();
    let mut s = String::from(
        "\n| part of the step | Ferrotron ms / step | launches | PyTorch ms / step | launches | Ferrotron / PyTorch |\n|---|---|---|---|---|---|\n",
    );
    for (n, (ms, calls), (tms, tcalls)) in rows {
        let (o, oc) = (ms / steps.0, calls as f64 / steps.0);
        let (t, tc, r) = if torch {
            let (t, tc) = (tms / steps.1, tcalls as f64 / steps.1);
            let r = if t > 0.0 { format!("{:.2}", o / t) } else { "–".into() };
            (format!("{t:.2}"), format!("{tc:.0}"), r)
        } else {
            ("–".into(), "–".into(), "–".into())
        };
        s.push_str(&format!("| {n} | {o:.2} | {oc:.0} | {t} | {tc} | {r} |\n"));
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
    fn kernels_add_up_by_part_of_the_step_beside_pytorch() {
        let ours = [
            ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 6.0, 4),
            ("void cublasLt::splitKreduce_kernel<32, 16>", 2.0, 2),
            ("flash_bwd_dkvq_wg1_bf16_64", 2.0, 2),
            ("layernorm_bwd_bf16_v8n1", 0.5, 4),
        ]
        .map(|(n, ms, calls)| KernelTime { name: n.into(), ms, calls });
        let theirs = [
            ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 10.0, 6),
            ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 1.0, 2),
            ("triton_per_fused__to_copy_add_native_layer_norm_backward_view_9", 1.0, 2),
            ("triton_poi_fused_gelu_gelu_backward_view_6", 1.0, 2),
        ]
        .map(|(n, ms, calls)| KernelTime { name: n.into(), ms, calls });
        assert_eq!(category(&ours[1].name), "GEMMs (cuBLASLt)");
        assert_eq!(category("qkv_split_bf16_v8"), "qkv split/merge, RoPE");
        assert_eq!(category("swiglu_fwd_bf16_v8"), "activations (outside GEMM epilogues)");
        assert_eq!(category("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopA_geluauxbias_auxt_TNN"), "GEMMs (cuBLASLt)");
        assert_eq!(
            category("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>"),
            "optimizer (AdamW, grad norm)"
        );
        assert_eq!(
            category("triton_red_fused__log_softmax__to_copy__unsafe_view_prepare_softmax_online_view_18"),
            "cross-entropy"
        );
        let t = compare_table(&ours, &theirs, (2.0, 2.0));
        assert!(t.contains("| GEMMs (cuBLASLt) | 4.00 | 3 | 5.00 | 3 | 0.80 |"), "{t}");
        assert!(t.contains("| attention | 1.00 | 1 | 0.50 | 1 | 2.00 |"), "{t}");
        assert!(t.contains("| activations (outside GEMM epilogues) | 0.00 | 0 | 0.50 | 1 | 0.00 |"), "{t}");
        assert!(t.contains("| all kernels | 5.25 | 6 | 6.50 | 6 | 0.81 |"), "{t}");
        assert!(t.find("GEMMs").unwrap() < t.find("attention").unwrap(), "largest first: {t}");
        assert!(t.trim_end().ends_with("0.81 |"), "total last: {t}");
        let alone = compare_table(&ours, &[], (2.0, 2.0));
        let uneven = compare_table(&ours, &theirs, (2.0, 4.0));
        assert!(uneven.contains("| attention | 1.00 | 1 | 0.25 | 0 | 4.00 |"), "{uneven}");
        assert!(alone.contains("| attention | 1.00 | 1 | – | – | – |"), "{alone}");
    }

    #[test]
    fn output_without_csv_or_with_odd_units_is_an_error() {
        assert!(kernel_times("==PROF== no kernels\n").unwrap_err().to_string().contains("no CSV header"));
        let odd = CSV.replace("\"us\"", "\"cycle\"");
        assert!(kernel_times(&odd).unwrap_err().to_string().contains("unknown duration unit"));
    }
}
