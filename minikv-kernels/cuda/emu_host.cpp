// Host entry points that run minikv.cu's kernels under the CPU emulation
// (emulate.h), with the launch geometry the CUDA backend uses. Built by
// build.rs with the `emulate` feature; called from the Rust tests.
#include "emulate.h"
#include "minikv.cu"

static unsigned blocks_of(int n, int per) { return (unsigned)((n + per - 1) / per); }

extern "C" {

// Prefill attention (+ A_cumul added into `cumul` when non-null).
void mk_emu_prefill(const float* q, const float* k, const float* v, float* out, float* lse,
                    float* cumul, int hq, int hkv, int n, int t, int d, float scale, int window) {
  int group = hq / hkv;
  emu::launch(dim3(n, hq), dim3(MK_THREADS), mk_prefill_fwd, q, k, v, out, lse, n, t, d, group,
              scale, window);
  if (cumul)
    emu::launch(dim3(blocks_of(t, MK_THREADS), hq), dim3(MK_THREADS), mk_column_sums, q, k,
                (const float*)lse, cumul, n, t, d, group, scale, window, 0, n);
}

// SnapKV window scores: column sums of queries [n - w, n) (their lse from
// mk_emu_prefill) added into `scores` [hq][t], then pooled over the first
// `t - w` columns into `pooled` [hq][t] (kernel 1: copy).
void mk_emu_window_scores(const float* q, const float* k, const float* lse, float* scores,
                          float* pooled, int hq, int hkv, int n, int t, int d, float scale, int w,
                          int kernel, int mode) {
  emu::launch(dim3(blocks_of(t, MK_THREADS), hq), dim3(MK_THREADS), mk_column_sums, q, k, lse,
              scores, n, t, d, hq / hkv, scale, 0, n - w, n);
  emu::launch(dim3(blocks_of(t - w, 32), hq), dim3(32), mk_pool1d, (const float*)scores, pooled,
              hq, t - w, t, kernel, mode);
}

void mk_emu_quant_keys(const float* rows, int g, int d, int bits, int t0, unsigned* words,
                       void* scale, void* minv, int f16) {
  emu::launch(dim3(blocks_of(d, 32)), dim3(32), mk_quant_keys_channel, rows, g, d, bits, t0,
              words, scale, minv, f16);
}

void mk_emu_quant_values(const float* rows, int n, int d, int g, int bits, int t0, int cap,
                         unsigned* words, void* scale, void* minv, int f16) {
  emu::launch(dim3(blocks_of(n, 32)), dim3(32), mk_quant_values_token, rows, n, d, g, bits, t0,
              cap, words, scale, minv, f16);
}

// Fused decode over `hkv` heads, split into chunks of `chunk` tokens.
void mk_emu_decode(const float* q, const MkHead* heads, int hq, int hkv, int d, float scale,
                   int chunk, float* out) {
  int longest = 0;
  for (int i = 0; i < hkv; ++i) {
    int tot = heads[i].len + heads[i].n_extra;
    if (tot > longest) longest = tot;
  }
  int splits = longest > 0 ? (longest + chunk - 1) / chunk : 1;
  std::vector<float> pm((size_t)hq * splits), pl((size_t)hq * splits),
      pacc((size_t)hq * splits * d);
  emu::launch(dim3(splits, hq), dim3(MK_THREADS), mk_decode_partial, q, heads, d, hq / hkv, scale,
              chunk, pm.data(), pl.data(), pacc.data());
  emu::launch(dim3(hq), dim3(MK_THREADS), mk_decode_combine, (const float*)pm.data(),
              (const float*)pl.data(), (const float*)pacc.data(), splits, d, out);
}

// fp16 conversions of the kernels, for tests against `half`.
unsigned short mk_emu_f2h(float f) { return mk_f2h(f); }
float mk_emu_h2f(unsigned short h) { return mk_h2f(h); }
}
