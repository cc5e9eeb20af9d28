//! The page table of a kv source's compressed-entry and index-key pools in the batched decode
//! step (`docs/architecture.md`, "The cache pool"): the pools are N pages of
//! [`PACKED_PAGE_TOKENS`] (P) entries shared by the B sequences of the batch, and entry j of
//! sequence b lives at pool slot `table[b][j / P]·P + j % P` (the same slot in both pools; a
//! packed page is one table page).
//!
//! This is the host side: which pages each sequence holds and which are free. Pages are taken as
//! a sequence's entries grow ([`PageTable::grow`], called by [`super::DecodeStepInputs::update`])
//! or when a sequence is loaded ([`PageTable::resize`]), and returned by [`PageTable::release`].
//! A request the free pages cannot serve is [`DecodeStepError::PoolFull`] and changes nothing.
//! The device copy of the table (`[B, max_pages]` i64, −1 where a sequence holds no page) is
//! written by [`super::DecodeStepInputs::update`] from [`PageTable::host_rows`].
//!
//! The table is shared by every handle (clones) of the kv source's cache and by the step inputs
//! built over it.

use std::sync::{Arc, Mutex, MutexGuard};

use super::decode_error::DecodeStepError;
use super::storage::PACKED_PAGE_TOKENS;

/// How many pages of a kv source's pools the sequences hold ([`PageTable::occupancy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageUse {
    /// The kv source.
    pub layer: usize,
    /// Pages held by sequences.
    pub used: usize,
    /// Pages of the pool.
    pub total: usize,
}

/// The pages of one kv source's pools (see the module docs). Cloning gives another handle to
/// the same table.
#[derive(Debug, Clone)]
pub struct PageTable {
    inner: Arc<Mutex<Pages>>,
}

#[derive(Debug)]
struct Pages {
    layer: usize,
    /// Pages a sequence can hold (`ceil(E / P)`).
    max_pages: usize,
    total: usize,
    /// Free pages, taken from the end (lowest id first while the pool is fresh).
    free: Vec<usize>,
    /// Per sequence, its pages in entry order.
    rows: Vec<Vec<usize>>,
    /// Per sequence, a counter bumped whenever its row changes (what an upload compares).
    versions: Vec<u64>,
}

impl Pages {
    /// `Err(PoolFull)` unless the free pages serve `more[s]` new pages for every sequence s.
    fn check(&self, more: &[usize]) -> Result<(), DecodeStepError> {
        let mut left = self.free.len();
        for (seq, &m) in more.iter().enumerate() {
            if m > left {
                let needed = more[seq..].iter().sum::<usize>();
                return Err(DecodeStepError::PoolFull { layer: self.layer, seq, needed, free: left, total: self.total, page: PACKED_PAGE_TOKENS });
            }
            left -= m;
        }
        Ok(())
    }
}

impl PageTable {
    /// Entries a page holds (P).
    pub const PAGE: usize = PACKED_PAGE_TOKENS;

    /// An empty table of `batch` sequences of up to `entries` entries each over a pool of `pages`
    /// pages, for the kv source `layer` (named by its errors).
    pub fn new(layer: usize, batch: usize, entries: usize, pages: usize) -> Result<Self, DecodeStepError> {
        if batch == 0 {
            return Err(DecodeStepError::EmptyBatch);
        }
        if pages == 0 || entries == 0 {
            return Err(DecodeStepError::Mismatch {
                layer,
                why: format!("a kv source's pools need at least 1 page and 1 entry per sequence, got {pages} pages and {entries} entries"),
            });
        }
        let pages_inner = Pages { layer, max_pages: entries.div_ceil(Self::PAGE), total: pages, free: (0..pages).rev().collect(), rows: vec![Vec::new(); batch], versions: vec![0; batch] };
        Ok(Self { inner: Arc::new(Mutex::new(pages_inner)) })
    }

