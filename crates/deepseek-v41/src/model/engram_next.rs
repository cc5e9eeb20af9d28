//! The inputs of a decode step that follows the last one on the device
//! ([`super::ModelDecodeStep::update_next`]): the tokens the last step sampled become the step's
//! tokens and their Engram row ids are hashed on the step's device, against each sequence's last
//! `max_ngram − 1` compressed ids kept there, so that no id travels to the host and back between
//! two steps (spec §9.4; the host hash is [`EngramHasher::hash`]).
//!
//! The step's id buffer (`[B + E·B·cols + B·(max_ngram − 1)]` u32) holds, in this order, the
//! tokens, each Engram layer's `[B, cols]` row ids (model layer order) and the history: per row
//! the compressed ids of its last `max_ngram − 1` tokens, oldest first, the pad id in place of
//! tokens before the sequence start (a lookback past the start reads the pad, and so does every
//! longer one: the pads stand exactly where the hash blocks). [`NextIds::apply`] writes, for the
//! first n rows: `tokens[r] = sampled[r]`, the row ids of `c = map[sampled[r]]` looking back at
//! the history, and the history shifted by one with `c` last. On CUDA one launch
//! (`kernels/engram_next.cu`); on the CPU [`next_ids_ref`], the reference the kernel is tested
//! against (`tests/cuda_engram_next.rs`), itself tested against [`EngramHasher::hash`] below.

use candle_core::{DType, Device, Result, Tensor};

use super::engram_hash::EngramHasher;

/// Where the parts of a step's id buffer lie and how the hash reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextIdsGeometry {
    /// Rows of the buffer (the step's batch B).
    pub batch: usize,
    /// Engram layers in the buffer.
    pub layers: usize,
    /// Row ids per token and layer: `(ngram − 1)·heads`.
    pub cols: usize,
    /// The largest n-gram order (1 without Engram: no history).
    pub ngram: usize,
    /// Hash heads per order.
    pub heads: usize,
}

impl NextIdsGeometry {
    /// Elements of the buffer.
    pub fn len(&self) -> usize {
        self.history_offset() + self.batch * (self.ngram - 1)
    }

    /// Whether the buffer is empty (never: it holds at least the tokens of one row).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the history starts.
    pub fn history_offset(&self) -> usize {
        self.batch + self.layers * self.batch * self.cols
    }

    /// Per layer the hash table row: multipliers `[ngram]`, primes `[cols]`, offsets `[cols]`.
    pub fn table_width(&self) -> usize {
        self.ngram + 2 * self.cols
    }
}

/// The device state of the hash: the token map and the layers' tables (see the module docs).
#[derive(Debug, Clone)]
pub struct NextIds {
    geometry: NextIdsGeometry,
    pad: u32,
    /// `[vocab]` u32 on the step's device and on the host (the CPU path reads the host copy).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    map: Tensor,
    map_host: Vec<u32>,
    /// `[layers, ngram + 2·cols]` i64 (all values below 2^63).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tables: Tensor,
    tables_host: Vec<i64>,
}

impl NextIds {
    /// The hash state of the Engram layers `layers` (backbone layer ids, in the buffer's order)
    /// on `device` for a batch of `batch` rows; `None` as the hasher for a model without Engram.
    /// Errors for a layer the hasher has no layout for, or a token map shorter than the model's
    /// `vocab` (a sampled id must have a compressed id).
    pub fn new(hasher: Option<&EngramHasher>, layers: &[usize], batch: usize, vocab: usize, device: &Device) -> Result<Self> {
        let (geometry, pad, map_host, tables_host) = match hasher {
            None => (NextIdsGeometry { batch, layers: 0, cols: 0, ngram: 1, heads: 0 }, 0, Vec::new(), Vec::new()),
            Some(h) => {
                let layout = h.layout();
                let map = h.token_map().ids();
                if map.len() < vocab {
                    candle_core::bail!("NextIds: the Engram token map covers {} ids, the model samples from {vocab}", map.len())
                }
                let g = NextIdsGeometry { batch, layers: layers.len(), cols: layout.n_cols(), ngram: layout.max_ngram(), heads: layout.n_heads() };
                let mut tables = Vec::with_capacity(g.layers * g.table_width());
                for &l in layers {
                    let Some(t) = layout.layer(l) else { candle_core::bail!("NextIds: layer {l} has no Engram hash layout") };
                    tables.extend(t.multipliers.iter().chain(&t.primes).chain(&t.offsets).map(|&v| v as i64));
                }
                (g, h.pad_compressed(), map.to_vec(), tables)
            }
        };
        let map = Tensor::from_slice(&map_host, map_host.len(), device)?;
        let tables = Tensor::from_slice(&tables_host, tables_host.len(), device)?;
        Ok(Self { geometry, pad, map, map_host, tables, tables_host })
    }

