//! Rows indexed by position in a fixed buffer, slot = position mod capacity: the addressing of
//! the sliding-window ring, and [`PositionRing`], the bounded per-position history a cache keeps
//! so that it can be truncated ([`super::SequenceCache::truncate`]).

use std::ops::Range;

use candle_core::{Result, Tensor};

/// Writes `rows` (`[k, width]`, positions `first .. first + k`, `k <= buf.dim(0)`) into `buf`
/// at slots `position mod buf.dim(0)` (at most two contiguous runs, in-place copies).
pub(crate) fn write_slots(buf: &Tensor, rows: &Tensor, first: usize) -> Result<()> {
    let (m, k) = (buf.dim(0)?, rows.dim(0)?);
    if k > m {
        candle_core::bail!("write_slots: {k} rows do not fit a ring of {m}")
    }
    let mut done = 0;
    while done < k {
        let slot = (first + done) % m;
        let run = (m - slot).min(k - done);
        let src = rows.narrow(0, done, run)?.to_dtype(buf.dtype())?;
        buf.slice_set(&src.contiguous()?, 0, slot)?;
        done += run;
    }
    Ok(())
}

/// The rows of positions `range` (`range.len() <= buf.dim(0)`) from `buf`'s slots
/// `position mod buf.dim(0)`, in position order.
pub(crate) fn read_slots(buf: &Tensor, range: Range<usize>) -> Result<Tensor> {
    let m = buf.dim(0)?;
    if range.len() > m {
        candle_core::bail!("read_slots: {} positions do not fit a ring of {m}", range.len())
    }
    let mut parts = Vec::new();
    let mut p = range.start;
    while p < range.end {
        let slot = p % m;
        let run = (m - slot).min(range.end - p);
        parts.push(buf.narrow(0, slot, run)?);
        p += run;
    }
    match parts.len() {
        0 => buf.narrow(0, 0, 0),
        1 => parts.pop().expect("one part").contiguous(),
        _ => Tensor::cat(&parts, 0),
    }
}

/// The rows of the last `capacity` positions recorded, for a contiguous run of positions
/// `[lo, hi)` (`hi − lo <= capacity`). The buffer is allocated at the first write, in the rows'
/// dtype and on their device. Capacity 0 records nothing.
#[derive(Debug, Clone)]
pub struct PositionRing {
    buf: Option<Tensor>,
    capacity: usize,
    lo: usize,
    hi: usize,
}

impl PositionRing {
    /// An empty history of `capacity` positions.
    pub fn new(capacity: usize) -> Self {
        Self { buf: None, capacity, lo: 0, hi: 0 }
    }

    /// How many positions it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions whose rows are held.
    pub fn held(&self) -> Range<usize> {
        self.lo..self.hi
    }

    /// Whether the rows of every position of `range` are held (always for an empty range).
    pub fn holds(&self, range: &Range<usize>) -> bool {
        range.is_empty() || (self.lo <= range.start && range.end <= self.hi)
    }

    /// Records `rows` `[k, width]` of positions `first .. first + k`. A write that does not
    /// continue the held run (`first != hi`) starts a new one at `first`.
    pub fn write(&mut self, rows: &Tensor, first: usize) -> Result<()> {
        let k = rows.dim(0)?;
        if first != self.hi {
            self.lo = first;
        }
        self.hi = first + k;
        self.lo = self.lo.max(self.hi.saturating_sub(self.capacity));
        if self.capacity == 0 || k == 0 {
            return Ok(());
        }
        let buf = match &self.buf {
            Some(b) => b.clone(),
            None => {
                let b = Tensor::zeros((self.capacity, rows.dim(1)?), rows.dtype(), rows.device())?;
                self.buf = Some(b.clone());
                b
            }
        };
        let keep = k.min(self.capacity);
        write_slots(&buf, &rows.narrow(0, k - keep, keep)?, first + k - keep)
    }

    /// The rows of `range`, in position order; `None` unless [`PositionRing::holds`] it or it is
    /// empty (then `None` too: there is nothing to read).
    pub fn read(&self, range: Range<usize>) -> Result<Option<Tensor>> {
        match &self.buf {
            Some(buf) if !range.is_empty() && self.holds(&range) => Ok(Some(read_slots(buf, range)?)),
            _ => Ok(None),
        }
    }

    /// Forgets the positions from `end` on.
    pub fn truncate(&mut self, end: usize) {
        self.hi = self.hi.min(end);
        self.lo = self.lo.min(self.hi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn rows(first: usize, k: usize) -> Tensor {
        let v: Vec<f32> = (first..first + k).map(|p| p as f32).collect();
        Tensor::from_vec(v, (k, 1), &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn keeps_the_last_capacity_positions_across_wraps_and_truncation() -> Result<()> {
        let mut h = PositionRing::new(5);
        h.write(&rows(0, 3), 0)?;
        h.write(&rows(3, 4), 3)?; // 0..7, keeps 2..7
        assert_eq!(h.held(), 2..7);
        assert_eq!(values(&h.read(2..7)?.unwrap()), [2.0, 3.0, 4.0, 5.0, 6.0]);
        assert!(h.read(1..3)?.is_none());
        h.truncate(4);
        assert_eq!(h.held(), 2..4);
        h.write(&rows(4, 1), 4)?;
        assert_eq!(values(&h.read(2..5)?.unwrap()), [2.0, 3.0, 4.0]);
        // A gap starts a new run; a write longer than the capacity keeps its tail.
        h.write(&rows(10, 8), 10)?;
        assert_eq!(h.held(), 13..18);
        assert_eq!(values(&h.read(13..18)?.unwrap()), [13.0, 14.0, 15.0, 16.0, 17.0]);
        let mut none = PositionRing::new(0);
        none.write(&rows(0, 3), 0)?;
        assert_eq!(none.held(), 3..3);
        assert!(none.read(0..1)?.is_none());
        let buf = Tensor::zeros((4, 1), DType::F32, &Device::Cpu)?;
        write_slots(&buf, &rows(6, 3), 6)?; // slots 2, 3, 0
        assert_eq!(values(&read_slots(&buf, 6..9)?), [6.0, 7.0, 8.0]);
        assert!(write_slots(&buf, &rows(0, 5), 0).is_err());
        Ok(())
    }
}
