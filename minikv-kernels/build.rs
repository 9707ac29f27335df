//! With the `emulate` feature: compiles the CUDA sources with the host C++
//! compiler under `cuda/emulate.h` (blocks in turn, threads as OS threads).
fn main() {
    println!("cargo:rerun-if-changed=cuda");
    #[cfg(feature = "emulate")]
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file("cuda/emu_host.cpp")
        .flag("-pthread")
        .opt_level(2)
        .warnings(false)
        .compile("minikv_emu");
}
