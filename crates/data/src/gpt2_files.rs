//! Megatron's GPT2BPETokenizer takes `--vocab-file` (vocab.json: token → id, each token's bytes
//! written as GPT-2's printable characters) and `--merge-file` (merges.txt). Ours is built in
//! (tiktoken-rs r50k_base: the same 50,257 ids), so the files are checked, not read into a
//! tokenizer: every vocab.json entry must be the built-in id's bytes, and merges.txt must hold
//! GPT-2's 50,000 merges. A file from another vocabulary is named with the first entry that differs.

use crate::DataError;
use std::path::Path;

/// GPT-2's byte ↔ character table: bytes that are printable Latin-1 (`!`..`~`, `¡`..`¬`,
/// `®`..`ÿ`) stand for themselves, the other 68 take code points 256, 257, … in byte order.
fn char_to_byte() -> std::collections::HashMap<char, u8> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            (char::from_u32(c).unwrap_or('\u{fffd}'), b as u8)
        })
        .collect()
}

pub(crate) fn check_vocab_file(path: &Path, bpe: &tiktoken_rs::CoreBPE) -> Result<(), DataError> {
    let bad = |what: String| DataError::BadFile { path: path.to_path_buf(), what };
    let text = std::fs::read_to_string(path).map_err(|e| DataError::Io { path: path.to_path_buf(), source: e })?;
    let vocab: std::collections::BTreeMap<String, u32> =
        serde_json::from_str(&text).map_err(|e| bad(format!("not a vocab.json (a JSON object of token → id): {e}")))?;
    if vocab.len() != 50257 {
        return Err(bad(format!(
            "{} entries, GPT-2's vocabulary has 50,257: for another tokenizer's data use --tokenizer-type NullTokenizer --vocab-size N",
            vocab.len()
        )));
    }
    let to_byte = char_to_byte();
    for (token, &id) in &vocab {
        let bytes: Option<Vec<u8>> = token.chars().map(|c| to_byte.get(&c).copied()).collect();
        let same = match (bytes, bpe.decode_bytes(&[id])) {
            (Some(b), Ok(ours)) => b == ours || (id == 50256 && token == "<|endoftext|>"),
            _ => false,
        };
        if !same {
            return Err(bad(format!(
                "entry {token:?} → {id} is not GPT-2's: this is another vocabulary; for data tokenized with it use --tokenizer-type NullTokenizer --vocab-size N"
            )));
        }
    }
    Ok(())
}

pub(crate) fn check_merge_file(path: &Path) -> Result<(), DataError> {
    let text = std::fs::read_to_string(path).map_err(|e| DataError::Io { path: path.to_path_buf(), source: e })?;
    let merges = text.lines().filter(|l| !l.starts_with("#version") && !l.trim().is_empty()).count();
    if merges != 50000 {
        return Err(DataError::BadFile {
            path: path.to_path_buf(),
            what: format!("{merges} merges, GPT-2's merges.txt has 50,000: this is another tokenizer's"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_byte_table_matches_known_entries() {
        let t = char_to_byte();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'!'], b'!');
        assert_eq!(t[&'Ġ'], b' ', "GPT-2 writes a space as Ġ (U+0120)");
        assert_eq!(t[&'Ċ'], b'\n', "and a newline as Ċ (U+010A)");
        assert_eq!(t[&'\u{100}'], 0);
    }

    #[test]
    fn a_vocab_file_is_checked_against_the_built_in_ids() {
        let bpe = tiktoken_rs::r50k_base().unwrap();
        let dir = std::env::temp_dir().join(format!("ferrotron-gpt2-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // GPT-2's own vocab.json, written from the built-in ids through the byte table.
        let to_char: std::collections::HashMap<u8, char> = char_to_byte().into_iter().map(|(c, b)| (b, c)).collect();
        let mut vocab: std::collections::BTreeMap<String, u32> =
            (0..50256).map(|id| (bpe.decode_bytes(&[id]).unwrap().iter().map(|b| to_char[b]).collect(), id)).collect();
        vocab.insert("<|endoftext|>".into(), 50256);
        let good = dir.join("vocab.json");
        std::fs::write(&good, serde_json::to_string(&vocab).unwrap()).unwrap();
        check_vocab_file(&good, &bpe).unwrap();
        assert_eq!(vocab["Ġworld"], 995, "a known entry");
        // Two ids swapped: another vocabulary.
        let (a, b) = (vocab["Ġworld"], vocab["Hello"]);
        vocab.insert("Ġworld".into(), b);
        vocab.insert("Hello".into(), a);
        let swapped = dir.join("swapped.json");
        std::fs::write(&swapped, serde_json::to_string(&vocab).unwrap()).unwrap();
        let e = check_vocab_file(&swapped, &bpe).unwrap_err().to_string();
        assert!(e.contains("is not GPT-2's") && e.contains("swapped.json"), "{e}");

        let merges = dir.join("merges.txt");
        std::fs::write(&merges, format!("#version: 0.2\n{}", "Ġ t\n".repeat(50000))).unwrap();
        check_merge_file(&merges).unwrap();
        std::fs::write(&merges, "#version: 0.2\nĠ t\n").unwrap();
        assert!(check_merge_file(&merges).unwrap_err().to_string().contains("1 merges"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
