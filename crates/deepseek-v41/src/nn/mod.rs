//! Numerical building blocks shared by every module: RMSNorm, RoPE, the reference linear.

pub mod linear;
pub mod rms_norm;
pub mod rope;

pub use linear::{Linear, LinearKind};
pub use rms_norm::RmsNorm;
pub use rope::{RopeKind, RopeTable};
