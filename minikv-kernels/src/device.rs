//! The few device operations the CUDA backend needs (allocate, copy, launch a
//! kernel by name), behind one object-safe trait with two implementations:
//! the CUDA driver through cudarc ([`crate::cuda::CudaDevice`]) and, with the
//! `emulate` feature, the CPU emulation of the same kernels
//! (`crate::emulated::EmuDevice`). The backend's host code (stores,
//! layouts, launch geometry, argument lists) is therefore one code path,
//! exercised here without a GPU.

use minikv_core::{Error, Result};
use std::fmt::Debug;
use std::sync::Arc;

/// The backend's error with `reason`.
pub(crate) fn err(reason: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cuda".into(),
        reason: reason.into(),
    }
}

/// A size or index as the kernels' `int`.
pub(crate) fn int(x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| err(format!("{x} does not fit the kernels' int")))
}

/// A device address (`CUdeviceptr` on a GPU, a host address when emulated).
pub type DevPtr = u64;

/// One kernel argument, passed by value as the kernel's parameter list
/// declares it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A pointer (`T*`); `0` is the null pointer.
    Ptr(DevPtr),
    /// An `int`.
    I32(i32),
    /// A `float`.
    F32(f32),
}

/// A launch grid and block shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// Blocks (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
}

/// A device that holds memory and runs minikv's kernels.
///
/// Operations take effect in the order they are called: a launch sees every
/// earlier upload and copy, a download what every earlier kernel wrote
/// (an upload may return before its bytes have landed: the caller's slice
/// is copied first, so it may be reused at once).
pub trait Device: Send + Sync + Debug {
    /// A short name for reports (`cuda:0 (sm_90)`, `emulated`).
    fn name(&self) -> String;
    /// Allocates `bytes` zeroed bytes (at least 1).
    fn alloc(&self, bytes: usize) -> Result<DevPtr>;
    /// Frees an allocation made by [`alloc`](Device::alloc).
    fn free(&self, ptr: DevPtr);
    /// Host to device.
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()>;
    /// Device to host.
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<()>;
    /// Device to device (the ranges must not overlap).
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()>;
    /// Launches `kernel` (one of [`crate::nvrtc::KERNELS`]).
    fn launch(&self, kernel: &'static str, shape: Launch, args: &[Arg]) -> Result<()>;
}

/// An owned device allocation, freed on drop.
#[derive(Debug)]
pub struct DevBuf {
    dev: Arc<dyn Device>,
    ptr: DevPtr,
    bytes: usize,
}

impl DevBuf {
    /// Allocates `bytes` zeroed bytes.
    pub fn zeroed(dev: &Arc<dyn Device>, bytes: usize) -> Result<Self> {
        let ptr = dev.alloc(bytes.max(1))?;
        Ok(Self {
            dev: dev.clone(),
            ptr,
            bytes,
        })
    }
    /// A copy of `data` on the device.
    pub fn from_slice<T: bytemuck::Pod>(dev: &Arc<dyn Device>, data: &[T]) -> Result<Self> {
        let b = Self::zeroed(dev, std::mem::size_of_val(data))?;
        b.write(0, data)?;
        Ok(b)
    }
    /// The device address.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
    /// The address `offset` bytes in.
    pub fn at(&self, offset: usize) -> DevPtr {
        debug_assert!(offset <= self.bytes);
        self.ptr + offset as u64
    }
    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.bytes
    }
    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
    fn check(&self, offset: usize, n: usize, what: &str) -> Result<()> {
        if offset + n > self.bytes {
            return Err(err(format!(
                "{what} of {n} bytes at offset {offset} past a {}-byte device buffer",
                self.bytes
            )));
        }
        Ok(())
    }
    /// Writes `data` at byte `offset`.
    pub fn write<T: bytemuck::Pod>(&self, offset: usize, data: &[T]) -> Result<()> {
        let b: &[u8] = bytemuck::cast_slice(data);
        self.check(offset, b.len(), "write")?;
        if b.is_empty() {
            return Ok(());
        }
        self.dev.upload(self.at(offset), b)
    }
    /// Reads `out.len()` elements from byte `offset`.
    pub fn read<T: bytemuck::Pod>(&self, offset: usize, out: &mut [T]) -> Result<()> {
        let b: &mut [u8] = bytemuck::cast_slice_mut(out);
        self.check(offset, b.len(), "read")?;
        if b.is_empty() {
            return Ok(());
        }
        self.dev.download(self.at(offset), b)
    }
    /// Reads `n` elements from byte `offset` into a new vector.
    pub fn to_vec<T: bytemuck::Pod>(&self, offset: usize, n: usize) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); n];
        self.read(offset, &mut v)?;
        Ok(v)
    }
    /// Copies `bytes` bytes from `src` (at `src_off`) to this buffer (at `off`).
    pub fn copy_from(&self, off: usize, src: &DevBuf, src_off: usize, bytes: usize) -> Result<()> {
        self.check(off, bytes, "copy")?;
        src.check(src_off, bytes, "copy")?;
        if bytes == 0 {
            return Ok(());
        }
        self.dev.copy(self.at(off), src.at(src_off), bytes)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        self.dev.free(self.ptr);
    }
}