    fn lock(&self) -> MutexGuard<'_, Pages> {
        // A panic elsewhere while holding the lock leaves the table consistent (every mutation
        // below is checked first, then applied without a fallible step).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sequences of the batch (rows of the table).
    pub fn batch(&self) -> usize {
        self.lock().rows.len()
    }

    /// Pages one sequence can hold: the table's row width, `ceil(E / P)`.
    pub fn max_pages(&self) -> usize {
        self.lock().max_pages
    }

    /// Pages of the pool (N).
    pub fn total(&self) -> usize {
        self.lock().total
    }

    /// Pages held by sequences.
    pub fn used(&self) -> usize {
        let p = self.lock();
        p.total - p.free.len()
    }

    /// Free pages.
    pub fn free(&self) -> usize {
        self.lock().free.len()
    }

    /// Pages used and total, with the kv source's layer.
    pub fn occupancy(&self) -> PageUse {
        let p = self.lock();
        PageUse { layer: p.layer, used: p.total - p.free.len(), total: p.total }
    }

    /// The pages sequence `seq` holds, in entry order (empty outside the batch).
    pub fn pages_of(&self, seq: usize) -> Vec<usize> {
        self.lock().rows.get(seq).cloned().unwrap_or_default()
    }

    /// The pool slot of entry `entry` of sequence `seq` (`None` where it holds no page for it).
    pub fn slot(&self, seq: usize, entry: usize) -> Option<usize> {
        let p = self.lock();
        p.rows.get(seq)?.get(entry / Self::PAGE).map(|&page| page * Self::PAGE + entry % Self::PAGE)
    }

    /// Whether both handles are the same table.
    pub fn same(&self, other: &PageTable) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The pages each sequence needs for `entries[s]` entries beyond those it holds
    /// (`entries.len()` must be the batch; callers check).
    fn more(p: &Pages, entries: &[usize]) -> Vec<usize> {
        p.rows.iter().zip(entries).map(|(r, &n)| n.div_ceil(Self::PAGE).saturating_sub(r.len())).collect()
    }

    /// `Err(PoolFull)` unless [`PageTable::grow`] with `entries` would succeed (nothing changes).
    pub fn check_grow(&self, entries: &[usize]) -> Result<(), DecodeStepError> {
        let p = self.lock();
        Self::check_entries(&p, entries)?;
        p.check(&Self::more(&p, entries))
    }

    /// Makes every sequence s hold pages for at least `entries[s]` entries (one per sequence, in
    /// batch order), taking free pages in sequence order; pages already held are kept. Errors,
    /// taking nothing, when the free pages do not suffice ([`DecodeStepError::PoolFull`] names the
    /// first sequence left without) or an entry count is past the table's width.
    pub fn grow(&self, entries: &[usize]) -> Result<(), DecodeStepError> {
        let mut p = self.lock();
        Self::check_entries(&p, entries)?;
        let more = Self::more(&p, entries);
        p.check(&more)?;
        for (s, m) in more.into_iter().enumerate() {
            for _ in 0..m {
                let page = p.free.pop().expect("checked: enough free pages");
                p.rows[s].push(page);
            }
            if m > 0 {
                p.versions[s] += 1;
            }
        }
        Ok(())
    }

    /// `Err` unless `entries` has one count per sequence, each within the table's width.
    fn check_entries(p: &Pages, entries: &[usize]) -> Result<(), DecodeStepError> {
        if entries.len() != p.rows.len() {
            return Err(DecodeStepError::BatchMismatch { what: "the entry counts", batch: p.rows.len(), got: entries.len() });
        }
        match entries.iter().position(|&n| n.div_ceil(Self::PAGE) > p.max_pages) {
            Some(s) => Err(Self::too_many(p, s, entries[s])),
            None => Ok(()),
        }
    }

    fn too_many(p: &Pages, seq: usize, entries: usize) -> DecodeStepError {
        DecodeStepError::Mismatch {
            layer: p.layer,
            why: format!("sequence {seq} asks for {entries} entries, a sequence holds at most {} pages of {}", p.max_pages, Self::PAGE),
        }
    }

