//! SentencePiece's precompiled normalisation rules (`precompiled_charsmap`): a Darts double-array
//! trie over UTF-8 byte strings whose values point into a blob of NUL-terminated replacements.
//! Layout: u32 (little-endian) trie size in bytes, the trie's u32 units, then the blob. The
//! normaliser replaces the *longest* rule that prefixes the input, as SentencePiece does.

pub(super) struct CharsMap {
    units: Vec<u32>,
    normalized: Vec<u8>,
}

impl CharsMap {
    /// `None` for a blob too short for the trie size it declares.
    pub fn parse(blob: &[u8]) -> Option<CharsMap> {
        let size = u32::from_le_bytes(blob.get(..4)?.try_into().ok()?) as usize;
        let trie = blob.get(4..4usize.checked_add(size)?)?;
        let units = trie.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Some(CharsMap { units, normalized: blob[4 + size..].to_vec() })
    }

    /// The longest rule at the start of `input`: (bytes it covers, its replacement).
    pub fn longest_prefix(&self, input: &[u8]) -> Option<(usize, &[u8])> {
        let unit = |pos: usize| self.units.get(pos).copied();
        // Darts unit fields.
        let offset = |u: u32| ((u >> 10) << ((u & (1 << 9)) >> 6)) as usize;
        let label = |u: u32| u & ((1 << 31) | 0xff);
        let has_leaf = |u: u32| (u >> 8) & 1 == 1;
        let mut pos = offset(unit(0)?);
        let mut best = None;
        for (i, &c) in input.iter().enumerate() {
            if c == 0 {
                break;
            }
            pos ^= c as usize;
            let Some(u) = unit(pos).filter(|&u| label(u) == c as u32) else { break };
            pos ^= offset(u);
            if has_leaf(u) {
                let Some(v) = unit(pos) else { break };
                best = Some((i + 1, (v & ((1 << 31) - 1)) as usize));
            }
        }
        let (len, at) = best?;
        let rest = self.normalized.get(at..)?;
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        Some((len, &rest[..end]))
    }
}
