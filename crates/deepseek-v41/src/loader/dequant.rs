//! Dequantization of the release weight formats (spec §2.4), as pure functions on raw bytes.
//!
//! * [`dequant_fp8_block32`]: dense FP8, `F8_E4M3 [out, in]` with one e8m0 scale per 32×32 block,
//!   scale `[ceil(out/32), ceil(in/32)]`.
//! * [`dequant_mxfp4`]: routed experts, two e2m1 codes per byte (low nibble = even input index),
//!   one e8m0 scale per row per 32 logical inputs, scale `[out, ceil(in/32)]`.
//! * [`dequant_fp8_rows`]: Engram tables, `F8_E4M3 [rows, cols]` with one e8m0 scale per row per
//!   32 columns, scale `[rows, ceil(cols/32)]`.
//!
//! Scale bytes are read raw (never through a numeric cast, spec §2.4 "e8m0 decode").
//!
//! Signed zeros: the reference obtains FP8/MXFP4 *matrix* weights through its GEMM, so a stored
//! negative zero (e4m3 `0x80`, e2m1 code 8) dequantizes to `+0.0` there (spec §14 item 14, golden
//! `dq.mxfp4.crafted`); [`dequant_fp8_block32`] and [`dequant_mxfp4`] return `+0.0`. Engram rows
//! are a plain lookup times the scale, so [`dequant_fp8_rows`] keeps the sign.

use std::sync::OnceLock;

use super::error::LoadError;
use crate::quant::formats::{e2m1_to_f32, e4m3_to_f32, e8m0_to_f32};

/// Elements covered by one scale along a dimension.
pub const BLOCK: usize = 32;

fn e4m3_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

fn e8m0_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|b| e8m0_to_f32(b as u8)))
}

/// The two e2m1 values of each packed byte: `[low nibble (even index), high nibble (odd index)]`.
fn e2m1_pair_table() -> &'static [[f32; 2]; 256] {
    static T: OnceLock<[[f32; 2]; 256]> = OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|b| [e2m1_to_f32(b as u8 & 0x0f), e2m1_to_f32(b as u8 >> 4)]))
}

/// `ceil(n / 32)`: the number of scale blocks covering `n` elements.
pub fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

fn check_len(what: &'static str, buf: &[u8], expected: usize, dims: impl FnOnce() -> String) -> Result<(), LoadError> {
    if buf.len() == expected {
        Ok(())
    } else {
        Err(LoadError::BufferLength {
            what,
            dims: dims(),
            expected,
            found: buf.len(),
        })
    }
}

/// Dense FP8 weight with 32×32 block scales.
///
/// * `weight`: e4m3fn bytes of `[out, inp]`, row-major (`out * inp` bytes).
/// * `scale`: e8m0 bytes of `[ceil(out/32), ceil(inp/32)]`; block `(r div 32, c div 32)` scales
///   `W[r, c]`. Edge blocks of dims that are not multiples of 32 are partial.
///
/// Returns the f32 weight `[out, inp]` row-major: `W[r,c] = e4m3(w[r,c]) · 2^(s[r/32, c/32] − 127)`,
/// negative zeros returned as `+0.0`. Errors if a buffer length does not match the dims.
pub fn dequant_fp8_block32(weight: &[u8], scale: &[u8], out: usize, inp: usize) -> Result<Vec<f32>, LoadError> {
    let (sr, sc) = (blocks(out), blocks(inp));
    check_len("FP8 block-32 weight (e4m3)", weight, out * inp, || {
        format!("[{out}, {inp}]")
    })?;
    check_len("FP8 block-32 scale (e8m0)", scale, sr * sc, || {
        format!("[{sr}, {sc}] (weight [{out}, {inp}])")
    })?;
    let (lut, s_lut) = (e4m3_table(), e8m0_table());
    let mut dst = Vec::with_capacity(out * inp);
    for (r, row) in weight.chunks_exact(inp.max(1)).take(out).enumerate() {
        let srow = &scale[(r / BLOCK) * sc..(r / BLOCK + 1) * sc];
        for (c, &b) in row.iter().enumerate() {
            // `+ 0.0` turns -0.0 into +0.0 and leaves every other value unchanged.
            dst.push(lut[b as usize] * s_lut[srow[c / BLOCK] as usize] + 0.0);
        }
    }
    Ok(dst)
}

