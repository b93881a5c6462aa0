//! What the GPU did while a bench run ran: nvidia-smi polled every 300 ms for memory in use, SM
//! clock, power draw and utilisation. The H200 is power-capped (700 W): under sustained load its
//! clock falls from 1980 MHz to 1450–1710 within seconds, so the clock a run held is part of its
//! figure, and two runs compare fairly only at like clocks.

use anyhow::bail;
use std::process::{Child, Command};

/// One run's readings.
#[derive(Debug, PartialEq)]
pub struct Watch {
    /// Largest device memory in use (whole device, GiB).
    pub peak_mem_gib: f64,
    /// Medians over the samples with the GPU at least half busy: SM clock (MHz), power (W).
    pub busy: Option<(f64, f64)>,
}

impl Watch {
    /// "1,620 MHz / 690 W" over the busy samples, or a dash.
    pub fn clock_power(&self) -> String {
        self.busy.map_or_else(|| "–".into(), |(c, p)| format!("{c:.0} MHz / {p:.0} W"))
    }
}

/// One poll's "memory.used, clocks.sm, power.draw, utilization.gpu" line.
fn parse(line: &str) -> Option<[f64; 4]> {
    let v: Vec<f64> = line.split(',').filter_map(|x| x.trim().parse().ok()).collect();
    <[f64; 4]>::try_from(v).ok()
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

fn summarize(samples: &[[f64; 4]]) -> Watch {
    let peak = samples.iter().map(|s| s[0]).fold(0.0, f64::max) / 1024.0;
    let busy: Vec<&[f64; 4]> = samples.iter().filter(|s| s[3] >= 50.0).collect();
    let clock = median(busy.iter().map(|s| s[1]).collect());
    let power = median(busy.iter().map(|s| s[2]).collect());
    Watch { peak_mem_gib: peak, busy: clock.zip(power) }
}

/// Polls the GPU until `child` exits; an unsuccessful exit is an error naming `what`.
pub fn watch(child: &mut Child, what: &str) -> anyhow::Result<Watch> {
    let mut samples = Vec::new();
    loop {
        if let Some(s) = child.try_wait()? {
            if !s.success() {
                bail!("{what} exited with {s}");
            }
            return Ok(summarize(&samples));
        }
        let q = "--query-gpu=memory.used,clocks.sm,power.draw,utilization.gpu";
        if let Ok(o) = Command::new("nvidia-smi").args([q, "--format=csv,noheader,nounits"]).output()
            && let Some(s) = String::from_utf8_lossy(&o.stdout).lines().next().and_then(parse)
        {
            samples.push(s);
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_become_peak_memory_and_busy_medians() {
        assert_eq!(parse("51200, 1620, 690.52, 100"), Some([51200.0, 1620.0, 690.52, 100.0]));
        assert_eq!(parse("51200, 1620, [N/A], 100"), None);
        let s = [
            [1024.0, 1980.0, 120.0, 0.0], // idle (compiling): left out of the medians
            [4096.0, 1650.0, 690.0, 100.0],
            [8192.0, 1560.0, 700.0, 100.0],
            [6144.0, 1600.0, 650.0, 80.0],
        ];
        let w = summarize(&s);
        assert_eq!(w, Watch { peak_mem_gib: 8.0, busy: Some((1600.0, 690.0)) });
        assert_eq!(w.clock_power(), "1600 MHz / 690 W");
        assert_eq!(summarize(&s[..1]).busy, None);
        assert_eq!(summarize(&[]).clock_power(), "–");
    }

    #[test]
    fn watch_waits_for_the_child_and_names_a_failure() {
        // Without nvidia-smi (CI) the polls come back empty; the run's exit is what is checked.
        let mut ok = Command::new("sleep").arg("0.4").spawn().unwrap();
        assert!(watch(&mut ok, "sleep").is_ok());
        assert!(ok.try_wait().unwrap().is_some(), "returned before the child exited");
        let mut bad = Command::new("false").spawn().unwrap();
        let e = watch(&mut bad, "the reference").unwrap_err().to_string();
        assert!(e.starts_with("the reference exited with"), "{e}");
    }
}
