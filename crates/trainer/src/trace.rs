//! `--profile-trace`: the GPU timeline of the profiled steps (ferrotron_core::gpu_trace) as a
//! Chrome trace, the JSON that Perfetto and chrome://tracing open and that PyTorch's profiler
//! writes too (`export_chrome_trace`), so `cargo xtask trace` reads both sides with one parser.
//! Event categories are PyTorch's (Kineto's): "kernel", "gpu_memcpy", "gpu_memset".

use anyhow::Context;
use ferrotron_core::gpu_trace::{ActivityKind, GpuTrace};
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};

/// What the trace covers, kept beside the events (top-level key "ferrotron").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TraceSteps {
    /// First and last training step recorded.
    pub first: u64,
    pub last: u64,
}

/// The file rank `rank` writes: `path` itself on rank 0, `path.rankN` on the others.
pub fn rank_path(path: &Path, rank: usize) -> PathBuf {
    if rank == 0 {
        return path.to_path_buf();
    }
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".rank{rank}"));
    PathBuf::from(s)
}

/// Writes `trace` to `path` as a Chrome trace: times in µs from the first activity's start,
/// device as pid, stream as tid. Written beside the target and renamed into place, so an
/// interrupted write leaves no half file under the name.
pub fn write_chrome_trace(path: &Path, trace: &GpuTrace, steps: TraceSteps) -> anyhow::Result<()> {
    let t0 = trace.activities.iter().map(|a| a.start_ns).min().unwrap_or(0);
    let us = |ns: u64| ns.saturating_sub(t0) as f64 / 1e3;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let write = || -> anyhow::Result<()> {
        let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        write!(w, "{{\"traceEvents\":[")?;
        for (i, a) in trace.activities.iter().enumerate() {
            let cat = match a.kind {
                ActivityKind::Kernel => "kernel",
                ActivityKind::Memcpy => "gpu_memcpy",
                ActivityKind::Memset => "gpu_memset",
            };
            let ev = json!({
                "name": a.name, "cat": cat, "ph": "X", "ts": us(a.start_ns),
                "dur": a.end_ns.saturating_sub(a.start_ns) as f64 / 1e3,
                "pid": a.device, "tid": a.stream, "args": { "bytes": a.bytes },
            });
            if i > 0 {
                w.write_all(b",\n")?;
            }
            serde_json::to_writer(&mut w, &ev)?;
        }
        let meta = json!({
            "first_step": steps.first, "last_step": steps.last, "steps": steps.last + 1 - steps.first,
            "dropped": trace.dropped,
        });
        write!(w, "],\"displayTimeUnit\":\"ns\",\"ferrotron\":{meta}}}")?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    };
    write().with_context(|| format!("--profile-trace: writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::gpu_trace::GpuActivity;

    #[test]
    fn a_trace_becomes_chrome_events_from_its_first_start() {
        let act = |kind, name: &str, start_ns, end_ns, bytes| GpuActivity {
            kind,
            name: name.into(),
            start_ns,
            end_ns,
            device: 0,
            stream: 7,
            bytes,
        };
        let trace = GpuTrace {
            activities: vec![
                act(ActivityKind::Memcpy, "memcpy", 1_000_000, 1_002_500, 4096),
                act(ActivityKind::Kernel, "flash_fwd_ws2pk128_bf16_64", 1_003_000, 1_010_000, 0),
            ],
            dropped: 0,
        };
        let dir = std::env::temp_dir().join(format!("ferrotron-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.json");
        write_chrome_trace(&path, &trace, TraceSteps { first: 11, last: 13 }).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let ev = v["traceEvents"].as_array().unwrap();
        assert_eq!(ev.len(), 2);
        assert_eq!(
            (ev[0]["cat"].as_str(), ev[0]["ts"].as_f64(), ev[0]["dur"].as_f64()),
            (Some("gpu_memcpy"), Some(0.0), Some(2.5))
        );
        assert_eq!(ev[0]["args"]["bytes"].as_u64(), Some(4096));
        assert_eq!(
            (ev[1]["cat"].as_str(), ev[1]["ts"].as_f64(), ev[1]["dur"].as_f64()),
            (Some("kernel"), Some(3.0), Some(7.0))
        );
        assert_eq!((ev[1]["name"].as_str(), ev[1]["tid"].as_u64()), (Some("flash_fwd_ws2pk128_bf16_64"), Some(7)));
        assert_eq!(v["ferrotron"]["steps"].as_u64(), Some(3));
        assert!(!dir.join("t.json.partial").exists(), "the partial file is renamed into place");
        assert_eq!(rank_path(&path, 0), path);
        assert_eq!(rank_path(&path, 2), dir.join("t.json.rank2"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
