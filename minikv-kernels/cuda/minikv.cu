// minikv's CUDA kernels. The same source compiles with NVRTC for the GPU and,
// with emulate.h, with the host C++ compiler (tests on machines without a GPU).
// It uses no CUDA header: fp16 conversions are written out (exact,
// round-to-nearest-even), so NVRTC needs no include path.
//
// Layouts (float32 unless noted; `d` = head dim, `g` = query heads per KV head):
//   prefill q, out [Hq][n][d]; keys, values [Hkv][t][d]; lse [Hq][n];
//   A_cumul [Hq][t]. Query i sits at position t - n + i and sees keys
//   lo(i) ..= t - n + i, lo = 0 or, with a window w > 0, t - n + i + 1 - w.
//   Quantized stores (the CPU store's layout, bit for bit; P = 32 / bits):
//   keys per channel: word (j / P) * d + c packs tokens of channel c, LSB
//   first; scale/min [j / G][d] as fp16 bits (or f32). Values per token:
//   token j owns d / P words; scale/min [j][d / G]. The device stores keep
//   these layouts; the word layout is the CPU store's, bit for bit.

#ifndef MK_THREADS
#define MK_THREADS 128
#endif
#define MK_MAX_D 256
#define MK_INF (__uint_as_float(0x7f800000u))
typedef unsigned long long mk_size;

