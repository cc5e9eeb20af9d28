//! The batched decode step's position-derived inputs on the GPU (`kernels/step_inputs.cu`):
//! [`crate::attention::DecodeStepInputs::derive`] in one launch instead of ~16 Candle kernels per
//! inputs object (~27 for a kv source's), bit for bit those ops on a CUDA device
//! (`tests/cuda_decoder_ops.rs`). The outputs are the inputs object's fixed tensors, written in
//! place: each is locked for writing through candle's in-place op API while the kernel is
//! enqueued (nested [`InplaceOp1`] calls, one per output).

use std::cell::RefCell;
use std::ffi::c_void;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, Layout, Result, Tensor};

use super::device::{as_cuda, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi::check_status;

/// `Dsv41StepInputsParams` of `kernels/include/dsv41_step_inputs.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct StepInputsParams {
    positions: *const i64,
    entry_positions: *const i64,
    entry_slots: *const i64,
    visible_in: *const i64,
    inv_freq: *const f32,
    cos: *mut f32,
    sin: *mut f32,
    neg_sin: *mut f32,
    window_indices: *mut i64,
    entry_cos: *mut f32,
    entry_sin: *mut f32,
    closing: *mut u8,
    visible: *mut u32,
    rows: i64,
    window_stride: i64,
    half: i32,
    window: i32,
}

extern "C" {
    fn dsv41_step_inputs(p: *const StepInputsParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// The integer rows a compressed layer's inputs derive from, and where its derived rows go.
#[derive(Debug, Clone, Copy)]
pub struct EntryRows<'a> {
    /// `[rows]` i64: the closing entry's position.
    pub positions: &'a Tensor,
    /// `[rows]` i64: its pool slot, < 0 where no group closes.
    pub slots: &'a Tensor,
    /// `[rows]` i64: the entries each row sees.
    pub visible_in: &'a Tensor,
    /// `[rows, half]` f32 out: RoPE rows at the entry positions.
    pub cos: &'a Tensor,
    /// `[rows, half]` f32 out.
    pub sin: &'a Tensor,
    /// `[rows, 1]` u8 out: slot ≥ 0.
    pub closing: &'a Tensor,
    /// `[rows]` u32 out.
    pub visible: &'a Tensor,
}

/// Writes in place, from `positions` (`[rows]` i64) and the RoPE frequencies `inv_freq`
/// (`[1, half]` f32): `cos`, `sin`, `neg_sin` (`[rows, half]` f32) of `f32(p)·inv_freq`, and
/// `window_indices` (`[rows, window]` i64: the ring slots `(p + 1 + k) mod W + b·window_stride`
/// for `k` in `0 .. W` where `p + 1 + k ≥ W`, else −1); with `entry`, a compressed layer's rows as
/// [`EntryRows`] says. Every tensor on one CUDA device, the outputs contiguous.
#[allow(clippy::too_many_arguments)]
pub fn step_inputs_device(
    positions: &Tensor,
    inv_freq: &Tensor,
    window_stride: usize,
    cos: &Tensor,
    sin: &Tensor,
    neg_sin: &Tensor,
    window_indices: &Tensor,
    entry: Option<EntryRows>,
) -> Result<()> {
    let op = "step_inputs_device";
    let rows = positions.dims1()?;
    let half = inv_freq.elem_count();
    let window = window_indices.dim(1)?;
    let check = |what: &str, t: &Tensor, dtype: DType, dims: &[usize]| -> Result<()> {
        if t.dtype() != dtype || t.elem_count() != dims.iter().product::<usize>() || t.dim(0)? != dims[0] || !t.device().same_device(positions.device()) {
            candle_core::bail!("{op}: {what} must be {dims:?} {dtype:?} on the positions' device, got {:?} {:?}", t.dtype(), t.shape())
        }
        Ok(())
    };
    check("positions", positions, DType::I64, &[rows])?;
    check("inv_freq", inv_freq, DType::F32, &[1, half])?;
    for (what, t) in [("cos", cos), ("sin", sin), ("neg_sin", neg_sin)] {
        check(what, t, DType::F32, &[rows, half])?;
    }
    check("window_indices", window_indices, DType::I64, &[rows, window])?;
    if let Some(e) = &entry {
        for (what, t) in [("entry positions", e.positions), ("entry slots", e.slots), ("visible counts", e.visible_in)] {
            check(what, t, DType::I64, &[rows])?;
        }
        check("entry cos", e.cos, DType::F32, &[rows, half])?;
        check("entry sin", e.sin, DType::F32, &[rows, half])?;
        check("closing", e.closing, DType::U8, &[rows])?;
        check("visible", e.visible, DType::U32, &[rows])?;
    }
    if half > i32::MAX as usize || window == 0 || window > i32::MAX as usize || window_stride < window {
        candle_core::bail!("{op}: half {half}, window {window}, window stride {window_stride} out of range")
    }
    if rows == 0 {
        return Ok(());
    }
    // Inputs: made contiguous and read-locked for the call.
    let mut reads = vec![positions.contiguous()?, inv_freq.contiguous()?];
    if let Some(e) = &entry {
        reads.extend([e.positions.contiguous()?, e.slots.contiguous()?, e.visible_in.contiguous()?]);
    }
    let guards: Vec<_> = reads.iter().map(|t| t.storage_and_layout()).collect();
    let cuda = guards.iter().map(|(s, _)| as_cuda(s, "an input")).collect::<Result<Vec<_>>>()?;
    let stream = stream_for(cuda[0])?;
    let p_pos = read_ptr::<i64>(cuda[0], guards[0].1, &stream)?;
    let p_freq = read_ptr::<f32>(cuda[1], guards[1].1, &stream)?;
    let p_entry = match entry {
        Some(_) => Some((
            read_ptr::<i64>(cuda[2], guards[2].1, &stream)?,
            read_ptr::<i64>(cuda[3], guards[3].1, &stream)?,
            read_ptr::<i64>(cuda[4], guards[4].1, &stream)?,
        )),
        None => None,
    };
    let mut outs = vec![cos, sin, neg_sin, window_indices];
    if let Some(e) = &entry {
        outs.extend([e.cos, e.sin, e.closing, e.visible]);
    }
    let base = StepInputsParams {
        positions: p_pos.0,
        entry_positions: p_entry.as_ref().map_or(std::ptr::null(), |p| p.0 .0),
        entry_slots: p_entry.as_ref().map_or(std::ptr::null(), |p| p.1 .0),
        visible_in: p_entry.as_ref().map_or(std::ptr::null(), |p| p.2 .0),
        inv_freq: p_freq.0,
        cos: std::ptr::null_mut(),
        sin: std::ptr::null_mut(),
        neg_sin: std::ptr::null_mut(),
        window_indices: std::ptr::null_mut(),
        entry_cos: std::ptr::null_mut(),
        entry_sin: std::ptr::null_mut(),
        closing: std::ptr::null_mut(),
        visible: std::ptr::null_mut(),
        rows: rows as i64,
        window_stride: window_stride as i64,
        half: half as i32,
        window: window as i32,
    };
    let launch = move |w: &[*mut c_void], stream: &candle_core::cuda_backend::cudarc::driver::CudaStream| -> Result<()> {
        let mut p = base;
        (p.cos, p.sin, p.neg_sin, p.window_indices) = (w[0].cast(), w[1].cast(), w[2].cast(), w[3].cast());
        if w.len() == 8 {
            (p.entry_cos, p.entry_sin, p.closing, p.visible) = (w[4].cast(), w[5].cast(), w[6].cast(), w[7].cast());
        }
        // SAFETY: the inputs are read-locked contiguous tensors of the checked shapes; the outputs
        // are write-locked, contiguous and checked; the launcher checks counts and pointers; the
        // guards order the launch on the stream.
        let code = unsafe { dsv41_step_inputs(&p, std::mem::size_of::<StepInputsParams>(), raw_stream(stream)) };
        check_status(op, code)
    };
    let ptrs = RefCell::new(Vec::with_capacity(outs.len()));
    let run: RefCell<Option<Launch>> = RefCell::new(Some(Box::new(launch)));
    let (first, rest) = outs.split_first().expect("at least four outputs");
    first.inplace_op1(&Nest { rest, ptrs: &ptrs, run: &run })?;
    drop((p_pos, p_freq, p_entry));
    drop(guards);
    Ok(())
}

type Launch<'a> = Box<dyn FnOnce(&[*mut c_void], &candle_core::cuda_backend::cudarc::driver::CudaStream) -> Result<()> + 'a>;

/// One output of [`step_inputs_device`] write-locked; the next output nested inside, the launch
/// in the innermost (so every output's lock and stream guard lives until it is enqueued).
struct Nest<'a, 'l> {
    rest: &'a [&'a Tensor],
    ptrs: &'a RefCell<Vec<*mut c_void>>,
    run: &'a RefCell<Option<Launch<'l>>>,
}

