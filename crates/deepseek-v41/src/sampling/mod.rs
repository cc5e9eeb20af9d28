//! Token sampling for a batch of sequences, one algorithm on every device: greedy, temperature,
//! top-k, top-p, with a seed per sequence and a step counter per draw, deterministic for a
//! `(seed, step)` pair. [`sample_batch`] runs `kernels/sampling.cu` on a CUDA device (only the
//! chosen ids come back to the host) and the CPU reference [`sample_row_ref`] elsewhere; both pick
//! the same id (`tests/cuda_sampling.rs`). [`crate::generation::Sampler`] uses it.
//!
//! # The algorithm
//!
//! Per sequence, [`SamplingParams`] `{ temperature T, top_k, top_p, seed }` and the draw's `step`
//! (the caller's token index), over one row of logits `l[0..V]`:
//!
//! 1. NaN logits count as −inf and −0 as +0. The row's order: logit descending, lower id first
//!    among equal logits. Greedy (`T = 0`), or a row whose largest logit is ±inf: the first id of
//!    the order ([`crate::generation::argmax`]).
//! 2. Scaled logits `x_i = (l_i − max l) / T` (`<= 0`).
//! 3. Candidates: the first `n = min(k, n_p)` ids of the order, `k = top_k` (0: `V`) and `n_p`
//!    the shortest prefix whose nucleus mass reaches `ceil(top_p · Z)` (`top_p = 1`: `V`) —
//!    the intersection of the top-k set and the top-p nucleus of the whole row. The mass of an
//!    entry is `floor(exp(x_i) · 2^40)` as an integer and `Z` the row's sum, so that prefix sums
//!    are exact in any order.
//! 4. The draw, Gumbel-max: the candidate with the largest `x_i + G_i`, lower id on ties, where
//!    `G_i = −ln(−ln u_i)` and `u_i` comes from 32 bits of SplitMix64's `i`-th output from a state
//!    mixed from `(seed, step)`. `argmax (x_i + G_i)` is distributed as `softmax(x)` restricted to
//!    the candidates.
//!
//! # Why Gumbel-max and integer masses
//!
//! The draw needs no normalisation, no prefix sum and no sorted order: each candidate's score
//! depends on its own logit and its own counter only, and the winner is a maximum — the same in
//! any reduction order. Inverse-CDF sampling, by contrast, compares one uniform against a running
//! f32 sum whose value depends on the summation order, so a host and a device differ whenever the
//! uniform falls within that rounding of a boundary. The nucleus boundary has the same problem
//! with f32 sums; integer masses remove it. What remains is `exp` and `ln`, whose library
//! versions differ between the host's libm and CUDA: `sampling/math.rs` computes them from basic IEEE
//! operations in a fixed order, so the kernel reproduces every bit — the CPU and GPU pick the
//! same id, not just the same id up to float noise (the tests still report each decision's
//! margin and the nucleus boundary's slack, and allow a mismatch only within a tiny slack).
//!
//! # Seeds and steps
//!
//! Draw `step` of a sequence seeded `seed` depends on `(seed, step)` only: a sequence reproduces
//! its tokens regardless of which other sequences share its batch or which device runs it.
//! [`crate::generation::Sampler`] counts its steps from 0.

mod math;
mod reference;

pub use reference::{argmax_ref, sample_row_ref, SampleDecision};

use candle_core::{DType, Device, Result, Tensor};

/// Longest row the sampler takes: `2^23` entries (the nucleus masses of a row sum in 64 bits).
pub const SAMPLING_MAX_VOCAB: usize = 1 << 23;

/// Words per sequence of [`SamplingBatch::table`].
pub const SAMPLING_TABLE_WORDS: usize = 8;

/// How one sequence's next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax, lowest id on ties); otherwise finite and > 0.
    pub temperature: f32,
    /// Keep the `top_k` largest logits (lower ids first among equal ones); 0 = no top-k.
    pub top_k: u32,
    /// Nucleus mass in (0, 1]; 1 = no nucleus.
    pub top_p: f32,
    /// The sequence's seed.
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding.
    pub const GREEDY: SamplingParams = SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 };

    /// Temperature finite and >= 0, `top_p` in (0, 1], `top_k <= vocab`, for sequence `seq` of a
    /// batch (named in the error) over rows of `vocab` logits (1 ..= [`SAMPLING_MAX_VOCAB`]).
    pub fn check(&self, seq: usize, vocab: usize) -> std::result::Result<(), SamplingError> {
        self.check_values(seq)?;
        if !(1..=SAMPLING_MAX_VOCAB).contains(&vocab) {
            return Err(SamplingError::Vocab { vocab });
        }
        if self.top_k as usize > vocab {
            return Err(SamplingError::TopK { seq, top_k: self.top_k, vocab });
        }
        Ok(())
    }

    /// The checks of [`SamplingParams::check`] that do not need the vocabulary size.
    pub fn check_values(&self, seq: usize) -> std::result::Result<(), SamplingError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(SamplingError::Temperature { seq, value: self.temperature });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP { seq, value: self.top_p });
        }
        Ok(())
    }

    /// The sequence's row of [`SamplingBatch::table`] at draw `step`.
    fn table_row(&self, step: u64) -> [u32; SAMPLING_TABLE_WORDS] {
        [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            0,
            self.seed as u32,
            (self.seed >> 32) as u32,
            step as u32,
            (step >> 32) as u32,
        ]
    }
}

