// Prefill on tensor cores: tiled flash attention (FlashAttention-2's loop
// order) with `mma.sync.m16n8k16` products, and the causal softmax's column
// sums (A_cumul) from the same tiles. Appended to minikv.cu (one source for
// NVRTC; emu_host.cpp includes both), so it uses that file's helpers.
//
// Arithmetic: queries (times 1/sqrt(d)), keys, values and the probabilities
// enter the products as fp16 (round to nearest even), products accumulate in
// f32, softmax and its sums are f32: the precision of FlashAttention-2 with
// fp16 inputs. The scalar kernels of minikv.cu stay for head dims other than
// 64 and 128 and as the f32 baseline.
//
// A block is 4 warps; warp w owns 16 query rows (fwd) or 16 keys (column
// sums). Tiles of 64 keys (fwd) or 64 queries (column sums) are staged in
// shared memory as fp16, rows padded by 8 halves. The order of every sum is
// fixed (no atomics): results are deterministic.

#define MK_MMA_TILE 64
#define MK_MMA_PAD 8

// One fp16 (bits) of `f`, round to nearest even: the hardware conversion on a
// GPU, minikv.cu's bitwise-equal software one under the emulation.
__device__ __forceinline__ unsigned mk_h(float f) {
#ifdef MK_EMULATED
  return mk_f2h(f);
#else
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}

// Two fp16 in one word, `lo` in the low half (an .f16x2 register).
__device__ __forceinline__ unsigned mk_pack(float lo, float hi) { return mk_h(lo) | (mk_h(hi) << 16); }

