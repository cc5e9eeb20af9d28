//! Shared harness of the CUDA benchmark examples (include it with
//! `#[path = "support/bench.rs"] mod bench;`; `examples/support/` holds no example of its own).
//!
//! * [`Timer::calls`]: CUDA events around `iters` back-to-back calls of a closure on the stream,
//!   after a warm-up; the median over repetitions, per call. A call's time includes its host-side
//!   work whenever the host is the bottleneck (small decode batches), as an application sees it.
//! * [`Timer::graph`]: the same calls captured once into a CUDA graph and the graph replayed:
//!   GPU time only (the launch overhead of the individual calls is gone; what remains is the
//!   kernels' own time plus the short gaps between graph nodes).
//! * [`CopyRef`]: a device-to-device `cuMemcpyAsync` of a given number of bytes, timed the same
//!   way: the in-run reference of what plain copying achieves on this card.
//! * [`rotation_sets`]: how many independent buffer sets to cycle through so that a benchmark's
//!   working set exceeds the L2 cache (a call then reads its inputs from and writes its outputs
//!   to HBM, as in a real step, instead of hitting data the previous call left in L2).
//! * Bandwidth: [`gbps`] counts the bytes that a call reads plus the bytes it writes; the tables
//!   compare them with [`HBM_READ_GBPS`] (the H200's measured read ceiling) and with the copy;
//!   [`tflops`] against [`BF16_TFLOPS`].
//! * [`BenchArgs`]: the `--reps`, `--warmup`, `--rep-ms`, `--no-baseline` options (flatten them
//!   into a bench's clap arguments; [`parse_args`] sets the bench's own defaults), [`BenchArgs::timer`].
//! * [`cuda_device`]: CUDA device 0 and candle's stream on it.
//! * [`PoolPeak`]: the high-water mark of the device memory pool candle allocates from (a peak
//!   that includes transient buffers inside a call, unlike sampling `total − free` between calls).
//! * [`timed`], [`eager_ms`]: one call alone between two events and a synchronization (the host
//!   clock on the CPU), and the median of such calls.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys::{
    self as cu, CUdevice_attribute, CUevent_flags, CUgraphInstantiate_flags, CUmemPool_attribute, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::Device;

/// Measured HBM read ceiling of the H200 (GB/s).
pub const HBM_READ_GBPS: f64 = 4170.0;
/// Dense bf16 tensor-core ceiling of the H200 (TFLOP/s).
pub const BF16_TFLOPS: f64 = 790.0;

/// GB/s of `bytes` moved (read + written) in `ms` milliseconds.
pub fn gbps(bytes: f64, ms: f64) -> f64 {
    bytes / (ms * 1e-3) / 1e9
}

/// TFLOP/s of `flops` floating-point operations in `ms` milliseconds.
pub fn tflops(flops: f64, ms: f64) -> f64 {
    flops / (ms * 1e-3) / 1e12
}

/// The median of `v` (the upper one of an even count; NaN when `v` is empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// CUDA device 0 and candle's stream on it (`bench` names the benchmark in the error).
pub fn cuda_device(bench: &str) -> Result<(Device, Arc<CudaStream>)> {
    let dev = Device::new_cuda(0).with_context(|| format!("{bench} needs a CUDA device"))?;
    let stream = match &dev {
        Device::Cuda(c) => c.cuda_stream(),
        _ => anyhow::bail!("{bench}: Device::new_cuda returned a non-CUDA device"),
    };
    Ok((dev, stream))
}

/// The options shared by the benchmarks (`#[command(flatten)]` them into a bench's arguments;
/// the timing defaults below are overridden per bench by [`parse_args`]).
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 9)]
    pub reps: usize,
    /// Warm-up calls before timing.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Target time of one repetition in milliseconds (sets the calls per repetition).
    #[arg(long, default_value_t = 3.0)]
    pub rep_ms: f64,
    /// Skip the plain-Candle baseline.
    #[arg(long)]
    pub no_baseline: bool,
}

impl BenchArgs {
    /// A [`Timer`] on `stream` with these options.
    pub fn timer(&self, stream: Arc<CudaStream>) -> Timer {
        Timer { stream, warmup: self.warmup, reps: self.reps, rep_ms: self.rep_ms }
    }
}

