//! Compiling the sources with NVRTC for a device's architecture (falling
//! back to older ones), the per-device cache of loaded functions, and the
//! driver's errors as the crate's. Imports only the kernel table.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, RwLock};

use candle_core::cuda::{CudaDevice, DeviceId};
use candle_core::Device;
use cudarc::driver::{CudaFunction, CudaModule, DriverError};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use super::registry::{KernelId, ModuleId, ALL_MODULES, MODULES};
use crate::{Error, Result};

/// The modules loaded on one device, compiled on first use.
struct DeviceKernels {
    /// Compute capability, `10 * major + minor`.
    cc: u32,
    modules: RwLock<[Option<Arc<CudaModule>>; MODULES.len()]>,
}

/// Per-device kernel modules. Keyed by candle's `DeviceId` (one per
/// `Device::new_cuda`), like candle's own per-device module store, so a
/// module is always loaded into the context of the device that runs it.
static CACHE: LazyLock<Mutex<HashMap<DeviceId, Arc<DeviceKernels>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Formats a driver error with its name and description (its `Debug` is a
/// bare number).
pub(crate) fn driver_message(e: &DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        _ => format!("{e:?}"),
    }
}

/// Wraps driver errors as [`Error::Cuda`] naming the operation and step.
pub(crate) trait WrapDriver<T> {
    /// Converts the error, for `?`.
    fn w(self, op: &'static str, call: &'static str) -> Result<T>;
}

impl<T> WrapDriver<T> for std::result::Result<T, DriverError> {
    fn w(self, op: &'static str, call: &'static str) -> Result<T> {
        self.map_err(|e| Error::Cuda {
            op,
            call,
            message: driver_message(&e),
        })
    }
}

/// The compute capability of a device, as `10 * major + minor`.
fn compute_capability(dev: &CudaDevice) -> Result<u32> {
    let (major, minor) = dev
        .cuda_stream()
        .context()
        .compute_capability()
        .w("nvrtc", "compute_capability")?;
    Ok(10 * major as u32 + minor as u32)
}

/// Architectures to fall back to, newest first, when the installed NVRTC
/// does not know the device's own (a GPU newer than the toolkit): PTX for
/// an older architecture is JIT-compiled by the driver for the device.
const FALLBACK_ARCHS: [u32; 7] = [120, 100, 90, 89, 86, 80, 75];

/// Compiles `module` for the device's architecture, or the newest older one
/// NVRTC accepts; returns the PTX and the architecture used.
fn compile_for(module: ModuleId, cc: u32) -> Result<(Ptx, String)> {
    let own = format!("sm_{cc}");
    let first = match compile(module, &own) {
        Ok(ptx) => return Ok((ptx, own)),
        Err(e) => e,
    };
    let unknown_arch =
        matches!(&first, Error::Nvrtc { log, .. } if log.contains("gpu-architecture"));
    if unknown_arch {
        for arch in FALLBACK_ARCHS.iter().filter(|&&a| a < cc) {
            let arch = format!("sm_{arch}");
            if let Ok(ptx) = compile(module, &arch) {
                return Ok((ptx, arch));
            }
        }
    }
    Err(first)
}

/// Compiles one module for `arch` with the options the kernels rely on:
/// no FMA contraction and IEEE division and square root (bitwise agreement
/// with the CPU path), no flush-to-zero (subnormals survive casts).
pub(crate) fn compile(module: ModuleId, arch: &str) -> Result<Ptx> {
    let opts = CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some(format!("{}.cu", module.name())),
        ..Default::default()
    };
    compile_ptx_with_opts(module.source(), opts).map_err(|e| Error::Nvrtc {
        module: module.name(),
        arch: arch.to_string(),
        log: match e {
            CompileError::CompileError { nvrtc, log, .. } => {
                format!("{nvrtc:?}: {}", log.to_string_lossy())
            }
            other => format!("{other:?}"),
        },
    })
}

