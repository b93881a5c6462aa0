//! SentencePiece's BPE encoder: the normalised text split into characters (a user-defined
//! symbol is one symbol, never merged), then, repeatedly, the adjacent pair whose joined text is
//! a piece with the highest score is merged (the leftmost on equal scores), until no pair is a
//! piece. An UNUSED piece that a merge made is split back into the pieces it was made of.

use super::{PieceKind, Vocab};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the joined text: a candidate whose symbols have changed since is stale.
    len: usize,
}

impl Ord for Candidate {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl PartialEq for Candidate {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Candidate {}

struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
    frozen: bool,
}

/// Pieces of `text` (normalised) with their ids; `None` for text that is no piece.
pub(super) fn encode<'t>(v: &Vocab, text: &'t str) -> Vec<(&'t str, Option<u32>)> {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    let mut at = 0;
    while at < text.len() {
        let (len, frozen) = v.symbol_at(&text[at..]);
        let i = symbols.len();
        symbols.push(Symbol { start: at, len, prev: i.checked_sub(1), next: None, frozen });
        if i > 0 {
            symbols[i - 1].next = Some(i);
        }
        at += len;
    }
    let mut agenda = BinaryHeap::new();
    // Pieces an UNUSED merge joined: split back at the end.
    let mut unmerge: HashMap<&str, (&str, &str)> = HashMap::new();
    let mut offer = |symbols: &[Symbol], agenda: &mut BinaryHeap<Candidate>, l: Option<usize>, r: Option<usize>| {
        let (Some(l), Some(r)) = (l, r) else { return };
        let (a, b) = (&symbols[l], &symbols[r]);
        if a.frozen || b.frozen {
            return;
        }
        let joined = &text[a.start..b.start + b.len];
        if let Some(id) = v.piece(joined) {
            agenda.push(Candidate { score: v.score(id), left: l, right: r, len: joined.len() });
            if v.kind(id) == PieceKind::Unused {
                unmerge.insert(joined, (&text[a.start..a.start + a.len], &text[b.start..b.start + b.len]));
            }
        }
    };
    for i in 1..symbols.len() {
        offer(&symbols, &mut agenda, Some(i - 1), Some(i));
    }
    while let Some(c) = agenda.pop() {
        let (l, r) = (&symbols[c.left], &symbols[c.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != c.len {
            continue;
        }
        let (next, add) = (r.next, r.len);
        symbols[c.left].len += add;
        symbols[c.left].next = next;
        if let Some(n) = next {
            symbols[n].prev = Some(c.left);
        }
        symbols[c.right].len = 0;
        let prev = symbols[c.left].prev;
        offer(&symbols, &mut agenda, prev, Some(c.left));
        offer(&symbols, &mut agenda, Some(c.left), next);
    }
    let mut out = Vec::new();
    let mut i = (!symbols.is_empty()).then_some(0);
    while let Some(k) = i {
        let s = &symbols[k];
        resegment(v, &unmerge, &text[s.start..s.start + s.len], &mut out);
        i = s.next;
    }
    out
}

fn resegment<'t>(
    v: &Vocab,
    unmerge: &HashMap<&'t str, (&'t str, &'t str)>,
    w: &'t str,
    out: &mut Vec<(&'t str, Option<u32>)>,
) {
    let id = v.id_of(w);
    match (id, unmerge.get(w)) {
        (Some(i), Some(&(a, b))) if v.kind(i) == PieceKind::Unused => {
            resegment(v, unmerge, a, out);
            resegment(v, unmerge, b, out);
        }
        _ => out.push((w, id)),
    }
}
