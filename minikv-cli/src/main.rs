//! The `minikv` binary: everything lives in the `minikv_cli` library.

// typetag registers impls only in binaries that reference their crate.
use minikv_policies as _;
use minikv_quant as _;

fn main() -> std::process::ExitCode {
    minikv_cli::main()
}
