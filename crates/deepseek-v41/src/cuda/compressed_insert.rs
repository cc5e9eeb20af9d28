//! Fused compressed-KV insert (spec §4.4, §5.4): RoPE at the group's first position, Q2 fake
//! quant, store as entry j.

use candle_core::{Result, Tensor};

use super::insert_op::{insert_rows, InsertKind};

/// Writes `G` compressed KV entries into a compressed cache, in place: for every entry g with
/// `slots[g]` in `[0, S)`,
///
/// `cache[slots[g]] = fq_Q2(RoPE(j·r)(latent[g]))` — GPT-J RoPE on the last `R = 2·cos.dim(1)`
/// dims with `cos[g]`/`sin[g]` (the angles of the group's **first** position `j·r`, spec §2.2),
/// then (when `fake_quant`) FP4 block-16 fake quantization with e4m3 scales over all D dims
/// ([`crate::quant::QatFormat::Fp4E4m3B16`]).
///
/// * `cache`: `[S, D]` bf16 (dense rows); rows not named by `slots` are left untouched.
/// * `latent`: `[G, D]` bf16, the compressor's normed, pre-RoPE output for the groups that
///   close in this call (any number of sequences).
/// * `cos`, `sin`: `[G, R/2]` f32 from [`crate::nn::RopeTable::cos_sin`] at positions `j·r`.
/// * `slots`: `[G]` i64 entry rows (typically `j`, or a paged slot); values outside `[0, S)`
///   are skipped; non-negative slots must be unique.
///
/// On CUDA (`D` ∈ {64, 128, 256, 512}) one fused kernel; on the CPU the crate's reference; bit
/// for bit equal.
pub fn compressed_insert(
    cache: &Tensor,
    latent: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    slots: &Tensor,
    fake_quant: bool,
) -> Result<()> {
    insert_rows(InsertKind::Compressed, cache, latent, cos, sin, slots, None, fake_quant)
}
