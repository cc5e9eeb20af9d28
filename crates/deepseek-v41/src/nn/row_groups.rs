//! Products over the rows of several sequences that give every sequence the bits of its own
//! product, so that a batched forward (the rows of several sequences concatenated,
//! `Model::forward_batch`) equals one-at-a-time forwards bit for bit on the CPU
//! (`docs/architecture.md`, "Several sequences in one forward").
//!
//! Candle's CPU matmul calls the `gemm` crate, which picks its kernel by shape (`gemm-common`
//! 0.19, `gemm.rs` `gemm_basic_generic` and `cache.rs` `kernel_params`; `gemm` transposes a
//! row-major product first, so its `m` is our output width `n` and its `n` our row count `m`):
//!
//! * `m·n <= 256`: "horizontal" dot-product kernels; `m == 1`: a matrix-vector kernel (when not
//!   horizontal); `k <= 2` and `n == 1`: vector kernels. Each sums in its own order.
//! * else `m <= 64 && n <= 64`: the blocked kernel with depth blocks of `min(k, 512)`;
//! * else the blocked kernel with depth blocks chosen from `k` and the cache sizes only.
//!
//! Inside one blocked kernel choice a row's result does not depend on the other rows
//! (`tests` below). A product of `m` rows gives the rows of one sequence the bits that sequence
//! gets alone only if its own row count takes the same kernel: [`grouped_matmul`] therefore runs
//! the rows of sequences whose own products are blocked-general in one product (padded with zero
//! rows to stay general), those whose own products are blocked-small in products of at most 64
//! rows, and every other sequence (one decode row, tiny products) in a product of exactly its own
//! row count. A single sequence's product is the plain matmul, unchanged.
//!
//! The padding moves nothing of a single sequence: an earlier design padded every CPU product to
//! the general kernel, which moved the mHC mixes (`k = hc·D > 512`, `n = (2+hc)·hc = 24`) of
//! prompts of at most 64 tokens from depth blocks of 512 to another blocking; that 1e-7 change of
//! the mixes grows through the FP8 activation quantization to an end-to-end drift beyond the
//! golden tolerance (`docs/numerics.md`).

use candle_core::{Result, Tensor};

/// One sequence's rows of a grouped product: `len` consecutive rows, and the number of rows the
/// same product has when the sequence runs alone (`alone >= len`; more when only some of its
/// rows are computed here, e.g. the head over the rows whose logits are asked for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowGroup {
    /// Rows of the product that belong to the sequence (consecutive, in group order).
    pub len: usize,
    /// Rows of the sequence's own product.
    pub alone: usize,
}

/// How the rows of a product split into sequences ([`RowGroup`]s, consecutive, in row order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowGroups {
    groups: Vec<RowGroup>,
}

impl RowGroups {
    /// One sequence of `rows` rows: the plain product.
    pub fn whole(rows: usize) -> Self {
        Self { groups: vec![RowGroup { len: rows, alone: rows }] }
    }

    /// Groups of `lens[i]` rows each, every one its sequence's whole product.
    pub fn from_lens(lens: impl IntoIterator<Item = usize>) -> Self {
        Self { groups: lens.into_iter().map(|len| RowGroup { len, alone: len }).collect() }
    }

    /// These groups. Errors when a group has more rows than its sequence's own product.
    pub fn new(groups: Vec<RowGroup>) -> Result<Self> {
        if let Some((i, g)) = groups.iter().enumerate().find(|(_, g)| g.len > g.alone) {
            candle_core::bail!("RowGroups: group {i} has {} rows, more than the {} of its sequence's own product", g.len, g.alone)
        }
        Ok(Self { groups })
    }

    /// The groups in row order.
    pub fn groups(&self) -> &[RowGroup] {
        &self.groups
    }

    /// The number of rows (the sum of the groups' lengths).
    pub fn rows(&self) -> usize {
        self.groups.iter().map(|g| g.len).sum()
    }

    /// Whether the product is one sequence's own (one group, or none): then it is the plain
    /// product.
    pub fn is_whole(&self) -> bool {
        match self.groups.as_slice() {
            [] => true,
            [g] => g.len == g.alone,
            _ => false,
        }
    }
}

