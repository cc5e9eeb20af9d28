//! Engram hashing (spec §9.1–§9.4): the compressed token map, the prime bucket layout, the hash
//! multipliers, and the n-gram hash ids of every position, with a caller-owned lookback history
//! so that chunked prefill and decode produce the same ids as one full prefill.
//!
//! Text only: the lookback blocking at image tokens (spec §9.4 step 2) is not implemented.

use candle_core::{Device, Result, Tensor};

use crate::config::EngramConfig;
use crate::model::numpy_rng::default_rng_integers;

/// Token id → compressed id (spec §9.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMap {
    map: Vec<u32>,
    compressed_vocab_size: usize,
}

impl TokenMap {
    /// Wraps a map `map[token_id] = compressed_id`; the compressed vocab size is `max + 1`.
    pub fn new(map: Vec<u32>) -> Result<Self> {
        let Some(&max) = map.iter().max() else {
            candle_core::bail!("TokenMap: empty map")
        };
        Ok(Self {
            map,
            compressed_vocab_size: max as usize + 1,
        })
    }

    /// The synthetic map of the golden sets: `id → id / 2` over `vocab_size` ids.
    pub fn div2(vocab_size: usize) -> Self {
        let map: Vec<u32> = (0..vocab_size as u32).map(|i| i / 2).collect();
        let compressed_vocab_size = vocab_size.div_ceil(2);
        Self {
            map,
            compressed_vocab_size,
        }
    }

    /// Number of distinct compressed ids (`max + 1`).
    pub fn compressed_vocab_size(&self) -> usize {
        self.compressed_vocab_size
    }

    /// The compressed id of every token id (`map[token_id]`).
    pub fn ids(&self) -> &[u32] {
        &self.map
    }

    /// Number of token ids covered.
    pub fn vocab_size(&self) -> usize {
        self.map.len()
    }

    /// The compressed id of `token`, or an error naming an out-of-range token.
    pub fn get(&self, token: u32) -> Result<u32> {
        match self.map.get(token as usize) {
            Some(&c) => Ok(c),
            None => candle_core::bail!(
                "TokenMap: token id {token} outside the map's {} ids",
                self.map.len()
            ),
        }
    }
}

/// One Engram layer's bucket layout and hash multipliers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngramLayerLayout {
    /// The backbone layer id.
    pub layer: usize,
    /// Bucket sizes (primes), `[(n−2)·n_heads + head]` for n-gram order `n = 2..=max_ngram`.
    pub primes: Vec<u64>,
    /// Row offset of each bucket range (prefix sums of `primes`), same indexing.
    pub offsets: Vec<u64>,
    /// Odd hash multipliers, one per lookback `s = 0..max_ngram`.
    pub multipliers: Vec<u64>,
}

impl EngramLayerLayout {
    /// Table rows of this layer (the sum of its primes).
    pub fn num_rows(&self) -> u64 {
        self.primes.iter().sum()
    }

    /// Appends the row ids of one position to `out`: `(max_ngram − 1)·heads` values from its
    /// lookback ids (`lookback[s]` = the compressed id `s` tokens back, the pad id before the
    /// sequence start). `rolling = tok₀·m₀`, then for `s = 1..max_ngram`: `rolling ^= tok_s·m_s`
    /// and `id[(s−1)·heads + k] = rolling mod prime + offset` (spec §9.4).
    pub(crate) fn push_ids(&self, lookback: &[u64], heads: usize, out: &mut Vec<u32>) {
        // tok < compressed vocab and m < 2·(i64::MAX / vocab / 2) + 1, so no overflow.
        let mut rolling = lookback[0] * self.multipliers[0];
        for (s, (&tok, &m)) in lookback.iter().zip(&self.multipliers).enumerate().skip(1) {
            rolling ^= tok * m;
            for k in 0..heads {
                let c = (s - 1) * heads + k;
                out.push((rolling % self.primes[c] + self.offsets[c]) as u32);
            }
        }
    }
}

