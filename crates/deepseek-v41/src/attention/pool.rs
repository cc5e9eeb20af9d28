//! A cache pool shared by many sequences (`docs/architecture.md`, "The cache pool"): the window
//! rings of every admitted sequence live in one preallocated tensor, cut into fixed-size pages of
//! one ring each (`W` rows `[W, head_dim]` in the activation dtype, or `ceil(W / 64)` format-A
//! pages `[pages, page_bytes]` u8 for packed storage, spec §7.2). A sequence's page table is the
//! page of each layer; its ring is a view of that page, so the attention reads and writes the
//! pool in place, with no copy (Candle views keep their start offset; so do the CUDA inserts).
//!
//! [`crate::model::ModelCache::admit`] takes the pages of one sequence (all layers) or fails with
//! [`PoolError::Full`] before taking any, [`PoolLease`] gives them back when the sequence's cache
//! (and every clone of it) is dropped, [`CachePool::occupancy`] reports the use. The compressed
//! entries and index keys of a pooled sequence, its compressor carry and its Engram history stay
//! in the sequence's own [`super::SequenceCache`] / `ModelCache` (growing buffers).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor};

use super::storage::{CacheKind, CacheStorage};
use crate::config::Config;

/// Why the pool cannot take a sequence. Nothing is allocated and no other sequence changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Not enough free pages.
    #[error("cache pool full: a sequence needs {needed} window pages, {free} of {total} are free; finish a sequence or build a larger pool")]
    Full {
        /// Pages one sequence needs (one per layer).
        needed: usize,
        /// Free pages.
        free: usize,
        /// All pages of the pool.
        total: usize,
    },
}

impl From<PoolError> for candle_core::Error {
    fn from(e: PoolError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// How much of the pool is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolOccupancy {
    /// Pages held by admitted sequences.
    pub used_pages: usize,
    /// All pages.
    pub total_pages: usize,
    /// Bytes of one page.
    pub page_bytes: usize,
    /// Admitted sequences.
    pub sequences: usize,
}

#[derive(Debug)]
struct Free {
    /// Free page ids, taken from the end (so a freed page is the next one reused).
    pages: Vec<usize>,
    sequences: usize,
}

#[derive(Debug)]
struct Shared {
    /// bf16: `[pages · W, head_dim]`; packed: `[pages · ring_pages, page_bytes]` u8.
    arena: Tensor,
    /// Rows of `arena` per page (W, or the format-A pages of one ring).
    unit: usize,
    total: usize,
    page_bytes: usize,
    free: Mutex<Free>,
}

/// A pool of window-ring pages for sequences of one model config, storage, dtype and device.
/// Cloning gives another handle to the same pool.
#[derive(Debug, Clone)]
pub struct CachePool {
    shared: Arc<Shared>,
    cfg: Config,
    storage: CacheStorage,
    dtype: DType,
}

/// The pages of one admitted sequence (its page table: layer l's ring is page `pages[l]`);
/// given back to the pool when the last clone is dropped.
#[derive(Debug)]
pub struct PoolLease {
    shared: Arc<Shared>,
    pages: Vec<usize>,
}

impl PoolLease {
    /// The page of each layer.
    pub fn pages(&self) -> &[usize] {
        &self.pages
    }
}

impl Drop for PoolLease {
    fn drop(&mut self) {
        // A poisoned lock means a panic elsewhere; the pages are then lost, not reused.
        if let Ok(mut free) = self.shared.free.lock() {
            free.pages.extend(self.pages.iter().rev());
            free.sequences -= 1;
        }
    }
}

impl CachePool {
    /// A pool with room for `sequences` sequences of `cfg` (one page per layer each), caches
    /// stored as `storage` with activations in `dtype`, allocated on `device` at once. Errors for
    /// packed storage without the `cuda` feature.
    pub fn new(cfg: &Config, storage: CacheStorage, dtype: DType, device: &Device, sequences: usize) -> Result<Self> {
        let (w, d) = (cfg.sliding_window, cfg.head_dim);
        if w == 0 {
            candle_core::bail!("CachePool: sliding_window must be > 0")
        }
        let total = sequences * cfg.layers.len();
        let (arena, unit, page_bytes) = match storage.packing(CacheKind::Window, d)? {
            None => (Tensor::zeros((total * w, d), dtype, device)?, w, w * d * dtype.size_in_bytes()),
            Some(p) => {
                let unit = w.div_ceil(p.page_size());
                let pages = p.zeros(total * unit, device)?;
                let bytes = pages.dim(1)? * unit;
                (pages, unit, bytes)
            }
        };
        let free = Mutex::new(Free { pages: (0..total).rev().collect(), sequences: 0 });
        Ok(Self { shared: Arc::new(Shared { arena, unit, total, page_bytes, free }), cfg: cfg.clone(), storage, dtype })
    }

    /// The config the pool's sequences run.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The storage of the pooled rings.
    pub fn storage(&self) -> CacheStorage {
        self.storage
    }

    /// The activation dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Pages in use, in all, their size and the admitted sequences.
    pub fn occupancy(&self) -> PoolOccupancy {
        let free = self.shared.free.lock().map(|f| (f.pages.len(), f.sequences)).unwrap_or((0, 0));
        PoolOccupancy { used_pages: self.shared.total - free.0, total_pages: self.shared.total, page_bytes: self.shared.page_bytes, sequences: free.1 }
    }

    /// Takes one page per layer for a new sequence and zeroes them: the lease and each layer's
    /// ring (a view of its page, `[W, head_dim]` or `[ring_pages, page_bytes]`). Fails with
    /// [`PoolError::Full`], taking nothing, when fewer pages are free.
    pub(crate) fn lease(&self) -> Result<(PoolLease, Vec<Tensor>)> {
        let needed = self.cfg.layers.len();
        let pages = {
            let mut free = self.shared.free.lock().map_err(|_| candle_core::Error::Msg("CachePool: the pool's lock is poisoned".into()))?;
            if free.pages.len() < needed {
                Err(PoolError::Full { needed, free: free.pages.len(), total: self.shared.total })?
            }
            let at = free.pages.len() - needed;
            free.sequences += 1;
            free.pages.split_off(at).into_iter().rev().collect::<Vec<_>>()
        };
        let lease = PoolLease { shared: self.shared.clone(), pages };
        let unit = self.shared.unit;
        let rings = lease
            .pages
            .iter()
            .map(|&p| {
                let ring = self.shared.arena.narrow(0, p * unit, unit)?;
                ring.slice_set(&ring.zeros_like()?, 0, 0)?;
                Ok(ring)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((lease, rings))
    }
}
