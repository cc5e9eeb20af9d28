//! Sequences dealt to expert-parallel ranks (`tests/expert_parallel.rs`, CPU, and
//! `tests/cuda_expert_parallel.rs`, GPU): the rows of `x` cut into sequences of `lens` tokens,
//! in order, and given to the ranks `deal[r]` sequences at a time; each rank (a thread of a
//! `LocalGroup`) loads its share of one MoE layer and runs it on its rows.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use deepseek_v41::config::Config;
use deepseek_v41::nn::RowGroups;
use deepseek_v41::parallel::{run_local_ranks, Collective, ExpertPlacement, LocalRank, ShardedMoe};
use deepseek_v41::Numerics;

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

/// The outputs of `layer`'s MoE run as `deal.len()` ranks, concatenated in rank order: rank r
/// loads its experts of `layers.{layer}.ffn` and calls `run(moe, rows, sequences, comm)`.
pub fn sharded_with(
    cfg: &Config,
    vb: &VarBuilder<'static>,
    layer: usize,
    x: &Tensor,
    lens: &[usize],
    deal: &[usize],
    run: impl Fn(&ShardedMoe, &Tensor, &RowGroups, &LocalRank) -> Result<Tensor> + Sync,
) -> Result<Tensor> {
    let world = deal.len();
    let ffn = vb.pp("layers").pp(layer).pp("ffn");
    let parts = deal_rows(x, lens, deal)?;
    let outs = run_local_ranks(world, |comm| {
        let (xr, groups) = &parts[comm.rank()];
        let placement = ExpertPlacement::new(cfg.n_routed_experts, world, comm.rank())?;
        let moe = ShardedMoe::new(cfg, Numerics::REFERENCE, ffn.clone(), placement)?;
        if moe.experts().len() != placement.range().len() {
            candle_core::bail!("rank {} loaded {} experts", comm.rank(), moe.experts().len())
        }
        run(&moe, xr, groups, &comm)
    })?;
    Tensor::cat(&outs, 0)
}
