//! Megatron's TikTokenizer against Python tiktoken: the ids `fixtures/tiktoken/expected.json`
//! holds (written by `make_tiktoken_fixture.py` from the same vocabulary file) under both
//! patterns, with 10 and 1000 special tokens first (the second cutting the file's last 20 ranks
//! by --vocab-size); and every bad flag or file named.

use ferrotron_data::{DataError, Tokenizer, TokenizerFlags, TokenizerKind};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiktoken").join(name)
}

fn tik(path: &Path, pattern: &str, vocab: usize, special: usize) -> Result<Tokenizer, DataError> {
    let flags = TokenizerFlags {
        vocab_size: Some(vocab),
        model: Some(path),
        tiktoken_pattern: Some(pattern),
        tiktoken_num_special_tokens: Some(special),
        tiktoken_special_tokens: None,
    };
    Tokenizer::new(TokenizerKind::from_flags("TikTokenizer", &flags)?)
}

#[test]
fn ids_match_python_tiktoken() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
    let texts: Vec<&str> = expected["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    let cases = expected["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    let mut by_pattern = vec![];
    for c in cases {
        let (pattern, special) = (c["pattern"].as_str().unwrap(), c["num_special_tokens"].as_u64().unwrap() as usize);
        let vocab = c["vocab_size"].as_u64().unwrap() as usize;
        let t = tik(&fixture("vocab.json"), pattern, vocab, special).unwrap();
        assert_eq!((t.vocab_size(), t.eod(), t.kind().as_str()), (vocab, 2, "TikTokenizer"));
        let mut ids_all = vec![];
        for (i, text) in texts.iter().enumerate() {
            let want: Vec<u32> = c["ids"][i].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let ids = t.encode(text).unwrap();
            assert_eq!(ids, want, "{pattern}, {special} special tokens: {text:?}");
            assert!(ids.iter().all(|&id| id as usize >= special && (id as usize) < vocab));
            assert_eq!(t.decode(&ids).unwrap(), *text);
            ids_all.push(ids);
        }
        by_pattern.push(ids_all);
        // The special tokens decode to their names; past the vocabulary is an error.
        assert_eq!(t.decode(&[1, 2]).unwrap(), "<s></s>");
        assert_eq!(t.decode(&[5]).unwrap(), "<SPECIAL_5>");
        assert!(matches!(t.decode(&[vocab as u32]), Err(DataError::TokenOutOfRange { .. })));
    }
    // v2 splits words at case changes where v1 does not: the fixture has a text they part on.
    assert_ne!(by_pattern[0], by_pattern[1], "v1 and v2 gave the same ids for every text");
}

fn ranks_in_fixture() -> usize {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("vocab.json")).unwrap()).unwrap();
    v.as_array().unwrap().len()
}

#[test]
fn bad_tiktoken_flags_are_named() {
    let vocab = fixture("vocab.json");
    let err = |f: TokenizerFlags| TokenizerKind::from_flags("TikTokenizer", &f).unwrap_err().to_string();
    let e = err(TokenizerFlags { tiktoken_pattern: Some("v2"), ..Default::default() });
    assert!(e.contains("TikTokenizer needs --tokenizer-model"), "{e}");
    let e = err(TokenizerFlags { model: Some(&vocab), ..Default::default() });
    assert!(e.contains("--tiktoken-pattern v1 or v2"), "{e}");
    let e = err(TokenizerFlags { model: Some(&vocab), tiktoken_pattern: Some("v3"), ..Default::default() });
    assert!(e.contains("--tiktoken-pattern v3: use v1 or v2"), "{e}");
    let e = TokenizerKind::from_flags("gpt2", &TokenizerFlags { tiktoken_pattern: Some("v2"), ..Default::default() })
        .unwrap_err()
        .to_string();
    assert!(e.contains("--tiktoken-pattern belongs to TikTokenizer, not the gpt2 tokenizer"), "{e}");
    let open = |special: Option<&[String]>, n: usize, v: usize| {
        let f = TokenizerFlags {
            vocab_size: Some(v),
            model: Some(&vocab),
            tiktoken_pattern: Some("v2"),
            tiktoken_num_special_tokens: Some(n),
            tiktoken_special_tokens: special,
        };
        Tokenizer::new(TokenizerKind::from_flags("TikTokenizer", &f).unwrap()).err().unwrap().to_string()
    };
    let no_eos = ["<unk>".to_string(), "<s>".to_string()];
    assert!(open(Some(&no_eos), 10, 300).contains("must include </s>"));
    let twice = ["<unk>", "<s>", "</s>", "<s>"].map(String::from);
    assert!(open(Some(&twice), 10, 300).contains("each must be given once"));
    assert!(open(None, 300, 300).contains("--tiktoken-num-special-tokens 300"));
    // A vocabulary needing more ranks than the file holds is refused, naming the fix.
    let n = ranks_in_fixture();
    let e = open(None, 10, 10 + n + 1);
    assert!(e.contains(&format!("holds {n} tokens")) && e.contains("lower --vocab-size"), "{e}");
    // A custom list keeps its order: ids follow it.
    let custom = ["<pad>", "<unk>", "<s>", "</s>"].map(String::from);
    let f = TokenizerFlags {
        vocab_size: Some(300),
        model: Some(&vocab),
        tiktoken_pattern: Some("v1"),
        tiktoken_num_special_tokens: Some(4),
        tiktoken_special_tokens: Some(&custom),
    };
    let t = Tokenizer::new(TokenizerKind::from_flags("TikTokenizer", &f).unwrap()).unwrap();
    assert_eq!((t.eod(), t.decode(&[0]).unwrap().as_str()), (3, "<pad>"));
}

#[test]
fn bad_vocabulary_files_are_named() {
    let dir = std::env::temp_dir().join(format!("ferrotron-tiktoken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let entries: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture("vocab.json")).unwrap()).unwrap();
    let write = |name: &str, v: &serde_json::Value| {
        let p = dir.join(name);
        std::fs::write(&p, v.to_string()).unwrap();
        p
    };
    let mutated = |i: usize, key: &str, val: serde_json::Value| {
        let mut e = entries.clone();
        e[i][key] = val;
        serde_json::Value::Array(e)
    };
    let cases = [
        ("order.json", mutated(300, "rank", 301.into()), "entry 300 has rank 301"),
        ("b64.json", mutated(280, "token_bytes", "%%%".into()), "entry 280's token_bytes is not base64"),
        ("bytes.json", mutated(65, "token_bytes", "Qg==".into()), "entry 65 must be the single byte 65"),
        ("dup.json", mutated(270, "token_bytes", entries[260]["token_bytes"].clone()), "entry 270 repeats"),
        ("shape.json", serde_json::json!({"rank": 0}), "not a TikTokenizer vocabulary"),
    ];
    for (name, v, want) in cases {
        let p = write(name, &v);
        let e = tik(&p, "v2", 10 + entries.len(), 10).err().unwrap().to_string();
        assert!(e.contains(want) && e.contains(name), "{name}: {e}");
    }
    // Entries past the vocabulary asked for are not read (Megatron cuts the list first).
    let p = write("tail.json", &mutated(entries.len() - 1, "token_bytes", "%%%".into()));
    assert!(tik(&p, "v2", 10 + entries.len() - 1, 10).is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}
