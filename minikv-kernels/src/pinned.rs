//! Page-locked (pinned) host buffers through which the CUDA device copies
//! asynchronously on its stream, so that a decode step's host thread does
//! not wait for its upload: the upload, the launches and the download are
//! queued in order and the host waits once, for the result.
//!
//! Uploads go through a ring of [`RING`] buffers, each with an event
//! recorded after its copy: a buffer is refilled only once the copy that
//! last read it has finished (usually long since). Downloads land in one
//! pinned buffer and are copied out after the stream has synchronized. Only
//! [`crate::cuda::CudaDevice`] uses this (a GPU is needed to run it:
//! `scripts/gpu-check.sh` checks and times it; `MINIKV_CUDA_PINNED=0` goes
//! back to synchronous copies from pageable memory).

use cudarc::driver::{DriverError, result as cu, sys};

/// Uploads of at most this many bytes go through the pinned ring (a
/// decode step's batched upload is at most a few megabytes); larger ones
/// (prefill rows) are synchronous copies.
pub(crate) const ASYNC_UPLOAD_MAX: usize = 8 << 20;

/// Buffers in the upload ring.
const RING: usize = 4;

/// A grow-only page-locked host buffer.
struct HostBuf {
    ptr: *mut u8,
    cap: usize,
}

impl HostBuf {
    const fn empty() -> Self {
        Self {
            ptr: std::ptr::null_mut(),
            cap: 0,
        }
    }
    /// Its first `n` bytes, grown (freed and allocated again) when short.
    ///
    /// # Safety
    /// No copy that reads or writes the buffer may be in flight.
    unsafe fn bytes(&mut self, n: usize) -> Result<&mut [u8], DriverError> {
        if self.cap < n {
            // SAFETY (both): `ptr` came from `malloc_host`; nothing uses it.
            unsafe { self.free()? };
            let cap = n.next_power_of_two().max(64 << 10);
            self.ptr = unsafe { cu::malloc_host(cap, 0)? }.cast();
            self.cap = cap;
        }
        // SAFETY: `n <= cap` bytes of a live allocation, borrowed mutably.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, n) })
    }
    unsafe fn free(&mut self) -> Result<(), DriverError> {
        if !self.ptr.is_null() {
            // SAFETY: allocated by `malloc_host`, freed once.
            unsafe { cu::free_host(self.ptr.cast())? };
            self.ptr = std::ptr::null_mut();
            self.cap = 0;
        }
        Ok(())
    }
}

/// The pinned buffers of one device (used under its mutex, with its context
/// bound to the calling thread).
pub(crate) struct Pinned {
    ring: [(HostBuf, sys::CUevent); RING],
    next: usize,
    down: HostBuf,
}

// SAFETY: the raw pointers are host allocations and driver handles owned by
// this value alone; the device uses it under a mutex.
unsafe impl Send for Pinned {}

impl Pinned {
    pub(crate) fn new() -> Self {
        Self {
            ring: std::array::from_fn(|_| (HostBuf::empty(), std::ptr::null_mut())),
            next: 0,
            down: HostBuf::empty(),
        }
    }

    /// Copies `src` into the next ring buffer and queues its upload to
    /// `dst` on `stream` (returns before the copy runs).
    ///
    /// # Safety
    /// `dst` holds `src.len()` bytes of device memory that stay allocated
    /// until the stream has passed the copy; the device's context is bound.
    pub(crate) unsafe fn upload(
        &mut self,
        dst: sys::CUdeviceptr,
        src: &[u8],
        stream: sys::CUstream,
    ) -> Result<(), DriverError> {
        let (buf, ev) = &mut self.ring[self.next];
        self.next = (self.next + 1) % RING;
        if ev.is_null() {
            *ev = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        } else {
            // SAFETY: a live event; waits for the copy that last read `buf`.
            unsafe { cu::event::synchronize(*ev)? };
        }
        // SAFETY: the buffer's last copy has finished (above).
        let staged = unsafe { buf.bytes(src.len())? };
        staged.copy_from_slice(src);
        // SAFETY: pinned source, left untouched until the event below has
        // completed; `dst` as the caller promises.
        unsafe {
            cu::memcpy_htod_async(dst, staged, stream)?;
            cu::event::record(*ev, stream)
        }
    }

    /// Queues the download of `dst.len()` bytes from `src` on `stream`
    /// (after everything queued before it), waits for the stream, and
    /// copies the bytes out.
    ///
    /// # Safety
    /// `src` holds `dst.len()` bytes of device memory; the context is bound.
    pub(crate) unsafe fn download(
        &mut self,
        src: sys::CUdeviceptr,
        dst: &mut [u8],
        stream: sys::CUstream,
    ) -> Result<(), DriverError> {
        // SAFETY: every download waits for the stream before returning, so
        // no copy into `down` is in flight.
        let staged = unsafe { self.down.bytes(dst.len())? };
        // SAFETY: as the caller promises; the stream is waited for before
        // the bytes are read.
        unsafe {
            cu::memcpy_dtoh_async(&mut *staged, src, stream)?;
            cu::stream::synchronize(stream)?;
        }
        dst.copy_from_slice(staged);
        Ok(())
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        for (buf, ev) in &mut self.ring {
            if !ev.is_null() {
                // SAFETY: a live event, destroyed once after its copy ended.
                unsafe {
                    let _ = cu::event::synchronize(*ev);
                    let _ = cu::event::destroy(*ev);
                }
            }
            // SAFETY: its copy has finished (above).
            let _ = unsafe { buf.free() };
        }
        // SAFETY: downloads finish before they return.
        let _ = unsafe { self.down.free() };
    }
}
