//! Fuzzes config parsing (TOML, or JSON when the text starts with `{`),
//! validation and cache construction: see `minikv_fuzz::config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    minikv_fuzz::config(text, text.trim_start().starts_with('{'));
});
