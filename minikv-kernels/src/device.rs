//! The few device operations the CUDA backend needs (allocate, copy, launch a
//! kernel by name), behind one object-safe trait with two implementations:
//! the CUDA driver through cudarc ([`crate::cuda::CudaDevice`]) and, with the
//! `emulate` feature, the CPU emulation of the same kernels
//! ([`crate::emulated::EmuDevice`]). The backend's host code (stores,
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
/// Copies are synchronous with respect to earlier launches (a download sees
/// what every earlier kernel wrote).
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
