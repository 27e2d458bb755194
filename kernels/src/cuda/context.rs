//! [`CudaContext`]: one GPU, its stream, the NVRTC-compiled kernel modules (PTX cached on disk) and a cuBLAS handle.
//! Everything else in [`crate::cuda`] launches through it.

use super::compile::{self, CacheStatus, KernelSource, MODULES, PtxCache};
use super::error::CudaError;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Facts about the device a context runs on.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// `sm_XY` the kernels were compiled for.
    pub arch: String,
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// Total device memory in bytes.
    pub total_mem: usize,
    /// NVRTC version the kernels were compiled with.
    pub nvrtc: (i32, i32),
}

/// One GPU with its default stream, all Pagoda kernels loaded, and a cuBLAS handle bound to the stream.
pub struct CudaContext {
    ctx: Arc<cudarc::driver::CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    info: DeviceInfo,
    cache: Vec<(&'static str, CacheStatus)>,
    ptx_cache: PtxCache,
    /// Modules loaded on first use ([`KernelSource::lazy`]), with their kernels or why they failed to load.
    lazy: Vec<(&'static KernelSource, OnceLock<Result<Kernels, String>>)>,
}

/// A loaded module's kernels by name.
type Kernels = HashMap<&'static str, CudaFunction>;

impl std::fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaContext").field("info", &self.info).field("cache", &self.cache).finish()
    }
}

/// True when the CUDA driver library loads and reports at least one device.
pub fn device_available() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    cudarc::driver::result::init().is_ok() && cudarc::driver::CudaContext::device_count().is_ok_and(|n| n > 0)
}

impl CudaContext {
    /// Opens device `ordinal`, compiles (or loads from [`PtxCache::default_dir`]) every kernel module for its
    /// architecture, and creates a cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<CudaContext, CudaError> {
        CudaContext::with_cache(ordinal, &PtxCache::new(PtxCache::default_dir()))
    }

    /// Like [`CudaContext::new`] with an explicit PTX cache.
    pub fn with_cache(ordinal: usize, cache: &PtxCache) -> Result<CudaContext, CudaError> {
        // SAFETY: only tries to dlopen libcuda; cudarc panics on first use when it is absent, so check first.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::DriverUnavailable);
        }
        if cudarc::driver::result::init().is_err() {
            return Err(CudaError::NoDevice(None));
        }
        let count = cudarc::driver::CudaContext::device_count().map_err(|_| CudaError::NoDevice(None))?;
        if count <= 0 {
            return Err(CudaError::NoDevice(None));
        }
        if ordinal >= count as usize {
            return Err(CudaError::NoDevice(Some(ordinal)));
        }
        if !compile::nvrtc_available() {
            return Err(CudaError::NvrtcUnavailable);
        }
        // SAFETY: as above, for libcublas.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::CublasUnavailable);
        }
        let ctx = cudarc::driver::CudaContext::new(ordinal)?;
        // One stream, so stream order already protects every buffer; per-buffer events would only cost time.
        // SAFETY: called before any buffer exists; all work of this context goes through the one stream below.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = ctx.compute_capability()?;
        let arch = compile::arch_for(major, minor);
        let sm_count =
            ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name()?,
            compute_capability: (major, minor),
            arch: arch.clone(),
            sm_count,
            total_mem: ctx.total_mem()?,
            nvrtc: compile::nvrtc_version()?,
        };
        let mut funcs = HashMap::new();
        let mut statuses = Vec::new();
        let mut lazy = Vec::new();
        for m in MODULES {
            if m.lazy {
                lazy.push((m, OnceLock::new()));
                continue;
            }
            let (module_funcs, status) = load_module(&ctx, cache, m, &arch)?;
            funcs.extend(module_funcs);
            statuses.push((m.name, status));
        }
        let blas = CudaBlas::new(stream.clone())?;
        Ok(CudaContext { ctx, stream, blas, funcs, info, cache: statuses, ptx_cache: cache.clone(), lazy })
    }

    /// The device this context runs on.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Whether each module loaded when the context opened had its PTX in the disk cache (lazy modules, loaded on
    /// first use, are not listed).
    pub fn cache_status(&self) -> &[(&'static str, CacheStatus)] {
        &self.cache
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The underlying cudarc context.
    pub fn driver(&self) -> &Arc<cudarc::driver::CudaContext> {
        &self.ctx
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    pub(crate) fn func(&self, name: &'static str) -> Result<&CudaFunction, CudaError> {
        if let Some(f) = self.funcs.get(name) {
            return Ok(f);
        }
        let not_loaded = || CudaError::Unsupported(format!("kernel {name} is not loaded"));
        let (m, loaded) = self.lazy.iter().find(|(m, _)| m.functions.contains(&name)).ok_or_else(not_loaded)?;
        let loaded = loaded.get_or_init(|| {
            load_module(&self.ctx, &self.ptx_cache, m, &self.info.arch).map(|(f, _)| f).map_err(|e| e.to_string())
        });
        match loaded {
            Ok(funcs) => funcs.get(name).ok_or_else(not_loaded),
            Err(e) => Err(CudaError::Unsupported(format!("kernel {name}: module {} did not load: {e}", m.name))),
        }
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// Copies a host slice to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies a device buffer back to the host (synchronises the stream).
    pub fn download<T: DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    /// A zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros(len)?)
    }
}

/// Compiles `m` for `arch` (or reads its PTX from `cache`), loads it into `ctx` and looks up its kernels.
fn load_module(
    ctx: &Arc<cudarc::driver::CudaContext>,
    cache: &PtxCache,
    m: &KernelSource,
    arch: &str,
) -> Result<(Kernels, CacheStatus), CudaError> {
    let (ptx, status) = cache.get_or_compile(m, arch)?;
    let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)) {
        Ok(module) => module,
        Err(e) if status == CacheStatus::Hit => {
            // A cached file the driver rejects (truncated, or from another toolkit): rebuild it once.
            cache.evict(m, arch)?;
            let (ptx, _) = cache.get_or_compile(m, arch)?;
            ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(|_| CudaError::Driver(e))?
        }
        Err(e) => return Err(e.into()),
    };
    let funcs = m.functions.iter().map(|&f| Ok((f, module.load_function(f)?))).collect::<Result<_, CudaError>>()?;
    Ok((funcs, status))
}
