
// 4c. Fused decode, the fast path for the common layouts: quantized keys per
// channel (or none), quantized values per token with scale groups of whole
// 8-channel columns (or none), fp16 residual rows and extra entries, head
// dims 16, 32, 64, 128 or 256 (compiled for each: the channel loops unroll,
// so a thread's loads are issued together; the host picks
// mk_decode_partial otherwise).
// Block (split s, y = KV head * slices + slice) reads its KV head's tokens
// [s * chunk, (s + 1) * chunk) once for up to MK_G query heads of the group
// (mk_decode_partial reads them once per query head), and writes the same
// partial (m, l, acc) per query head, so mk_decode_combine is shared.
//   1. scores. Quantized keys by warp tiles of 16 tokens (mk_key_tile): a
//      lane reads 4 channels' words (16 tokens each) and their scales at
//      once, folds each channel's scale into the MK_G queries (in shared
//      memory, a channel's four in 16 bytes, rows padded against bank
//      conflicts: mk_sqr) for its 4 tokens and its minimum into one sum per
//      head, and 8 lanes' partial sums are added by shuffles. fp16 rows
//      (the residual, extra entries, an fp16 cache): one token per thread,
//      the row read 16 bytes (eight halves) at a time and converted by the
//      hardware. Codes become floats by the exponent trick (2^23 + code,
//      minus 2^23: exact), not by a slow integer conversion.
//   2. softmax over the chunk: one warp per query head (max, then e^(s - m)
//      and its sum), no rescaling (a block holds one chunk).
//   3. values: thread (column of 8 channels, token lane), MK_UNROLL tokens'
//      loads issued before their sums; a quantized token folds its column's
//      scale into the probabilities (p s code) and its minimum into one sum
//      per head (p m, added to every channel at the end), so a code costs
//      one fused multiply-add per query head; the token lanes' sums are
//      added in shared memory in a fixed order (no atomics: deterministic).
// Every chunk has the same size on the host (a multiple of 16 tokens, at
// most MK_CHUNK), so a chunk's quantized keys start on a tile boundary.

#define MK_G 4
#define MK_CHUNK 256
#define MK_COL 8
#define MK_RED (MK_COL * MK_G + MK_G)
#define MK_TILE 16
#define MK_UNROLL 4

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
struct alignas(8) mk_u2 {
  unsigned w[2];
};
// A channel's MK_G scaled query values (one 16-byte shared-memory load).
struct alignas(16) mk_f4 {
  float v[MK_G];
};
// The shared-memory row of channel c: a spare row after each lane's block of
// D / 8 channels, so that the 8 lanes of a key tile, each reading its own
// block, hit 8 different bank quads (unpadded, their rows D / 8 x 16 bytes
// apart fall in the same banks: 8-way conflicts on every query load).
template <int D>
__device__ __forceinline__ int mk_sqr(int c) {
  return c + c / (D / 8);
}
__device__ __forceinline__ mk_u4 mk_ld16(const unsigned* p) {
#ifdef MK_EMULATED
  mk_u4 r;
  std::memcpy(&r, p, 16);
  return r;
#else
  return *(const mk_u4*)p;
#endif
}

// N (1, 2 or 4) consecutive words in one load (p aligned to 4 N bytes: the
// host checks the stores' bases, the kernels' offsets keep it).
template <int N>
__device__ __forceinline__ void mk_ldn(const unsigned* p, unsigned* out) {
#ifdef MK_EMULATED
  std::memcpy(out, p, 4 * N);
#else
  if constexpr (N == 4) {
    mk_u4 v = *(const mk_u4*)p;
    for (int i = 0; i < 4; ++i) out[i] = v.w[i];
  } else if constexpr (N == 2) {
    mk_u2 v = *(const mk_u2*)p;
    out[0] = v.w[0];
    out[1] = v.w[1];
  } else {
    out[0] = *p;
  }
#endif
}

// N (2 or 4) scales or minimums from element i (a multiple of N) of p, fp16
// bits or f32, in one load.
template <int N>
__device__ __forceinline__ void mk_ld_scales(const void* p, mk_size i, int f16, float* out) {
  if (f16) {
    unsigned w[N / 2];
    mk_ldn<N / 2>((const unsigned*)((const unsigned short*)p + i), w);
    for (int k = 0; k < N / 2; ++k) {
      out[2 * k] = mk_h2f_fast((unsigned short)(w[k] & 0xffffu));
      out[2 * k + 1] = mk_h2f_fast((unsigned short)(w[k] >> 16));
    }
  } else {
    unsigned w[N];
    mk_ldn<N>((const unsigned*)((const float*)p + i), w);
    for (int k = 0; k < N; ++k) out[k] = __uint_as_float(w[k]);
  }
}

// The code of x's bits [k, k + BITS), times 2^k, as a float (< 2^23: exact):
// the bits of 2^23 + (x & (mask << k)), minus 2^23 (m = mask << k). One LOP3
// ((a & b) | c) and one FADD, where the code shifted down first,
// ((x >> k) & mask) | 2^23's bits, takes a shift and two LOP3s (ptxas does
// not fuse an AND and an OR of two constants).
__device__ __forceinline__ float mk_codef_at(unsigned x, unsigned m) {
#ifdef MK_EMULATED
  return __uint_as_float((x & m) | 0x4B000000u) - 8388608.0f;
#else
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(m), "r"(0x4B000000u));
  return __uint_as_float(r) - 8388608.0f;
#endif
}
// 2^k as a float, for |k| <= 126.
__device__ __forceinline__ float mk_pow2(int k) { return __uint_as_float((unsigned)(127 + k) << 23); }

// Where a quantized store's words, scales and minimums are read from: the
// store in global memory, or a block's copy in shared memory of the part its
// chunk reads (mk_decode_staged): word i of the store at words[i - wofs]
// (key words with their 16-byte units swizzled, mk_swz, when swz), scale or
// minimum i at [i - sofs].
struct MkQSrc {
  const unsigned* words;
  const void* scale;
  const void* minv;
  mk_size wofs, sofs;
  int swz;
};

