//! Generation on the batched decode step: the prompt is prefilled by `Model::forward` on the
//! caller's cache, which is then loaded into a one-sequence [`ModelDecodeStep`]; every later
//! token is one `update` and one step, eager or — on CUDA — replayed from a CUDA graph captured
//! at the first step ([`crate::model::GraphedDecodeStep`], feature `cuda`; `docs/architecture.md`,
//! "The whole-model decode step").

use candle_core::Result;

use super::Sampler;
use crate::attention::BatchStorage;
use crate::config::Config;
use crate::model::{Model, ModelCache, ModelDecodeStep};
use crate::sampling::SamplingBatch;

/// [`super::generate`] on the batched decode step (see the module docs): `model` built from
/// `config`, its decode steps replayed from a CUDA graph when `graph` is set.
#[derive(Debug, Clone, Copy)]
pub struct SteppedGeneration<'a> {
    /// The model.
    pub model: &'a Model,
    /// Its config (the step's layer kinds and cache geometry).
    pub config: &'a Config,
    /// Capture the first decode step into a CUDA graph and replay it (CUDA only).
    pub graph: bool,
}

impl SteppedGeneration<'_> {
    /// [`super::generate`]'s contract — the same token budget, EOS and sampler draws (draw t at
    /// step t). On the CPU the tokens are [`super::generate`]'s (the step's logits are
    /// `Model::forward_batch`'s bit for bit, `tests/generate.rs`); on CUDA the step's kernels sum
    /// in another order than `Model::forward`'s, so a token may differ at a near-tie of the
    /// logits (`tests/cuda_model_decode_step.rs`).
    ///
    /// `cache` holds the prompt afterwards: the decoded tokens' state lives in the step, which
    /// is dropped at the end. Errors as [`super::generate`] does; for `graph` off CUDA (after the
    /// prefill and the first draw); and when the model cannot run as the step ([`ModelDecodeStep::new`]; with `graph` also
    /// [`crate::model::GraphedDecodeStep::capture`]: activations other than bf16, routed experts
    /// that are not MXFP4) — then only the prefill has run.
    pub fn generate(
        &self,
        cache: &mut ModelCache,
        prompt: &[u32],
        max_new: usize,
        sampler: &mut Sampler,
        eos: Option<u32>,
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        let model = self.model;
        let (first, device) = super::prefill(model, cache, prompt, max_new, sampler)?;
        if self.graph && !device.is_cuda() {
            candle_core::bail!("SteppedGeneration: graph replay needs a CUDA device, the model runs on {device:?} (set graph to false)")
        }
        let mut out = Vec::new();
        let Some(mut next) = first else { return Ok(out) };
        let mut pos = cache.seq_len();
        let mut runner: Option<Runner> = None;
        loop {
            out.push(next);
            on_token(next)?;
            if Some(next) == eos || out.len() == max_new {
                return Ok(out);
            }
            let ids = match runner.as_mut() {
                Some(r) => r.step(next, pos, sampler.step)?,
                None => {
                    // The first decode step builds the step over the prefilled cache (and captures it).
                    let mut step = ModelDecodeStep::new(self.config, model, 1, pos + max_new, BatchStorage::uniform(cache.attention.storage()), &device)?;
                    step.load(0, cache)?;
                    let batch = SamplingBatch::new(vec![sampler.params], vec![sampler.step], &device)?;
                    let (r, ids) = Runner::first(step, batch, self.graph, next, pos)?;
                    runner = Some(r);
                    ids
                }
            };
            sampler.step += 1;
            next = ids;
            pos += 1;
        }
    }
}

/// The step, eager or replayed.
enum Runner<'m> {
    Eager(ModelDecodeStep<'m>, SamplingBatch),
    #[cfg(feature = "cuda")]
    Graph(crate::model::GraphedDecodeStep<'m>),
}

impl<'m> Runner<'m> {
    /// The first step (token `next` at `pos`) and its sampled id.
    fn first(mut step: ModelDecodeStep<'m>, batch: SamplingBatch, graph: bool, next: u32, pos: usize) -> Result<(Self, u32)> {
        #[cfg(feature = "cuda")]
        if graph {
            let g = crate::model::GraphedDecodeStep::capture(step, batch, &[next], &[pos])?;
            let id = g.ids()?.to_vec1::<u32>()?[0];
            return Ok((Self::Graph(g), id));
        }
        let _ = graph; // without the feature there is no CUDA device: refused after the prefill
        step.update(&[next], &[pos])?;
        let id = step.forward_sampled(&batch)?.1.to_vec1::<u32>()?[0];
        Ok((Self::Eager(step, batch), id))
    }

    /// The next step: token `next` at `pos`, sampling draw `draw`; its sampled id.
    fn step(&mut self, next: u32, pos: usize, draw: u64) -> Result<u32> {
        match self {
            Self::Eager(step, batch) => {
                step.update(&[next], &[pos])?;
                batch.set_steps(&[draw])?;
                Ok(step.forward_sampled(batch)?.1.to_vec1::<u32>()?[0])
            }
            #[cfg(feature = "cuda")]
            Self::Graph(g) => Ok(g.step_ids(&[next], &[pos], &[draw])?[0]),
        }
    }
}