/// Grow-only device buffers reused across calls, one per slot (working
/// memory of the backend and of its stores' uploads, not cache memory).
#[derive(Debug, Default)]
pub(crate) struct Scratch(Vec<Option<DevBuf>>);

impl Scratch {
    /// Slot `slot`, at least `bytes` long.
    pub(crate) fn get(
        &mut self,
        dev: &Arc<dyn Device>,
        slot: usize,
        bytes: usize,
    ) -> Result<&DevBuf> {
        if self.0.len() <= slot {
            self.0.resize_with(slot + 1, || None);
        }
        let b = &mut self.0[slot];
        if b.as_ref().is_none_or(|b| b.len() < bytes) {
            *b = None;
            *b = Some(DevBuf::zeroed(dev, bytes.max(4).next_power_of_two())?);
        }
        Ok(b.as_ref().expect("allocated"))
    }
    /// Uploads `data` into `slot` and returns its address.
    pub(crate) fn put<T: bytemuck::Pod>(
        &mut self,
        dev: &Arc<dyn Device>,
        slot: usize,
        data: &[T],
    ) -> Result<DevPtr> {
        let b = self.get(dev, slot, std::mem::size_of_val(data))?;
        b.write(0, data)?;
        Ok(b.ptr())
    }
}

/// Host-device calls that reached a device, by kind (what a
/// [`Batched`] device passed on; for reports and tests).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Calls {
    /// Host-to-device copies.
    pub uploads: u64,
    /// Bytes those copies carried (a batch's table included).
    pub upload_bytes: u64,
    /// Device-to-host copies.
    pub downloads: u64,
    /// Device-to-device copies.
    pub copies: u64,
    /// Allocations.
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// Kernel launches (asynchronous on a GPU).
    pub launches: u64,
}

impl Calls {
    /// The calls a host thread waits for on a GPU with synchronous copies
    /// (`MINIKV_CUDA_PINNED=0`): every copy, allocation and free (launches
    /// are asynchronous). With pinned copies, uploads and device copies are
    /// queued too, and a step waits at its download.
    pub fn synchronous(&self) -> u64 {
        self.uploads + self.downloads + self.copies + self.allocs + self.frees
    }
    /// The calls made since `earlier`.
    pub fn since(&self, earlier: &Calls) -> Calls {
        Calls {
            uploads: self.uploads - earlier.uploads,
            upload_bytes: self.upload_bytes - earlier.upload_bytes,
            downloads: self.downloads - earlier.downloads,
            copies: self.copies - earlier.copies,
            allocs: self.allocs - earlier.allocs,
            frees: self.frees - earlier.frees,
            launches: self.launches - earlier.launches,
        }
    }
}

/// An upload of at most this many bytes is queued (larger ones go at once).
const QUEUE_ENTRY_MAX: usize = 256 << 10;
/// The queue is flushed when its payload would pass this many bytes.
const QUEUE_BYTES_MAX: usize = 4 << 20;
/// The queue is flushed at this many entries.
const QUEUE_ENTRIES_MAX: usize = 4096;

