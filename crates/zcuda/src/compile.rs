//! The kernels of `kernels/`, compiled to PTX by NVRTC at run time.
//!
//! Why at run time: a build machine needs no CUDA toolkit (no `nvcc`, which no
//! registry these machines reach provides), and the PTX is made for the exact
//! GPU that runs it. Why cached: NVRTC takes a fraction of a second per kernel,
//! paid once per host and compiler, not once per worker and run. The cache key
//! is a SHA-256 of the kernel's source, the options, the target architecture
//! and NVRTC's version, so a changed kernel or compiler never meets stale PTX.
//! Entries are written to a temporary name and renamed, so workers compiling
//! the same kernel at once never read half a file.
//!
//! Every kernel is compiled with `--fmad=false` (no fused multiply-add: the
//! CPU kernels they must equal form none) and `--ftz=false` (subnormals kept).

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{nvrtc_present, CudaError, NO_NVRTC};

/// One CUDA C source file of `kernels/`.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name in `kernels/`.
    pub name: &'static str,
    /// The source text (with `half16.cuh`'s before it where the file uses
    /// the 16-bit formats, `runs.cuh`'s where it walks runs and
    /// `dropout.cuh`'s where it drops).
    pub code: &'static str,
    /// The `extern "C"` functions it defines.
    pub functions: &'static [&'static str],
    /// Whether it promises the CPU kernel's bits (AdamW, quantization, the
    /// collectives' sums: every operation rounded on its own, no FMA, no
    /// math library), or only the CPU model's function in f32 (the model's
    /// kernels, whose exp, tanh and log come from CUDA's math library).
    pub same_bits_as_cpu: bool,
}

/// Every kernel zrun ships.
pub const KERNELS: [KernelSource; 5] = [
    KernelSource {
        name: "adamw.cu",
        code: concat!(
            include_str!("../../../kernels/half16.cuh"),
            include_str!("../../../kernels/runs.cuh"),
            include_str!("../../../kernels/adamw.cu")
        ),
        functions: &["adamw", "adamw_runs"],
        same_bits_as_cpu: true,
    },
    KernelSource {
        name: "quantize.cu",
        code: include_str!("../../../kernels/quantize.cu"),
        functions: &["quantize", "dequantize"],
        same_bits_as_cpu: true,
    },
    KernelSource {
        name: "reduce.cu",
        code: concat!(
            include_str!("../../../kernels/half16.cuh"),
            include_str!("../../../kernels/runs.cuh"),
            include_str!("../../../kernels/reduce.cu")
        ),
        functions: &[
            "add_f32",
            "scale_f32",
            "add_into16",
            "add_runs",
            "widen16_into",
            "round16_into",
            "sum_sq_chunks",
        ],
        same_bits_as_cpu: true,
    },
    KernelSource {
        name: "gpt.cu",
        code: concat!(
            include_str!("../../../kernels/half16.cuh"),
            include_str!("../../../kernels/dropout.cuh"),
            include_str!("../../../kernels/gpt.cu")
        ),
        functions: &[
            "embed",
            "embed_backward_tokens",
            "embed_backward_positions",
            "layer_norm",
            "layer_norm_backward",
            "layer_norm_param_partials",
            "rms_norm",
            "rms_norm_backward",
            "rms_norm_param_partials",
            "column_sums",
            "bias_residual",
            "dropout_noise",
            "gelu",
            "gelu_backward",
            "causal_softmax",
            "causal_softmax_backward",
            "rows_to_heads",
            "heads_to_rows",
            "kv_rows_to_heads",
            "heads_to_kv_rows",
            "rope",
            "swiglu",
            "swiglu_backward",
            "cross_entropy",
        ],
        same_bits_as_cpu: false,
    },
    KernelSource {
        name: "attention.cu",
        code: concat!(
            include_str!("../../../kernels/half16.cuh"),
            include_str!("../../../kernels/dropout.cuh"),
            include_str!("../../../kernels/attention.cu")
        ),
        functions: &[
            "flash_forward_bf16_16",
            "flash_forward_bf16_32",
            "flash_forward_bf16_64",
            "flash_forward_f16_16",
            "flash_forward_f16_32",
            "flash_forward_f16_64",
            "flash_forward_bf16_128",
            "flash_forward_f16_128",
            "flash_forward_tf32_16",
            "flash_forward_tf32_32",
            "flash_forward_tf32_64",
            "flash_backward_kv_bf16_16",
            "flash_backward_kv_bf16_32",
            "flash_backward_kv_bf16_64",
            "flash_backward_kv_f16_16",
            "flash_backward_kv_f16_32",
            "flash_backward_kv_f16_64",
            "flash_backward_kv_bf16_128",
            "flash_backward_kv_f16_128",
            "flash_backward_kv_tf32_16",
            "flash_backward_kv_tf32_32",
            "flash_backward_kv_tf32_64",
            "flash_backward_q_bf16_16",
            "flash_backward_q_bf16_32",
            "flash_backward_q_bf16_64",
            "flash_backward_q_f16_16",
            "flash_backward_q_f16_32",
            "flash_backward_q_f16_64",
            "flash_backward_q_bf16_128",
            "flash_backward_q_f16_128",
            "flash_backward_q_tf32_16",
            "flash_backward_q_tf32_32",
            "flash_backward_q_tf32_64",
            "flash_forward_dropout_bf16_16",
            "flash_forward_dropout_bf16_32",
            "flash_forward_dropout_bf16_64",
            "flash_forward_dropout_f16_16",
            "flash_forward_dropout_f16_32",
            "flash_forward_dropout_f16_64",
            "flash_forward_dropout_bf16_128",
            "flash_forward_dropout_f16_128",
            "flash_forward_dropout_tf32_16",
            "flash_forward_dropout_tf32_32",
            "flash_forward_dropout_tf32_64",
            "flash_backward_kv_dropout_bf16_16",
            "flash_backward_kv_dropout_bf16_32",
            "flash_backward_kv_dropout_bf16_64",
            "flash_backward_kv_dropout_f16_16",
            "flash_backward_kv_dropout_f16_32",
            "flash_backward_kv_dropout_f16_64",
            "flash_backward_kv_dropout_bf16_128",
            "flash_backward_kv_dropout_f16_128",
            "flash_backward_kv_dropout_tf32_16",
            "flash_backward_kv_dropout_tf32_32",
            "flash_backward_kv_dropout_tf32_64",
            "flash_backward_q_dropout_bf16_16",
            "flash_backward_q_dropout_bf16_32",
            "flash_backward_q_dropout_bf16_64",
            "flash_backward_q_dropout_f16_16",
            "flash_backward_q_dropout_f16_32",
            "flash_backward_q_dropout_f16_64",
            "flash_backward_q_dropout_bf16_128",
            "flash_backward_q_dropout_f16_128",
            "flash_backward_q_dropout_tf32_16",
            "flash_backward_q_dropout_tf32_32",
            "flash_backward_q_dropout_tf32_64",
            "attention_delta",
        ],
        same_bits_as_cpu: false,
    },
];

