//! The kernels' warp reduction replayed on the host: 32 lane values combined by an xor
//! butterfly (masks 16, 8, 4, 2, 1; each lane adds its partner's value), lane 0's result.

/// Lane 0's value after the xor butterfly over `lanes`.
pub fn xor_butterfly(mut lanes: [f32; 32]) -> f32 {
    let mut mask = 16;
    while mask > 0 {
        let prev = lanes;
        for l in 0..32 {
            lanes[l] = prev[l] + prev[l ^ mask];
        }
        mask /= 2;
    }
    lanes[0]
}
