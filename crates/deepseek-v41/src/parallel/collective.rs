//! [`Collective`]: the exchange between the ranks of an expert-parallel group, and
//! [`LocalGroup`], its in-process form (ranks as threads).

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;

use candle_core::{DType, Device, Result, Tensor};
use half::bf16;

/// The exchanges between the ranks of a group. Every rank calls them the same number of times in
/// the same order (collectives); call `i` of a rank meets call `i` of every other.
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// This rank (0 ..= world − 1).
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Sends `send[d]` to rank `d` (`send.len()` = world; the own entry included) and returns
    /// what every rank sent to this one, by source rank.
    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>>;

    /// Sends the rows `send[d]` (`[n_d, width]` bf16, `n_d` ≥ 0) to rank `d` and returns the rows
    /// every rank sent to this one, by source rank, on `device`. The default goes through
    /// [`Collective::all_to_all`] as host bytes; a collective over device buffers sends them as
    /// they are.
    fn all_to_all_rows(&self, send: Vec<Tensor>, width: usize, device: &Device) -> Result<Vec<Tensor>> {
        let bytes = send.iter().map(|t| rows_to_bytes(t, width)).collect::<Result<Vec<_>>>()?;
        self.all_to_all(bytes)?.iter().enumerate().map(|(src, b)| rows_from_bytes(b, width, device, src)).collect()
    }

    /// Ends this rank's part in the group after another rank failed, so that its pending and
    /// later exchanges fail instead of waiting ([`run_ranks`] calls it; NCCL: the communicator is
    /// aborted). Default: nothing (where a failing rank already fails the others' exchanges, as in
    /// [`LocalGroup`]).
    fn abort(&self) {}
}

/// A shared rank is a rank (e.g. `Arc<dyn Collective>`, what a rank's model blocks hold).
impl<C: Collective + ?Sized> Collective for std::sync::Arc<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world(&self) -> usize {
        (**self).world()
    }

    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        (**self).all_to_all(send)
    }

    fn all_to_all_rows(&self, send: Vec<Tensor>, width: usize, device: &Device) -> Result<Vec<Tensor>> {
        (**self).all_to_all_rows(send, width, device)
    }

    fn abort(&self) {
        (**self).abort()
    }
}

/// `[n, width]` bf16 rows as little-endian bytes.
fn rows_to_bytes(t: &Tensor, width: usize) -> Result<Vec<u8>> {
    let (_, w) = t.dims2()?;
    if w != width || t.dtype() != DType::BF16 {
        candle_core::bail!("all_to_all_rows: a {:?} {:?} tensor where [n, {width}] bf16 rows were expected", t.dtype(), t.shape())
    }
    Ok(t.flatten_all()?.to_vec1::<bf16>()?.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect())
}

/// Inverse of [`rows_to_bytes`]; errors on a length that is not whole rows.
fn rows_from_bytes(b: &[u8], width: usize, device: &Device, src: usize) -> Result<Tensor> {
    if width == 0 || !b.len().is_multiple_of(2 * width) {
        candle_core::bail!("all_to_all_rows: {} bytes from rank {src} are not whole rows of {width} bf16 values", b.len())
    }
    let v: Vec<bf16> = b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect();
    Tensor::from_vec(v, (b.len() / (2 * width), width), device)
}

/// One rank of a [`LocalGroup`]: a channel to and from every rank (FIFO per pair, so the calls
/// of a collective meet in order). Move each into its own thread.
#[derive(Debug)]
pub struct LocalRank {
    rank: usize,
    to: Vec<Sender<Vec<u8>>>,
    from: Vec<Mutex<Receiver<Vec<u8>>>>,
}

/// `world` ranks in one process ([`LocalGroup::ranks`]).
#[derive(Debug)]
pub struct LocalGroup;

impl LocalGroup {
    /// The ranks of a new group of `world` ranks, in rank order.
    pub fn ranks(world: usize) -> Vec<LocalRank> {
        // pair[s][d]: the channel from s to d.
        let mut tx: Vec<Vec<Option<Sender<Vec<u8>>>>> = (0..world).map(|_| (0..world).map(|_| None).collect()).collect();
        let mut rx: Vec<Vec<Option<Receiver<Vec<u8>>>>> = (0..world).map(|_| (0..world).map(|_| None).collect()).collect();
        for s in 0..world {
            for d in 0..world {
                let (t, r) = channel();
                tx[s][d] = Some(t);
                rx[d][s] = Some(r);
            }
        }
        tx.into_iter()
            .zip(rx)
            .enumerate()
            .map(|(rank, (to, from))| LocalRank { rank, to: to.into_iter().flatten().collect(), from: from.into_iter().flatten().map(Mutex::new).collect() })
            .collect()
    }
}

