
// 4c. Fused decode, the fast path for the common layouts: quantized keys per
// channel (or none), quantized values per token with scale groups of whole
// 8-channel columns (or none), fp16 residual rows and extra entries, head
// dims 16, 32, 64, 128 or 256 (the host picks mk_decode_partial otherwise).
// Block (split s, y = KV head * slices + slice) reads its KV head's tokens
// [s * chunk, (s + 1) * chunk) once for up to MK_G query heads of the group
// (mk_decode_partial reads them once per query head), and writes the same
// partial (m, l, acc) per query head, so mk_decode_combine is shared.
//   1. scores: one token per thread; a quantized key's channel is dequantized
//      once and multiplied with the MK_G queries (in shared memory, channel
//      major); codes become floats by the exponent trick (2^23 + code, minus
//      2^23: exact), not by a slow integer conversion; fp16 rows are read 16
//      bytes (eight halves) at a time and converted by the hardware.
//   2. softmax over the chunk: one warp per query head (max, then e^(s - m)
//      and its sum), no rescaling (a block holds one chunk).
//   3. values: thread (column of 8 channels, token lane); a quantized token
//      folds its column's scale into the probabilities (p s code) and its
//      minimum into one sum per head (p m, added to every channel at the
//      end), so a code costs one fused multiply-add per query head; the
//      token lanes' sums are added in shared memory in a fixed order (no
//      atomics: deterministic).
// Every chunk has the same size on the host (DECODE_CHUNK = MK_CHUNK).

#define MK_G 4
#define MK_CHUNK 256
#define MK_COL 8
#define MK_RED (MK_COL * MK_G + MK_G)

