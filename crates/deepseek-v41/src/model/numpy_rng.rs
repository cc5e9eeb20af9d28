//! The slice of numpy's random generator that the Engram hash multipliers are drawn from
//! (spec §9.3): `numpy.random.default_rng(seed).integers(0, bound, size=n)` with the default
//! `int64` dtype.
//!
//! `default_rng(seed)` is a PCG64 bit generator (128-bit LCG, XSL-RR 128/64 output) whose 128-bit
//! state and increment come from a `SeedSequence(seed)` (a 4-word uint32 entropy pool, hashed and
//! mixed, then expanded into 4 uint64 words). `integers` on a range wider than 32 bits draws one
//! 64-bit output per value and maps it with Lemire's multiply-and-reject method.
//!
//! Written from the algorithm descriptions; verified against the multipliers numpy produced for
//! the released V4.1 config and for the tiny golden config (tests below and in
//! `tests/model_parts.rs`).

const POOL_SIZE: usize = 4;
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;

/// The PCG 128-bit LCG multiplier.
const PCG_MULT: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;

/// A hash step of the seed sequence; `hash_const` evolves across calls.
fn hashmix(value: u32, hash_const: &mut u32) -> u32 {
    let mut v = value ^ *hash_const;
    *hash_const = hash_const.wrapping_mul(MULT_A);
    v = v.wrapping_mul(*hash_const);
    v ^ (v >> XSHIFT)
}

fn mix(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L
        .wrapping_mul(x)
        .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> XSHIFT)
}

/// numpy's `SeedSequence(entropy)` with no spawn key: the mixed 4-word pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeedSequence {
    pool: [u32; POOL_SIZE],
}

impl SeedSequence {
    /// Seeds from a non-negative integer (numpy splits it into little-endian 32-bit words; 0 is
    /// one zero word).
    pub fn new(entropy: u64) -> Self {
        let mut words = vec![entropy as u32];
        if entropy >> 32 != 0 {
            words.push((entropy >> 32) as u32);
        }
        let mut pool = [0u32; POOL_SIZE];
        let mut hash_const = INIT_A;
        for (i, slot) in pool.iter_mut().enumerate() {
            *slot = hashmix(words.get(i).copied().unwrap_or(0), &mut hash_const);
        }
        for i_src in 0..POOL_SIZE {
            for i_dst in 0..POOL_SIZE {
                if i_src != i_dst {
                    let h = hashmix(pool[i_src], &mut hash_const);
                    pool[i_dst] = mix(pool[i_dst], h);
                }
            }
        }
        for &w in words.iter().skip(POOL_SIZE) {
            for slot in pool.iter_mut() {
                let h = hashmix(w, &mut hash_const);
                *slot = mix(*slot, h);
            }
        }
        Self { pool }
    }

    /// `generate_state(n, uint64)`: `2n` uint32 words cycling over the pool, paired little-endian.
    pub fn generate_state_u64(&self, n: usize) -> Vec<u64> {
        let mut hash_const = INIT_B;
        let words: Vec<u32> = (0..2 * n)
            .map(|i| {
                let mut v = self.pool[i % POOL_SIZE] ^ hash_const;
                hash_const = hash_const.wrapping_mul(MULT_B);
                v = v.wrapping_mul(hash_const);
                v ^ (v >> XSHIFT)
            })
            .collect();
        words
            .chunks(2)
            .map(|p| p[0] as u64 | (p[1] as u64) << 32)
            .collect()
    }
}

/// numpy's PCG64 bit generator (XSL-RR 128/64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pcg64 {
    state: u128,
    inc: u128,
}

impl Pcg64 {
    /// `PCG64(seed)`: state and increment from `SeedSequence(seed).generate_state(4, uint64)`,
    /// high word first.
    pub fn from_seed(seed: u64) -> Self {
        let v = SeedSequence::new(seed).generate_state_u64(4);
        let init_state = (v[0] as u128) << 64 | v[1] as u128;
        let init_seq = (v[2] as u128) << 64 | v[3] as u128;
        let mut rng = Self {
            state: 0,
            inc: init_seq << 1 | 1,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(init_state);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    /// Next 64-bit output: advance, then XSL-RR of the new state.
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let xored = (self.state >> 64) as u64 ^ self.state as u64;
        xored.rotate_right((self.state >> 122) as u32)
    }

    /// A value in `[0, rng]` (inclusive) by Lemire's method, for `rng >= 2^32` as numpy uses it
    /// for 64-bit ranges. `rng` must not be `u64::MAX`.
    fn bounded_lemire(&mut self, rng: u64) -> u64 {
        let excl = rng + 1;
        let mut m = self.next_u64() as u128 * excl as u128;
        let mut leftover = m as u64;
        if leftover < excl {
            let threshold = (u64::MAX - rng) % excl;
            while leftover < threshold {
                m = self.next_u64() as u128 * excl as u128;
                leftover = m as u64;
            }
        }
        (m >> 64) as u64
    }
}

/// `numpy.random.default_rng(seed).integers(0, high, size=n)` (int64, `endpoint=False`).
///
/// Only ranges with `high - 1 > u32::MAX` are supported (numpy draws those from 64-bit outputs;
/// smaller ranges use buffered 32-bit draws, which the Engram multipliers never need).
pub fn default_rng_integers(seed: u64, high: i64, n: usize) -> candle_core::Result<Vec<i64>> {
    let rng = high - 1;
    if rng <= u32::MAX as i64 {
        candle_core::bail!(
            "default_rng_integers: high {high} needs numpy's 32-bit path, not implemented"
        )
    }
    let mut g = Pcg64::from_seed(seed);
    Ok((0..n)
        .map(|_| g.bounded_lemire(rng as u64) as i64)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Engram multipliers `2v + 1` of layer `l` for a compressed vocab and `n` lookbacks.
    fn multipliers(compressed_vocab: i64, n: usize, l: u64) -> Vec<i64> {
        let bound = (i64::MAX / compressed_vocab) / 2;
        default_rng_integers(10007 * l, bound, n).unwrap().iter().map(|v| 2 * v + 1).collect()
    }

    /// The released V4.1 multipliers (spec §9.3) are `2v + 1` of these draws.
    #[test]
    fn released_multipliers() {
        let m = |l: u64| multipliers(99092, 4, l);
        assert_eq!(
            m(1),
            vec![
                76632096046245,
                4839876093313,
                35959672319349,
                73987337458391
            ]
        );
        assert_eq!(
            m(14),
            vec![
                67716810739261,
                51510806800915,
                30921347202721,
                82619226485591
            ]
        );
    }

    /// The tiny golden config (compressed vocab 256, 3 lookbacks, layers 1 and 5); values from
    /// `modules/golden.safetensors` `engram.multipliers`.
    #[test]
    fn tiny_multipliers() {
        let m = |l: u64| multipliers(256, 3, l);
        assert_eq!(
            m(1),
            vec![29662608052400909, 1873410163432121, 13919202536988139]
        );
        assert_eq!(
            m(5),
            vec![14090283695042227, 11980416300147269, 7883456125943357]
        );
    }

    /// Negative control: a different seed gives different draws.
    #[test]
    fn seed_matters() {
        let bound = (i64::MAX / 256) / 2;
        assert_ne!(
            default_rng_integers(10007, bound, 3).unwrap(),
            default_rng_integers(10008, bound, 3).unwrap()
        );
    }
}
