//! The CUDA kernels of `cuda/minikv.cu` on the CPU under `cuda/emulate.h`
//! (feature `emulate`): [`EmuDevice`] is a [`Device`] whose memory is host
//! memory and whose launches run the same kernel source, with the same
//! geometry and argument lists, blocks one at a time with their threads as
//! fibers (in reverse order, [`EmuDevice::with_reversed_fibers`], with the
//! warps in turn, [`EmuDevice::with_warps_in_turn`], or as OS threads,
//! [`EmuDevice::with_os_threads`]). Slow, exact, and
//! meant for tests on small shapes; [`emulated_backend`] is the whole CUDA
//! backend on it.
//!
//! Every copy is checked against the live allocations, so a backend bug that
//! would read or write past a device buffer fails loudly here; and every
//! allocation ends where an inaccessible guard page begins, so a kernel that
//! reads or writes past the end of a buffer faults (the test process dies
//! with SIGSEGV) instead of touching a neighbour's bytes
//! (`MINIKV_EMU_GUARD=before`: every allocation starts where a guard page
//! ends, for accesses before a buffer's start).

use crate::backend::CudaBackend;
use crate::device::{Arg, DevPtr, Device, Launch};
use minikv_core::{AttentionBackend, Error, Result};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex};

unsafe extern "C" {
    fn mk_emu_launch(
        name: *const c_char,
        gx: u32,
        gy: u32,
        gz: u32,
        bx: u32,
        by: u32,
        bz: u32,
        params: *mut *mut c_void,
        n_params: c_int,
        how: c_int,
    ) -> c_int;
    fn mk_emu_f2h(f: f32) -> u16;
    fn mk_emu_staged(keys: *mut u64, values: *mut u64);
    fn mk_emu_h2f(h: u16) -> f32;
    fn mk_emu_last_error(buf: *mut c_char, n: std::os::raw::c_ulong);
    fn mk_emu_alloc(bytes: std::os::raw::c_ulong, before: c_int) -> *mut c_void;
    fn mk_emu_free(p: *mut c_void, bytes: std::os::raw::c_ulong);
}

fn err(reason: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cuda (emulated)".into(),
        reason: reason.into(),
    }
}

/// The unit of emulated allocations: 16 bytes, so that every allocation is
/// aligned as the kernels' 16-byte loads need (`cuMemAlloc` aligns to 256).
const WORD: usize = 16;

/// Whether allocations start after their guard page (`MINIKV_EMU_GUARD=before`)
/// rather than end before one (unset, empty or `after`); read once.
fn guard_before() -> Result<bool> {
    static GUARD: std::sync::OnceLock<std::result::Result<bool, String>> =
        std::sync::OnceLock::new();
    GUARD
        .get_or_init(|| match std::env::var("MINIKV_EMU_GUARD").as_deref() {
            Err(_) | Ok("" | "after") => Ok(false),
            Ok("before") => Ok(true),
            Ok(v) => Err(format!(
                "MINIKV_EMU_GUARD={v:?}: expected after (guard pages after device buffers, the default) or before"
            )),
        })
        .clone()
        .map_err(err)
}

/// How a block's threads run (`launch_mode` of `cuda/emulate.h`).
#[derive(Debug, Default, Clone, Copy)]
enum Threads {
    /// Fibers, first to last between waits.
    #[default]
    Fibers = 0,
    /// OS threads.
    Os = 1,
    /// Fibers, last to first between waits.
    ReversedFibers = 2,
    /// Fibers, the warps in turn, each through a whole phase between two
    /// block barriers.
    WarpsInTurn = 3,
}

/// Host memory standing in for device memory; launches through the emulator.
#[derive(Debug, Default)]
pub struct EmuDevice {
    /// Live allocations: base address -> length in 16-byte words (from
    /// `mk_emu_alloc`, each followed by a guard page; freed by `free` or
    /// drop).
    mem: Mutex<BTreeMap<u64, usize>>,
    /// How a block's threads run.
    threads: Threads,
    /// Launches per kernel name.
    launched: Mutex<BTreeMap<&'static str, u64>>,
    /// Blocks of `mk_decode_staged` that staged keys, and values.
    staged: Mutex<(u64, u64)>,
}

impl Drop for EmuDevice {
    fn drop(&mut self) {
        let m = std::mem::take(self.mem.get_mut().unwrap_or_else(|p| p.into_inner()));
        for (p, n) in m {
            // SAFETY: each entry is a live allocation of `n` words.
            unsafe { mk_emu_free(p as *mut c_void, (n * WORD) as _) };
        }
    }
}