/// The kernel family `gemm` takes for a row-major product of `m` rows, output width `n` and depth
/// `k` (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    /// Shape-specific kernels: computed at exactly the sequence's own row count.
    Exact,
    /// Blocked, depth blocks `min(k, 512)`: `m <= 64` rows per product.
    Small,
    /// Blocked, depth blocks from `k` only: any number of rows above [`general_min_rows`].
    General,
}

fn family(m: usize, n: usize, k: usize) -> Family {
    if m <= 1 || n <= 1 || k <= 2 || m * n <= 256 {
        Family::Exact
    } else if m <= 64 && n <= 64 {
        Family::Small
    } else {
        Family::General
    }
}

/// The fewest rows of a [`Family::General`] product of width `n`.
fn general_min_rows(n: usize) -> usize {
    let rows = 2.max(256 / n.max(1) + 1);
    if n <= 64 {
        rows.max(65)
    } else {
        rows
    }
}

/// `x · rhs` of `x` `[m, k]` and `rhs` `[k, n]` (as `Tensor::matmul`), where on the CPU each
/// group's rows get the bits of the group's own product (`alone` rows of the same operands,
/// module documentation). `groups` must cover the `m` rows. The plain matmul for one whole
/// group and off the CPU (there kernels may also choose by shape; batched and one-at-a-time
/// products then agree up to the f32 summation order).
pub fn grouped_matmul(x: &Tensor, rhs: &Tensor, groups: &RowGroups) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    if groups.rows() != m {
        candle_core::bail!("grouped_matmul: the row groups cover {} rows, the input has {m}", groups.rows())
    }
    if !x.device().is_cpu() || groups.is_whole() {
        return x.matmul(rhs);
    }
    let n = rhs.dim(1)?;
    let x = x.contiguous()?;
    // Products as (first row, rows) spans of `x` and the rows the product must have.
    let mut products: Vec<(Vec<(usize, usize)>, usize)> = Vec::new();
    let mut general: Vec<(usize, usize)> = Vec::new();
    let mut small: Vec<(usize, usize)> = Vec::new();
    let mut small_rows = 0;
    let mut at = 0;
    for g in groups.groups().iter().filter(|g| g.len > 0) {
        match family(g.alone, n, k) {
            Family::Exact => products.push((vec![(at, g.len)], g.alone)),
            Family::General => general.push((at, g.len)),
            Family::Small => {
                if small_rows + g.len > 64 {
                    products.push((std::mem::take(&mut small), 0));
                    small_rows = 0;
                }
                small.push((at, g.len));
                small_rows += g.len;
            }
        }
        at += g.len;
    }
    if !small.is_empty() {
        products.push((small, 0));
    }
    if !general.is_empty() {
        products.push((general, general_min_rows(n)));
    }
    let min_small = 2.max(256 / n.max(1) + 1);
    let mut outs = Vec::with_capacity(products.len());
    let mut order = Vec::with_capacity(m);
    for (spans, want) in &products {
        let parts = spans.iter().map(|&(s, len)| x.narrow(0, s, len)).collect::<Result<Vec<_>>>()?;
        let rows: usize = spans.iter().map(|s| s.1).sum();
        // Exact: the group's own row count; small: at least `min_small` (<= 64 as the family
        // needs m·n > 256 with m <= 64); general: at least `general_min_rows`.
        let target = if *want == 0 { rows.max(min_small) } else { rows.max(*want) };
        let lhs = if target > rows {
            let pad = Tensor::zeros((target - rows, k), x.dtype(), x.device())?;
            Tensor::cat(&[parts.as_slice(), &[pad]].concat(), 0)?
        } else {
            Tensor::cat(&parts, 0)?
        };
        outs.push(lhs.matmul(rhs)?.narrow(0, 0, rows)?);
        order.extend(spans.iter().flat_map(|&(s, len)| s..s + len));
    }
    let y = Tensor::cat(&outs, 0)?;
    if order.iter().enumerate().all(|(i, &r)| i == r) {
        return Ok(y);
    }
    // Row r of the result is row inverse[r] of the concatenation.
    let mut inverse = vec![0u32; m];
    for (i, &r) in order.iter().enumerate() {
        inverse[r] = i as u32;
    }
    y.index_select(&Tensor::new(inverse, x.device())?, 0)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;

    /// Random bf16-exact f32 values (the model's activations are bf16 widened to f32).
    fn rows(m: usize, k: usize, seed: u64) -> Result<Tensor> {
        let dev = Device::Cpu;
        let mut s = seed | 1;
        let v: Vec<f32> = (0..m * k)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, (m, k), &dev)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)
    }

    /// Every group of a grouped product equals its own plain product bit for bit, for shapes on
    /// each side of the kernel thresholds (one row, `m·n <= 256`, `m <= 64` with `k > 512`, many
    /// rows) and mixes of group sizes; the plain product of all rows does not.
    #[test]
    fn groups_get_the_bits_of_their_own_products() -> Result<()> {
        let mut plain_differs = false;
        for (i, &(k, n)) in [(1024usize, 24usize), (768, 24), (192, 8), (256, 64), (256, 2), (96, 192), (600, 300), (64, 512)].iter().enumerate() {
            let w = rows(n, k, 7 + i as u64)?;
            let layouts: [&[usize]; 6] = [&[1, 1, 1, 1], &[40, 23, 1, 17], &[73, 5, 1, 64, 65], &[3, 120, 2, 7, 11], &[64, 64, 64], &[1, 46, 31, 10, 1, 4]];
            for (j, lens) in layouts.iter().enumerate() {
                let m: usize = lens.iter().sum();
                let x = rows(m, k, 100 * i as u64 + j as u64)?;
                let got = grouped_matmul(&x, &w.t()?, &RowGroups::from_lens(lens.iter().copied()))?.to_vec2::<f32>()?;
                let all = x.matmul(&w.t()?)?.to_vec2::<f32>()?;
                let mut at = 0;
                for &len in lens.iter() {
                    let own = x.narrow(0, at, len)?.matmul(&w.t()?)?.to_vec2::<f32>()?;
                    assert_eq!(&got[at..at + len], own.as_slice(), "k {k} n {n}, layout {lens:?}: group at row {at}");
                    plain_differs |= own.as_slice() != &all[at..at + len];
                    at += len;
                }
            }
        }
        assert!(plain_differs, "the plain product was row-independent here: the grouping is not needed on this build");
        Ok(())
    }

    /// A group holding only some rows of its sequence's own product (`alone > len`) gets those
    /// rows' bits of the whole product.
    #[test]
    fn partial_groups_get_the_bits_of_the_whole_product() -> Result<()> {
        for &(k, n) in &[(1024usize, 24usize), (192, 512), (768, 24)] {
            let w = rows(n, k, 3)?;
            // Sequences of 40, 1, 73 and 9 rows; the product holds the last row of each, and rows
            // 3..5 of the first.
            let x: Vec<Tensor> = [40usize, 1, 73, 9].iter().enumerate().map(|(i, &m)| rows(m, k, 50 + i as u64)).collect::<Result<_>>()?;
            let pick = [(0usize, 3usize, 2usize), (0, 39, 1), (1, 0, 1), (2, 72, 1), (3, 8, 1)];
            let parts = pick.iter().map(|&(s, r, len)| x[s].narrow(0, r, len)).collect::<Result<Vec<_>>>()?;
            let groups = RowGroups::new(pick.iter().map(|&(s, _, len)| RowGroup { len, alone: x[s].dim(0).unwrap() }).collect())?;
            let got = grouped_matmul(&Tensor::cat(&parts, 0)?, &w.t()?, &groups)?.to_vec2::<f32>()?;
            let mut at = 0;
            for &(s, r, len) in &pick {
                let own = x[s].matmul(&w.t()?)?.narrow(0, r, len)?.to_vec2::<f32>()?;
                assert_eq!(&got[at..at + len], own.as_slice(), "k {k} n {n}: sequence {s} rows {r}..");
                at += len;
            }
        }
        Ok(())
    }

    #[test]
    fn bad_groups_are_errors() -> Result<()> {
        let x = rows(5, 8, 1)?;
        let e = grouped_matmul(&x, &x.t()?, &RowGroups::from_lens([2, 2])).unwrap_err().to_string();
        assert!(e.contains("cover 4 rows") && e.contains("has 5"), "{e}");
        let e = RowGroups::new(vec![RowGroup { len: 3, alone: 2 }]).unwrap_err().to_string();
        assert!(e.contains("3 rows") && e.contains("2 of its"), "{e}");
        Ok(())
    }
}
