//! One GPU: its context, a stream, and the kernels of `kernels/` loaded for
//! its architecture, with a typed launch for each.
//!
//! Launches are asynchronous on the stream; the calls that return host data
//! (downloads, the quantizer's non-finite check) wait for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
};
use zquant::{Bits, QuantError, Quantized};

use crate::compile::{compile, KERNELS};
use crate::profile::Profile;
use crate::{probe, CudaError};

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
/// Blocks of a grid-stride launch at most (a few per SM on any current GPU).
const MAX_BLOCKS: u32 = 4096;
/// The gradient norm's threads per chunk (a block each; `sum_sq_chunks` in
/// `reduce.cu`: one warp adds, the others read and square).
const SUM_SQ_THREADS: u32 = 256;
/// The quantizer's threads per block (`THREADS` in `quantize.cu`).
const QUANT_THREADS: u32 = 256;

/// AdamW's per-step scalars, as zrun's CPU kernel derives them (zengine
/// builds them; the layout is `AdamConsts` in `adamw.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConsts {
    /// Every gradient is multiplied by this first.
    pub gscale: f32,
    /// beta1.
    pub b1: f32,
    /// 1 - beta1.
    pub omb1: f32,
    /// beta2.
    pub b2: f32,
    /// 1 - beta2.
    pub omb2: f32,
    /// lr over the first moment's bias correction.
    pub step_size: f32,
    /// 1 / sqrt of the second moment's bias correction.
    pub inv_sqrt_bc2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// The weight decay's factor: 1 − lr·weight_decay (decoupled, scales
    /// p) where decay applies, else 1; Adam and Adagrad: weight_decay (L2,
    /// the multiple of p added to the gradient), else 0.
    pub decay: f32,
    /// Adagrad: added to the sum before the square (its initial value at
    /// the first update, else 0).
    pub initial_sum: f32,
    /// Which update: [`RULE_ADAMW`], [`RULE_LION`], [`RULE_ADAGRAD`] or
    /// [`RULE_ADAM`].
    pub rule: u32,
}

/// [`AdamConsts::rule`] of AdamW's update.
pub const RULE_ADAMW: u32 = 0;
/// [`AdamConsts::rule`] of Lion's update (`step_size` is lr itself; no v).
pub const RULE_LION: u32 = 1;
/// [`AdamConsts::rule`] of Adagrad's update (its sum of squares in m; no v).
pub const RULE_ADAGRAD: u32 = 2;
/// [`AdamConsts::rule`] of PyTorch's Adam (AdamW's update on a gradient
/// with the L2 term added, p not decayed).
pub const RULE_ADAM: u32 = 3;

// SAFETY: ten f32 and a u32 in C layout, no pointers; `adamw.cu` declares
// the same struct, which the kernel receives by value.
unsafe impl DeviceRepr for AdamConsts {}

/// Runs one `adamw_runs` launch takes at most (`ADAMW_MAX_RUNS` in
/// `adamw.cu`); [`Gpu::adamw_runs`] launches once per this many.
const ADAMW_MAX_RUNS: usize = 16;

/// The one length of AdamW's buffers (`what`'s), or an error where they
/// differ.
fn adam_len(
    what: &str,
    n: usize,
    (g, m, v): (
        &DeviceGrads<'_>,
        &CudaViewMut<f32>,
        Option<&CudaViewMut<f32>>,
    ),
    working: Option<&CudaViewMut<u16>>,
    c: &AdamConsts,
) -> Result<usize, CudaError> {
    if v.is_some() != (c.rule == RULE_ADAMW || c.rule == RULE_ADAM) {
        return Err(CudaError::Invalid(format!(
            "{what}: a second moment is AdamW's and Adam's alone (Lion and Adagrad keep none)"
        )));
    }
    if g.len() != n
        || m.len() != n
        || v.is_some_and(|v| v.len() != n)
        || working.is_some_and(|w| w.len() != n)
    {
        return Err(CudaError::Invalid(format!("{what}: buffer lengths differ")));
    }
    Ok(n)
}

/// `AdamRuns` of `adamw.cu`: the runs of one launch and their decay.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamRuns {
    start: [u64; ADAMW_MAX_RUNS],
    end: [u64; ADAMW_MAX_RUNS],
    p_at: [u64; ADAMW_MAX_RUNS],
    count: u32,
    decay_mask: u32,
    plain: f32,
}

// SAFETY: integers (device addresses among them) and an f32 in C layout,
// as `adamw.cu` declares `AdamRuns`, received by value.
unsafe impl DeviceRepr for AdamRuns {}

/// Where [`Gpu::adamw_runs`] finds the parameters.
pub enum RunParams<'p, 'a> {
    /// One flat buffer, indexed as the gradients and moments (a group's
    /// working parameters).
    Flat(&'p mut CudaViewMut<'a, f32>),
    /// One buffer a run, each of its run's length (a model's f32 tensors).
    Each(&'p mut [CudaViewMut<'a, f32>]),
}

/// Runs one `add_runs` launch takes at most (`ADD_MAX_RUNS` in
/// `reduce.cu`).
const ADD_MAX_RUNS: usize = 16;