/// `MkCopy` of minikv.cu: one queued copy (`src` a device address).
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct MkCopy {
    dst: u64,
    src: u64,
    bytes: u64,
}

/// A queued upload (from the payload at offset `src`) or device copy
/// (from device address `src`).
#[derive(Debug, Clone, Copy)]
struct Pending {
    dst: u64,
    src: u64,
    bytes: u64,
    upload: bool,
}

impl Pending {
    fn writes(&self, p: u64, n: u64) -> bool {
        p < self.dst + self.bytes && self.dst < p + n
    }
    fn reads(&self, p: u64, n: u64) -> bool {
        !self.upload && p < self.src + self.bytes && self.src < p + n
    }
}

#[derive(Debug, Default)]
struct Queue {
    /// Payload, each entry at a 16-byte aligned offset.
    data: Vec<u8>,
    entries: Vec<Pending>,
    /// Device buffer the table and payload are uploaded to (grow-only).
    staging: Option<(DevPtr, usize)>,
    calls: Calls,
    /// An error met while flushing from `free` (which cannot return one),
    /// returned by the next call.
    failed: Option<Error>,
}

/// A [`Device`] that queues small uploads and device-to-device copies and
/// sends them as one copy and one `mk_scatter` launch when anything else
/// needs the device (a launch, a download, a free), so that a decode step's
/// many row appends, row moves, head table and query make one
/// host-to-device copy. Every other
/// operation passes through after the queue is flushed, in order, so what a
/// kernel or a download sees is exactly what was uploaded before it. It
/// counts the calls that reach the inner device ([`Batched::calls`]).
#[derive(Debug)]
pub struct Batched {
    inner: Arc<dyn Device>,
    q: std::sync::Mutex<Queue>,
}

