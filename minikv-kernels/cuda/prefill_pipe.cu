// 5c. The pipelined tensor-core prefill (mk_prefill_mma_pipe{64,128} and
// mk_column_sums_mma_pipe{64,128}, PrefillPath::Pipelined). Appended after decode_fast.cu (one source for
// NVRTC; emu_host.cpp includes it), whose asynchronous copies it uses.
//
// mk_prefill_mma's products in the same order on the same fp16 operands, so
// the same bits; what changes is how the operands reach the tensor cores.
// mk_prefill_mma stages each tile of 64 keys and values through registers
// (a 4-byte global load and 16-bit shared stores per pair of halves, the
// values transposed), with the whole block waiting at a barrier for the
// loads, and builds each B fragment from two 16-bit shared loads. Here:
//   - keys and values are staged row-major, [64][D + 8] fp16 each, by
//     asynchronous 16-byte copies (cp.async; rows past the last key are
//     zeroed by plain stores), each tile issued one phase ahead: the next
//     tile's keys are copied while this tile's P V runs, the next tile's
//     values while the next tile's scores and softmax run;
//   - B fragments come from shared memory by ldmatrix.x4, four 8 x 8
//     matrices (two products' fragments) per instruction; the values, which
//     P V takes column-major, by its .trans form. Rows of D + 8 halves put
//     the 8 rows of a matrix on 8 different bank quads.
// Two commit groups per tile (keys, then values), always committed, also
// empty ones after the last tile, so that `wait_group 1` retires exactly the
// group a phase needs. The queries are fp16 bits of q / sqrt(d), rounded by
// the host as mk_a_frags rounds f32 queries (the same operands); 5d, the
// column sums, stages their tiles the same way.

// Keys and values of one tile, row-major with rows padded by 8 halves (row
// stride (D + 8) x 2 bytes, a multiple of 16: every 16-byte unit aligned).
template <int D>
struct alignas(16) MkPipeTiles {
  unsigned short k[MK_MMA_TILE * (D + MK_MMA_PAD)];
  unsigned short v[MK_MMA_TILE * (D + MK_MMA_PAD)];
};

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lane l gives the address
// of row l % 8 of matrix l / 8 (8 halves, 16-byte aligned); r[i] is this
// lane's word of matrix i: row lane / 4, halves 2 (lane % 4) and + 1 (with
// TRANS, column lane / 4 of rows 2 (lane % 4) and + 1), the lower index in
// the low half: the B-fragment layout of mma.m16n8k16.
template <bool TRANS>
__device__ __forceinline__ void mk_ldsm4(unsigned* r, const unsigned short* row) {
#ifdef MK_EMULATED
  emu::ldmatrix_x4(r, row, TRANS);
#else
  unsigned a = (unsigned)__cvta_generic_to_shared(row);
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
#endif
}

// 16 zero bytes (16-byte aligned).
__device__ __forceinline__ void mk_zero16(void* p) {
#ifdef MK_EMULATED
  std::memset(p, 0, 16);
#else
  *(mk_u4*)p = mk_u4{{0u, 0u, 0u, 0u}};
#endif
}

// Issues the copies of rows [r0, r0 + 64) of a row-major [rows][D] fp16
// matrix (16-byte aligned) into dst [64][D + 8], rows >= `rows` zeroed, and
// commits them as one group.
template <int D>
__device__ __forceinline__ void mk_pipe_stage(unsigned short* dst, const unsigned short* src,
                                             int r0, int rows) {
  constexpr int LD = D + MK_MMA_PAD, U = D / 8;
  for (int e = threadIdx.x; e < MK_MMA_TILE * U; e += blockDim.x) {
    int r = e / U, u = e % U;
    unsigned short* d = dst + r * LD + u * 8;
    if (r0 + r < rows) mk_cp16(d, src + (mk_size)(r0 + r) * D + u * 8);
    else mk_zero16(d);
  }
  mk_cp_commit();
}