__device__ __forceinline__ float mk_h2f(unsigned short h) {
  unsigned sign = (unsigned)(h & 0x8000u) << 16;
  unsigned exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  unsigned bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while ((man & 0x400u) == 0);
      bits = sign | ((unsigned)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return __uint_as_float(bits);
}

// f32 -> fp16 bits, round to nearest even (as `half::f16::from_f32`).
__device__ __forceinline__ unsigned short mk_f2h(float f) {
  unsigned x = __float_as_uint(f);
  unsigned sign = (x >> 16) & 0x8000u;
  unsigned absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return (unsigned short)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  if (absx >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds to inf
  if (absx < 0x38800000u) {  // subnormal or zero in fp16
    if (absx < 0x33000000u) return (unsigned short)sign;  // below half the smallest subnormal
    unsigned e = absx >> 23, m = (absx & 0x7fffffu) | 0x800000u;
    unsigned shift = 113 - e + 13;  // to the 10-bit subnormal mantissa
    unsigned r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return (unsigned short)(sign | r);
  }
  unsigned r = ((absx >> 13) - (112u << 10));
  unsigned rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return (unsigned short)(sign | r);
}

__device__ __forceinline__ float mk_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float mk_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Block-wide reduction (max when is_max, else sum); every thread gets the result.
__device__ __forceinline__ float mk_block_reduce(float v, float* scratch, bool is_max) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  v = is_max ? mk_warp_max(v) : mk_warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < nw; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();
  return r;
}

// 1. Prefill attention, one block per (query row, query head): online softmax
// over tiles of MK_THREADS keys (one key per thread), output and log-sum-exp.
extern "C" __global__ void mk_prefill_fwd(const float* __restrict__ q, const float* __restrict__ k,
                                          const float* __restrict__ v, float* __restrict__ out,
                                          float* __restrict__ lse, int n, int t, int d, int group,
                                          float scale, int window) {
  __shared__ float sq[MK_MAX_D];
  __shared__ float sp[MK_THREADS];
  __shared__ float red[MK_THREADS / 32];
  int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
  const float* kh = k + (mk_size)(h / group) * t * d;
  const float* vh = v + (mk_size)(h / group) * t * d;
  const float* qi = q + ((mk_size)h * n + i) * d;
  for (int c = tid; c < d; c += nt) sq[c] = qi[c] * scale;
  __syncthreads();
  int pos = t - n + i;
  int lo = window > 0 ? (pos + 1 - window > 0 ? pos + 1 - window : 0) : 0;
  float acc[MK_MAX_D / 32];
  for (int r = 0; r < MK_MAX_D / 32; ++r) acc[r] = 0.f;
  float m = -MK_INF, l = 0.f;
  for (int j0 = lo; j0 <= pos; j0 += nt) {
    int j = j0 + tid;
    float s = -MK_INF;
    if (j <= pos) {
      const float* kj = kh + (mk_size)j * d;
      float dot = 0.f;
      for (int c = 0; c < d; ++c) dot += sq[c] * kj[c];
      s = dot;
    }
    float mt = mk_block_reduce(s, red, true);
    float mnew = fmaxf(m, mt);
    float p = (j <= pos) ? __expf(s - mnew) : 0.f;
    sp[tid] = p;
    float sum = mk_block_reduce(p, red, false);  // its barriers also publish sp
    float alpha = __expf(m - mnew);
    l = l * alpha + sum;
    m = mnew;
    int nk = pos - j0 + 1 < nt ? pos - j0 + 1 : nt;
    for (int r = 0, c = tid; c < d; ++r, c += nt) {
      float a = acc[r] * alpha;
      for (int jj = 0; jj < nk; ++jj) a += sp[jj] * vh[(mk_size)(j0 + jj) * d + c];
      acc[r] = a;
    }
    __syncthreads();
  }
  float* oi = out + ((mk_size)h * n + i) * d;
  for (int r = 0, c = tid; c < d; ++r, c += nt) oi[c] = acc[r] / l;
  if (tid == 0) lse[(mk_size)h * n + i] = m + __logf(l);
}

// 2. Column sums of the causal softmax (MiniKV's A_cumul; SnapKV's window
// scores with i_begin = n - W): one thread per key, looping over the query rows
// that see it, so no two threads write one column (no atomics, no races), and
// the extra memory is the O(T) log-sum-exp of pass 1. Adds into `cumul`.
extern "C" __global__ void mk_column_sums(const float* __restrict__ q, const float* __restrict__ k,
                                          const float* __restrict__ lse, float* __restrict__ cumul,
                                          int n, int t, int d, int group, float scale, int window,
                                          int i_begin, int i_end) {
  __shared__ float sq[MK_MAX_D];
  int h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
  int j = blockIdx.x * nt + tid;
  const float* kj = k + ((mk_size)(h / group) * t + (j < t ? j : 0)) * d;
  float acc = 0.f;
  for (int i = i_begin; i < i_end; ++i) {
    const float* qi = q + ((mk_size)h * n + i) * d;
    for (int c = tid; c < d; c += nt) sq[c] = qi[c] * scale;
    __syncthreads();
    int pos = t - n + i;
    int lo = window > 0 ? (pos + 1 - window > 0 ? pos + 1 - window : 0) : 0;
    if (j < t && j <= pos && j >= lo) {
      float dot = 0.f;
      for (int c = 0; c < d; ++c) dot += sq[c] * kj[c];
      acc += __expf(dot - lse[(mk_size)h * n + i]);
    }
    __syncthreads();
  }
  if (j < t) cumul[(mk_size)h * t + j] += acc;
}

// SnapKV pooling with `same` padding over rows of length `len` (stride
// `stride`): mode 0 = max (-inf padding), 1 = average (zero padding counted).
extern "C" __global__ void mk_pool1d(const float* __restrict__ in, float* __restrict__ out,
                                     int rows, int len, int stride, int kernel, int mode) {
  int j = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
  if (j >= len || r >= rows) return;
  int rad = kernel / 2, lo = j - rad < 0 ? 0 : j - rad, hi = j + rad > len - 1 ? len - 1 : j + rad;
  const float* x = in + (mk_size)r * stride;
  float acc = mode == 0 ? -MK_INF : 0.f;
  for (int i = lo; i <= hi; ++i) acc = mode == 0 ? fmaxf(acc, x[i]) : acc + x[i];
  out[(mk_size)r * stride + j] = mode == 0 ? acc : acc / (float)kernel;
}

// The CPU quantizer's code: ((x - min) / scale) clamped to [0, qmax], rounded
// half to even (IEEE division: NVRTC's default -prec-div=true).
// Input rows of the quantize kernels: f32 rows [n][d] (rows_f16 = 0, the
// host's rows uploaded), or fp16 rows of a device store's ring (rows_f16 =
// 1: a quantized cache's residual quantized in place when it flushes), row i
// at slot (r0 + i) % rcap. Element (i, c):
__device__ __forceinline__ float mk_row(const void* rows, int rows_f16, int r0, int rcap, int i,
                                        int c, int d) {
  mk_size r = (mk_size)r0 + i;
  if (r >= (mk_size)rcap) r -= rcap;
  mk_size at = r * d + c;
  return rows_f16 ? mk_h2f(((const unsigned short*)rows)[at]) : ((const float*)rows)[at];
}

__device__ __forceinline__ unsigned mk_code(float x, float mn, float sc, float qmax) {
  float r = (x - mn) / sc;
  r = fminf(fmaxf(r, 0.f), qmax);
  return (unsigned)rintf(r);
}

// Stores a (scale, min) pair as the CPU store does: fp16 (rounded) or f32.
__device__ __forceinline__ void mk_store_pair(void* sc, void* mn, mk_size idx, float s, float m,
                                              int f16) {
  if (f16) {
    ((unsigned short*)sc)[idx] = mk_f2h(s);
    ((unsigned short*)mn)[idx] = mk_f2h(m);
  } else {
    ((float*)sc)[idx] = s;
    ((float*)mn)[idx] = m;
  }
}

// 3a. Keys per channel: one group of `g` tokens (rows [g][d], first token
// index `t0`, a multiple of g), one thread per channel (each owns its words).
extern "C" __global__ void mk_quant_keys_channel(const void* __restrict__ rows, int rows_f16,
                                                 int r0, int rcap, int g, int d, int bits, int t0,
                                                 unsigned* __restrict__ words, void* scale,
                                                 void* minv, int f16) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= d) return;
  int p = 32 / bits;
  float qmax = (float)((1u << bits) - 1);
  float mn = MK_INF, mx = -MK_INF;
  for (int i = 0; i < g; ++i) {
    float x = mk_row(rows, rows_f16, r0, rcap, i, c, d);
    mn = fminf(mn, x);
    mx = fmaxf(mx, x);
  }
  float sc = (mx - mn) / qmax;
  mk_store_pair(scale, minv, (mk_size)(t0 / g) * d + c, sc, mn, f16);
  if (!(sc > 0.f)) return;
  for (int i = 0; i < g; ++i) {
    int tok = t0 + i;
    unsigned code = mk_code(mk_row(rows, rows_f16, r0, rcap, i, c, d), mn, sc, qmax);
    words[(mk_size)(tok / p) * d + c] |= code << (bits * (tok % p));
  }
}

