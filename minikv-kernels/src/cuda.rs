//! The CUDA driver as a [`Device`], through cudarc (loaded at run time: no
//! CUDA at build time). The kernels are compiled with NVRTC for the device's
//! architecture at first use and cached per device for the process.

use crate::device::{Arg, DevPtr, Device, Launch, err};
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

/// One GPU with minikv's kernels loaded.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    functions: HashMap<&'static str, CudaFunction>,
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
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let ptx = crate::nvrtc::compile_ptx(arch)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(drv("loading the PTX"))?;
        let mut functions = HashMap::new();
        for k in crate::nvrtc::KERNELS {
            functions.insert(k, module.load_function(k).map_err(drv(k))?);
        }
        let dev = Arc::new(CudaDevice {
            stream: ctx.default_stream(),
            ctx,
            arch: arch.to_string(),
            functions,
        });
        map.insert(ordinal, dev.clone());
        Ok(dev)
    }
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(drv("binding the context"))
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        format!("cuda:{} ({})", self.ctx.ordinal(), self.arch)
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
            // SAFETY: `ptr` came from `alloc` and is freed once (DevBuf's drop).
            let _ = unsafe { cu::free_sync(ptr) };
        }
    }
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: DevBuf checked that the range lies in the allocation.
        unsafe { cu::memcpy_htod_sync(dst, src) }.map_err(drv("cuMemcpyHtoD"))
    }
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: as above; the synchronous copy waits for earlier launches on
        // the legacy default stream, where every launch goes.
        unsafe { cu::memcpy_dtoh_sync(dst, src) }.map_err(drv("cuMemcpyDtoH"))
    }
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: both ranges checked by DevBuf, not overlapping.
        unsafe { cu::memcpy_dtod_sync(dst, src, bytes) }.map_err(drv("cuMemcpyDtoD"))
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
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv(kernel))
    }
}
