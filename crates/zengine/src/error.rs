//! Why a step, a load or a build of the engine failed. Every variant carries
//! the step, parameter or file it is about, so the worker can report it as is.

use std::path::PathBuf;

use zcomm::CommError;

/// Why the engine failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The GPU failed (a CUDA call, a kernel launch, a shape the GPU model
    /// does not take).
    #[error("GPU: {0}")]
    Gpu(String),
    /// The GPU had no room for an allocation (what, and the GPU's free and
    /// total memory).
    #[error("GPU: {0}")]
    GpuOutOfMemory(String),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// candle failed (shape bugs, allocation).
    #[error("model: {0}")]
    Model(candle_core::Error),
    /// NVMe offload: a swap file could not be set up, read or written.
    #[error(transparent)]
    Swap(#[from] zswap::SwapError),
    /// ZeRO++ quantization refused a value (a NaN or infinite weight) or got
    /// damaged data.
    #[error("qwZ: {0}")]
    Quantize(#[from] zquant::QuantError),
    /// A checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] zckpt::CkptError),
    /// The loss or gradients stopped being finite.
    #[error("step {step}: {what} is not finite ({value})")]
    NonFinite {
        /// Step.
        step: u64,
        /// Loss or gradient norm.
        what: &'static str,
        /// The value.
        value: f64,
    },
    /// `forward_backward` was called more often than `train.grad_accum` allows
    /// before `step`.
    #[error("engine: more than grad_accum = {accum} micro-batches before step()")]
    TooManyMicroBatches {
        /// `train.grad_accum`.
        accum: usize,
    },
    /// `step` was called before every micro-batch of the step ran.
    #[error("engine: step after {done} of {accum} micro-batches")]
    StepTooEarly {
        /// Micro-batches run.
        done: usize,
        /// `train.grad_accum`.
        accum: usize,
    },
    /// Backward produced no gradient for a parameter (a model bug).
    #[error("engine: backward produced no gradient for {param}")]
    MissingGradient {
        /// The parameter (or tensor) without a gradient.
        param: String,
    },
    /// A gradient whose size or type does not fit its parameter (a model bug).
    #[error("engine: gradient for {param}: {problem}")]
    BadGradient {
        /// The parameter.
        param: String,
        /// What is wrong with it.
        problem: String,
    },
    /// `model.tile_size` does not fit the model.
    #[error("model.tile_size: {problem}")]
    Tiling {
        /// What does not fit.
        problem: String,
    },
    /// A checkpoint of another model.
    #[error("{}: the checkpoint's parameter layout differs from the model's", dir.display())]
    LayoutMismatch {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// Process groups that do not fit the job (hpZ's group missing or of the
    /// wrong size).
    #[error("engine: {problem}")]
    ProcessGroups {
        /// What does not fit.
        problem: String,
    },
    /// `model.init_from` weights that do not fit the model.
    #[error("model.init_from: {problem}")]
    InitWeights {
        /// What does not fit.
        problem: String,
    },
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> EngineError {
        EngineError::Model(e)
    }
}