// 3b. Per token (values; keys in the per-token ablation): rows [n][d]
// appended at token index `t0`; one thread per token (its words and scales
// are its own). Scales and minimums [token][d / g].
extern "C" __global__ void mk_quant_values_token(const void* __restrict__ rows, int rows_f16,
                                                 int r0, int rcap, int n, int d, int g, int bits, int t0,
                                                 unsigned* __restrict__ words, void* scale,
                                                 void* minv, int f16) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int p = 32 / bits, wpt = d / p;
  float qmax = (float)((1u << bits) - 1);
  unsigned* w = words + (mk_size)(t0 + i) * wpt;
  for (int k = 0; k < wpt; ++k) w[k] = 0u;
  for (int gi = 0; gi < d / g; ++gi) {
    float mn = MK_INF, mx = -MK_INF;
    for (int c = gi * g; c < (gi + 1) * g; ++c) {
      float xc = mk_row(rows, rows_f16, r0, rcap, i, c, d);
      mn = fminf(mn, xc);
      mx = fmaxf(mx, xc);
    }
    float sc = (mx - mn) / qmax;
    mk_store_pair(scale, minv, (mk_size)(t0 + i) * (d / g) + gi, sc, mn, f16);
    if (!(sc > 0.f)) continue;
    for (int c = gi * g; c < (gi + 1) * g; ++c)
      w[c / p] |= mk_code(mk_row(rows, rows_f16, r0, rcap, i, c, d), mn, sc, qmax) << (bits * (c % p));
  }
}

