//! Packed cache rows of spec §7.2, as CPU references for packed-cache kernels.
//!
//! A row of `W` values (W a multiple of the format's block) packs into a data region and a scale
//! region, one scale byte per block:
//!
//! * format A, SWA cache ([`QatFormat::Fp8Ue8m0B32`]): `W` e4m3 bytes, `W/32` ue8m0 bytes
//!   (528 B for W = 512);
//! * format B, compressed cache ([`QatFormat::Fp4E4m3B16`]): `W/2` bytes of e2m1 pairs, `W/16`
//!   e4m3 scale bytes (288 B for W = 512);
//! * format E, MXFP4 indexer K cache ([`QatFormat::Fp4Ue8m0B32`]): `W/2` bytes of e2m1 pairs,
//!   `W/32` ue8m0 bytes (68 B for W = 128). The MXFP4 weights of §2.4 share this layout.
//!
//! Two e2m1 codes per byte: the even element in the low nibble, the odd one in the high nibble.
//! Unpacking yields exactly the values of [`super::fake_quant::fake_quant_slice`].

use candle_core::Result;

use super::fake_quant::{quantize_block, QatFormat};

/// Data bytes per row of `width` elements.
fn data_len(fmt: QatFormat, width: usize) -> usize {
    if fmt.is_fp4() {
        width / 2
    } else {
        width
    }
}

/// Quantizes and packs one row (`x.len()` a multiple of `fmt.block()`); returns
/// `(data, scales)`: the element bytes and one scale byte per block.
pub fn pack_row(fmt: QatFormat, x: &[f32]) -> Result<(Vec<u8>, Vec<u8>)> {
    let block = fmt.block();
    if !x.len().is_multiple_of(block) {
        candle_core::bail!("pack_row {fmt}: row width {} is not a multiple of the block {block}", x.len())
    }
    let mut data = Vec::with_capacity(data_len(fmt, x.len()));
    let mut scales = Vec::with_capacity(x.len() / block);
    for chunk in x.chunks(block) {
        let q = quantize_block(fmt, chunk);
        scales.push(fmt.encode_scale(q.scale)?);
        if fmt.is_fp4() {
            data.extend(q.codes.chunks(2).map(|p| p[0] | (p[1] << 4)));
        } else {
            data.extend_from_slice(&q.codes);
        }
    }
    Ok((data, scales))
}

/// Unpacks and dequantizes one row packed by [`pack_row`]; the width is implied by `data`
/// (`data.len()` for fp8, `2·data.len()` for fp4) and `scales` must hold one byte per block.
pub fn unpack_row(fmt: QatFormat, data: &[u8], scales: &[u8]) -> Result<Vec<f32>> {
    let width = if fmt.is_fp4() { 2 * data.len() } else { data.len() };
    let block = fmt.block();
    if !width.is_multiple_of(block) || scales.len() != width / block {
        candle_core::bail!(
            "unpack_row {fmt}: {} data bytes ({width} elements) need {} scale bytes and a width multiple of {block}, got {} scale bytes",
            data.len(),
            width.div_ceil(block),
            scales.len()
        )
    }
    let codes: Vec<u8> =
        if fmt.is_fp4() { data.iter().flat_map(|&b| [b & 0x0f, b >> 4]).collect() } else { data.to_vec() };
    Ok(codes
        .chunks(block)
        .zip(scales)
        .flat_map(|(chunk, &sb)| {
            let s = fmt.decode_scale(sb);
            chunk.iter().map(move |&c| fmt.decode_element(c) * s)
        })
        .collect())
}

/// Format A (SWA cache, Q1): packs a row into `(e4m3 bytes [W], ue8m0 scales [W/32])`.
pub fn pack_fp8_row(x: &[f32]) -> Result<(Vec<u8>, Vec<u8>)> {
    pack_row(QatFormat::Fp8Ue8m0B32, x)
}

/// Inverse of [`pack_fp8_row`]: `data [W]`, `scales [W/32]` → `W` values.
pub fn unpack_fp8_row(data: &[u8], scales: &[u8]) -> Result<Vec<f32>> {
    unpack_row(QatFormat::Fp8Ue8m0B32, data, scales)
}

/// Format B (compressed cache, Q2): packs a row into `(e2m1 pairs [W/2], e4m3 scales [W/16])`.
pub fn pack_fp4_row(x: &[f32]) -> Result<(Vec<u8>, Vec<u8>)> {
    pack_row(QatFormat::Fp4E4m3B16, x)
}

/// Inverse of [`pack_fp4_row`]: `data [W/2]`, `scales [W/16]` → `W` values.
pub fn unpack_fp4_row(data: &[u8], scales: &[u8]) -> Result<Vec<f32>> {
    unpack_row(QatFormat::Fp4E4m3B16, data, scales)
}

/// Format E, MXFP4 (index keys, Q3): packs a row into `(e2m1 pairs [W/2], ue8m0 scales [W/32])`.
pub fn pack_index_fp4_row(x: &[f32]) -> Result<(Vec<u8>, Vec<u8>)> {
    pack_row(QatFormat::Fp4Ue8m0B32, x)
}

/// Inverse of [`pack_index_fp4_row`]: `data [W/2]`, `scales [W/32]` → `W` values. Also decodes
/// an MXFP4 weight row (spec §2.4).
pub fn unpack_index_fp4_row(data: &[u8], scales: &[u8]) -> Result<Vec<f32>> {
    unpack_row(QatFormat::Fp4Ue8m0B32, data, scales)
}

#[cfg(test)]
#[path = "packed_tests.rs"]
mod tests;
