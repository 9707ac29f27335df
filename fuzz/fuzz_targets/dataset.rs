//! Fuzzes the QA dataset reader: see `minikv_fuzz::dataset`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| minikv_fuzz::dataset(data));