// D += A B for one warp: A 16x16 fp16 (row-major), B 16x8 fp16 (column-major),
// D 16x8 f32 (PTX `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`).
// Fragments, with g = lane / 4 and c = lane % 4 (PTX ISA, "Matrix Fragments
// for mma.m16n8k16 with floating point type"): a[0] = A[g][2c, 2c+1],
// a[1] = A[g+8][2c, 2c+1], a[2] = A[g][2c+8, 2c+9], a[3] = A[g+8][2c+8, 2c+9];
// b[0] = B[2c, 2c+1][g], b[1] = B[2c+8, 2c+9][g]; d[0], d[1] = D[g][2c, 2c+1],
// d[2], d[3] = D[g+8][2c, 2c+1]. Every lane of the warp takes part.
__device__ __forceinline__ void mk_mma(float* d, const unsigned* a, const unsigned* b) {
#ifdef MK_EMULATED
  unsigned mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  unsigned all[32 * 6];
  emu::warp_gather(mine, 6, all);
  int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  auto half_of = [](unsigned w, int k) { return mk_h2f((unsigned short)(k % 2 ? w >> 16 : w & 0xffffu)); };
  // Rows g and g + 8 of A, columns 2c and 2c + 1 of B, from the lanes that hold them.
  float ar[2][16], bc[2][16];
  for (int k = 0; k < 16; ++k) {
    for (int i = 0; i < 2; ++i) {
      int r = g + 8 * i, n = 2 * c + i;
      ar[i][k] = half_of(all[((r % 8) * 4 + (k % 8) / 2) * 6 + (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k);
      bc[i][k] = half_of(all[(n * 4 + (k % 8) / 2) * 6 + 4 + (k >= 8 ? 1 : 0)], k);
    }
  }
  for (int e = 0; e < 4; ++e) {
    float s = 0.f;
    for (int k = 0; k < 16; ++k) s += ar[e / 2][k] * bc[e % 2][k];  // fp16 products are exact in f32
    d[e] += s;
  }
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Elements i and i + 1 (i even) of a source as two fp16 in one word, `i` in
// the low half: f32 times `mul`, rounded (queries); or fp16 bits as they are
// (keys and values, uploaded as fp16 by the host: the same bits as rounding
// their f32 here, since their `mul` is 1).
__device__ __forceinline__ unsigned mk_pair(const float* p, mk_size i, float mul) {
  return mk_pack(p[i] * mul, p[i + 1] * mul);
}
__device__ __forceinline__ unsigned mk_pair(const unsigned short* p, mk_size i, float) {
#ifdef MK_EMULATED
  unsigned w;
  std::memcpy(&w, p + i, 4);
  return w;
#else
  return *(const unsigned*)(p + i);
#endif
}

// A fragments of 16 rows x D channels of a row-major matrix (`rows` valid
// rows from `base`, zeros after), times `mul`, as fp16: frag[kc] covers
// channels 16 kc .. 16 kc + 15.
template <int D, class T>
__device__ __forceinline__ void mk_a_frags(unsigned (*frag)[4], const T* base, int rows, float mul) {
  int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      int row = g + (r % 2) * 8, col = kc * 16 + 2 * c + (r / 2) * 8;
      frag[kc][r] = row < rows ? mk_pair(base, (mk_size)row * D + col, mul) : 0u;
    }
}

// Stages rows [r0, r0 + 64) of a row-major [.][D] matrix (rows >= `rows` as
// zeros), times `mul`, as fp16 into shared `dst` [64][D + PAD] and/or
// transposed into `dt` [D][64 + PAD] (either may be null).
template <int D, class T>
__device__ __forceinline__ void mk_stage(unsigned short* dst, unsigned short* dt, const T* src,
                                         int r0, int rows, float mul) {
  for (int e = threadIdx.x; e < MK_MMA_TILE * D / 2; e += blockDim.x) {
    int r = e / (D / 2), c = 2 * (e % (D / 2));
    unsigned w = r0 + r < rows ? mk_pair(src, (mk_size)(r0 + r) * D + c, mul) : 0u;
    unsigned hx = w & 0xffffu, hy = w >> 16;
    if (dst) {
      dst[r * (D + MK_MMA_PAD) + c] = (unsigned short)hx;
      dst[r * (D + MK_MMA_PAD) + c + 1] = (unsigned short)hy;
    }
    if (dt) {
      dt[c * (MK_MMA_TILE + MK_MMA_PAD) + r] = (unsigned short)hx;
      dt[(c + 1) * (MK_MMA_TILE + MK_MMA_PAD) + r] = (unsigned short)hy;
    }
  }
}

// Two consecutive fp16 of shared memory as one word (the index is even).
__device__ __forceinline__ unsigned mk_word(const unsigned short* s, int i) {
  return (unsigned)s[i] | ((unsigned)s[i + 1] << 16);
}

// Whether query position `pos` sees key `j` (causal, optional window).
__device__ __forceinline__ bool mk_sees(int pos, int j, int window) {
  return j <= pos && (window <= 0 || j > pos - window);
}

// A forward block's geometry (block (64 query rows, query head h), warp w
// owning rows i0 = 64 x + 16 w ..): its KV head's offset in k and v, this
// lane's two row positions, the keys [jlo, last] the block's rows see (from
// the first row's lowest to the last row's position); qa gets the warp's
// query rows as A fragments: f32 times `scale`, rounded, or fp16 bits
// already so (the pipelined kernels'). Shared by both forward kernels.
struct MkFwdBlock {
  int h, i0, jlo, last;
  int pos[2];
  mk_size kv;
};
template <int D, class T>
__device__ __forceinline__ MkFwdBlock mk_fwd_block(const T* q, unsigned (*qa)[4], int n, int t,
                                                   int group, float scale, int window) {
  int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  MkFwdBlock b;
  b.h = blockIdx.y;
  b.i0 = blockIdx.x * MK_MMA_TILE + warp * 16;
  b.kv = (mk_size)(b.h / group) * t * D;
  int left = n - b.i0;
  mk_a_frags<D>(qa, q + ((mk_size)b.h * n + (b.i0 < n ? b.i0 : 0)) * D, left > 0 ? left : 0, scale);
  b.pos[0] = t - n + b.i0 + g;
  b.pos[1] = b.pos[0] + 8;
  int first = t - n + blockIdx.x * MK_MMA_TILE;
  b.last = first + MK_MMA_TILE - 1 < t - 1 ? first + MK_MMA_TILE - 1 : t - 1;
  b.jlo = window > 0 && first + 1 - window > 0 ? first + 1 - window : 0;
  return b;
}

// A forward block's running state for this lane's two rows: outputs 0,
// maxima -inf, sums 0.
template <int NT>
__device__ __forceinline__ void mk_fwd_init(float (*o)[4], float* m, float* l) {
#pragma unroll
  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  m[0] = m[1] = -MK_INF;
  l[0] = l[1] = 0.f;
}

// P's accumulator tiles 2kc, 2kc + 1 as the A fragment of keys 16 kc ..
// 16 kc + 15 for O += P V (FlashAttention-2's register reuse).
__device__ __forceinline__ void mk_p_frag(const float (*s)[4], int kc, unsigned* pa) {
  pa[0] = mk_pack(s[2 * kc][0], s[2 * kc][1]);
  pa[1] = mk_pack(s[2 * kc][2], s[2 * kc][3]);
  pa[2] = mk_pack(s[2 * kc + 1][0], s[2 * kc + 1][1]);
  pa[3] = mk_pack(s[2 * kc + 1][2], s[2 * kc + 1][3]);
}

// Scores of one group of 8 keys or rows (nt) for a warp's 16 rows of A
// (a: D / 16 fragments): s = sum over channel chunks kc of A_kc B_kc, in kc
// order; frags(nt, kc, b) gives the B fragments of chunks kc and kc + 1 in
// b[0, 2) and b[2, 4). Every tensor-core kernel's products go through here
// or mk_tile_pv, so their order is the same whatever loads the operands.
template <int D, class F>
__device__ __forceinline__ void mk_row_scores(float* s, const unsigned (*a)[4], int nt, F frags) {
  s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
  for (int kc = 0; kc < D / 16; kc += 2) {
    unsigned b[4];
    frags(nt, kc, b);
    mk_mma(s, a[kc], b);
    mk_mma(s, a[kc + 1], b + 2);
  }
}

// O += P V for one tile of 64 keys: P from the scores s (mk_p_frag), and
// frags(kc, j, b) the B fragments of keys 16 kc .. for channel groups j and
// j + 1 in b[0, 2) and b[2, 4).
template <int NT, class F>
__device__ __forceinline__ void mk_tile_pv(float (*o)[4], const float (*s)[4], F frags) {
#pragma unroll
  for (int kc = 0; kc < MK_MMA_TILE / 16; ++kc) {
    unsigned pa[4];
    mk_p_frag(s, kc, pa);
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      unsigned b[4];
      frags(kc, j, b);
      mk_mma(o[j], pa, b);
      mk_mma(o[j + 1], pa, b + 2);
    }
  }
}

// The B fragment of row r, channels 16 kc .. 16 kc + 15, of a row-major
// fp16 tile with rows of `ld` halves, by two 4-byte shared loads (the plain
// kernels' operand loads).
__device__ __forceinline__ void mk_words2(const unsigned short* tile, int ld, int r, int kc,
                                          unsigned* b) {
  int c = threadIdx.x % 4;
  b[0] = mk_word(tile, r * ld + kc * 16 + 2 * c);
  b[1] = mk_word(tile, r * ld + kc * 16 + 2 * c + 8);
}

// The online softmax of one tile of 64 keys at j0 for this lane's two query
// rows (row r: g + 8r, at position pos[r]; a row's 64 scores sit in the 4
// lanes of its group): scores of keys the row does not see become -inf, the
// running maximum m[r] and sum l[r] and the outputs o are rescaled, and s
// becomes the tile's exp(s - m). Shared by mk_prefill_mma and
// mk_prefill_mma_pipe (the same code: the same bits).
template <int D>
__device__ __forceinline__ void mk_tile_softmax(float (*s)[4], float (*o)[4], float* m, float* l,
                                                int j0, int t, const int* pos, int window) {
  constexpr int NT = D / 8;
  int c = threadIdx.x % 4;
  // Only a tile that reaches past a row's position (the diagonal), past
  // the last key or, with a window, below a row's first key needs the mask
  // (FlashAttention-2 masks only those): both rows see every key of the
  // others, and the scores are the same with or without it.
  int jl = j0 + MK_MMA_TILE - 1;
  bool all = jl < t && jl <= pos[0] && jl <= pos[1] &&
             (window <= 0 || (j0 > pos[0] - window && j0 > pos[1] - window));
  if (!all) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int nt = 0; nt < MK_MMA_TILE / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          int j = j0 + nt * 8 + 2 * c + e;
          if (j >= t || !mk_sees(pos[r], j, window)) s[nt][2 * r + e] = -MK_INF;
        }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = m[r];
#pragma unroll
    for (int nt = 0; nt < MK_MMA_TILE / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) mx = fmaxf(mx, s[nt][2 * r + e]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float base = mx == -MK_INF ? 0.f : mx;
    float alpha = __expf(m[r] - base);
    l[r] *= alpha;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      o[j][2 * r] *= alpha;
      o[j][2 * r + 1] *= alpha;
    }
    m[r] = mx;
#pragma unroll
    for (int nt = 0; nt < MK_MMA_TILE / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float p = __expf(s[nt][2 * r + e] - base);
        s[nt][2 * r + e] = p;
        l[r] += p;
      }
  }
}

