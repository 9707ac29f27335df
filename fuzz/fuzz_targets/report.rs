//! Fuzzes `minikv report` with arbitrary results files: see `minikv_fuzz::report`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| minikv_fuzz::report(data));
