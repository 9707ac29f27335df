//! Fuzzes JSON configs (deep nesting included): see `minikv_fuzz::config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    minikv_fuzz::config(text, true);
});