/// Sampling settings or logits the sampler cannot take. Converts into [`candle_core::Error`] (a
/// wrapped error whose message is this `Display`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A temperature is negative or not finite.
    #[error("sequence {seq}: temperature must be finite and >= 0 (0 = greedy), got {value}")]
    Temperature {
        /// The sequence's index in the batch.
        seq: usize,
        /// The temperature.
        value: f32,
    },
    /// A nucleus mass is outside (0, 1].
    #[error("sequence {seq}: top_p must be in (0, 1] (1 = no nucleus), got {value}")]
    TopP {
        /// The sequence's index in the batch.
        seq: usize,
        /// The nucleus mass.
        value: f32,
    },
    /// A top-k is larger than the row.
    #[error("sequence {seq}: top_k = {top_k} exceeds the {vocab} logits of a row; use at most {vocab} (0 = no top-k)")]
    TopK {
        /// The sequence's index in the batch.
        seq: usize,
        /// The top-k.
        top_k: u32,
        /// Logits per row.
        vocab: usize,
    },
    /// The step counters do not match the sequences.
    #[error("{steps} step counters for {sequences} sequences: give one step per sequence")]
    Steps {
        /// Sequences (parameter sets).
        sequences: usize,
        /// Step counters.
        steps: usize,
    },
    /// An empty batch on a CUDA device, which holds no zero-sized tensor.
    #[error("the batch has no sequences: nothing to sample on a CUDA device (skip the call)")]
    EmptyOnCuda,
    /// The logits' rows do not match the sequences.
    #[error("logits have {rows} rows but the batch has {sequences} sequences: pass one row of logits per sequence")]
    Rows {
        /// Rows of the logits.
        rows: usize,
        /// Sequences of the batch.
        sequences: usize,
    },
    /// A row is empty or longer than [`SAMPLING_MAX_VOCAB`].
    #[error("logit rows of {vocab} entries: the sampler takes 1 ..= {SAMPLING_MAX_VOCAB}")]
    Vocab {
        /// Logits per row.
        vocab: usize,
    },
}

