//! Inputs shared by the benchmarks.

/// `n` deterministic values in [-1, 1) (a multiplicative hash of the index
/// and `s`).
pub fn data(n: usize, s: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2654435761).wrapping_add(s)) % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}