impl EmuDevice {
    /// A new emulated device; a block's threads run as fibers on the
    /// launching thread (fast, deterministic).
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    /// A new emulated device whose blocks' threads are OS threads (real
    /// concurrency; much slower).
    pub fn with_os_threads() -> Arc<Self> {
        Self::with_threads(Threads::Os)
    }
    /// A new emulated device whose blocks' threads run as fibers from the
    /// last to the first between waits (where the default runs them first
    /// to last): a thread that reads another's write without a barrier
    /// between them misses it in one of the two orders.
    pub fn with_reversed_fibers() -> Arc<Self> {
        Self::with_threads(Threads::ReversedFibers)
    }
    /// A new emulated device whose blocks run their warps in turn: a warp's
    /// threads (as fibers) go through a whole phase between two block
    /// barriers before the next warp starts it. A warp that refills shared
    /// memory without first waiting at a barrier for the other warps to
    /// finish reading it then spoils what they read (with the threads in
    /// lockstep, as the other orders run them, such a race goes unseen).
    pub fn with_warps_in_turn() -> Arc<Self> {
        Self::with_threads(Threads::WarpsInTurn)
    }
    fn with_threads(threads: Threads) -> Arc<Self> {
        // (Not `..Self::default()`: a type with `Drop` cannot be moved out of.)
        let mut d = Self::default();
        d.threads = threads;
        Arc::new(d)
    }
    /// How many times `kernel` was launched on this device (tests check
    /// which kernel a backend path takes).
    pub fn launches(&self, kernel: &str) -> u64 {
        let l = self.launched.lock().unwrap_or_else(|p| p.into_inner());
        l.get(kernel).copied().unwrap_or(0)
    }
    /// Blocks of `mk_decode_staged` launched on this device that staged
    /// their split's quantized keys, and that staged its quantized values
    /// (the rest read the stores in place: a part too large for the
    /// block's staging memory, or not 16-byte aligned).
    pub fn staged_blocks(&self) -> (u64, u64) {
        *self.staged.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Bytes currently allocated.
    pub fn allocated(&self) -> usize {
        let m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        m.values().map(|n| n * WORD).sum()
    }
    /// Checks that `[p, p + n)` lies inside one live allocation.
    fn check(&self, p: DevPtr, n: usize, what: &str) -> Result<()> {
        let m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        match m.range(..=p).next_back() {
            Some((&base, &words)) if p + n as u64 <= base + (words * WORD) as u64 => Ok(()),
            _ => Err(err(format!(
                "{what} of {n} bytes at {p:#x} is outside every device allocation"
            ))),
        }
    }
}

impl Device for EmuDevice {
    fn name(&self) -> String {
        "emulated".into()
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        let n = bytes.div_ceil(WORD).max(1);
        let before = c_int::from(guard_before()?);
        // SAFETY: allocates (zeroed) or returns null.
        let p = unsafe { mk_emu_alloc((n * WORD) as _, before) } as u64;
        if p == 0 {
            return Err(err(format!("out of host memory for {bytes} bytes")));
        }
        self.mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p, n);
        Ok(p)
    }
    fn free(&self, ptr: DevPtr) {
        let n = self
            .mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ptr);
        if let Some(n) = n {
            // SAFETY: `ptr` was a live allocation of `n` words, now unlisted.
            unsafe { mk_emu_free(ptr as *mut c_void, (n * WORD) as _) };
        }
    }
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.check(dst, src.len(), "upload")?;
        // SAFETY: the destination range lies in a live allocation (checked).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<()> {
        self.check(src, dst.len(), "download")?;
        // SAFETY: the source range lies in a live allocation (checked).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        self.check(dst, bytes, "copy")?;
        self.check(src, bytes, "copy")?;
        if dst < src + bytes as u64 && src < dst + bytes as u64 {
            return Err(err("overlapping device-to-device copy"));
        }
        // SAFETY: both ranges live and disjoint (checked).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn launch(&self, kernel: &'static str, shape: Launch, args: &[Arg]) -> Result<()> {
        // Each argument's value in its own 8-byte slot, pointed to as the
        // driver's kernelParams are.
        let mut vals: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) => p,
                Arg::I32(x) => x as u32 as u64,
                Arg::F32(x) => x.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        *self
            .launched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(kernel)
            .or_default() += 1;
        let name = CString::new(kernel).map_err(|_| err("kernel name"))?;
        let (g, b) = (shape.grid, shape.block);
        // SAFETY: the parameter array holds one pointer per argument to a
        // value of the kernel's parameter type (little-endian: an int or
        // float is the low 4 bytes of its slot); the pointers inside are
        // live allocations of this device, sized by the backend.
        let rc = unsafe {
            mk_emu_launch(
                name.as_ptr(),
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                params.as_mut_ptr(),
                params.len() as c_int,
                self.threads as c_int,
            )
        };
        if rc == 0 && kernel == "mk_decode_staged" {
            let (mut k, mut v) = (0, 0);
            // SAFETY: writes the two counts of this thread's last launch.
            unsafe { mk_emu_staged(&mut k, &mut v) };
            let mut st = self.staged.lock().unwrap_or_else(|p| p.into_inner());
            st.0 += k;
            st.1 += v;
        }
        match rc {
            0 => Ok(()),
            1 => Err(err(format!("unknown kernel {kernel}"))),
            2 => Err(err(format!(
                "{kernel}: {} arguments do not match its parameter list",
                args.len()
            ))),
            _ => {
                let mut buf = [0 as c_char; 256];
                // SAFETY: writes at most 255 bytes and a NUL into `buf`.
                unsafe { mk_emu_last_error(buf.as_mut_ptr(), buf.len() as _) };
                // SAFETY: NUL-terminated (above).
                let why = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
                Err(err(format!("{kernel}: the emulated launch failed: {why}")))
            }
        }
    }
}

/// The CUDA backend on an emulated device.
pub fn emulated_backend() -> Result<Arc<dyn AttentionBackend>> {
    Ok(Arc::new(
        CudaBackend::new(EmuDevice::new())
            .with_decode_kernel(crate::DecodeKernel::from_env()?)
            .with_prefill_path(crate::PrefillPath::from_env()?),
    ))
}

minikv_core::register_backend!(
    "cuda-emulated",
    "the CUDA backend (device stores, launches, kernels) on the CPU emulation of CUDA; exact and very slow, for checks without a GPU",
    emulated_backend
);

/// Keeps the `cuda-emulated` registration linked (see
/// [`crate::ensure_registered`]).
#[inline(never)]
pub fn ensure_registered() {
    std::hint::black_box(emulated_backend as fn() -> Result<Arc<dyn AttentionBackend>>);
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
