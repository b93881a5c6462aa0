//! What the GPU did while a bench run ran: nvidia-smi polled every 300 ms for memory in use, SM
//! clock, power draw, utilisation, temperature and why the clock is held below its top. The H200
//! is power-capped (700 W): under sustained load its clock falls from 1980 MHz to 1450–1710
//! within seconds, so the clock a run held is part of its figure, and two runs compare fairly
//! only at like clocks. A hotter die
//! leaks more of the same 700 W, so the temperature a run starts busy at is reported too: a side
//! that starts on a card still hot from the run before it starts behind.

use anyhow::bail;
use std::process::{Child, Command};

/// One run's readings.
#[derive(Debug, PartialEq)]
pub struct Watch {
    /// Largest device memory in use (whole device, GiB).
    pub peak_mem_gib: f64,
    /// Medians over the samples with the GPU at least half busy: SM clock (MHz), power (W).
    pub busy: Option<(f64, f64)>,
    /// GPU temperature (°C) at the first and the last busy sample.
    pub temp: Option<(f64, f64)>,
    /// Of the busy samples, the share in which each clock-limiting reason was active, most
    /// frequent first (e.g. ("power cap", 0.9)): says whether a lower clock is the power cap's
    /// doing or something else's.
    pub limits: Vec<(&'static str, f64)>,
}

impl Watch {
    /// "1620 MHz / 690 W, 41→68 °C, power cap 90%" over the busy samples, or a dash.
    pub fn clock_power(&self) -> String {
        let t = self.temp.map_or_else(String::new, |(a, b)| format!(", {a:.0}→{b:.0} °C"));
        let l: String = self.limits.iter().map(|(r, f)| format!(", {r} {:.0}%", 100.0 * f)).collect();
        self.busy.map_or_else(|| "–".into(), |(c, p)| format!("{c:.0} MHz / {p:.0} W{t}{l}"))
    }
}

/// NVML's clock event reasons that hold a busy GPU's clock down (nvidia-smi
/// `clocks_event_reasons.active`); idle, application-clock and display bits are left out.
const LIMITS: [(u64, &str); 6] = [
    (0x4, "power cap"),
    (0x8, "hw slowdown"),
    (0x10, "sync boost"),
    (0x20, "sw thermal"),
    (0x40, "hw thermal"),
    (0x80, "power brake"),
];

/// One poll: "memory.used, clocks.sm, power.draw, utilization.gpu, temperature.gpu" and the
/// active clock event reasons as a hex mask (0 when the field is missing or unreadable).
fn parse(line: &str) -> Option<([f64; 5], u64)> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    let v: Vec<f64> = fields.iter().take(5).filter_map(|x| x.parse().ok()).collect();
    let mask = fields.get(5).and_then(|m| u64::from_str_radix(m.trim_start_matches("0x"), 16).ok()).unwrap_or(0);
    Some((<[f64; 5]>::try_from(v).ok()?, mask))
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

fn summarize(samples: &[([f64; 5], u64)]) -> Watch {
    let peak = samples.iter().map(|s| s.0[0]).fold(0.0, f64::max) / 1024.0;
    let busy: Vec<&([f64; 5], u64)> = samples.iter().filter(|s| s.0[3] >= 50.0).collect();
    let clock = median(busy.iter().map(|s| s.0[1]).collect());
    let power = median(busy.iter().map(|s| s.0[2]).collect());
    let temp = busy.first().zip(busy.last()).map(|(a, b)| (a.0[4], b.0[4]));
    let mut limits: Vec<(&'static str, f64)> = LIMITS
        .iter()
        .map(|&(bit, name)| (name, busy.iter().filter(|s| s.1 & bit != 0).count() as f64 / busy.len().max(1) as f64))
        .filter(|&(_, f)| f > 0.0)
        .collect();
    limits.sort_by(|a, b| b.1.total_cmp(&a.1));
    Watch { peak_mem_gib: peak, busy: clock.zip(power), temp, limits }
}

/// Polls the GPU until `child` exits; an unsuccessful exit is an error naming `what`.
pub fn watch(child: &mut Child, what: &str) -> anyhow::Result<Watch> {
    let mut samples = Vec::new();
    // Drivers that do not know the reasons field refuse the whole query: then poll without it.
    let mut reasons = true;
    loop {
        if let Some(s) = child.try_wait()? {
            if !s.success() {
                bail!("{what} exited with {s}");
            }
            return Ok(summarize(&samples));
        }
        let q = "--query-gpu=memory.used,clocks.sm,power.draw,utilization.gpu,temperature.gpu";
        let q = if reasons { format!("{q},clocks_event_reasons.active") } else { q.to_string() };
        if let Ok(o) = Command::new("nvidia-smi").args([q.as_str(), "--format=csv,noheader,nounits"]).output() {
            match String::from_utf8_lossy(&o.stdout).lines().next().and_then(parse) {
                Some(s) => samples.push(s),
                None if reasons && !o.status.success() => reasons = false,
                None => {}
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
}

/// Waits (at most two minutes) until the GPU is at or below `limit` °C, so both sides of a bench
/// start at like temperatures (`BENCH_COOL_C`); returns the temperature it started at, if read.
pub fn cool_to(limit: f64) -> Option<f64> {
    let read = || {
        let o =
            Command::new("nvidia-smi").args(["--query-gpu=temperature.gpu", "--format=csv,noheader,nounits"]).output();
        o.ok().and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse::<f64>().ok())
    };
    let start = std::time::Instant::now();
    while let Some(t) = read() {
        if t <= limit || start.elapsed().as_secs() >= 120 {
            return Some(t);
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_become_peak_memory_and_busy_medians() {
        assert_eq!(parse("51200, 1620, 690.52, 100, 45"), Some(([51200.0, 1620.0, 690.52, 100.0, 45.0], 0)));
        assert_eq!(
            parse("51200, 1620, 690.52, 100, 45, 0x0000000000000084"),
            Some(([51200.0, 1620.0, 690.52, 100.0, 45.0], 0x84))
        );
        assert_eq!(parse("51200, 1620, [N/A], 100, 45"), None);
        let s = [
            ([1024.0, 1980.0, 120.0, 0.0, 33.0], 0x1), // idle (compiling): left out of the medians
            ([4096.0, 1650.0, 690.0, 100.0, 41.0], 0x4),
            ([8192.0, 1560.0, 700.0, 100.0, 60.0], 0x84),
            ([6144.0, 1600.0, 650.0, 80.0, 68.0], 0x0),
            ([6144.0, 1610.0, 650.0, 80.0, 68.0], 0x4),
        ];
        let w = summarize(&s);
        let limits = vec![("power cap", 0.75), ("power brake", 0.25)];
        assert_eq!(w, Watch { peak_mem_gib: 8.0, busy: Some((1610.0, 690.0)), temp: Some((41.0, 68.0)), limits });
        assert_eq!(w.clock_power(), "1610 MHz / 690 W, 41→68 °C, power cap 75%, power brake 25%");
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
