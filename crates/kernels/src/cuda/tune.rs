//! Picking a GEMM's algorithm by timing cuBLASLt's candidates on the problem's first call (as
//! cuDNN's benchmark mode does), instead of taking the heuristic's first. The choice is cached with
//! the problem (`lt`), so the timing runs once per shape per process, inside the first step.
//!
//! By default only the dGeLU product (fc2's input gradient) is tuned; `FERROTRON_GEMM_TUNE=1`
//! tunes every product, `=0` none (and stored choices are not read either). On the H200 single shapes gained up to 1.2× in isolation (the
//! LM head's forward, the dGeLU product), yet in a running step under the card's 700 W cap most
//! choices timed alone ran no faster or slower (GPU timelines, benches/NOTES.md session 17: 1.3B
//! GEMMs 185.4 ms a step untuned, 186.4–188.3 all tuned). The dGeLU product is the exception: the
//! heuristic's first is an older kernel, and the tuned one ran 0.85–0.86 against 0.91 ms a 1.3B
//! layer in the step (124M 0.163 against 0.173). Timings differ from run to run, and so can the
//! choice and the last bits of the products: deterministic mode (`set_deterministic`) never tunes.
//!
//! `FERROTRON_GEMM_TUNE_HOLD_MS=T` times every product's candidates under sustained load instead
//! (each repeated back to back for T ms, timed over the second half: the clock a running step
//! holds the power-capped card at; session 21: 124M +1.0%, the LM head forward 1793 → 1576 µs),
//! and stores the choices on disk (`choices`), where later runs take them without timing.

use cudarc::driver::{CudaSlice, CudaStream, sys::CUevent_flags};
use ferrotron_core::Result;
use std::sync::Arc;

/// How many of the heuristic's algorithms are asked for and timed: 8, or
/// `FERROTRON_GEMM_CANDIDATES` (1 to 64, checked at start by `lab_env`; a stored choice is a
/// place in the heuristic's best-first list, so choices stored with fewer stay valid with more).
pub(crate) fn candidates() -> usize {
    static ENV: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ENV.get_or_init(|| {
        std::env::var("FERROTRON_GEMM_CANDIDATES")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(8, |n: usize| n.clamp(1, 64))
    })
}

/// Rounds over all candidates, one timed run of each per round (after one untimed run each).
const ROUNDS: usize = 3;

thread_local! {
    static TUNE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether this thread's GEMMs, all of them, time the candidate algorithms of a new shape
/// (default: the dGeLU product only, or as `FERROTRON_GEMM_TUNE` says; never in deterministic
/// mode). Tests set it to run both ways.
pub fn set_gemm_tuning(on: bool) {
    TUNE.with(|t| t.set(Some(on)));
}

/// This thread's `set_gemm_tuning`, else `FERROTRON_GEMM_TUNE` (1 or 0), else None.
fn all() -> Option<bool> {
    static ENV: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    TUNE.with(|t| t.get()).or_else(|| {
        *ENV.get_or_init(|| match std::env::var("FERROTRON_GEMM_TUNE").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        })
    })
}

/// Whether a new shape's candidates are timed; `dgelu`: the product has the dGeLU epilogue.
pub(crate) fn enabled(dgelu: bool) -> bool {
    (all().unwrap_or(dgelu) || hold_ms().is_some()) && !super::deterministic()
}

/// Whether tuning is off altogether (`FERROTRON_GEMM_TUNE=0` or `set_gemm_tuning(false)`, no hold
/// asked for): the heuristic's first for every product, stored choices (`choices`) left unread.
pub(crate) fn off() -> bool {
    all() == Some(false) && hold_ms().is_none()
}

/// `FERROTRON_GEMM_TUNE_HOLD_MS`: each candidate timed over this many milliseconds of back-to-back
/// runs, and the choices stored.
pub(crate) fn hold_ms() -> Option<f32> {
    static ENV: std::sync::OnceLock<Option<f32>> = std::sync::OnceLock::new();
    *ENV.get_or_init(|| std::env::var("FERROTRON_GEMM_TUNE_HOLD_MS").ok()?.parse().ok().filter(|&ms: &f32| ms > 0.0))
}

