//! The whole-model decode step captured once into a CUDA graph and replayed per step (feature
//! `cuda`; `docs/architecture.md`, "The whole-model decode step"): a [`ModelDecodeStep`] and a
//! device [`SamplingBatch`], with the logits and sampled ids copied into fixed tensors inside the
//! graph. A step is `update` (tokens, Engram ids, positions: one host→device copy each), the
//! sampling table's steps (one copy), one graph launch, and — for [`GraphedDecodeStep::step_ids`]
//! — the ids read back.
//!
//! [`GraphedDecodeStep::capture_buckets`] captures one graph per batch-size bucket (1, 2, 4, …,
//! as serving engines do) over the same pools: a step of n sequences replays the smallest bucket
//! of at least n rows, the rows past n idle ([`ModelDecodeStep::update_first`]). Sequences take
//! the lowest rows: start or load a joining sequence in the lowest free row, and release a
//! finished one ([`ModelDecodeStep::release`]; a step refuses to idle a row that holds one).
//!
//! The graphs stay valid while the step's tensors do: [`GraphedDecodeStep::step_mut`] gives the
//! step for `load` (a sequence copied into its region) and `release`, which write the same pools.

use candle_core::{DType, Result, Tensor};

use super::decode_step::ModelDecodeStep;
use crate::attention::DecodeStepError;
use crate::cuda::{PinnedReadback, StepGraph};
use crate::sampling::SamplingBatch;

/// A [`ModelDecodeStep`] replayed from CUDA graphs, one per batch-size bucket (see the module
/// docs).
#[derive(Debug)]
pub struct GraphedDecodeStep<'m> {
    step: ModelDecodeStep<'m>,
    sampling: SamplingBatch,
    /// `[B, vocab]` f32 and `[B]` u32: a replay of bucket b writes their first b rows.
    logits: Tensor,
    ids: Tensor,
    /// `(rows, graph)` by ascending rows.
    graphs: Vec<(usize, StepGraph)>,
    /// Sequences of the last step.
    rows: usize,
    /// The ids of a step, read back by [`Self::step_next_ids`] while the next one runs.
    readback: Option<PinnedReadback>,
}

impl<'m> GraphedDecodeStep<'m> {
    /// Runs the first step of `step` at `tokens` / `positions` (one per sequence) with
    /// `sampling` (built on the step's device) and captures it: afterwards [`Self::logits`] and
    /// [`Self::ids`] hold that step's results and the pools its state, as after one eager
    /// `forward_sampled`. One graph, of the whole batch. Errors when the step would read the
    /// device from the host ([`ModelDecodeStep::host_reads`]), when `sampling` does not have one
    /// row per sequence or is not on the step's device, or as [`ModelDecodeStep::update`] and
    /// [`StepGraph::capture`].
    pub fn capture(mut step: ModelDecodeStep<'m>, sampling: SamplingBatch, tokens: &[u32], positions: &[usize]) -> Result<Self> {
        let (logits, ids) = Self::outputs(&step, &sampling)?;
        step.update(tokens, positions)?;
        let b = step.batch();
        let graph = Self::capture_rows(&step, &sampling, b, &logits, &ids)?;
        Ok(Self { step, sampling, logits, ids, graphs: vec![(b, graph)], rows: b, readback: None })
    }

