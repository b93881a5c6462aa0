//! Image-text pairs for LLaVA-style training: the records, the images as CLIP's processor prepares
//! them, and a split whose every sample is one record.
//!
//! Records: LLaVA-Pretrain's JSON (a list of `{"image": "00453/004539375.jpg", "conversations":
//! [{"from": "human", "value": "<image>\n…"}, {"from": "gpt", "value": "the caption"}]}`: the text
//! is the `gpt` turns), or JSON lines of `{"image": …, "text": …}` (or `"caption"`), image paths
//! relative to an image folder; or webdataset tar shards (what Megatron's Energon captioning
//! datasets are made of): files grouped by key (the name up to the first dot of its last
//! component), `KEY.jpg`/`.jpeg`/`.png` the image and `KEY.txt` (or `KEY.json` as a record above)
//! the text; images are read from the shard where they lie when a sample needs them. Images (JPEG or PNG): RGB, the shorter side resized to the
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

/// Where a record's image lies.
#[derive(Clone, Debug, PartialEq)]
pub enum ImageRef {
    File(PathBuf),
    /// `len` bytes from `offset` of a tar shard, the member `name`.
    Tar {
        shard: PathBuf,
        offset: u64,
        len: u64,
        name: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct ImageTextRecord {
    pub image: ImageRef,
    pub text: String,
}

fn bad(path: &Path, what: String) -> DataError {
    DataError::BadFile { path: path.to_path_buf(), what }
}

/// One record from its JSON: `image` and `text`, `caption` or the `gpt` turns of `conversations`.
fn record(v: &Value, folder: &Path, path: &Path, at: &str) -> Result<ImageTextRecord, DataError> {
    let image = v.get("image").and_then(Value::as_str).ok_or_else(|| bad(path, format!("{at}: no \"image\" path")))?;
    Ok(ImageTextRecord { image: ImageRef::File(folder.join(image)), text: text_of(v, path, at)? })
}

/// A record's text: `text`, `caption`, or the `gpt` turns of `conversations`.
fn text_of(v: &Value, path: &Path, at: &str) -> Result<String, DataError> {
    Ok(if let Some(t) = v.get("text").or_else(|| v.get("caption")).and_then(Value::as_str) {
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
    })
}

/// The records of `path`: a JSON list or JSON lines (image paths joined to `folder`), a
/// webdataset tar shard, or a folder of shards (`*.tar`, in name order).
pub fn read_image_text(path: &Path, folder: &Path) -> Result<Vec<ImageTextRecord>, DataError> {
    let io = |source| DataError::Io { path: path.to_path_buf(), source };
    if path.is_dir() {
        let mut shards: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "tar"))
            .collect();
        shards.sort();
        if shards.is_empty() {
            return Err(bad(path, "a folder without .tar shards".into()));
        }
        let mut out = vec![];
        for s in shards {
            out.extend(read_shard(&s)?);
        }
        return Ok(out);
    }
    if path.extension().is_some_and(|x| x == "tar") {
        return read_shard(path);
    }
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

/// A webdataset shard's records, in the order their keys first appear.
fn read_shard(path: &Path) -> Result<Vec<ImageTextRecord>, DataError> {
    use std::collections::HashMap;
    let io = |source| DataError::Io { path: path.to_path_buf(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut archive = tar::Archive::new(file);
    let (mut keys, mut images, mut texts) = (Vec::<String>::new(), HashMap::new(), HashMap::new());
    for entry in archive.entries().map_err(io)? {
        let mut e = entry.map_err(io)?;
        if !e.header().entry_type().is_file() {
            continue;
        }
        let name = e.path().map_err(io)?.to_string_lossy().into_owned();
        let base = name.rfind('/').map_or(0, |i| i + 1);
        let Some(dot) = name[base..].find('.') else { continue };
        let (key, ext) = (name[..base + dot].to_string(), name[base + dot + 1..].to_ascii_lowercase());
        if !images.contains_key(&key) && !texts.contains_key(&key) {
            keys.push(key.clone());
        }
        match ext.as_str() {
            "jpg" | "jpeg" | "png" => {
                let image =
                    ImageRef::Tar { shard: path.to_path_buf(), offset: e.raw_file_position(), len: e.size(), name };
                images.insert(key, image);
            }
            "txt" | "json" => {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut e, &mut s).map_err(io)?;
                let text = if ext == "txt" {
                    s.trim().to_string()
                } else {
                    let v: Value = serde_json::from_str(&s).map_err(|err| bad(path, format!("{name}: {err}")))?;
                    text_of(&v, path, &name)?
                };
                texts.insert(key, text);
            }
            _ => {}
        }
    }
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        match (images.remove(&key), texts.remove(&key)) {
            (Some(image), Some(text)) => out.push(ImageTextRecord { image, text }),
            (None, _) => return Err(bad(path, format!("sample `{key}` has no .jpg, .jpeg or .png image"))),
            (_, None) => return Err(bad(path, format!("sample `{key}` has no .txt or .json text"))),
        }
    }
    if out.is_empty() {
        return Err(bad(path, "no samples (KEY.jpg/.png with KEY.txt/.json)".into()));
    }
    Ok(out)
}

/// An image as [3, h, w] CLIP-normalised values.
pub fn load_image(image: &ImageRef, h: usize, w: usize) -> Result<Vec<f32>, DataError> {
    let decoded = match image {
        ImageRef::File(path) => image::ImageReader::open(path)
            .map_err(|source| DataError::Io { path: path.to_path_buf(), source })?
            .with_guessed_format()
            .map_err(|source| DataError::Io { path: path.to_path_buf(), source })?
            .decode(),
        ImageRef::Tar { shard, offset, len, .. } => {
            use std::io::{Read, Seek, SeekFrom};
            let io = |source| DataError::Io { path: shard.to_path_buf(), source };
            let mut f = std::fs::File::open(shard).map_err(io)?;
            f.seek(SeekFrom::Start(*offset)).map_err(io)?;
            let mut bytes = Vec::with_capacity(*len as usize);
            f.take(*len).read_to_end(&mut bytes).map_err(io)?;
            image::load_from_memory(&bytes)
        }
    };
    let img = decoded
        .map_err(|e| match image {
            ImageRef::File(p) => bad(p, format!("not a readable image: {e}")),
            ImageRef::Tar { shard, name, .. } => bad(shard, format!("{name}: not a readable image: {e}")),
        })?
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
        let v = load_image(&ImageRef::File(path.clone()), 4, 4).unwrap();
        assert_eq!(v.len(), 3 * 16);
        let at = |c: usize, y: usize, x: usize| v[c * 16 + y * 4 + x];
        let norm = |c: usize, x: f32| (x - CLIP_MEAN[c]) / CLIP_STD[c];
        assert!((at(0, 1, 0) - norm(0, 1.0)).abs() < 1e-5 && (at(2, 1, 0) - norm(2, 0.0)).abs() < 1e-5);
        assert!((at(0, 2, 3) - norm(0, 0.0)).abs() < 1e-5 && (at(2, 2, 3) - norm(2, 1.0)).abs() < 1e-5);
        let e = load_image(&ImageRef::File(d.join("missing.png")), 4, 4).unwrap_err().to_string();
        assert!(e.contains("missing.png"), "{e}");
        std::fs::write(d.join("bad.png"), b"not an image").unwrap();
        let e = load_image(&ImageRef::File(d.join("bad.png")), 4, 4).unwrap_err().to_string();
        assert!(e.contains("not a readable image"), "{e}");
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
        let want = ImageTextRecord { image: ImageRef::File("/imgs/00/a.jpg".into()), text: "a red fox".into() };
        assert_eq!(r, vec![want]);
        let lines = d.join("pairs.jsonl");
        std::fs::write(
            &lines,
            "{\"image\": \"b.png\", \"caption\": \"blue\"}\n\n{\"image\": \"c.png\", \"text\": \"green\"}\n",
        )
        .unwrap();
        let r = read_image_text(&lines, &d).unwrap();
        assert_eq!((r.len(), r[1].text.as_str(), r[1].image.clone()), (2, "green", ImageRef::File(d.join("c.png"))));
        std::fs::write(&lines, "{\"image\": \"b.png\"}\n").unwrap();
        let e = read_image_text(&lines, &d).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("no \"text\""), "{e}");
        let _ = std::fs::remove_dir_all(d);
    }

    /// A webdataset shard (KEY.png with KEY.txt or KEY.json, in a sub-folder as tar writers keep
    /// them): the records in key order, each image read from inside the shard equal to the file's.
    #[test]
    fn webdataset_shards_are_read_in_place() {
        let d = tmp("tar");
        let png = |name: &str, c: [u8; 3]| {
            let p = d.join(name);
            image::RgbImage::from_fn(4, 4, |x, y| image::Rgb([c[0], c[1].wrapping_add((x * 9 + y) as u8), c[2]]))
                .save(&p)
                .unwrap();
            p
        };
        let (a, b) = (png("a.png", [200, 10, 0]), png("b.png", [0, 20, 220]));
        let shard = d.join("shard-000.tar");
        let mut t = tar::Builder::new(std::fs::File::create(&shard).unwrap());
        t.append_path_with_name(&a, "s/000.png").unwrap();
        let mut add = |name: &str, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            t.append_data(&mut h, name, data).unwrap();
        };
        add("s/000.txt", b"a red square\n");
        add("s/001.json", br#"{"caption": "a blue one"}"#);
        t.append_path_with_name(&b, "s/001.png").unwrap();
        t.finish().unwrap();
        drop(t);
        let r = read_image_text(&shard, Path::new("/unused")).unwrap();
        assert_eq!((r.len(), r[0].text.as_str(), r[1].text.as_str()), (2, "a red square", "a blue one"));
        for (rec, file) in r.iter().zip([&a, &b]) {
            assert!(matches!(&rec.image, ImageRef::Tar { .. }));
            assert_eq!(load_image(&rec.image, 4, 4).unwrap(), load_image(&ImageRef::File(file.clone()), 4, 4).unwrap());
        }
        // A folder of shards reads them all; a sample without its text is named.
        assert_eq!(read_image_text(&d, Path::new("/unused")).unwrap().len(), 2);
        let lonely = d.join("lonely.tar");
        let mut t = tar::Builder::new(std::fs::File::create(&lonely).unwrap());
        t.append_path_with_name(&a, "007.png").unwrap();
        t.finish().unwrap();
        drop(t);
        let e = read_image_text(&lonely, Path::new("/unused")).unwrap_err().to_string();
        assert!(e.contains("`007` has no .txt"), "{e}");
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
