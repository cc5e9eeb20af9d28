//! [`NcclRank`]: a [`Collective`] over NCCL (cudarc's bindings; feature `nccl`): the ranks of one
//! process, one per GPU, exchanging device buffers with grouped `ncclSend` / `ncclRecv`.
//!
//! * [`NcclRank::group`] creates the communicators of every GPU in one call (`ncclCommInitAll`);
//!   run each rank in its own thread with [`super::run_ranks`] (as `Arc<NcclRank>` or
//!   `Arc<dyn Collective>`). A rank's NCCL calls go on its
//!   device's candle stream, so they are ordered with the candle work before and after them.
//! * [`Collective::all_to_all_rows`]: the row counts first (one `u64` per pair), then the rows
//!   themselves from and into device memory — no host copy of the rows.
//! * [`Collective::all_to_all`] (host bytes: the slots' metadata, the rounds): the lengths, then the
//!   bytes, staged through device buffers.
//!
//! Unlike [`super::LocalGroup`], a rank that fails between two exchanges does not make the others'
//! exchanges fail: they would wait in NCCL. [`super::run_ranks`] therefore aborts the other
//! ranks' communicators ([`Collective::abort`]: `ncclCommAbort`) as soon as one rank fails.

use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::cudarc::nccl::{group_end, group_start, Comm, NcclType};
use candle_core::cuda_backend::WrapErr;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Shape, Storage, Tensor};
use half::bf16;

use super::Collective;

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("NCCL {what}: {e:?}"))
}

/// One rank of an NCCL group (see the module doc).
pub struct NcclRank {
    /// None once aborted.
    comm: Mutex<Option<Comm>>,
    rank: usize,
    world: usize,
    device: CudaDevice,
}

// SAFETY: an NCCL communicator may be used from any thread as long as its calls do not overlap;
// every call goes through the mutex. The stream and device handles are thread-safe.
unsafe impl Send for NcclRank {}
unsafe impl Sync for NcclRank {}

impl std::fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclRank {{ rank: {}, world: {} }}", self.rank, self.world)
    }
}

impl NcclRank {
    /// The ranks of a new group, rank r on `devices[r]` (distinct CUDA devices: NCCL runs one rank
    /// per GPU), in rank order.
    pub fn group(devices: &[Device]) -> Result<Vec<NcclRank>> {
        let cuda: Vec<CudaDevice> = devices.iter().map(|d| d.as_cuda_device().cloned()).collect::<Result<_>>()?;
        let ordinals: Vec<usize> = cuda.iter().map(|d| d.cuda_stream().context().ordinal()).collect();
        for (i, o) in ordinals.iter().enumerate() {
            if ordinals[..i].contains(o) {
                candle_core::bail!("NcclRank::group: GPU {o} is given twice ({ordinals:?}); NCCL runs one rank per GPU")
            }
        }
        let streams = cuda.iter().map(|d| d.cuda_stream()).collect();
        let comms = Comm::from_devices(streams).map_err(|e| nccl_err("ncclCommInitAll", e))?;
        let world = comms.len();
        Ok(comms.into_iter().zip(cuda).enumerate().map(|(rank, (comm, device))| NcclRank { comm: Mutex::new(Some(comm)), rank, world, device }).collect())
    }

    fn stream(&self) -> std::sync::Arc<CudaStream> {
        self.device.cuda_stream()
    }

    /// Sends `send[d]` to rank d and receives `recv[s]` from rank s, as one NCCL group; the
    /// buffers of `send_n[d]` / `recv_n[s]` = 0 elements (placeholders of one) are skipped.
    fn exchange<T: NcclType + DeviceRepr, S: DevicePtr<T>>(&self, send: &[S], send_n: &[usize], recv: &mut [CudaSlice<T>], recv_n: &[usize]) -> Result<()> {
        let guard = self.comm.lock().map_err(|_| candle_core::Error::Msg(format!("NcclRank {}: the communicator's lock is poisoned", self.rank)))?;
        let Some(comm) = guard.as_ref() else { candle_core::bail!("NcclRank {}: the group was aborted (another rank failed)", self.rank) };
        group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let mut issued = Ok(());
        for (peer, (s, r)) in send.iter().zip(recv.iter_mut()).enumerate() {
            if send_n[peer] > 0 {
                issued = issued.and_then(|_| comm.send(s, peer as i32).map_err(|e| nccl_err("ncclSend", e)));
            }
            if recv_n[peer] > 0 {
                issued = issued.and_then(|_| comm.recv(r, peer as i32).map(|_| ()).map_err(|e| nccl_err("ncclRecv", e)));
            }
        }
        // The group is ended whatever happened inside it.
        let ended = group_end().map(|_| ()).map_err(|e| nccl_err("ncclGroupEnd", e));
        issued.and(ended)
    }

