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
/// per channel with scale groups of a multiple of 4 tokens (a lane's four
/// tokens share a scale) and quantized values per token with scale groups
/// of whole columns, at 2, 4 or 8 bits (or none of either), fp16 rows and
/// the keys' words, scales and minimums 16-byte aligned (read 16 bytes at a
/// time). `MINIKV_CUDA_DECODE=general` forces the general kernel (to
/// compare the two on a device).
fn fast_decode(heads: &[MkHead], d: usize) -> bool {
    static GENERAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *GENERAL.get_or_init(|| std::env::var("MINIKV_CUDA_DECODE").as_deref() == Ok("general")) {
        return false;
    }
    let bits_ok = |b: i32| matches!(b, 2 | 4 | 8);
    // fp16 rows are read 16 bytes at a time.
    let aligned = |h: &MkHead| {
        [h.fk, h.fv, h.ek, h.ev, h.k.words, h.k.scale, h.k.minv]
            .iter()
            .all(|p| p % 16 == 0)
    };
    [16, 32, 64, 128, 256].contains(&d)
        && heads.iter().all(|h| {
            aligned(h)
                && (h.k.n == 0 || (h.k.axis == 0 && bits_ok(h.k.bits) && h.k.group % 4 == 0))
                && (h.v.n == 0
                    || (h.v.axis == 1
                        && bits_ok(h.v.bits)
                        && h.v.group % 8 == 0
                        && d.is_multiple_of(h.v.group as usize)))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MkQuant;

    /// A head of 2-bit keys per channel (scale groups of `group` tokens,
    /// words at `words`) and 2-bit values per token, 16-byte aligned
    /// elsewhere.
    fn head(group: i32, words: u64, key_axis: i32) -> MkHead {
        let quant = |axis, base: u64| MkQuant {
            words: base,
            scale: base + 4096,
            minv: base + 8192,
            n: 256,
            group,
            bits: 2,
            axis,
            ..Default::default()
        };
        let mut v = quant(1, 1 << 20);
        v.group = 16;
        MkHead {
            k: MkQuant {
                words,
                ..quant(key_axis, 1 << 16)
            },
            v,
            fk: 1 << 24,
            fv: 1 << 25,
            len: 300,
            ..Default::default()
        }
    }

    #[test]
    fn the_fast_kernel_takes_only_the_layouts_it_reads() {
        let fast = |h: MkHead, d| decode_plan(&[h], d, 4, 4, 300).0 == "mk_decode_fast";
        assert!(fast(head(16, 1 << 16, 0), 128));
        assert!(fast(head(32, 1 << 16, 0), 16));
        // A lane's four key tokens must share a scale.
        assert!(!fast(head(6, 1 << 16, 0), 128));
        // Key words are read 16 bytes at a time.
        assert!(!fast(head(16, (1 << 16) + 8, 0), 128));
        // Keys per token, head dims other than 16 * 2^k.
        assert!(!fast(head(16, 1 << 16, 1), 128));
        assert!(!fast(head(16, 1 << 16, 0), 96));
    }

    #[test]
    fn splits_shrink_until_the_grid_fills_the_gpu() {
        let h = head(16, 1 << 16, 0);
        // 8 KV heads x 1 block row at 128K tokens: 512 splits of 256.
        let plan = decode_plan(&[h; 8], 128, 4, 32, 131072);
        assert_eq!(plan, ("mk_decode_fast", 8, 256));
        // One head of 1000 tokens: splits halved down to 32 tokens.
        assert_eq!(decode_plan(&[h], 128, 4, 4, 1000).2, 32);
        // 8 heads of 16K tokens: 64 x 8 = 512 blocks at 256 already.
        assert_eq!(decode_plan(&[h; 8], 128, 4, 32, 16384).2, 256);
        // 8 heads of 4K: 16 x 8 and 32 x 8 blocks are too few, 64 x 8 not.
        assert_eq!(decode_plan(&[h; 8], 128, 4, 32, 4096).2, 64);
    }
}
