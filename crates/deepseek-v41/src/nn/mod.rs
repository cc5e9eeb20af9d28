//! Numerical building blocks shared by every module: RMSNorm, RoPE, the reference linear.

pub mod linear;
pub mod random_weights;
pub mod rms_norm;
pub mod rope;

pub use linear::{Linear, LinearKind};
pub use random_weights::RandomWeights;
pub use rms_norm::RmsNorm;
pub use rope::{RopeKind, RopeRows, RopeTable, ROPE_BLOCK};
