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
}
