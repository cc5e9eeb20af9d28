//! Fused window-KV insert (spec §4.3): RoPE at the token's position, Q1 fake quant, store.

use candle_core::{Result, Tensor};

use super::insert_op::{insert_rows, InsertKind};

/// Writes the window-KV rows of `T` tokens (any number of sequences) into a row cache, in
/// place: for every token t with `slots[t]` in `[0, S)`,
///
/// `cache[slots[t]] = fq_Q1(RoPE(kv[t]))` — GPT-J RoPE on the last `R = 2·cos.dim(1)` dims
/// with the token's `cos[t]`/`sin[t]` row, then (when `fake_quant`) FP8-UE8M0 block-32 fake
/// quantization over all D dims ([`crate::quant::QatFormat::Fp8Ue8m0B32`]).
///
/// * `cache`: `[S, D]` bf16 (a view with dense rows is fine); rows not named by `slots` are
///   left untouched.
/// * `kv`: `[T, D]` bf16, the `kv_norm`'ed window KV of the tokens (any strides).
/// * `cos`, `sin`: `[T, R/2]` f32, the angles of each token's position, as returned by
///   [`crate::nn::RopeTable::cos_sin`] (computing them once per step serves q, kv and every
///   layer of the same frequency set).
/// * `slots`: `[T]` i64 row indices (a ring slot `p mod W`, a paged slot, ...); values outside
///   `[0, S)` skip the token (padding). Non-negative slots must be unique within a call; for a
///   ring that wraps within one call use [`super::keep_last_writer`].
///
/// On CUDA (`D` ∈ {64, 128, 256, 512}) one fused kernel; on the CPU the crate's reference
/// ([`crate::nn::rope::apply_rope_tail`] then [`crate::quant::fake_quant()`]); the two agree bit
/// for bit. Errors name the offending tensor on dtype, shape or device mismatches.
pub fn window_insert(
    cache: &Tensor,
    kv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    slots: &Tensor,
    fake_quant: bool,
) -> Result<()> {
    insert_rows(InsertKind::Window, cache, kv, cos, sin, slots, None, fake_quant)
}