    /// Captures one graph per bucket of `buckets` (row counts, each at most the batch; empty:
    /// 1, 2, 4, … up to the batch, the batch last) over `step`, whose rows must all be free (no
    /// sequence loaded or stepped yet): each is captured over idle rows, which leaves no
    /// sequence's state in the pools. Then [`Self::step`] of n sequences replays the smallest
    /// bucket of at least n rows. `sampling` has one row per batch row (row s: the settings of
    /// the sequence in row s; [`SamplingBatch::set_sequence`] when another joins). Errors as
    /// [`Self::capture`], for a bucket of 0 rows or past the batch, and for a row in use.
    pub fn capture_buckets(mut step: ModelDecodeStep<'m>, sampling: SamplingBatch, buckets: &[usize]) -> Result<Self> {
        let (logits, ids) = Self::outputs(&step, &sampling)?;
        let b = step.batch();
        if let Some(row) = (0..b).find(|&r| step.is_live(r)) {
            candle_core::bail!("GraphedDecodeStep::capture_buckets: row {row} holds a sequence; capture the buckets before loading or stepping any")
        }
        let mut sizes: Vec<usize> = if buckets.is_empty() {
            std::iter::successors(Some(1usize), |&r| (r < b).then(|| (2 * r).min(b))).collect()
        } else {
            buckets.to_vec()
        };
        sizes.sort_unstable();
        sizes.dedup();
        if let Some(&r) = sizes.iter().find(|&&r| r == 0 || r > b) {
            Err(DecodeStepError::BatchMismatch { what: "a bucket", batch: b, got: r })?
        }
        step.idle()?;
        let graphs = sizes.iter().map(|&r| Ok((r, Self::capture_rows(&step, &sampling, r, &logits, &ids)?))).collect::<Result<Vec<_>>>()?;
        Ok(Self { step, sampling, logits, ids, graphs, rows: 0, readback: None })
    }

    /// The fixed outputs `[B, vocab]` f32 and `[B]` u32, after checking the step and `sampling`.
    fn outputs(step: &ModelDecodeStep<'m>, sampling: &SamplingBatch) -> Result<(Tensor, Tensor)> {
        let reads = step.host_reads();
        if !reads.is_empty() {
            candle_core::bail!("GraphedDecodeStep: the step reads the device from the host, so it cannot be captured: {}", reads.join("; "))
        }
        let (b, dev) = (step.batch(), step.device());
        if sampling.len() != b {
            candle_core::bail!("GraphedDecodeStep: the sampling batch has {} rows for {b} sequences: give one per sequence", sampling.len())
        }
        if !sampling.table().device().same_device(dev) {
            candle_core::bail!("GraphedDecodeStep: build the SamplingBatch on the step's device ({dev:?})")
        }
        Ok((Tensor::zeros((b, step.model().vocab_size()), DType::F32, dev)?, Tensor::zeros(b, DType::U32, dev)?))
    }

    /// The graph of the step over the first `rows` rows, its results into the outputs' first rows.
    fn capture_rows(step: &ModelDecodeStep<'m>, sampling: &SamplingBatch, rows: usize, logits: &Tensor, ids: &Tensor) -> Result<StepGraph> {
        let sampling = sampling.leading(rows)?;
        StepGraph::capture(step.device(), || {
            let (l, i) = step.forward_sampled_rows(rows, &sampling)?;
            logits.slice_set(&l, 0, 0)?;
            ids.slice_set(&i, 0, 0)
        })
    }

    /// One step of the first n = `tokens.len()` rows: their next `tokens` at `positions`
    /// ([`ModelDecodeStep::update_first`]) with their sampling steps `sampling_steps`
    /// ([`SamplingBatch::set_first_steps`]), then the replay of the smallest bucket of at least
    /// n rows, enqueued on the device's stream (read [`Self::logits`] / [`Self::ids`]
    /// afterwards). Errors, before anything is replayed, for n = 0, n past the largest bucket,
    /// and inputs `update_first` or `set_first_steps` refuses.
    pub fn step(&mut self, tokens: &[u32], positions: &[usize], sampling_steps: &[u64]) -> Result<()> {
        let n = tokens.len();
        if n == 0 {
            Err(DecodeStepError::EmptyBatch)?
        }
        let at = self.bucket("step", n, sampling_steps)?;
        self.step.update_first(tokens, positions)?;
        self.sampling.set_first_steps(sampling_steps)?;
        self.rows = n;
        self.graphs[at].1.replay()
    }