impl InplaceOp1 for Nest<'_, '_> {
    fn name(&self) -> &'static str {
        "step_inputs"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("step_inputs_device: the tensors must be on a CUDA device")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        if !l.is_contiguous() {
            candle_core::bail!("step_inputs_device: an output is not contiguous ({:?})", l.shape())
        }
        let stream = stream_for(s)?;
        let (ptr, _guard) = match s.dtype() {
            DType::F32 => write_ptr::<f32>(s, l, &stream).map(|(p, g)| (p.cast::<c_void>(), g))?,
            DType::I64 => write_ptr::<i64>(s, l, &stream).map(|(p, g)| (p.cast::<c_void>(), g))?,
            DType::U8 => write_ptr::<u8>(s, l, &stream).map(|(p, g)| (p.cast::<c_void>(), g))?,
            DType::U32 => write_ptr::<u32>(s, l, &stream).map(|(p, g)| (p.cast::<c_void>(), g))?,
            other => candle_core::bail!("step_inputs_device: an output of dtype {other:?}"),
        };
        self.ptrs.borrow_mut().push(ptr);
        match self.rest.split_first() {
            Some((next, rest)) => next.inplace_op1(&Nest { rest, ptrs: self.ptrs, run: self.run }),
            None => {
                let Some(launch) = self.run.borrow_mut().take() else { candle_core::bail!("step_inputs_device: launched twice") };
                let ptrs = self.ptrs.borrow().clone();
                launch(&ptrs, &stream)
            }
        }
    }
}
