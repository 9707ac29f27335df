//! Which decode kernel a step takes, and its grid: `mk_decode_fast` (or its
//! staged form, `mk_decode_staged`) for the common layouts (a KV head read
//! once for up to four query heads), else `mk_decode_partial`.

use crate::backend::{DECODE_CHUNK, MkHead};
use crate::device::err;
use minikv_core::Result;
use std::sync::OnceLock;

/// Query heads a block of the fast decode kernel serves (`MK_G`).
const FAST_GROUP: usize = 4;

/// Blocks the fast decode aims to launch at least (a few per SM of a large
/// GPU: 132 SMs on an H100 or H200).
const FAST_MIN_BLOCKS: usize = 512;

/// Which fused decode kernel a [`crate::CudaBackend`] takes for the layouts
/// the fast kernels read (every other layout takes `mk_decode_partial`).
/// `MINIKV_CUDA_DECODE` sets it for `backend = "cuda"` (and
/// `"cuda-emulated"`), so that one device run can time each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeKernel {
    /// `mk_decode_fast` (`fast`, the default): warps load a key tile, then
    /// compute it.
    #[default]
    Fast,
    /// `mk_decode_staged` (`staged`): the same arithmetic (the same bits),
    /// after a block's asynchronous copy of its whole chunk of quantized
    /// keys and values into shared memory, so that all of its loads are in
    /// flight at once. Not yet timed on a GPU.
    Staged,
    /// `mk_decode_partial` for every layout (`general`): the reference
    /// kernel, one block per query head, the fast kernels' baseline.
    General,
}

impl DecodeKernel {
    /// The kernel named by `MINIKV_CUDA_DECODE` (unset: [`DecodeKernel::Fast`];
    /// a value as [`DecodeKernel::parse`] takes it).
    pub fn from_env() -> Result<Self> {
        match std::env::var("MINIKV_CUDA_DECODE") {
            Err(_) => Ok(Self::Fast),
            Ok(v) => Self::parse(&v),
        }
    }
    /// `fast`, `staged` or `general` (empty: `fast`); any other name is an
    /// error that names it and the three.
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim() {
            "" | "fast" => Ok(Self::Fast),
            "staged" => Ok(Self::Staged),
            "general" => Ok(Self::General),
            other => Err(err(format!(
                "MINIKV_CUDA_DECODE={other:?}: expected \"fast\", \"staged\" or \"general\""
            ))),
        }
    }
    /// The name `MINIKV_CUDA_DECODE` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fast => "fast",
            Self::Staged => "staged",
            Self::General => "general",
        }
    }
}

/// The decode kernel, its grid rows and tokens per split: the fast kernels
/// read a KV head once for up to [`FAST_GROUP`] of its query heads (rows:
/// KV heads x slices of the group), with splits halved down to 32 tokens
/// while the grid is under [`FAST_MIN_BLOCKS`] (short caches still fill the
/// GPU); the general one (any layout) reads it once per query head, in
/// splits of [`DECODE_CHUNK`].
pub(crate) fn decode_plan(
    kernel: DecodeKernel,
    heads: &[MkHead],
    d: usize,
    group: usize,
    hq: usize,
    longest: usize,
) -> (&'static str, usize, usize) {
    if kernel == DecodeKernel::General || !fast_decode(heads, d) {
        return ("mk_decode_partial", hq, DECODE_CHUNK);
    }
    let rows = heads.len() * group.div_ceil(FAST_GROUP);
    let mut chunk = DECODE_CHUNK;
    while chunk > 32 && longest.div_ceil(chunk) * rows < FAST_MIN_BLOCKS {
        chunk /= 2;
    }
    if kernel != DecodeKernel::Staged {
        return ("mk_decode_fast", rows, chunk);
    }
    // Splits small enough that a block stages all it reads (a part that
    // does not fit is read in place: correct, but not staged).
    while chunk > 32
        && heads
            .iter()
            .any(|h| staged_bytes(h, d, chunk) > STAGE_BYTES)
    {
        chunk /= 2;
    }
    ("mk_decode_staged", rows, chunk)
}