__device__ __forceinline__ MkQSrc mk_global_src(const MkQuant& z) {
  return MkQSrc{z.words, z.scale, z.minv, 0, 0, 0};
}

// The two ways the tiles and value loops read a source: the fast kernel
// reads the store in place, its pointers loaded from the head's entry in
// shared memory where used (held in registers they would crowd out the
// loads in flight); the staged kernel reads an MkQSrc in shared memory.
struct MkInPlace {
  const MkQuant& z;
  __device__ __forceinline__ const unsigned* words() const { return z.words; }
  __device__ __forceinline__ const void* scale() const { return z.scale; }
  __device__ __forceinline__ const void* minv() const { return z.minv; }
  __device__ __forceinline__ mk_size wofs() const { return 0; }
  __device__ __forceinline__ mk_size sofs() const { return 0; }
  __device__ __forceinline__ bool swz() const { return false; }
};
struct MkStaged {
  const MkQSrc& s;
  __device__ __forceinline__ const unsigned* words() const { return s.words; }
  __device__ __forceinline__ const void* scale() const { return s.scale; }
  __device__ __forceinline__ const void* minv() const { return s.minv; }
  __device__ __forceinline__ mk_size wofs() const { return s.wofs; }
  __device__ __forceinline__ mk_size sofs() const { return s.sofs; }
  __device__ __forceinline__ bool swz() const { return s.swz != 0; }
};

// A staged key region's word i: 16-byte unit u is stored at unit
// u ^ ((u / 8) % 8), so that the 8 lanes of a key tile's quarter warp, each
// reading 16 bytes of its own block of channels in one row (D / 8 channels
// apart: on 2 bank quads unswizzled at d = 64 and 128, on 1 at 256), hit 8
// different bank quads. The XOR is constant on each aligned run of 8 units,
// so it maps every such run onto itself: the region is reserved in whole
// runs of 8 units.
__device__ __forceinline__ mk_size mk_swz(mk_size i) {
  mk_size u = i >> 2;
  return ((u ^ ((u >> 3) & 7)) << 2) | (i & 3);
}

__device__ __forceinline__ float mk_scale_at(const void* p, mk_size i, int f16) {
  return f16 ? mk_h2f_fast(((const unsigned short*)p)[i]) : ((const float*)p)[i];
}

// Lanes i and i ^ o (o = 4, 2, 1: within a group of 8) each hold N
// partial sums of the same N values: each keeps the half selected by its
// bit o, adds the other lane's copy of that half (sent in exchange for its
// own copy of the other half), and ends with N / 2 values in r[0, N / 2).
template <int N>
__device__ __forceinline__ void mk_halve(float* r, int lane, int o) {
  bool hi = (lane & o) != 0;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    float send = hi ? r[i] : r[i + N / 2];
    float keep = hi ? r[i + N / 2] : r[i];
    r[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
  }
}

// Where a key tile's lane starts reading (token jt, channel c0 of its
// block): its first word and scale (relative to the source) and the shift
// of token jt's code in the word.
struct MkTileAt {
  mk_size w0, s0;
  int sh;
};
template <int D, int BITS, class S>
__device__ __forceinline__ MkTileAt mk_tile_at(const MkQuant& z, const S& src, int jt, int c0) {
  constexpr int P = 32 / BITS;
  return MkTileAt{(mk_size)(jt / P) * D + c0 - src.wofs(),
                  (mk_size)(jt / z.group) * D + c0 - src.sofs(), BITS * (jt % P)};
}

// A key tile's loads of VW (1, 2 or 4) consecutive channels of one row:
// their words from word w (swizzled when staged so), scales and minimums
// from element s.
template <int VW, class S>
__device__ __forceinline__ void mk_tile_load(const MkQuant& z, const S& src, mk_size w, mk_size s,
                                            unsigned* wv, float* sc, float* mn) {
  mk_ldn<VW>(src.words() + (src.swz() ? mk_swz(w) : w), wv);
  if constexpr (VW >= 2) {
    mk_ld_scales<VW>(src.scale(), s, z.f16, sc);
    mk_ld_scales<VW>(src.minv(), s, z.f16, mn);
  } else {
    sc[0] = mk_scale_at(src.scale(), s, z.f16);
    mn[0] = mk_scale_at(src.minv(), s, z.f16);
  }
}

