//! SentencePiece's unigram encoder: the best-scoring segmentation of the normalised text into
//! pieces (Viterbi over a lattice of characters). Every piece that starts at a character is a
//! node with its score; a user-defined symbol scores `length × max_score + 1` so that it is
//! always taken (max_score starts at f32's smallest positive value, as SentencePiece's does); a
//! character that no one-character piece covers gets an unknown node scoring the lowest normal
//! score − 10. Nodes are visited in SentencePiece's order (by start, then by length) and the
//! first of equal scores wins, so ties fall as they do there.

use super::{PieceKind, Vocab};

/// Pieces of `text` (normalised) with their ids; `None` for an unknown character.
pub(super) fn encode<'t>(v: &Vocab, text: &'t str) -> Vec<(&'t str, Option<u32>)> {
    // Byte offset of each character boundary.
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
    let n = bounds.len() - 1;
    if n == 0 {
        return vec![];
    }
    // best[p]: the best score of a segmentation of the first p characters and its last node.
    let mut best: Vec<Option<(f32, usize, Option<u32>)>> = vec![None; n + 1];
    best[0] = Some((0.0, 0, None));
    let unk_score = v.min_score - 10.0;
    for begin in 0..n {
        let Some((base, _, _)) = best[begin] else { continue };
        let mut has_single = false;
        let mut offer = |end: usize, id: Option<u32>, score: f32| {
            let total = base + score;
            if best[end].is_none_or(|(b, _, _)| total > b) {
                best[end] = Some((total, begin, id));
            }
        };
        for end in begin + 1..=n.min(begin + v.max_piece_chars) {
            let Some(id) = v.piece(&text[bounds[begin]..bounds[end]]) else { continue };
            let score = match v.kind(id) {
                PieceKind::Unused => continue,
                PieceKind::UserDefined => (end - begin) as f32 * v.max_score + 1.0,
                _ => v.score(id),
            };
            has_single |= end == begin + 1;
            offer(end, Some(id), score);
        }
        if !has_single {
            offer(begin + 1, None, unk_score);
        }
    }
    let mut out = Vec::new();
    let mut end = n;
    while end > 0 {
        let Some((_, begin, id)) = best[end] else { break };
        out.push((&text[bounds[begin]..bounds[end]], id));
        end = begin;
    }
    out.reverse();
    out
}
