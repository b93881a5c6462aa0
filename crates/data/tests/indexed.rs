//! Megatron indexed datasets: a file written by an independent script (tests/fixtures), our own
//! writer's round trip, every corrupt-index case refused with the file named, and `--split`'s
//! bad spellings. (Sample order and the split and blend arithmetic: gpt_order.rs.)

use ferrotron_data::{
    DataError, GptDataset, IndexedBuilder, IndexedDataset, Sequences, TokenDtype, blend_split, parse_split,
    write_indexed,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron_tiny")
}

fn fixture_docs() -> Vec<Vec<u32>> {
    std::fs::read_to_string(fixture().with_extension("txt"))
        .unwrap()
        .lines()
        .map(|l| l.split(' ').map(|t| t.parse().unwrap()).collect())
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotron-indexed-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("data")
}

#[test]
fn reads_a_dataset_written_as_megatron_writes_it() {
    let docs = fixture_docs();
    let ds = IndexedDataset::open(fixture()).unwrap();
    assert_eq!(ds.dtype(), TokenDtype::U16);
    assert_eq!(ds.num_sequences(), docs.len());
    assert_eq!(ds.num_documents(), docs.len());
    let all: Vec<u32> = docs.concat();
    assert_eq!(ds.num_tokens(), all.len() as u64);
    let mut got = vec![0u32; all.len()];
    ds.read(0, &mut got).unwrap();
    assert_eq!(got, all);
    // Documents 3..7 are one range of tokens.
    let start: usize = docs[..3].iter().map(Vec::len).sum();
    let len: usize = docs[3..7].iter().map(Vec::len).sum();
    assert_eq!(ds.document_tokens(3..7), start as u64..(start + len) as u64);
    for (i, d) in docs.iter().enumerate() {
        assert_eq!((ds.sequence_length(i), ds.sequence_start(i)), (d.len() as u64, docs[..i].concat().len() as u64));
    }
    // Its samples, which cross sequence boundaries, are those of the same documents in memory.
    let ds = Arc::new(ds);
    let build =
        |s: Sequences| GptDataset::build("train", Arc::new(s), 2..docs.len(), Some(40), 16, 1234, None).unwrap();
    let (mapped, held) = (build(Sequences::Indexed(ds.clone())), build(Sequences::from_documents(&docs)));
    assert!(mapped.num_samples() >= 40);
    assert_eq!(mapped.num_samples(), held.num_samples());
    for i in 0..mapped.num_samples() {
        assert_eq!(mapped.sample(i).unwrap(), held.sample(i).unwrap(), "sample {i}");
    }
    assert!(ds.read(ds.num_tokens() - 2, &mut [0; 3]).is_err(), "a read past the end is refused");
}

#[test]
fn our_writer_round_trips_every_integer_type() {
    let docs: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![], vec![4, 120, 7, 0]];
    for dt in [TokenDtype::U8, TokenDtype::I8, TokenDtype::I16, TokenDtype::U16, TokenDtype::I32, TokenDtype::I64] {
        let p = scratch(&format!("rt{}", dt.code()));
        write_indexed(&p, &docs, dt).unwrap();
        let ds = IndexedDataset::open(&p).unwrap();
        assert_eq!((ds.dtype(), ds.num_documents()), (dt, 3));
        let mut got = vec![0; 7];
        ds.read(0, &mut got).unwrap();
        assert_eq!(got, docs.concat(), "{dt:?}");
        assert_eq!(ds.document_tokens(1..2), 3..3, "an empty document");
    }
    // The same bytes as the independent script for its documents.
    let p = scratch("same");
    write_indexed(&p, &fixture_docs(), TokenDtype::for_vocab(50257)).unwrap();
    for ext in ["bin", "idx"] {
        assert_eq!(
            std::fs::read(p.with_extension(ext)).unwrap(),
            std::fs::read(fixture().with_extension(ext)).unwrap()
        );
    }
    let err = write_indexed(scratch("big"), &[vec![300]], TokenDtype::U8).unwrap_err();
    assert!(matches!(err, DataError::TokenDoesNotFit { id: 300, .. }), "{err}");
}