// The end of a forward block: this lane's two rows of outputs (o over the
// group's summed l) and their log-sum-exp, for rows below n.
template <int D>
__device__ __forceinline__ void mk_prefill_store(const float (*o)[4], float* l, const float* m,
                                                 float* out, float* lse, int h, int n, int i0) {
  constexpr int NT = D / 8;
  int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    int i = i0 + g + 8 * r;
    if (i >= n) continue;
    float* oi = out + ((mk_size)h * n + i) * D;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      oi[j * 8 + 2 * c] = o[j][2 * r] / l[r];
      oi[j * 8 + 2 * c + 1] = o[j][2 * r + 1] / l[r];
    }
    if (c == 0) lse[(mk_size)h * n + i] = m[r] + __logf(l[r]);
  }
}

// 5a. Tensor-core prefill: block (64 query rows, query head h); outputs and
// each row's log-sum-exp (of the scaled scores), as mk_prefill_fwd.
template <int D>
__device__ void mk_prefill_mma(const float* q, const unsigned short* k, const unsigned short* v,
                               float* out, float* lse, int n, int t, int group, float scale,
                               int window) {
  constexpr int LK = D + MK_MMA_PAD, LV = MK_MMA_TILE + MK_MMA_PAD, NT = D / 8;
  __shared__ unsigned short sk[MK_MMA_TILE * LK];
  __shared__ unsigned short svt[D * LV];
  int g = threadIdx.x % 32 / 4;
  unsigned qa[D / 16][4];
  MkFwdBlock b = mk_fwd_block<D>(q, qa, n, t, group, scale, window);
  float o[NT][4], m[2], l[2];
  mk_fwd_init<NT>(o, m, l);
  for (int j0 = b.jlo; j0 <= b.last; j0 += MK_MMA_TILE) {
    __syncthreads();  // the previous tile is no longer read
    mk_stage<D>(sk, nullptr, k + b.kv, j0, t, 1.f);
    mk_stage<D>(nullptr, svt, v + b.kv, j0, t, 1.f);  // V transposed: B fragments of P V
    __syncthreads();
    float s[MK_MMA_TILE / 8][4];
#pragma unroll
    for (int nt = 0; nt < MK_MMA_TILE / 8; ++nt)
      mk_row_scores<D>(s[nt], qa, nt, [&](int r, int kc, unsigned* bk) {
        mk_words2(sk, LK, r * 8 + g, kc, bk);
        mk_words2(sk, LK, r * 8 + g, kc + 1, bk + 2);
      });
    mk_tile_softmax<D>(s, o, m, l, j0, t, b.pos, window);
    mk_tile_pv<NT>(o, s, [&](int kc, int j, unsigned* bv) {
      mk_words2(svt, LV, j * 8 + g, kc, bv);
      mk_words2(svt, LV, (j + 1) * 8 + g, kc, bv + 2);
    });
  }
  mk_prefill_store<D>(o, l, m, out, lse, b.h, n, b.i0);
}

