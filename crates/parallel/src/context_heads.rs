//! Context-parallel core attention by all-to-all (Megatron's `--cp-comm-type a2a`,
//! DeepSpeed-Ulysses): q, k and v trade this rank's two chunks of every head for the whole
//! sequence of 1/cp of the heads (`to_channels`, the exchange Mamba's mixer uses), the plain
//! attention kernels run on those over the whole sequence, and the output trades back
//! (`to_sequence`). Nothing is split along the keys, so any mask works: a sliding window, no
//! causal mask, dropout drawn whole (the rank's heads at their global index), document-wise
//! masks (`AttnCfg::docs` then holds the whole rows' starts, [B, T], not this rank's rows).
//!
//! Rank r gets query heads r·Hq/cp.. and key/value heads r·Hkv/cp..: with Hkv divisible by cp,
//! query head h's group h·Hkv/Hq is among them, so GQA needs no repeated K/V.
//!
//! Shapes: q, o, dq [B, 2c, Hq, D]; k, v, dk, dv [B, 2c, Hkv, D·]; lse [B, Hq, 2c], this rank's
//! rows (the layout of `k::attention_fwd` on the local sequence, which the sink softmax reads);
//! inside, [B, T, H/cp, D·] and lse [B, Hq/cp, T]. The backward trades q, k, v, o, dO and lse
//! again rather than keeping the forward's traded copies (as the all-gather path re-gathers).

use crate::context::{ContextParallel, dims4};
use ferrotron_core::{Result, Tensor, invalid, shape_mismatch};
use ferrotron_kernels::{self as k, AttnCfg};

impl ContextParallel {
    /// The all-to-all's condition: both head counts divisible by the group, or the error naming
    /// the fix.
    pub fn check_heads(&self, hq: usize, hkv: usize) -> Result<()> {
        let n = self.size();
        if hq % n != 0 || hkv % n != 0 {
            return Err(invalid(
                "context parallelism by all-to-all",
                format!(
                    "--cp-comm-type a2a gives each of the --context-parallel-size {n} ranks 1/{n} of the heads: this rank's {hq} attention heads and {hkv} query groups must both be multiples of {n}; use --cp-comm-type allgather or another context-parallel size"
                ),
            ));
        }
        Ok(())
    }

    pub(crate) fn heads_attention_fwd(
        &self,
        q: &Tensor,
        kk: &Tensor,
        v: &Tensor,
        cfg: &AttnCfg,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "context-parallel (all-to-all) attention_fwd";
        let [_, _, hq, _] = dims4(OP, q)?;
        let [_, _, hkv, _] = dims4(OP, kk)?;
        self.check_heads(hq, hkv)?;
        let (qh, kh, vh) = (self.heads_of(q)?, self.heads_of(kk)?, self.heads_of(v)?);
        let (o, lse) = k::attention_fwd(&qh, &kh, &vh, &self.heads_cfg(cfg, hq))?;
        Ok((self.rows_of(&o)?, self.lse_rows(&lse)?))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn heads_attention_bwd(
        &self,
        q: &Tensor,
        kk: &Tensor,
        v: &Tensor,
        o: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        cfg: &AttnCfg,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "context-parallel (all-to-all) attention_bwd";
        let [_, _, hq, _] = dims4(OP, q)?;
        let [_, _, hkv, _] = dims4(OP, kk)?;
        self.check_heads(hq, hkv)?;
        let (qh, kh, vh) = (self.heads_of(q)?, self.heads_of(kk)?, self.heads_of(v)?);
        let (oh, doh, lseh) = (self.heads_of(o)?, self.heads_of(dout)?, self.lse_heads(lse)?);
        let (dq, dk, dv) = k::attention_bwd(&qh, &kh, &vh, &oh, &lseh, &doh, &self.heads_cfg(cfg, hq))?;
        Ok((self.rows_of(&dq)?, self.rows_of(&dk)?, self.rows_of(&dv)?))
    }

    /// The whole sequence's attention settings for this rank's heads: dropout at their global
    /// index (the key's `head_offset` is the tensor-parallel rank's first head).
    fn heads_cfg<'a>(&self, cfg: &AttnCfg<'a>, hq: usize) -> AttnCfg<'a> {
        let first = (self.rank() * hq / self.size()) as u64;
        let dropout = cfg.dropout.map(|d| k::AttnDropout { head_offset: d.head_offset + first, ..d });
        AttnCfg { dropout, ..*cfg }
    }

    /// x [B, 2c, H, D] (this rank's rows) → [B, T, H/cp, D] (every row of its heads).
    fn heads_of(&self, x: &Tensor) -> Result<Tensor> {
        let [b, t2, h, d] = dims4("ContextParallel::heads_of", x)?;
        let y = self.to_channels(&x.contiguous()?.reshape([b, t2, h * d])?, &[h * d])?;
        y.reshape([b, t2 * self.size(), h / self.size(), d])
    }

    /// `heads_of`'s inverse: [B, T, H/cp, D] → [B, 2c, H, D].
    fn rows_of(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.size();
        let [b, t, hl, d] = dims4("ContextParallel::rows_of", x)?;
        let y = self.to_sequence(&x.contiguous()?.reshape([b, t, hl * d])?, &[hl * d * n])?;
        y.reshape([b, t / n, hl * n, d])
    }

    /// The inner lse [B, H/cp, T] → this rank's rows [B, H, 2c].
    fn lse_rows(&self, lse: &Tensor) -> Result<Tensor> {
        let n = self.size();
        let rows = lse.transpose(1, 2)?.contiguous()?; // [B, T, H/cp]
        let hl = rows.dims()[2];
        self.to_sequence(&rows, &[hl * n])?.transpose(1, 2)?.contiguous()
    }

    /// `lse_rows`' inverse: [B, H, 2c] → [B, H/cp, T].
    fn lse_heads(&self, lse: &Tensor) -> Result<Tensor> {
        if lse.dims().len() != 3 {
            return Err(shape_mismatch("ContextParallel::lse_heads", "lse [B, H, 2c] (the forward's)", lse.dims()));
        }
        let rows = lse.transpose(1, 2)?.contiguous()?; // [B, 2c, H]
        let h = rows.dims()[2];
        self.to_channels(&rows, &[h])?.transpose(1, 2)?.contiguous()
    }
}