/// Parses the command line into `A`, with the bench's own defaults of the flattened
/// [`BenchArgs`]: `defaults` pairs an argument id (`"reps"`, `"warmup"`, `"rep_ms"`) with its
/// default value.
pub fn parse_args<A: clap::Parser>(defaults: &[(&'static str, &'static str)]) -> A {
    let mut cmd = A::command();
    for &(id, value) in defaults {
        cmd = cmd.mut_arg(id, |a| a.default_value(value));
    }
    let matches = cmd.get_matches();
    A::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// CUDA-event timing on one stream.
pub struct Timer {
    pub stream: Arc<CudaStream>,
    /// Calls before timing (at least 1).
    pub warmup: usize,
    /// Repetitions; the median is reported.
    pub reps: usize,
    /// Target duration of one repetition in milliseconds (sets the calls per repetition).
    pub rep_ms: f64,
}

impl Timer {
    /// Median milliseconds per call of back-to-back calls of `f`.
    pub fn calls(&self, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        for _ in 0..self.warmup.max(1) {
            f()?;
        }
        self.stream.synchronize()?;
        let probe = self.span(3, &mut f)?;
        let iters = ((self.rep_ms / probe.max(1e-4)) as usize).clamp(3, 5000);
        self.median((0..self.reps.max(1)).map(|_| self.span(iters, &mut f)))
    }

    /// Median milliseconds per call of `f`, replayed from a CUDA graph holding `calls_per_graph`
    /// consecutive calls (capture mode relaxed; `f` must only enqueue work on the stream: no
    /// synchronization, no host reads). The graph is replayed enough times per repetition to
    /// last about `rep_ms`.
    pub fn graph(&self, calls_per_graph: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        let n = calls_per_graph.max(1);
        f()?; // first call outside the capture (lazy initialisation, module loading)
        self.stream.synchronize()?;
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let captured: Result<()> = (0..n).try_for_each(|_| f());
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        captured.context("a call failed during graph capture")?;
        let graph = graph?.context("graph capture returned no graph")?;
        graph.upload()?;
        let mut replay = || -> Result<()> { Ok(graph.launch()?) };
        for _ in 0..self.warmup.max(1) {
            replay()?;
        }
        self.stream.synchronize()?;
        let probe = self.span(2, &mut replay)?;
        let iters = ((self.rep_ms / probe.max(1e-4)) as usize).clamp(2, 2000);
        let per_graph = self.median((0..self.reps.max(1)).map(|_| self.span(iters, &mut replay)))?;
        Ok(per_graph / n as f64)
    }

    /// The nodes of one call of `f` captured into a CUDA graph, by kernel, most frequent first
    /// (`deepseek_v41::cuda::graph_census`; after one call outside the capture).
    pub fn census(&self, mut f: impl FnMut() -> Result<()>) -> Result<Vec<(String, usize)>> {
        f()?;
        self.stream.synchronize()?;
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let captured = f();
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        captured.context("a call failed during graph capture")?;
        let graph = graph?.context("graph capture returned no graph")?;
        Ok(deepseek_v41::cuda::graph_census(&graph)?)
    }

    /// Milliseconds per call of `iters` back-to-back calls, from two events.
    fn span(&self, iters: usize, f: &mut impl FnMut() -> Result<()>) -> Result<f64> {
        let start = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..iters {
            f()?;
        }
        let end = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        Ok(start.elapsed_ms(&end)? as f64 / iters as f64)
    }

    fn median(&self, samples: impl Iterator<Item = Result<f64>>) -> Result<f64> {
        Ok(median(samples.collect::<Result<_>>()?))
    }
}

/// The device's L2 cache size in bytes.
pub fn l2_bytes(stream: &CudaStream) -> Result<usize> {
    Ok(stream.context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize)
}

/// Number of buffer sets of `bytes_per_set` bytes to rotate through so that the sets together
/// hold at least 4x the L2 cache (at most `max_sets`, at least 1).
pub fn rotation_sets(bytes_per_set: usize, l2: usize, max_sets: usize) -> usize {
    (4 * l2).div_ceil(bytes_per_set.max(1)).clamp(1, max_sets.max(1))
}

/// A device-to-device copy reference: `bytes` copied per call, cycling through enough source /
/// destination regions to defeat the L2 cache.
pub struct CopyRef {
    src: CudaSlice<u8>,
    dst: CudaSlice<u8>,
    bytes: usize,
    sets: usize,
}

impl CopyRef {
    /// Buffers for copies of `bytes` bytes (rounded up to 256).
    pub fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self> {
        let bytes = bytes.div_ceil(256).max(1) * 256;
        let sets = rotation_sets(2 * bytes, l2_bytes(stream)?, 64);
        let src = stream.alloc_zeros::<u8>(bytes * sets)?;
        let dst = stream.alloc_zeros::<u8>(bytes * sets)?;
        Ok(Self { src, dst, bytes, sets })
    }

    /// Bytes moved per copy: read + written.
    pub fn moved_bytes(&self) -> f64 {
        2.0 * self.bytes as f64
    }

    /// Median milliseconds per copy (graph replay of one copy per buffer set).
    pub fn time(&mut self, timer: &Timer) -> Result<f64> {
        let stream = timer.stream.clone();
        let (bytes, sets) = (self.bytes, self.sets);
        let (src, dst) = (&self.src, &mut self.dst);
        let mut i = 0usize;
        timer.graph(sets, || {
            let k = i % sets;
            i += 1;
            let from = src.slice(k * bytes..(k + 1) * bytes);
            let mut to = dst.slice_mut(k * bytes..(k + 1) * bytes);
            Ok(stream.memcpy_dtod(&from, &mut to)?)
        })
    }
}

/// The high-water mark of CUDA device 0's current memory pool.
///
/// Candle's CUDA backend (cudarc) allocates every tensor with `cuMemAllocAsync` from the device's
/// current memory pool when the device supports pools (the H200 does; [`PoolPeak::new`] fails
/// otherwise), so the pool's `USED_MEM_HIGH` attribute is the peak of the bytes held by tensors —
/// transient buffers freed inside a call included — without the CUDA context or cuBLAS
/// workspaces (allocated outside the pool). [`PoolPeak::reset`] restarts the mark at the bytes in
/// use now.
pub struct PoolPeak {
    pool: cu::CUmemoryPool,
}

impl PoolPeak {
    /// The current pool of device 0 (`stream` proves the context is current and pools work).
    pub fn new(stream: &CudaStream) -> Result<Self> {
        let ctx = stream.context();
        ctx.bind_to_thread()?;
        if ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? == 0 {
            anyhow::bail!("PoolPeak: device {} has no memory pools (candle then allocates outside any pool)", ctx.ordinal())
        }
        let mut pool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer; `cu_device` is the context's device handle.
        unsafe { cu::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) }.result()?;
        Ok(Self { pool })
    }

    fn attribute(&self, attr: CUmemPool_attribute) -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: the USED_MEM_* attributes are cuuint64_t values; `v` outlives the call.
        unsafe { cu::cuMemPoolGetAttribute(self.pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void) }.result()?;
        Ok(v)
    }

    /// Bytes held by allocations from the pool now.
    pub fn used(&self) -> Result<u64> {
        self.attribute(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// The most bytes held at once since the last [`PoolPeak::reset`] (or since the pool was
    /// created). Synchronize the stream first so that every enqueued allocation has happened.
    pub fn peak(&self) -> Result<u64> {
        self.attribute(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    /// Restarts the high-water mark at the bytes in use now.
    pub fn reset(&self) -> Result<()> {
        let mut zero = 0u64;
        // SAFETY: setting USED_MEM_HIGH to 0 resets it to the current use (CUDA driver API).
        unsafe { cu::cuMemPoolSetAttribute(self.pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut zero as *mut u64 as *mut std::ffi::c_void) }.result()?;
        Ok(())
    }
}

/// `bytes` in GiB.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Milliseconds of one call of `f`: between two events and a synchronization on CUDA, the host
/// clock on the CPU.
pub fn timed(stream: Option<&CudaStream>, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let Some(s) = stream else {
        let t = Instant::now();
        f()?;
        return Ok(t.elapsed().as_secs_f64() * 1e3);
    };
    s.synchronize()?;
    let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    f()?;
    let e = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    s.synchronize()?;
    Ok(a.elapsed_ms(&e)? as f64)
}

/// Median milliseconds of `f` over `reps` calls timed one by one ([`timed`]), after one
/// warm-up call: eager work whose calls cannot overlap (host reads, long prefill calls).
pub fn eager_ms(stream: Option<&CudaStream>, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let v = (0..reps.max(1)).map(|_| timed(stream, &mut f)).collect::<Result<Vec<_>>>()?;
    Ok(median(v))
}