/// An uncleared buffer to time products in when they may not write their real output (they
/// accumulate into it); None when the memory is not there (the heuristic's first is taken then).
pub(crate) fn scratch(stream: &Arc<CudaStream>, bytes: usize) -> Option<CudaSlice<u8>> {
    // SAFETY: device memory of plain bytes, read (as C) and written only by the products being
    // timed, whose values are never used.
    unsafe { stream.alloc::<u8>(bytes) }.ok()
}

/// One problem's timing: what `gemm_tuning_report` lists.
#[derive(Clone, Debug)]
pub struct Tuned {
    /// The problem as cuBLASLt sees it (column-major m×n×k, transposes, epilogue, output type).
    pub problem: String,
    /// Candidates timed.
    pub candidates: usize,
    /// Milliseconds per product of the heuristic's first and of the one chosen.
    pub first_ms: f32,
    pub best_ms: f32,
    /// The chosen one's place in the heuristic's order (0: its first).
    pub best: usize,
}

static REPORT: std::sync::Mutex<Vec<Tuned>> = std::sync::Mutex::new(Vec::new());

/// Every problem timed in this process so far, in order.
pub fn gemm_tuning_report() -> Vec<Tuned> {
    REPORT.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The candidate whose `launch` takes least time on `stream` (the first when timing fails; a
/// candidate that fails to launch is passed over). Each is launched once untimed, then timed once
/// per round, the rounds going over all candidates in turn so that a clock falling as the card
/// warms weighs on each alike; a candidate's time is its best round's.
pub(crate) fn fastest<A: Copy>(
    stream: &Arc<CudaStream>,
    problem: impl FnOnce() -> String,
    cands: &[A],
    launch: impl Fn(&A) -> Result<()>,
) -> A {
    let times = time_all(stream, cands.len(), |i| launch(&cands[i]));
    let best = (0..cands.len()).min_by(|&i, &j| times[i].total_cmp(&times[j])).unwrap_or(0);
    if times[best].is_finite() {
        let t = Tuned { problem: problem(), candidates: cands.len(), first_ms: times[0], best_ms: times[best], best };
        REPORT.lock().unwrap_or_else(|e| e.into_inner()).push(t);
    }
    cands[best]
}

/// Each candidate's best time in milliseconds over ROUNDS (infinite where it failed to launch or
/// the events failed).
fn time_all(stream: &Arc<CudaStream>, n: usize, launch: impl Fn(usize) -> Result<()>) -> Vec<f32> {
    let ok: Vec<bool> = (0..n).map(|i| launch(i).is_ok()).collect();
    if let Some(hold) = hold_ms() {
        return (0..n).map(|i| if ok[i] { held(stream, hold, || launch(i)) } else { f32::INFINITY }).collect();
    }
    let event = || stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok();
    let mut marks = Vec::with_capacity(ROUNDS * n);
    for _ in 0..ROUNDS {
        for i in (0..n).filter(|&i| ok[i]) {
            let start = event();
            let ran = launch(i).is_ok();
            marks.push((i, start, event().filter(|_| ran)));
        }
    }
    let mut best = vec![f32::INFINITY; n];
    for (i, start, end) in marks {
        if let (Some(s), Some(e)) = (start, end)
            && let Ok(ms) = s.elapsed_ms(&e)
        {
            best[i] = best[i].min(ms);
        }
    }
    best
}

/// One candidate's milliseconds per product under `hold` ms of back-to-back runs: the mean over
/// the second half (the first is the clock settling). A batch is always queued behind the one
/// being waited on, so the card never idles. Infinite when a launch or event fails.
fn held(stream: &Arc<CudaStream>, hold: f32, launch: impl Fn() -> Result<()>) -> f32 {
    const BATCH: usize = 16;
    let batch = || -> Option<_> {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok()?;
        for _ in 0..BATCH {
            launch().ok()?;
        }
        Some((start, stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok()?))
    };
    let (mut spent, mut settled) = (0f32, Vec::new());
    let Some(mut queued) = batch() else { return f32::INFINITY };
    while spent < hold {
        let Some(next) = batch() else { return f32::INFINITY };
        let Ok(ms) = queued.0.elapsed_ms(&queued.1) else { return f32::INFINITY };
        queued = next;
        spent += ms;
        if spent >= hold / 2.0 {
            settled.push(ms);
        }
    }
    let _ = queued.1.synchronize();
    settled.iter().sum::<f32>() / (settled.len() * BATCH).max(1) as f32
}