/// `AddRuns` of `reduce.cu`: each run's source address and place.
#[repr(C)]
#[derive(Clone, Copy)]
struct AddRuns {
    src: [u64; ADD_MAX_RUNS],
    start: [u64; ADD_MAX_RUNS],
    end: [u64; ADD_MAX_RUNS],
    count: u32,
}

// SAFETY: integers (device addresses among them) in C layout, as
// `reduce.cu` declares `AddRuns`, received by value.
unsafe impl DeviceRepr for AddRuns {}

/// A flat buffer that [`Gpu::add_runs`] adds into.
pub enum AddInto<'p, 'a> {
    /// f32 values (`add_f32`'s sum).
    F32(&'p mut CudaViewMut<'a, f32>),
    /// 16-bit values (`add_into16`'s sum).
    Half(Half16, &'p mut CudaViewMut<'a, u16>),
}

/// Runs sorted, apart or touching, inside `n` values; else what is wrong.
fn check_runs<'r>(
    what: &str,
    n: usize,
    runs: impl Iterator<Item = &'r std::ops::Range<usize>> + Clone,
) -> Result<(), CudaError> {
    let mut end = 0;
    for r in runs.clone() {
        if r.start > r.end || r.end > n || r.start < end {
            return Err(CudaError::Invalid(format!(
                "{what}: runs {:?} not sorted apart inside {n} values",
                runs.collect::<Vec<_>>()
            )));
        }
        end = r.end;
    }
    Ok(())
}

/// A 16-bit floating-point format on the device: the host's 16-bit type.
pub use zquant::Half as Half16;

/// A 16-bit format's number in the kernels (`FMT_BF16`, `FMT_F16`).
pub(crate) trait FormatCode {
    /// The number.
    fn code(self) -> i32;
}

impl FormatCode for Half16 {
    fn code(self) -> i32 {
        match self {
            Half16::Bf16 => 1,
            Half16::F16 => 2,
        }
    }
}

impl DeviceGrads<'_> {
    fn len(&self) -> usize {
        match self {
            DeviceGrads::F32(g) => g.len(),
            DeviceGrads::Half(_, g) => g.len(),
        }
    }

    /// The format's number in the kernels (`FMT_F32` for f32).
    fn code(&self) -> i32 {
        match self {
            DeviceGrads::F32(_) => 0,
            DeviceGrads::Half(h, _) => h.code(),
        }
    }
}

/// Gradients on the device, as AdamW and the norm read them.
#[derive(Debug)]
pub enum DeviceGrads<'a> {
    /// f32 values.
    F32(CudaView<'a, f32>),
    /// 16-bit values, as bits.
    Half(Half16, CudaView<'a, u16>),
}

/// Quantized values in device memory: the CPU's [`Quantized`], split in the
/// same two parts.
#[derive(Debug)]
pub struct DeviceQuantized {
    /// Bits per value.
    pub bits: Bits,
    /// Values per block (even).
    pub block_size: usize,
    /// Values.
    pub len: usize,
    /// One scale per block.
    pub scales: CudaSlice<f32>,
    /// `bits.data_bytes(len)` bytes.
    pub data: CudaSlice<u8>,
}

/// Page-locked host memory that device copies land in without staging
/// through the driver's own buffers (not write-combined: the CPU reads it).
pub struct Pinned {
    buf: PinnedHostSlice<f32>,
    /// Recorded after each copy into `buf`. cudarc's own event on a pinned
    /// slice is recorded only when a context has several streams, so with
    /// one stream waiting on it would not wait at all (found on an H200: the
    /// host read gradients before they landed).
    landed: CudaEvent,
}

impl Pinned {
    /// Values it holds.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The values, once the last copy into them has landed (waits for it).
    pub fn values(&self) -> Result<&[f32], CudaError> {
        let wait = |source| CudaError::Driver {
            what: "waiting for a copy to the host".into(),
            source,
        };
        self.landed.synchronize().map_err(wait)?;
        self.buf.as_slice().map_err(wait)
    }
}

/// Page-locked host memory that uploads ahead of use go through
/// ([`Gpu::upload_ahead`]): one buffer per part, kept for the next upload
/// of parts of the same lengths (allocating page-locked memory costs
/// milliseconds).
pub struct Staging<T = f32> {
    parts: Vec<PinnedHostSlice<T>>,
    /// Recorded on the upload stream after the last copy out of `parts`:
    /// they are refilled only once it has passed.
    copied: Option<CudaEvent>,
}

impl<T> Default for Staging<T> {
    fn default() -> Staging<T> {
        Staging {
            parts: Vec::new(),
            copied: None,
        }
    }
}

/// One GPU with zrun's kernels loaded.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    arch: String,
    /// Every kernel function of `kernels/`, by name.
    functions: HashMap<&'static str, CudaFunction>,
    /// GPU time by operation, with `ZRUN_GPU_PROFILE` set (not empty, not 0).
    profile: Option<Mutex<Profile>>,
    /// The stream that uploads ahead of use run on, made by the first
    /// ([`Gpu::upload_ahead`]); until then the context has one stream.
    uploads: std::sync::OnceLock<Arc<CudaStream>>,
}

