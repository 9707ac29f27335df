//! Which decode kernel a step takes, and its grid: `mk_decode_fast` for the
//! common layouts (a KV head read once for up to four query heads), else
//! `mk_decode_partial`.

use crate::backend::{DECODE_CHUNK, MkHead};

/// Query heads a block of the fast decode kernel serves (`MK_G`).
const FAST_GROUP: usize = 4;

/// Blocks the fast decode aims to launch at least (a few per SM of a large
/// GPU: 132 SMs on an H100 or H200).
const FAST_MIN_BLOCKS: usize = 512;

/// The decode kernel, its grid rows and tokens per split: the fast kernel
/// reads a KV head once for up to [`FAST_GROUP`] of its query heads (rows:
/// KV heads x slices of the group), with splits halved down to 32 tokens
/// while the grid is under [`FAST_MIN_BLOCKS`] (short caches still fill the
/// GPU); the general one (any layout) reads it once per query head, in
/// splits of [`DECODE_CHUNK`].
pub(crate) fn decode_plan(
    heads: &[MkHead],
    d: usize,
    group: usize,
    hq: usize,
    longest: usize,
) -> (&'static str, usize, usize) {
    if !fast_decode(heads, d) {
        return ("mk_decode_partial", hq, DECODE_CHUNK);
    }
    let rows = heads.len() * group.div_ceil(FAST_GROUP);
    let mut chunk = DECODE_CHUNK;
    while chunk > 32 && longest.div_ceil(chunk) * rows < FAST_MIN_BLOCKS {
        chunk /= 2;
    }
    ("mk_decode_fast", rows, chunk)
}

/// True when `mk_decode_fast` takes these heads: head dim 16, 32, 64, 128
/// or 256 (whole 8-channel columns that divide the block), quantized keys
/// per channel and quantized values per token with scale groups of whole
/// columns, at 2, 4 or 8 bits (or none of either), fp16 rows 16-byte
/// aligned. `MINIKV_CUDA_DECODE=general` forces the general kernel (to
/// compare the two on a device).
fn fast_decode(heads: &[MkHead], d: usize) -> bool {
    static GENERAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *GENERAL.get_or_init(|| std::env::var("MINIKV_CUDA_DECODE").as_deref() == Ok("general")) {
        return false;
    }
    let bits_ok = |b: i32| matches!(b, 2 | 4 | 8);
    // fp16 rows are read 16 bytes at a time.
    let aligned = |h: &MkHead| [h.fk, h.fv, h.ek, h.ev].iter().all(|p| p % 16 == 0);
    [16, 32, 64, 128, 256].contains(&d)
        && heads.iter().all(|h| {
            aligned(h)
                && (h.k.n == 0 || (h.k.axis == 0 && bits_ok(h.k.bits)))
                && (h.v.n == 0
                    || (h.v.axis == 1
                        && bits_ok(h.v.bits)
                        && h.v.group % 8 == 0
                        && d.is_multiple_of(h.v.group as usize)))
        })
}
