//! A tensor written as pieces under one layout reads back under any other: every value against
//! the whole tensor the pieces were cut from (the oracle is plain indexing into it, through
//! `Piece::to_global`, which `piece.rs` checks against an exhaustive inverse). And damaged
//! checkpoints are named, not read.

use ferrotron_checkpoint::{CheckpointError, Piece, ShardEntry, ShardReader, Split, write_shard};
use ferrotron_core::{DType, bf16};
use proptest::prelude::*;
use std::borrow::Cow;
use std::path::{Path, PathBuf};

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrotron-shards-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The pieces of every rank of a `size`-way split (each part cut into `cuts` ranges) of `shape`;
/// a cut that holds nothing (more cuts than values) is no piece, as a rank that owns nothing of a
/// tensor writes nothing of it.
fn pieces(shape: &[usize], split: Option<(usize, usize, usize)>, cuts: usize) -> Vec<Piece> {
    let mut out = vec![];
    let ranks = split.map_or(1, |s| s.1);
    for rank in 0..ranks {
        let sp = split.map(|(dim, size, chunks)| Split { dim, rank, size, chunks, sizes: None });
        let part = Piece { global_shape: shape.to_vec(), split: sp, start: 0, len: 0 };
        let n: usize = part.part_shape().iter().product();
        for c in 0..cuts {
            let (a, b) = (n * c / cuts, n * (c + 1) / cuts);
            if b > a {
                out.push(Piece { start: a, len: b - a, ..part.clone() });
            }
        }
    }
    out
}

/// The values of `p` taken from the whole tensor `whole` (rows past `rows` as 0).
fn expected(p: &Piece, whole: &[f32], row: usize, rows: usize) -> Vec<f32> {
    p.range().map(|i| p.to_global(i).0).map(|g| if g / row < rows { whole[g] } else { 0.0 }).collect()
}

