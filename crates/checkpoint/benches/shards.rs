//! Shard write and read throughput (`cargo xtask bench --checkpoint`): one 4096 × 4096 weight
//! (64 MiB of f32) written as a rank's shard, then read back whole and under other layouts.
//! The file stays in the page cache, so this measures our path (encoding, the safetensors
//! write, SHA-256, the run-by-run index walk), not the disk.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ferrotron_checkpoint::{Piece, ShardEntry, ShardReader, Split, write_shard};
use ferrotron_core::DType;
use std::borrow::Cow;
use std::hint::black_box;

const N: usize = 4096;

fn part(dim: usize, rank: usize, size: usize) -> Piece {
    let whole = Piece::whole(&[N, N]);
    let split = Some(Split { dim, rank, size, chunks: 1, sizes: None });
    Piece { split, len: N * N / size, ..whole }
}

fn shards(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("ferrotron-bench-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("bench folder");
    let values: Vec<f32> = (0..N * N).map(|i| (i % 1009) as f32 * 0.01).collect();
    let mut g = c.benchmark_group("shard");
    g.sample_size(10);
    g.throughput(Throughput::Bytes((N * N * 4) as u64));
    for dtype in [DType::F32, DType::BF16] {
        let path = dir.join(format!("w-{dtype}.safetensors"));
        g.bench_function(format!("write {dtype} 4096x4096"), |b| {
            b.iter(|| {
                let e =
                    ShardEntry { key: "w".into(), piece: Piece::whole(&[N, N]), dtype, values: Cow::Borrowed(&values) };
                write_shard(black_box(&path), &[e]).expect("write")
            })
        });
    }
    // Read back: the whole tensor written as two tensor-parallel row parts (one file each).
    let files: Vec<_> = (0..2)
        .map(|r| {
            let p = part(0, r, 2);
            let v = &values[r * N * N / 2..(r + 1) * N * N / 2];
            let path = dir.join(format!("rows-{r}.safetensors"));
            let sha = write_shard(
                &path,
                &[ShardEntry { key: "w".into(), piece: p, dtype: DType::F32, values: Cow::Borrowed(v) }],
            )
            .expect("write");
            (path, Some(sha))
        })
        .collect();
    let reader = ShardReader::open(&files).expect("open");
    g.bench_function("read whole from 2 row parts", |b| b.iter(|| reader.read_whole("w", None).expect("read")));
    g.bench_function("read as 4 row parts", |b| {
        b.iter(|| (0..4).map(|r| reader.read("w", &part(0, r, 4), None).expect("read").len()).sum::<usize>())
    });
    g.bench_function("read as 4 column parts", |b| {
        b.iter(|| (0..4).map(|r| reader.read("w", &part(1, r, 4), None).expect("read").len()).sum::<usize>())
    });
    g.finish();
    let _ = std::fs::remove_dir_all(dir);
}

criterion_group!(benches, shards);
criterion_main!(benches);
