//! The whole-model decode step captured once into a CUDA graph and replayed per step (feature
//! `cuda`; `docs/architecture.md`, "The whole-model decode step"): a [`ModelDecodeStep`] and a
//! device [`SamplingBatch`], with the logits and sampled ids copied into fixed tensors inside the
//! graph. A step is `update` (tokens, Engram ids, positions: one host→device copy each), the
//! sampling table's steps (one copy), one graph launch, and — for [`GraphedDecodeStep::step_ids`]
//! — the B ids read back.
//!
//! The graph stays valid while the step's tensors do: [`GraphedDecodeStep::step_mut`] gives the
//! step for `load` (a sequence copied into its region), which writes the same pools.

use candle_core::{DType, Result, Tensor};

use super::decode_step::ModelDecodeStep;
use crate::cuda::StepGraph;
use crate::sampling::SamplingBatch;

/// A [`ModelDecodeStep`] replayed from a CUDA graph (see the module docs).
#[derive(Debug)]
pub struct GraphedDecodeStep<'m> {
    step: ModelDecodeStep<'m>,
    sampling: SamplingBatch,
    /// `[B, vocab]` f32 and `[B]` u32, written by each replay.
    logits: Tensor,
    ids: Tensor,
    graph: StepGraph,
}

impl<'m> GraphedDecodeStep<'m> {
    /// Runs the first step of `step` at `tokens` / `positions` (one per sequence) with
    /// `sampling` (built on the step's device) and captures it: afterwards [`Self::logits`] and
    /// [`Self::ids`] hold that step's results and the pools its state, as after one eager
    /// `forward_sampled`. Errors when the step would read the device from the host
    /// ([`ModelDecodeStep::host_reads`]), when `sampling` does not have one row per sequence or
    /// is not on the step's device, or as [`ModelDecodeStep::update`] and [`StepGraph::capture`].
    pub fn capture(mut step: ModelDecodeStep<'m>, sampling: SamplingBatch, tokens: &[u32], positions: &[usize]) -> Result<Self> {
        let reads = step.host_reads();
        if !reads.is_empty() {
            candle_core::bail!("GraphedDecodeStep: the step reads the device from the host, so it cannot be captured: {}", reads.join("; "))
        }
        let (b, dev) = (step.batch(), step.device().clone());
        if sampling.len() != b {
            candle_core::bail!("GraphedDecodeStep: the sampling batch has {} rows for {b} sequences: give one per sequence", sampling.len())
        }
        if !sampling.table().device().same_device(&dev) {
            candle_core::bail!("GraphedDecodeStep: build the SamplingBatch on the step's device ({dev:?})")
        }
        step.update(tokens, positions)?;
        let logits = Tensor::zeros((b, step.model().vocab_size()), DType::F32, &dev)?;
        let ids = Tensor::zeros(b, DType::U32, &dev)?;
        let graph = StepGraph::capture(&dev, || {
            let (l, i) = step.forward_sampled(&sampling)?;
            logits.slice_set(&l, 0, 0)?;
            ids.slice_set(&i, 0, 0)
        })?;
        Ok(Self { step, sampling, logits, ids, graph })
    }

    /// One step: the sequences' next `tokens` at `positions` ([`ModelDecodeStep::update`]) with
    /// their sampling steps `sampling_steps` ([`SamplingBatch::set_steps`]), then the replay,
    /// enqueued on the device's stream (read [`Self::logits`] / [`Self::ids`] afterwards).
    /// Errors, before anything is replayed, for inputs `update` or `set_steps` refuses.
    pub fn step(&mut self, tokens: &[u32], positions: &[usize], sampling_steps: &[u64]) -> Result<()> {
        if sampling_steps.len() != self.step.batch() {
            candle_core::bail!("GraphedDecodeStep::step: {} sampling steps for {} sequences", sampling_steps.len(), self.step.batch())
        }
        self.step.update(tokens, positions)?;
        self.sampling.set_steps(sampling_steps)?;
        self.graph.replay()
    }

    /// [`Self::step`] and the sampled ids read back (one id per sequence).
    pub fn step_ids(&mut self, tokens: &[u32], positions: &[usize], sampling_steps: &[u64]) -> Result<Vec<u32>> {
        self.step(tokens, positions, sampling_steps)?;
        self.ids.to_vec1::<u32>()
    }

    /// `[B, vocab]` f32: the logits of the last step.
    pub fn logits(&self) -> &Tensor {
        &self.logits
    }

    /// `[B]` u32: the ids sampled by the last step.
    pub fn ids(&self) -> &Tensor {
        &self.ids
    }

    /// The captured graph (its node count: [`StepGraph::nodes`]).
    pub fn graph(&self) -> &StepGraph {
        &self.graph
    }

    /// The step (its caches, inputs, batch).
    pub fn inner(&self) -> &ModelDecodeStep<'m> {
        &self.step
    }

    /// The step, to load a sequence into a region ([`ModelDecodeStep::load`]) between replays.
    pub fn step_mut(&mut self) -> &mut ModelDecodeStep<'m> {
        &mut self.step
    }
}