    /// A device buffer of `n` elements (one where `n` = 0: no zero-size allocation).
    fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream().alloc_zeros::<T>(n.max(1)).w()
    }

    /// Every rank's `u64` for this rank, by source.
    fn counts(&self, mine: &[u64]) -> Result<Vec<u64>> {
        let stream = self.stream();
        let send = mine.iter().map(|&c| stream.clone_htod(&[c]).w()).collect::<Result<Vec<_>>>()?;
        let mut recv = (0..self.world).map(|_| self.alloc::<u64>(1)).collect::<Result<Vec<_>>>()?;
        let ones = vec![1; self.world];
        self.exchange(&send, &ones, &mut recv, &ones)?;
        recv.iter().map(|r| Ok(stream.clone_dtoh(r).w()?[0])).collect()
    }
}

impl Collective for NcclRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    /// Aborts the communicator (`ncclCommAbort`): the rank's pending NCCL work ends, its later
    /// exchanges are errors.
    fn abort(&self) {
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(comm);
    }

    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        if send.len() != self.world {
            candle_core::bail!("all_to_all: {} buffers for {} ranks", send.len(), self.world)
        }
        let lens: Vec<usize> = self.counts(&send.iter().map(|b| b.len() as u64).collect::<Vec<_>>())?.into_iter().map(|n| n as usize).collect();
        let stream = self.stream();
        let send_n: Vec<usize> = send.iter().map(|b| b.len()).collect();
        let dev_send = send.iter().map(|b| if b.is_empty() { self.alloc::<u8>(0) } else { stream.clone_htod(b).w() }).collect::<Result<Vec<_>>>()?;
        let mut recv = lens.iter().map(|&n| self.alloc::<u8>(n)).collect::<Result<Vec<_>>>()?;
        self.exchange(&dev_send, &send_n, &mut recv, &lens)?;
        recv.iter().zip(&lens).map(|(r, &n)| if n == 0 { Ok(Vec::new()) } else { stream.clone_dtoh(r).w() }).collect()
    }

    fn all_to_all_rows(&self, send: Vec<Tensor>, width: usize, device: &Device) -> Result<Vec<Tensor>> {
        if send.len() != self.world {
            candle_core::bail!("all_to_all_rows: {} tensors for {} ranks", send.len(), self.world)
        }
        if !device.same_device(&Device::Cuda(self.device.clone())) {
            candle_core::bail!("all_to_all_rows: rank {} runs on its own GPU, the rows were asked for on {device:?}", self.rank)
        }
        // Each tensor's rows, contiguous on this rank's device, sent from where they lie.
        let mut rows = Vec::with_capacity(send.len());
        for t in &send {
            let (_, w) = t.dims2()?;
            if w != width || t.dtype() != DType::BF16 {
                candle_core::bail!("all_to_all_rows: a {:?} {:?} tensor where [n, {width}] bf16 rows were expected", t.dtype(), t.shape())
            }
            rows.push(t.to_device(device)?.contiguous()?);
        }
        let counts: Vec<u64> = rows.iter().map(|t| t.dim(0).map(|n| n as u64)).collect::<Result<_>>()?;
        let stored: Vec<_> = rows.iter().map(|t| t.storage_and_layout()).collect();
        let mut bufs = Vec::with_capacity(stored.len());
        for ((storage, layout), &n) in stored.iter().zip(&counts) {
            let Storage::Cuda(cs) = &**storage else { candle_core::bail!("all_to_all_rows: rows not on the GPU") };
            let start = layout.start_offset();
            bufs.push(cs.as_cuda_slice::<bf16>()?.slice(start..start + n as usize * width));
        }
        let got: Vec<usize> = self.counts(&counts)?.into_iter().map(|n| n as usize).collect();
        let send_n: Vec<usize> = counts.iter().map(|&n| n as usize * width).collect();
        let recv_n: Vec<usize> = got.iter().map(|&n| n * width).collect();
        let mut recv = recv_n.iter().map(|&n| self.alloc::<bf16>(n)).collect::<Result<Vec<_>>>()?;
        self.exchange(&bufs, &send_n, &mut recv, &recv_n)?;
        recv.into_iter()
            .zip(got)
            .map(|(r, n)| {
                let storage = CudaStorage::wrap_cuda_slice(r, self.device.clone());
                Ok(Tensor::from_storage(Storage::Cuda(storage), Shape::from((n, width)), BackpropOp::none(), false))
            })
            .collect()
    }
}