/// Threads of a `mk_decode_combine` block for `splits` splits: 32 channel
/// lanes times 4 to 32 split lanes (a power of two), about 16 splits a
/// split lane, so that a long cache's combination keeps many loads in
/// flight (at most `MK_COMBINE_MAX_THREADS`, 1024).
/// `MINIKV_CUDA_COMBINE_LANES` (4, 8, 16 or 32) fixes the split lanes, so
/// that one device run can time the combination as it was (4) beside the
/// default; another value is an error that names it.
pub(crate) fn combine_threads(splits: usize) -> Result<u32> {
    static LANES: OnceLock<std::result::Result<Option<usize>, String>> = OnceLock::new();
    let lanes = LANES
        .get_or_init(|| combine_lanes(std::env::var("MINIKV_CUDA_COMBINE_LANES").ok().as_deref()))
        .clone()
        .map_err(err)?;
    Ok(32 * lanes.unwrap_or_else(|| split_lanes(splits)) as u32)
}

/// The split lanes `splits` splits take by default.
fn split_lanes(splits: usize) -> usize {
    splits.div_ceil(16).next_power_of_two().clamp(4, 32)
}

/// `MINIKV_CUDA_COMBINE_LANES`'s value: unset or empty, none (chosen by the
/// split count); else 4, 8, 16 or 32.
fn combine_lanes(v: Option<&str>) -> std::result::Result<Option<usize>, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(x) => match x.parse::<usize>() {
            Ok(n @ (4 | 8 | 16 | 32)) => Ok(Some(n)),
            _ => Err(format!(
                "MINIKV_CUDA_COMBINE_LANES={x:?}: expected 4, 8, 16 or 32 split lanes (unset: by the split count)"
            )),
        },
    }
}

/// Shared memory a block of `mk_decode_staged` stages into
/// (`MK_STAGE_BYTES`).
const STAGE_BYTES: usize = 32768;

/// The most bytes a block of `mk_decode_staged` stages for a split of
/// `chunk` tokens (a multiple of 32) of head `h`, as the kernel lays them
/// out: key words by rows of 32 / bits tokens (in runs of 128 bytes), key
/// scales and minimums by groups of tokens, value words, scales and
/// minimums per token (each part from a 16-byte boundary).
fn staged_bytes(h: &MkHead, d: usize, chunk: usize) -> usize {
    let round = |x: usize, m: usize| x.div_ceil(m) * m;
    let es = |q: &crate::backend::MkQuant| if q.f16 != 0 { 2 } else { 4 };
    let mut bytes = 0;
    if h.k.n > 0 {
        let (rows, g) = (chunk * h.k.bits as usize / 32, h.k.group.max(1) as usize);
        // A split's first token is a multiple of `chunk`: it spans
        // chunk / g groups when g divides it, one when it divides g, else
        // at most two more than chunk / g.
        let groups = if chunk.is_multiple_of(g) {
            chunk / g
        } else if g.is_multiple_of(chunk) {
            1
        } else {
            chunk / g + 2
        };
        bytes += round(rows * d * 4, 128) + 2 * round(groups * d * es(&h.k), 16);
    }
    if h.v.n > 0 {
        let per_token = d / h.v.group.max(1) as usize;
        bytes += round(chunk * d * h.v.bits as usize / 8, 16)
            + 2 * round(chunk * per_token * es(&h.v), 16);
    }
    bytes
}