template <int D>
__device__ void mk_prefill_pipe(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                                float* out, float* lse, int n, int t, int group, float scale,
                                int window) {
  constexpr int LD = D + MK_MMA_PAD, NT = D / 8;
  __shared__ MkPipeTiles<D> st;
  int lane = threadIdx.x % 32;
  unsigned qa[D / 16][4];
  MkFwdBlock b = mk_fwd_block<D>(q, qa, n, t, group, scale, window);
  float o[NT][4], m[2], l[2];
  mk_fwd_init<NT>(o, m, l);
  if (b.jlo <= b.last) {
    mk_pipe_stage<D>(st.k, k + b.kv, b.jlo, t);
    mk_pipe_stage<D>(st.v, v + b.kv, b.jlo, t);
  }
  // This lane's ldmatrix row: row lane % 8 of matrix lane / 8.
  int mr = lane % 8, mi = lane / 8;
  for (int j0 = b.jlo; j0 <= b.last; j0 += MK_MMA_TILE) {
    bool more = j0 + MK_MMA_TILE <= b.last;
    mk_cp_wait<1>();  // this tile's keys (its values may still be in flight)
    __syncthreads();
    // S = Q K^T: matrices 0-3 are channels 16 kc .. + 7, + 8 .. + 15 and the
    // same of kc + 1 for keys 8 nt .. 8 nt + 7: the B fragments of kc, kc + 1.
    float s[MK_MMA_TILE / 8][4];
#pragma unroll
    for (int nt = 0; nt < MK_MMA_TILE / 8; ++nt)
      mk_row_scores<D>(s[nt], qa, nt, [&](int r, int kc, unsigned* bk) {
        mk_ldsm4<false>(bk, st.k + (r * 8 + mr) * LD + kc * 16 + mi * 8);
      });
    mk_tile_softmax<D>(s, o, m, l, j0, t, b.pos, window);
    __syncthreads();  // every warp's scores are done with st.k
    if (more) mk_pipe_stage<D>(st.k, k + b.kv, j0 + MK_MMA_TILE, t);
    else mk_cp_commit();
    mk_cp_wait<1>();  // this tile's values (the next keys may be in flight)
    __syncthreads();
    // O += P V: matrices 0-3 are keys 16 kc .. + 7 and + 8 .. + 15 of
    // channels 8 j .., then of 8 (j + 1) .., transposed: the B fragments of
    // j and j + 1.
    mk_tile_pv<NT>(o, s, [&](int kc, int j, unsigned* bv) {
      mk_ldsm4<true>(bv, st.v + (kc * 16 + (mi % 2) * 8 + mr) * LD + (j + mi / 2) * 8);
    });
    __syncthreads();  // every warp's P V is done with st.v
    if (more) mk_pipe_stage<D>(st.v, v + b.kv, j0 + MK_MMA_TILE, t);
    else mk_cp_commit();
  }
  mk_cp_wait<0>();  // the empty groups of the last tile
  mk_prefill_store<D>(o, l, m, out, lse, b.h, n, b.i0);
}

// 5d. A_cumul, pipelined (mk_column_sums_mma_pipe{64,128}): mk_column_sums_mma's
// products and sums in the same order (the same bits), its query tiles
// (fp16, times 1/sqrt(d) already: the host rounds them as mk_a_frags would)
// staged by asynchronous copies into two buffers, the next tile's copy
// issued before this tile's products, and the B fragments loaded by
// ldmatrix; each tile's log-sum-exp entries beside it (plain loads: a head's
// rows start anywhere in lse, not on 16 bytes).
template <int D>
struct alignas(16) MkPipeRows {
  unsigned short q[2][MK_MMA_TILE * (D + MK_MMA_PAD)];
  float l[2][MK_MMA_TILE];
};

template <int D>
__device__ void mk_column_sums_pipe(const unsigned short* q, const unsigned short* k,
                                    const float* lse, float* cumul, int n, int t, int group,
                                    float scale, int window, int i_begin, int i_end) {
  (void)scale;  // the queries come scaled
  constexpr int LD = D + MK_MMA_PAD;
  __shared__ MkPipeRows<D> st;
  int lane = threadIdx.x % 32;
  unsigned ka[D / 16][4];
  MkColBlock cb = mk_col_block<D>(k, ka, n, t, group, window, i_begin, i_end);
  const unsigned short* qh = q + (mk_size)cb.h * n * D;
  const float* lh = lse + (mk_size)cb.h * n;
  float acc[2] = {0.f, 0.f};
  // Tile r0's rows (zeros from ie on) and log-sum-exps into buffer b.
  auto stage = [&](int b, int r0) {
    mk_pipe_stage<D>(st.q[b], qh, r0, cb.ie);
    for (int e = threadIdx.x; e < MK_MMA_TILE; e += blockDim.x)
      st.l[b][e] = r0 + e < cb.ie ? lh[r0 + e] : 0.f;
  };
  if (cb.ib < cb.ie) stage(0, cb.ib);
  int mr = lane % 8, mi = lane / 8, b = 0;
  for (int r0 = cb.ib; r0 < cb.ie; r0 += MK_MMA_TILE, b ^= 1) {
    // The next tile into the other buffer, whose reads ended at the last
    // iteration's closing barrier.
    if (r0 + MK_MMA_TILE < cb.ie) stage(b ^ 1, r0 + MK_MMA_TILE);
    else mk_cp_commit();
    mk_cp_wait<1>();  // this tile's rows
    __syncthreads();
    const unsigned short* sq = st.q[b];
#pragma unroll
    for (int nt = 0; nt < MK_MMA_TILE / 8; ++nt) {
      float s[4];
      mk_row_scores<D>(s, ka, nt, [&](int r, int kc, unsigned* bq) {
        mk_ldsm4<false>(bq, sq + (r * 8 + mr) * LD + kc * 16 + mi * 8);
      });
      mk_cumul_tile(s, cb, r0, nt, st.l[b], n, t, window, acc);
    }
    __syncthreads();  // every warp is done with buffer b
  }
  mk_cp_wait<0>();  // the empty group of the last tile
  mk_cumul_store(acc, cb, cumul, t);
}

// The launchable instances (head dims 64 and 128; MK_PREFILL_KERNELS of
// prefill_mma.cu), except that the queries are fp16 bits of q times
// `scale` (the host rounds them as the plain kernels do: the same operands,
// half the bytes uploaded; `scale` is then unused); queries, keys and values
// must be 16-byte aligned (the host checks).
MK_PREFILL_KERNELS(mma_pipe, unsigned short, mk_prefill_pipe, mk_column_sums_pipe, 64)
MK_PREFILL_KERNELS(mma_pipe, unsigned short, mk_prefill_pipe, mk_column_sums_pipe, 128)
#undef MK_PREFILL_KERNELS
