//! Megatron's explicit pipeline layout (--pipeline-model-parallel-layout): the model's pieces in
//! order, stages separated by `|`, one character a piece: `E` the embedding, `t` a decoder
//! (transformer) layer, `m` a multi-token prediction depth, `L` the loss. `x*n` repeats a piece
//! and `(...)*n` a group (stage separators inside it too); commas are cosmetic. E.g.
//! `Ettt|(tt|)*29,|L` is 61 layers over 32 stages, the last holding only the loss.
//!
//! There are pp × vpp stages; stage s is chunk s / pp of pipeline rank s mod pp (Megatron's
//! interleaving, as `stages`). A stage may hold no decoder layer (only the embedding, or only
//! the loss). What Ferrotron's stages hold besides their layers is fixed: the embedding on the
//! first stage, the loss (and the MTP depths) on the last, so the layout must put them there.

use super::stages::{StagePlan, stage_layers_of};
use crate::{ParallelError, Result};

/// What one stage of a layout holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayoutStage {
    pub embedding: bool,
    pub decoder: usize,
    pub mtp: usize,
    pub loss: bool,
}

/// A parsed layout: its stages in model order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineLayout {
    pub stages: Vec<LayoutStage>,
}

fn err(layout: &str, msg: impl std::fmt::Display) -> ParallelError {
    ParallelError::Layout(format!("--pipeline-model-parallel-layout {layout}: {msg}"))
}

/// The most pieces (and separators) an expanded layout may hold.
const MAX_PIECES: usize = 1 << 20;

/// `s` with its repeats written out and its commas dropped.
fn expand(layout: &str) -> Result<String> {
    let chars: Vec<char> = layout.chars().filter(|&c| c != ',' && !c.is_whitespace()).collect();
    let mut at = 0;
    let out = expand_seq(layout, &chars, &mut at)?;
    if at < chars.len() {
        return Err(err(layout, format!("an unmatched ')' at character {}", at + 1)));
    }
    Ok(out)
}

/// A sequence of pieces up to a ')' or the end.
fn expand_seq(layout: &str, c: &[char], at: &mut usize) -> Result<String> {
    let mut out = String::new();
    while *at < c.len() && c[*at] != ')' {
        let item = if c[*at] == '(' {
            *at += 1;
            let inner = expand_seq(layout, c, at)?;
            if c.get(*at) != Some(&')') {
                return Err(err(layout, "a '(' without its ')'"));
            }
            *at += 1;
            inner
        } else {
            *at += 1;
            c[*at - 1].to_string()
        };
        let times = if c.get(*at) == Some(&'*') {
            *at += 1;
            let start = *at;
            while c.get(*at).is_some_and(|d| d.is_ascii_digit()) {
                *at += 1;
            }
            let digits: String = c[start..*at].iter().collect();
            digits.parse::<usize>().map_err(|_| err(layout, "a '*' must be followed by a count, as in t*4"))?
        } else {
            1
        };
        // A layout names each layer once: far fewer pieces than this.
        if out.len().saturating_add(item.len().saturating_mul(times)) > MAX_PIECES {
            return Err(err(layout, format!("it expands past {MAX_PIECES} pieces")));
        }
        out.push_str(&item.repeat(times));
    }
    Ok(out)
}

impl PipelineLayout {
    /// Parses `layout` (see the module doc) and checks its pieces' order and counts against the
    /// model's `num_layers` decoder layers and `mtp` depths.
    pub fn parse(layout: &str, num_layers: usize, mtp: usize) -> Result<PipelineLayout> {
        let flat = expand(layout)?;
        let mut stages = Vec::new();
        for part in flat.split('|') {
            let mut s = LayoutStage::default();
            for ch in part.chars() {
                match ch {
                    'E' => s.embedding = true,
                    't' => s.decoder += 1,
                    'm' => s.mtp += 1,
                    'L' => s.loss = true,
                    o => return Err(err(layout, format!("'{o}' is not a piece: use E, t, m, L, '|', (...)*n"))),
                }
            }
            stages.push(s);
        }
        if !flat.starts_with('E') || flat.matches('E').count() != 1 {
            return Err(err(layout, "the embedding E must come first, once"));
        }
        if !flat.ends_with('L') || flat.matches('L').count() != 1 {
            return Err(err(layout, "the loss L must come last, once"));
        }
        let (t, m) = (flat.matches('t').count(), flat.matches('m').count());
        if t != num_layers {
            return Err(err(layout, format!("{t} decoder layers (t) for --num-layers {num_layers}")));
        }
        if m != mtp {
            return Err(err(layout, format!("{m} MTP depths (m) for --mtp-num-layers {mtp}")));
        }
        if let Some(last) = stages.last().filter(|_| m > 0)
            && last.mtp != m
        {
            return Err(err(
                layout,
                "the MTP depths (m) must all be in the last stage, with the loss (MTP on a stage of its own is not built)",
            ));
        }
        if let Some(i) = flat.find('m')
            && flat[i..].contains('t')
        {
            return Err(err(layout, "the MTP depths (m) come after every decoder layer (t)"));
        }
        Ok(PipelineLayout { stages })
    }

