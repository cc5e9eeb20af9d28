//! Numerical building blocks shared by every module: RMSNorm, RoPE, the reference linear and its
//! weight (dense, or FP8 / MXFP4 as stored), products over the rows of several sequences.

pub mod grouped_linear;
pub mod linear;
pub mod linear_pair;
pub mod linear_weight;
pub mod random_weights;
pub mod rms_norm;
pub mod rope;
pub mod row_groups;

pub use grouped_linear::GroupedLinear;
pub use linear::{Linear, LinearKind};
pub use linear_pair::LinearPair;
pub use linear_weight::LinearWeight;
pub use random_weights::RandomWeights;
pub use rms_norm::RmsNorm;
pub use rope::{RopeKind, RopeRows, RopeTable, ROPE_BLOCK};
pub use row_groups::{grouped_matmul, RowGroup, RowGroups};
