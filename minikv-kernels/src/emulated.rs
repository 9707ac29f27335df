//! The CUDA kernels of `cuda/minikv.cu` run on the CPU under `cuda/emulate.h`
//! (feature `emulate`): the same source, the same launch geometry as on a
//! GPU, blocks one at a time with their threads as OS threads. Slow (an OS
//! thread per CUDA thread), exact, and meant for tests on small shapes.

use std::os::raw::{c_int, c_void};

/// One decode head as the fused decode kernel reads it (`MkHead` in
/// `minikv.cu`; the CPU store's layouts). Pointers must stay valid for the call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MkHead {
    /// Packed key codes, per channel: word `(j / P) * d + c`.
    pub kwords: *const u32,
    /// Key scales `[j / G][d]`, fp16 bits.
    pub kscale: *const u16,
    /// Key minimums, fp16 bits.
    pub kmin: *const u16,
    /// Quantized keys, group (tokens), bits.
    pub nqk: c_int,
    /// Tokens per key group.
    pub kgroup: c_int,
    /// Key bits.
    pub kbits: c_int,
    /// Packed value codes, per token: `d / P` words per token.
    pub vwords: *const u32,
    /// Value scales `[c / G][vcap]`, fp16 bits.
    pub vscale: *const u16,
    /// Value minimums, fp16 bits.
    pub vmin: *const u16,
    /// Quantized values.
    pub nqv: c_int,
    /// Channels per value group.
    pub vgroup: c_int,
    /// Value bits.
    pub vbits: c_int,
    /// Row stride of the value scales.
    pub vcap: c_int,
    /// fp16 residual keys `[len - nqk][d]`.
    pub fk: *const u16,
    /// fp16 residual values `[len - nqv][d]`.
    pub fv: *const u16,
    /// Tokens held.
    pub len: c_int,
    /// Extra entries' keys `[n_extra][d]`, fp16.
    pub ek: *const u16,
    /// Extra entries' values, fp16.
    pub ev: *const u16,
    /// Extra entries' logit bias.
    pub ebias: *const f32,
    /// Extra entries.
    pub n_extra: c_int,
}

unsafe extern "C" {
    fn mk_emu_prefill(
        q: *const f32,
        k: *const f32,
        v: *const f32,
        out: *mut f32,
        lse: *mut f32,
        cumul: *mut f32,
        hq: c_int,
        hkv: c_int,
        n: c_int,
        t: c_int,
        d: c_int,
        scale: f32,
        window: c_int,
    );
    fn mk_emu_window_scores(
        q: *const f32,
        k: *const f32,
        lse: *const f32,
        scores: *mut f32,
        pooled: *mut f32,
        hq: c_int,
        hkv: c_int,
        n: c_int,
        t: c_int,
        d: c_int,
        scale: f32,
        w: c_int,
        kernel: c_int,
        mode: c_int,
    );
    fn mk_emu_quant_keys(
        rows: *const f32,
        g: c_int,
        d: c_int,
        bits: c_int,
        t0: c_int,
        words: *mut u32,
        scale: *mut c_void,
        minv: *mut c_void,
        f16: c_int,
    );
    fn mk_emu_quant_values(
        rows: *const f32,
        n: c_int,
        d: c_int,
        g: c_int,
        bits: c_int,
        t0: c_int,
        cap: c_int,
        words: *mut u32,
        scale: *mut c_void,
        minv: *mut c_void,
        f16: c_int,
    );
    fn mk_emu_decode(
        q: *const f32,
        heads: *const MkHead,
        hq: c_int,
        hkv: c_int,
        d: c_int,
        scale: f32,
        chunk: c_int,
        out: *mut f32,
    );
    fn mk_emu_f2h(f: f32) -> u16;
    fn mk_emu_h2f(h: u16) -> f32;
}

/// Largest head dimension the kernels take (`MK_MAX_D`).
pub const MAX_HEAD_DIM: usize = 256;

fn int(x: usize) -> c_int {
    c_int::try_from(x).expect("shape fits a C int")
}

/// Shape of a prefill call.
#[derive(Debug, Clone, Copy)]
pub struct PrefillShape {
    /// Query heads.
    pub hq: usize,
    /// KV heads.
    pub hkv: usize,
    /// Queries (the last `n` positions).
    pub n: usize,
    /// Keys.
    pub t: usize,
    /// Head dimension.
    pub d: usize,
    /// Sliding window (0: none).
    pub window: usize,
}

/// Prefill attention: `q [Hq][n][d]`, `k`, `v` `[Hkv][t][d]`; returns the
/// output `[Hq][n][d]`, the log-sum-exp `[Hq][n]`, and `A_cumul [Hq][t]` when
/// asked.
pub fn prefill(
    s: PrefillShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    cumulative: bool,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    assert!(s.d <= MAX_HEAD_DIM && s.hq.is_multiple_of(s.hkv) && s.n <= s.t);
    assert_eq!(q.len(), s.hq * s.n * s.d);
    assert_eq!(k.len(), s.hkv * s.t * s.d);
    assert_eq!(v.len(), k.len());
    let mut out = vec![0.0; q.len()];
    let mut lse = vec![0.0; s.hq * s.n];
    let mut cu = cumulative.then(|| vec![0.0f32; s.hq * s.t]);
    let cp = cu.as_mut().map_or(std::ptr::null_mut(), |c| c.as_mut_ptr());
    // SAFETY: every buffer has the length the kernels index (asserted above).
    unsafe {
        mk_emu_prefill(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            out.as_mut_ptr(),
            lse.as_mut_ptr(),
            cp,
            int(s.hq),
            int(s.hkv),
            int(s.n),
            int(s.t),
            int(s.d),
            1.0 / (s.d as f32).sqrt(),
            int(s.window),
        );
    }
    (out, lse, cu)
}

