//! Fuzzes the GGUF reader and everything that reads a parsed file: metadata,
//! tensor bounds, model and tokenizer construction, dequantization of every
//! tensor's first row. Any panic, overflow or out-of-bounds read is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minikv_models::gguf::{Bytes, Gguf};

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::parse(Bytes::Owned(data.to_vec())) else {
        return;
    };
    for t in g.tensors.values() {
        let n = t.dims[0].min(1 << 16);
        let n = n - n % t.dtype.block_size();
        let blob = g.blob(t);
        let mut row = vec![0.0f32; n];
        let bytes = &blob.bytes()[..t.dtype.row_bytes(n).min(blob.bytes().len())];
        if bytes.len() == t.dtype.row_bytes(n) {
            minikv_models::blocks::dequantize_row(t.dtype, bytes, &mut row);
        }
    }
    let _ = minikv_models::Llama::from_gguf(&g);
    let _ = minikv_models::Tokenizer::from_gguf(&g);
});
