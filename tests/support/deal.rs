//! Sequences dealt to expert-parallel ranks (`tests/expert_parallel.rs`, CPU, and
//! `tests/cuda_expert_parallel.rs`, GPU): the rows of `x` cut into sequences of `lens` tokens,
//! in order, and given to the ranks `deal[r]` sequences at a time.

use candle_core::{Result, Tensor};
use deepseek_v41::nn::RowGroups;

/// Rank r's rows of `x` and their sequences, for every rank of `deal` (sequence counts per rank).
pub fn deal_rows(x: &Tensor, lens: &[usize], deal: &[usize]) -> Result<Vec<(Tensor, RowGroups)>> {
    let mut parts = Vec::with_capacity(deal.len());
    let (mut seq, mut row) = (0, 0);
    for &n in deal {
        let mine = &lens[seq..seq + n];
        let rows: usize = mine.iter().sum();
        parts.push((x.narrow(0, row, rows)?, RowGroups::from_lens(mine.iter().copied())));
        seq += n;
        row += rows;
    }
    Ok(parts)
}