// 5b. A_cumul on tensor cores: block (64 keys, query head h) adds to each of
// its keys j the sum, over rows i in [i_begin, i_end) that see j, of
// exp(s_ij - lse_i), as mk_column_sums. Warp w owns keys 16w .. 16w + 15 of
// the block and computes S^T = K Q^T per tile of 64 rows; a lane sums its two
// keys' entries, and the 4 lanes of a key are added in a fixed order at the end.
// A column-sums block's geometry (block (64 keys from kb, query head h),
// warp w owning keys j0 = kb + 16 w ..): this lane's two keys, the rows
// [ib, ie) that see a key of the block (position >= kb and, with a window,
// position < kb + 63 + window; row i sits at position t - n + i); ka gets
// the warp's keys as A fragments. Shared by both column-sums kernels.
struct MkColBlock {
  int h, ib, ie;
  int key[2];
};
template <int D>
__device__ __forceinline__ MkColBlock mk_col_block(const unsigned short* k, unsigned (*ka)[4], int n,
                                                   int t, int group, int window, int i_begin,
                                                   int i_end) {
  int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  MkColBlock b;
  b.h = blockIdx.y;
  int kb = blockIdx.x * MK_MMA_TILE, j0 = kb + warp * 16, left = t - j0;
  mk_a_frags<D>(ka, k + ((mk_size)(b.h / group) * t + (j0 < t ? j0 : 0)) * D, left > 0 ? left : 0, 1.f);
  b.key[0] = j0 + g;
  b.key[1] = j0 + g + 8;
  b.ib = kb - (t - n) > i_begin ? kb - (t - n) : i_begin;
  b.ie = i_end;
  if (window > 0 && kb + MK_MMA_TILE - 1 + window - (t - n) < b.ie)
    b.ie = kb + MK_MMA_TILE - 1 + window - (t - n);
  return b;
}