/// The bucket layouts of all Engram layers (spec §9.2, §9.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngramLayout {
    layers: Vec<EngramLayerLayout>,
    max_ngram: usize,
    n_heads: usize,
}

fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    if n.is_multiple_of(2) {
        return n == 2;
    }
    let mut i = 3u64;
    while i * i <= n {
        if n.is_multiple_of(i) {
            return false;
        }
        i += 2;
    }
    true
}

impl EngramLayout {
    /// The global prime walk (for each layer, for each order, restart at `vocab_size − 1` and take
    /// per head the next unused prime), offsets as prefix sums, and the multipliers
    /// `2·v + 1` with `v` from numpy's `default_rng(10007·L).integers(0, bound, max_ngram)`,
    /// `bound = (i64::MAX div compressed_vocab) div 2`.
    ///
    /// Errors when a layer's prime sum differs from `num_embeddings` (the table would be read with
    /// a different hash), or when the configuration is degenerate.
    pub fn new(cfg: &EngramConfig) -> Result<Self> {
        let (max_ngram, n_heads) = (cfg.max_ngram_size, cfg.n_heads);
        if max_ngram < 2 || n_heads == 0 || cfg.vocab_size == 0 || cfg.compressed_vocab_size == 0 {
            candle_core::bail!(
                "Engram: need max_ngram_size >= 2, n_heads/vocab_size/compressed_vocab_size > 0, got {}/{}/{}/{}",
                max_ngram,
                n_heads,
                cfg.vocab_size,
                cfg.compressed_vocab_size
            )
        }
        if cfg.num_embeddings.len() != cfg.layer_ids.len() {
            candle_core::bail!(
                "Engram: {} num_embeddings for {} layers {:?}",
                cfg.num_embeddings.len(),
                cfg.layer_ids.len(),
                cfg.layer_ids
            )
        }
        let bound = (i64::MAX / cfg.compressed_vocab_size as i64) / 2;
        let mut seen = std::collections::HashSet::new();
        let mut layers = Vec::with_capacity(cfg.layer_ids.len());
        for (&layer, &rows) in cfg.layer_ids.iter().zip(&cfg.num_embeddings) {
            // Grown as found: the count comes from the config.
            let mut primes = Vec::new();
            for _order in 2..=max_ngram {
                let mut c = cfg.vocab_size as u64 - 1;
                for _head in 0..n_heads {
                    c += 1;
                    while !is_prime(c) || seen.contains(&c) {
                        c += 1;
                    }
                    seen.insert(c);
                    primes.push(c);
                }
            }
            let offsets: Vec<u64> = primes
                .iter()
                .scan(0u64, |acc, &p| Some(std::mem::replace(acc, *acc + p)))
                .collect();
            let multipliers = default_rng_integers(10007 * layer as u64, bound, max_ngram)?
                .into_iter()
                .map(|v| 2 * v as u64 + 1)
                .collect();
            let l = EngramLayerLayout {
                layer,
                primes,
                offsets,
                multipliers,
            };
            if l.num_rows() != rows as u64 {
                candle_core::bail!(
                    "Engram layer {layer}: prime bucket sizes sum to {} but engram_num_embeddings says {rows}",
                    l.num_rows()
                )
            }
            if l.num_rows() > u32::MAX as u64 + 1 {
                candle_core::bail!(
                    "Engram layer {layer}: {} table rows do not fit u32 row ids",
                    l.num_rows()
                )
            }
            layers.push(l);
        }
        Ok(Self {
            layers,
            max_ngram,
            n_heads,
        })
    }

    /// Per-layer layouts, in `engram_layer_ids` order.
    pub fn layers(&self) -> &[EngramLayerLayout] {
        &self.layers
    }

