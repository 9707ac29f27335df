//! The CUDA driver as a [`Device`], through cudarc (loaded at run time: no
//! CUDA at build time). The kernels are loaded as a CUBIN for the device's
//! exact architecture, prebuilt or compiled by NVRTC at first use
//! ([`crate::nvrtc`]), once per device for the process.
//!
//! Copies are asynchronous on the device's one stream (the legacy default
//! stream, where every launch goes): uploads of up to 8 MB through pinned
//! host buffers (`src/pinned.rs`), device-to-device copies in stream
//! order, and a download waits once for everything queued before it. So a
//! decode step's host thread waits once per layer, for its result.
//! `MINIKV_CUDA_PINNED=0` makes every copy synchronous from pageable
//! memory (the path measured on the H200 before; to compare the two).
//!
//! With `MINIKV_CUDA_CHECK=1` every launch and copy is followed by a
//! synchronization and an error check, so that a faulting kernel is named
//! at its launch rather than at a later, unrelated copy
//! (`scripts/gpu-check.sh` sets it).

use crate::device::{Arg, DevPtr, Device, Launch, err};
use crate::pinned::{ASYNC_UPLOAD_MAX, Pinned};
use cudarc::driver::result as cu;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use minikv_core::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

fn drv(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| err(format!("{what}: {e:?}"))
}

