//! With the `emulate` feature: compiles the CUDA sources with the host C++
//! compiler under `cuda/emulate.h` (blocks in turn, a block's threads as
//! fibers or OS threads). `MINIKV_EMU_UCONTEXT=1` switches the fibers with
//! glibc's `swapcontext` instead of the emulation's own x86-64 switch (other
//! architectures always do).
fn main() {
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-env-changed=MINIKV_EMU_UCONTEXT");
    #[cfg(feature = "emulate")]
    {
        let mut b = cc::Build::new();
        b.cpp(true)
            .std("c++20")
            .file("cuda/emu_host.cpp")
            .flag("-pthread")
            .opt_level(2)
            .warnings(false);
        if std::env::var_os("MINIKV_EMU_UCONTEXT").is_some_and(|v| v == "1") {
            b.define("MK_EMU_UCONTEXT", "1");
        }
        b.compile("minikv_emu");
    }
}
