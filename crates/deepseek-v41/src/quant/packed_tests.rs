//! Packed rows: round trips, byte budgets, and the reference's weight-decode goldens (`dq.*`).

use super::*;
use crate::quant::fake_quant::fake_quant_slice;
use crate::quant::formats::{e4m3_to_f32, e8m0_to_f32};
use crate::quant::test_golden::{f32_rows, modules, u8_rows};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn row(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|i| {
            s = s.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let m = ((s >> 12) & 0x3ff) as f32 / 256.0 - 2.0;
            let v = m * 2f32.powi((i / 32) as i32 % 9 - 4);
            half::bf16::from_f32(v).to_f32()
        })
        .collect()
}

#[test]
fn round_trip_equals_fake_quant_and_byte_budgets() -> anyhow::Result<()> {
    type Pack = fn(&[f32]) -> candle_core::Result<(Vec<u8>, Vec<u8>)>;
    type Unpack = fn(&[u8], &[u8]) -> candle_core::Result<Vec<f32>>;
    let cases: [(QatFormat, Pack, Unpack, usize, usize); 3] = [
        (QatFormat::Fp8Ue8m0B32, pack_fp8_row, unpack_fp8_row, 512, 528),
        (QatFormat::Fp4E4m3B16, pack_fp4_row, unpack_fp4_row, 512, 288),
        (QatFormat::Fp4Ue8m0B32, pack_index_fp4_row, unpack_index_fp4_row, 128, 68),
    ];
    for (fmt, pack, unpack, width, bytes) in cases {
        for w in [width, 64, 96] {
            for seed in 0..8 {
                let x = row(w, seed);
                let (data, scales) = pack(&x)?;
                if w == width {
                    assert_eq!(data.len() + scales.len(), bytes, "{fmt}: bytes per row");
                }
                assert_eq!(scales.len(), w / fmt.block());
                let mut want = x.clone();
                fake_quant_slice(fmt, &mut want)?;
                assert_eq!(bits(&unpack(&data, &scales)?), bits(&want), "{fmt} width {w} seed {seed}");
            }
        }
    }
    Ok(())
}

#[test]
fn fp4_nibble_order_even_low() -> anyhow::Result<()> {
    let mut x = vec![0f32; 32];
    x[0] = 6.0; // code 7, low nibble of byte 0
    x[1] = -1.0; // code 0xa, high nibble
    x[3] = 0.5; // code 1, high nibble of byte 1
    let (data, scales) = pack_index_fp4_row(&x)?;
    assert_eq!(&data[..2], &[0xa7, 0x10]);
    assert_eq!(scales, [127]);
    Ok(())
}

#[test]
fn errors_on_bad_widths() {
    assert!(pack_fp8_row(&[0.0; 48]).is_err());
    assert!(pack_fp4_row(&[0.0; 24]).is_err());
    assert!(unpack_fp8_row(&[0; 64], &[127]).is_err());
    assert!(unpack_fp4_row(&[0; 8], &[0x38, 0x38]).is_err());
    assert!(unpack_index_fp4_row(&[0; 24], &[127]).is_err());
    assert!(unpack_index_fp4_row(&[0; 16], &[127]).is_ok());
}

/// Dense FP8 weights: `W[r, c] = e4m3(b[r, c]) · 2^(S[r/32, c/32] - 127)` (spec §2.4).
fn dequant_fp8(weight: &[Vec<u8>], scale: &[Vec<u8>]) -> Vec<Vec<f32>> {
    weight
        .iter()
        .enumerate()
        .map(|(r, w)| w.iter().enumerate().map(|(c, &b)| e4m3_to_f32(b) * e8m0_to_f32(scale[r / 32][c / 32])).collect())
        .collect()
}

/// Golden weights are compared by value: the reference obtains them through a GEMM with an
/// identity activation, which turns the -0.0 of e2m1 code 8 into +0.0.
fn assert_values_eq(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "{what}: row {r}");
    }
}

#[test]
fn golden_dq_fp8() -> anyhow::Result<()> {
    let g = modules()?;
    for pre in ["dq.fp8.crafted", "dq.fp8.layers.0.attn.wq_a"] {
        let w = u8_rows(&g, &format!("{pre}.weight_e4m3"))?;
        let s = u8_rows(&g, &format!("{pre}.scale_e8m0"))?;
        let want = f32_rows(&g, &format!("{pre}.out"))?;
        assert_values_eq(&dequant_fp8(&w, &s), &want, pre);
    }
    Ok(())
}

#[test]
fn golden_dq_mxfp4() -> anyhow::Result<()> {
    let g = modules()?;
    for pre in ["dq.mxfp4.crafted", "dq.mxfp4.layers.0.ffn.experts.0.w1"] {
        let w = u8_rows(&g, &format!("{pre}.weight_packed"))?;
        let s = u8_rows(&g, &format!("{pre}.scale_e8m0"))?;
        let want = f32_rows(&g, &format!("{pre}.out"))?;
        let got =
            w.iter().zip(&s).map(|(d, sc)| unpack_index_fp4_row(d, sc)).collect::<candle_core::Result<Vec<_>>>()?;
        assert_values_eq(&got, &want, pre);
    }
    Ok(())
}
