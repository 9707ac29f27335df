// The emulated counterpart of cuLaunchKernel: runs one of minikv.cu's kernels
// under the CPU emulation (emulate.h) with its arguments passed as an array
// of pointers to the values, exactly as the CUDA driver takes them. The
// `emulated` device of the Rust crate launches through this, so the backend's
// host code is the same on a GPU and here. Built by build.rs with the
// `emulate` feature.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include "emulate.h"
#include "minikv.cu"
#include "prefill_mma.cu"
#include "decode_fast.cu"
#include "prefill_pipe.cu"

namespace {
// Why the calling thread's last launch failed (mk_emu_last_error).
thread_local std::string last_error;

// A kernel of the emulation's own tests (not of minikv.cu): each thread
// stages 16 bytes of `src` into shared memory by an asynchronous copy and
// then, as `order` says, 0: waits, syncs and writes its neighbour's 16
// bytes to `out`; 1: does the same with the wait only after every thread
// has read (a race the emulation must show: `out` gets the 0xff fill);
// 2: commits and ends without a wait (the launch must fail); 3: stores its
// 16 bytes and reads its predecessor's with no barrier between (in the
// fibers' order, first to last, it gets the predecessor's new bytes; in
// reverse order what the previous launch left); 4: stores its 16 bytes,
// takes part in a warp shuffle and reads those of the thread 32 ahead (the
// next warp's) with no block barrier between (with the fibers first to
// last it gets the new bytes, the shuffle letting every warp store first;
// with the warps in turn, the next warp has not run yet: what the previous
// launch left, except in the last warp, which reads the first's); 5: an
// ldmatrix whose rows sit 2 bytes past a 16-byte boundary (the launch must
// fail, as the hardware faults).
__global__ void mk_emu_selftest_cp(const unsigned char* src, unsigned char* out, int order) {
  __shared__ MkStageBuf stage_buf;
  unsigned char* stage = stage_buf.b;
  int t = threadIdx.x, n = blockDim.x;
  if (order == 3) {
    std::memcpy(stage + t * 16, src + t * 16, 16);
    std::memcpy(out + t * 16, stage + ((t + n - 1) % n) * 16, 16);
    return;
  }
  if (order == 5) {
    unsigned r[4];
    emu::ldmatrix_x4(r, stage + (t % 32) * 16 + 2, false);
    std::memcpy(out + t * 16, r, 16);
    return;
  }
  if (order == 4) {
    std::memcpy(stage + t * 16, src + t * 16, 16);
    (void)__shfl_xor_sync(0xffffffffu, t, 1);
    std::memcpy(out + t * 16, stage + ((t + 32) % n) * 16, 16);
    return;
  }
  emu::cp_async16(stage + t * 16, src + t * 16);
  emu::cp_commit();
  if (order == 2) return;
  if (order == 0) emu::cp_wait(0);
  __syncthreads();
  std::memcpy(out + t * 16, stage + ((t + 1) % n) * 16, 16);
  __syncthreads();
  if (order == 1) emu::cp_wait(0);
}

template <class... A, std::size_t... I>
void call(int how, dim3 g, dim3 b, void (*k)(A...), void** p, std::index_sequence<I...>) {
  emu::launch_mode(how, g, b, k, *static_cast<std::remove_cv_t<A>*>(p[I])...);
}
template <class... A>
int run(int how, dim3 g, dim3 b, void (*k)(A...), void** p, int n_params) {
  if (n_params != (int)sizeof...(A)) return 2;
  call(how, g, b, k, p, std::index_sequence_for<A...>{});
  return 0;
}
}  // namespace

extern "C" {

// Threads as fibers (`how` 0), OS threads (1) or fibers in reverse order
// (2). Returns 0: launched;
// 1: unknown kernel; 2: wrong argument count; 3: the emulation failed (a
// block that is not whole warps, a barrier that can never complete,
// asynchronous copies never waited for: mk_emu_last_error says which).
int mk_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                  unsigned by, unsigned bz, void** params, int n_params, int how) {
  dim3 g(gx, gy, gz), b(bx, by, bz);
  try {
#define MK_KERNEL(f) \
  if (std::strcmp(name, #f) == 0) return run(how, g, b, f, params, n_params);
    MK_KERNEL(mk_prefill_fwd)
    MK_KERNEL(mk_column_sums)
    MK_KERNEL(mk_pool1d)
    MK_KERNEL(mk_quant_keys_channel)
    MK_KERNEL(mk_quant_values_token)
    MK_KERNEL(mk_decode_partial)
    MK_KERNEL(mk_decode_fast)
    MK_KERNEL(mk_decode_staged)
    MK_KERNEL(mk_decode_combine)
    MK_KERNEL(mk_scatter)
    MK_KERNEL(mk_prefill_mma64)
    MK_KERNEL(mk_column_sums_mma64)
    MK_KERNEL(mk_prefill_mma128)
    MK_KERNEL(mk_column_sums_mma128)
    MK_KERNEL(mk_prefill_mma_pipe64)
    MK_KERNEL(mk_prefill_mma_pipe128)
    MK_KERNEL(mk_column_sums_mma_pipe64)
    MK_KERNEL(mk_column_sums_mma_pipe128)
    MK_KERNEL(mk_emu_selftest_cp)
#undef MK_KERNEL
  } catch (const std::exception& e) {
    last_error = e.what();
    return 3;
  }
  return 1;
}

// Device memory of the emulation: `bytes` (a multiple of 16) of zeros that
// end where an inaccessible guard page begins (another guard page sits
// before the first page), so a kernel's access past the end of a device
// buffer faults at once, as compute-sanitizer's memcheck would flag it on
// a GPU, instead of reading a neighbour's bytes. With `before` the buffer
// starts right after the first guard page instead (an access before its
// start faults). Null when out of memory.
void* mk_emu_alloc(unsigned long bytes, int before) {
  unsigned long page = (unsigned long)sysconf(_SC_PAGESIZE);
  unsigned long data = (bytes + page - 1) / page * page;
  void* base = mmap(nullptr, data + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  char* d = static_cast<char*>(base) + page;
  if (mprotect(d, data, PROT_READ | PROT_WRITE) != 0) {
    munmap(base, data + 2 * page);
    return nullptr;
  }
  return before ? d : d + (data - bytes);
}

// Frees what mk_emu_alloc(bytes) returned.
void mk_emu_free(void* p, unsigned long bytes) {
  unsigned long page = (unsigned long)sysconf(_SC_PAGESIZE);
  unsigned long data = (bytes + page - 1) / page * page;
  // The page-aligned start of the data pages, wherever the buffer sits.
  char* d = reinterpret_cast<char*>(reinterpret_cast<unsigned long>(p) / page * page);
  munmap(d - page, data + 2 * page);
}

// Why the calling thread's last failed launch failed: at most n - 1 bytes
// and a NUL into buf.
void mk_emu_last_error(char* buf, unsigned long n) {
  if (n == 0) return;
  unsigned long k = last_error.size() < n - 1 ? last_error.size() : n - 1;
  std::memcpy(buf, last_error.data(), k);
  buf[k] = 0;
}

// Blocks of the calling thread's last launch (of mk_decode_staged) that
// staged their keys / values.
void mk_emu_staged(unsigned long long* keys, unsigned long long* values) {
  *keys = emu::last_staged_keys;
  *values = emu::last_staged_values;
}

// fp16 conversions of the kernels, for tests against `half`.
unsigned short mk_emu_f2h(float f) { return mk_f2h(f); }
float mk_emu_h2f(unsigned short h) { return mk_h2f(h); }
}
