//! Position ids of a sample's tokens (Megatron's `_get_ltor_masks_and_position_ids`): each
//! row counts from 0, and under --reset-position-ids from 0 again after each end of document,
//! so a document packed behind another one sees the positions it would alone.

/// Rows of `tokens` ([rows, seq]) numbered from 0, again from 0 after each `eod` (the end of
/// document keeps the position it ends its document at; the token after it is 0).
pub fn reset_position_ids(tokens: &[u32], seq: usize, eod: u32) -> Vec<u32> {
    tokens
        .chunks(seq)
        .flat_map(|row| {
            let mut next = 0u32;
            row.iter().map(move |&t| {
                let here = next;
                next = if t == eod { 0 } else { next + 1 };
                here
            })
        })
        .collect()
}

/// The first position of each token's document in its row of `tokens` ([rows, seq]), for
/// document-wise attention masks (Megatron's --reset-attention-mask): a token after an `eod` at
/// position e sees no key at or before e; the end of document itself belongs to the document it
/// ends.
pub fn document_starts(tokens: &[u32], seq: usize, eod: u32) -> Vec<u32> {
    tokens
        .chunks(seq)
        .flat_map(|row| {
            let mut start = 0u32;
            row.iter().enumerate().map(move |(i, &t)| {
                let here = start;
                if t == eod {
                    start = i as u32 + 1;
                }
                here
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn document_starts_follow_megatrons_mask() {
        // Megatron's rule: for each eod at i, mask[i + 1:, :i + 1] = 0 (on top of causal).
        let megatron = |row: &[u32], eod: u32| -> Vec<Vec<bool>> {
            let n = row.len();
            let mut m: Vec<Vec<bool>> = (0..n).map(|i| (0..n).map(|j| j <= i).collect()).collect();
            for (e, _) in row.iter().enumerate().filter(|(_, t)| **t == eod) {
                for r in m.iter_mut().skip(e + 1) {
                    r[..=e].iter_mut().for_each(|x| *x = false);
                }
            }
            m
        };
        let rows = [5u32, 7, 0, 3, 0, 0, 9, 4, /* row 2 */ 1, 2, 3, 4, 5, 6, 7, 0];
        let got = document_starts(&rows, 8, 0);
        assert_eq!(&got[..8], [0, 0, 0, 3, 3, 5, 6, 6]);
        assert_eq!(&got[8..], [0; 8], "a row starts a document; an eod at its end changes nothing in it");
        for (r, starts) in rows.chunks(8).zip(got.chunks(8)) {
            let mask = megatron(r, 0);
            for (i, row) in mask.iter().enumerate() {
                let ours: Vec<bool> = (0..8).map(|j| j <= i && j >= starts[i] as usize).collect();
                assert_eq!(&ours, row, "query {i} of {r:?}");
            }
        }
    }

    #[test]
    fn positions_restart_after_each_end_of_document() {
        // Megatron's rule: position_ids[i + 1:] -= i + 1 − prev for each eod at i.
        let megatron = |row: &[u32], eod: u32| -> Vec<u32> {
            let mut p: Vec<i64> = (0..row.len() as i64).collect();
            let mut prev = 0i64;
            for (i, _) in row.iter().enumerate().filter(|(_, t)| **t == eod) {
                let i = i as i64;
                for x in p.iter_mut().skip(i as usize + 1) {
                    *x -= i + 1 - prev;
                }
                prev = i + 1;
            }
            p.into_iter().map(|x| x as u32).collect()
        };
        let rows = [5u32, 7, 0, 3, 0, 0, 9, 4, /* row 2 */ 1, 2, 3, 4, 5, 6, 7, 0];
        let got = reset_position_ids(&rows, 8, 0);
        assert_eq!(&got[..8], [0, 1, 2, 0, 1, 0, 0, 1]);
        assert_eq!(&got[8..], [0, 1, 2, 3, 4, 5, 6, 7], "a row restarts at 0; an eod at the end changes nothing");
        for r in rows.chunks(8) {
            assert_eq!(reset_position_ids(r, 8, 0), megatron(r, 0));
        }
    }
}