    /// Virtual stages per pipeline rank: the stages over `pp` (which must divide them).
    pub fn virtual_stages(&self, pp: usize) -> Result<usize> {
        let n = self.stages.len();
        if pp == 0 || n % pp != 0 {
            return Err(ParallelError::Layout(format!(
                "--pipeline-model-parallel-layout has {n} stages, not a multiple of --pipeline-model-parallel-size {pp}: give pp × (virtual stages) stages separated by '|'"
            )));
        }
        Ok(n / pp)
    }

    /// The plan of pipeline rank `rank` out of `pp`.
    pub fn plan(&self, pp: usize, rank: usize) -> Result<StagePlan> {
        self.virtual_stages(pp)?;
        let sizes: Vec<usize> = self.stages.iter().map(|s| s.decoder).collect();
        stage_layers_of(&sizes, pp, rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoders(l: &PipelineLayout) -> Vec<usize> {
        l.stages.iter().map(|s| s.decoder).collect()
    }

    #[test]
    fn deepseek_v3s_layouts_expand() {
        // The MTP depth with the loss: 31 stages, the last holding no decoder layer.
        let l = PipelineLayout::parse("Ettt|(tt|)*29,mL", 61, 1).unwrap();
        assert_eq!(l.stages.len(), 31);
        assert_eq!(l.stages[0], LayoutStage { embedding: true, decoder: 3, mtp: 0, loss: false });
        assert_eq!(l.stages[29], LayoutStage { decoder: 2, ..LayoutStage::default() });
        assert_eq!(l.stages[30], LayoutStage { mtp: 1, loss: true, ..LayoutStage::default() });
        // Megatron's recipe gives the depth a stage of its own (32 stages): not built here.
        let e = PipelineLayout::parse("Ettt|(tt|)*29,m|L", 61, 1).unwrap_err().to_string();
        assert!(e.contains("with the loss (MTP on a stage of its own is not built)"), "{e}");
        assert_eq!(PipelineLayout::parse("Ettt|(tt|)*29,|L", 61, 0).unwrap().stages.len(), 32);
    }

    #[test]
    fn repeats_groups_and_interleaving() {
        let l = PipelineLayout::parse("Et*2|(t|)*2t*2L", 6, 0).unwrap();
        assert_eq!(decoders(&l), [2, 1, 1, 2]);
        // Stage s is chunk s / pp of rank s mod pp.
        let p = l.plan(2, 1).unwrap();
        assert_eq!((p.chunks, p.pre_process, p.post_process), (vec![2..3, 4..6], false, true));
        assert_eq!(l.plan(2, 0).unwrap().chunks, vec![0..2, 3..4]);
        assert_eq!(l.virtual_stages(2).unwrap(), 2);
        // Empty stages: the embedding alone, the loss alone.
        let l = PipelineLayout::parse("E|tt|tt|L", 4, 0).unwrap();
        assert_eq!(l.plan(4, 0).unwrap().chunks, vec![0..0]);
        assert_eq!(l.plan(4, 3).unwrap().chunks, vec![4..4]);
        assert_eq!(decoders(&PipelineLayout::parse("E(t(t|)*2)*2L", 6, 0).unwrap()), [2, 1, 2, 1, 0]);
    }

    #[test]
    fn bad_layouts_name_the_problem() {
        let e = |s: &str, layers: usize, mtp: usize| PipelineLayout::parse(s, layers, mtp).unwrap_err().to_string();
        assert!(e("tE|tL", 2, 0).contains("E must come first"));
        assert!(e("Et|tLt", 3, 0).contains("L must come last"));
        assert!(e("Et|tL", 3, 0).contains("2 decoder layers (t) for --num-layers 3"));
        assert!(e("Et|tL", 2, 1).contains("0 MTP depths"));
        assert!(e("Et|m|tL", 2, 1).contains("last stage, with the loss"));
        assert!(e("Et|mtL", 2, 1).contains("after every decoder layer"));
        assert!(e("Et|txL", 2, 0).contains("'x' is not a piece"));
        assert!(e("E(t|tL", 2, 0).contains("without its ')'"));
        assert!(e("Et)|tL", 2, 0).contains("unmatched ')'"));
        assert!(e("Et*|tL", 2, 0).contains("followed by a count"));
        assert!(e("E(t*1000)*100000000000L", 2, 0).contains("expands past"));
        let l = PipelineLayout::parse("Et|t|tL", 3, 0).unwrap();
        assert!(l.virtual_stages(2).unwrap_err().to_string().contains("3 stages, not a multiple"));
    }
}
