// CPU emulation of the subset of CUDA that minikv's kernels use, so that the
// same .cu sources run (slowly, exactly) on a machine without a GPU:
//
// * a launch runs the grid's blocks one at a time;
// * a block's threads run either as fibers (the default: stacks of their own on
//   the calling OS thread, switched only where a thread waits, so a barrier
//   costs a few context switches and runs are deterministic; launch_mode 0
//   runs them first to last between waits, 2 last to first, so that a read
//   of another thread's write without a barrier between them sees the
//   write's absence in one of the two orders whichever thread it is; 3 runs
//   the warps in turn, each through a whole phase between two block
//   barriers before the next starts, so that a warp that refills shared
//   memory without the barrier that waits for the other warps' reads
//   spoils what they then read) or as OS threads (launch_mode 1: real
//   concurrency, to shake out races the fixed fiber orders would hide);
// * `__syncthreads()` is a barrier over the block's threads;
// * `__shared__` variables are function statics: one copy, shared by the
//   threads of the block that is running (blocks never overlap);
// * warps are groups of 32 consecutive threads; a shuffle or vote writes the
//   lane's value to a per-warp exchange, waits on a per-warp barrier, reads,
//   and waits again (so a later exchange cannot overwrite a value still being
//   read). As on a GPU, every lane of the warp must take part (full mask).
//   A barrier that can never complete (threads that returned while others
//   wait) is detected in fiber mode and fails the launch.
// * an asynchronous copy (cp.async) reads its source when issued and lands
//   at the wait that retires its group; its destination holds 0xff bytes
//   until then (a read too early gives NaN or wrong codes, not the data), and
//   a thread that ends with copies no wait retired fails the launch.
//
// Only what the kernels need is here; anything else fails to compile.
#pragma once
#if !defined(__x86_64__) || defined(MK_EMU_UCONTEXT)
#define MK_EMU_UCONTEXT 1
#include <ucontext.h>
#endif

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

// Kernels test this to use the emulated forms of instructions the host
// compiler does not have (tensor-core products, PTX conversions).
#define MK_EMULATED 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace emu {
// Blocks of mk_decode_staged that staged their keys / values in the launch
// that runs (counted by its threads), and, per launching thread, in its last
// launch (for tests: launches are serialized, so the counts are exact).
inline std::atomic<unsigned long long> staged_keys{0}, staged_values{0};
inline thread_local unsigned long long last_staged_keys = 0, last_staged_values = 0;
inline int mode = 0;  // 0: fibers, 1: OS threads, 2: fibers in reverse order, 3: warps in turn

#ifdef MK_EMU_UCONTEXT
// Fiber scheduling state (one launch at a time, on the launching thread).
struct Fiber {
  ucontext_t ctx;
  bool done = false;
};
inline ucontext_t scheduler;
#else
// On x86-64 a fiber switch is the few instructions below: glibc's
// swapcontext also saves and restores the signal mask, a system call per
// switch, which took most of an emulated launch's time. A switch pushes the
// registers the System V ABI makes callee-saved, stores the stack pointer
// in *save, loads `load` as the stack pointer, pops and returns into the
// other fiber (or, the first time, into its entry, from the frame that
// start_fiber built). The FPU and SSE control words are not switched: no
// kernel changes them.
extern "C" void mk_emu_switch(void** save, void* load);
asm(R"(
  .text
  .globl mk_emu_switch
  .type mk_emu_switch, @function
mk_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mk_emu_switch, .-mk_emu_switch
)");
struct Fiber {
  void* sp = nullptr;
  bool done = false;
};
inline void* scheduler = nullptr;
#endif
inline std::vector<Fiber> fibers;
inline unsigned current = 0;
inline unsigned long progress = 0;  // barrier arrivals and finished threads
inline std::function<void()> body;

#ifdef MK_EMU_UCONTEXT
inline void yield() { swapcontext(&fibers[current].ctx, &scheduler); }
#else
inline void yield() { mk_emu_switch(&fibers[current].sp, scheduler); }
#endif