    /// The buffer geometry.
    pub fn geometry(&self) -> NextIdsGeometry {
        self.geometry
    }

    /// The compressed pad id (the history before a sequence's start).
    pub fn pad(&self) -> u32 {
        self.pad
    }

    /// Writes into `buf` (the step's id buffer, rank 1, [`NextIdsGeometry::len`] u32) the inputs
    /// of the first n = `sampled.len()` rows following their last step: tokens, Engram row ids
    /// and the shifted history (module docs). `sampled`: `[n]` u32 on `buf`'s device, each below
    /// the model's vocabulary. Enqueued on CUDA, reading nothing back.
    pub fn apply(&self, buf: &Tensor, sampled: &Tensor) -> Result<()> {
        let g = self.geometry;
        let n = sampled.dims1()?;
        if buf.dims() != [g.len()] || buf.dtype() != DType::U32 || !buf.is_contiguous() {
            candle_core::bail!("NextIds::apply: the id buffer must be [{}] u32 contiguous, got {:?} {:?}", g.len(), buf.dtype(), buf.shape())
        }
        if sampled.dtype() != DType::U32 || n == 0 || n > g.batch || !sampled.device().same_device(buf.device()) {
            candle_core::bail!("NextIds::apply: sampled must be [1..={}] u32 on the buffer's device, got {:?} {:?}", g.batch, sampled.dtype(), sampled.shape())
        }
        #[cfg(feature = "cuda")]
        if buf.device().is_cuda() {
            return crate::cuda::engram_next_device(buf, &sampled.contiguous()?, &self.map, &self.tables, g);
        }
        let mut host = buf.to_vec1::<u32>()?;
        next_ids_ref(&mut host, &sampled.to_vec1::<u32>()?, &self.map_host, &self.tables_host, g);
        buf.slice_set(&Tensor::from_vec(host, g.len(), buf.device())?, 0, 0)
    }
}