/// True when the CUDA driver library can be loaded (cudarc panics on use
/// otherwise, so everything checks this first).
pub fn driver_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The CUDA driver's version as `major.minor` (e.g. `12.8`), if the
/// driver library loads.
pub fn driver_version() -> Option<String> {
    if !driver_available() {
        return None;
    }
    let mut v: std::ffi::c_int = 0;
    // SAFETY: writes one int; needs no initialized context.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS)
        .then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// One GPU with minikv's kernels loaded.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    driver: String,
    image: String,
    check: bool,
    functions: HashMap<&'static str, CudaFunction>,
    /// Pinned buffers for asynchronous copies (`None`: synchronous copies,
    /// `MINIKV_CUDA_PINNED=0`).
    pinned: Option<Mutex<Pinned>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal`, compiling and loading the kernels the first
    /// time in this process (later calls return the same device).
    pub fn open(ordinal: usize) -> Result<Arc<CudaDevice>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
        if !driver_available() {
            return Err(err(
                "no CUDA driver (libcuda.so) on this machine; use backend = \"tiled\" (CPU)",
            ));
        }
        let map = DEVICES.get_or_init(Mutex::default);
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let count = CudaContext::device_count().map_err(drv("counting devices"))?;
        if ordinal >= count.max(0) as usize {
            return Err(err(format!(
                "device {ordinal} asked, {count} CUDA device(s) present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("creating the context"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("reading the compute capability"))?;
        let arch = format!("sm_{major}{minor}");
        let driver = driver_version().unwrap_or_else(|| "unknown".into());
        let dirs = crate::nvrtc::cubin_dirs();
        let (image, cubin) = match crate::nvrtc::find_cubin(&arch, &dirs) {
            Some((path, b)) => (format!("prebuilt CUBIN {}", path.display()), b),
            None => {
                let b = crate::nvrtc::compile_cubin(&arch).map_err(|e| {
                    err(format!(
                        "no prebuilt CUBIN {} in {dirs:?} and NVRTC could not make one                          (device {arch}, driver {driver}): {e}",
                        crate::nvrtc::cubin_name(&arch)
                    ))
                })?;
                ("CUBIN compiled by NVRTC at load".to_string(), b)
            }
        };
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| {
                err(format!(
                    "loading the kernels ({image}) on {arch} with driver {driver}: {e:?}"
                ))
            })?;
        let mut functions = HashMap::new();
        for k in crate::nvrtc::KERNELS {
            functions.insert(k, module.load_function(k).map_err(drv(k))?);
        }
        let check = std::env::var("MINIKV_CUDA_CHECK").is_ok_and(|v| v != "0" && !v.is_empty());
        let pinned = match std::env::var("MINIKV_CUDA_PINNED")
            .as_deref()
            .map(str::trim)
        {
            Err(_) | Ok("" | "1") => Some(Mutex::new(Pinned::new())),
            Ok("0") => None,
            Ok(v) => {
                return Err(err(format!(
                    "MINIKV_CUDA_PINNED={v:?}: expected 1 (asynchronous copies through pinned memory, the default) or 0 (synchronous copies)"
                )));
            }
        };
        let dev = Arc::new(CudaDevice {
            stream: ctx.default_stream(),
            ctx,
            arch,
            driver,
            image,
            check,
            functions,
            pinned,
        });
        map.insert(ordinal, dev.clone());
        Ok(dev)
    }
    /// What was loaded where, for reports: ordinal, architecture, driver,
    /// the kernel image, the memory bandwidth bound (from the memory clock
    /// and bus width), the check mode, and each kernel's registers and
    /// local (spilled) bytes as the driver reports them.
    pub fn info(&self) -> serde_json::Value {
        use cudarc::driver::sys::CUdevice_attribute as A;
        use cudarc::driver::sys::CUfunction_attribute_enum as F;
        let attr = |a| self.ctx.attribute(a).ok();
        // DDR: two transfers per clock; the clock is in kHz, the bus in bits.
        let bw = match (
            attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
            attr(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
        ) {
            (Some(khz), Some(bits)) => Some(2.0 * khz as f64 * 1e3 * bits as f64 / 8.0 / 1e9),
            _ => None,
        };
        let kernels: serde_json::Map<String, serde_json::Value> = self
            .functions
            .iter()
            .map(|(k, f)| {
                (
                    k.to_string(),
                    serde_json::json!({
                        "registers": f.get_attribute(F::CU_FUNC_ATTRIBUTE_NUM_REGS).ok(),
                        "local_bytes": f.get_attribute(F::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES).ok(),
                    }),
                )
            })
            .collect();
        serde_json::json!({
            "ordinal": self.ctx.ordinal(),
            "arch": self.arch,
            "driver": self.driver,
            "image": self.image,
            "sms": attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            "peak_bandwidth_gb_s": bw,
            "check_every_launch": self.check,
            "copies": if self.pinned.is_some() {
                "asynchronous, pinned host buffers"
            } else {
                "synchronous, pageable host memory (MINIKV_CUDA_PINNED=0)"
            },
            "kernels": kernels,
        })
    }
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(drv("binding the context"))
    }
    fn pinned(&self) -> Option<std::sync::MutexGuard<'_, Pinned>> {
        self.pinned
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
    }
    /// In the check mode, waits for the stream and names `what` in the
    /// error of anything that failed.
    fn checked(&self, what: &str) -> Result<()> {
        if self.check {
            self.stream
                .synchronize()
                .map_err(|e| err(format!("{what} failed on {}: {e:?}", self.name())))?;
        }
        Ok(())
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        format!(
            "cuda:{} ({}, driver {})",
            self.ctx.ordinal(),
            self.arch,
            self.driver
        )
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        self.bind()?;
        // SAFETY: a fresh allocation, zeroed before use; freed by `free`.
        unsafe {
            let p = cu::malloc_sync(bytes.max(1)).map_err(drv("cuMemAlloc"))?;
            cu::memset_d8_sync(p, 0, bytes.max(1)).map_err(drv("cuMemset"))?;
            Ok(p)
        }
    }
    fn free(&self, ptr: DevPtr) {
        if self.bind().is_ok() {
            // Queued copies and launches may still use the memory.
            if self.pinned.is_some() {
                let _ = self.stream.synchronize();
            }
            // SAFETY: `ptr` came from `alloc` and is freed once (DevBuf's drop).
            let _ = unsafe { cu::free_sync(ptr) };
        }
    }
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.bind()?;
        match self.pinned() {
            Some(mut p) if src.len() <= ASYNC_UPLOAD_MAX => {
                // SAFETY: DevBuf checked that the range lies in the
                // allocation, which `free` keeps until the stream passes.
                unsafe { p.upload(dst, src, self.stream.cu_stream()) }
                    .map_err(drv("cuMemcpyHtoDAsync"))?;
            }
            // SAFETY: as above.
            _ => unsafe { cu::memcpy_htod_sync(dst, src) }.map_err(drv("cuMemcpyHtoD"))?,
        }
        self.checked("an upload")
    }
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        match self.pinned() {
            // SAFETY: DevBuf checked the range; the copy is queued after
            // everything before it on the stream and waited for.
            Some(mut p) => unsafe { p.download(src, dst, self.stream.cu_stream()) }
                .map_err(drv("cuMemcpyDtoHAsync")),
            // SAFETY: as above; the synchronous copy waits for earlier
            // launches on the legacy default stream, where every launch goes.
            None => unsafe { cu::memcpy_dtoh_sync(dst, src) }.map_err(drv("cuMemcpyDtoH")),
        }
    }
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        self.bind()?;
        if self.pinned.is_some() {
            // SAFETY: both ranges checked by DevBuf, not overlapping; in
            // stream order with the launches and uploads around it.
            unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
                .map_err(drv("cuMemcpyDtoDAsync"))?;
        } else {
            // SAFETY: as above.
            unsafe { cu::memcpy_dtod_sync(dst, src, bytes) }.map_err(drv("cuMemcpyDtoD"))?;
        }
        self.checked("a device copy")
    }
    fn launch(&self, kernel: &'static str, shape: Launch, args: &[Arg]) -> Result<()> {
        self.bind()?;
        let f = self
            .functions
            .get(kernel)
            .ok_or_else(|| err(format!("unknown kernel {kernel}")))?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::I32(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: shape.grid,
            block_dim: shape.block,
            shared_mem_bytes: 0,
        };
        // SAFETY: the backend passes each kernel its parameter list (types and
        // order of minikv.cu's signatures) with buffers of the sizes it indexes.
        unsafe { b.launch(cfg) }.map_err(|e| {
            err(format!(
                "launching {kernel} (grid {:?}, block {:?}) on {}: {e:?}",
                shape.grid,
                shape.block,
                self.name()
            ))
        })?;
        if self.check {
            self.stream.synchronize().map_err(|e| {
                err(format!(
                    "{kernel} (grid {:?}, block {:?}) failed on {}: {e:?}",
                    shape.grid,
                    shape.block,
                    self.name()
                ))
            })?;
        }
        Ok(())
    }
}