    /// The layout of backbone layer `layer`, if it is an Engram layer.
    pub fn layer(&self, layer: usize) -> Option<&EngramLayerLayout> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Hash ids per position: `(max_ngram − 1)·n_heads`.
    pub fn n_cols(&self) -> usize {
        (self.max_ngram - 1) * self.n_heads
    }

    /// Hash heads per n-gram order.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// Largest n-gram order.
    pub fn max_ngram(&self) -> usize {
        self.max_ngram
    }
}

/// The compressed ids of the last `max_ngram − 1` tokens of a sequence (oldest first), owned by
/// the caller next to its caches; fresh for a new sequence. With a rollback depth it keeps that
/// many more ids, so that it can be truncated ([`EngramHistory::truncate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngramHistory {
    recent: Vec<u32>,
    /// `max_ngram − 1`: the ids a hash looks back at.
    lookback: usize,
    capacity: usize,
    /// Tokens pushed since the sequence start.
    seen: usize,
}

impl EngramHistory {
    /// An empty history (sequence start) for `max_ngram_size`.
    pub fn new(max_ngram_size: usize) -> Self {
        let lookback = max_ngram_size.saturating_sub(1);
        Self { recent: Vec::new(), lookback, capacity: lookback, seen: 0 }
    }

    /// The remembered compressed ids, oldest first (fewer than `max_ngram − 1` near the start;
    /// up to `max_ngram − 1 + depth` with a rollback depth).
    pub fn recent(&self) -> &[u32] {
        &self.recent
    }

    /// Forgets the sequence.
    pub fn clear(&mut self) {
        self.recent.clear();
        self.seen = 0;
    }

    /// Keeps `depth` more ids than the hashes need, so that the history can be truncated up to
    /// `depth` tokens back from the longest length it reached.
    pub fn set_rollback_depth(&mut self, depth: usize) {
        self.capacity = self.lookback + depth;
    }

    /// Tokens pushed since the sequence start.
    pub fn seq_len(&self) -> usize {
        self.seen
    }

    /// The positions whose ids a truncation to `len` tokens needs but that are no longer held
    /// (`None`: it can be done; `len` must not exceed [`EngramHistory::seq_len`]).
    pub fn rollback_gap(&self, len: usize) -> Option<std::ops::Range<usize>> {
        let needed = len.saturating_sub(self.lookback)..len;
        let held_from = self.seen - self.recent.len();
        (len <= self.seen && !needed.is_empty() && needed.start < held_from).then(|| needed.start..held_from.min(len))
    }

    /// Rolls the history back to the first `len` tokens; `false` (and nothing changes) when
    /// [`EngramHistory::rollback_gap`] reports missing ids or `len` is past the end.
    pub fn truncate(&mut self, len: usize) -> bool {
        if len > self.seen || self.rollback_gap(len).is_some() {
            return false;
        }
        self.recent.truncate(self.recent.len().saturating_sub(self.seen - len));
        self.seen = len;
        true
    }

    /// A history that has seen `seen` tokens, the last of them `recent` (oldest first; at most
    /// `max_ngram − 1` are kept).
    pub(crate) fn resume(max_ngram_size: usize, recent: &[u32], seen: usize) -> Self {
        let mut h = Self::new(max_ngram_size);
        h.push_all(recent);
        h.seen = seen;
        h
    }

    fn push_all(&mut self, ids: &[u32]) {
        self.recent.extend_from_slice(ids);
        self.seen += ids.len();
        let excess = self.recent.len().saturating_sub(self.capacity);
        self.recent.drain(..excess);
    }
}

/// Hash ids of a run of positions for every Engram layer: `[T, n_cols]` u32 row ids per layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngramIds {
    tokens: usize,
    n_cols: usize,
    /// `(layer, [T·n_cols] row ids)`.
    per_layer: Vec<(usize, Vec<u32>)>,
}

impl EngramIds {
    /// Number of positions.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Ids per position.
    pub fn n_cols(&self) -> usize {
        self.n_cols
    }

