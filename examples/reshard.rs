//! The checkpoint crate on its own: a weight saved by two tensor-parallel ranks (rows split) is
//! read back by three ranks that split its columns, and whole, from the two shard files.
//!
//! Run: `cargo run --release -p ferrotron-examples --example reshard`

use ferrotron_checkpoint::{Piece, ShardEntry, ShardReader, Split, write_shard};
use ferrotron_core::DType;
use std::borrow::Cow;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shape = [8, 6];
    let whole: Vec<f32> = (0..48).map(|i| i as f32).collect();
    let dir = std::env::temp_dir().join(format!("ferrotron-reshard-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    // Saving: each of two ranks writes its half of the rows, as a run with a tensor-parallel
    // split of dim 0 would.
    let mut files = vec![];
    for rank in 0..2 {
        let split = Some(Split { dim: 0, rank, size: 2, chunks: 1, sizes: None });
        let piece = Piece { split, len: 24, ..Piece::whole(&shape) };
        let values = Cow::Borrowed(&whole[rank * 24..(rank + 1) * 24]);
        let path = dir.join(format!("rank{rank}.safetensors"));
        let sha = write_shard(&path, &[ShardEntry { key: "linear.weight".into(), piece, dtype: DType::F32, values }])?;
        println!("rank {rank} wrote {} (SHA-256 {}…)", path.display(), &sha[..12]);
        files.push((path, Some(sha)));
    }
    // Loading under another layout: three ranks, each two of the six columns.
    let reader = ShardReader::open(&files)?;
    for rank in 0..3 {
        let split = Some(Split { dim: 1, rank, size: 3, chunks: 1, sizes: None });
        let want = Piece { split, len: 16, ..Piece::whole(&shape) };
        let got = reader.read("linear.weight", &want, None)?;
        let expected: Vec<f32> = (0..8).flat_map(|r| (0..2).map(move |c| (r * 6 + 2 * rank + c) as f32)).collect();
        assert_eq!(got, expected);
        println!("column rank {rank}: {got:?}");
    }
    let (s, all) = reader.read_whole("linear.weight", None)?;
    assert_eq!((s.as_slice(), &all), (&shape[..], &whole));
    println!("whole {s:?}: as saved");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
