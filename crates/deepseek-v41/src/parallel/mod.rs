//! Expert parallelism (issue 25): the routed experts of a MoE layer spread over the ranks of a
//! group (one rank per GPU of a node), each rank holding `E / N` of them and its own sequences'
//! tokens; the tokens routed to an expert travel to its rank and the outputs come back
//! ([`ShardedMoe`], over a [`Collective`]).
//!
//! * [`ExpertPlacement`]: which experts a rank holds (contiguous ranges, as even as `E` allows);
//!   a rank loads only those ([`ShardedMoe::new`]).
//! * [`Collective`]: the all-to-all exchanges the dispatch and the combine use — of host bytes
//!   (the slots' metadata, the rounds) and of bf16 rows ([`Collective::all_to_all_rows`]: the
//!   token rows and the outputs, which stay on the device where the collective exchanges device
//!   buffers; by default through host bytes); [`LocalGroup`] runs `N` ranks as threads of one
//!   process (the tests, `generate --ranks N`, and the semantics an NCCL group must keep),
//!   [`run_local_ranks`] launches them (a failing rank fails the others' exchanges: no hang).
//! * [`agree`]: the round that starts every call of an expert-parallel model ([`Turn`]: forward,
//!   idle or done), so ranks may make different numbers of calls.
//! * [`ShardedMoe::forward`]: route locally (the router is replicated), send each routed slot's
//!   token row to its expert's rank, compute every received slot there, send the outputs back, and
//!   sum them in expert-id order followed by the (replicated) shared expert — the sequence of
//!   [`crate::model::Moe::forward_grouped`], so on the CPU every rank's rows are bit for bit
//!   those of one process running all ranks' sequences as one batch (`tests/expert_parallel.rs`).
//!
//! * [`crate::model::Model::expert_parallel`]: the whole model as one rank — every block holds
//!   its layer's [`ShardedMoe`]; each rank forwards its own sequences (data-parallel attention,
//!   replicated weights but the experts); on the CPU every sequence's logits are bit for bit
//!   those of one model forwarding all ranks' sequences in one batch. A rank with no sequence
//!   in a call joins its exchanges with [`crate::model::Model::join_idle`].
//!
//! * `NcclRank` (feature `nccl`): the collective over NCCL, one rank per GPU, the rows sent from
//!   and into device memory.
//!
//! * On CUDA with MXFP4 experts and the device routing on (`cuda::with_device_routing`), a rank
//!   computes the slots it receives with the grouped expert kernels (`cuda::moe_experts_device`
//!   over its experts, one expert per received row) instead of a loop over its experts; the
//!   dispatch metadata still travels as host bytes (`tests/cuda_expert_parallel.rs`).
//!
//! Not yet: the routing and the dispatch without the host (fixed-capacity exchanges), the
//! captured decode step over a sharded model, tensor-parallel attention.

mod collective;
#[cfg(feature = "nccl")]
mod nccl;
mod placement;
mod round;
mod sharded_moe;

pub use collective::{run_local_ranks, run_ranks, Collective, LocalGroup, LocalRank};
#[cfg(feature = "nccl")]
pub use nccl::NcclRank;
pub use placement::ExpertPlacement;
pub use round::{agree, Round, Turn};
pub use sharded_moe::ShardedMoe;