    /// The `[T·n_cols]` row ids of backbone layer `layer` (row-major `[T, n_cols]`).
    pub fn layer(&self, layer: usize) -> Option<&[u32]> {
        self.per_layer
            .iter()
            .find(|(l, _)| *l == layer)
            .map(|(_, v)| v.as_slice())
    }

    /// The ids of `layer` as a `[T, n_cols]` u32 tensor.
    pub fn tensor(&self, layer: usize, device: &Device) -> Result<Tensor> {
        match self.layer(layer) {
            Some(v) => Tensor::from_slice(v, (self.tokens, self.n_cols), device),
            None => candle_core::bail!("EngramIds: layer {layer} is not an Engram layer"),
        }
    }
}

/// Computes Engram hash ids (spec §9.4).
#[derive(Debug, Clone)]
pub struct EngramHasher {
    layout: EngramLayout,
    token_map: TokenMap,
    pad: u32,
}

impl EngramHasher {
    /// Builds the layout of `cfg` and checks `token_map` against it: its compressed vocab must
    /// equal `compressed_vocab_size` (the multipliers depend on it) and it must cover the pad id.
    pub fn new(cfg: &EngramConfig, token_map: TokenMap) -> Result<Self> {
        if token_map.compressed_vocab_size() != cfg.compressed_vocab_size {
            candle_core::bail!(
                "Engram: token map has {} compressed ids, config engram_compressed_vocab_size is {}",
                token_map.compressed_vocab_size(),
                cfg.compressed_vocab_size
            )
        }
        let pad = token_map.get(cfg.pad_token_id)?;
        Ok(Self {
            layout: EngramLayout::new(cfg)?,
            token_map,
            pad,
        })
    }

    /// The bucket layout.
    pub fn layout(&self) -> &EngramLayout {
        &self.layout
    }

    /// The token map.
    pub fn token_map(&self) -> &TokenMap {
        &self.token_map
    }

    /// The compressed pad id used for missing lookback (`map[engram_pad_token_id]`).
    pub fn pad_compressed(&self) -> u32 {
        self.pad
    }

    /// A fresh history for a new sequence.
    pub fn new_history(&self) -> EngramHistory {
        EngramHistory::new(self.layout.max_ngram)
    }

