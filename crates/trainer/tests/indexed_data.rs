//! `--data-path`: training on Megatron indexed datasets. The oracle is the built-in corpus: its
//! documents written as PREFIX.bin/.idx and cut by the `--split` that matches the corpus's own
//! split must train to the same losses, bit for bit, as the corpus held in memory.

use ferrotron_data::{TokenDtype, Tokenizer, TokenizerKind, corpus, write_indexed};
use ferrotron_trainer::settings::{Paths, Settings, TrainArgs};
use ferrotron_trainer::train::{Summary, train};
use std::path::PathBuf;

const DOCS: usize = 2000;

fn args() -> TrainArgs {
    TrainArgs {
        preset: Some("tiny".into()),
        train_iters: Some(6),
        eval_interval: Some(3),
        eval_iters: Some(2),
        corpus_docs: Some(DOCS),
        no_progress: true,
        ..TrainArgs::default()
    }
}

fn run(a: TrainArgs) -> anyhow::Result<Summary> {
    let (s, _): (Settings, Paths) = Settings::resolve(&a)?;
    s.validate()?;
    train(&s, &Paths::default())
}

/// The tiny preset's corpus (byte tokenizer, its seed) as an indexed dataset, with `edit` applied
/// to its documents' tokens first.
fn corpus_dataset(name: &str, edit: impl FnOnce(&mut Vec<Vec<u32>>)) -> PathBuf {
    let (s, _) = Settings::resolve(&args()).unwrap();
    let tok = Tokenizer::new(TokenizerKind::parse("byte").unwrap()).unwrap();
    let mut docs: Vec<Vec<u32>> = corpus::documents(s.seed, DOCS)
        .iter()
        .map(|d| {
            let mut t = tok.encode(d).unwrap();
            t.push(tok.eod());
            t
        })
        .collect();
    edit(&mut docs);
    let dir = std::env::temp_dir().join(format!("ferrotron-indexed-train-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("corpus_text_document");
    write_indexed(&prefix, &docs, TokenDtype::U16).unwrap();
    prefix
}

#[test]
fn an_indexed_dataset_trains_as_the_same_tokens_in_memory() {
    let prefix = corpus_dataset("same", |_| {});
    let want = run(args()).unwrap();
    // The corpus keeps its last 5% of documents (100 of 2000) for validation.
    let got =
        run(TrainArgs { data_path: vec![prefix.to_str().unwrap().into()], split: Some("1900,100,0".into()), ..args() })
            .unwrap();
    assert_eq!(got.losses, want.losses);
    assert_eq!(got.evals, want.evals);
    assert_eq!(got.losses.len(), 6);
    // --data-cache-path: the first run writes the train and valid splits' indices, the second
    // reads them; both train as without.
    let cache = prefix.with_file_name("index-cache");
    let cached = || TrainArgs {
        data_path: vec![prefix.to_str().unwrap().into()],
        split: Some("1900,100,0".into()),
        data_cache_path: Some(cache.clone()),
        ..args()
    };
    for _ in 0..2 {
        let c = run(cached()).unwrap();
        assert_eq!((c.losses, c.evals), (want.losses.clone(), want.evals.clone()));
    }
    let names: Vec<String> =
        std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    for split in ["train", "valid"] {
        let n = names.iter().filter(|f| f.contains(&format!("-GPTDataset-{split}-"))).count();
        assert_eq!(n, 4, "{split}: description and three indices in {names:?}");
    }

    // The same split as two datasets, each read whole.
    let head = corpus_dataset("head", |d| d.truncate(1900));
    let tail = corpus_dataset("tail", |d| {
        d.drain(..1900);
    });
    let whole = run(TrainArgs {
        train_data_path: vec![head.to_str().unwrap().into()],
        valid_data_path: vec![tail.to_str().unwrap().into()],
        ..args()
    })
    .unwrap();
    assert_eq!((whole.losses, whole.evals), (want.losses.clone(), want.evals.clone()));
    let e = run(TrainArgs { train_data_path: vec![head.to_str().unwrap().into()], ..args() }).err().unwrap();
    assert!(format!("{e:#}").contains("go together"), "{e:#}");
    let e = run(TrainArgs {
        data_path: vec![head.to_str().unwrap().into()],
        train_data_path: vec![head.to_str().unwrap().into()],
        valid_data_path: vec![tail.to_str().unwrap().into()],
        ..args()
    })
    .err()
    .unwrap();
    assert!(format!("{e:#}").contains("give one"), "{e:#}");

    // Megatron's NullTokenizer takes the ids as they are: with --vocab-size 255 (256 with its
    // end-of-document id, the byte tokenizer's vocabulary) the same model trains on the same
    // tokens to the same losses.
    let null = run(TrainArgs {
        data_path: vec![prefix.to_str().unwrap().into()],
        split: Some("1900,100,0".into()),
        tokenizer_type: Some("NullTokenizer".into()),
        vocab_size: Some(255),
        ..args()
    })
    .unwrap();
    assert_eq!(null.losses, want.losses);
    let e =
        run(TrainArgs { tokenizer_type: Some("NullTokenizer".into()), vocab_size: Some(256), ..args() }).err().unwrap();
    assert!(format!("{e:#}").contains("give it with --data-path"), "{e:#}");
    let e = run(TrainArgs { vocab_size: Some(256), ..args() }).err().unwrap();
    assert!(format!("{e:#}").contains("applies to NullTokenizer and TikTokenizer only"), "{e:#}");
    // Megatron's mock data with NullTokenizer (its benchmark scripts' pairing): the mock
    // sequences are ids, so the run trains on them (ending each in the vocabulary's id as EOD).
    let mock = run(TrainArgs {
        tokenizer_type: Some("NullTokenizer".into()),
        vocab_size: Some(4000),
        mock_data: true,
        ..args()
    })
    .unwrap();
    assert!(mock.losses.len() == 6 && mock.losses.iter().all(|l| l.1.is_finite()), "{:?}", mock.losses);

    // --split 1,0,0 gives validation no share: the run trains the same steps and evaluates
    // nothing, as Megatron's does.
    let no_valid =
        run(TrainArgs { data_path: vec![prefix.to_str().unwrap().into()], split: Some("1,0,0".into()), ..args() })
            .unwrap();
    assert!(no_valid.evals.is_empty() && no_valid.losses.len() == 6, "{:?}", no_valid.evals);
    let no_evals = run(TrainArgs { eval_iters: Some(0), ..args() }).unwrap();
    assert!(no_evals.evals.is_empty() && no_evals.losses == want.losses, "--eval-iters 0: {:?}", no_evals.evals);

    // Blended with a second copy at 3 : 1, the run trains (finite, falling loss) on samples of
    // both; the default --split leaves validation documents too.
    let other = corpus_dataset("other", |d| d.reverse());
    let blended = run(TrainArgs {
        data_path: vec!["3".into(), prefix.to_str().unwrap().into(), "1".into(), other.to_str().unwrap().into()],
        train_iters: Some(12),
        ..args()
    })
    .unwrap();
    let l = &blended.losses;
    assert!(l.iter().all(|x| x.1.is_finite()) && l[l.len() - 1].1 < l[0].1, "{l:?}");
}

/// Megatron's --data-args-path (a text file holding --data-path's words) and
/// --per-split-data-args-path (a JSON file of per-split lists): the same settings as the flags
/// written out, a run on them the same losses; bad files named.
#[test]
fn data_args_files_stand_for_the_flags() {
    let prefix = corpus_dataset("args", |_| {});
    let other = corpus_dataset("args-other", |d| d.reverse());
    let (p, o) = (prefix.to_str().unwrap().to_string(), other.to_str().unwrap().to_string());
    let dir = std::env::temp_dir().join(format!("ferrotron-data-args-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let f = dir.join(name);
        std::fs::write(&f, text).unwrap();
        f
    };
    let resolve = |a: TrainArgs| Settings::resolve(&a).map(|(s, _)| s);
    let blend = vec!["3".to_string(), p.clone(), "1".into(), o.clone()];
    let flags = resolve(TrainArgs { data_path: blend.clone(), ..args() }).unwrap();
    let from_file =
        resolve(TrainArgs { data_args_path: Some(file("blend.txt", &format!("3 {p}\n1\t{o}\n"))), ..args() }).unwrap();
    assert_eq!(from_file.data_path, blend);
    assert_eq!(from_file, flags);
    let a = TrainArgs { data_args_path: Some(dir.join("blend.txt")), ..args() };
    assert_eq!(run(a).unwrap().losses, run(TrainArgs { data_path: blend, ..args() }).unwrap().losses);
    let json = format!(r#"{{"train": ["{p}"], "valid": ["1 {o}"], "test": null}}"#);
    let per_split =
        resolve(TrainArgs { per_split_data_args_path: Some(file("splits.json", &json)), ..args() }).unwrap();
    let written =
        resolve(TrainArgs { train_data_path: vec![p.clone()], valid_data_path: vec!["1".into(), o], ..args() });
    assert_eq!(per_split, written.unwrap());

    let err = |a: TrainArgs| format!("{:#}", resolve(a).unwrap_err());
    let e = err(TrainArgs { data_args_path: Some(dir.join("blend.txt")), data_path: vec![p.clone()], ..args() });
    assert!(e.contains("--data-args-path") && e.contains("give one"), "{e}");
    let e = err(TrainArgs { data_args_path: Some(file("empty.txt", " \n")), ..args() });
    assert!(e.contains("is empty"), "{e}");
    let e = err(TrainArgs { data_args_path: Some(dir.join("missing.txt")), ..args() });
    assert!(e.contains("missing.txt") && e.contains("cannot read"), "{e}");
    for (text, want) in [
        ("[1, 2]", "not a JSON object"),
        ("{\"train\": [\"a\"], \"extra\": []}", "unknown key \"extra\""),
        ("{\"train\": [3]}", "holds 3, not a string"),
        ("{\"train\": ", "not JSON"),
    ] {
        let e = err(TrainArgs { per_split_data_args_path: Some(file("bad.json", text)), ..args() });
        assert!(e.contains("--per-split-data-args-path") && e.contains(want), "{text}: {e}");
    }
    let e =
        err(TrainArgs { per_split_data_args_path: Some(dir.join("splits.json")), train_data_path: vec![p], ..args() });
    assert!(e.contains("names the data per split"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_indexed_data_is_named() {
    // A token id past the byte tokenizer's vocabulary, in every document.
    let prefix = corpus_dataset("bad-token", |d| d.iter_mut().for_each(|t| t[0] = 300));
    let e = run(TrainArgs { data_path: vec![prefix.to_str().unwrap().into()], ..args() })
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(e.contains("token id 300") && e.contains("another tokenizer"), "{e}");

    // A validation share too small to hold a document (0.01% of 2000) is refused by name.
    let good = corpus_dataset("good", |_| {});
    let e = run(TrainArgs { data_path: vec![good.to_str().unwrap().into()], split: Some("9999,1".into()), ..args() })
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(e.contains("valid split has 0 tokens"), "{e}");
    let e = run(TrainArgs { seed: Some(1 << 32), ..args() }).err().unwrap();
    assert!(format!("{e:#}").contains("below 2^32"), "{e:#}");
    let e = run(TrainArgs { data_path: vec!["/nonexistent/ferrotron/data".into()], ..args() }).err().unwrap();
    assert!(format!("{e:#}").contains("/nonexistent/ferrotron/data.idx"), "{e:#}");
    let e = run(TrainArgs { data_path: vec!["0.5".into(), "a".into(), "b".into()], ..args() }).err().unwrap();
    assert!(format!("{e:#}").contains("`0.5` reads as a weight"), "{e:#}");
    let e = run(TrainArgs { data_path: vec![prefix.to_str().unwrap().into()], split: Some("9,x".into()), ..args() })
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("--split 9,x"), "{e:#}");
}

/// `--mock-data`: the trainer's samples are those Megatron-Core's MockGPTDataset gives (the
/// oracle file ferrotron-data's tests use: its first 24 train and 8 valid samples for the byte
/// tokenizer at --seq-length 300; one epoch of mock data is far more than either split asks, so
/// the order does not depend on the sample counts).
#[test]
fn mock_data_is_megatrons() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/tests/fixtures/megatron_gpt_order.json");
    let oracle: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let case = oracle["cases"].as_array().unwrap().iter().find(|c| c["name"] == "mock, byte tokenizer").unwrap();
    let a = TrainArgs { mock_data: true, seq_length: Some(300), max_position_embeddings: Some(300), ..args() };
    let (s, _) = Settings::resolve(&a).unwrap();
    s.validate().unwrap();
    let data = ferrotron_trainer::train::Data::build(&s).unwrap();
    for (split, key) in [(&data.train, "train"), (data.valid.as_ref().unwrap(), "valid")] {
        let want = case[key].as_array().unwrap();
        assert!(want.len() >= 8);
        for (i, w) in want.iter().enumerate() {
            let w: Vec<u32> = w.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
            assert_eq!(split.sample(i).unwrap(), w, "{key} sample {i}");
        }
    }
    // --eod-mask-loss: each sample's end-of-document positions (one in every sequence) leave the
    // loss, so the same untrained model's first validation loss differs; training still learns.
    let masked = run(TrainArgs { mock_data: true, eod_mask_loss: true, ..args() }).unwrap();
    let plain = run(TrainArgs { mock_data: true, ..args() }).unwrap();
    assert_ne!(masked.evals[0].1, plain.evals[0].1);
    let l = &masked.losses;
    assert!(l.iter().all(|x| x.1.is_finite()) && l[l.len() - 1].1 < l[0].1, "{l:?}");
    // It trains, and it stands in for a dataset, so it does not go with one.
    let l = run(TrainArgs { mock_data: true, ..args() }).unwrap().losses;
    assert!(l.iter().all(|x| x.1.is_finite()) && l[l.len() - 1].1 < l[0].1, "{l:?}");
    let e = run(TrainArgs { mock_data: true, data_path: vec!["x".into()], ..args() }).err().unwrap();
    assert!(format!("{e:#}").contains("--mock-data stands in for a dataset"), "{e:#}");
}