/// The per-device entry of [`CACHE`], made on first use.
fn device_kernels(dev: &CudaDevice) -> Result<Arc<DeviceKernels>> {
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(k) = cache.get(&dev.id()) {
        return Ok(k.clone());
    }
    let k = Arc::new(DeviceKernels {
        cc: compute_capability(dev)?,
        modules: RwLock::new(Default::default()),
    });
    cache.insert(dev.id(), k.clone());
    Ok(k)
}

/// The compute capability of `dev` (`10 * major + minor`), queried once per
/// device and kept with its modules.
pub(crate) fn device_cc(dev: &CudaDevice) -> Result<u32> {
    Ok(device_kernels(dev)?.cc)
}

/// The kernel `id` on `dev`, compiling and loading its module on first use.
pub(crate) fn function(dev: &CudaDevice, id: KernelId) -> Result<CudaFunction> {
    let kernels = device_kernels(dev)?;
    let m = id.module() as usize;
    let loaded = kernels.modules.read().unwrap_or_else(|p| p.into_inner())[m].clone();
    let module = match loaded {
        Some(module) => module,
        None => {
            // Compiling under the write lock keeps two threads from both
            // compiling the same module; it happens once per device.
            let mut modules = kernels.modules.write().unwrap_or_else(|p| p.into_inner());
            match &modules[m] {
                Some(module) => module.clone(),
                None => {
                    let (ptx, _arch) = compile_for(id.module(), kernels.cc)?;
                    let module = dev
                        .cuda_stream()
                        .context()
                        .load_module(ptx)
                        .w(id.name(), "load_module")?;
                    modules[m] = Some(module.clone());
                    module
                }
            }
        }
    };
    module
        .load_function(id.name())
        .w(id.name(), "load_function")
}

/// The CUDA device behind `device`, or [`Error::InvalidArgument`] naming
/// `op` (the public entry points that take a `Device`).
pub(crate) fn cuda_of<'a>(op: &'static str, device: &'a Device) -> Result<&'a CudaDevice> {
    match device {
        Device::Cuda(dev) => Ok(dev),
        other => Err(Error::InvalidArgument {
            op,
            reason: format!("needs a CUDA device, got {:?}", other.location()),
        }),
    }
}

/// Compiles and loads every kernel for `device` now, instead of on the first
/// call that needs it (NVRTC takes a moment per module). Also a quick check
/// that the installed NVRTC and driver accept the sources.
///
/// # Errors
/// [`Error::Nvrtc`] with the compile log, [`Error::Cuda`] when the driver
/// rejects the PTX, [`Error::InvalidArgument`] for a non-CUDA device.
pub fn precompile(device: &Device) -> Result<()> {
    let dev = cuda_of("precompile", device)?;
    for &id in KernelId::ALL {
        function(dev, id)?;
    }
    Ok(())
}

/// Compiles every embedded kernel source with NVRTC for `arch` (such as
/// `"sm_90"`), with no device involved, and returns each module's name and
/// PTX: a check that the installed NVRTC accepts the sources (it runs where
/// `libnvrtc` exists, GPU or not).
///
/// # Errors
/// [`Error::Nvrtc`] with the compile log.
pub fn compile_sources(arch: &str) -> Result<Vec<(&'static str, String)>> {
    ALL_MODULES
        .iter()
        .map(|&m| Ok((m.name(), compile(m, arch)?.to_src())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs `libnvrtc` (no GPU): every `KernelId` names a kernel of its
    /// module's PTX, so `load_function` cannot miss at run time.
    #[test]
    #[ignore = "needs libnvrtc; run with --ignored where it is installed"]
    fn every_kernel_id_is_an_entry_of_its_module() -> Result<()> {
        for &m in &ALL_MODULES {
            let ptx = compile(m, "sm_80")?.to_src();
            for id in KernelId::ALL.iter().filter(|id| id.module() == m) {
                let entry = format!(".entry {}(", id.name());
                assert!(ptx.contains(&entry), "{} not in {}.cu", id.name(), m.name());
            }
            let entries = ptx.matches(".entry ").count();
            let ids = KernelId::ALL.iter().filter(|id| id.module() == m).count();
            assert_eq!(
                entries,
                ids,
                "{}.cu has kernels without a KernelId",
                m.name()
            );
        }
        Ok(())
    }
}