// Scores of the quantized keys (per channel, BITS bits) of the MK_TILE-token
// tile at j0 (a multiple of 16) for the block's MK_G query heads, by one
// warp: lane (tq, cb) = (lane / 8, lane % 8) takes tokens j0 + 4 tq .. + 3
// (one word per channel: 4 | P, and one scale group: 4 | G, which the host
// checks) over channels [cb D / 8, (cb + 1) D / 8), read 4 channels' words,
// scales and minimums at a time. A channel's scale is folded into the
// queries once for the four tokens (sq s) and its minimum into one sum per
// head (sq m). The eight lanes of a token group then add their 16 partial
// sums (4 tokens x 4 heads) by three halving steps: lane cb ends with token
// j0 + 4 tq + cb / 2, heads 2 (cb % 2) and + 1, in r2. Lanes whose tokens
// are past the quantized ones read nothing (their words may not exist) and
// their sums are not used.
//
// As in mk_values_quant, a token's code is read in place as code 2^k (k its
// bit offset past the nearest lower multiple of FIT codes) and its sums,
// kept so scaled, are scaled back before the minimums' term: the same bits.
template <int D, int BITS, class S>
__device__ __forceinline__ void mk_key_tile(const MkQuant& z, const S& src, int j0, int lane,
                                           const mk_f4* sq, float* r2) {
  constexpr int P = 32 / BITS, CPL = D / 8, VW = CPL < 4 ? CPL : 4, FIT = 23 / BITS;
  const unsigned mask = (1u << BITS) - 1u;
  int tq = lane / 8, cb = lane % 8, jt = j0 + 4 * tq;
  float r[4 * MK_G];
#pragma unroll
  for (int i = 0; i < 4 * MK_G; ++i) r[i] = 0.f;
  if (jt < z.n) {
    float bias[MK_G];
    for (int g = 0; g < MK_G; ++g) bias[g] = 0.f;
    const MkTileAt at = mk_tile_at<D, BITS>(z, src, jt, cb * CPL);
#pragma unroll 2
    for (int c4 = 0; c4 < CPL; c4 += VW) {
      unsigned wv[VW];
      float sc[VW], mn[VW];
      mk_tile_load<VW>(z, src, at.w0 + c4, at.s0 + c4, wv, sc, mn);
#pragma unroll
      for (int i = 0; i < VW; ++i) {
        const mk_f4 qc = sq[mk_sqr<D>(cb * CPL + c4 + i)];
        float qs[MK_G];
#pragma unroll
        for (int g = 0; g < MK_G; ++g) {
          qs[g] = qc.v[g] * sc[i];
          bias[g] += qc.v[g] * mn[i];
        }
        unsigned x = wv[i] >> at.sh;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          float cf = mk_codef_at(x >> (BITS * (t - t % FIT)), mask << (BITS * (t % FIT)));
#pragma unroll
          for (int g = 0; g < MK_G; ++g) r[t * MK_G + g] += qs[g] * cf;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < 4; ++t)
      for (int g = 0; g < MK_G; ++g)
        r[t * MK_G + g] = r[t * MK_G + g] * mk_pow2(-BITS * (t % FIT)) + bias[g];
  }
  mk_halve<4 * MK_G>(r, lane, 4);
  mk_halve<2 * MK_G>(r, lane, 2);
  mk_halve<MK_G>(r, lane, 1);
  r2[0] = r[0];
  r2[1] = r[1];
}

// Integer key products (`arithmetic = "int8"`, z.i8: per-channel 2- or
// 4-bit keys whose scale groups hold whole words). Per block and query head
// g, over the chunk's quantized keys (the CPU takes segments of 4096
// tokens; a chunk is at most 256, so the step is as fine or finer):
//   amax_g = max_c |q_gc| smax_c   (smax_c: channel c's largest key scale)
//   sig_g  = amax_g (1/127), inv_g = 127 / amax_g (both 0 when amax_g is 0
//            or inv_g overflows: the codes then add nothing)
//   q8_gc  = rne((q_gc inv_g) scale_gc)   per key group, in -127 ..= 127
//   score  = sig_g sum_c q8_gc code_c + sum_c q_gc min_gc   (min term in f32)
// q is the scaled query of sq. mk_i8_prep leaves sig_g at si8[g] and inv_g
// at si8[MK_G + g].

// fp32 product rounded to nearest (never fused into a following add).
__device__ __forceinline__ float mk_mul_rn(float a, float b) {
#ifdef MK_EMULATED
  volatile float r = a * b;
  return r;
#else
  return __fmul_rn(a, b);
#endif
}
// rne(x) for |x| < 2^22 as the low byte of the bits of x + 1.5 * 2^23 (two's
// complement: -1 is 0xff).
__device__ __forceinline__ unsigned mk_rne_bits(float x) {
#ifdef MK_EMULATED
  volatile float r = x + 12582912.0f;
  return __float_as_uint(r);
#else
  return __float_as_uint(__fadd_rn(x, 12582912.0f));
#endif
}
// Byte k (0..3) of a, b, c and d as the bytes 0..3 of one word.
__device__ __forceinline__ unsigned mk_bytes4(unsigned a, unsigned b, unsigned c, unsigned d,
                                             int k) {
#ifdef MK_EMULATED
  return ((a >> (8 * k)) & 0xffu) | (((b >> (8 * k)) & 0xffu) << 8) |
         (((c >> (8 * k)) & 0xffu) << 16) | (((d >> (8 * k)) & 0xffu) << 24);
#else
  unsigned sel = (unsigned)(k | ((k + 4) << 4)), lo, hi, r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(lo) : "r"(a), "r"(b), "r"(sel));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(hi) : "r"(c), "r"(d), "r"(sel));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "n"(0x5410));
  return r;
#endif
}
// w with its byte i (0..3) replaced by the low byte of b.
__device__ __forceinline__ unsigned mk_put_byte(unsigned w, unsigned b, int i) {
#ifdef MK_EMULATED
  return (w & ~(0xffu << (8 * i))) | ((b & 0xffu) << (8 * i));
#else
  // prmt selectors: bytes 0..3 of w, byte 4 = b's first.
  const unsigned sel = i == 0 ? 0x3214u : i == 1 ? 0x3240u : i == 2 ? 0x3410u : 0x4210u;
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(w), "r"(b), "r"(sel));
  return r;
#endif
}
// acc + the sum of the four signed byte products of a and b.
__device__ __forceinline__ int mk_dp4a(unsigned a, unsigned b, int acc) {
#ifdef MK_EMULATED
  for (int i = 0; i < 4; ++i)
    acc += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
  return acc;
#else
  int r;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(acc));
  return r;
#endif
}

// sig_g and inv_g of the chunk's quantized keys [begin, begin + kq) into
// si8 (smax: D floats of shared scratch; the caller synchronizes before
// si8 is read). Thread c takes channel c's largest scale over the chunk's
// groups; a warp per head the maximum of |q_gc| smax_c.
template <int D, class S>
__device__ __forceinline__ void mk_i8_prep(const MkQuant& z, const S& src, int begin, int kq,
                                          const mk_f4* sq, float* smax, float* si8) {
  int tid = threadIdx.x, nt = blockDim.x, warp = tid / 32, lane = tid % 32;
  int g0 = begin / z.group, g1 = (begin + kq - 1) / z.group + 1;
  for (int c = tid; c < D; c += nt) {
    float m = 0.f;
    for (int gi = g0; gi < g1; ++gi)
      m = fmaxf(m, mk_scale_at(src.scale(), (mk_size)gi * D + c - src.sofs(), z.f16));
    smax[c] = m;
  }
  __syncthreads();
  if (warp < MK_G) {
    float a = 0.f;
    for (int c = lane; c < D; c += 32) a = fmaxf(a, fabsf(sq[mk_sqr<D>(c)].v[warp]) * smax[c]);
    a = mk_warp_max(a);
    if (lane == 0) {
      float inv = 127.0f / a;
      bool ok = a > 0.f && inv <= 3.4028235e38f;
      si8[warp] = ok ? a * (1.0f / 127.0f) : 0.f;
      si8[MK_G + warp] = ok ? inv : 0.f;
    }
  }
}