    /// Hash ids of the next `tokens` of the sequence whose earlier tokens `history` remembers
    /// (empty = the sequence starts here); appends `tokens` to `history`.
    ///
    /// For position `p`, lookback `s` reads the compressed token at `p − s`; before the sequence
    /// start it reads the pad id, and so does every longer lookback (blocking is cumulative).
    /// `rolling = tok₀·m₀`, then for `s = 1..max_ngram`: `rolling ^= tok_s·m_s` and
    /// `id[(s−1)·heads + k] = rolling mod prime + offset`.
    pub fn hash(&self, tokens: &[u32], history: &mut EngramHistory) -> Result<EngramIds> {
        let compressed = tokens
            .iter()
            .map(|&t| self.token_map.get(t))
            .collect::<Result<Vec<u32>>>()?;
        // The ids the hashes look back at (a history with a rollback depth holds more).
        let recent = history.recent();
        let seq: Vec<u32> = recent[recent.len().saturating_sub(history.lookback)..]
            .iter()
            .chain(&compressed)
            .copied()
            .collect();
        let start = seq.len() - compressed.len();
        let (g, heads, n_cols) = (
            self.layout.max_ngram,
            self.layout.n_heads,
            self.layout.n_cols(),
        );
        let mut per_layer: Vec<(usize, Vec<u32>)> = self
            .layout
            .layers
            .iter()
            .map(|l| (l.layer, Vec::with_capacity(tokens.len() * n_cols)))
            .collect();
        let mut lookback = vec![0u64; g];
        for i in 0..tokens.len() {
            let at = start + i;
            let mut blocked = false;
            for (s, tok) in lookback.iter_mut().enumerate() {
                blocked |= s > at;
                *tok = if blocked { self.pad } else { seq[at - s] } as u64;
            }
            for (layout, (_, out)) in self.layout.layers.iter().zip(per_layer.iter_mut()) {
                layout.push_ids(&lookback, heads, out);
            }
        }
        history.push_all(&compressed);
        Ok(EngramIds {
            tokens: tokens.len(),
            n_cols,
            per_layer,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The released Engram configuration.
    pub(crate) fn real_cfg() -> EngramConfig {
        EngramConfig {
            layer_ids: vec![1, 14],
            num_embeddings: vec![384006168, 384016682],
            max_ngram_size: 4,
            vocab_size: 16_000_000,
            n_heads: 8,
            head_dim: 256,
            pad_token_id: 2,
            compressed_vocab_size: 99092,
        }
    }

    /// Spec §9.2 self-checks and §9.3 released multipliers for the real config.
    #[test]
    fn real_layout() {
        let l = EngramLayout::new(&real_cfg()).unwrap();
        assert_eq!(l.n_cols(), 24);
        assert_eq!(l.layers()[0].primes[0], 16000057);
        assert_eq!(l.layers()[1].primes[0], 16000477);
        assert_eq!(l.layers()[0].num_rows(), 384006168);
        assert_eq!(l.layers()[1].num_rows(), 384016682);
        assert_eq!(
            l.layers()[0].multipliers,
            vec![
                76632096046245,
                4839876093313,
                35959672319349,
                73987337458391
            ]
        );
        assert_eq!(
            l.layers()[1].multipliers,
            vec![
                67716810739261,
                51510806800915,
                30921347202721,
                82619226485591
            ]
        );
        let o = &l.layers()[1].offsets;
        assert_eq!(o[0], 0);
        assert_eq!(o[23] + l.layers()[1].primes[23], 384016682);
    }

    /// A table size that the walk cannot produce is rejected.
    #[test]
    fn wrong_table_size_is_rejected() {
        let mut cfg = real_cfg();
        cfg.num_embeddings[1] += 2;
        let err = EngramLayout::new(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("384016682") && err.contains("384016684"),
            "{err}"
        );
    }

    /// Hand-built sequence: the first positions read the pad id for missing lookback.
    #[test]
    fn hand_hash_with_padding() {
        let cfg = EngramConfig {
            layer_ids: vec![1, 5],
            num_embeddings: vec![420, 508],
            max_ngram_size: 3,
            vocab_size: 101,
            n_heads: 2,
            head_dim: 32,
            pad_token_id: 2,
            compressed_vocab_size: 256,
        };
        let h = EngramHasher::new(&cfg, TokenMap::div2(512)).unwrap();
        assert_eq!(h.pad_compressed(), 1);
        let toks = [10u32, 21, 30, 7];
        let ids = h.hash(&toks, &mut h.new_history()).unwrap();
        let l = &h.layout().layers()[0];
        let (m, p, o) = (&l.multipliers, &l.primes, &l.offsets);
        let expect = |t: [u64; 3]| -> Vec<u32> {
            let r1 = (t[0] * m[0]) ^ (t[1] * m[1]);
            let r2 = r1 ^ (t[2] * m[2]);
            vec![
                (r1 % p[0] + o[0]) as u32,
                (r1 % p[1] + o[1]) as u32,
                (r2 % p[2] + o[2]) as u32,
                (r2 % p[3] + o[3]) as u32,
            ]
        };
        let got = ids.layer(1).unwrap();
        assert_eq!(&got[0..4], expect([5, 1, 1]).as_slice());
        assert_eq!(&got[4..8], expect([10, 5, 1]).as_slice());
        assert_eq!(&got[8..12], expect([15, 10, 5]).as_slice());
        assert_eq!(&got[12..16], expect([3, 15, 10]).as_slice());
    }
}
