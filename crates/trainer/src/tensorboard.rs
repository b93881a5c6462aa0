//! TensorBoard event files for `--tensorboard-dir` (what Megatron's SummaryWriter writes): a file
//! `events.out.tfevents.<seconds>.<host>` of TFRecord records, each an `Event` protocol buffer,
//! the first naming the file version and every other one scalar (`Summary.Value.simple_value`).
//!
//! TFRecord framing: length (u64 LE), masked CRC-32C of those 8 bytes, the data, masked CRC-32C
//! of the data; the mask is ((crc >> 15) | (crc << 17)) + 0xa282ead8. The protos are written by
//! hand (three messages, five fields), proto3's way: fields in number order, zero values left
//! out (a oneof's value kept). Checked byte for byte against TensorBoard's own writer (tests/fixtures/tensorboard).

use anyhow::Context;
use std::io::Write;
use std::path::{Path, PathBuf};

const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

fn masked_crc(data: &[u8]) -> u32 {
    let c = CRC32C.checksum(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    varint(out, (field << 3 | 2) as u64);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// An `Event`: wall_time (1, double), step (2, int64), file_version (3, string) or summary (5).
fn event(wall_time: f64, step: i64, body: EventBody) -> Vec<u8> {
    let mut e = Vec::new();
    if wall_time != 0.0 {
        e.push(1 << 3 | 1);
        e.extend_from_slice(&wall_time.to_le_bytes());
    }
    if step != 0 {
        e.push(2 << 3);
        varint(&mut e, step as u64);
    }
    match body {
        EventBody::FileVersion(v) => bytes_field(&mut e, 3, v.as_bytes()),
        EventBody::Scalar(tag, value) => {
            // Summary { value: [Value { tag (1), simple_value (2, float) }] }; simple_value is
            // in a oneof, so written even at zero.
            let mut v = Vec::new();
            bytes_field(&mut v, 1, tag.as_bytes());
            v.push(2 << 3 | 5);
            v.extend_from_slice(&value.to_le_bytes());
            let mut summary = Vec::new();
            bytes_field(&mut summary, 1, &v);
            bytes_field(&mut e, 5, &summary);
        }
    }
    e
}

enum EventBody<'a> {
    FileVersion(&'a str),
    Scalar(&'a str, f32),
}

/// One event file, written as scalars come and flushed at `flush` (each log line).
pub struct EventWriter {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
}

impl EventWriter {
    /// A new event file in `dir` (made if absent), its version record written with `wall_time`.
    pub fn create(dir: &Path, wall_time: f64) -> anyhow::Result<EventWriter> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--tensorboard-dir {}: cannot create it", dir.display()))?;
        let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()).unwrap_or_else(|| "localhost".into());
        let path = dir.join(format!("events.out.tfevents.{}.{host}", wall_time as u64));
        let file = std::fs::File::create(&path)
            .with_context(|| format!("--tensorboard-dir: cannot write {}", path.display()))?;
        let mut w = EventWriter { file: std::io::BufWriter::new(file), path };
        w.record(&event(wall_time, 0, EventBody::FileVersion("brain.Event:2")))?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Scalar `tag` = `value` at `step` (an iteration, or a sample count for the "vs samples" tags).
    pub fn scalar(&mut self, tag: &str, value: f32, step: i64, wall_time: f64) -> anyhow::Result<()> {
        self.record(&event(wall_time, step, EventBody::Scalar(tag, value)))
    }

    pub fn flush(&mut self) -> anyhow::Result<()> {
        self.file.flush().with_context(|| format!("writing {}", self.path.display()))
    }

    fn record(&mut self, data: &[u8]) -> anyhow::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut r = Vec::with_capacity(data.len() + 16);
        r.extend_from_slice(&len);
        r.extend_from_slice(&masked_crc(&len).to_le_bytes());
        r.extend_from_slice(data);
        r.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file.write_all(&r).with_context(|| format!("writing {}", self.path.display()))
    }
}

/// A run's event file: each metric line's scalars under Megatron's tags.
pub struct RunEvents {
    w: EventWriter,
    interval: u64,
    ppl: bool,
    timers: bool,
    seq_length: u64,
    /// `--log-world-size-to-tensorboard`: the number of ranks.
    world_size: Option<usize>,
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl RunEvents {
    pub fn create(dir: &Path, s: &crate::settings::Settings, world: usize) -> anyhow::Result<RunEvents> {
        Ok(RunEvents {
            w: EventWriter::create(dir, now())?,
            interval: s.tensorboard_log_interval as u64,
            ppl: s.log_validation_ppl_to_tensorboard,
            timers: s.log_timers_to_tensorboard,
            seq_length: s.seq_length as u64,
            world_size: s.log_world_size_to_tensorboard.then_some(world),
        })
    }

    /// The scalars of one metric line: a training log line at a multiple of the interval (each
    /// value at the iteration and, "vs samples", at the samples consumed), or an evaluation.
    pub fn write(&mut self, m: &crate::train::Metric) -> anyhow::Result<()> {
        use crate::train::Metric;
        let t = now();
        match *m {
            Metric::Train {
                iteration,
                loss,
                lr,
                decoupled_lr,
                grad_norm,
                tokens_per_s,
                consumed_samples,
                global_batch_size,
                load_balancing_loss,
                z_loss,
                ref moe_layer_losses,
                ref mtp_losses,
                tflops_per_gpu,
                params_norm,
                num_zeros_in_grad,
                memory,
                ..
            } => {
                if iteration % self.interval != 0 {
                    return Ok(());
                }
                let (it, samples) = (iteration as i64, consumed_samples as i64);
                for (tag, v) in [
                    ("learning-rate", lr),
                    ("batch-size", global_batch_size as f64),
                    ("lm loss", loss),
                    ("grad-norm", grad_norm),
                ] {
                    self.w.scalar(tag, v as f32, it, t)?;
                    self.w.scalar(&format!("{tag} vs samples"), v as f32, samples, t)?;
                }
                if let Some(v) = decoupled_lr {
                    // Megatron's tag (at the iteration).
                    self.w.scalar("decoupled-learning-rate", v as f32, it, t)?;
                }
                for (tag, v) in [("params-norm", params_norm), ("num-zeros", num_zeros_in_grad)] {
                    if let Some(v) = v {
                        self.w.scalar(tag, v as f32, it, t)?;
                        self.w.scalar(&format!("{tag} vs samples"), v as f32, samples, t)?;
                    }
                }
                // Megatron's memory tags, at the iteration only (its mem-allocated-count has no
                // counterpart: the pool does not count allocations).
                if let Some(m) = memory {
                    for (tag, v) in [
                        ("mem-reserved-bytes", m.mem_reserved_bytes),
                        ("mem-allocated-bytes", m.mem_allocated_bytes),
                        ("mem-max-allocated-bytes", m.mem_max_allocated_bytes),
                    ] {
                        self.w.scalar(tag, v as f32, it, t)?;
                    }
                }
                for (tag, v) in
                    [("load_balancing_loss", load_balancing_loss), ("z_loss", z_loss), ("throughput", tflops_per_gpu)]
                {
                    if let Some(v) = v {
                        self.w.scalar(tag, v as f32, it, t)?;
                    }
                }
                // --moe-per-layer-logging, Megatron's tags (at the iteration).
                for (i, &(lb, z)) in moe_layer_losses.iter().enumerate() {
                    self.w.scalar(&format!("moe/load_balancing_loss_layer_{i}"), lb as f32, it, t)?;
                    self.w.scalar(&format!("moe/z_loss_layer_{i}"), z as f32, it, t)?;
                }
                for (k, &l) in mtp_losses.iter().enumerate() {
                    // Megatron's tag.
                    self.w.scalar(&format!("mtp_{} loss", k + 1), l as f32, it, t)?;
                }
                if let Some(w) = self.world_size {
                    self.w.scalar("world-size", w as f32, it, t)?;
                }
                if self.timers && tokens_per_s > 0.0 {
                    let secs = (global_batch_size * self.seq_length) as f64 / tokens_per_s;
                    self.w.scalar("iteration-time", secs as f32, it, t)?;
                }
            }
            Metric::Eval { iteration, loss, consumed_samples } => {
                let (it, samples) = (iteration as i64, consumed_samples as i64);
                self.w.scalar("lm loss validation", loss as f32, it, t)?;
                self.w.scalar("lm loss validation vs samples", loss as f32, samples, t)?;
                if self.ppl {
                    let ppl = loss.min(20.0).exp() as f32;
                    self.w.scalar("lm loss validation ppl", ppl, it, t)?;
                    self.w.scalar("lm loss validation ppl vs samples", ppl, samples, t)?;
                }
            }
        }
        self.w.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_answer() {
        // The CRC-32C check value (RFC 3720's polynomial on "123456789").
        assert_eq!(CRC32C.checksum(b"123456789"), 0xE306_9283);
        let mut v = Vec::new();
        varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
    }
}