/// Writes `saved` pieces of `whole` (shape `shape`) over `files` files, one key; returns the reader.
fn save(
    dir: &Path,
    key: &str,
    shape: &[usize],
    whole: &[f32],
    saved: &[Piece],
    files: usize,
    dtype: DType,
) -> ShardReader {
    let mut list = vec![];
    for f in 0..files {
        let entries: Vec<ShardEntry> = saved
            .iter()
            .enumerate()
            .filter(|(k, _)| k % files == f)
            .map(|(_, p)| ShardEntry {
                key: key.to_string(),
                piece: p.clone(),
                dtype,
                values: Cow::Owned(expected(p, whole, 1, usize::MAX)),
            })
            .collect();
        let path = dir.join(format!("shard_{f:05}.safetensors"));
        let sha = write_shard(&path, &entries).unwrap();
        list.push((path, Some(sha)));
    }
    let _ = shape;
    ShardReader::open(&list).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn pieces_saved_under_one_layout_read_under_another(
        rows_a in 1usize..4, rows_b in 1usize..4, cols in 1usize..4, third in 1usize..3,
        dim in 0usize..2, chunks in 1usize..3, size_a in 1usize..4, size_b in 1usize..4,
        cuts_a in 1usize..4, cuts_b in 1usize..4, files in 1usize..4, bf in any::<bool>(), seed in 0u64..1000,
    ) {
        // Dims are multiples of every split; dim 0 differs between the layouts like a padded
        // vocabulary, the real rows being the smaller count.
        let unit = chunks * size_a * size_b;
        let (ra, rb) = (rows_a * unit, rows_b * unit);
        let c = cols * unit;
        let shape_a = vec![ra, c, third];
        let shape_b = vec![rb, c, third];
        let real = ra.min(rb);
        let row = c * third;
        let whole: Vec<f32> = (0..ra * row).map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 7.0 - 50.0).collect();
        let dir = tmp(&format!("prop-{seed}-{ra}-{rb}-{c}"));
        let dtype = if bf { DType::BF16 } else { DType::F32 };
        let saved = pieces(&shape_a, (size_a > 1 || chunks > 1).then_some((dim, size_a, chunks)), cuts_a);
        let reader = save(&dir, "w", &shape_a, &whole, &saved, files, dtype);
        prop_assert_eq!(reader.global_shape("w").unwrap(), &shape_a[..]);
        for want in pieces(&shape_b, Some((dim, size_b, chunks)), cuts_b) {
            let got = reader.read("w", &want, Some(real)).unwrap();
            let mut exp = expected(&want, &whole, row, real);
            if bf {
                exp.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
            }
            prop_assert_eq!(got, exp, "{:?}", want);
        }
        let (s, w) = reader.read_whole("w", Some(real)).unwrap();
        prop_assert_eq!(s[0], real);
        prop_assert_eq!(w.len(), real * row);
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn small(dir: &Path) -> (Vec<(PathBuf, Option<String>)>, Vec<f32>) {
    let whole: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let mut list = vec![];
    for p in pieces(&[4, 6], Some((0, 2, 1)), 1) {
        let path = dir.join(format!("shard_{:05}.safetensors", p.split.unwrap().rank));
        let e =
            ShardEntry { key: "w".into(), values: Cow::Owned(expected(&p, &whole, 6, 4)), piece: p, dtype: DType::F32 };
        let sha = write_shard(&path, &[e]).unwrap();
        list.push((path, Some(sha)));
    }
    (list, whole)
}

#[test]
fn damaged_or_mismatched_checkpoints_are_named() {
    let dir = tmp("damaged");
    let (list, whole) = small(&dir);
    let r = ShardReader::open(&list).unwrap();
    assert_eq!(r.read_whole("w", None).unwrap().1, whole);
    // Asked for what the model has and the checkpoint does not.
    let e = r.read("v", &Piece::whole(&[4, 6]), None).unwrap_err();
    assert!(matches!(e, CheckpointError::Missing(_)) && e.to_string().contains("`v`"), "{e}");
    let e = r.read("w", &Piece::whole(&[4, 8]), None).unwrap_err();
    assert!(e.to_string().contains("[4, 6]") && e.to_string().contains("[4, 8]"), "{e}");
    // A shard left out of the list: the rows it held are nowhere.
    let r = ShardReader::open(&list[..1]).unwrap();
    let e = r.read("w", &Piece::whole(&[4, 6]), None).unwrap_err();
    assert!(matches!(e, CheckpointError::Incomplete { index: 12, .. }), "{e}");
    // A flipped byte in the data: the checksum names the file (the header still parses).
    let bytes = std::fs::read(&list[1].0).unwrap();
    let mut flipped = bytes.clone();
    *flipped.last_mut().unwrap() ^= 1;
    std::fs::write(&list[1].0, &flipped).unwrap();
    let r = ShardReader::open(&list).unwrap();
    let e = r.read_whole("w", None).unwrap_err();
    assert!(matches!(e, CheckpointError::Checksum { .. }) && e.to_string().contains("shard_00001"), "{e}");
    // Values only rank 0's file holds still read: a rank hashes only the files it reads.
    let top = Piece {
        global_shape: vec![4, 6],
        split: Some(Split { dim: 0, rank: 0, size: 2, chunks: 1, sizes: None }),
        start: 0,
        len: 12,
    };
    assert_eq!(r.read("w", &top, None).unwrap(), whole[..12]);
    // Truncated: refused when opened.
    std::fs::write(&list[1].0, &bytes[..bytes.len() - 3]).unwrap();
    let e = ShardReader::open(&list).err().unwrap();
    assert!(matches!(e, CheckpointError::Corrupt { .. }) && e.to_string().contains("shard_00001"), "{e}");
    // A safetensors file that is not a shard (no piece map).
    let plain = dir.join("plain.safetensors");
    let data = [0u8; 8];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &data).unwrap();
    safetensors::serialize_to_file([("w", view)], None, &plain).unwrap();
    let e = ShardReader::open(&[(plain, None)]).err().unwrap();
    assert!(e.to_string().contains("not a Ferrotron shard"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_pieces_are_refused_when_written() {
    let dir = tmp("bad");
    let p = Piece::whole(&[2, 3]);
    let e = write_shard(
        &dir.join("a.safetensors"),
        &[ShardEntry { key: "w".into(), piece: p.clone(), dtype: DType::F32, values: Cow::Owned(vec![0.0; 5]) }],
    )
    .unwrap_err();
    assert!(e.to_string().contains("5 values for a piece of 6"), "{e}");
    let two = |p: &Piece| ShardEntry {
        key: "w".into(),
        piece: p.clone(),
        dtype: DType::F32,
        values: Cow::Owned(vec![0.0; 6]),
    };
    let e = write_shard(&dir.join("b.safetensors"), &[two(&p), two(&p)]).unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
    let e = write_shard(&dir.join("c.safetensors"), &[ShardEntry { dtype: DType::U32, ..two(&p) }]).unwrap_err();
    assert!(matches!(e, CheckpointError::Dtype { .. }), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}