/// Merging (Megatron's `add_index`): datasets added one after another are byte for byte the
/// dataset written from their documents in that order, the Megatron-written fixture and
/// documents of several sequences (sentence-split) alike; another token type or a multimodal
/// index is refused with the file named, and nothing is left behind.
#[test]
fn merged_datasets_are_their_documents_written_in_order() {
    let more: Vec<Vec<u32>> = vec![vec![9, 8], vec![], vec![7, 6, 5]];
    let b = scratch("merge-b");
    write_indexed(&b, &more, TokenDtype::U16).unwrap();
    let merged = scratch("merge-out");
    let mut m = IndexedBuilder::create(&merged, TokenDtype::U16).unwrap();
    for p in [fixture(), b.clone()] {
        m.add_dataset(&IndexedDataset::open(&p).unwrap()).unwrap();
    }
    assert_eq!(m.num_documents(), fixture_docs().len() + 3);
    m.finish().unwrap();
    let want = scratch("merge-want");
    write_indexed(&want, &[fixture_docs(), more].concat(), TokenDtype::U16).unwrap();
    let bytes = |p: &Path, ext: &str| std::fs::read(p.with_extension(ext)).unwrap();
    for ext in ["bin", "idx"] {
        assert_eq!(bytes(&merged, ext), bytes(&want, ext), "{ext}");
    }
    // Documents of several sequences: the document index is offset by the sequences before.
    let (x, y) = (scratch("merge-x"), scratch("merge-y"));
    let docs_x: Vec<Vec<Vec<u32>>> = vec![vec![vec![1, 2], vec![3]], vec![vec![4]]];
    let docs_y: Vec<Vec<Vec<u32>>> = vec![vec![vec![5, 6], vec![], vec![7]], vec![vec![8, 9]]];
    let write = |p: &Path, docs: &[Vec<Vec<u32>>]| {
        let mut w = IndexedBuilder::create(p, TokenDtype::I32).unwrap();
        for d in docs {
            w.add_sequences(&d.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
        }
        w.finish().unwrap();
    };
    write(&x, &docs_x);
    write(&y, &docs_y);
    let (xy, want) = (scratch("merge-xy"), scratch("merge-xy-want"));
    let mut m = IndexedBuilder::create(&xy, TokenDtype::I32).unwrap();
    m.add_dataset(&IndexedDataset::open(&x).unwrap()).unwrap();
    m.add_dataset(&IndexedDataset::open(&y).unwrap()).unwrap();
    m.finish().unwrap();
    write(&want, &[docs_x, docs_y].concat());
    for ext in ["bin", "idx"] {
        assert_eq!(bytes(&xy, ext), bytes(&want, ext), "{ext}");
    }
    let ds = IndexedDataset::open(&xy).unwrap();
    assert_eq!((ds.num_documents(), ds.num_sequences(), ds.num_tokens()), (4, 7, 9));
    assert_eq!(ds.document_tokens(2..3), 4..7, "the third document: 5, 6, 7");
    // Another token type, then a multimodal index: refused, the file named, no output left.
    let bad = scratch("merge-bad");
    let mut m = IndexedBuilder::create(&bad, TokenDtype::U16).unwrap();
    let e = m.add_dataset(&IndexedDataset::open(&x).unwrap()).unwrap_err().to_string();
    assert!(e.contains("merge-x") && e.contains("I32") && e.contains("U16"), "{e}");
    drop(m);
    assert!(!bad.with_extension("bin").exists() && !bad.with_extension("bin.tmp").exists());
    let mm = scratch("merge-mm");
    std::fs::copy(b.with_extension("bin"), mm.with_extension("bin")).unwrap();
    let mut idx = bytes(&b, "idx");
    idx.extend([0u8; 3]); // a mode byte for each of its three sequences
    std::fs::write(mm.with_extension("idx"), idx).unwrap();
    let mut m = IndexedBuilder::create(&bad, TokenDtype::U16).unwrap();
    let e = m.add_dataset(&IndexedDataset::open(&mm).unwrap()).unwrap_err().to_string();
    assert!(e.contains("merge-mm") && e.contains("multimodal"), "{e}");
}

/// Spoils the copied index and data files.
type Edit<'a> = Box<dyn FnOnce(&mut Vec<u8>, &mut Vec<u8>) + 'a>;

/// Copies the fixture, lets `edit` spoil the index or data, and returns `open`'s error text.
fn corrupt(name: &str, edit: impl FnOnce(&mut Vec<u8>, &mut Vec<u8>)) -> String {
    let p = scratch(name);
    let (mut idx, mut bin) = (
        std::fs::read(fixture().with_extension("idx")).unwrap(),
        std::fs::read(fixture().with_extension("bin")).unwrap(),
    );
    edit(&mut idx, &mut bin);
    std::fs::write(p.with_extension("idx"), &idx).unwrap();
    std::fs::write(p.with_extension("bin"), &bin).unwrap();
    match IndexedDataset::open(&p) {
        Ok(_) => panic!("{name}: a corrupt dataset opened"),
        Err(e) => {
            assert!(matches!(e, DataError::BadFile { .. }), "{name}: {e}");
            e.to_string()
        }
    }
}

#[test]
fn a_corrupt_index_or_data_file_is_refused_with_the_file_named() {
    let s = 12; // sequences in the fixture
    let ptr = move |k: usize| 34 + 4 * s + 8 * k;
    let doc = move |k: usize| 34 + 12 * s + 8 * k;
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("magic", Box::new(|i, _| i[0] = b'X'), "MMIDIDX"),
        ("version", Box::new(|i, _| i[9] = 2), "version 2"),
        ("float", Box::new(|i, _| i[17] = 7), "dtype code 7"),
        ("short", Box::new(|i, _| i.truncate(i.len() - 3)), "truncated"),
        ("bin-short", Box::new(|_, b| b.truncate(b.len() - 2)), "not one pair"),
        ("pointer", Box::new(move |i, _| i[ptr(5)] ^= 2), "sequence 5 starts at byte"),
        ("length", Box::new(|i, _| i[34 + 4 * 3 + 3] = 0x80), "negative length"),
        ("docs-end", Box::new(move |i, _| i[doc(s)] = 11), "document index"),
        ("docs-order", Box::new(move |i, _| i[doc(4)] = 9), "ends before it starts"),
    ];
    for (name, edit, says) in cases {
        let msg = corrupt(name, edit);
        assert!(msg.contains(says), "{name}: {msg}");
        assert!(
            msg.contains(&format!("ferrotron-indexed-{}-{name}", std::process::id())),
            "{name}: names the file: {msg}"
        );
    }
    let missing = IndexedDataset::open(scratch("none").with_file_name("absent")).err().unwrap();
    assert!(matches!(missing, DataError::Io { .. }) && missing.to_string().contains("absent.idx"), "{missing}");
}

