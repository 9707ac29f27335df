//! Names the build's one target condition for the x86 kernels, so every
//! module and dispatch says `#[cfg(x86_kernels)]` instead of repeating it.
fn main() {
    cfg_aliases::cfg_aliases! {
        // AVX2, FMA and F16C enabled at compile time (x86-64-v3 and up;
        // `.cargo/config.toml` builds for the native CPU): the 256-bit
        // kernels and, behind a run-time check, the 512-bit ones.
        x86_kernels: {
            all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                target_feature = "f16c"
            )
        },
    }
}
