//! The three QAT fake-quantization functions of the reference (spec §2.3): the activation
//! families the model was trained to see rounded through low-bit formats.
//!
//! | format | used for | block | scale | element |
//! |---|---|---|---|---|
//! | [`QatFormat::Fp8Ue8m0B32`] (Q1) | window KV (all 512 dims) | 32 | `2^ceil(log2(max(amax,1e-4)/448))` | e4m3 |
//! | [`QatFormat::Fp4E4m3B16`] (Q2) | compressed KV (after RoPE) | 16 | `e4m3(max(amax,6·2^-9)/6)` ≤ 448 | e2m1 |
//! | [`QatFormat::Fp4Ue8m0B32`] (Q3) | index q and k (after RoPE) | 32 | `2^ceil(log2(max(amax,6·2^-126)/6))` | e2m1 |
//!
//! Elements are `q = round(clamp(x / s, ±max))` with an IEEE f32 division (not a reciprocal
//! multiply: exact ties must stay ties) and round-to-nearest-even, and the fake-quantized value
//! is `q · s`, exact in f32 and bf16. The sign of zero is kept (a negative value rounding to zero
//! becomes -0.0, fp4 code 8; spec §0.1b.7).
//!
//! Q1 is also the reference's FP8 activation quantization ([`super::act_quant`]).

use candle_core::{DType, Result, Tensor, D};

use super::formats::{
    ceil_log2, e2m1_to_f32, e4m3_to_f32, e8m0_to_f32, f32_to_e2m1, f32_to_e4m3, f32_to_e8m0, pow2, round_to_e2m1,
    round_to_e4m3, E2M1_MAX, E4M3_MAX,
};

/// One of the reference's three QAT fake-quantization formats (spec §2.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QatFormat {
    /// Q1, window KV: e4m3 elements, UE8M0 (power-of-two) scale, block 32, amax floor 1e-4.
    Fp8Ue8m0B32,
    /// Q2, compressed KV: e2m1 elements, e4m3 scale, block 16, amax floor 6·2^-9.
    Fp4E4m3B16,
    /// Q3, index queries and keys: e2m1 elements, UE8M0 scale, block 32, amax floor 6·2^-126.
    Fp4Ue8m0B32,
}

impl QatFormat {
    /// Number of contiguous last-dim elements sharing one scale.
    pub const fn block(self) -> usize {
        match self {
            Self::Fp8Ue8m0B32 | Self::Fp4Ue8m0B32 => 32,
            Self::Fp4E4m3B16 => 16,
        }
    }

    /// The format's name in the golden data (`fq.<name>.*`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Fp8Ue8m0B32 => "fp8_ue8m0_b32",
            Self::Fp4E4m3B16 => "fp4_e4m3_b16",
            Self::Fp4Ue8m0B32 => "fp4_ue8m0_b32",
        }
    }

    /// Whether elements are e2m1 (fp4) codes; otherwise e4m3 bytes.
    pub const fn is_fp4(self) -> bool {
        !matches!(self, Self::Fp8Ue8m0B32)
    }

    /// Largest element magnitude (the clamp bound of `x / s`).
    const fn element_max(self) -> f32 {
        if self.is_fp4() {
            E2M1_MAX
        } else {
            E4M3_MAX
        }
    }

    /// The block scale for a block whose largest magnitude is `amax` (the floor is applied
    /// here). Always a positive value of the scale format for finite `amax`.
    pub fn scale(self, amax: f32) -> f32 {
        match self {
            Self::Fp8Ue8m0B32 => pow2(ceil_log2(amax.max(1e-4) / E4M3_MAX)),
            Self::Fp4E4m3B16 => round_to_e4m3(amax.max(6.0 * pow2(-9)) / E2M1_MAX).min(E4M3_MAX),
            Self::Fp4Ue8m0B32 => pow2(ceil_log2(amax.max(6.0 * pow2(-126)) / E2M1_MAX)),
        }
    }

    /// Encodes a block scale (as returned by [`QatFormat::scale`]) into its byte: e8m0 for the
    /// UE8M0 formats, e4m3 for [`QatFormat::Fp4E4m3B16`].
    pub fn encode_scale(self, scale: f32) -> Result<u8> {
        match self {
            Self::Fp4E4m3B16 => {
                let b = f32_to_e4m3(scale);
                if e4m3_to_f32(b) != scale {
                    candle_core::bail!("{}: scale {scale:e} is not an e4m3 value", self.name())
                }
                Ok(b)
            }
            _ => f32_to_e8m0(scale),
        }
    }

    /// Decodes a scale byte (inverse of [`QatFormat::encode_scale`]).
    pub fn decode_scale(self, byte: u8) -> f32 {
        match self {
            Self::Fp4E4m3B16 => e4m3_to_f32(byte),
            _ => e8m0_to_f32(byte),
        }
    }

    /// Rounds an already-scaled value `y = x / s` to the element grid (clamped to ±max).
    fn round_element(self, y: f32) -> f32 {
        let y = y.clamp(-self.element_max(), self.element_max());
        if self.is_fp4() {
            round_to_e2m1(y)
        } else {
            round_to_e4m3(y)
        }
    }

    /// Encodes an already-scaled value `y = x / s` as an element code (e4m3 byte or e2m1 code).
    pub fn encode_element(self, y: f32) -> u8 {
        let y = y.clamp(-self.element_max(), self.element_max());
        if self.is_fp4() {
            f32_to_e2m1(y)
        } else {
            f32_to_e4m3(y)
        }
    }

    /// Decodes an element code (e4m3 byte or e2m1 code in the low nibble).
    pub fn decode_element(self, code: u8) -> f32 {
        if self.is_fp4() {
            e2m1_to_f32(code & 0x0f)
        } else {
            e4m3_to_f32(code)
        }
    }
}