// mk_key_tile with integer products. The query bytes of a channel change
// with its scale, every key group, and cost about as much as the products
// they feed; a lane therefore takes T = 8 tokens (4 at d = 256, where 8
// spill past the kernel's 96 registers), twice mk_key_tile's: lane
// (th, cb) = (lane / L, lane % L), L = 2 T lanes per token group, scores
// tokens j0 + T th .. + T - 1 (one word per channel: T | P, one scale group:
// T | G, which int8_keys ensures) over channels [cb D / L, (cb + 1) D / L),
// 4 channels' words, scales and minimums loaded at a time. Per 4 channels it
// packs each head's 4 query bytes into a word and, per token, the 4
// channels' codes into another (one byte each: byte k of the 4 words shifted
// to the lane's first token holds BITS-bit codes of 8 / BITS tokens), and
// one dp4a adds their 4 products. The T x 4 integer sums become
// sig_g sum + the lane's part of the min term, and the L lanes add them by
// halvings: lane cb ends with token j0 + T th + cb / 2, heads 2 (cb % 2) and
// + 1, in r2 (mk_key_tile_bits returns that token).
template <int D>
__device__ constexpr int mk_i8_tokens() {
  return D >= 256 ? 4 : 8;
}
template <int D, int BITS, class S>
__device__ __forceinline__ void mk_key_tile_i8(const MkQuant& z, const S& src, int j0, int lane,
                                              const mk_f4* sq, const float* si8, float* r2) {
  constexpr int T = mk_i8_tokens<D>(), L = 2 * T, P = 32 / BITS, CPL = D / L;
  constexpr int VW = CPL < 4 ? CPL : 4, NB = (T * BITS + 7) / 8;
  const unsigned cmask = ((1u << BITS) - 1u) * 0x01010101u;
  int th = lane / L, cb = lane % L, jt = j0 + T * th;
  float r[T * MK_G];
#pragma unroll
  for (int i = 0; i < T * MK_G; ++i) r[i] = 0.f;
  if (jt < z.n) {
    int acc[T * MK_G];
    float bias[MK_G];
#pragma unroll
    for (int i = 0; i < T * MK_G; ++i) acc[i] = 0;
    for (int g = 0; g < MK_G; ++g) bias[g] = 0.f;
    const MkTileAt at = mk_tile_at<D, BITS>(z, src, jt, cb * CPL);
#pragma unroll 1
    for (int c4 = 0; c4 < CPL; c4 += VW) {
      unsigned wv[4] = {0u, 0u, 0u, 0u};
      float sc[VW], mn[VW];
      mk_tile_load<VW>(z, src, at.w0 + c4, at.s0 + c4, wv, sc, mn);
      unsigned qw[MK_G] = {0u, 0u, 0u, 0u}, cw[NB];
#pragma unroll
      for (int i = 0; i < VW; ++i) {
        const mk_f4 qc = sq[mk_sqr<D>(cb * CPL + c4 + i)];
#pragma unroll
        for (int g = 0; g < MK_G; ++g) {
          bias[g] += qc.v[g] * mn[i];
          float x = mk_mul_rn(mk_mul_rn(qc.v[g], si8[MK_G + g]), sc[i]);
          qw[g] = mk_put_byte(qw[g], mk_rne_bits(x), i);
        }
      }
#pragma unroll
      for (int k = 0; k < NB; ++k)
        cw[k] = mk_bytes4(wv[0] >> at.sh, wv[1] >> at.sh, wv[2] >> at.sh, wv[3] >> at.sh, k);
#pragma unroll
      for (int t = 0; t < T; ++t) {
        unsigned ct = (cw[(BITS * t) / 8] >> ((BITS * t) % 8)) & cmask;
#pragma unroll
        for (int g = 0; g < MK_G; ++g) acc[t * MK_G + g] = mk_dp4a(ct, qw[g], acc[t * MK_G + g]);
      }
    }
#pragma unroll
    for (int t = 0; t < T; ++t)
      for (int g = 0; g < MK_G; ++g) r[t * MK_G + g] = si8[g] * (float)acc[t * MK_G + g] + bias[g];
  }
  if constexpr (T == 8) mk_halve<8 * MK_G>(r, lane, 8);
  mk_halve<4 * MK_G>(r, lane, 4);
  mk_halve<2 * MK_G>(r, lane, 2);
  mk_halve<MK_G>(r, lane, 1);
  r2[0] = r[0];
  r2[1] = r[1];
}

// dot[g] = sum_c sq[c][g] k_c for an fp16 row (unrolled by 8 loads of 16
// bytes: more spill past the kernel's 96 registers at D = 256).
template <int D>
__device__ __forceinline__ void mk_dot_fp(const unsigned* row, const mk_f4* sq, float* dot) {
#pragma unroll 8
  for (int c0 = 0; c0 < D; c0 += 8) {
    mk_u4 x = mk_ld16(row + c0 / 2);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      int c = c0 + 2 * i;
      float k0 = mk_h2f_fast((unsigned short)(x.w[i] & 0xffffu));
      float k1 = mk_h2f_fast((unsigned short)(x.w[i] >> 16));
      const mk_f4 q0 = sq[mk_sqr<D>(c)], q1 = sq[mk_sqr<D>(c + 1)];
      for (int g = 0; g < MK_G; ++g) dot[g] += q0.v[g] * k0 + q1.v[g] * k1;
    }
  }
}