    /// Pages `seq` would hold for `entries` entries and the free pages that leaves (`Err`:
    /// [`DecodeStepError::PoolFull`] when they do not suffice).
    fn resize_plan(p: &Pages, seq: usize, entries: usize) -> Result<usize, DecodeStepError> {
        let want = entries.div_ceil(Self::PAGE);
        if want > p.max_pages {
            return Err(Self::too_many(p, seq, entries));
        }
        let held = p.rows[seq].len();
        let mut more = vec![0; p.rows.len()];
        more[seq] = want.saturating_sub(held);
        p.check(&more)?;
        Ok(want)
    }

    fn check_seq(p: &Pages, seq: usize) -> Result<(), DecodeStepError> {
        if seq >= p.rows.len() {
            return Err(DecodeStepError::BatchMismatch { what: "the sequence index", batch: p.rows.len(), got: seq + 1 });
        }
        Ok(())
    }

    /// `Err` unless [`PageTable::resize`] of `seq` to `entries` would succeed (nothing changes).
    pub fn check_resize(&self, seq: usize, entries: usize) -> Result<(), DecodeStepError> {
        let p = self.lock();
        Self::check_seq(&p, seq)?;
        Self::resize_plan(&p, seq, entries).map(|_| ())
    }

    /// Makes `seq` hold exactly the pages of `entries` entries (a sequence being loaded): its first
    /// pages are kept, missing ones taken from the free pages, surplus ones returned. Errors,
    /// changing nothing, for a sequence outside the batch or a full pool.
    pub fn resize(&self, seq: usize, entries: usize) -> Result<(), DecodeStepError> {
        let mut p = self.lock();
        Self::check_seq(&p, seq)?;
        let want = Self::resize_plan(&p, seq, entries)?;
        while p.rows[seq].len() > want {
            let page = p.rows[seq].pop().expect("longer than want");
            p.free.push(page);
        }
        while p.rows[seq].len() < want {
            let page = p.free.pop().expect("checked: enough free pages");
            p.rows[seq].push(page);
        }
        p.versions[seq] += 1;
        Ok(())
    }

    /// Returns the pages of `seq` to the pool (its table row becomes empty). Errors for a
    /// sequence outside the batch.
    pub fn release(&self, seq: usize) -> Result<(), DecodeStepError> {
        let mut p = self.lock();
        Self::check_seq(&p, seq)?;
        let pages = std::mem::take(&mut p.rows[seq]);
        p.free.extend(pages.into_iter().rev());
        p.versions[seq] += 1;
        Ok(())
    }

    /// Per sequence, a counter that changes whenever its row does (an upload of the device copy
    /// compares them to find the rows to rewrite, without building the table).
    pub fn row_versions(&self) -> Vec<u64> {
        self.lock().versions.clone()
    }

    /// Row `seq` of [`PageTable::host_rows`] (`max_pages` values; empty outside the batch).
    pub fn host_row(&self, seq: usize) -> Vec<i64> {
        let p = self.lock();
        let Some(r) = p.rows.get(seq) else { return Vec::new() };
        let mut out = vec![-1i64; p.max_pages];
        fill_row(&mut out, r);
        out
    }

    /// The table `[B, max_pages]` row-major: each sequence's pages, −1 past those it holds (what
    /// the device copy holds).
    pub fn host_rows(&self) -> Vec<i64> {
        let p = self.lock();
        let mut out = vec![-1i64; p.rows.len() * p.max_pages];
        for (row, r) in out.chunks_mut(p.max_pages.max(1)).zip(&p.rows) {
            fill_row(row, r);
        }
        out
    }
}

/// One row of the device table: the sequence's pages, the rest of `row` (−1) left as is.
fn fill_row(row: &mut [i64], pages: &[usize]) {
    row.iter_mut().zip(pages).for_each(|(o, &page)| *o = page as i64);
}

