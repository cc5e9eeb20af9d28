//! A step's device work captured once into a CUDA graph and replayed (`docs/architecture.md`,
//! "The whole-model decode step"): what the batched decode steps need to be replayed instead of
//! launched op by op from the host.
//!
//! The captured closure must launch the same kernels with the same arguments every time and read
//! nothing back to the host; its inputs live in device tensors the caller rewrites in place
//! between replays (`attention::DecodeStepInputs::update`, `model::ModelDecodeStep::update`,
//! `sampling::SamplingBatch::set_steps`), and its outputs are copied into fixed tensors inside the
//! capture. Candle uploads small shape descriptors from the host per op; around the warm-up and
//! the capture its host-upload cache is on, so the captured copies read buffers that stay alive
//! and unchanged.

use candle_core::cuda_backend::cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::cuda_backend::WrapErr;
use candle_core::{Device, Result};

/// A captured step (see the module docs).
pub struct StepGraph {
    graph: CudaGraph,
    nodes: usize,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraph").field("nodes", &self.nodes).finish()
    }
}

impl StepGraph {
    /// Runs `step` once on `device`'s stream (the warm-up: kernels loaded, the host-upload cache
    /// filled), then captures a second call into a graph (relaxed capture mode) and instantiates
    /// it. The warm-up and the captured call both take effect, like two eager calls: call it
    /// where a repeated step changes nothing (the batched decode steps at unchanged inputs).
    /// Errors when `device` is not CUDA, when `step` fails (the capture is ended first, so the
    /// stream stays usable), or when the driver refuses the graph.
    pub fn capture(device: &Device, mut step: impl FnMut() -> Result<()>) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            candle_core::bail!("StepGraph::capture needs a CUDA device, got {device:?}")
        };
        let stream = cuda.cuda_stream();
        let _uploads = cuda.enable_cuda_graph_htod_cache();
        step()?;
        stream.synchronize().w()?;
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).w()?;
        let captured = step();
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        captured.map_err(|e| e.context("StepGraph::capture: the step failed during the capture"))?;
        let Some(graph) = graph.w()? else {
            candle_core::bail!("StepGraph::capture: the capture recorded no work (the step launched nothing)")
        };
        let mut nodes = 0usize;
        // SAFETY: `graph` is alive; a null node array asks for the count only.
        unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes) }.result().w()?;
        graph.upload().w()?;
        Ok(Self { graph, nodes })
    }

    /// Enqueues one replay on the stream it was captured on (asynchronous).
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().w()
    }

    /// Nodes of the graph (kernels, copies, memsets).
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The graph's nodes by what they run, most frequent first: each kernel by its (mangled)
    /// function name, other nodes by their type (`memcpy`, `memset`, ...). What a step's fusion
    /// work starts from (`bench_model_decode --graph --census`).
    pub fn census(&self) -> Result<Vec<(String, usize)>> {
        graph_census(&self.graph)
    }
}

/// The nodes of a captured graph by what they run, most frequent first (see
/// [`StepGraph::census`]); for graphs captured by other code (the benchmarks' timers).
pub fn graph_census(graph: &CudaGraph) -> Result<Vec<(String, usize)>> {
    let graph = graph.cu_graph();
    let mut n = 0usize;
    // SAFETY: `graph` is alive; a null node array asks for the count only.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }.result().w()?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `graph` is alive; `nodes` has room for `n` handles.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }.result().w()?;
    nodes.truncate(n);
    let mut counts: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for node in nodes {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to the live graph.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }.result().w()?;
        let name = match kind {
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => kernel_name(node)?,
            other => format!("{other:?}").trim_start_matches("CU_GRAPH_NODE_TYPE_").to_lowercase(),
        };
        *counts.entry(name).or_default() += 1;
    }
    let mut counts: Vec<(String, usize)> = counts.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(counts)
}

/// The function name of a kernel node (`?` where the driver gives none).
fn kernel_name(node: sys::CUgraphNode) -> Result<String> {
    // SAFETY: the params struct is plain data the driver fills; `node` is a kernel node.
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS_v2 = unsafe { std::mem::zeroed() };
    unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) }.result().w()?;
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `func` / `kern` come from the driver; a null name pointer is handled below.
    let got = if !params.func.is_null() {
        unsafe { sys::cuFuncGetName(&mut name, params.func) }
    } else if !params.kern.is_null() {
        unsafe { sys::cuKernelGetName(&mut name, params.kern) }
    } else {
        return Ok("?".into());
    };
    if got != sys::CUresult::CUDA_SUCCESS || name.is_null() {
        return Ok("?".into());
    }
    // SAFETY: the driver returns a NUL-terminated string it owns.
    Ok(unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned())
}