/// MXFP4 (e2m1 codes, 32-element e8m0 blocks along the input dimension).
///
/// * `packed`: `[out, inp/2]` bytes; byte `j` of a row holds input `2j` in its low nibble and
///   `2j+1` in its high nibble. `inp` must be even.
/// * `scale`: e8m0 bytes of `[out, ceil(inp/32)]`, one per row per 32 logical inputs.
///
/// Returns the f32 weight `[out, inp]` row-major: `W[r,c] = e2m1(code(r,c)) · 2^(s[r, c/32] − 127)`,
/// code 8 ("−0") returned as `+0.0`. Errors on an odd `inp` or a buffer length mismatch.
pub fn dequant_mxfp4(packed: &[u8], scale: &[u8], out: usize, inp: usize) -> Result<Vec<f32>, LoadError> {
    if !inp.is_multiple_of(2) {
        return Err(LoadError::BufferLength {
            what: "MXFP4 weight (logical input dim must be even)",
            dims: format!("[{out}, {inp}]"),
            expected: out * inp.div_ceil(2),
            found: packed.len(),
        });
    }
    let sc = blocks(inp);
    check_len("MXFP4 packed weight", packed, out * inp / 2, || {
        format!("[{out}, {inp}] (packed [{out}, {}])", inp / 2)
    })?;
    check_len("MXFP4 scale (e8m0)", scale, out * sc, || {
        format!("[{out}, {sc}] (weight [{out}, {inp}])")
    })?;
    let (pairs, s_lut) = (e2m1_pair_table(), e8m0_table());
    let mut dst = Vec::with_capacity(out * inp);
    for (r, row) in packed.chunks_exact((inp / 2).max(1)).take(out).enumerate() {
        let srow = &scale[r * sc..(r + 1) * sc];
        for (j, &b) in row.iter().enumerate() {
            let s = s_lut[srow[(2 * j) / BLOCK] as usize];
            let [lo, hi] = pairs[b as usize];
            dst.push(lo * s + 0.0);
            dst.push(hi * s + 0.0);
        }
    }
    Ok(dst)
}

/// FP8 rows with one e8m0 scale per row per 32 columns (Engram tables, spec §2.4).
///
/// * `weight`: e4m3fn bytes of `[rows, cols]`.
/// * `scale`: e8m0 bytes of `[rows, ceil(cols/32)]`.
///
/// Returns the f32 rows `[rows, cols]` row-major: `W[r,c] = e4m3(w[r,c]) · 2^(s[r, c/32] − 127)`
/// (signed zeros kept). To dequantize selected rows only, pass the bytes of those rows with
/// `rows` = their count (see [`super::ReleaseCheckpoint::get_raw_rows`]).
pub fn dequant_fp8_rows(weight: &[u8], scale: &[u8], rows: usize, cols: usize) -> Result<Vec<f32>, LoadError> {
    let sc = blocks(cols);
    check_len("FP8 row weight (e4m3)", weight, rows * cols, || {
        format!("[{rows}, {cols}]")
    })?;
    check_len("FP8 row scale (e8m0)", scale, rows * sc, || {
        format!("[{rows}, {sc}] (weight [{rows}, {cols}])")
    })?;
    let (lut, s_lut) = (e4m3_table(), e8m0_table());
    let mut dst = Vec::with_capacity(rows * cols);
    for (r, row) in weight.chunks_exact(cols.max(1)).take(rows).enumerate() {
        let srow = &scale[r * sc..(r + 1) * sc];
        for (c, &b) in row.iter().enumerate() {
            dst.push(lut[b as usize] * s_lut[srow[c / BLOCK] as usize]);
        }
    }
    Ok(dst)
}