/// SnapKV window scores: column sums of the last `w` queries (with the
/// log-sum-exp from [`prefill`]) over the first `t - w` keys, then pooled
/// (`kernel`, `max`: max pooling, else average). Returns `[Hq][t - w]`.
#[allow(clippy::too_many_arguments)]
pub fn window_scores(
    s: PrefillShape,
    q: &[f32],
    k: &[f32],
    lse: &[f32],
    w: usize,
    kernel: usize,
    max: bool,
) -> Vec<f32> {
    assert!(w <= s.n && w < s.t && lse.len() == s.hq * s.n);
    let mut scores = vec![0.0f32; s.hq * s.t];
    let mut pooled = vec![0.0f32; s.hq * s.t];
    // SAFETY: lengths as the kernels index them.
    unsafe {
        mk_emu_window_scores(
            q.as_ptr(),
            k.as_ptr(),
            lse.as_ptr(),
            scores.as_mut_ptr(),
            pooled.as_mut_ptr(),
            int(s.hq),
            int(s.hkv),
            int(s.n),
            int(s.t),
            int(s.d),
            1.0 / (s.d as f32).sqrt(),
            int(w),
            int(kernel),
            if max { 0 } else { 1 },
        );
    }
    let p = s.t - w;
    (0..s.hq)
        .flat_map(|h| pooled[h * s.t..h * s.t + p].to_vec())
        .collect()
}

/// Quantizes one group of `g` key rows `[g][d]` per channel into `words`
/// (tokens from `t0`), scales and minimums as fp16 bits `[t0 / g][d]`.
#[allow(clippy::too_many_arguments)]
pub fn quant_keys(
    rows: &[f32],
    g: usize,
    d: usize,
    bits: u32,
    t0: usize,
    words: &mut Vec<u32>,
    scale: &mut Vec<u16>,
    min: &mut Vec<u16>,
) {
    let p = 32 / bits as usize;
    assert_eq!(rows.len(), g * d);
    assert_eq!(t0 % g, 0);
    words.resize(words.len().max((t0 + g).div_ceil(p) * d), 0);
    let sl = (t0 / g + 1) * d;
    scale.resize(scale.len().max(sl), 0);
    min.resize(min.len().max(sl), 0);
    // SAFETY: words, scale and min cover the indices written (resized above).
    unsafe {
        mk_emu_quant_keys(
            rows.as_ptr(),
            int(g),
            int(d),
            bits as c_int,
            int(t0),
            words.as_mut_ptr(),
            scale.as_mut_ptr().cast(),
            min.as_mut_ptr().cast(),
            1,
        );
    }
}

/// Quantizes value rows `[n][d]` per token (groups of `g` channels) at token
/// index `t0`; scales and minimums fp16 bits `[d / g][cap]`.
#[allow(clippy::too_many_arguments)]
pub fn quant_values(
    rows: &[f32],
    n: usize,
    d: usize,
    g: usize,
    bits: u32,
    t0: usize,
    cap: usize,
    words: &mut [u32],
    scale: &mut [u16],
    min: &mut [u16],
) {
    let p = 32 / bits as usize;
    assert!(rows.len() == n * d && t0 + n <= cap && d.is_multiple_of(g) && d.is_multiple_of(p));
    assert!(words.len() >= cap * d / p && scale.len() >= d / g * cap && min.len() == scale.len());
    // SAFETY: lengths asserted above.
    unsafe {
        mk_emu_quant_values(
            rows.as_ptr(),
            int(n),
            int(d),
            int(g),
            bits as c_int,
            int(t0),
            int(cap),
            words.as_mut_ptr(),
            scale.as_mut_ptr().cast(),
            min.as_mut_ptr().cast(),
            1,
        );
    }
}

/// Fused decode of one query per head `q [Hq][d]` over `heads` (one per KV
/// head), split into chunks of `chunk` tokens; returns `[Hq][d]`.
///
/// # Safety
/// Every pointer in `heads` must be valid for the lengths its counts imply.
pub unsafe fn decode(q: &[f32], heads: &[MkHead], hq: usize, d: usize, chunk: usize) -> Vec<f32> {
    assert!(d <= MAX_HEAD_DIM && !heads.is_empty() && hq.is_multiple_of(heads.len()) && chunk > 0);
    assert_eq!(q.len(), hq * d);
    let mut out = vec![0.0f32; hq * d];
    // SAFETY: the caller vouches for the heads; q and out have Hq * d floats.
    unsafe {
        mk_emu_decode(
            q.as_ptr(),
            heads.as_ptr(),
            int(hq),
            int(heads.len()),
            int(d),
            1.0 / (d as f32).sqrt(),
            int(chunk),
            out.as_mut_ptr(),
        );
    }
    out
}

/// The kernels' f32 -> fp16 conversion (round to nearest even).
pub fn f32_to_f16_bits(x: f32) -> u16 {
    // SAFETY: a pure function.
    unsafe { mk_emu_f2h(x) }
}

/// The kernels' fp16 -> f32 conversion.
pub fn f16_bits_to_f32(h: u16) -> f32 {
    // SAFETY: a pure function.
    unsafe { mk_emu_h2f(h) }
}