impl std::fmt::Display for QatFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Largest magnitude of a block (NaNs ignored).
fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// One quantized block: element codes and the block scale.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantBlock {
    /// The format the block was quantized with.
    pub format: QatFormat,
    /// One code per element: e4m3 bytes (Q1) or e2m1 codes in `0..16` (Q2, Q3; bit 3 = sign).
    pub codes: Vec<u8>,
    /// The block scale as an f32 value (a power of two, or an e4m3 value for Q2).
    pub scale: f32,
}

impl QuantBlock {
    /// The dequantized values `decode(code) · scale`, equal to [`fake_quant_slice`] of the input.
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes.iter().map(|&c| self.format.decode_element(c) * self.scale).collect()
    }
}

/// Quantizes `x` as one block of `fmt` (callers pass `fmt.block()` elements; any length works
/// and shares one scale).
pub fn quantize_block(fmt: QatFormat, x: &[f32]) -> QuantBlock {
    let scale = fmt.scale(amax(x));
    let codes = x.iter().map(|&v| fmt.encode_element(v / scale)).collect();
    QuantBlock { format: fmt, codes, scale }
}

/// Fake-quantizes `x` in place as one block of `fmt` (any length; one shared scale).
pub fn fake_quant_block(fmt: QatFormat, x: &mut [f32]) {
    let scale = fmt.scale(amax(x));
    for v in x.iter_mut() {
        *v = fmt.round_element(*v / scale) * scale;
    }
}

/// Fake-quantizes `x` in place, block by block; `x.len()` must be a multiple of `fmt.block()`.
pub fn fake_quant_slice(fmt: QatFormat, x: &mut [f32]) -> Result<()> {
    let block = fmt.block();
    if !x.len().is_multiple_of(block) {
        candle_core::bail!("fake_quant_slice {fmt}: length {} is not a multiple of the block {block}", x.len())
    }
    x.chunks_mut(block).for_each(|b| fake_quant_block(fmt, b));
    Ok(())
}

/// Fake-quantizes `x` (`[..., K]`, K a multiple of `fmt.block()`, any float dtype) per block of
/// the last dim; returns the dequantized values `[..., K]` in `x`'s dtype and device (exact in
/// f32 and bf16). Computed on the host in f32, except for bf16 / f32 tensors on a CUDA device
/// (with the `cuda` feature), which one kernel computes in place on the device, bit for bit
/// equal (`cuda::fake_quant_device`).
pub fn fake_quant(x: &Tensor, fmt: QatFormat) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_kernels(x.device()) {
        return crate::cuda::fake_quant_device(x, fmt);
    }
    fake_quant_host(x, fmt)
}

/// [`fake_quant()`] computed on the host whatever the device of `x` (the reference).
pub(crate) fn fake_quant_host(x: &Tensor, fmt: QatFormat) -> Result<Tensor> {
    map_blocks(x, fmt.block(), &format!("fake_quant {fmt}"), |b| fake_quant_block(fmt, b))
}

/// Applies `f` to every `block`-wide chunk of the last dim of `x` (computed in f32 on the host),
/// returning `x`'s shape, dtype and device. `what` names the operation in errors.
pub(crate) fn map_blocks(x: &Tensor, block: usize, what: &str, f: impl Fn(&mut [f32])) -> Result<Tensor> {
    if !x.dtype().is_float() {
        candle_core::bail!("{what}: expected a float tensor, got {:?} of shape {:?}", x.dtype(), x.shape())
    }
    if x.rank() == 0 {
        candle_core::bail!("{what}: expected a tensor with a last dim, got a scalar")
    }
    let k = x.dim(D::Minus1)?;
    if !k.is_multiple_of(block) {
        candle_core::bail!("{what}: last dim {k} of shape {:?} is not a multiple of the block {block}", x.shape())
    }
    let mut v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    v.chunks_mut(block).for_each(f);
    Tensor::from_vec(v, x.shape(), x.device())?.to_dtype(x.dtype())
}

#[cfg(test)]
#[path = "fake_quant_tests.rs"]
mod tests;
