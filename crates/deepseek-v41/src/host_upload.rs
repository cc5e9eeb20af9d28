//! [`HostUpload`]: the integer rows a decode step writes from the host into its device tensors
//! every step (the token and Engram ids of `model::ModelDecodeStep`, the positions, slots and
//! page-table rows of `attention::DecodeStepInputs`). On a CUDA device they go through a reused
//! page-locked buffer with one asynchronous copy straight into the tensor
//! (`cuda::PinnedStaging::copy_into`); on the CPU, and where page-locked memory cannot be
//! allocated, through `Tensor::slice_set` of a fresh tensor (what every call did before: a
//! pageable copy the host waits for, then a device-side copy).

use candle_core::{Result, Tensor, WithDType};

/// Element types [`HostUpload::write`] copies as raw bytes.
pub(crate) trait Plain: WithDType {}
impl Plain for u32 {}
impl Plain for i64 {}

/// A reusable host → device writer for one tensor's per-step rows (see the module doc). Two
/// staging buffers used in turn: a write waits only for the copy of the write before the last
/// one to have read its buffer, not for the last (still queued behind the step in flight).
#[derive(Default)]
pub(crate) struct HostUpload {
    #[cfg(feature = "cuda")]
    staging: std::sync::Mutex<(usize, [Option<crate::cuda::PinnedStaging>; 2])>,
}

impl std::fmt::Debug for HostUpload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostUpload").finish_non_exhaustive()
    }
}

impl Clone for HostUpload {
    /// A fresh writer (the staging buffer is per writer).
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl HostUpload {
    /// Writes `host` into the first `host.len()` elements of the rank-1 tensor `dst` (same
    /// dtype), ordered on `dst`'s device like any op enqueued after it.
    pub(crate) fn write<T: Plain>(&self, dst: &Tensor, host: &[T]) -> Result<()> {
        if dst.rank() != 1 || dst.dtype() != T::DTYPE || host.len() > dst.elem_count() {
            candle_core::bail!("HostUpload: {} {:?} values into a {:?} {:?} tensor (rank 1, same dtype, long enough)", host.len(), T::DTYPE, dst.dtype(), dst.shape())
        }
        #[cfg(feature = "cuda")]
        if let (candle_core::Device::Cuda(dev), true) = (dst.device(), dst.is_contiguous()) {
            // SAFETY: u32 / i64 (`Plain`) have no padding and any bit pattern is a valid byte.
            let bytes = unsafe { std::slice::from_raw_parts(host.as_ptr() as *const u8, std::mem::size_of_val(host)) };
            let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            let (turn, buffers) = &mut *staging;
            *turn ^= 1;
            let st = buffers[*turn].get_or_insert_with(|| crate::cuda::PinnedStaging::new(dev));
            if st.fill(bytes.len(), |b| {
                b.copy_from_slice(bytes);
                Ok(())
            })
            .is_ok()
            {
                return st.copy_into(dst, bytes.len());
            }
        }
        dst.slice_set(&Tensor::from_slice(host, host.len(), dst.device())?, 0, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// On the CPU: the values land at the front, the rest is kept; a wrong dtype, rank or length
    /// is an error naming them.
    #[test]
    fn writes_the_front_of_the_tensor() -> Result<()> {
        let dst = Tensor::new(&[9u32, 9, 9, 9], &Device::Cpu)?;
        let up = HostUpload::default();
        up.write(&dst, &[1u32, 2])?;
        assert_eq!(dst.to_vec1::<u32>()?, [1, 2, 9, 9]);
        up.write(&dst, &[5u32, 6, 7, 8])?;
        assert_eq!(dst.to_vec1::<u32>()?, [5, 6, 7, 8]);
        assert!(up.write(&dst, &[1i64]).unwrap_err().to_string().contains("I64"));
        assert!(up.write(&dst, &[1u32; 5]).is_err());
        assert!(up.write(&Tensor::zeros((2, 2), DType::U32, &Device::Cpu)?, &[1u32]).is_err());
        Ok(())
    }
}