// One quantized tensor of a decode head (keys or values), in the layouts of
// the quantize kernels above: axis 0 = per channel (groups of `group` tokens;
// word (j / P) * d + c, scale/min [j / group][d]), axis 1 = per token (groups
// of `group` channels; token j owns d / P words, scale/min [j][d / group]).
// Scales and minimums are fp16 bits (f16 = 1) or f32. i8 = 1 on per-channel
// 2- or 4-bit keys asks the fast decode kernels for integer key products
// (`arithmetic = "int8"`: mk_key_tile_i8); the other kernels ignore it.
struct MkQuant {
  const unsigned* words;
  const void* scale;
  const void* minv;
  int n, group, bits, axis, f16, i8;
};

// One decode head: quantized keys and values, fp16 residual rows, extra
// entries with a logit bias. Tokens: the quantized part first, then the
// residual (keys and values may split differently).
struct MkHead {
  MkQuant k, v;
  const unsigned short* fk;  // fp16 residual keys: len - k.n rows of a ring
  const unsigned short* fv;  // fp16 residual values: len - v.n rows of a ring
  int len;
  int fk0, fkcap, fv0, fvcap;  // residual row i at slot (f?0 + i) % f?cap
  const unsigned short* ek;  // extra entries: keys, values [n_extra][d], bias
  const unsigned short* ev;
  const float* ebias;
  int n_extra;
};

__device__ __forceinline__ float mk_deq(const MkQuant& z, int j, int c, int d) {
  int p = 32 / z.bits;
  unsigned mask = (1u << z.bits) - 1u, code;
  mk_size s;
  if (z.axis == 0) {
    code = (z.words[(mk_size)(j / p) * d + c] >> (z.bits * (j % p))) & mask;
    s = (mk_size)(j / z.group) * d + c;
  } else {
    code = (z.words[(mk_size)j * (d / p) + c / p] >> (z.bits * (c % p))) & mask;
    s = (mk_size)j * (d / z.group) + c / z.group;
  }
  float sc, mn;
  if (z.f16) {
    sc = mk_h2f(((const unsigned short*)z.scale)[s]);
    mn = mk_h2f(((const unsigned short*)z.minv)[s]);
  } else {
    sc = ((const float*)z.scale)[s];
    mn = ((const float*)z.minv)[s];
  }
  return (float)code * sc + mn;
}

// Token j's fp16 row, j >= n (the quantized tokens before the ring): a
// residual ring row (slot (r0 + j - n) % cap) or extra entry j - len.
__device__ __forceinline__ const unsigned short* mk_fp_row(const unsigned short* ring, int r0,
                                                           int cap, int n,
                                                           const unsigned short* extra, int len,
                                                           int j, int d) {
  if (j < len) {
    int r = j - n + r0;
    if (r >= cap) r -= cap;
    return ring + (mk_size)r * d;
  }
  return extra + (mk_size)(j - len) * d;
}

__device__ __forceinline__ float mk_key(const MkHead& hd, int j, int c, int d) {
  if (j < hd.k.n) return mk_deq(hd.k, j, c, d);
  return mk_h2f(mk_fp_row(hd.fk, hd.fk0, hd.fkcap, hd.k.n, hd.ek, hd.len, j, d)[c]);
}

__device__ __forceinline__ float mk_value(const MkHead& hd, int j, int c, int d) {
  if (j < hd.v.n) return mk_deq(hd.v, j, c, d);
  return mk_h2f(mk_fp_row(hd.fv, hd.fv0, hd.fvcap, hd.v.n, hd.ev, hd.len, j, d)[c]);
}

