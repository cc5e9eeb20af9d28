//! Fused indexer-key insert (spec §6.2): k_norm, RoPE at the group's first position, Q3 fake
//! quant, store as key j.

use candle_core::{Result, Tensor};

use super::insert_op::{insert_rows, InsertKind};

/// Writes `G` lightning-indexer keys into an index-key cache, in place: for every key g with
/// `slots[g]` in `[0, S)`,
///
/// `cache[slots[g]] = fq_Q3(RoPE(j·r)(k_norm(k_pre[g])))` — the RMSNorm with weight
/// `k_norm_weight` and `eps` ([`crate::nn::RmsNorm`]: f32, then bf16), GPT-J RoPE on the last
/// `R = 2·cos.dim(1)` dims with the angles of the group's first position `j·r`, then (when
/// `fake_quant`) FP4 block-32 fake quantization with UE8M0 scales
/// ([`crate::quant::QatFormat::Fp4Ue8m0B32`]).
///
/// * `cache`: `[S, D_I]` bf16 (dense rows); rows not named by `slots` are left untouched.
/// * `k_pre`: `[G, D_I]` bf16, `latent · wkᵀ` for the groups closing in this call.
/// * `k_norm_weight`: `[D_I]`, any float dtype (used in f32).
/// * `eps`: the norm's epsilon (1e-20 in V4.1).
/// * `cos`, `sin`: `[G, R/2]` f32 at positions `j·r`; `slots`: `[G]` i64 (outside `[0, S)`:
///   skipped; non-negative slots unique).
///
/// On CUDA (`D_I` ∈ {64, 128, 256, 512}) one fused kernel. The norm's sum of squares is
/// reduced in the order of candle's CPU sum on x86-64 hosts with AVX2, so GPU and CPU agree bit
/// for bit there; on other hosts the CPU result can differ by an ulp before the bf16 rounding.
#[allow(clippy::too_many_arguments)]
pub fn index_key_insert(
    cache: &Tensor,
    k_pre: &Tensor,
    k_norm_weight: &Tensor,
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
    slots: &Tensor,
    fake_quant: bool,
) -> Result<()> {
    insert_rows(InsertKind::IndexKey, cache, k_pre, cos, sin, slots, Some((k_norm_weight, eps)), fake_quant)
}
