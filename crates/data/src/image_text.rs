//! Image-text pairs for LLaVA-style training: the records, the images as CLIP's processor prepares
//! them, and a split whose every sample is one record.
//!
//! Records: LLaVA-Pretrain's JSON (a list of `{"image": "00453/004539375.jpg", "conversations":
//! [{"from": "human", "value": "<image>\n…"}, {"from": "gpt", "value": "the caption"}]}`: the text
//! is the `gpt` turns), or JSON lines of `{"image": …, "text": …}` (or `"caption"`). Image paths
//! are relative to an image folder. Images (JPEG or PNG): RGB, the shorter side resized to the
//! target's by bicubic (Catmull-Rom) filtering, centre-cropped, scaled to [0, 1] and normalised
//! with CLIP's mean and std, laid out [3, H, W] (close to transformers' CLIPImageProcessor,
//! whose PIL resize rounds differently: not bit for bit).

use crate::DataError;
use crate::dataset::TokenSplit;
use ferrotron_core::rng::Philox;
use image::imageops::FilterType;
use serde_json::Value;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// CLIP's (and LLaVA's) normalisation.
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

#[derive(Clone, Debug, PartialEq)]
pub struct ImageTextRecord {
    pub image: PathBuf,
    pub text: String,
}

fn bad(path: &Path, what: String) -> DataError {
    DataError::BadFile { path: path.to_path_buf(), what }
}

/// One record from its JSON: `image` and `text`, `caption` or the `gpt` turns of `conversations`.
fn record(v: &Value, folder: &Path, path: &Path, at: &str) -> Result<ImageTextRecord, DataError> {
    let image = v.get("image").and_then(Value::as_str).ok_or_else(|| bad(path, format!("{at}: no \"image\" path")))?;
    let text = if let Some(t) = v.get("text").or_else(|| v.get("caption")).and_then(Value::as_str) {
        t.to_string()
    } else if let Some(turns) = v.get("conversations").and_then(Value::as_array) {
        let gpt: Vec<&str> = turns
            .iter()
            .filter(|t| t.get("from").and_then(Value::as_str) == Some("gpt"))
            .filter_map(|t| t.get("value").and_then(Value::as_str))
            .collect();
        if gpt.is_empty() {
            return Err(bad(path, format!("{at}: no \"gpt\" turn in \"conversations\"")));
        }
        gpt.join("\n")
    } else {
        return Err(bad(path, format!("{at}: no \"text\", \"caption\" or \"conversations\"")));
    };
    Ok(ImageTextRecord { image: folder.join(image), text })
}

/// The records of `path` (a JSON list, or JSON lines), image paths joined to `folder`.
pub fn read_image_text(path: &Path, folder: &Path) -> Result<Vec<ImageTextRecord>, DataError> {
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
    let records = if text.trim_start().starts_with('[') {
        let v: Value =
            serde_json::from_str(&text).map_err(|e| bad(path, format!("not a JSON list of records: {e}")))?;
        let list = v.as_array().ok_or_else(|| bad(path, "not a JSON list of records".into()))?;
        list.iter()
            .enumerate()
            .map(|(i, r)| record(r, folder, path, &format!("record {i}")))
            .collect::<Result<_, _>>()?
    } else {
        let mut out = vec![];
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: Value = serde_json::from_str(line).map_err(|e| bad(path, format!("line {}: {e}", i + 1)))?;
            out.push(record(&v, folder, path, &format!("line {}", i + 1))?);
        }
        out
    };
    if records.is_empty() {
        return Err(bad(path, "no records".into()));
    }
    Ok(records)
}

/// An image file as [3, h, w] CLIP-normalised values.
pub fn load_image(path: &Path, h: usize, w: usize) -> Result<Vec<f32>, DataError> {
    let img = image::ImageReader::open(path)
        .map_err(|source| DataError::Io { path: path.to_path_buf(), source })?
        .with_guessed_format()
        .map_err(|source| DataError::Io { path: path.to_path_buf(), source })?
        .decode()
        .map_err(|e| bad(path, format!("not a readable image: {e}")))?
        .to_rgb8();
    let (iw, ih) = (img.width() as f64, img.height() as f64);
    // The shorter side to the target's, the other in proportion, then the centre crop.
    let scale = (w as f64 / iw).max(h as f64 / ih);
    let (rw, rh) = (((iw * scale).round() as u32).max(w as u32), ((ih * scale).round() as u32).max(h as u32));
    let resized = image::imageops::resize(&img, rw, rh, FilterType::CatmullRom);
    let (x0, y0) = ((rw - w as u32) / 2, (rh - h as u32) / 2);
    let mut out = vec![0f32; 3 * h * w];
    for y in 0..h {
        for x in 0..w {
            let p = resized.get_pixel(x0 + x as u32, y0 + y as u32);
            for c in 0..3 {
                out[c * h * w + y * w + x] = (p[c] as f32 / 255.0 - CLIP_MEAN[c]) / CLIP_STD[c];
            }
        }
    }
    Ok(out)
}

