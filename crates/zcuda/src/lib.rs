//! zcuda: zrun's GPU layer.
//!
//! Nothing CUDA is needed to build it: cudarc loads the driver (`libcuda`) and
//! NVRTC (`libnvrtc`) when first asked, and this crate asks whether each is
//! there before touching it, because cudarc panics on a missing library. So a
//! binary built with zrun's `cuda` feature starts on a machine without CUDA and
//! says what is missing ([`probe`]).
//!
//! Layout:
//! - this file: [`CudaError`], [`probe`] (what this host has).
//! - `compile`: the CUDA C sources of the repository's `kernels/` folder,
//!   embedded in the binary, compiled to PTX by NVRTC at run time for the GPU
//!   at hand and cached on disk by a hash of source, options and compiler.
//! - `gpu`: [`Gpu`], one device with its stream and the loaded kernels, and
//!   typed launches of each kernel on device buffers.
//! - `nccl`: [`Nccl`], collectives between GPUs on device buffers, with
//!   deadlines (NCCL's non-blocking mode, polled, aborted at the deadline).
//! - `gpt`: [`GptGpu`], the GPT-2 and LLaMA models' forward and backward on one GPU
//!   (cuBLAS for the products, `kernels/gpt.cu` for the rest), its
//!   parameters and gradients crossing to and from the host's flat buffers.
//! - `profile`: GPU time by operation (`ZRUN_GPU_PROFILE=1`), from events
//!   recorded after each launch.
//!
//! Every kernel is written to give the same bits as zrun's CPU kernel of the
//! same job (AdamW, blockwise quantization, the collectives' f32 sums), so the
//! CPU kernels are the GPU's test oracles.

#![deny(missing_docs)]

mod compile;
mod gpt;
mod gpu;
mod nccl;
mod profile;

pub use compile::{compile, compile_with, kernel, CacheUse, Compiled, KernelSource, KERNELS};
pub use gpt::{
    check_documents, rotary_table, rows_by_token, BlockActs, Dropouts, Family, GptGpu, GptShape,
    HeadGrads, HeadOut, HeadPass, Mask, Noise, Rows, Weights, BLOCK_PARAMS,
};
pub use gpu::{
    AdamConsts, AddInto, DeviceGrads, DeviceQuantized, Gpu, Half16, Pinned, RunParams, Staging,
    RULE_ADAGRAD, RULE_ADAM, RULE_ADAMW, RULE_LION,
};
pub use nccl::{host_id_for_shared_gpu, nccl_present, nccl_version, Nccl, NcclId, NcclOp};

/// Re-exported so that callers hold device buffers without naming cudarc.
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library or a GPU is not on this host.
    #[error("{0}")]
    Missing(String),
    /// NVRTC refused a kernel.
    #[error("kernel {kernel}: NVRTC failed ({options}):\n{log}")]
    Compile {
        /// The kernel's file name.
        kernel: &'static str,
        /// The options it was compiled with.
        options: String,
        /// NVRTC's log (file, line and message per error).
        log: String,
    },
    /// The GPU had no room for an allocation.
    #[error(
        "{what}: the GPU is out of memory ({} MiB asked, {} MiB free of {} MiB)",
        mib(*bytes), mib(*free), mib(*total)
    )]
    OutOfMemory {
        /// What was being allocated.
        what: String,
        /// Bytes asked for.
        bytes: usize,
        /// Bytes free on the GPU when it failed (the driver's count).
        free: usize,
        /// The GPU's memory.
        total: usize,
    },
    /// A driver call failed.
    #[error("{what}: {source}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error.
        source: cudarc::driver::DriverError,
    },
    /// A quantized input held a NaN or an infinity.
    #[error("{0}")]
    Quant(#[from] zquant::QuantError),
    /// Arguments that do not fit the kernel (lengths, sizes).
    #[error("{0}")]
    Invalid(String),
    /// NCCL failed or missed its deadline (the communicator is aborted).
    #[error("{0}")]
    Nccl(String),
}