impl From<SamplingError> for candle_core::Error {
    fn from(e: SamplingError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// The settings of a batch of sequences for one draw each: per sequence its [`SamplingParams`]
/// and step, kept on the host (for the checks and the CPU path) and as a device table the kernel
/// reads (no host value enters the launch, so a captured CUDA graph can replay it after the
/// caller rewrites the table in place).
#[derive(Debug, Clone)]
pub struct SamplingBatch {
    params: Vec<SamplingParams>,
    steps: Vec<u64>,
    table: Tensor,
}

impl SamplingBatch {
    /// `params[b]` and `steps[b]` for sequence b, the table uploaded to `device`. Errors on
    /// invalid values or a length mismatch ([`SamplingError`]).
    pub fn new(params: Vec<SamplingParams>, steps: Vec<u64>, device: &Device) -> Result<Self> {
        if params.len() != steps.len() {
            return Err(SamplingError::Steps { sequences: params.len(), steps: steps.len() }.into());
        }
        for (seq, p) in params.iter().enumerate() {
            p.check_values(seq)?;
        }
        let words: Vec<u32> = params.iter().zip(&steps).flat_map(|(p, &s)| p.table_row(s)).collect();
        // A CUDA device allocates no zero-sized tensor: an empty batch keeps its table on the host.
        let device = if params.is_empty() { &Device::Cpu } else { device };
        let table = Tensor::from_vec(words, (params.len(), SAMPLING_TABLE_WORDS), device)?;
        Ok(Self { params, steps, table })
    }

    /// Sets every sequence's step (`steps[b]` for sequence b) and rewrites the table in place
    /// with one host→device copy, so that a CUDA graph that reads the table draws the new steps'
    /// bits when replayed. Errors, changing nothing, on a length mismatch.
    pub fn set_steps(&mut self, steps: &[u64]) -> Result<()> {
        if steps.len() != self.len() {
            return Err(SamplingError::Steps { sequences: self.len(), steps: steps.len() }.into());
        }
        self.set_first_steps(steps)
    }

    /// Sets the steps of the first `steps.len()` sequences (the others keep theirs), rewriting
    /// their table rows in place with one host→device copy. Errors, changing nothing, for more
    /// steps than sequences.
    pub fn set_first_steps(&mut self, steps: &[u64]) -> Result<()> {
        let n = steps.len();
        if n > self.len() {
            return Err(SamplingError::Steps { sequences: self.len(), steps: n }.into());
        }
        if n == 0 {
            return Ok(());
        }
        let words: Vec<u32> = self.params.iter().zip(steps).flat_map(|(p, &s)| p.table_row(s)).collect();
        self.table.slice_set(&Tensor::from_vec(words, (n, SAMPLING_TABLE_WORDS), self.table.device())?, 0, 0)?;
        self.steps[..n].copy_from_slice(steps);
        Ok(())
    }

    /// Gives sequence `seq` new settings and step (a sequence joining the batch in that row),
    /// rewriting its table row in place. Errors, changing nothing, for invalid values or a
    /// sequence outside the batch.
    pub fn set_sequence(&mut self, seq: usize, params: SamplingParams, step: u64) -> Result<()> {
        if seq >= self.len() {
            candle_core::bail!("SamplingBatch::set_sequence: sequence {seq} is outside the batch of {} sequences", self.len())
        }
        params.check_values(seq)?;
        let words = params.table_row(step).to_vec();
        self.table.slice_set(&Tensor::from_vec(words, (1, SAMPLING_TABLE_WORDS), self.table.device())?, 0, seq)?;
        self.params[seq] = params;
        self.steps[seq] = step;
        Ok(())
    }

    /// The first `rows` sequences as a batch of their own whose table is a view of this one's
    /// (for a step over the first rows, a batch-size bucket: later rewrites of this batch's table
    /// show through on the device; the view's host copy of settings is taken now). Errors for
    /// more rows than sequences.
    pub fn leading(&self, rows: usize) -> Result<Self> {
        if rows > self.len() {
            return Err(SamplingError::Steps { sequences: self.len(), steps: rows }.into());
        }
        Ok(Self { params: self.params[..rows].to_vec(), steps: self.steps[..rows].to_vec(), table: self.table.narrow(0, 0, rows)? })
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether the batch has no sequence.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Per sequence its settings.
    pub fn params(&self) -> &[SamplingParams] {
        &self.params
    }

    /// Per sequence its step.
    pub fn steps(&self) -> &[u64] {
        &self.steps
    }

    /// `[B, 8]` u32 on the batch's device, row b: temperature (f32 bits), top_k, top_p (f32 bits),
    /// 0, seed (low, high 32 bits), step (low, high 32 bits) — what the kernel reads.
    pub fn table(&self) -> &Tensor {
        &self.table
    }

    /// Every sequence's settings valid for rows of `vocab` logits ([`SamplingParams::check`]).
    pub fn check_vocab(&self, vocab: usize) -> std::result::Result<(), SamplingError> {
        self.params.iter().enumerate().try_for_each(|(seq, p)| p.check(seq, vocab))
    }

    /// The batch's `[B, V]` logits (any float dtype) checked against it; returns `(B, V)`.
    pub(crate) fn check_logits(&self, op: &str, logits: &Tensor) -> Result<(usize, usize)> {
        let Ok((rows, vocab)) = logits.dims2() else {
            candle_core::bail!("{op}: logits must be [B, V], got shape {:?}", logits.shape())
        };
        if !logits.dtype().is_float() {
            candle_core::bail!("{op}: logits must be a float dtype, got {:?}", logits.dtype())
        }
        if rows != self.len() {
            return Err(SamplingError::Rows { rows, sequences: self.len() }.into());
        }
        self.check_vocab(vocab)?;
        Ok((rows, vocab))
    }
}

/// One token per sequence: `logits` `[B, V]` (any float dtype), `batch` of B sequences; returns
/// `[B]` u32 on the logits' device. On a CUDA device whose batch table is there too (build the
/// [`SamplingBatch`] on the logits' device) one kernel launch that reads nothing back
/// (`cuda::sample_device`, with the `cuda` feature; the same ids as the reference by design,
/// `tests/cuda_sampling.rs`); otherwise the CPU reference ([`sample_batch_ref`], which reads the
/// logits to the host). An empty batch gives an empty tensor on the CPU and
/// [`SamplingError::EmptyOnCuda`] for CUDA logits.
pub fn sample_batch(logits: &Tensor, batch: &SamplingBatch) -> Result<Tensor> {
    if batch.is_empty() && logits.device().is_cuda() {
        return Err(SamplingError::EmptyOnCuda.into());
    }
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_kernels(logits.device()) && batch.table().device().same_device(logits.device()) {
        return crate::cuda::sample_device(logits, batch);
    }
    let ids: Vec<u32> = sample_batch_ref(logits, batch)?.iter().map(|d| d.id).collect();
    Tensor::from_vec(ids, batch.len(), logits.device())
}

/// The CPU reference of [`sample_batch`], with each decision's margins ([`SampleDecision`]).
pub fn sample_batch_ref(logits: &Tensor, batch: &SamplingBatch) -> Result<Vec<SampleDecision>> {
    batch.check_logits("sample_batch_ref", logits)?;
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows.iter().zip(batch.params()).zip(batch.steps()).map(|((row, p), &step)| reference::decide(row, p, step)).collect())
}

#[cfg(test)]
mod tests;
