//! Deterministic, untrained tensor contents in the release storage formats (spec §2.4), with the
//! magnitudes of trained weights, generated in chunks so that a writer never holds a whole tensor
//! (include it with `#[path = "support/synthetic_values.rs"] mod synthetic_values;`).
//!
//! * Values are draws from N(0, `STD`) (norm weights: 1). A draw is a uniform index into a table
//!   of normal quantiles `Φ⁻¹((i + ½) / n)` already rounded to the stored type or code (2¹⁶ for
//!   bf16 / f32, 2²⁰ for the codes): four values per generator step, no per-value arithmetic.
//! * FP8 e4m3 codes: the quantiles scaled so that the extreme ones round to ±448, so every
//!   non-NaN code occurs (subnormals and both zeros included; 0x7f / 0xff never).
//! * MXFP4 (e2m1) codes: the extremes round to ±6; two codes per byte, the even input in the low
//!   nibble.
//! * e8m0 block scales: `2^k` with `k` one of two neighbouring exponents per block, mixed so that
//!   the dequantized weights have standard deviation `STD` (FP8: bytes 114 / 115, MXFP4: 121 /
//!   122; the release's test vectors have 115 and 120, spec §2.4).
//! * BF16 / F32 plain tensors: the quantiles times `STD`.
//!
//! Each tensor's stream is seeded from its name ([`seed_of`]): the same name gives the same bytes
//! whatever else the checkpoint holds.
#![allow(dead_code)]

use std::sync::OnceLock;

/// Standard deviation of every generated weight (norm weights excepted).
pub const STD: f64 = 0.02;

/// What one stored tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// e4m3 codes (FP8 weights with 32×32 block scales, FP8 Engram rows).
    Fp8Codes,
    /// Packed e2m1 pairs (MXFP4 routed experts).
    Mxfp4Codes,
    /// e8m0 scales of FP8 codes.
    Fp8Scales,
    /// e8m0 scales of MXFP4 codes.
    Mxfp4Scales,
    /// Little-endian bf16 draws of N(0, STD).
    Bf16Normal,
    /// Little-endian f32 draws of N(0, STD).
    F32Normal,
    /// Little-endian bf16 ones (norm weights).
    Bf16Ones,
    /// Little-endian f32 ones (norm weights stored as f32).
    F32Ones,
}

/// FNV-1a of `name`: the seed of that tensor's stream.
pub fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// SplitMix64 (Steele, Lea, Flood 2014): a fast, well-mixed 64-bit stream.
pub struct Rng(u64);

impl Rng {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform draw in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Φ⁻¹(p) for 0 < p < 1 (Acklam's rational approximation, relative error < 1.2e-9).
fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] =
        [-3.969683028665376e1, 2.209460984245205e2, -2.759285104469687e2, 1.38357751867269e2, -3.066479806614716e1, 2.506628277459239];
    const B: [f64; 5] = [-5.447609879822406e1, 1.615858368580409e2, -1.556989798598866e2, 6.680131188771972e1, -1.328068155288572e1];
    const C: [f64; 6] =
        [-7.784894002430293e-3, -3.223964580411365e-1, -2.400758277161838, -2.549732539343734, 4.374664141464968, 2.938163982698783];
    const D: [f64; 4] = [7.784695709041462e-3, 3.224671290700398e-1, 2.445134137142996, 3.754408661907416];
    let tail = |q: f64| (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5]) / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0);
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// Quantiles of the plain (bf16 / f32) tables and the coarse level of the code tables: one
/// 16-bit draw each, four draws per 64-bit generator step, tables that stay in cache.
const COARSE: usize = 1 << 16;
/// Fine quantiles per coarse one: the code tables resolve 2²⁰ quantiles, enough for the smallest
/// FP8 subnormals near zero (a coarse step there is about two subnormal steps).
const FINE: usize = 16;

/// The `n` normal quantiles `Φ⁻¹((i + ½) / n)`, ascending.
fn quantiles(n: usize) -> Vec<f64> {
    (0..n).map(|i| normal_quantile((i as f64 + 0.5) / n as f64)).collect()
}

/// The value of e4m3 code `c` (NaN for 0x7f / 0xff).
pub fn e4m3_value(c: u8) -> f64 {
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((c >> 3) & 0xf, c & 7);
    if e == 0xf && m == 7 {
        return f64::NAN;
    }
    sign * if e == 0 { m as f64 / 8.0 * 2f64.powi(-6) } else { (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7) }
}

/// The value of e2m1 code `c` (low nibble).
pub fn e2m1_value(c: u8) -> f64 {
    const MAG: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = MAG[(c & 7) as usize];
    if c & 8 != 0 {
        -m
    } else {
        m
    }
}

/// A code table: the 2²⁰ quantiles times `max_code / max quantile`, rounded to the nearest
/// code (the sign bit from the value's sign, so both zeros occur), looked up in two levels: a
/// 16-bit draw picks a coarse entry, which holds the code when its 16 fine quantiles all round
/// to one code, else [`SPLIT`] and 4 more random bits pick the fine entry. Both levels together
/// draw exactly from the 2²⁰ fine quantiles; the fine table is read for a few hundred of the
/// 65536 coarse entries only.
struct Codes {
    coarse: Vec<u8>,
    fine: Vec<u8>,
    /// RMS value of the codes drawn.
    rms: f64,
}