#[test]
fn a_bad_split_is_refused() {
    for bad in ["", "1,x", "1,1,1,1", "0,0", "-1,2"] {
        assert!(matches!(parse_split(bad), Err(DataError::BadSplit(_))), "{bad:?}");
    }
}

/// `--data-cache-path`: the first build writes the indices, the second maps them and gives the
/// same samples; other settings get files of their own; indices that do not fit the dataset (a
/// file swapped in from another run) are refused with the file named.
#[test]
fn cached_indices_give_the_built_samples() {
    let docs = fixture_docs();
    let ds = Arc::new(IndexedDataset::open(fixture()).unwrap());
    let cache = scratch("cache").with_file_name("cache");
    let _ = std::fs::remove_dir_all(&cache);
    let build = |n: u64, seed: u32| {
        let seqs = Arc::new(Sequences::Indexed(ds.clone()));
        GptDataset::build("train", seqs, 1..docs.len(), Some(n), 16, seed, Some(&cache)).unwrap()
    };
    let npy = |dir: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "npy"))
            .collect();
        v.sort();
        v
    };
    let fresh =
        GptDataset::build("train", Arc::new(Sequences::Indexed(ds.clone())), 1..docs.len(), Some(30), 16, 7, None)
            .unwrap();
    let first = build(30, 7);
    let files = npy(&cache);
    assert_eq!(files.len(), 3, "document, sample and shuffle index: {files:?}");
    assert!(files.iter().all(|f| f.file_name().unwrap().to_str().unwrap().contains("-GPTDataset-train-")));
    let stamp = |f: &PathBuf| std::fs::metadata(f).unwrap().modified().unwrap();
    let written: Vec<_> = files.iter().map(stamp).collect();
    let second = build(30, 7);
    assert_eq!(files.iter().map(stamp).collect::<Vec<_>>(), written, "the second run reads, not rewrites");
    assert_eq!(second.num_samples(), fresh.num_samples());
    assert!(second.indices_mapped() && !first.indices_mapped(), "read back mapped, built in memory");
    for i in 0..fresh.num_samples() {
        let want = fresh.sample(i).unwrap();
        assert_eq!(first.sample(i).unwrap(), want, "sample {i}");
        assert_eq!(second.sample(i).unwrap(), want, "sample {i} from the cache");
    }
    // Another seed: three files more, the first three untouched.
    build(30, 8);
    assert_eq!(npy(&cache).len(), 6);
    // The seed-7 shuffle index replaced by the seed-8 one with more samples: refused, named.
    let (f7, f8) = {
        let all = npy(&cache);
        let shuffles: Vec<_> = all.into_iter().filter(|f| f.to_str().unwrap().ends_with("shuffle_index.npy")).collect();
        let seven = shuffles.iter().find(|f| files.contains(f)).unwrap().clone();
        let eight = shuffles.iter().find(|f| !files.contains(f)).unwrap().clone();
        (seven, eight)
    };
    build(60, 8);
    let more = npy(&cache)
        .into_iter()
        .find(|f| !files.contains(f) && f.to_str().unwrap().ends_with("shuffle_index.npy") && *f != f8);
    std::fs::copy(more.unwrap(), &f7).unwrap();
    let seqs = Arc::new(Sequences::Indexed(ds.clone()));
    let e = GptDataset::build("train", seqs, 1..docs.len(), Some(30), 16, 7, Some(&cache)).err().unwrap();
    assert!(matches!(e, DataError::BadCache { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("shuffle_index.npy") && msg.contains("delete it"), "{msg}");
    std::fs::remove_dir_all(&cache).unwrap();

    // Thread ranks of one process building the same indices at once into an empty folder: each
    // gets the built samples and the files left read back whole.
    let fresh = &fresh;
    let start = std::sync::Barrier::new(16);
    std::thread::scope(|sc| {
        for _ in 0..16 {
            sc.spawn(|| {
                start.wait();
                let d = build(30, 7);
                assert!((0..fresh.num_samples()).all(|i| d.sample(i).unwrap() == fresh.sample(i).unwrap()));
            });
        }
    });
    let d = build(30, 7);
    assert!((0..fresh.num_samples()).all(|i| d.sample(i).unwrap() == fresh.sample(i).unwrap()));
    let left: Vec<_> = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 4, "three indices and the description, no temporary file: {left:?}");
    std::fs::remove_dir_all(&cache).unwrap();
}

