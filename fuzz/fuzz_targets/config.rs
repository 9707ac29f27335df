//! Fuzzes config parsing, validation and cache construction: any text that
//! `config check` accepts must build a cache that prefills, compresses and
//! decodes a few steps without a panic (errors are fine).
#![no_main]

use libfuzzer_sys::fuzz_target;
use minikv_core::{CacheBuilder, ModelSpec, RunConfig};
use minikv_policies as _;
use minikv_quant as _;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(mut cfg) = RunConfig::parse(text, text.trim_start().starts_with('{')) else { return };
    if cfg.resolve().and_then(|_| cfg.validate(None)).is_err() {
        return;
    }
    let spec = ModelSpec { n_layers: 2, n_q_heads: 4, n_kv_heads: 2, head_dim: 32, max_seq_len: 256, windows: Vec::new() };
    let Ok(mut c) = CacheBuilder::new(spec).build(&cfg.cache) else { return };
    let (t, kv, qd) = (48, 64, 128);
    let x: Vec<f32> = (0..t * qd).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let mut out = vec![0.0; t * qd];
    for l in 0..2 {
        if c.append(l, &x[..t * kv], &x[t * kv..2 * t * kv], t).is_err()
            || c.attend(l, &x, t, &mut out).is_err()
        {
            return;
        }
    }
    if c.end_prefill().is_err() {
        return;
    }
    for s in 0..4 {
        for l in 0..2 {
            let k = &x[s * kv..(s + 1) * kv];
            if c.append(l, k, k, 1).is_err() || c.attend(l, &x[..qd], 1, &mut out[..qd]).is_err() {
                return;
            }
            assert!(out[..qd].iter().all(|v| v.is_finite()));
        }
    }
    let _ = c.memory();
});