// 4a. Fused decode, split over tokens (flash-decoding): block (split s, query
// head h) attends over tokens [s * chunk, (s + 1) * chunk) of its KV head
// (extra entries included, with their bias) and writes a partial (m, l, acc).
// With `logits` non-null, the scaled logits of the head's tokens (extra
// entries excluded) go to logits[h * lstride + j] (probabilities on request).
extern "C" __global__ void mk_decode_partial(const float* __restrict__ q, const MkHead* heads,
                                             int d, int group, float scale, int chunk,
                                             float* __restrict__ pm, float* __restrict__ pl,
                                             float* __restrict__ pacc, float* __restrict__ logits,
                                             int lstride) {
  __shared__ float sq[MK_MAX_D];
  __shared__ float sp[MK_THREADS];
  __shared__ float red[MK_THREADS / 32];
  int s = blockIdx.x, h = blockIdx.y, ns = gridDim.x, tid = threadIdx.x, nt = blockDim.x;
  const MkHead& hd = heads[h / group];
  int total = hd.len + hd.n_extra;
  int begin = s * chunk, end = begin + chunk < total ? begin + chunk : total;
  for (int c = tid; c < d; c += nt) sq[c] = q[(mk_size)h * d + c] * scale;
  __syncthreads();
  float acc[MK_MAX_D / 32];
  for (int r = 0; r < MK_MAX_D / 32; ++r) acc[r] = 0.f;
  float m = -MK_INF, l = 0.f;
  for (int j0 = begin; j0 < end; j0 += nt) {
    int j = j0 + tid;
    float sc = -MK_INF;
    if (j < end) {
      float dot = 0.f;
      for (int c = 0; c < d; ++c) dot += sq[c] * mk_key(hd, j, c, d);
      sc = dot + (j >= hd.len ? hd.ebias[j - hd.len] : 0.f);
      if (logits && j < hd.len) logits[(mk_size)h * lstride + j] = sc;
    }
    float mt = mk_block_reduce(sc, red, true);
    float mnew = fmaxf(m, mt);
    float p = j < end ? __expf(sc - mnew) : 0.f;
    sp[tid] = p;
    float sum = mk_block_reduce(p, red, false);
    float alpha = m == -MK_INF ? 0.f : __expf(m - mnew);
    l = l * alpha + sum;
    m = mnew;
    int nk = end - j0 < nt ? end - j0 : nt;
    for (int r = 0, c = tid; c < d; ++r, c += nt) {
      float a = acc[r] * alpha;
      for (int jj = 0; jj < nk; ++jj) a += sp[jj] * mk_value(hd, j0 + jj, c, d);
      acc[r] = a;
    }
    __syncthreads();
  }
  mk_size slot = (mk_size)h * ns + s;
  for (int r = 0, c = tid; c < d; ++r, c += nt) pacc[slot * d + c] = acc[r];
  if (tid == 0) {
    pm[slot] = m;
    pl[slot] = l;
  }
}