/// Every product of [`dequant_fp8_rows`]: entry `s · 256 + c` is `e4m3(c) · 2^(s − 127)` in f32
/// (signed zeros kept, scale byte 255 NaN), computed by [`dequant_fp8_rows`] itself. A row
/// decoder that looks these up by `(scale byte, code byte)` — e.g. a gather on the device
/// (`model::engram_host`) — returns exactly what [`dequant_fp8_rows`] returns, with no float
/// arithmetic of its own.
pub fn fp8_rows_products() -> Result<Vec<f32>, LoadError> {
    let codes: Vec<u8> = (0..256 * 256).map(|i| (i % 256) as u8).collect();
    let scales: Vec<u8> = (0..256 * 8).map(|i| (i / 8) as u8).collect();
    // 256 rows of 256 columns, row s scaled by s in each of its 8 blocks: row s, column c is
    // e4m3(c) · 2^(s − 127).
    dequant_fp8_rows(&codes, &scales, 256, 256)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spec §2.4 FP8 test vector (`layers.0.attn.wkv.weight` row 0, block scale 0x73 = 2^-12).
    #[test]
    fn fp8_spec_vector() {
        let bytes = [0xd8u8, 0x71, 0xf2, 0x79, 0x70, 0x69, 0xf0, 0xe5];
        let expect = [
            -0.00390625f32,
            0.03515625,
            -0.0390625,
            0.0703125,
            0.03125,
            0.017578125,
            -0.03125,
            -0.0126953125,
        ];
        // A 1x8 matrix: one (partial) 32x32 block.
        let got = dequant_fp8_block32(&bytes, &[0x73], 1, 8).unwrap();
        assert_eq!(got, expect);
        let rows = dequant_fp8_rows(&bytes, &[0x73], 1, 8).unwrap();
        assert_eq!(rows, expect);
    }

    /// Spec §2.4 MXFP4 test vector (`layers.0.ffn.experts.0.w1.weight` row 0, scale 0x78 = 2^-7).
    #[test]
    fn mxfp4_spec_vector() {
        let bytes = [0xa0u8, 0xa8, 0xec, 0x4a, 0xad, 0xaf, 0x42, 0xaa];
        let expect = [
            0.0f32, -0.0078125, 0.0, -0.0078125, -0.015625, -0.03125, -0.0078125, 0.015625, -0.0234375, -0.0078125,
            -0.046875, -0.0078125, 0.0078125, 0.015625, -0.0078125, -0.0078125,
        ];
        let got = dequant_mxfp4(&bytes, &[0x78], 1, 16).unwrap();
        assert_eq!(got, expect);
        // Code 8 is +0.0 (bit pattern), not -0.0.
        assert_eq!(got[2].to_bits(), 0);
    }

    /// Non-multiple-of-32 dims: a 33x40 matrix has 2x2 blocks; every element must pick its block.
    #[test]
    fn fp8_partial_blocks() {
        let (out, inp) = (33usize, 40usize);
        let weight = vec![0x38u8; out * inp]; // e4m3 0x38 = 1.0
        let scale = [127u8, 128, 129, 130]; // 1, 2, 4, 8
        let w = dequant_fp8_block32(&weight, &scale, out, inp).unwrap();
        for r in 0..out {
            for c in 0..inp {
                let expect = [1.0f32, 2.0, 4.0, 8.0][(r / 32) * 2 + c / 32];
                assert_eq!(w[r * inp + c], expect, "r={r} c={c}");
            }
        }
        // Wrong scale length (a 128x128-block layout would have 1 scale) is an error, not a panic.
        let e = dequant_fp8_block32(&weight, &[127u8], out, inp)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected 4 bytes") && e.contains("got 1"), "{e}");
    }

    /// MXFP4 with a row length that is not a multiple of 32 (48 inputs -> 2 scales per row), and
    /// the nibble order: low nibble = even index.
    #[test]
    fn mxfp4_partial_blocks_and_nibble_order() {
        let (out, inp) = (2usize, 48usize);
        // Byte 0x71: low nibble 1 (0.5) at even index, high nibble 7 (6.0) at odd index.
        let packed = vec![0x71u8; out * inp / 2];
        let scale = [127u8, 128, 126, 129]; // row 0: 1, 2; row 1: 0.5, 4
        let w = dequant_mxfp4(&packed, &scale, out, inp).unwrap();
        for r in 0..out {
            for c in 0..inp {
                let s = [[1.0f32, 2.0], [0.5, 4.0]][r][c / 32];
                let v = if c % 2 == 0 { 0.5 } else { 6.0 };
                assert_eq!(w[r * inp + c], v * s, "r={r} c={c}");
            }
        }
        assert!(dequant_mxfp4(&packed, &scale, out, 47).is_err());
        assert!(dequant_mxfp4(&packed[1..], &scale, out, inp).is_err());
    }

    /// Per-row scales: each row uses its own scale row (a 32x32-block reading would not).
    #[test]
    fn fp8_rows_use_own_scale() {
        let weight = vec![0x38u8; 3 * 64]; // 1.0
        let scale = [127u8, 128, 129, 130, 131, 132];
        let w = dequant_fp8_rows(&weight, &scale, 3, 64).unwrap();
        for r in 0..3 {
            for c in 0..64 {
                assert_eq!(w[r * 64 + c], 2f32.powi((r * 2 + c / 32) as i32));
            }
        }
        // Signed zero kept in the row path.
        let z = dequant_fp8_rows(&[0x80], &[127], 1, 1).unwrap();
        assert_eq!(z[0].to_bits(), 0x8000_0000);
    }

    /// The product table: every (scale, code) pair as `dequant_fp8_rows` of a one-element row.
    #[test]
    fn fp8_rows_product_table() {
        let t = fp8_rows_products().unwrap();
        assert_eq!(t.len(), 65536);
        for s in 0..=255u8 {
            for c in 0..=255u8 {
                let want = dequant_fp8_rows(&[c], &[s], 1, 1).unwrap()[0];
                assert_eq!(t[s as usize * 256 + c as usize].to_bits(), want.to_bits(), "s={s} c={c}");
            }
        }
    }

    /// e8m0 255 is NaN; scale bytes are read raw (2^-7 stays 2^-7, not 0).
    #[test]
    fn e8m0_raw_bytes() {
        let w = dequant_fp8_rows(&[0x38, 0x38], &[120, 255], 2, 1).unwrap();
        assert_eq!(w[0], 2f32.powi(-7));
        assert!(w[1].is_nan());
    }
}