impl Batched {
    /// Queues uploads in front of `inner`.
    pub fn new(inner: Arc<dyn Device>) -> Self {
        Self {
            inner,
            q: std::sync::Mutex::default(),
        }
    }
    /// The calls passed to the inner device so far.
    pub fn calls(&self) -> Calls {
        self.lock().calls
    }
    /// The device behind the queue.
    pub fn inner(&self) -> &Arc<dyn Device> {
        &self.inner
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Sends every queued upload (one copy, or one copy and one launch).
    pub fn flush(&self) -> Result<()> {
        let mut q = self.lock();
        self.flush_locked(&mut q)
    }
    fn flush_locked(&self, q: &mut Queue) -> Result<()> {
        if let Some(e) = q.failed.take() {
            q.entries.clear();
            q.data.clear();
            return Err(e);
        }
        let r = self.send(q);
        q.entries.clear();
        q.data.clear();
        r
    }
    fn send(&self, q: &mut Queue) -> Result<()> {
        match q.entries.len() {
            0 => Ok(()),
            1 if q.entries[0].upload => {
                let e = q.entries[0];
                q.calls.uploads += 1;
                q.calls.upload_bytes += e.bytes;
                let (s, n) = (e.src as usize, e.bytes as usize);
                self.inner.upload(e.dst, &q.data[s..s + n])
            }
            1 => {
                let e = q.entries[0];
                q.calls.copies += 1;
                self.inner.copy(e.dst, e.src, e.bytes as usize)
            }
            n => {
                let table = (n * std::mem::size_of::<MkCopy>()).next_multiple_of(16);
                let total = table + q.data.len();
                if q.staging.is_none_or(|(_, cap)| cap < total) {
                    if let Some((p, _)) = q.staging.take() {
                        q.calls.frees += 1;
                        self.inner.free(p);
                    }
                    let cap = total.next_power_of_two().max(4096);
                    q.calls.allocs += 1;
                    q.staging = Some((self.inner.alloc(cap)?, cap));
                }
                let (dev, _) = q.staging.expect("allocated");
                let base = dev + table as u64;
                let copies: Vec<MkCopy> = q
                    .entries
                    .iter()
                    .map(|e| MkCopy {
                        dst: e.dst,
                        src: if e.upload { base + e.src } else { e.src },
                        bytes: e.bytes,
                    })
                    .collect();
                let mut buf = Vec::with_capacity(total);
                buf.extend_from_slice(bytemuck::cast_slice(&copies));
                buf.resize(table, 0);
                buf.extend_from_slice(&q.data);
                q.calls.uploads += 1;
                q.calls.upload_bytes += buf.len() as u64;
                self.inner.upload(dev, &buf)?;
                q.calls.launches += 1;
                self.inner.launch(
                    "mk_scatter",
                    Launch {
                        grid: (int(n)? as u32, 1, 1),
                        block: (128, 1, 1),
                    },
                    &[Arg::Ptr(dev)],
                )
            }
        }
    }
}

impl Drop for Batched {
    fn drop(&mut self) {
        let mut q = std::mem::take(self.q.get_mut().unwrap_or_else(|p| p.into_inner()));
        let _ = self.send(&mut q);
        if let Some((p, _)) = q.staging {
            self.inner.free(p);
        }
    }
}

impl Device for Batched {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        // A fresh allocation has no queued writes: nothing to flush.
        self.lock().calls.allocs += 1;
        self.inner.alloc(bytes)
    }
    fn free(&self, ptr: DevPtr) {
        let mut q = self.lock();
        if let Err(e) = self.flush_locked(&mut q) {
            q.failed.get_or_insert(e);
        }
        q.calls.frees += 1;
        self.inner.free(ptr);
    }
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        let mut q = self.lock();
        let n = src.len() as u64;
        // Queued entries run in parallel: one that writes or reads these
        // bytes must land first.
        let overlaps = q
            .entries
            .iter()
            .any(|e| e.writes(dst, n) || e.reads(dst, n));
        if src.len() > QUEUE_ENTRY_MAX
            || overlaps
            || q.data.len() + src.len() > QUEUE_BYTES_MAX
            || q.entries.len() >= QUEUE_ENTRIES_MAX
        {
            self.flush_locked(&mut q)?;
        }
        if src.len() > QUEUE_ENTRY_MAX {
            q.calls.uploads += 1;
            q.calls.upload_bytes += src.len() as u64;
            return self.inner.upload(dst, src);
        }
        if let Some(e) = q.failed.take() {
            return Err(e);
        }
        let at = q.data.len().next_multiple_of(16);
        q.data.resize(at, 0);
        q.data.extend_from_slice(src);
        q.entries.push(Pending {
            dst,
            src: at as u64,
            bytes: n,
            upload: true,
        });
        Ok(())
    }
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<()> {
        let mut q = self.lock();
        self.flush_locked(&mut q)?;
        q.calls.downloads += 1;
        self.inner.download(src, dst)
    }
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        let mut q = self.lock();
        let n = bytes as u64;
        // A small copy is queued like an upload (a row moved by an
        // eviction), unless it reads what a queued entry writes or writes
        // what one reads or writes.
        let overlaps = q
            .entries
            .iter()
            .any(|e| e.writes(src, n) || e.writes(dst, n) || e.reads(dst, n));
        if bytes > QUEUE_ENTRY_MAX || overlaps || q.entries.len() >= QUEUE_ENTRIES_MAX {
            self.flush_locked(&mut q)?;
        }
        if bytes > QUEUE_ENTRY_MAX || bytes == 0 {
            q.calls.copies += 1;
            return self.inner.copy(dst, src, bytes);
        }
        if let Some(e) = q.failed.take() {
            return Err(e);
        }
        if src < dst + n && dst < src + n {
            return Err(err("overlapping device-to-device copy"));
        }
        q.entries.push(Pending {
            dst,
            src,
            bytes: n,
            upload: false,
        });
        Ok(())
    }
    fn launch(&self, kernel: &'static str, shape: Launch, args: &[Arg]) -> Result<()> {
        let mut q = self.lock();
        self.flush_locked(&mut q)?;
        q.calls.launches += 1;
        self.inner.launch(kernel, shape, args)
    }
}
