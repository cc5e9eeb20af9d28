//! The decoder's non-attention parts: mHC hyper-connections, MoE, Engram.

pub mod numpy_rng;