/// `--data-cache-path` with a blend: its picks (dataset_index, dataset_sample_index) are written
/// beside its parts' indices, read back mapped by the next run with the same samples; other weights
/// get files of their own; picks that do not fit the blend are refused with the file named.
#[test]
fn cached_blend_picks_give_the_built_samples() {
    let docs = fixture_docs();
    let ds = Arc::new(IndexedDataset::open(fixture()).unwrap());
    let cache = scratch("blend-cache").with_file_name("blend-cache");
    let _ = std::fs::remove_dir_all(&cache);
    let seqs = || Arc::new(Sequences::Indexed(ds.clone()));
    let half = docs.len() / 2;
    let build = |w: f64, cache: Option<&Path>| {
        let parts = vec![(Some(w), seqs(), 0..half), (Some(1.0), seqs(), half..docs.len())];
        blend_split("train", parts, 40, 16, 7, cache).unwrap()
    };
    let blend_files = |dir: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_str().unwrap().contains("-BlendedDataset-train-"))
            .collect();
        v.sort();
        v
    };
    let fresh = build(0.5, None);
    let first = build(0.5, Some(&cache));
    let files = blend_files(&cache);
    let names: Vec<String> = files.iter().map(|f| f.file_name().unwrap().to_str().unwrap().to_string()).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    for end in ["description.txt", "dataset_index.npy", "dataset_sample_index.npy"] {
        assert!(names.iter().any(|n| n.ends_with(end)), "{end} in {names:?}");
    }
    let second = build(0.5, Some(&cache));
    assert!(second.indices_mapped() && !first.indices_mapped(), "picks read back mapped, built in memory");
    assert_eq!(second.num_samples(), fresh.num_samples());
    for i in 0..fresh.num_samples() {
        let want = fresh.sample(i).unwrap();
        assert_eq!(first.sample(i).unwrap(), want, "sample {i}");
        assert_eq!(second.sample(i).unwrap(), want, "sample {i} from the cache");
    }
    // Other weights: a blend of its own (and parts of other sizes).
    build(2.0, Some(&cache));
    let both = blend_files(&cache);
    assert_eq!(both.len(), 6, "{both:?}");
    // The 0.5 blend's last pick pointed past its part's samples: refused, the file named.
    let ours = files.iter().find(|f| f.to_str().unwrap().ends_with("-dataset_sample_index.npy")).unwrap();
    let mut bytes = std::fs::read(ours).unwrap();
    let n = bytes.len();
    bytes[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(ours, &bytes).unwrap();
    let again = || {
        let parts = vec![(Some(0.5), seqs(), 0..half), (Some(1.0), seqs(), half..docs.len())];
        blend_split("train", parts, 40, 16, 7, Some(&cache)).err().expect("bad picks are refused")
    };
    let e = again();
    assert!(matches!(e, DataError::BadCache { .. }), "{e}");
    let msg = e.to_string();
    let last = format!("entry {} is sample {}", fresh.num_samples() - 1, u32::MAX);
    assert!(msg.contains("dataset_sample_index.npy") && msg.contains(&last) && msg.contains("delete it"), "{msg}");
    // Cut short: refused too.
    std::fs::write(ours, &bytes[..n - 2]).unwrap();
    let msg = again().to_string();
    assert!(msg.contains("dataset_sample_index.npy") && msg.contains("bytes of data"), "{msg}");
    std::fs::remove_dir_all(&cache).unwrap();
}
