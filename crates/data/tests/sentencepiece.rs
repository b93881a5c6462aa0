//! SentencePiece models against Google's own library: the ids and text `fixtures/sentencepiece/
//! expected.json` holds, written by `make_sentencepiece_fixture.py` with the Python package from
//! the two models it trained there (BPE with byte fallback and identity normalisation, as
//! Llama 2's; unigram with nmt_nfkc rules, a user-defined symbol and <unk> for what it does not
//! know). Then Megatron's two tokenizers over them, and bad files named.

use ferrotron_data::sentencepiece::SentencePiece;
use ferrotron_data::{DataError, Tokenizer, TokenizerKind};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sentencepiece").join(name)
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect()
}

#[test]
fn ids_and_text_match_google_sentencepiece() {
    let all = expected();
    for name in ["llama_bpe", "unigram_nfkc"] {
        let e = &all[name];
        let sp = SentencePiece::open(&fixture(&format!("{name}.model"))).unwrap();
        assert_eq!(sp.vocab_size() as u64, e["vocab_size"].as_u64().unwrap(), "{name}");
        let special = |k: &str| e[k].as_i64().unwrap();
        assert_eq!(sp.unk() as i64, special("unk"));
        for (k, got) in [("bos", sp.bos()), ("eos", sp.eos()), ("pad", sp.pad())] {
            assert_eq!(got.map_or(-1, |i| i as i64), special(k), "{name} {k}");
        }
        let cases = e["cases"].as_array().unwrap();
        assert!(cases.len() >= 14);
        for c in cases {
            let text = c["text"].as_str().unwrap();
            let want = ids(&c["ids"]);
            assert_eq!(sp.encode(text), want, "{name}: {text:?}");
            assert_eq!(sp.decode(&want).unwrap(), c["decoded"].as_str().unwrap(), "{name}: {text:?}");
        }
        for c in e["decode_only"].as_array().unwrap() {
            let i = ids(&c["ids"]);
            assert_eq!(sp.decode(&i).unwrap(), c["decoded"].as_str().unwrap(), "{name}: {i:?}");
        }
        let past = sp.vocab_size() as u32;
        assert!(matches!(sp.decode(&[past]), Err(DataError::TokenOutOfRange { id, .. }) if id == past));
    }
}

/// Megatron's Llama2Tokenizer puts BOS before each text; GPTSentencePieceTokenizer does not; both
/// end a document with EOS and size the vocabulary by the model's pieces.
#[test]
fn megatrons_two_sentencepiece_tokenizers() {
    let model = fixture("llama_bpe.model");
    let sp = SentencePiece::open(&model).unwrap();
    let text = "The owl found 12 + 7 = 19.";
    let parse = |name: &str| TokenizerKind::parse_with(name, None, Some(&model)).unwrap();
    let llama = Tokenizer::new(parse("Llama2Tokenizer")).unwrap();
    let gpt = Tokenizer::new(parse("GPTSentencePieceTokenizer")).unwrap();
    let plain = sp.encode(text);
    assert_eq!(llama.encode(text).unwrap(), [vec![sp.bos().unwrap()], plain.clone()].concat());
    assert_eq!(gpt.encode(text).unwrap(), plain);
    for t in [&llama, &gpt] {
        assert_eq!((t.vocab_size(), t.eod()), (600, sp.eos().unwrap()));
        assert_eq!(t.decode(&t.encode(text).unwrap()).unwrap(), text, "BOS decodes to nothing");
    }
    assert_eq!(llama.kind().as_str(), "Llama2Tokenizer");
    assert_eq!(gpt.kind(), TokenizerKind::SentencePiece { path: model.clone(), bos: false });
}

#[test]
fn bad_models_are_named() {
    let e = TokenizerKind::parse_with("Llama2Tokenizer", None, None).unwrap_err().to_string();
    assert!(e.contains("Llama2Tokenizer needs --tokenizer-model FILE.model"), "{e}");
    let e = TokenizerKind::parse_with("GPTSentencePieceTokenizer", Some(32000), Some(Path::new("t.model")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--vocab-size 32000"), "{e}");
    let dir = std::env::temp_dir().join(format!("ferrotron-spm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Not protobuf; a model cut short; a file that is not there.
    let garbage = dir.join("garbage.model");
    std::fs::write(&garbage, b"\xff\xff\xff\xff not a model").unwrap();
    let whole = std::fs::read(fixture("unigram_nfkc.model")).unwrap();
    let cut = dir.join("cut.model");
    std::fs::write(&cut, &whole[..whole.len() / 2]).unwrap();
    for (p, needle) in [
        (garbage.clone(), "not a SentencePiece model"),
        (cut.clone(), "not a SentencePiece model"),
        (dir.join("missing.model"), "No such file"),
        (dir.clone(), "Is a directory"),
    ] {
        let e = SentencePiece::open(&p).err().unwrap().to_string();
        assert!(e.contains(&p.display().to_string()) && e.contains(needle), "{e}");
    }
    // A folder holding tokenizer.model (a Hugging Face Llama folder) is read through it.
    std::fs::copy(fixture("llama_bpe.model"), dir.join("tokenizer.model")).unwrap();
    assert_eq!(SentencePiece::open(&dir).unwrap().vocab_size(), 600);
    let _ = std::fs::remove_dir_all(dir);
}
