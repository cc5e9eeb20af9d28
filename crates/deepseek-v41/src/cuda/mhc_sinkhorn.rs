//! The mHC coefficient split on the GPU (`kernels/mhc_sinkhorn.cu`, spec §3.2 steps 2–8): one
//! launch per call instead of the ~130 tiny Candle kernels of [`crate::model::split_sinkhorn`]'s
//! op sequence, with bit-identical results to that sequence on a CUDA device
//! (`tests/cuda_layer.rs`). [`crate::model::split_sinkhorn`] calls it for CUDA tensors.

use candle_core::cuda_backend::cudarc::driver::{CudaStream, SyncOnDrop};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CudaStorage, DType, Layout, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi;

/// Largest `hc` the kernel takes (`DSV41_MHC_MAX_HC`).
pub const MHC_MAX_HC: usize = 8;

/// `(pre [T, hc], post [T, hc], comb [T, hc, hc])`, all f32 on the mixes' CUDA device, from the
/// rsqrt-scaled raw mixes `mixes` `[T, (2+hc)·hc]`, `scale` `[3]` and `base` `[(2+hc)·hc]` (any
/// float dtype, converted to f32), with `iters` Sinkhorn iterations and `eps` inside every
/// division — [`crate::model::split_sinkhorn`]'s semantics. `hc` must be 1..=[`MHC_MAX_HC`].
pub fn split_sinkhorn_device(mixes: &Tensor, scale: &Tensor, base: &Tensor, hc: usize, iters: usize, eps: f64) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "split_sinkhorn_device";
    let (t, width) = mixes.dims2()?;
    if !(1..=MHC_MAX_HC).contains(&hc) || width != (2 + hc) * hc || iters == 0 || iters > i32::MAX as usize {
        candle_core::bail!("{op}: mixes {:?} with hc {hc} (1..={MHC_MAX_HC}, width (2+hc)·hc) and iters {iters} (>= 1)", mixes.shape())
    }
    if scale.dims1()? != 3 || base.dims1()? != width {
        candle_core::bail!("{op}: scale {:?} (want [3]) and base {:?} (want [{width}])", scale.shape(), base.shape())
    }
    let dev = mixes.device();
    if t == 0 {
        return SplitOutputs::empty(dev, hc);
    }
    let f32c = |x: &Tensor| -> Result<Tensor> { x.to_device(dev)?.to_dtype(DType::F32)?.contiguous() };
    let (mixes, scale, base) = (f32c(mixes)?, f32c(scale)?, f32c(base)?);
    let (ms, ml) = mixes.storage_and_layout();
    let (ss, sl) = scale.storage_and_layout();
    let (bs, bl) = base.storage_and_layout();
    let (mc, sc, bc) = (as_cuda(&ms, "mixes")?, as_cuda(&ss, "scale")?, as_cuda(&bs, "base")?);
    let stream = stream_for(mc)?;
    let mut outs = SplitOutputs::new(&mc.device, t, hc)?;
    {
        let (m_p, _g0) = read_ptr::<f32>(mc, ml, &stream)?;
        let (s_p, _g1) = read_ptr::<f32>(sc, sl, &stream)?;
        let (b_p, _g2) = read_ptr::<f32>(bc, bl, &stream)?;
        let ([pre_p, post_p, comb_p], _gw) = outs.write_ptrs(&stream)?;
        let params = ffi::MhcSplitParams {
            mixes: m_p,
            scale: s_p,
            base: b_p,
            pre: pre_p,
            post: post_p,
            comb: comb_p,
            tokens: t as i64,
            hc: hc as i32,
            iters: iters as i32,
            eps: eps as f32,
        };
        // SAFETY: inputs are read-locked, contiguous f32 of the checked shapes; outputs are fresh
        // allocations of T·hc / T·hc² f32; the launcher checks counts and pointers; the guards
        // order the launch on the storages' stream.
        let code = unsafe { ffi::dsv41_mhc_split_sinkhorn(&params, std::mem::size_of::<ffi::MhcSplitParams>(), raw_stream(&stream)) };
        ffi::check_status(op, code)?;
    }
    drop((ms, ss, bs));
    Ok(outs.tensors())
}

/// The split's three f32 outputs for `t > 0` tokens of `hc` copies, uninitialized (the kernels
/// write every element): pre `[t, hc]`, post `[t, hc]`, comb `[t, hc, hc]`. Shared by
/// [`split_sinkhorn_device`] and `mhc_mixes_device`.
pub(super) struct SplitOutputs {
    pre: CudaStorage,
    post: CudaStorage,
    comb: CudaStorage,
    t: usize,
    hc: usize,
}

impl SplitOutputs {
    pub(super) fn new(dev: &CudaDevice, t: usize, hc: usize) -> Result<Self> {
        // SAFETY: the kernel that follows writes every element (t > 0, callers' contract).
        let alloc = |n: usize| -> Result<CudaStorage> { Ok(CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(n)? }, dev.clone())) };
        Ok(Self { pre: alloc(t * hc)?, post: alloc(t * hc)?, comb: alloc(t * hc * hc)?, t, hc })
    }

    /// The outputs' write pointers (pre, post, comb) and their guards on `stream`.
    pub(super) fn write_ptrs<'a>(&'a mut self, stream: &'a CudaStream) -> Result<([*mut f32; 3], [SyncOnDrop<'a>; 3])> {
        let (row, mat) = (Layout::contiguous((self.t, self.hc)), Layout::contiguous((self.t, self.hc, self.hc)));
        let (pre, g0) = write_ptr::<f32>(&mut self.pre, &row, stream)?;
        let (post, g1) = write_ptr::<f32>(&mut self.post, &row, stream)?;
        let (comb, g2) = write_ptr::<f32>(&mut self.comb, &mat, stream)?;
        Ok(([pre, post, comb], [g0, g1, g2]))
    }

    /// `(pre, post, comb)` as tensors.
    pub(super) fn tensors(self) -> (Tensor, Tensor, Tensor) {
        let (t, hc) = (self.t, self.hc);
        (cuda_tensor(self.pre, (t, hc)), cuda_tensor(self.post, (t, hc)), cuda_tensor(self.comb, (t, hc, hc)))
    }

    /// The outputs of zero tokens.
    pub(super) fn empty(dev: &candle_core::Device, hc: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, dev);
        Ok((z(&[0, hc])?, z(&[0, hc])?, z(&[0, hc, hc])?))
    }
}