/// The kernel source named `name`.
pub fn kernel(name: &str) -> Option<&'static KernelSource> {
    KERNELS.iter().find(|k| k.name == name)
}

/// Where a compiled kernel came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheUse {
    /// Read from the cache.
    Hit,
    /// Compiled now and stored.
    Stored,
    /// Compiled now; no cache directory was usable.
    Uncached,
}

/// PTX for one kernel source and architecture.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The PTX text.
    pub ptx: String,
    /// Whether the cache served it.
    pub cache: CacheUse,
}

/// Compiles `src` for `arch` (`compute_80`, `compute_90`, ...) through the
/// default cache: `$ZRUN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/zrun/kernels`,
/// else `~/.cache/zrun/kernels`.
pub fn compile(src: &KernelSource, arch: &str) -> Result<Compiled, CudaError> {
    compile_with(src, arch, default_cache_dir().as_deref())
}

/// [`compile`] with an explicit cache directory (`None`: no cache).
pub fn compile_with(
    src: &KernelSource,
    arch: &str,
    cache_dir: Option<&Path>,
) -> Result<Compiled, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::Missing(NO_NVRTC.to_string()));
    }
    if !arch
        .strip_prefix("compute_")
        .is_some_and(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_alphanumeric()))
    {
        return Err(CudaError::Invalid(format!(
            "`{arch}` is not an NVRTC virtual architecture (e.g. compute_90)"
        )));
    }
    let options = vec![
        format!("--gpu-architecture={arch}"),
        "--fmad=false".to_string(),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
    ];
    let entry = cache_dir.map(|d| d.join(format!("{}.ptx", cache_key(src, &options))));
    if let Some(ptx) = entry.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(Compiled {
            ptx,
            cache: CacheUse::Hit,
        });
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: options.clone(),
        name: Some(src.name.to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src.code, opts)
        .map_err(|e| compile_error(src, &options, e))?
        .to_src();
    let cache = match entry.as_ref().map(|p| store(p, &ptx)) {
        Some(Ok(())) => CacheUse::Stored,
        _ => CacheUse::Uncached,
    };
    Ok(Compiled { ptx, cache })
}

fn compile_error(
    src: &KernelSource,
    options: &[String],
    e: cudarc::nvrtc::CompileError,
) -> CudaError {
    let log = match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    };
    CudaError::Compile {
        kernel: src.name,
        options: options.join(" "),
        log,
    }
}

fn default_cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("ZRUN_KERNEL_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("zrun/kernels")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/zrun/kernels")))
}

fn cache_key(src: &KernelSource, options: &[String]) -> String {
    let mut h = Sha256::new();
    for part in [src.name, src.code, &options.join("\0"), &nvrtc_version()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// NVRTC's version, `major.minor` (CUDA 13's NVRTC no longer targets Volta).
pub(crate) fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loadable (checked by the caller); nvrtcVersion writes
    // two ints through the pointers it is given.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    format!("{major}.{minor}")
}

/// Writes `ptx` to `path` through a temporary name in the same directory.
fn store(path: &Path, ptx: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = tempfile_name(path);
    std::fs::write(&tmp, ptx)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// A name no other writer of this entry uses: the process id and a counter
/// (threads of one process compile too).
fn tempfile_name(path: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.{n}.tmp", std::process::id()));
    path.with_file_name(name)
}