// Adds to this lane's two keys the exp(s - lse) of the 16 x 8 tile of
// S^T = K Q^T at rows r0 + 8 nt .. (sl: the tile's log-sum-exps) that see
// them.
__device__ __forceinline__ void mk_cumul_tile(const float* s, const MkColBlock& b, int r0, int nt,
                                              const float* sl, int n, int t, int window,
                                              float* acc) {
  int c = threadIdx.x % 4, i0 = r0 + nt * 8 + 2 * c;
  // Both rows see both keys (most tiles): no per-entry test.
  bool all = i0 + 1 < b.ie && b.key[1] < t && b.key[1] <= t - n + i0 &&
             (window <= 0 || b.key[0] > t - n + i0 + 1 - window);
  if (all) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e / 2] += __expf(s[e] - sl[i0 + e % 2 - r0]);
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int i = i0 + e % 2, j = b.key[e / 2];
    if (i < b.ie && j < t && mk_sees(t - n + i, j, window)) acc[e / 2] += __expf(s[e] - sl[i - r0]);
  }
}

// The 4 lanes of a key add their sums in a fixed order into cumul [Hq][t].
__device__ __forceinline__ void mk_cumul_store(float* acc, const MkColBlock& b, float* cumul, int t) {
  int c = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
    acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 2);
    if (c == 0 && b.key[r] < t) cumul[(mk_size)b.h * t + b.key[r]] += acc[r];
  }
}