    /// The index of the smallest bucket of at least `n` rows for a step of `n` sequences with
    /// `sampling_steps` (one per sequence); `op` names the caller in the errors.
    fn bucket(&self, op: &str, n: usize, sampling_steps: &[u64]) -> Result<usize> {
        if sampling_steps.len() != n {
            candle_core::bail!("GraphedDecodeStep::{op}: {} sampling steps for {n} sequences", sampling_steps.len())
        }
        match self.graphs.iter().position(|(r, _)| *r >= n) {
            Some(at) => Ok(at),
            None => {
                let largest = self.graphs.last().map_or(0, |(r, _)| *r);
                candle_core::bail!("GraphedDecodeStep::{op}: {n} sequences, the largest captured bucket has {largest} rows")
            }
        }
    }

    /// [`Self::step`] and the sampled ids read back (one id per sequence).
    pub fn step_ids(&mut self, tokens: &[u32], positions: &[usize], sampling_steps: &[u64]) -> Result<Vec<u32>> {
        self.step(tokens, positions, sampling_steps)?;
        self.ids()?.to_vec1::<u32>()
    }

    /// The step that follows the last one on the device: its n sequences decode the ids it
    /// sampled at their next positions ([`ModelDecodeStep::update_next`]: tokens and Engram ids
    /// written on the device) with their sampling steps `sampling_steps`, then the replay of the
    /// same bucket — all enqueued without reading anything back, so the host's part of the step
    /// overlaps the step before it on the GPU. Errors, before anything is replayed, as
    /// `update_next` (no step to follow: give the tokens with [`Self::step`]) and
    /// `set_first_steps`.
    pub fn step_next(&mut self, sampling_steps: &[u64]) -> Result<()> {
        let n = self.rows;
        let at = self.bucket("step_next", n, sampling_steps)?;
        self.step.update_next(&self.ids.narrow(0, 0, n)?)?;
        self.sampling.set_first_steps(sampling_steps)?;
        self.graphs[at].1.replay()
    }

    /// [`Self::step_next`], and the ids the step it follows sampled: copied to page-locked memory
    /// before the new step is enqueued and returned once that copy is done, while the new step
    /// runs (a decode loop reads each step's ids one step late and never waits for the GPU to
    /// drain; the last step's ids are [`Self::ids`]).
    pub fn step_next_ids(&mut self, sampling_steps: &[u64]) -> Result<Vec<u32>> {
        let ids = self.ids()?;
        let readback = match &mut self.readback {
            Some(r) => r,
            None => {
                let candle_core::Device::Cuda(dev) = self.ids.device() else { candle_core::bail!("GraphedDecodeStep: not on a CUDA device") };
                self.readback.insert(PinnedReadback::new(dev))
            }
        };
        readback.enqueue(&ids)?;
        self.step_next(sampling_steps)?;
        self.readback.as_mut().map_or(Ok(Vec::new()), |r| r.read())
    }

    /// `[n, vocab]` f32: the logits of the last step's n sequences (a view of the fixed output).
    pub fn logits(&self) -> Result<Tensor> {
        self.logits.narrow(0, 0, self.rows)
    }

    /// `[n]` u32: the ids sampled by the last step (a view of the fixed output).
    pub fn ids(&self) -> Result<Tensor> {
        self.ids.narrow(0, 0, self.rows)
    }

    /// The bucket sizes (rows), ascending, and their graphs (node counts: [`StepGraph::nodes`]).
    pub fn graphs(&self) -> &[(usize, StepGraph)] {
        &self.graphs
    }

    /// The sampling settings (one row per batch row).
    pub fn sampling_mut(&mut self) -> &mut SamplingBatch {
        &mut self.sampling
    }

    /// The step (its caches, inputs, batch).
    pub fn inner(&self) -> &ModelDecodeStep<'m> {
        &self.step
    }

    /// The step, to load a sequence into a row ([`ModelDecodeStep::load`]) or release one
    /// between replays.
    pub fn step_mut(&mut self) -> &mut ModelDecodeStep<'m> {
        &mut self.step
    }
}