/// The pool rows of a batched step's top-k entries: entry j of sequence b (`topk` `[B, k]` i64,
/// < 0: none) at `table[b][j / P]·P + j mod P` through the device page table `page_table`
/// (`[B, max_pages]` i64), −1 kept. On CUDA one kernel ([`crate::cuda::page_rows_device`], bit
/// for bit [`page_rows_ref`] for the entries inside the pages a sequence holds).
pub fn page_rows(topk: &candle_core::Tensor, page_table: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_kernels(topk.device()) {
        return crate::cuda::page_rows_device(topk, page_table, PageTable::PAGE);
    }
    page_rows_ref(topk, page_table)
}

/// [`page_rows`] as Candle ops (the reference, on any device).
pub fn page_rows_ref(topk: &candle_core::Tensor, page_table: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    use candle_core::Tensor;
    let zeros = topk.zeros_like()?;
    let page_len = Tensor::full(PageTable::PAGE as i64, (1, 1), topk.device())?;
    let valid = topk.ge(&zeros)?;
    let j = valid.where_cond(topk, &zeros)?;
    let page = j.broadcast_div(&page_len)?;
    let within = (&j - page.broadcast_mul(&page_len)?)?;
    let rows = page_table.gather(&page.contiguous()?, 1)?.broadcast_mul(&page_len)?;
    valid.where_cond(&(rows + within)?, &Tensor::full(-1i64, topk.shape(), topk.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_taken_kept_and_returned() {
        let t = PageTable::new(3, 2, 200, 5).unwrap();
        assert_eq!((t.max_pages(), t.total(), t.used()), (4, 5, 0));
        t.grow(&[1, 65]).unwrap();
        assert_eq!((t.pages_of(0), t.pages_of(1)), (vec![0], vec![1, 2]));
        t.grow(&[65, 65]).unwrap(); // only sequence 0 takes one
        assert_eq!(t.pages_of(0), vec![0, 3]);
        assert_eq!(t.slot(0, 70), Some(3 * 64 + 6));
        assert_eq!(t.slot(0, 128), None);
        // Full: 1 page left, 2 asked: nothing taken, the error names sequence 1.
        let e = t.grow(&[129, 129]).unwrap_err();
        assert!(matches!(e, DecodeStepError::PoolFull { layer: 3, seq: 1, needed: 1, free: 0, total: 5, .. }), "{e}");
        let e = t.grow(&[200, 1]).unwrap_err();
        assert!(matches!(e, DecodeStepError::PoolFull { seq: 0, needed: 2, free: 1, .. }), "{e}");
        assert_eq!((t.used(), t.pages_of(0), t.pages_of(1)), (4, vec![0, 3], vec![1, 2]));
        assert!(e.to_string().contains("layer 3") && e.to_string().contains("release"), "{e}");
        t.release(1).unwrap();
        assert_eq!((t.used(), t.pages_of(1)), (2, vec![]));
        t.resize(1, 130).unwrap();
        assert_eq!(t.pages_of(1), vec![1, 2, 4]);
        t.resize(1, 10).unwrap();
        assert_eq!((t.pages_of(1), t.free()), (vec![1], 2));
        assert_eq!(t.host_rows(), vec![0, 3, -1, -1, 1, -1, -1, -1]);
        assert!(t.resize(2, 1).is_err() && t.grow(&[1]).is_err() && t.grow(&[257, 0]).is_err() && t.resize(0, 257).is_err());
        assert!(t.same(&t.clone()) && !t.same(&PageTable::new(3, 2, 200, 5).unwrap()));
        // Every change of a row bumps its version; a grow that takes nothing for a row does not.
        let v = t.row_versions();
        t.grow(&[65, 10]).unwrap();
        assert_eq!(t.row_versions(), v);
        t.grow(&[129, 10]).unwrap();
        assert_eq!((t.row_versions()[0] > v[0], t.row_versions()[1]), (true, v[1]));
        assert_eq!(t.host_row(1), vec![1, -1, -1, -1]);
        assert_eq!([t.host_row(0), t.host_row(1)].concat(), t.host_rows());
        assert!(t.host_row(2).is_empty());
    }
}