/// A coarse entry whose fine quantiles round to different codes (0xff is no e2m1 nibble and
/// the e4m3 NaN, which is never drawn).
const SPLIT: u8 = 0xff;

impl Codes {
    /// `positive`: the non-negative codes in ascending value order; `sign`: the sign bit.
    fn new(max_code: f64, positive: &[u8], sign: u8, value: fn(u8) -> f64) -> Self {
        let q = quantiles(COARSE * FINE);
        let scale = max_code / q[q.len() - 1];
        let values: Vec<f64> = positive.iter().map(|&c| value(c)).collect();
        let nearest = |x: f64| {
            let i = values.partition_point(|&v| v < x);
            match (i.checked_sub(1), values.get(i)) {
                (Some(lo), Some(&hi)) if x - values[lo] <= hi - x => positive[lo],
                (_, Some(_)) => positive[i],
                (Some(lo), None) => positive[lo],
                (None, None) => 0,
            }
        };
        let fine: Vec<u8> = q
            .iter()
            .map(|&x| {
                let c = nearest((x * scale).abs());
                if x < 0.0 {
                    c | sign
                } else {
                    c
                }
            })
            .collect();
        let coarse = fine.chunks(FINE).map(|c| if c.iter().all(|&x| x == c[0]) { c[0] } else { SPLIT }).collect();
        let rms = (fine.iter().map(|&c| value(c).powi(2)).sum::<f64>() / fine.len() as f64).sqrt();
        Self { coarse, fine, rms }
    }

    /// The code of coarse draw `i`, using `rng` for the fine level when needed.
    fn code(&self, i: usize, rng: &mut Rng) -> u8 {
        match self.coarse[i] {
            SPLIT => self.fine[i * FINE + (rng.next_u64() % FINE as u64) as usize],
            c => c,
        }
    }
}

fn fp8_codes() -> &'static Codes {
    static T: OnceLock<Codes> = OnceLock::new();
    // e4m3 codes 0x00..=0x7e ascend in value.
    T.get_or_init(|| Codes::new(448.0, &(0..0x7fu8).collect::<Vec<_>>(), 0x80, e4m3_value))
}

fn fp4_codes() -> &'static Codes {
    static T: OnceLock<Codes> = OnceLock::new();
    T.get_or_init(|| Codes::new(6.0, &(0..8u8).collect::<Vec<_>>(), 8, e2m1_value))
}

fn bf16_table() -> &'static [[u8; 2]] {
    static T: OnceLock<Vec<[u8; 2]>> = OnceLock::new();
    T.get_or_init(|| quantiles(COARSE).iter().map(|&x| half::bf16::from_f64(x * STD).to_le_bytes()).collect())
}

fn f32_table() -> &'static [[u8; 4]] {
    static T: OnceLock<Vec<[u8; 4]>> = OnceLock::new();
    T.get_or_init(|| quantiles(COARSE).iter().map(|&x| ((x * STD) as f32).to_le_bytes()).collect())
}

/// The two neighbouring e8m0 bytes and the probability of the lower one for which codes of RMS
/// `rms` times the block scale have standard deviation [`STD`].
fn scale_mix(rms: f64) -> (u8, u8, f64) {
    let target = (STD / rms).powi(2);
    let a = (STD / rms).log2().floor() as i32;
    let (lo, hi) = (4f64.powi(a), 4f64.powi(a + 1));
    let p = (hi - target) / (hi - lo);
    ((127 + a) as u8, (127 + a + 1) as u8, p)
}

/// The generator of one tensor's bytes: call [`Stream::fill`] on consecutive chunks.
pub struct Stream {
    content: Content,
    rng: Rng,
    /// Bytes of the last step not yet handed out.
    pending: Vec<u8>,
    mix: (u8, u8, f64),
}

impl Stream {
    /// The stream of `content` for the tensor named `name`.
    pub fn new(content: Content, name: &str) -> Self {
        let mix = match content {
            Content::Fp8Scales => scale_mix(fp8_codes().rms),
            Content::Mxfp4Scales => scale_mix(fp4_codes().rms),
            _ => (0, 0, 0.0),
        };
        Self { content, rng: Rng::new(seed_of(name)), pending: Vec::new(), mix }
    }

    /// Four 16-bit draws from one generator step.
    fn draws(&mut self) -> [usize; 4] {
        let r = self.rng.next_u64();
        [0, 16, 32, 48].map(|k| ((r >> k) & 0xffff) as usize)
    }