// A barrier over `expected` threads: cooperative in fiber mode, std::barrier
// in thread mode.
struct Barrier {
  unsigned expected, count = 0;
  unsigned long gen = 0;
  std::unique_ptr<std::barrier<>> os;
  explicit Barrier(unsigned n) : expected(n) {
    if (mode == 1) os = std::make_unique<std::barrier<>>(n);
  }
  void arrive_and_wait() {
    if (os) {
      os->arrive_and_wait();
      return;
    }
    ++progress;
    unsigned long g = gen;
    if (++count == expected) {
      count = 0;
      ++gen;
      return;
    }
    while (gen == g) yield();
  }
};

// One thread's asynchronous copies (cp.async): those issued since its last
// commit, and its committed groups, oldest first. A copy's source is read
// when it is issued and its 16 bytes land at the wait that retires its
// group; until then the destination holds 0xff bytes (NaN as fp16 or f32),
// so that a read before the wait, or before the barrier that makes other
// threads' copies visible, gives wrong numbers instead of the right ones.
struct Copy16 {
  unsigned char* dst;
  unsigned char bytes[16];
};
struct AsyncCopies {
  std::vector<Copy16> open;
  std::vector<std::vector<Copy16>> groups;
};

struct Block {
  std::unique_ptr<Barrier> all;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<uint64_t> slots;  // one exchange slot per thread
  std::vector<uint32_t> wide;   // kWide words per thread (warp_gather)
  std::vector<AsyncCopies> copies;  // per thread
};
inline Block* block = nullptr;
inline dim3 grid_dim, block_dim, block_idx;
inline thread_local dim3 os_thread_idx;
inline thread_local unsigned os_flat = 0;
inline std::vector<dim3> fiber_idx;

inline unsigned flat() { return mode == 1 ? os_flat : current; }
inline dim3 thread_idx() { return mode == 1 ? os_thread_idx : fiber_idx[current]; }
}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block->all->arrive_and_wait(); }

