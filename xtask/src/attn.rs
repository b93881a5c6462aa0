//! `bench --attention`'s table: examples/attention_bench's rows and benches/torch_sdpa.py's for the
//! same shapes, side by side with the ratios (issue 7 asks for the two in one command).

use std::collections::BTreeMap;

/// (head dim, sequence length) → (forward, backward) TFLOP/s from a markdown table whose rows
/// start `| d | t | b × h | fwd | bwd |`; a cell that is not a number (`–`) is None.
pub fn rows(table: &str) -> BTreeMap<(u32, u32), (Option<f64>, Option<f64>)> {
    let mut out = BTreeMap::new();
    for line in table.lines() {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() < 5 {
            continue;
        }
        let (Ok(d), Ok(t)) = (cells[0].parse::<u32>(), cells[1].parse::<u32>()) else { continue };
        out.insert((d, t), (cells[3].parse().ok(), cells[4].parse().ok()));
    }
    out
}

/// The merged table: every shape either side measured, each side's forward and backward and our
/// ratio to SDPA where both are numbers.
pub fn merge(ours: &str, sdpa: &str) -> String {
    let (a, b) = (rows(ours), rows(sdpa));
    let mut keys: Vec<_> = a.keys().chain(b.keys()).copied().collect();
    keys.sort();
    keys.dedup();
    let num = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{v:.1}"));
    let ratio = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (Some(x), Some(y)) if y > 0.0 => format!("{:.2}", x / y),
        _ => "–".to_string(),
    };
    let mut s = String::from(
        "| head dim | seq | Ferrotron fwd | SDPA fwd | fwd ratio | Ferrotron bwd | SDPA bwd | bwd ratio |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for (d, t) in keys {
        let (of, ob) = a.get(&(d, t)).copied().unwrap_or((None, None));
        let (sf, sb) = b.get(&(d, t)).copied().unwrap_or((None, None));
        s.push_str(&format!(
            "| {d} | {t} | {} | {} | {} | {} | {} | {} |\n",
            num(of),
            num(sf),
            ratio(of, sf),
            num(ob),
            num(sb),
            ratio(ob, sb)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: &str = "| head dim | seq | batch × heads | fwd TFLOP/s | bwd TFLOP/s | bwd deterministic | fwd mma.sync | bwd mma.sync |\n\
|---|---|---|---|---|---|---|---|\n\
| 64 | 1024 | 16 × 32 | 250.0 | 239.5 | 190.0 | 120.0 | 110.0 |\n\
| 128 | 2048 | 8 × 16 | 460.0 | – | – | – | – |\n";
    const SDPA: &str = "| head dim | seq | batch × heads | SDPA fwd TFLOP/s | SDPA bwd TFLOP/s |\n\
|---|---|---|---|---|\n\
| 64 | 1024 | 16 × 32 | 290.0 | 225.0 |\n\
| 128 | 2048 | 8 × 16 | 466.4 | 377.1 |\n\
| 128 | 4096 | 4 × 16 | 537.0 | 454.7 |\n";

    #[test]
    fn rows_read_numbers_and_skip_headers() {
        let r = rows(OURS);
        assert_eq!(r.len(), 2);
        assert_eq!(r[&(64, 1024)], (Some(250.0), Some(239.5)));
        assert_eq!(r[&(128, 2048)], (Some(460.0), None));
    }

    #[test]
    fn merged_table_has_every_shape_and_the_ratios() {
        let m = merge(OURS, SDPA);
        let lines: Vec<&str> = m.lines().collect();
        assert_eq!(lines.len(), 2 + 3, "{m}");
        assert_eq!(lines[2], "| 64 | 1024 | 250.0 | 290.0 | 0.86 | 239.5 | 225.0 | 1.06 |");
        assert_eq!(lines[3], "| 128 | 2048 | 460.0 | 466.4 | 0.99 | – | 377.1 | – |");
        assert_eq!(lines[4], "| 128 | 4096 | – | 537.0 | – | – | 454.7 | – |");
    }
}