/// The CPU reference of [`NextIds::apply`] on the buffer's values `buf` (module docs): rows
/// `0 .. sampled.len()`; a sampled id past the map reads its last entry (the kernel does the same;
/// [`NextIds::new`] makes the map cover the vocabulary).
pub fn next_ids_ref(buf: &mut [u32], sampled: &[u32], map: &[u32], tables: &[i64], g: NextIdsGeometry) {
    let (g1, hist0) = (g.ngram - 1, g.history_offset());
    let mut lookback = vec![0u64; g.ngram];
    for (r, &t) in sampled.iter().enumerate() {
        buf[r] = t;
        if g.layers == 0 {
            continue;
        }
        let c = map[(t as usize).min(map.len() - 1)];
        let hist = hist0 + r * g1;
        lookback[0] = c as u64;
        for s in 1..g.ngram {
            lookback[s] = buf[hist + g1 - s] as u64;
        }
        for l in 0..g.layers {
            let tab = &tables[l * g.table_width()..(l + 1) * g.table_width()];
            let (m, primes, offsets) = (&tab[..g.ngram], &tab[g.ngram..g.ngram + g.cols], &tab[g.ngram + g.cols..]);
            let mut rolling = lookback[0].wrapping_mul(m[0] as u64);
            let out = g.batch + (l * g.batch + r) * g.cols;
            for s in 1..g.ngram {
                rolling ^= lookback[s].wrapping_mul(m[s] as u64);
                for k in 0..g.heads {
                    let col = (s - 1) * g.heads + k;
                    buf[out + col] = (rolling % primes[col] as u64 + offsets[col] as u64) as u32;
                }
            }
        }
        buf.copy_within(hist + 1..hist + g1, hist);
        buf[hist + g1 - 1] = c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::engram_hash::tests::real_cfg;
    use crate::model::engram_hash::TokenMap;

    /// The released Engram layout (layers 1 and 14, orders 2..=4, 8 heads) over a token map of
    /// 600 ids whose largest compressed id is the released 99091.
    fn hasher() -> EngramHasher {
        let cfg = real_cfg();
        let mut map: Vec<u32> = (0..600u32).map(|t| (t * 7919 + 13) % 99092).collect();
        map[599] = 99091;
        EngramHasher::new(&cfg, TokenMap::new(map).unwrap()).unwrap()
    }

    /// Step after step, the buffer's row ids equal the host hash of the same tokens, the history
    /// holds the last ids with the pads before the start, rows past n keep their values.
    #[test]
    fn follows_the_host_hash() -> Result<()> {
        let h = hasher();
        let (batch, n) = (4usize, 3usize);
        let next = NextIds::new(Some(&h), &[1, 14], batch, 600, &Device::Cpu)?;
        let g = next.geometry();
        assert_eq!((g.layers, g.cols, g.ngram), (2, 24, 4));
        // Start: the history of every row is all pads; row 3 holds sentinels.
        let mut buf = vec![0u32; g.len()];
        for v in &mut buf[g.history_offset()..] {
            *v = next.pad();
        }
        let sentinel = 0xdead_beef;
        buf[3] = sentinel;
        let mut histories: Vec<_> = (0..n).map(|_| h.new_history()).collect();
        let mut rng = 12345u64;
        for _step in 0..6 {
            let sampled: Vec<u32> = (0..n)
                .map(|_| {
                    rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((rng >> 33) % 600) as u32
                })
                .collect();
            next_ids_ref(&mut buf, &sampled, &next.map_host, &next.tables_host, g);
            for (r, hist) in histories.iter_mut().enumerate() {
                let want = h.hash(&[sampled[r]], hist)?;
                assert_eq!(buf[r], sampled[r]);
                for (l, layer) in [1usize, 14].iter().enumerate() {
                    let at = g.batch + (l * g.batch + r) * g.cols;
                    assert_eq!(&buf[at..at + g.cols], want.layer(*layer).unwrap(), "row {r} layer {layer}");
                }
                let recent = hist.recent();
                let row = &buf[g.history_offset() + r * 3..g.history_offset() + r * 3 + 3];
                assert_eq!(&row[3 - recent.len()..], recent);
                assert!(row[..3 - recent.len()].iter().all(|&v| v == next.pad()));
            }
            assert_eq!(buf[3], sentinel);
        }
        // Through the op on the CPU: the same values.
        let t = Tensor::new(buf.as_slice(), &Device::Cpu)?;
        let sampled = Tensor::new(&[5u32, 599, 0], &Device::Cpu)?;
        next.apply(&t, &sampled)?;
        next_ids_ref(&mut buf, &[5, 599, 0], &next.map_host, &next.tables_host, g);
        assert_eq!(t.to_vec1::<u32>()?, buf);
        Ok(())
    }

    /// Bad shapes and a short token map are errors naming them.
    #[test]
    fn errors() -> Result<()> {
        let h = hasher();
        assert!(NextIds::new(Some(&h), &[1], 2, 601, &Device::Cpu).unwrap_err().to_string().contains("601"));
        assert!(NextIds::new(Some(&h), &[2], 2, 600, &Device::Cpu).unwrap_err().to_string().contains("layer 2"));
        let next = NextIds::new(Some(&h), &[1, 14], 2, 600, &Device::Cpu)?;
        let buf = Tensor::zeros(next.geometry().len(), DType::U32, &Device::Cpu)?;
        let e = next.apply(&buf, &Tensor::zeros(3, DType::U32, &Device::Cpu)?).unwrap_err().to_string();
        assert!(e.contains("[1..=2]"), "{e}");
        let e = next.apply(&buf.narrow(0, 1, 5)?, &Tensor::zeros(1, DType::U32, &Device::Cpu)?).unwrap_err().to_string();
        assert!(e.contains("id buffer"), "{e}");
        // Without Engram: only the tokens.
        let plain = NextIds::new(None, &[], 3, 10, &Device::Cpu)?;
        let buf = Tensor::new(&[7u32, 7, 7], &Device::Cpu)?;
        plain.apply(&buf, &Tensor::new(&[1u32, 2], &Device::Cpu)?)?;
        assert_eq!(buf.to_vec1::<u32>()?, [1, 2, 7]);
        Ok(())
    }
}