/// True when `mk_decode_fast` (and `mk_decode_staged`) take these heads:
/// head dim 16, 32, 64, 128 or 256 (whole 8-channel columns that divide the
/// block), quantized keys per channel with scale groups of a multiple of 4
/// tokens (a lane's four tokens share a scale) and quantized values per
/// token with scale groups of whole columns, at 2, 4 or 8 bits (or none of
/// either), fp16 rows and the keys' words, scales and minimums 16-byte
/// aligned (read 16 bytes at a time; the staged kernel also checks the
/// values' arrays before it copies them 16 bytes at a time).
fn fast_decode(heads: &[MkHead], d: usize) -> bool {
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
        let fast = |h: MkHead, d| {
            decode_plan(DecodeKernel::Fast, &[h], d, 4, 4, 300).0 == "mk_decode_fast"
        };
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
    fn the_decode_kernel_is_chosen_by_name() {
        let h = head(16, 1 << 16, 0);
        let kernel = |k| decode_plan(k, &[h; 8], 128, 4, 32, 16384);
        // f32 scales: 8 + 2 x 8 KB of keys and as much of values for 256
        // tokens; 128 fit the 32 KB.
        assert_eq!(staged_bytes(&h, 128, 256), 49152);
        assert_eq!(kernel(DecodeKernel::Staged), ("mk_decode_staged", 8, 128));
        // 2-bit keys (groups of 16, fp16 scales) and values (groups of 16
        // channels): 8 + 2 x 4 KB of keys, 8 + 2 x 4 KB of values for 256
        // tokens, the whole 32 KB.
        let mut h2 = h;
        h2.k.f16 = 1;
        h2.v.f16 = 1;
        assert_eq!(staged_bytes(&h2, 128, 256), 32768);
        let plan = decode_plan(DecodeKernel::Staged, &[h2; 8], 128, 4, 32, 16384);
        assert_eq!(plan, ("mk_decode_staged", 8, 256));
        // 4-bit: 48 KB at 256 tokens, so the staged kernel takes 128.
        let mut h4 = h2;
        (h4.k.bits, h4.v.bits) = (4, 4);
        assert_eq!(staged_bytes(&h4, 128, 256), 49152);
        let plan = decode_plan(DecodeKernel::Staged, &[h4; 8], 128, 4, 32, 131072);
        assert_eq!(plan, ("mk_decode_staged", 8, 128));
        assert_eq!(
            decode_plan(DecodeKernel::Fast, &[h4; 8], 128, 4, 32, 131072).2,
            256
        );
        assert_eq!(kernel(DecodeKernel::Fast), ("mk_decode_fast", 8, 256));
        assert_eq!(kernel(DecodeKernel::General).0, "mk_decode_partial");
        // A layout the fast kernels do not read takes the general one.
        let per_token = head(16, 1 << 16, 1);
        let plan = decode_plan(DecodeKernel::Staged, &[per_token], 128, 4, 4, 300);
        assert_eq!(plan.0, "mk_decode_partial");
        for k in [
            DecodeKernel::Fast,
            DecodeKernel::Staged,
            DecodeKernel::General,
        ] {
            assert_eq!(DecodeKernel::parse(k.name()).unwrap(), k);
        }
        assert_eq!(DecodeKernel::parse("").unwrap(), DecodeKernel::Fast);
        let e = DecodeKernel::parse("stagged").unwrap_err().to_string();
        assert!(e.contains("stagged") && e.contains("staged"), "{e}");
    }

    #[test]
    fn splits_shrink_until_the_grid_fills_the_gpu() {
        let h = head(16, 1 << 16, 0);
        // 8 KV heads x 1 block row at 128K tokens: 512 splits of 256.
        let plan = decode_plan(DecodeKernel::Fast, &[h; 8], 128, 4, 32, 131072);
        assert_eq!(plan, ("mk_decode_fast", 8, 256));
        // One head of 1000 tokens: splits halved down to 32 tokens.
        assert_eq!(decode_plan(DecodeKernel::Fast, &[h], 128, 4, 4, 1000).2, 32);
        // 8 heads of 16K tokens: 64 x 8 = 512 blocks at 256 already.
        assert_eq!(
            decode_plan(DecodeKernel::Fast, &[h; 8], 128, 4, 32, 16384).2,
            256
        );
        // 8 heads of 4K: 16 x 8 and 32 x 8 blocks are too few, 64 x 8 not.
        assert_eq!(
            decode_plan(DecodeKernel::Fast, &[h; 8], 128, 4, 32, 4096).2,
            64
        );
    }

    #[test]
    fn the_combination_takes_more_split_lanes_for_more_splits() {
        // Up to 64 splits: 4 split lanes (the 128 threads of every kernel).
        for splits in [1, 16, 64] {
            assert_eq!(split_lanes(splits), 4, "{splits}");
        }
        // Then about 16 splits a lane, a power of two of lanes.
        assert_eq!(split_lanes(65), 8);
        assert_eq!(split_lanes(128), 8);
        assert_eq!(split_lanes(256), 16);
        // 128K tokens in splits of 256: 512 splits, 32 lanes, no more.
        assert_eq!(split_lanes(512), 32);
        assert_eq!(split_lanes(1 << 20), 32);
        // The variable fixes them, or names what it cannot take.
        assert_eq!(combine_lanes(None), Ok(None));
        assert_eq!(combine_lanes(Some(" ")), Ok(None));
        assert_eq!(combine_lanes(Some("4")), Ok(Some(4)));
        assert_eq!(combine_lanes(Some("32")), Ok(Some(32)));
        for bad in ["2", "12", "64", "many"] {
            let e = combine_lanes(Some(bad)).unwrap_err();
            assert!(e.contains(bad) && e.contains("4, 8, 16 or 32"), "{e}");
        }
    }
}