/// Bytes in MiB, rounded up (a request of a few bytes shows as 1).
fn mib(bytes: usize) -> usize {
    bytes.div_ceil(1 << 20)
}

/// What this host offers the GPU path.
#[derive(Debug, Clone)]
pub struct Probe {
    /// GPUs the driver sees, or why there are none.
    pub devices: Result<usize, String>,
    /// NVRTC is loadable (kernels can be compiled).
    pub nvrtc: bool,
    /// cuBLAS is loadable (the model's products can run).
    pub cublas: bool,
}

impl Probe {
    /// The GPU count, or a sentence saying what is missing.
    pub fn usable_devices(&self) -> Result<usize, String> {
        let n = self.devices.clone()?;
        if !self.nvrtc {
            return Err(NO_NVRTC.to_string());
        }
        Ok(n)
    }

    /// The GPU count where training can run (driver, GPU, NVRTC and
    /// cuBLAS), or a sentence saying what is missing.
    pub fn training_devices(&self) -> Result<usize, String> {
        let n = self.usable_devices()?;
        if !self.cublas {
            return Err(NO_CUBLAS.to_string());
        }
        Ok(n)
    }
}

const NO_DRIVER: &str = "no CUDA driver on this host (libcuda.so was not found: install the NVIDIA driver, or add its directory to LD_LIBRARY_PATH)";
const NO_CUBLAS: &str = "cuBLAS (libcublas.so) was not found: install the CUDA toolkit's cuBLAS, e.g. `pip install nvidia-cublas-cu12`, and add its lib/ directory to LD_LIBRARY_PATH";
const NO_NVRTC: &str = "NVRTC (libnvrtc.so.12) was not found: install the CUDA toolkit's runtime compiler, e.g. `pip install nvidia-cuda-nvrtc-cu12`, and add its lib/ directory to LD_LIBRARY_PATH";

/// The memory of the smallest GPU the driver sees (`cuDeviceTotalMem`), for
/// the check before launch that a worker's estimate fits its GPU; `None`
/// where the driver cannot say (no driver, no GPU).
pub fn smallest_gpu_memory() -> Option<usize> {
    if !driver_present() {
        return None;
    }
    use cudarc::driver::result;
    result::init().ok()?;
    let n = result::device::get_count().ok()?;
    (0..n)
        .map(|i| {
            let dev = result::device::get(i).ok()?;
            // SAFETY: `dev` is a device the initialized driver just gave.
            unsafe { result::device::total_mem(dev) }.ok()
        })
        .collect::<Option<Vec<usize>>>()?
        .into_iter()
        .min()
}

/// The driver is loadable (it may still see no GPU).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// NVRTC is loadable.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// cuBLAS is loadable.
pub fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// For tests that need a GPU: whether `have` (a probe's answer, e.g.
/// [`Probe::usable_devices`]) found one. Where it did not, prints
/// `SKIPPED {test}: {why}`, or fails under `ZRUN_REQUIRE_GPU=1` (a GPU host
/// where the test must run).
pub fn gpu_or_skip(test: &str, have: Result<usize, String>) -> bool {
    match have {
        Ok(_) => true,
        Err(why) => {
            assert!(
                std::env::var("ZRUN_REQUIRE_GPU").as_deref() != Ok("1"),
                "ZRUN_REQUIRE_GPU=1 but: {why}"
            );
            eprintln!("SKIPPED {test}: {why}");
            false
        }
    }
}

/// What this host has, without panicking where it has nothing.
pub fn probe() -> Probe {
    let devices = if !driver_present() {
        Err(NO_DRIVER.to_string())
    } else {
        match cudarc::driver::result::init()
            .and_then(|()| cudarc::driver::result::device::get_count())
        {
            Ok(0) => Err("the CUDA driver sees no GPU (CUDA_VISIBLE_DEVICES may hide them)".into()),
            Ok(n) => Ok(n as usize),
            Err(e) => Err(format!("the CUDA driver failed to start: {e}")),
        }
    };
    Probe {
        devices,
        nvrtc: nvrtc_present(),
        cublas: cublas_present(),
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_gpt;
#[cfg(test)]
mod tests_nccl;