// 4b. The exact combination of the splits: out_h = sum_s e^(m_s - M) acc_s /
// sum_s e^(m_s - M) l_s. Block (query head h, slice y of 32 channels); its
// threads are (channel lane, split lane): M and the denominator by block
// reductions, then the weights e^(m_s - M) of a tile of splits once into
// shared memory and each split lane's share of the tile's rows (coalesced
// over channels), the split lanes' sums added in lane order (deterministic).
// The host gives a block 4 to 32 split lanes (blockDim.x = 32 x lanes, about
// 16 splits a lane): with a long cache's hundreds of splits, a block of 4
// warps walking them one load at a time is latency-bound (at 128K tokens
// and 32 heads of 128, 128 blocks of 4 warps: some 4 warps an SM for 8 MB of
// partial sums); 32 warps an SM, four loads a thread, keep 32 times the
// loads in flight.
// With `lse` non-null, the head's log-sum-exp M + log(sum_s e^(m_s - M) l_s)
// goes to lse[h]. A head with no token and no extra entry (every split
// empty): output 0 and log-sum-exp -inf, as the CPU backends give (never
// 0 / 0).
// (The emulation takes tiles of 64 so that its tests, at most a few hundred
// splits, cross tile boundaries.)
#ifdef MK_EMULATED
#define MK_COMBINE_TILE 64
#else
#define MK_COMBINE_TILE 1024
#endif
#define MK_COMBINE_MAX_THREADS 1024
extern "C" __global__ void __launch_bounds__(MK_COMBINE_MAX_THREADS)
    mk_decode_combine(const float* __restrict__ pm, const float* __restrict__ pl,
                      const float* __restrict__ pacc, int splits, int d, float* __restrict__ out,
                      float* __restrict__ lse) {
  __shared__ float sw[MK_COMBINE_TILE];
  __shared__ float red[MK_COMBINE_MAX_THREADS / 32];
  __shared__ float part[MK_COMBINE_MAX_THREADS];
  int h = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
  int lane = tid % 32, sl = tid / 32, nsl = nt / 32, c = blockIdx.y * 32 + lane;
  const float* mh = pm + (mk_size)h * splits;
  const float* lh = pl + (mk_size)h * splits;
  float mx = -MK_INF;
  for (int s = tid; s < splits; s += nt) mx = fmaxf(mx, mh[s]);
  mx = mk_block_reduce(mx, red, true);
  // Each weight once: into the tile, and into this thread's share of the
  // denominator (summed over the block after the last tile).
  float z = 0.f, a = 0.f;
  for (int s0 = 0; s0 < splits; s0 += MK_COMBINE_TILE) {
    int n = splits - s0 < MK_COMBINE_TILE ? splits - s0 : MK_COMBINE_TILE;
    __syncthreads();  // the previous tile's weights are no longer read
    for (int i = tid; i < n; i += nt) {
      float m = mh[s0 + i], w = m == -MK_INF ? 0.f : __expf(m - mx);
      sw[i] = w;
      z += w * lh[s0 + i];
    }
    __syncthreads();
    if (c < d) {
      // Four rows' loads issued before their sums (a loop unrolled by the
      // compiler tests its bound between a load and the next: one load in
      // flight); the sums in split order, as one row at a time.
      const float* col = pacc + ((mk_size)h * splits + s0) * d + c;
      for (int i = sl; i < n; i += 4 * nsl) {
        float x[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) x[u] = i + u * nsl < n ? col[(mk_size)(i + u * nsl) * d] : 0.f;
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (i + u * nsl < n) a += sw[i + u * nsl] * x[u];
      }
    }
  }
  z = mk_block_reduce(z, red, false);
  part[tid] = a;
  __syncthreads();
  if (sl == 0 && c < d) {
    float t = 0.f;
    for (int k = 0; k < nsl; ++k) t += part[k * 32 + lane];
    out[(mk_size)h * d + c] = z > 0.f ? t / z : 0.f;
  }
  if (lse && blockIdx.y == 0 && tid == 0) lse[h] = z > 0.f ? mx + __logf(z) : -MK_INF;
}

// 5. Batched copies: entry e copies `bytes` bytes from src to dst (one block
// per entry). The host packs many small uploads into one buffer (the table,
// then the payload its entries point into) and queues small device-to-device
// moves beside them, so that a decode step makes one host-to-device copy
// instead of one per row. No entry reads or writes bytes another writes (the
// host flushes before queuing such an entry).
struct MkCopy {
  unsigned char* dst;
  const unsigned char* src;
  unsigned long long bytes;
};
extern "C" __global__ void mk_scatter(const MkCopy* __restrict__ table) {
  MkCopy e = table[blockIdx.x];
  const unsigned char* s = e.src;
  if ((((unsigned long long)e.dst | (unsigned long long)e.src | e.bytes) & 3ull) == 0ull) {
    const unsigned* s4 = (const unsigned*)s;
    unsigned* d4 = (unsigned*)e.dst;
    for (mk_size i = threadIdx.x; i < e.bytes / 4; i += blockDim.x) d4[i] = s4[i];
  } else {
    for (mk_size i = threadIdx.x; i < e.bytes; i += blockDim.x) e.dst[i] = s[i];
  }
}