/// Text tokens of a record as a sample of `seq` + 1 tokens: the tokens, then end-of-document, then
/// end-of-document padding (cut at `seq` + 1); and how many of its `seq` labels count (through
/// the first end-of-document).
pub fn record_tokens(tokens: &[u32], eod: u32, seq: usize) -> (Vec<u32>, usize) {
    let mut s: Vec<u32> = tokens.iter().copied().take(seq + 1).collect();
    // Inputs 0..len−1 predict the tokens after them and, last, the end-of-document.
    let counted = s.len().min(seq);
    s.resize(seq + 1, eod);
    (s, counted)
}

/// A split of `num_samples` samples over records `range` of `records` (their text tokens, one
/// sample each: `record_tokens` at `seq`), the records in a fresh seeded order every epoch.
pub fn record_split(
    name: &'static str,
    records: Arc<Vec<Vec<u32>>>,
    range: Range<usize>,
    num_samples: usize,
    (seq, eod, seed): (usize, u32, u64),
) -> TokenSplit {
    let n = range.len();
    let mut picks = Vec::with_capacity(num_samples);
    let mut epoch = 0u64;
    while picks.len() < num_samples && n > 0 {
        let mut order: Vec<u32> = (range.start as u32..range.end as u32).collect();
        let rng = Philox::new(seed).with_stream(epoch);
        for i in (1..n).rev() {
            let j = rng.u32_at(i as u64) as usize % (i + 1);
            order.swap(i, j);
        }
        picks.extend(order.into_iter().take(num_samples - picks.len()));
        epoch += 1;
    }
    TokenSplit::records(name, records, picks, seq, eod)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferrotron-image-text-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A 6 × 4 PNG (wider than high): left half red, right half blue. Resized to 4 × 4 with the
    /// shorter side kept, the centre crop's left column is red and its right column blue.
    #[test]
    fn an_image_is_resized_cropped_and_normalised_as_clip_does() {
        let d = tmp("png");
        let img = image::RgbImage::from_fn(
            6,
            4,
            |x, _| if x < 3 { image::Rgb([255, 0, 0]) } else { image::Rgb([0, 0, 255]) },
        );
        let path = d.join("a.png");
        img.save(&path).unwrap();
        let v = load_image(&path, 4, 4).unwrap();
        assert_eq!(v.len(), 3 * 16);
        let at = |c: usize, y: usize, x: usize| v[c * 16 + y * 4 + x];
        let norm = |c: usize, x: f32| (x - CLIP_MEAN[c]) / CLIP_STD[c];
        assert!((at(0, 1, 0) - norm(0, 1.0)).abs() < 1e-5 && (at(2, 1, 0) - norm(2, 0.0)).abs() < 1e-5);
        assert!((at(0, 2, 3) - norm(0, 0.0)).abs() < 1e-5 && (at(2, 2, 3) - norm(2, 1.0)).abs() < 1e-5);
        let e = load_image(&d.join("missing.png"), 4, 4).unwrap_err().to_string();
        assert!(e.contains("missing.png"), "{e}");
        std::fs::write(d.join("bad.png"), b"not an image").unwrap();
        assert!(load_image(&d.join("bad.png"), 4, 4).unwrap_err().to_string().contains("not a readable image"));
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn records_read_from_llava_json_and_json_lines() {
        let d = tmp("records");
        let json = d.join("pretrain.json");
        std::fs::write(
            &json,
            r#"[{"id": "1", "image": "00/a.jpg", "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "a red fox"}]}]"#,
        )
        .unwrap();
        let r = read_image_text(&json, Path::new("/imgs")).unwrap();
        assert_eq!(r, vec![ImageTextRecord { image: "/imgs/00/a.jpg".into(), text: "a red fox".into() }]);
        let lines = d.join("pairs.jsonl");
        std::fs::write(
            &lines,
            "{\"image\": \"b.png\", \"caption\": \"blue\"}\n\n{\"image\": \"c.png\", \"text\": \"green\"}\n",
        )
        .unwrap();
        let r = read_image_text(&lines, &d).unwrap();
        assert_eq!((r.len(), r[1].text.as_str(), r[1].image.clone()), (2, "green", d.join("c.png")));
        std::fs::write(&lines, "{\"image\": \"b.png\"}\n").unwrap();
        let e = read_image_text(&lines, &d).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("no \"text\""), "{e}");
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn a_record_split_takes_every_record_once_an_epoch() {
        let (s, counted) = record_tokens(&[5, 6, 7], 0, 6);
        assert_eq!((s, counted), (vec![5, 6, 7, 0, 0, 0, 0], 3));
        assert_eq!(record_tokens(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 0, 4), (vec![1, 2, 3, 4, 5], 4));
        let records = Arc::new((0..7).map(|i| vec![i, i]).collect::<Vec<_>>());
        let split = record_split("train", records, 1..6, 12, (3, 99, 3));
        assert_eq!(split.num_samples(), 12);
        let epoch = |e: usize| (5 * e..5 * e + 5).map(|i| split.record(i).unwrap()).collect::<Vec<_>>();
        let first = epoch(0);
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(sorted, vec![1, 2, 3, 4, 5], "the range's records, each once");
        assert_ne!(first, sorted, "shuffled");
        assert_ne!(epoch(1), first, "another order the next epoch");
        let r = first[3] as u32;
        assert_eq!(split.sample(3).unwrap(), vec![r, r, 99, 99]);
    }
}