impl Collective for LocalRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.to.len()
    }

    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        if send.len() != self.to.len() {
            candle_core::bail!("all_to_all: {} buffers for {} ranks", send.len(), self.to.len())
        }
        for (d, (buf, to)) in send.into_iter().zip(&self.to).enumerate() {
            to.send(buf).map_err(|_| candle_core::Error::Msg(format!("all_to_all: rank {d} has left the group (rank {})", self.rank)))?;
        }
        self.from
            .iter()
            .enumerate()
            .map(|(s, r)| {
                let r = r.lock().map_err(|_| candle_core::Error::Msg(format!("all_to_all: the channel from rank {s} is poisoned (rank {})", self.rank)))?;
                r.recv().map_err(|_| candle_core::Error::Msg(format!("all_to_all: rank {s} has left the group (rank {})", self.rank)))
            })
            .collect()
    }
}

/// Runs `f` as every rank of a new [`LocalGroup`] of `world` ranks, one thread each, and returns
/// their results in rank order (as [`run_ranks`]). A rank that fails (or panics) drops its
/// channels, so the ranks waiting on it in an exchange fail too instead of waiting forever.
pub fn run_local_ranks<T: Send>(world: usize, f: impl Fn(LocalRank) -> Result<T> + Sync) -> Result<Vec<T>> {
    run_threads(LocalGroup::ranks(world), f, |_| ())
}

/// Runs `f` as every rank of `comms` (rank r gets `comms[r]`, e.g. `Arc<dyn Collective>`), one
/// thread each, and returns their results in rank order; the first failure by rank is returned,
/// naming the rank. When a rank fails (or panics) the others are aborted
/// ([`Collective::abort`]), so none waits forever for it.
pub fn run_ranks<C: Collective + Clone, T: Send>(comms: Vec<C>, f: impl Fn(C) -> Result<T> + Sync) -> Result<Vec<T>> {
    let handles = comms.clone();
    run_threads(comms, f, |failed| handles.iter().enumerate().filter(|&(r, _)| r != failed).for_each(|(_, c)| c.abort()))
}

/// Tells the launcher that its rank ended, and whether it succeeded (false if it unwinds).
struct Ended {
    rank: usize,
    ok: bool,
    tx: Sender<(usize, bool)>,
}

impl Drop for Ended {
    fn drop(&mut self) {
        let _ = self.tx.send((self.rank, self.ok));
    }
}

