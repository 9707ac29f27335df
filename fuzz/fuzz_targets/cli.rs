//! Fuzzes every command's flags, run in-process on the real model: see
//! `minikv_fuzz::cli`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| minikv_fuzz::cli::run(data));
