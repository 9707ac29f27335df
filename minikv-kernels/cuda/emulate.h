// CPU emulation of the subset of CUDA that minikv's kernels use, so that the
// same .cu sources run (slowly, exactly) on a machine without a GPU:
//
// * a launch runs the grid's blocks one at a time; a block's threads are OS
//   threads (std::thread), `__syncthreads()` is a barrier over them;
// * `__shared__` variables are function statics: one copy, shared by the
//   threads of the block that is running (blocks never overlap);
// * warps are groups of 32 consecutive threads; a shuffle or vote writes the
//   lane's value to a per-warp exchange, waits on a per-warp barrier, reads,
//   and waits again (so a later exchange cannot overwrite a value still being
//   read). As on a GPU, every lane of the warp must take part (full mask).
//
// Only what the kernels need is here; anything else fails to compile.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace emu {
struct Block {
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint64_t> slots;  // one exchange slot per thread
};
inline Block* block = nullptr;
inline dim3 grid_dim, block_dim, block_idx;
inline thread_local dim3 thread_idx;
inline thread_local unsigned flat = 0;
}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block->all->arrive_and_wait(); }

namespace emu {
template <class T>
inline T exchange(T v, unsigned src_lane) {
  static_assert(sizeof(T) <= 8, "exchange of at most 8 bytes");
  Block* b = block;
  unsigned warp = flat / 32, base = warp * 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  b->slots[flat] = bits;
  b->warps[warp]->arrive_and_wait();
  uint64_t got = b->slots[base + (src_lane & 31)];
  b->warps[warp]->arrive_and_wait();
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}
}  // namespace emu

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return emu::exchange(v, (emu::flat % 32) ^ (unsigned)mask);
}
template <class T>
inline T __shfl_sync(unsigned, T v, int lane) {
  return emu::exchange(v, (unsigned)lane);
}
inline unsigned __ballot_sync(unsigned, int pred) {
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l) r |= (emu::exchange((unsigned)(pred != 0), l) ? 1u : 0u) << l;
  return r;
}

inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
using std::fmaxf;
using std::fminf;
using std::rintf;
inline float __logf(float x) { return std::log(x); }

namespace emu {
// Runs `kernel(args...)` over `grid` x `block` threads, blocks in order.
// Launches are serialized: `__shared__` statics and the globals above belong
// to the one block that runs.
inline std::mutex launch_lock;
template <class K, class... A>
void launch(dim3 grid, dim3 blk, K kernel, A... args) {
  std::lock_guard<std::mutex> guard(launch_lock);
  unsigned n = blk.x * blk.y * blk.z;
  if (n % 32 != 0) throw std::runtime_error("emulated blocks hold whole warps");
  grid_dim = grid;
  block_dim = blk;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b;
        b.all = std::make_unique<std::barrier<>>(n);
        for (unsigned w = 0; w < n / 32; ++w) b.warps.push_back(std::make_unique<std::barrier<>>(32));
        b.slots.assign(n, 0);
        block = &b;
        block_idx = dim3(bx, by, bz);
        std::vector<std::thread> threads;
        threads.reserve(n);
        for (unsigned i = 0; i < n; ++i)
          threads.emplace_back([=] {
            flat = i;
            thread_idx = dim3(i % blk.x, (i / blk.x) % blk.y, i / (blk.x * blk.y));
            kernel(args...);
          });
        for (auto& t : threads) t.join();
        block = nullptr;
      }
}
}  // namespace emu