namespace emu {
template <class T>
inline T exchange(T v, unsigned src_lane) {
  static_assert(sizeof(T) <= 8, "exchange of at most 8 bytes");
  Block* b = block;
  unsigned me = flat(), warp = me / 32, base = warp * 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  b->slots[me] = bits;
  b->warps[warp]->arrive_and_wait();
  uint64_t got = b->slots[base + (src_lane & 31)];
  b->warps[warp]->arrive_and_wait();
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

// Words a thread can publish at once through warp_gather.
inline constexpr unsigned kWide = 8;

// Every lane's `n` (<= kWide) words, gathered for the whole warp:
// out[l * n + i] = word i of lane l (the emulation of a warp-wide operation
// such as a tensor-core product, whose operands are spread over the lanes).
inline void warp_gather(const unsigned* in, unsigned n, unsigned* out) {
  if (n > kWide) throw std::runtime_error("warp_gather of more than kWide words");
  Block* b = block;
  unsigned me = flat(), warp = me / 32, base = warp * 32;
  std::memcpy(&b->wide[me * kWide], in, n * 4);
  b->warps[warp]->arrive_and_wait();
  for (unsigned l = 0; l < 32; ++l) std::memcpy(out + l * n, &b->wide[(base + l) * kWide], n * 4);
  b->warps[warp]->arrive_and_wait();
}

// A broken requirement of an instruction that a thread met (the first one):
// the launch fails with it once the block has run (an exception cannot
// leave a fiber's or an OS thread's stack).
inline std::mutex fault_lock;
inline std::string fault;
inline void report_fault(const char* what) {
  std::lock_guard<std::mutex> g(fault_lock);
  if (fault.empty()) fault = what;
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16, warp-wide: lane l gives
// the address of row l % 8 of matrix l / 8 (8 fp16, 16-byte aligned, as the
// hardware requires: a misaligned row fails the launch); out[i] is this
// lane's word of matrix i: row lane / 4, elements 2 (lane % 4) and + 1, or
// with `trans` column lane / 4 of rows 2 (lane % 4) and + 1, the lower index
// in the low half. The rows are read after every lane of the warp has
// given its address, as a warp-wide load reads them.
inline void ldmatrix_x4(unsigned* out, const void* row, bool trans) {
  uint64_t a = reinterpret_cast<uint64_t>(row);
  if (a % 16 != 0) report_fault("ldmatrix: a row address is not 16-byte aligned");
  unsigned mine[2] = {(unsigned)a, (unsigned)(a >> 32)}, all[64];
  warp_gather(mine, 2, all);
  unsigned lane = flat() % 32;
  auto at = [&](unsigned m, unsigned r, unsigned col) {
    uint64_t p = all[(m * 8 + r) * 2] | ((uint64_t)all[(m * 8 + r) * 2 + 1] << 32);
    unsigned short h;
    std::memcpy(&h, reinterpret_cast<const unsigned char*>(p) + 2 * col, 2);
    return (unsigned)h;
  };
  for (unsigned m = 0; m < 4; ++m) {
    unsigned e = 2 * (lane % 4);
    out[m] = trans ? at(m, e, lane / 4) | (at(m, e + 1, lane / 4) << 16)
                   : at(m, lane / 4, e) | (at(m, lane / 4, e + 1) << 16);
  }
}
}  // namespace emu

namespace emu {
// cp.async.cg.shared.global of 16 bytes: issued now, landing at a later wait.
inline void cp_async16(void* dst, const void* src) {
  Copy16 c;
  c.dst = static_cast<unsigned char*>(dst);
  std::memcpy(c.bytes, src, 16);
  std::memset(dst, 0xff, 16);
  block->copies[flat()].open.push_back(c);
}
// cp.async.commit_group: the copies issued since the last commit become a group.
inline void cp_commit() {
  AsyncCopies& a = block->copies[flat()];
  a.groups.push_back(std::move(a.open));
  a.open.clear();
}
// cp.async.wait_group n: all but the newest n committed groups have landed.
inline void cp_wait(unsigned n) {
  AsyncCopies& a = block->copies[flat()];
  while (a.groups.size() > n) {
    for (const Copy16& c : a.groups.front()) std::memcpy(c.dst, c.bytes, 16);
    a.groups.erase(a.groups.begin());
  }
}
// Fails the launch when a thread of the block that just ran left copies
// that no wait retired (on a GPU they would land at an unknown time, over
// whatever the memory holds by then).
inline void check_copies_retired() {
  for (const AsyncCopies& a : block->copies)
    if (!a.open.empty() || !a.groups.empty())
      throw std::runtime_error("a thread ended with asynchronous copies (cp.async) no wait retired");
}
}  // namespace emu

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return emu::exchange(v, (emu::flat() % 32) ^ (unsigned)mask);
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
inline constexpr std::size_t kStack = 128 * 1024;
// Fiber stacks, shared by every launch (launches are serialized).
inline std::vector<std::unique_ptr<char[]>> stacks;

inline void trampoline() {
  body();
  fibers[current].done = true;
  ++progress;
#ifndef MK_EMU_UCONTEXT
  // Back to the scheduler for good: a finished fiber is never resumed.
  mk_emu_switch(&fibers[current].sp, scheduler);
  __builtin_unreachable();
#endif
}

#ifdef MK_EMU_UCONTEXT
inline void start_fiber(Fiber& f, char* stack) {
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = stack;
  f.ctx.uc_stack.ss_size = kStack;
  f.ctx.uc_link = &scheduler;
  makecontext(&f.ctx, trampoline, 0);
}
inline void resume(Fiber& f) { swapcontext(&scheduler, &f.ctx); }
#else
// The frame the first switch into a fiber pops: six callee-saved registers
// (zero), then `trampoline` as the return address, then a null return
// address for trampoline itself (it never returns), which leaves the stack
// pointer 8 bytes past a 16-byte boundary at its entry, as after a call.
inline void start_fiber(Fiber& f, char* stack) {
  auto top = reinterpret_cast<std::uintptr_t>(stack + kStack) & ~std::uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(&trampoline);
  for (int r = 0; r < 6; ++r) *--sp = nullptr;
  f.sp = sp;
}
inline void resume(Fiber& f) { mk_emu_switch(&scheduler, f.sp); }
#endif

// Runs `kernel(args...)` over `grid` x `block` threads, blocks in order,
// the threads as fibers (`how` 0; 2: in reverse order; 3: warps in turn)
// or OS threads (1). Launches are serialized: `__shared__` statics and the
// globals above belong to the one block that runs.
inline std::mutex launch_lock;
template <class K, class... A>
void launch_mode(int how, dim3 grid, dim3 blk, K kernel, A... args) {
  std::lock_guard<std::mutex> guard(launch_lock);
  staged_keys = 0;
  staged_values = 0;
  last_staged_keys = last_staged_values = 0;
  mode = how;
  fault.clear();
  unsigned n = blk.x * blk.y * blk.z;
  if (n == 0 || n % 32 != 0) throw std::runtime_error("emulated blocks hold whole warps");
  grid_dim = grid;
  block_dim = blk;
  if (mode != 1) {
    while (stacks.size() < n) stacks.emplace_back(new char[kStack]);
    fibers.assign(n, Fiber{});
    fiber_idx.resize(n);
    for (unsigned i = 0; i < n; ++i)
      fiber_idx[i] = dim3(i % blk.x, (i / blk.x) % blk.y, i / (blk.x * blk.y));
    body = [&] { kernel(args...); };
  }
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b;
        b.all = std::make_unique<Barrier>(n);
        for (unsigned w = 0; w < n / 32; ++w) b.warps.push_back(std::make_unique<Barrier>(32));
        b.slots.assign(n, 0);
        b.wide.assign(n * kWide, 0);
        b.copies.assign(n, AsyncCopies{});
        block = &b;
        block_idx = dim3(bx, by, bz);
        if (mode == 1) {
          std::vector<std::thread> threads;
          threads.reserve(n);
          for (unsigned i = 0; i < n; ++i)
            threads.emplace_back([=] {
              os_flat = i;
              os_thread_idx = dim3(i % blk.x, (i / blk.x) % blk.y, i / (blk.x * blk.y));
              kernel(args...);
            });
          for (auto& t : threads) t.join();
        } else {
          for (unsigned i = 0; i < n; ++i) {
            Fiber& f = fibers[i];
            f.done = false;
            start_fiber(f, stacks[i].get());
          }
          unsigned left = n;
          auto step = [&](unsigned i) {
            if (fibers[i].done) return;
            current = i;
            resume(fibers[i]);
            if (fibers[i].done) --left;
          };
          while (left > 0) {
            unsigned long before = progress;
            if (mode == 3) {
              // Warps in turn: a warp's fibers run until none of them gets
              // further (all wait at a block barrier, or are done), then the
              // next warp's: a whole phase between two __syncthreads.
              for (unsigned w = 0; w < n / 32; ++w) {
                unsigned long p;
                do {
                  p = progress;
                  for (unsigned k = 0; k < 32; ++k) step(w * 32 + k);
                } while (progress != p);
              }
            } else {
              for (unsigned k = 0; k < n; ++k) step(mode == 2 ? n - 1 - k : k);
            }
            if (left > 0 && progress == before) {
              block = nullptr;
              throw std::runtime_error("a barrier can never complete (deadlock)");
            }
          }
        }
        if (!fault.empty()) {
          block = nullptr;
          throw std::runtime_error(fault);
        }
        try {
          check_copies_retired();
        } catch (...) {
          block = nullptr;
          throw;
        }
        block = nullptr;
      }
  last_staged_keys = staged_keys;
  last_staged_values = staged_values;
}

template <class K, class... A>
void launch(dim3 grid, dim3 blk, K kernel, A... args) {
  launch_mode(0, grid, blk, kernel, args...);
}
}  // namespace emu