impl Gpu {
    /// Opens GPU `ordinal` and loads every kernel, compiled for it (or read
    /// from the kernel cache). Without a driver, a GPU or NVRTC: the error
    /// says which is missing.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        let n = probe().usable_devices().map_err(CudaError::Missing)?;
        if ordinal >= n {
            return Err(CudaError::Missing(format!(
                "GPU {ordinal} asked for, but the driver sees {n}"
            )));
        }
        let driver = |what: &str| {
            let what = what.to_string();
            move |source| CudaError::Driver { what, source }
        };
        let ctx = CudaContext::new(ordinal).map_err(driver("opening the GPU"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let name = ctx.name().map_err(driver("reading the GPU's name"))?;
        let arch = format!("compute_{major}{minor}");
        let mut functions = HashMap::new();
        for src in &KERNELS {
            let ptx = compile(src, &arch)?.ptx;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .map_err(driver(&format!("loading {}", src.name)))?;
            for f in src.functions {
                let function = module
                    .load_function(f)
                    .map_err(driver(&format!("loading {} from {}", f, src.name)))?;
                functions.insert(*f, function);
            }
        }
        let stream = ctx.default_stream();
        let profile = match std::env::var("ZRUN_GPU_PROFILE") {
            Ok(v) if !v.is_empty() && v != "0" => Some(Mutex::new(
                Profile::start(&stream).map_err(driver("starting the GPU profile"))?,
            )),
            _ => None,
        };
        Ok(Gpu {
            ctx,
            stream,
            name,
            arch,
            functions,
            profile,
            uploads: std::sync::OnceLock::new(),
        })
    }

    /// A launch's result, a failure named by `what`; a launch marked in the
    /// profile, if there is one.
    pub(crate) fn launched<T>(
        &self,
        what: &str,
        r: Result<T, cudarc::driver::DriverError>,
    ) -> Result<(), CudaError> {
        r.map_err(|source| CudaError::Driver {
            what: format!("launching {what}"),
            source,
        })?;
        self.mark(|| what.to_string())
    }

    /// Marks the end of the operation just enqueued (`name` made only when
    /// profiling).
    pub(crate) fn mark(&self, name: impl FnOnce() -> String) -> Result<(), CudaError> {
        self.with_profile("recording a profile event", |p| {
            p.mark(&self.stream, name())
        })
        .map(|_| ())
    }

    /// With `ZRUN_GPU_PROFILE` set: forgets the profile's times so far.
    pub fn profile_restart(&self) -> Result<(), CudaError> {
        self.with_profile("reading the GPU profile's events", |p| {
            p.restart(&self.stream)
        })
        .map(|_| ())
    }

    /// With `ZRUN_GPU_PROFILE` set: GPU time by operation so far (waiting
    /// for the stream), per step of `steps`, the most first.
    pub fn profile_report(&self, steps: u64) -> Result<Option<String>, CudaError> {
        self.with_profile("reading the GPU profile's events", |p| p.report(steps))
    }

    /// `f` on the profile, if there is one; a failure named by `what`.
    fn with_profile<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Profile) -> Result<T, cudarc::driver::DriverError>,
    ) -> Result<Option<T>, CudaError> {
        let Some(profile) = &self.profile else {
            return Ok(None);
        };
        let mut p = profile.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut p).map(Some).map_err(|source| CudaError::Driver {
            what: what.into(),
            source,
        })
    }

    /// Kernel function `name` (one of `KERNELS`' functions).
    pub(crate) fn function(&self, name: &str) -> &CudaFunction {
        self.functions
            .get(name)
            .unwrap_or_else(|| panic!("no kernel function `{name}` in kernels/"))
    }

    /// The stream every launch and copy of this GPU goes to.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The GPU's name, as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The architecture its kernels were compiled for (`compute_90`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Copies `host` into new device memory.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(host).map_err(|source| {
            let what = format!("copying {} values to the GPU", host.len());
            self.alloc_failed(what, std::mem::size_of_val(host), source)
        })
    }

    /// Starts copying `parts` into new device buffers on a stream of their
    /// own, through `staging`, and returns the buffers at once: the copy
    /// runs while the compute stream works on what was queued before. Its
    /// second stream puts cudarc in its multi-stream mode, where each
    /// buffer's events order its uses across streams: a kernel on the
    /// compute stream that reads one of these waits for its copy, and a
    /// buffer is freed only after its last use. `staging` is refilled only
    /// after its previous copies have run (this waits for them), and the
    /// host's values are copied into it in parallel (rayon).
    pub fn upload_ahead<T: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync>(
        &self,
        parts: &[&[T]],
        staging: &mut Staging<T>,
    ) -> Result<Vec<CudaSlice<T>>, CudaError> {
        use rayon::prelude::*;
        let driver = |what: &'static str| {
            move |source| CudaError::Driver {
                what: what.into(),
                source,
            }
        };
        if let Some(copied) = staging.copied.take() {
            copied
                .synchronize()
                .map_err(driver("waiting for an upload's copies"))?;
        }
        let stream = match self.uploads.get() {
            Some(s) => s.clone(),
            None => {
                let s = self
                    .ctx
                    .new_stream()
                    .map_err(driver("making the upload stream"))?;
                self.uploads.get_or_init(|| s).clone()
            }
        };
        staging.parts.truncate(parts.len());
        for (i, part) in parts.iter().enumerate() {
            match staging.parts.get(i) {
                Some(p) if p.len() == part.len() => {}
                _ => {
                    // SAFETY: every value is written below before the copy
                    // reads it.
                    let buf = unsafe { self.ctx.alloc_pinned_with_flags::<T>(part.len(), 0) }
                        .map_err(driver("allocating page-locked staging memory"))?;
                    match i < staging.parts.len() {
                        true => staging.parts[i] = buf,
                        false => staging.parts.push(buf),
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(parts.len());
        for (part, buf) in parts.iter().zip(&mut staging.parts) {
            let host = buf
                .as_mut_slice()
                .map_err(driver("waiting for page-locked staging memory"))?;
            host.par_chunks_mut(1 << 16)
                .zip(part.par_chunks(1 << 16))
                .for_each(|(to, from)| to.copy_from_slice(from));
            // SAFETY: the copy below writes every value before a use.
            let mut dev = unsafe { stream.alloc::<T>(part.len()) }.map_err(|source| {
                let what = format!("allocating {} values on the GPU", part.len());
                self.alloc_failed(what, std::mem::size_of_val(*part), source)
            })?;
            stream
                .memcpy_htod(&*buf, &mut dev)
                .map_err(driver("copying parameters to the GPU ahead of use"))?;
            out.push(dev);
        }
        staging.copied = Some(
            stream
                .record_event(None)
                .map_err(driver("recording an upload's end"))?,
        );
        Ok(out)
    }

    /// The error of an allocation of `bytes` that failed with `source`:
    /// where the GPU is out of memory, how much it had free and in all
    /// (what a user sizing a job needs), else the driver's error.
    pub(crate) fn alloc_failed(
        &self,
        what: String,
        bytes: usize,
        source: cudarc::driver::DriverError,
    ) -> CudaError {
        use cudarc::driver::sys::CUresult;
        if source.0 != CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return CudaError::Driver { what, source };
        }
        let (free, total) = self
            .ctx
            .bind_to_thread()
            .and_then(|()| cudarc::driver::result::mem_get_info())
            .unwrap_or((0, 0));
        CudaError::OutOfMemory {
            what,
            bytes,
            free,
            total,
        }
    }

    /// Copies `dev` back to the host (waits for the stream).
    pub fn download<T: DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        self.stream
            .clone_dtoh(dev)
            .map_err(|source| CudaError::Driver {
                what: format!("copying {} values from the GPU", dev.len()),
                source,
            })
    }

    /// `len` values of page-locked host memory, unset until a copy lands.
    pub fn pinned(&self, len: usize) -> Result<Pinned, CudaError> {
        let driver = |source| CudaError::Driver {
            what: format!("allocating {len} floats of page-locked host memory"),
            source,
        };
        // SAFETY: the values are read only through `Pinned::values`, after a
        // copy into them (the only way callers fill it) has completed.
        let buf = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(len, 0) }.map_err(driver)?;
        let landed = self
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(driver)?;
        Ok(Pinned { buf, landed })
    }

    /// Starts copying `src` into `dst` (of the same length); returns at once,
    /// and [`Pinned::values`] waits for it.
    pub fn copy_to_pinned(&self, src: &CudaSlice<f32>, dst: &mut Pinned) -> Result<(), CudaError> {
        if src.len() != dst.len() {
            return Err(CudaError::Invalid(format!(
                "copy to the host: {} values into {}",
                src.len(),
                dst.len()
            )));
        }
        let driver = |source| CudaError::Driver {
            what: format!("copying {} values from the GPU", src.len()),
            source,
        };
        self.stream.memcpy_dtoh(src, &mut dst.buf).map_err(driver)?;
        dst.landed.record(&self.stream).map_err(driver)
    }

    /// `len` zeros in device memory.
    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream.alloc_zeros(len).map_err(|source| {
            let what = format!("allocating {len} values on the GPU");
            self.alloc_failed(what, len * std::mem::size_of::<T>(), source)
        })
    }

    /// One AdamW step over device-resident `p`, `m`, `v` with gradient `g`
    /// (Lion's or Adagrad's as `c.rule` says, which keep no `v`: `None`);
    /// with `working`,
    /// also the rounded 16-bit copy of the updated `p`. Same bits as the CPU
    /// kernel given the same [`AdamConsts`].
    pub fn adamw(
        &self,
        p: &mut CudaViewMut<f32>,
        g: DeviceGrads<'_>,
        m: &mut CudaViewMut<f32>,
        mut v: Option<&mut CudaViewMut<f32>>,
        working: Option<(Half16, &mut CudaViewMut<u16>)>,
        c: &AdamConsts,
    ) -> Result<(), CudaError> {
        let n = adam_len(
            "adamw",
            p.len(),
            (&g, m, v.as_deref()),
            working.as_ref().map(|(_, w)| &**w),
            c,
        )?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let grad_fmt = g.code();
        let null = 0u64;
        let (working_fmt, mut working) = match working {
            Some((h, w)) => (h.code(), Some(w)),
            None => (0i32, None),
        };
        let mut launch = self.stream.launch_builder(self.function("adamw"));
        launch.arg(p);
        match &g {
            DeviceGrads::F32(g) => launch.arg(g),
            DeviceGrads::Half(_, g) => launch.arg(g),
        };
        launch.arg(m);
        match v.as_mut() {
            Some(v) => launch.arg(&mut **v),
            None => launch.arg(&null),
        };
        match working.as_mut() {
            Some(w) => launch.arg(&mut **w),
            None => launch.arg(&null),
        };
        launch.arg(&n64).arg(c).arg(&grad_fmt).arg(&working_fmt);
        // SAFETY: the arguments match `adamw`'s signature in adamw.cu (f32
        // buffers p and m, v or null where `c.rule` says the kernel never
        // touches it, the gradient in the format `grad_fmt` names, the
        // working copy or null as `working_fmt` says, all of n elements,
        // checked above), and the grid-stride loop stays below n.
        self.launched("adamw", unsafe { launch.launch(grid_stride(n)) })?;
        Ok(())
    }

    /// [`Gpu::adamw`] over runs of flat buffers at once (a parameter
    /// group's tensors, one launch per 16 runs instead of one a tensor):
    /// run `(r, decay)` updates elements `r` of the gradients, moments and
    /// working copy, and its parameters (`p`: the same elements of a flat
    /// buffer, or a buffer of the run's own), decayed by `c.decay` where
    /// `decay`, else by `plain` (`c.decay` of a step without decay);
    /// elements outside the runs are not touched. The same bits as
    /// [`Gpu::adamw`] on each run. Runs must be sorted, apart or touching,
    /// and inside the flat buffers, which must be of one length.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_runs(
        &self,
        p: RunParams<'_, '_>,
        g: DeviceGrads<'_>,
        m: &mut CudaViewMut<f32>,
        mut v: Option<&mut CudaViewMut<f32>>,
        mut working: Option<(Half16, &mut CudaViewMut<u16>)>,
        c: &AdamConsts,
        plain: f32,
        runs: &[(std::ops::Range<usize>, bool)],
    ) -> Result<(), CudaError> {
        let n = adam_len(
            "adamw_runs",
            m.len(),
            (&g, m, v.as_deref()),
            working.as_ref().map(|(_, w)| &**w),
            c,
        )?;
        check_runs("adamw_runs", n, runs.iter().map(|(r, _)| r))?;
        match &p {
            RunParams::Flat(f) if f.len() != n => {
                return Err(CudaError::Invalid(
                    "adamw_runs: buffer lengths differ".into(),
                ));
            }
            RunParams::Each(each)
                if each.len() != runs.len()
                    || each.iter().zip(runs).any(|(e, (r, _))| e.len() != r.len()) =>
            {
                return Err(CudaError::Invalid(
                    "adamw_runs: a run's parameters are not its length".into(),
                ));
            }
            _ => {}
        }
        let grad_fmt = g.code();
        let working_fmt = working.as_ref().map_or(0i32, |(h, _)| h.code());
        let null = 0u64;
        let live: Vec<usize> = (0..runs.len()).filter(|&i| !runs[i].0.is_empty()).collect();
        // The flat parameters, or the live runs' own buffers in run order.
        let (mut flat, mut own) = match p {
            RunParams::Flat(f) => (Some(f), Vec::new()),
            RunParams::Each(each) => {
                let own: Vec<_> = (each.iter_mut().zip(runs))
                    .filter(|(_, (r, _))| !r.is_empty())
                    .map(|(e, _)| e)
                    .collect();
                (None, own)
            }
        };
        let mut rest = own.as_mut_slice();
        for batch in live.chunks(ADAMW_MAX_RUNS) {
            let mut a = AdamRuns {
                start: [0; ADAMW_MAX_RUNS],
                end: [0; ADAMW_MAX_RUNS],
                p_at: [0; ADAMW_MAX_RUNS],
                count: batch.len() as u32,
                decay_mask: 0,
                plain,
            };
            // The device addresses of a batch's own parameter buffers,
            // their streams' guards held until the launch is queued.
            let take = if flat.is_some() { 0 } else { batch.len() };
            let (now, later) = std::mem::take(&mut rest).split_at_mut(take);
            rest = later;
            let mut guards = Vec::new();
            for (k, own) in now.iter_mut().enumerate() {
                let (at, guard) = own.device_ptr_mut(&self.stream);
                a.p_at[k] = at;
                guards.push(guard);
            }
            for (k, &i) in batch.iter().enumerate() {
                let (r, decay) = &runs[i];
                a.start[k] = r.start as u64;
                a.end[k] = r.end as u64;
                a.decay_mask |= u32::from(*decay) << k;
            }
            let span = runs[batch[batch.len() - 1]].0.end - runs[batch[0]].0.start;
            let mut launch = self.stream.launch_builder(self.function("adamw_runs"));
            match flat.as_mut() {
                Some(f) => launch.arg(&mut **f),
                None => launch.arg(&null),
            };
            match &g {
                DeviceGrads::F32(g) => launch.arg(g),
                DeviceGrads::Half(_, g) => launch.arg(g),
            };
            launch.arg(&mut *m);
            match v.as_mut() {
                Some(v) => launch.arg(&mut **v),
                None => launch.arg(&null),
            };
            match working.as_mut() {
                Some((_, w)) => launch.arg(&mut **w),
                None => launch.arg(&null),
            };
            launch.arg(c).arg(&a).arg(&grad_fmt).arg(&working_fmt);
            // SAFETY: the arguments match `adamw_runs`'s signature in
            // adamw.cu (the flat parameters or null with each run's own
            // buffer's address, of the run's length; the gradient in the
            // format `grad_fmt` names, the moments (v null where `c.rule`
            // says it is never touched), the working copy or null as
            // `working_fmt` says, all of n elements, checked above;
            // 1 to 16 non-empty runs, sorted, inside n), and the loop stays
            // below the last run's end.
            self.launched("adamw_runs", unsafe { launch.launch(grid_stride(span)) })?;
            drop(guards);
        }
        Ok(())
    }

    /// Adds each `(at, x)` of `parts` into `acc[at..at + x.len()]` (f32, or
    /// 16-bit rounded to nearest even) in one launch per 16 of them, the
    /// bits of [`Gpu::add`] and [`Gpu::add_into16`] on each: a block's
    /// gradients, each its own buffer, into its group's flat one. The
    /// places must not overlap and must lie inside `acc`.
    pub fn add_runs(
        &self,
        acc: AddInto<'_, '_>,
        parts: &[(usize, CudaView<'_, f32>)],
    ) -> Result<(), CudaError> {
        let mut order: Vec<usize> = (0..parts.len())
            .filter(|&i| !parts[i].1.is_empty())
            .collect();
        order.sort_by_key(|&i| parts[i].0);
        let places: Vec<_> = order
            .iter()
            .map(|&i| parts[i].0..parts[i].0 + parts[i].1.len())
            .collect();
        let (n, fmt) = match &acc {
            AddInto::F32(a) => (a.len(), 0i32),
            AddInto::Half(h, a) => (a.len(), h.code()),
        };
        check_runs("add_runs", n, places.iter())?;
        let mut acc = acc;
        for (batch, at) in order.chunks(ADD_MAX_RUNS).zip(places.chunks(ADD_MAX_RUNS)) {
            let mut a = AddRuns {
                src: [0; ADD_MAX_RUNS],
                start: [0; ADD_MAX_RUNS],
                end: [0; ADD_MAX_RUNS],
                count: batch.len() as u32,
            };
            let mut guards = Vec::new();
            for (k, (&i, r)) in batch.iter().zip(at).enumerate() {
                let (src, guard) = parts[i].1.device_ptr(&self.stream);
                a.src[k] = src;
                guards.push(guard);
                a.start[k] = r.start as u64;
                a.end[k] = r.end as u64;
            }
            let span = at[at.len() - 1].end - at[0].start;
            let mut launch = self.stream.launch_builder(self.function("add_runs"));
            match &mut acc {
                AddInto::F32(a) => launch.arg(&mut **a),
                AddInto::Half(_, a) => launch.arg(&mut **a),
            };
            launch.arg(&a).arg(&fmt);
            // SAFETY: add_runs(acc, runs, fmt) in reduce.cu: acc f32 where
            // fmt is FMT_F32, else 16-bit, of n values; 1 to 16 non-empty
            // runs, sorted, inside n (checked above), each reading its
            // source's run-length values; the loop stays below the last
            // run's end.
            self.launched("add_runs", unsafe { launch.launch(grid_stride(span)) })?;
            drop(guards);
        }
        Ok(())
    }

    /// Quantizes `x` in the CPU's block format. A NaN or an infinity is
    /// refused, naming the first one, as the CPU quantizer refuses it.
    pub fn quantize(
        &self,
        x: &CudaSlice<f32>,
        bits: Bits,
        block_size: usize,
    ) -> Result<DeviceQuantized, CudaError> {
        if block_size == 0 || !block_size.is_multiple_of(2) {
            return Err(QuantError::BlockSize(block_size).into());
        }
        let len = x.len();
        if len == 0 {
            // Device allocations of zero bytes are refused by the driver.
            return Err(CudaError::Invalid("quantize: no values".into()));
        }
        let blocks = len.div_ceil(block_size);
        let grid = u32::try_from(blocks)
            .ok()
            .filter(|&b| b <= i32::MAX as u32)
            .ok_or_else(|| {
                CudaError::Invalid(format!(
                    "quantize: {blocks} blocks is more than one launch takes"
                ))
            })?;
        let block_u32 = u32::try_from(block_size).map_err(|_| {
            CudaError::Invalid(format!("quantize: block size {block_size} is too large"))
        })?;
        let mut scales = self.zeros::<f32>(blocks)?;
        let mut data = self.zeros::<u8>(bits.data_bytes(len))?;
        let mut bad = self.upload(&[u64::MAX])?;
        let (len64, nbits) = (len as u64, if bits == Bits::Int8 { 8i32 } else { 4 });
        let mut launch = self.stream.launch_builder(self.function("quantize"));
        launch
            .arg(x)
            .arg(&len64)
            .arg(&block_u32)
            .arg(&nbits)
            .arg(&mut scales)
            .arg(&mut data)
            .arg(&mut bad);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (QUANT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `quantize` in quantize.cu; one block
        // per quantization block, each reading and writing only its own
        // block's values (below len), scale and bytes.
        self.launched("quantize", unsafe { launch.launch(cfg) })?;
        let index = self.download(&bad)?[0];
        if index != u64::MAX {
            let value = self
                .stream
                .clone_dtoh(&x.slice(index as usize..index as usize + 1))
                .map_err(|source| CudaError::Driver {
                    what: "reading a non-finite input".into(),
                    source,
                })?[0];
            return Err(QuantError::NonFinite {
                index: index as usize,
                value,
            }
            .into());
        }
        Ok(DeviceQuantized {
            bits,
            block_size,
            len,
            scales,
            data,
        })
    }

    /// Dequantizes `q` into `out` (of `q.len` values).
    pub fn dequantize(
        &self,
        q: &DeviceQuantized,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if out.len() != q.len {
            return Err(CudaError::Invalid(format!(
                "dequantize: {} values into {}",
                q.len,
                out.len()
            )));
        }
        if q.len == 0 {
            return Ok(());
        }
        let (len64, block_u32) = (q.len as u64, q.block_size as u32);
        let nbits = if q.bits == Bits::Int8 { 8i32 } else { 4 };
        let mut launch = self.stream.launch_builder(self.function("dequantize"));
        launch
            .arg(&q.scales)
            .arg(&q.data)
            .arg(&len64)
            .arg(&block_u32)
            .arg(&nbits)
            .arg(out);
        // SAFETY: the arguments match `dequantize` in quantize.cu; scales and
        // data were sized for len values by `quantize`, out holds len.
        self.launched("dequantize", unsafe { launch.launch(grid_stride(q.len)) })?;
        Ok(())
    }

    /// `acc[i] += x[i]`, one IEEE addition each.
    pub fn add(&self, acc: &mut CudaViewMut<f32>, x: &CudaView<f32>) -> Result<(), CudaError> {
        if x.len() != acc.len() {
            return Err(CudaError::Invalid(format!(
                "add: {} values onto {}",
                x.len(),
                acc.len()
            )));
        }
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len() as u64;
        let mut launch = self.stream.launch_builder(self.function("add_f32"));
        launch.arg(&mut *acc).arg(x).arg(&n);
        // SAFETY: the arguments match `add_f32` in reduce.cu; both hold n
        // values (checked above).
        self.launched("add_f32", unsafe { launch.launch(grid_stride(x.len())) })?;
        Ok(())
    }

    /// `acc[at + i] += x[i]`, one IEEE addition each.
    pub fn add_at(
        &self,
        acc: &mut CudaSlice<f32>,
        at: usize,
        x: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if at + x.len() > acc.len() {
            return Err(CudaError::Invalid(format!(
                "add: {} values at {at} onto {}",
                x.len(),
                acc.len()
            )));
        }
        self.add(&mut acc.slice_mut(at..at + x.len()), &x.slice(..))
    }

    /// `x[i] *= s`, one IEEE multiplication each.
    pub fn scale(&self, x: &mut CudaViewMut<f32>, s: f32) -> Result<(), CudaError> {
        if x.is_empty() {
            return Ok(());
        }
        let (len, n) = (x.len(), x.len() as u64);
        let mut launch = self.stream.launch_builder(self.function("scale_f32"));
        launch.arg(&mut *x).arg(&s).arg(&n);
        // SAFETY: scale_f32(x[n], s, n).
        self.launched("scale_f32", unsafe { launch.launch(grid_stride(len)) })?;
        Ok(())
    }

    /// `acc[i] = round(widen(acc[i]) + x[i])` in the 16-bit format `h`: a
    /// micro-batch's f32 gradient added into a 16-bit gradient buffer, as
    /// zengine's host buffers add it (the same bits).
    pub fn add_into16(
        &self,
        h: Half16,
        acc: &mut CudaViewMut<u16>,
        x: &CudaView<f32>,
    ) -> Result<(), CudaError> {
        self.launch16("add_into16", h, acc, x)
    }

    /// `out[i]` = the f32 value of the 16-bit `x[i]` in format `h` (exact).
    pub fn widen16(
        &self,
        h: Half16,
        x: &CudaView<u16>,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaError> {
        self.launch16("widen16_into", h, out, x)
    }

    /// `out[i]` = `x[i]` rounded to nearest even in format `h`.
    pub fn round16(
        &self,
        h: Half16,
        x: &CudaView<f32>,
        out: &mut CudaViewMut<u16>,
    ) -> Result<(), CudaError> {
        self.launch16("round16_into", h, out, x)
    }

    /// Launches one of reduce.cu's element-wise 16-bit kernels, all
    /// `kernel(out[n], x[n], n, fmt)`.
    fn launch16<O: DeviceRepr, I: DeviceRepr>(
        &self,
        kernel: &'static str,
        h: Half16,
        out: &mut CudaViewMut<O>,
        x: &CudaView<I>,
    ) -> Result<(), CudaError> {
        if x.len() != out.len() {
            return Err(CudaError::Invalid(format!(
                "{kernel}: {} values into {}",
                x.len(),
                out.len()
            )));
        }
        if x.is_empty() {
            return Ok(());
        }
        let (n, fmt) = (x.len() as u64, h.code());
        let mut launch = self.stream.launch_builder(self.function(kernel));
        launch.arg(&mut *out).arg(x).arg(&n).arg(&fmt);
        // SAFETY: add_into16(acc u16, x f32, n, fmt), widen16_into(out f32,
        // x u16, n, fmt) and round16_into(out u16, x f32, n, fmt): the
        // callers give each its types; both hold n values (checked above).
        self.launched(kernel, unsafe { launch.launch(grid_stride(x.len())) })?;
        Ok(())
    }

    /// The sums of squares of `x·scale` over chunks of `chunk` values (a
    /// multiple of 8) of each `x` of `xs`, each chunk added as zengine's CPU
    /// gradient norm adds one (eight f64 lanes, then the tail; 16-bit
    /// values widened first: the same bits), launched one after another
    /// and brought back in one download: the host waits for the GPU once,
    /// not once a buffer (a step's gradient norm over 14 groups spent ~60
    /// µs a group in those waits on an H200).
    pub fn sum_sq_chunks_of_each(
        &self,
        xs: &[DeviceGrads<'_>],
        chunk: usize,
        scale: f32,
    ) -> Result<Vec<Vec<f64>>, CudaError> {
        if chunk == 0 || !chunk.is_multiple_of(8) {
            return Err(CudaError::Invalid(format!(
                "sum_sq_chunks: chunks of {chunk} (a multiple of 8 is needed)"
            )));
        }
        let counts: Vec<usize> = xs.iter().map(|x| x.len().div_ceil(chunk)).collect();
        let total: usize = counts.iter().sum();
        if total == 0 {
            return Ok(vec![Vec::new(); xs.len()]);
        }
        let mut out = self.zeros::<f64>(total)?;
        let mut at = 0;
        for (x, &chunks) in xs.iter().zip(&counts) {
            if chunks == 0 {
                continue;
            }
            let mut sums = out.slice_mut(at..at + chunks);
            at += chunks;
            let (n, c, fmt) = (x.len() as u64, chunk as u64, x.code());
            let mut launch = self.stream.launch_builder(self.function("sum_sq_chunks"));
            match x {
                DeviceGrads::F32(x) => launch.arg(x),
                DeviceGrads::Half(_, x) => launch.arg(x),
            };
            launch.arg(&n).arg(&c).arg(&scale).arg(&mut sums).arg(&fmt);
            let cfg = LaunchConfig {
                grid_dim: (chunks as u32, 1, 1),
                block_dim: (SUM_SQ_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: sum_sq_chunks(x[n] in format fmt, n, chunk, scale,
            // out[chunks], fmt): a block of 256 threads per chunk (grid =
            // chunks), every thread reaching each barrier and the first warp
            // the shuffle, block c's thread 0 writing out[c] (the view
            // holds `chunks` values).
            self.launched("sum_sq_chunks", unsafe { launch.launch(cfg) })?;
        }
        let all = self.download(&out)?;
        let mut rest = all.as_slice();
        Ok(counts
            .iter()
            .map(|&c| {
                let (mine, after) = rest.split_at(c);
                rest = after;
                mine.to_vec()
            })
            .collect())
    }

    /// Copies `src` into `dst` (the same length) on the stream.
    pub fn copy<T: DeviceRepr>(
        &self,
        src: &CudaView<T>,
        dst: &mut CudaViewMut<T>,
    ) -> Result<(), CudaError> {
        if src.len() != dst.len() {
            return Err(CudaError::Invalid(format!(
                "copy: {} values into {}",
                src.len(),
                dst.len()
            )));
        }
        self.stream
            .memcpy_dtod(src, dst)
            .map_err(|source| CudaError::Driver {
                what: format!("copying {} values on the GPU", src.len()),
                source,
            })?;
        self.mark(|| "copy on the GPU".into())
    }

    /// Sets every value of `x` to zero.
    pub fn fill_zero<T: DeviceRepr + cudarc::driver::ValidAsZeroBits, D: DevicePtrMut<T>>(
        &self,
        x: &mut D,
    ) -> Result<(), CudaError> {
        self.stream
            .memset_zeros(x)
            .map_err(|source| CudaError::Driver {
                what: "zeroing a device buffer".into(),
                source,
            })?;
        self.mark(|| "zeroing".into())
    }
}

impl DeviceQuantized {
    /// Copies the quantized values to the host, in the CPU's type (for the
    /// wire, and for comparing with the CPU quantizer).
    pub fn to_host(&self, gpu: &Gpu) -> Result<Quantized, CudaError> {
        Ok(Quantized {
            bits: self.bits,
            block_size: self.block_size,
            len: self.len,
            scales: gpu.download(&self.scales)?,
            data: gpu.download(&self.data)?,
        })
    }
}

pub(crate) fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).min(MAX_BLOCKS as usize) as u32;
    LaunchConfig {
        grid_dim: (blocks.max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}