// fp16 bits to f32: the hardware conversion on a GPU (exact, as the software
// one the emulation uses).
__device__ __forceinline__ float mk_h2f_fast(unsigned short h) {
#ifdef MK_EMULATED
  return mk_h2f(h);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

// Eight fp16 (16 bytes) of a row in one load (rows start 16-byte aligned:
// the host checks).
struct alignas(16) mk_u4 {
  unsigned w[4];
};
__device__ __forceinline__ mk_u4 mk_ld16(const unsigned* p) {
#ifdef MK_EMULATED
  mk_u4 r;
  std::memcpy(&r, p, 16);
  return r;
#else
  return *(const mk_u4*)p;
#endif
}

// A code (< 2^23) as a float: the bits of 2^23 + code, minus 2^23 (exact).
__device__ __forceinline__ float mk_codef(unsigned code) {
  return __uint_as_float(0x4B000000u | code) - 8388608.0f;
}

__device__ __forceinline__ float mk_scale_at(const void* p, mk_size i, int f16) {
  return f16 ? mk_h2f_fast(((const unsigned short*)p)[i]) : ((const float*)p)[i];
}

// dot[g] = sum_c sq[c][g] k_c for quantized key j (per channel, BITS bits).
template <int BITS>
__device__ __forceinline__ void mk_dot_quant(const MkQuant& z, int j, int d,
                                             const float (*sq)[MK_G], float* dot) {
  const int P = 32 / BITS;
  const unsigned mask = (1u << BITS) - 1u;
  const unsigned* w = z.words + (mk_size)(j / P) * d;
  int sh = BITS * (j % P);
  mk_size s0 = (mk_size)(j / z.group) * d;
  for (int c = 0; c < d; ++c) {
    float k = mk_codef((w[c] >> sh) & mask) * mk_scale_at(z.scale, s0 + c, z.f16) +
              mk_scale_at(z.minv, s0 + c, z.f16);
    for (int g = 0; g < MK_G; ++g) dot[g] += sq[c][g] * k;
  }
}

__device__ __forceinline__ void mk_dot_fp(const unsigned* row, int d, const float (*sq)[MK_G],
                                          float* dot) {
  for (int c0 = 0; c0 < d; c0 += 8) {
    mk_u4 x = mk_ld16(row + c0 / 2);
    for (int i = 0; i < 4; ++i) {
      int c = c0 + 2 * i;
      float k0 = mk_h2f_fast((unsigned short)(x.w[i] & 0xffffu));
      float k1 = mk_h2f_fast((unsigned short)(x.w[i] >> 16));
      for (int g = 0; g < MK_G; ++g) dot[g] += sq[c][g] * k0 + sq[c + 1][g] * k1;
    }
  }
}

// acc[e][g] += p[g] s code_e and macc[g] += p[g] m over the MK_COL channels
// of the column at c0 of quantized value j (per token, BITS bits; a column
// lies in one scale group and, at 2 and 4 bits, in one word).
template <int BITS>
__device__ __forceinline__ void mk_acc_quant(const MkQuant& z, int j, int d, int c0,
                                             const float* p, float (*acc)[MK_G], float* macc) {
  const int P = 32 / BITS;
  const unsigned mask = (1u << BITS) - 1u;
  const unsigned* w = z.words + (mk_size)j * (d / P);
  mk_size si = (mk_size)j * (d / z.group) + c0 / z.group;
  float sc = mk_scale_at(z.scale, si, z.f16), mn = mk_scale_at(z.minv, si, z.f16);
  float ps[MK_G];
  for (int g = 0; g < MK_G; ++g) {
    ps[g] = p[g] * sc;
    macc[g] += p[g] * mn;
  }
  for (int i = 0; i < (P >= MK_COL ? 1 : MK_COL / P); ++i) {
    // At 2 and 4 bits the column is MK_COL codes of one word from bit
    // BITS * (c0 % P); at 8 bits, MK_COL / P whole words.
    unsigned x = P >= MK_COL ? w[c0 / P] >> (BITS * (c0 % P)) : w[c0 / P + i];
    for (int e = 0; e < (P >= MK_COL ? MK_COL : P); ++e) {
      float cf = mk_codef((x >> (BITS * e)) & mask);
      for (int g = 0; g < MK_G; ++g) acc[i * P + e][g] += ps[g] * cf;
    }
  }
}

__device__ __forceinline__ void mk_acc_fp(const unsigned* row, int c0, const float* p,
                                          float (*acc)[MK_G]) {
  mk_u4 x = mk_ld16(row + c0 / 2);  // MK_COL = 8 channels: one load
  for (int i = 0; i < MK_COL / 2; ++i) {
    float v0 = mk_h2f_fast((unsigned short)(x.w[i] & 0xffffu));
    float v1 = mk_h2f_fast((unsigned short)(x.w[i] >> 16));
    for (int g = 0; g < MK_G; ++g) {
      acc[2 * i][g] += p[g] * v0;
      acc[2 * i + 1][g] += p[g] * v1;
    }
  }
}

// Launch bounds: 5 resident blocks of 128 threads per SM (at most 102
// registers; ptxas gives 96 without spills, tests/nvrtc.rs holds it there).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 5)
    mk_decode_fast(const float* __restrict__ q, const MkHead* heads, int d, int group, float scale,
                   int chunk, float* __restrict__ pm, float* __restrict__ pl,
                   float* __restrict__ pacc, float* __restrict__ logits, int lstride) {
  __shared__ float sq[MK_MAX_D][MK_G];
  __shared__ float sp[MK_CHUNK][MK_G];
  __shared__ float red[MK_THREADS][MK_RED];
  __shared__ float sm[MK_G], sl[MK_G];
  int s = blockIdx.x, ns = gridDim.x, tid = threadIdx.x, nt = blockDim.x;
  int slices = (group + MK_G - 1) / MK_G;
  int kvh = blockIdx.y / slices, g0 = (int)(blockIdx.y % slices) * MK_G;
  int gn = group - g0 < MK_G ? group - g0 : MK_G;
  const MkHead hd = heads[kvh];
  int total = hd.len + hd.n_extra;
  int begin = s * chunk, end = begin + chunk < total ? begin + chunk : total;
  int h0 = kvh * group + g0;  // the block's first query head
  for (int i = tid; i < d * MK_G; i += nt) {
    int c = i / MK_G, g = i % MK_G;
    sq[c][g] = g < gn ? q[(mk_size)(h0 + g) * d + c] * scale : 0.f;
  }
  __syncthreads();

  // 1. Scores.
  for (int jl = tid; jl < chunk; jl += nt) {
    int j = begin + jl;
    float dot[MK_G];
    for (int g = 0; g < MK_G; ++g) dot[g] = 0.f;
    if (j < end) {
      if (j < hd.k.n) {
        if (hd.k.bits == 2) mk_dot_quant<2>(hd.k, j, d, sq, dot);
        else if (hd.k.bits == 4) mk_dot_quant<4>(hd.k, j, d, sq, dot);
        else mk_dot_quant<8>(hd.k, j, d, sq, dot);
      } else {
        const unsigned short* row = mk_fp_row(hd.fk, hd.fk0, hd.fkcap, hd.k.n, hd.ek, hd.len, j, d);
        mk_dot_fp((const unsigned*)row, d, sq, dot);
      }
      float bias = j >= hd.len ? hd.ebias[j - hd.len] : 0.f;
      for (int g = 0; g < MK_G; ++g) {
        dot[g] += bias;
        if (logits && j < hd.len && g < gn) logits[(mk_size)(h0 + g) * lstride + j] = dot[g];
      }
    } else {
      for (int g = 0; g < MK_G; ++g) dot[g] = -MK_INF;
    }
    for (int g = 0; g < MK_G; ++g) sp[jl][g] = dot[g];
  }
  __syncthreads();

  // 2. Softmax over the chunk, one warp per query head.
  int warp = tid / 32, lane = tid % 32;
  if (warp < MK_G) {
    float mx = -MK_INF;
    for (int jl = lane; jl < chunk; jl += 32) mx = fmaxf(mx, sp[jl][warp]);
    mx = mk_warp_max(mx);
    float sum = 0.f;
    for (int jl = lane; jl < chunk; jl += 32) {
      float p = mx == -MK_INF ? 0.f : __expf(sp[jl][warp] - mx);
      sp[jl][warp] = p;
      sum += p;
    }
    sum = mk_warp_sum(sum);
    if (lane == 0) {
      sm[warp] = mx;
      sl[warp] = sum;
    }
  }
  __syncthreads();

  // 3. Values.
  int cols = d / MK_COL, lanes = nt / cols;
  int col = tid % cols, tl = tid / cols, c0 = col * MK_COL;
  float acc[MK_COL][MK_G], macc[MK_G];
  for (int e = 0; e < MK_COL; ++e)
    for (int g = 0; g < MK_G; ++g) acc[e][g] = 0.f;
  for (int g = 0; g < MK_G; ++g) macc[g] = 0.f;
  for (int jl = tl; jl < end - begin; jl += lanes) {
    int j = begin + jl;
    float p[MK_G];
    for (int g = 0; g < MK_G; ++g) p[g] = sp[jl][g];
    if (j < hd.v.n) {
      if (hd.v.bits == 2) mk_acc_quant<2>(hd.v, j, d, c0, p, acc, macc);
      else if (hd.v.bits == 4) mk_acc_quant<4>(hd.v, j, d, c0, p, acc, macc);
      else mk_acc_quant<8>(hd.v, j, d, c0, p, acc, macc);
    } else {
      const unsigned short* row = mk_fp_row(hd.fv, hd.fv0, hd.fvcap, hd.v.n, hd.ev, hd.len, j, d);
      mk_acc_fp((const unsigned*)row, c0, p, acc);
    }
  }
  for (int e = 0; e < MK_COL; ++e)
    for (int g = 0; g < MK_G; ++g) red[tid][e * MK_G + g] = acc[e][g];
  for (int g = 0; g < MK_G; ++g) red[tid][MK_COL * MK_G + g] = macc[g];
  __syncthreads();
  for (int o = tid; o < gn * d; o += nt) {
    int g = o / d, c = o % d, cl = c / MK_COL, e = c % MK_COL;
    float a = 0.f;
    for (int t = 0; t < lanes; ++t) {
      const float* r = red[t * cols + cl];
      a += r[e * MK_G + g] + r[MK_COL * MK_G + g];
    }
    pacc[((mk_size)(h0 + g) * ns + s) * d + c] = a;
  }
  if (tid < gn) {
    mk_size slot = (mk_size)(h0 + tid) * ns + s;
    pm[slot] = sm[tid];
    pl[slot] = sl[tid];
  }
}