// Of the tokens [begin, end), how many lie among a store's first n (the
// quantized ones, before the fp16 rows): min(n, end) - begin, at least 0.
__device__ __forceinline__ int mk_stored_in(int n, int begin, int end) {
  int k = (n < end ? n : end) - begin;
  return k > 0 ? k : 0;
}

// acc[e][g] += p_j[g] s_j code_{j,e} and macc[g] += p_j[g] m_j over the
// MK_COL channels of the column at c0, for quantized values (per token, BITS
// bits; a column lies in one scale group and, at 2 and 4 bits, in one word)
// of the chunk's tokens jl = tl, tl + lanes, ... < cnt: MK_UNROLL tokens'
// codes and scales loaded before their sums.
//
// A channel's code is read in place, as code 2^k with k its bit offset from
// the nearest lower multiple of FIT codes (the most whose values stay below
// 2^23 so scaled: 11 at 2 bits, all 8 of a column), and the channel's sums
// are kept times 2^k: scaled up on entry, down on exit. Scaling by a power of
// two commutes with rounding, so the sums have the bits of unscaled ones
// (short of subnormal products, some 1e-38 of the values).
template <int D, int BITS, class S>
__device__ __forceinline__ void mk_values_quant(const MkQuant& z, const S& src, int begin,
                                               int cnt, int tl,
                                               int lanes, int c0, const float (*sp)[MK_G],
                                               float (*acc)[MK_G], float* macc) {
  constexpr int P = 32 / BITS, NW = P >= MK_COL ? 1 : MK_COL / P, PE = P >= MK_COL ? MK_COL : P;
  constexpr int FIT = 23 / BITS;
  const unsigned mask = (1u << BITS) - 1u;
  const int sh = P >= MK_COL ? BITS * (c0 % P) : 0;
  const int gpt = D / z.group, cg = c0 / z.group;
#pragma unroll
  for (int e = 0; e < MK_COL; ++e)
    for (int g = 0; g < MK_G; ++g) acc[e][g] *= mk_pow2(BITS * ((e % PE) % FIT));
  for (int jl0 = tl; jl0 < cnt; jl0 += MK_UNROLL * lanes) {
    unsigned x[MK_UNROLL][NW] = {};
    float sc[MK_UNROLL] = {}, mn[MK_UNROLL] = {};
#pragma unroll
    for (int u = 0; u < MK_UNROLL; ++u) {
      int jl = jl0 + u * lanes;
      if (jl < cnt) {
        int j = begin + jl;
        const unsigned* w = src.words() + ((mk_size)j * (D / P) + c0 / P - src.wofs());
        for (int i = 0; i < NW; ++i) x[u][i] = w[i];
        mk_size si = (mk_size)j * gpt + cg - src.sofs();
        sc[u] = mk_scale_at(src.scale(), si, z.f16);
        mn[u] = mk_scale_at(src.minv(), si, z.f16);
      }
    }
#pragma unroll
    for (int u = 0; u < MK_UNROLL; ++u) {
      int jl = jl0 + u * lanes;
      if (jl >= cnt) break;
      float ps[MK_G];
      for (int g = 0; g < MK_G; ++g) {
        float p = sp[jl][g];
        ps[g] = p * sc[u];
        macc[g] += p * mn[u];
      }
#pragma unroll
      for (int i = 0; i < NW; ++i) {
        unsigned xx = x[u][i] >> sh;
#pragma unroll
        for (int e = 0; e < PE; ++e) {
          float cf = mk_codef_at(xx >> (BITS * (e - e % FIT)), mask << (BITS * (e % FIT)));
          for (int g = 0; g < MK_G; ++g) acc[i * P + e][g] += ps[g] * cf;
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < MK_COL; ++e)
    for (int g = 0; g < MK_G; ++g) acc[e][g] *= mk_pow2(-BITS * ((e % PE) % FIT));
}

// acc[e][g] += p[g] v_e over the MK_COL channels of an fp16 row's column
// (x: its 16 bytes).
__device__ __forceinline__ void mk_acc_fp(const mk_u4& x, const float* p, float (*acc)[MK_G]) {
#pragma unroll
  for (int i = 0; i < MK_COL / 2; ++i) {
    float v0 = mk_h2f_fast((unsigned short)(x.w[i] & 0xffffu));
    float v1 = mk_h2f_fast((unsigned short)(x.w[i] >> 16));
    for (int g = 0; g < MK_G; ++g) {
      acc[2 * i][g] += p[g] * v0;
      acc[2 * i + 1][g] += p[g] * v1;
    }
  }
}

// acc[e][g] += p_j[g] v_{j,e} over the column at c0 for the fp16 value rows
// (the residual ring, then extra entries) of the chunk's tokens jl = from +
// tl, + lanes, ... < cnt: MK_UNROLL rows' 16 bytes loaded before their sums.
template <int D>
__device__ __forceinline__ void mk_values_fp(const MkHead& hd, int begin, int from, int cnt, int tl,
                                            int lanes, int c0, const float (*sp)[MK_G],
                                            float (*acc)[MK_G]) {
  for (int jl0 = from + tl; jl0 < cnt; jl0 += MK_UNROLL * lanes) {
    mk_u4 x[MK_UNROLL] = {};
#pragma unroll
    for (int u = 0; u < MK_UNROLL; ++u) {
      int jl = jl0 + u * lanes;
      if (jl < cnt) {
        const unsigned short* row =
            mk_fp_row(hd.fv, hd.fv0, hd.fvcap, hd.v.n, hd.ev, hd.len, begin + jl, D);
        x[u] = mk_ld16((const unsigned*)row + c0 / 2);  // MK_COL = 8 channels
      }
    }
#pragma unroll
    for (int u = 0; u < MK_UNROLL; ++u) {
      int jl = jl0 + u * lanes;
      if (jl >= cnt) break;
      mk_acc_fp(x[u], sp[jl], acc);
    }
  }
}

// 4d. The staged form (mk_decode_staged): a block first issues asynchronous
// copies (cp.async, sm_80 and later) of everything its chunk reads from the
// quantized keys and values into shared memory, keys and values as two
// groups, then computes from there: the whole chunk's loads are in flight
// at once, the values' under the scores' arithmetic, where the fast kernel's
// warps load a tile, wait, compute it and load the next. Same arithmetic in
// the same order as mk_decode_fast: the same bits.
#define MK_STAGE_BYTES 32768
struct alignas(16) MkStageBuf {
  unsigned char b[MK_STAGE_BYTES];
};

// One 16-byte asynchronous copy, global to shared (both 16-byte aligned);
// the emulation lands it at the wait that retires its group (emulate.h).
__device__ __forceinline__ void mk_cp16(void* dst, const void* src) {
#ifdef MK_EMULATED
  emu::cp_async16(dst, src);
#else
  unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
#endif
}
__device__ __forceinline__ void mk_cp_commit() {
#ifdef MK_EMULATED
  emu::cp_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups are in flight
// (a __syncthreads after it makes every thread's copies visible).
template <int N>
__device__ __forceinline__ void mk_cp_wait() {
#ifdef MK_EMULATED
  emu::cp_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Copies `bytes` (a multiple of 2) from src to dst, both 16-byte aligned,
// by the block's threads: whole 16-byte units asynchronously (unit u to
// unit u ^ ((u / 8) % 8) when swz: mk_swz), the tail by plain loads.
__device__ __forceinline__ void mk_stage(unsigned char* dst, const void* src, mk_size bytes,
                                        int swz, int tid, int nt) {
  const unsigned char* s = (const unsigned char*)src;
  mk_size units = bytes / 16;
  for (mk_size u = tid; u < units; u += nt)
    mk_cp16(dst + (swz ? (u ^ ((u >> 3) & 7)) : u) * 16, s + u * 16);
  mk_size tail = bytes - units * 16;
  if ((mk_size)tid < tail / 2)
    ((unsigned short*)(dst + units * 16))[tid] = ((const unsigned short*)(s + units * 16))[tid];
}

__device__ __forceinline__ bool mk_aligned16(const void* p) { return ((mk_size)p & 15) == 0; }
__device__ __forceinline__ mk_size mk_round(mk_size x, mk_size m) { return (x + m - 1) / m * m; }

// Issues the copies of what the chunk [begin, begin + kq) of quantized keys
// and [begin, begin + vq) of quantized values read (key words by rows of
// 32 / bits tokens, their scales and minimums by groups; value words,
// scales and minimums per token), each part when it fits what is left of
// MK_STAGE_BYTES and its arrays are 16-byte aligned. Two commit groups:
// keys, then values. Every thread computes the same plan; thread 0 writes
// where each part is then read from (its staged copy, else the store in
// place) to srcs[0] (keys) and srcs[1] (values), in shared memory and read
// where used (in registers they would push the kernel into spills), visible
// after the caller's next __syncthreads.
template <int D>
__device__ __forceinline__ void mk_stage_chunk(const MkHead& hd, int begin, int kq, int vq,
                                              unsigned char* stage, int tid, int nt,
                                              MkQSrc* srcs) {
  MkQSrc ks = mk_global_src(hd.k), vs = mk_global_src(hd.v);
  mk_size used = 0;
  if (kq > 0 && mk_aligned16(hd.k.words) && mk_aligned16(hd.k.scale) && mk_aligned16(hd.k.minv)) {
    const MkQuant& z = hd.k;
    int p = 32 / z.bits, last = begin + kq - 1;
    mk_size w0 = (mk_size)(begin / p) * D, s0 = (mk_size)(begin / z.group) * D;
    mk_size wb = (mk_size)(last / p + 1 - begin / p) * D * 4;
    mk_size sb = (mk_size)(last / z.group + 1 - begin / z.group) * D * (z.f16 ? 2 : 4);
    mk_size wr = mk_round(wb, 128), sr = mk_round(sb, 16);
    if (wr + 2 * sr <= MK_STAGE_BYTES) {
      mk_stage(stage, z.words + w0, wb, 1, tid, nt);
      mk_stage(stage + wr, (const unsigned char*)z.scale + s0 * (z.f16 ? 2 : 4), sb, 0, tid, nt);
      mk_stage(stage + wr + sr, (const unsigned char*)z.minv + s0 * (z.f16 ? 2 : 4), sb, 0, tid,
               nt);
      ks = MkQSrc{(const unsigned*)stage, stage + wr, stage + wr + sr, w0, s0, 1};
      used = wr + 2 * sr;
    }
  }
  mk_cp_commit();
  if (vq > 0 && mk_aligned16(hd.v.words) && mk_aligned16(hd.v.scale) && mk_aligned16(hd.v.minv)) {
    const MkQuant& z = hd.v;
    int es = z.f16 ? 2 : 4, gpt = D / z.group;
    mk_size w0 = (mk_size)begin * (D / (32 / z.bits)), s0 = (mk_size)begin * gpt;
    mk_size wb = (mk_size)vq * (D / (32 / z.bits)) * 4, sb = (mk_size)vq * gpt * es;
    mk_size wr = mk_round(wb, 16), sr = mk_round(sb, 16);
    if (used + wr + 2 * sr <= MK_STAGE_BYTES) {
      unsigned char* b = stage + used;
      mk_stage(b, z.words + w0, wb, 0, tid, nt);
      mk_stage(b + wr, (const unsigned char*)z.scale + s0 * es, sb, 0, tid, nt);
      mk_stage(b + wr + sr, (const unsigned char*)z.minv + s0 * es, sb, 0, tid, nt);
      vs = MkQSrc{(const unsigned*)b, b + wr, b + wr + sr, w0, s0, 0};
    }
  }
  mk_cp_commit();
  if (tid == 0) {
    srcs[0] = ks;
    srcs[1] = vs;
#ifdef MK_EMULATED
    if (ks.words != hd.k.words) ++emu::staged_keys;
    if (vs.words != hd.v.words) ++emu::staged_values;
#endif
  }
}

// mk_key_tile and mk_values_quant at the store's bits (2, 4, else 8).
// Returns the token of the tile (0 .. 15) whose scores the lane holds in
// r2 (heads 2 (lane % 2) and + 1).
template <int D, class S>
__device__ __forceinline__ int mk_key_tile_bits(const MkQuant& z, const S& src, int j0, int lane,
                                               const mk_f4* sq, const float* si8, float* r2) {
  if (z.i8) {
    if (z.bits == 2) mk_key_tile_i8<D, 2>(z, src, j0, lane, sq, si8, r2);
    else mk_key_tile_i8<D, 4>(z, src, j0, lane, sq, si8, r2);
    constexpr int T = mk_i8_tokens<D>();
    return T * (lane / (2 * T)) + (lane % (2 * T)) / 2;
  }
  if (z.bits == 2) mk_key_tile<D, 2>(z, src, j0, lane, sq, r2);
  else if (z.bits == 4) mk_key_tile<D, 4>(z, src, j0, lane, sq, r2);
  else mk_key_tile<D, 8>(z, src, j0, lane, sq, r2);
  return 4 * (lane / 8) + (lane % 8) / 2;
}
template <int D, class S>
__device__ __forceinline__ void mk_values_bits(const MkQuant& z, const S& src, int begin, int cnt,
                                              int tl, int lanes, int c0,
                                              const float (*sp)[MK_G], float (*acc)[MK_G],
                                              float* macc) {
  if (z.bits == 2) mk_values_quant<D, 2>(z, src, begin, cnt, tl, lanes, c0, sp, acc, macc);
  else if (z.bits == 4) mk_values_quant<D, 4>(z, src, begin, cnt, tl, lanes, c0, sp, acc, macc);
  else mk_values_quant<D, 8>(z, src, begin, cnt, tl, lanes, c0, sp, acc, macc);
}

// The kernel's body for head dim D (the kernels below pick it): with STAGED
// (mk_decode_staged), the quantized parts are first copied to `stage`,
// which `red` then reuses once the values are summed.
template <int D, bool STAGED>
__device__ __forceinline__ void mk_decode_fast_d(const float* __restrict__ q, const MkHead& hd,
                                                int group, float scale, int chunk,
                                                float* __restrict__ pm, float* __restrict__ pl,
                                                float* __restrict__ pacc,
                                                float* __restrict__ logits, int lstride,
                                                mk_f4* sq, float (*sp)[MK_G],
                                                float (*red)[MK_RED], float* sm, float* sl,
                                                float* si8, unsigned char* stage,
                                                MkQSrc* srcs) {
  int s = blockIdx.x, ns = gridDim.x, tid = threadIdx.x, nt = blockDim.x;
  int slices = (group + MK_G - 1) / MK_G;
  int kvh = blockIdx.y / slices, g0 = (int)(blockIdx.y % slices) * MK_G;
  int gn = group - g0 < MK_G ? group - g0 : MK_G;
  int total = hd.len + hd.n_extra;
  int begin = s * chunk, end = begin + chunk < total ? begin + chunk : total;
  int h0 = kvh * group + g0;  // the block's first query head
  // The fast kernel reads hd's pointers where used (MkInPlace): held in
  // registers from here they would crowd out the loads.
  if constexpr (STAGED)
    mk_stage_chunk<D>(hd, begin, mk_stored_in(hd.k.n, begin, end),
                      mk_stored_in(hd.v.n, begin, end), stage, tid, nt, srcs);
  for (int i = tid; i < D * MK_G; i += nt) {
    int c = i / MK_G, g = i % MK_G;
    sq[mk_sqr<D>(c)].v[g] = g < gn ? q[(mk_size)(h0 + g) * D + c] * scale : 0.f;
  }
  if constexpr (STAGED) mk_cp_wait<1>();  // the keys' group
  __syncthreads();

  // 1. Scores: the quantized keys [begin, begin + kq) by warp tiles, then
  // fp16 rows (and -inf past the end) one token per thread.
  int warp = tid / 32, lane = tid % 32;
  int kq = mk_stored_in(hd.k.n, begin, end);
  if (hd.k.i8 && kq > 0) {  // integer key products: the chunk's steps
    if constexpr (STAGED) mk_i8_prep<D>(hd.k, MkStaged{srcs[0]}, begin, kq, sq, &sp[0][0], si8);
    else mk_i8_prep<D>(hd.k, MkInPlace{hd.k}, begin, kq, sq, &sp[0][0], si8);
    __syncthreads();
  }
  for (int t0 = warp * MK_TILE; t0 < kq; t0 += (nt / 32) * MK_TILE) {
    float r2[2];
    int tt;
    if constexpr (STAGED)
      tt = mk_key_tile_bits<D>(hd.k, MkStaged{srcs[0]}, begin + t0, lane, sq, si8, r2);
    else tt = mk_key_tile_bits<D>(hd.k, MkInPlace{hd.k}, begin + t0, lane, sq, si8, r2);
    int jl = t0 + tt, g = 2 * (lane % 2);
    if (jl < kq) {
      for (int e = 0; e < 2; ++e) {
        sp[jl][g + e] = r2[e];
        if (logits && g + e < gn) logits[(mk_size)(h0 + g + e) * lstride + begin + jl] = r2[e];
      }
    }
  }
  for (int jl = kq + tid; jl < chunk; jl += nt) {
    int j = begin + jl;
    float dot[MK_G];
    for (int g = 0; g < MK_G; ++g) dot[g] = 0.f;
    if (j < end) {
      const unsigned short* row = mk_fp_row(hd.fk, hd.fk0, hd.fkcap, hd.k.n, hd.ek, hd.len, j, D);
      mk_dot_fp<D>((const unsigned*)row, sq, dot);
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
  if constexpr (STAGED) mk_cp_wait<0>();  // the values' group
  __syncthreads();

  // 3. Values: the quantized ones [begin, begin + vq), then fp16 rows.
  constexpr int COLS = D / MK_COL;
  int lanes = nt / COLS, col = tid % COLS, tl = tid / COLS, c0 = col * MK_COL;
  float acc[MK_COL][MK_G], macc[MK_G];
  for (int e = 0; e < MK_COL; ++e)
    for (int g = 0; g < MK_G; ++g) acc[e][g] = 0.f;
  for (int g = 0; g < MK_G; ++g) macc[g] = 0.f;
  int cnt = end - begin > 0 ? end - begin : 0;
  int vq = mk_stored_in(hd.v.n, begin, end);
  if (vq > 0) {
    if constexpr (STAGED)
      mk_values_bits<D>(hd.v, MkStaged{srcs[1]}, begin, vq, tl, lanes, c0, sp, acc, macc);
    else mk_values_bits<D>(hd.v, MkInPlace{hd.v}, begin, vq, tl, lanes, c0, sp, acc, macc);
  }
  mk_values_fp<D>(hd, begin, vq, cnt, tl, lanes, c0, sp, acc);
  if constexpr (STAGED) __syncthreads();  // `red` reuses the staged values
  for (int e = 0; e < MK_COL; ++e)
    for (int g = 0; g < MK_G; ++g) red[tid][e * MK_G + g] = acc[e][g];
  for (int g = 0; g < MK_G; ++g) red[tid][MK_COL * MK_G + g] = macc[g];
  __syncthreads();
  for (int o = tid; o < gn * D; o += nt) {
    int g = o / D, c = o % D, cl = c / MK_COL, e = c % MK_COL;
    float a = 0.f;
    for (int t = 0; t < lanes; ++t) {
      const float* r = red[t * COLS + cl];
      a += r[e * MK_G + g] + r[MK_COL * MK_G + g];
    }
    pacc[((mk_size)(h0 + g) * ns + s) * D + c] = a;
  }
  if (tid < gn) {
    mk_size slot = (mk_size)(h0 + tid) * ns + s;
    pm[slot] = sm[tid];
    pl[slot] = sl[tid];
  }
}

// Picks the body for head dim d (16, 32, 64, 128, else 256).
#define MK_FAST_SWITCH(STAGED, RED, STAGE, SRCS)                                                   \
  switch (d) {                                                                                     \
    case 16: mk_decode_fast_d<16, STAGED>(q, hd, group, scale, chunk, pm, pl, pacc, logits,        \
                                          lstride, sq, sp, RED, sm, sl, si8, STAGE, SRCS); break;  \
    case 32: mk_decode_fast_d<32, STAGED>(q, hd, group, scale, chunk, pm, pl, pacc, logits,        \
                                          lstride, sq, sp, RED, sm, sl, si8, STAGE, SRCS); break;  \
    case 64: mk_decode_fast_d<64, STAGED>(q, hd, group, scale, chunk, pm, pl, pacc, logits,        \
                                          lstride, sq, sp, RED, sm, sl, si8, STAGE, SRCS); break;  \
    case 128: mk_decode_fast_d<128, STAGED>(q, hd, group, scale, chunk, pm, pl, pacc, logits,      \
                                            lstride, sq, sp, RED, sm, sl, si8, STAGE, SRCS); break; \
    default: mk_decode_fast_d<256, STAGED>(q, hd, group, scale, chunk, pm, pl, pacc, logits,       \
                                           lstride, sq, sp, RED, sm, sl, si8, STAGE, SRCS); break; \
  }

// Launch bounds: 5 resident blocks of 128 threads per SM (at most 102
// registers; tests/nvrtc.rs holds ptxas to 96 without spills).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 5)
    mk_decode_fast(const float* __restrict__ q, const MkHead* heads, int d, int group, float scale,
                   int chunk, float* __restrict__ pm, float* __restrict__ pl,
                   float* __restrict__ pacc, float* __restrict__ logits, int lstride) {
  __shared__ mk_f4 sq[MK_MAX_D + 8];
  __shared__ float sp[MK_CHUNK][MK_G];
  __shared__ float red[MK_THREADS][MK_RED];
  __shared__ float sm[MK_G], sl[MK_G], si8[2 * MK_G];
  // The head's table entry in shared memory (read where used: in registers
  // its 20-odd words would crowd out the loads in flight).
  __shared__ MkHead hd;
  if (threadIdx.x == 0) hd = heads[blockIdx.y / ((group + MK_G - 1) / MK_G)];
  __syncthreads();
  MK_FAST_SWITCH(false, red, (unsigned char*)nullptr, (MkQSrc*)nullptr)
}

// mk_decode_fast with the chunk's quantized parts staged in shared memory
// first (4d): the same arguments, grid and bits. Its 32 KB of staging, which
// the final sums reuse, brings a block to about 41 KB of shared memory:
// still 5 blocks per SM on an H100 or H200 (228 KB), 3 on an A100.
extern "C" __global__ void __launch_bounds__(MK_THREADS, 5)
    mk_decode_staged(const float* __restrict__ q, const MkHead* heads, int d, int group,
                     float scale, int chunk, float* __restrict__ pm, float* __restrict__ pl,
                     float* __restrict__ pacc, float* __restrict__ logits, int lstride) {
  __shared__ mk_f4 sq[MK_MAX_D + 8];
  __shared__ float sp[MK_CHUNK][MK_G];
  __shared__ MkStageBuf st;
  __shared__ MkQSrc srcs[2];
  unsigned char* stage = st.b;
  __shared__ float sm[MK_G], sl[MK_G], si8[2 * MK_G];
  __shared__ MkHead hd;
  static_assert(sizeof(float) * MK_THREADS * MK_RED <= MK_STAGE_BYTES, "red fits the staging");
  if (threadIdx.x == 0) hd = heads[blockIdx.y / ((group + MK_G - 1) / MK_G)];
  __syncthreads();
  MK_FAST_SWITCH(true, (float(*)[MK_RED])stage, stage, srcs)
}
#undef MK_FAST_SWITCH
