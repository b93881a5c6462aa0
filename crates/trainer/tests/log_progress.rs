//! --log-progress: progress.txt in the --save folder, as Megatron writes it. A run logs its start
//! and each checkpoint (iteration, throughputs, model FLOPs, tokens); a resumed run appends to the
//! same file and its FLOPs go on from the checkpoint's; under --async-save each save has its
//! hand-over line and, once committed, its `Saved async checkpoint` line.

mod common;

use common::*;
use ferrotron_trainer::checkpoint;
use ferrotron_trainer::settings::{Paths, TrainArgs};
use ferrotron_trainer::train::train;

/// progress.txt's lines, split at tabs, after the date, job id and GPU count (checked here).
fn events(dir: &std::path::Path) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(dir.join("progress.txt")).unwrap();
    text.lines()
        .map(|l| {
            let t: Vec<&str> = l.split('\t').collect();
            assert!(chrono::NaiveDateTime::parse_from_str(t[0], "%Y-%m-%d %H:%M:%S").is_ok(), "{l}");
            assert!(t[1].starts_with("Job ID: ") && t[2] == "# GPUs: 1", "{l}");
            t[3..].iter().map(|s| s.to_string()).collect()
        })
        .collect()
}

/// The value of `field` in a save line (`Name: value`).
fn value(e: &[String], field: &str) -> String {
    let f = e.iter().find(|f| f.starts_with(field)).unwrap_or_else(|| panic!("{field} in {e:?}"));
    f.split_once(": ").unwrap().1.to_string()
}

#[test]
fn progress_is_logged_per_job_and_checkpoint_and_goes_on_across_jobs() {
    let dir = tmp("log-progress");
    let paths = |load: bool, async_save: bool| Paths {
        save: Some(dir.clone()),
        load: load.then(|| dir.clone()),
        log_progress: true,
        async_save,
        ..Paths::default()
    };
    let args = tiny_args(true); // saves at 4 and 8
    let s = settings(&args);
    train(&s, &paths(false, false)).unwrap();
    let e = events(&dir);
    assert_eq!(e.len(), 3, "{e:?}");
    assert_eq!(e[0], ["Starting job"]);
    let flops = |e: &[String]| value(e, "Floating-point operations").parse::<f64>().unwrap();
    for (line, it) in [(&e[1], 4), (&e[2], 8)] {
        assert_eq!(line[0], "Saved checkpoint");
        assert_eq!(value(line, "Iteration"), it.to_string());
        // Python's format: a signed two-digit exponent.
        assert!(value(line, "Floating-point operations").contains("e+"), "{line:?}");
        assert!(value(line, "Job throughput").ends_with(" TFLOP/s/GPU"));
        let tokens = (it * s.global_batch_size as u64 * s.seq_length as u64) as f64 / 1e9;
        assert_eq!(value(line, "Tokens (in billions)"), format!("{tokens:.2}"));
    }
    // A constant batch: twice the samples, twice the FLOPs; the checkpoint keeps the count.
    let f4 = flops(&e[1]);
    assert!(f4 > 0.0 && (flops(&e[2]) - 2.0 * f4).abs() <= 0.01 * f4, "{e:?}");
    let kept = checkpoint::load_params(&dir).unwrap().state.floating_point_operations;
    assert!((kept - flops(&e[2])).abs() <= 0.01 * kept, "{kept} in the checkpoint");

    // Resumed to 12 iterations with --async-save: appended, the FLOPs going on from 8's.
    let more = settings(&TrainArgs { train_iters: Some(12), ..args });
    train(&more, &paths(true, true)).unwrap();
    let e = events(&dir);
    assert_eq!(e.len(), 6, "{e:?}");
    assert_eq!(e[3], ["Starting job"]);
    assert_eq!((e[4][0].as_str(), value(&e[4], "Iteration")), ("Saving async checkpoint", "12".into()));
    assert!((flops(&e[4]) - 3.0 * f4).abs() <= 0.01 * f4, "{e:?}");
    assert_eq!(e[5], ["Saved async checkpoint", "Iteration: 12"]);
    let _ = std::fs::remove_dir_all(dir);
}
