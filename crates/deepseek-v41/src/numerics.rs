//! Numerics switches: the reference's trained numerics, or plain ones.

/// Which numerics the modules emulate.
///
/// The official reference rounds three activation families through low-bit formats (QAT
/// fake-quant: the window KV, the compressed KV, the index q/k) and quantizes the input of every
/// FP8/FP4-weight linear to e4m3 per 1x32 block. [`Numerics::REFERENCE`] reproduces both, which
/// is what the golden data encodes; [`Numerics::PLAIN`] turns both off (the fast path of a bf16
/// GPU run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Numerics {
    /// Cache fake-quantization (spec §2.3, Q1/Q2/Q3): window KV fp8, compressed KV fp4,
    /// index q/k fp4. The golden sets call this `qat`.
    pub cache_fake_quant: bool,
    /// FP8 activation quantization (1x32 blocks, UE8M0 scale, e4m3) of the input of every
    /// FP8/FP4-weight linear (spec §0.1b.8, §2.5).
    pub activation_quant: bool,
}

impl Numerics {
    /// The reference's numerics: both switches on (default).
    pub const REFERENCE: Numerics = Numerics { cache_fake_quant: true, activation_quant: true };
    /// Plain numerics: no fake quant and no activation quantization.
    pub const PLAIN: Numerics = Numerics { cache_fake_quant: false, activation_quant: false };
}

impl Default for Numerics {
    fn default() -> Self {
        Self::REFERENCE
    }
}