    /// Writes the next step's bytes (four values, [`Stream::step_len`] bytes) into `out`.
    fn step(&mut self, out: &mut [u8]) {
        match self.content {
            Content::Fp8Codes => {
                let t = fp8_codes();
                for (o, i) in out.iter_mut().zip(self.draws()) {
                    *o = t.code(i, &mut self.rng);
                }
            }
            Content::Mxfp4Codes => {
                let t = fp4_codes();
                let [a, b, c, d] = self.draws().map(|i| t.code(i, &mut self.rng));
                out[0] = a | (b << 4);
                out[1] = c | (d << 4);
            }
            Content::Fp8Scales | Content::Mxfp4Scales => {
                let (lo, hi, p) = self.mix;
                for (o, i) in out.iter_mut().zip(self.draws()) {
                    *o = if (i as f64 + 0.5) / COARSE as f64 <= p { lo } else { hi };
                }
            }
            Content::Bf16Normal => {
                let t = bf16_table();
                for (o, i) in out.chunks_exact_mut(2).zip(self.draws()) {
                    o.copy_from_slice(&t[i]);
                }
            }
            Content::F32Normal => {
                let t = f32_table();
                for (o, i) in out.chunks_exact_mut(4).zip(self.draws()) {
                    o.copy_from_slice(&t[i]);
                }
            }
            Content::Bf16Ones => out.chunks_exact_mut(2).for_each(|o| o.copy_from_slice(&half::bf16::ONE.to_le_bytes())),
            Content::F32Ones => out.chunks_exact_mut(4).for_each(|o| o.copy_from_slice(&1f32.to_le_bytes())),
        }
    }

    /// Bytes produced per step: four values.
    fn step_len(&self) -> usize {
        match self.content {
            Content::Fp8Codes | Content::Fp8Scales | Content::Mxfp4Scales => 4,
            Content::Mxfp4Codes => 2,
            Content::Bf16Normal | Content::Bf16Ones => 8,
            Content::F32Normal | Content::F32Ones => 16,
        }
    }

    /// Fills `buf` with the next bytes of the stream.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let from_pending = self.pending.len().min(buf.len());
        buf[..from_pending].copy_from_slice(&self.pending[..from_pending]);
        self.pending.drain(..from_pending);
        let len = self.step_len();
        let mut i = from_pending;
        while buf.len() - i >= len {
            self.step(&mut buf[i..i + len]);
            i += len;
        }
        if i < buf.len() {
            let mut out = [0u8; 16];
            self.step(&mut out[..len]);
            let n = buf.len() - i;
            buf[i..].copy_from_slice(&out[..n]);
            self.pending.extend_from_slice(&out[n..len]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(content: Content, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        let mut s = Stream::new(content, "layers.0.attn.wq_a.weight");
        // Odd chunk sizes: the pending bytes must carry over exactly.
        let mut at = 0;
        for chunk in [3usize, 7, 1, 13].iter().cycle() {
            if at >= n {
                break;
            }
            let end = (at + chunk).min(n);
            s.fill(&mut v[at..end]);
            at = end;
        }
        v
    }

    #[test]
    fn chunking_does_not_change_the_stream() {
        for c in [Content::Fp8Codes, Content::Mxfp4Codes, Content::Bf16Normal, Content::F32Normal] {
            let mut whole = vec![0u8; 4000];
            Stream::new(c, "layers.0.attn.wq_a.weight").fill(&mut whole);
            assert_eq!(all(c, 4000), whole, "{c:?}");
        }
    }

    #[test]
    fn fp8_codes_cover_every_non_nan_code_and_dequantize_to_std() {
        let codes = all(Content::Fp8Codes, 1 << 22);
        let mut seen = [false; 256];
        codes.iter().for_each(|&c| seen[c as usize] = true);
        let missing: Vec<usize> = (0..256).filter(|&c| !seen[c] && c != 0x7f && c != 0xff).collect();
        assert!(missing.is_empty(), "codes never drawn: {missing:x?}");
        assert!(!seen[0x7f] && !seen[0xff]);
        let scales = all(Content::Fp8Scales, 1 << 16);
        assert!(scales.iter().all(|&s| s == 114 || s == 115));
        let var: f64 = codes
            .iter()
            .zip(scales.iter().cycle())
            .map(|(&c, &s)| (e4m3_value(c) * 2f64.powi(s as i32 - 127)).powi(2))
            .sum::<f64>()
            / codes.len() as f64;
        assert!((var.sqrt() / STD - 1.0).abs() < 0.02, "std {}", var.sqrt());
    }

    #[test]
    fn mxfp4_values_have_the_target_std() {
        let codes = all(Content::Mxfp4Codes, 1 << 20);
        let scales = all(Content::Mxfp4Scales, 1 << 16);
        let (lo, hi, _) = scale_mix(fp4_codes().rms);
        assert!((118..=123).contains(&lo) && hi == lo + 1, "{lo} {hi}");
        assert!(scales.iter().all(|&s| s == lo || s == hi), "{:?}", &scales[..8]);
        eprintln!("MXFP4 scale bytes {lo} / {hi}, FP8 {:?}", scale_mix(fp8_codes().rms));
        let var: f64 = codes
            .iter()
            .zip(scales.iter().cycle())
            .flat_map(|(&b, &s)| [b & 15, b >> 4].map(|c| (e2m1_value(c) * 2f64.powi(s as i32 - 127)).powi(2)))
            .sum::<f64>()
            / (2 * codes.len()) as f64;
        assert!((var.sqrt() / STD - 1.0).abs() < 0.03, "std {}", var.sqrt());
    }
}