fn run_threads<C: Collective, T: Send>(comms: Vec<C>, f: impl Fn(C) -> Result<T> + Sync, on_failure: impl Fn(usize)) -> Result<Vec<T>> {
    let world = comms.len();
    if world == 0 {
        candle_core::bail!("run_ranks: a group of 0 ranks")
    }
    let f = &f;
    let mut first_failed = None;
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let (tx, rx) = channel();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let mut ended = Ended { rank, ok: false, tx: tx.clone() };
                s.spawn(move || {
                    let out = f(comm);
                    ended.ok = out.is_ok();
                    drop(ended);
                    out
                })
            })
            .collect();
        drop(tx);
        for (rank, ok) in rx {
            if !ok && first_failed.is_none() {
                first_failed = Some(rank);
                on_failure(rank);
            }
        }
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| h.join().unwrap_or_else(|_| Err(candle_core::Error::Msg(format!("rank {r} panicked")))))
            .collect()
    });
    // The rank that failed first is the cause; the others' failures may only follow from it.
    let mut results: Vec<Option<Result<T>>> = results.into_iter().map(Some).collect();
    if let Some(r) = first_failed {
        if let Some(Err(e)) = results[r].take() {
            candle_core::bail!("rank {r} of {world}: {e}")
        }
    }
    results.into_iter().enumerate().map(|(r, v)| v.unwrap_or_else(|| Err(candle_core::Error::Msg("no result".into()))).map_err(|e| candle_core::Error::Msg(format!("rank {r} of {world}: {e}")))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank gets what each rank sent it, by source, over several calls.
    #[test]
    fn all_to_all_delivers_by_source() -> Result<()> {
        let got = run_local_ranks(4, |c| {
            let mut seen = Vec::new();
            for call in 0..3u8 {
                let send = (0..4u8).map(|d| vec![c.rank() as u8, d, call]).collect();
                seen.push(c.all_to_all(send)?);
            }
            Ok(seen)
        })?;
        for (r, calls) in got.iter().enumerate() {
            for (call, from) in calls.iter().enumerate() {
                for (s, b) in from.iter().enumerate() {
                    assert_eq!(b, &vec![s as u8, r as u8, call as u8], "rank {r} call {call} from {s}");
                }
            }
        }
        Ok(())
    }

    /// Rows sent to every rank (none to some) arrive by source with their values, shapes and
    /// dtype; a wrong width is an error.
    #[test]
    fn all_to_all_rows_delivers_by_source() -> Result<()> {
        let got = run_local_ranks(3, |c| {
            let send = (0..3)
                .map(|d| {
                    let n = (c.rank() + d) % 3;
                    let v: Vec<f32> = (0..n * 4).map(|i| (100 * c.rank() + 10 * d + i) as f32).collect();
                    Tensor::from_vec(v, (n, 4), &Device::Cpu)?.to_dtype(DType::BF16)
                })
                .collect::<Result<Vec<_>>>()?;
            let bad = c.all_to_all_rows(vec![Tensor::zeros((1, 3), DType::BF16, &Device::Cpu)?; 3], 4, &Device::Cpu);
            if bad.is_ok() {
                candle_core::bail!("a [1, 3] tensor went out as rows of 4")
            }
            c.all_to_all_rows(send, 4, &Device::Cpu)
        });
        // The failing call errors on every rank before it sends: the group stays in step.
        let got = got?;
        for (r, from) in got.iter().enumerate() {
            for (s, t) in from.iter().enumerate() {
                let n = (s + r) % 3;
                assert_eq!(t.dims(), [n, 4], "rank {r} from {s}");
                let want: Vec<f32> = (0..n * 4).map(|i| (100 * s + 10 * r + i) as f32).collect();
                assert_eq!(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, want, "rank {r} from {s}");
            }
        }
        Ok(())
    }

    /// A rank whose exchanges wait until it is aborted (as an NCCL rank waits for a peer).
    #[derive(Debug)]
    struct Waiting {
        rank: usize,
        aborted: std::sync::Arc<(Mutex<bool>, std::sync::Condvar)>,
    }

    impl Collective for Waiting {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world(&self) -> usize {
            3
        }
        fn all_to_all(&self, _: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
            let (flag, cv) = &*self.aborted;
            let mut done = flag.lock().unwrap();
            while !*done {
                done = cv.wait(done).unwrap();
            }
            candle_core::bail!("aborted")
        }
        fn abort(&self) {
            *self.aborted.0.lock().unwrap() = true;
            self.aborted.1.notify_all();
        }
    }

    /// When a rank fails, run_ranks aborts the others (which would otherwise wait forever) and
    /// reports the failing rank's error, not the aborted ranks'.
    #[test]
    fn run_ranks_aborts_the_others_and_names_the_cause() {
        let comms: Vec<std::sync::Arc<Waiting>> = (0..3).map(|rank| std::sync::Arc::new(Waiting { rank, aborted: Default::default() })).collect();
        let err = run_ranks(comms, |c| -> Result<()> {
            if c.rank() == 1 {
                candle_core::bail!("load failed")
            }
            c.all_to_all(vec![vec![]; 3]).map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("rank 1 of 3") && err.contains("load failed"), "{err}");
    }

    /// A rank that fails before an exchange makes the others' exchange fail: no rank waits
    /// forever, and the error names the failing rank.
    #[test]
    fn a_failing_rank_does_not_hang_the_group() {
        let err = run_local_ranks(3, |c| {
            if c.rank() == 1 {
                candle_core::bail!("load failed")
            }
            c.all_to_all(vec![vec![]; 3])?;
            c.all_to_all(vec![vec![]; 3])
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("left the group") || err.contains("load failed"), "{err}");
        let err = run_local_ranks(2, |c| -> Result<()> {
            if c.rank() == 0 {
                panic!("boom")
            }
            c.all_to_all(vec![vec![]; 2]).map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("rank 0 panicked") || err.contains("left the group"), "{err}");
    }
}