template <int D>
__device__ void mk_column_sums_mma(const float* q, const unsigned short* k, const float* lse, float* cumul,
                                   int n, int t, int group, float scale, int window, int i_begin,
                                   int i_end) {
  constexpr int LK = D + MK_MMA_PAD;
  __shared__ unsigned short sq[MK_MMA_TILE * LK];
  __shared__ float sl[MK_MMA_TILE];
  int g = threadIdx.x % 32 / 4;
  unsigned ka[D / 16][4];
  MkColBlock b = mk_col_block<D>(k, ka, n, t, group, window, i_begin, i_end);
  const float* qh = q + (mk_size)b.h * n * D;
  const float* lh = lse + (mk_size)b.h * n;
  float acc[2] = {0.f, 0.f};
  for (int r0 = b.ib; r0 < b.ie; r0 += MK_MMA_TILE) {
    __syncthreads();  // the previous tile is no longer read
    mk_stage<D>(sq, nullptr, qh, r0, b.ie, scale);
    for (int e = threadIdx.x; e < MK_MMA_TILE; e += blockDim.x) sl[e] = r0 + e < b.ie ? lh[r0 + e] : 0.f;
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < MK_MMA_TILE / 8; ++nt) {
      float s[4];
      mk_row_scores<D>(s, ka, nt, [&](int r, int kc, unsigned* bq) {
        mk_words2(sq, LK, r * 8 + g, kc, bq);
        mk_words2(sq, LK, r * 8 + g, kc + 1, bq + 2);
      });
      mk_cumul_tile(s, b, r0, nt, sl, n, t, window, acc);
    }
  }
  mk_cumul_store(acc, b, cumul, t);
}

// The launchable instances (head dims 64 and 128; grid: fwd (ceil(n / 64),
// Hq), column sums (ceil(t / 64), Hq); 128 threads). Their arguments are the
// scalar kernels' (`d`, equal to D, included) so the host launches either
// with one argument list, except that keys and values are fp16 bits (the
// host rounds them once, at upload, and keeps prefill histories so: half the
// bytes moved and read of the f32 the scalar kernels take).
// MK_PREFILL_KERNELS(SUF, QT, FWD, COLS, D): the pair mk_prefill_SUF<D> and
// mk_column_sums_SUF<D> around FWD<D> and COLS<D>, queries of type QT
// (prefill_pipe.cu makes its pair with it too, and undefines it).
#define MK_PREFILL_KERNELS(SUF, QT, FWD, COLS, D)                                                \
  extern "C" __global__ void mk_prefill_##SUF##D(                                                \
      const QT* __restrict__ q, const unsigned short* __restrict__ k,                            \
      const unsigned short* __restrict__ v,                                                      \
      float* __restrict__ out, float* __restrict__ lse, int n, int t, int d, int group,          \
      float scale, int window) {                                                                 \
    (void)d;                                                                                     \
    FWD<D>(q, k, v, out, lse, n, t, group, scale, window);                                       \
  }                                                                                              \
  extern "C" __global__ void mk_column_sums_##SUF##D(                                            \
      const QT* __restrict__ q, const unsigned short* __restrict__ k,                            \
      const float* __restrict__ lse,                                                             \
      float* __restrict__ cumul, int n, int t, int d, int group, float scale, int window,        \
      int i_begin, int i_end) {                                                                  \
    (void)d;                                                                                     \
    COLS<D>(q, k, lse, cumul, n, t, group, scale, window, i_begin, i_end);                       \
  }
MK_PREFILL_KERNELS(mma, float, mk_prefill_mma, mk_column_sums_mma, 64)
MK_PREFILL_KERNELS(mma, float, mk_prefill_mma, mk_column_sums_mma, 128)
