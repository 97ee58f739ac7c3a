//! `device: cuda`: the micro-batch's forward and backward on a GPU
//! ([`zcuda::GptGpu`]), everything else as on the CPU.
//!
//! The engine's flat buffers, their partition over ranks, the gathers, the
//! gradient buckets and AdamW stay on the host. A group's parameters come
//! from `Engine::params_for` exactly as the CPU path takes them (gathered
//! at stage 3), go up to the GPU for that group's forward or backward, and
//! its gradients come down into the group's micro-batch buffer as soon as
//! they exist, which hands the bucket to the reduction pipeline as on the
//! CPU: ZeRO-Offload's data flow (optimizer state and Adam on the host), with
//! every stage computing the same values on the GPU, so stages 0-3 stay
//! bit-identical to each other there too. Activations stay on the GPU from a
//! block's forward to its backward (with activation checkpointing, only the
//! block's input, and the backward recomputes the rest).
//!
//! The embedding's backward (a scatter-add of `dx` rows into `wte`) runs on
//! the host from the downloaded `dx`, in row order: deterministic without
//! atomics, and small (`b·t·d` floats).

use std::sync::Arc;

use candle_core::{CpuStorage, Device, Storage, Tensor, TensorId};
use zcuda::{BlockActs, GptGpu, GptShape, Rows, Weights};
use zmodel::Batch;

use crate::engine::Engine;
use crate::error::EngineError;
use crate::gather::Prefetcher;
use crate::micro_batch::MicroBatch;

impl From<zcuda::CudaError> for EngineError {
    fn from(e: zcuda::CudaError) -> EngineError {
        EngineError::Gpu(e.to_string())
    }
}

/// What a block keeps on the GPU between its forward and backward.
enum Saved {
    Acts(Box<BlockActs>),
    Input(Rows),
}

/// The shape of the job's model for the GPU, or why the GPU path cannot run
/// it ([`zconfig::spec::JobSpec::gpu_unsupported`]).
pub fn gpu_shape(spec: &zconfig::spec::JobSpec) -> Result<GptShape, String> {
    if let Some(why) = spec.gpu_unsupported() {
        return Err(why);
    }
    let m = &spec.model;
    Ok(GptShape {
        d_model: m.d_model,
        n_heads: m.n_heads,
        vocab: m.vocab_size,
        seq_len: m.seq_len,
        eps: m.norm_eps() as f32,
    })
}

fn grad_tensors(grads: Vec<Vec<f32>>) -> Result<Vec<Tensor>, EngineError> {
    grads
        .into_iter()
        .map(|g| {
            let n = g.len();
            Ok(Tensor::from_vec(g, n, &Device::Cpu)?)
        })
        .collect()
}

/// Uploads `tensors` (f32 on the CPU) read in place from their storage.
fn upload(gpu: &GptGpu, tensors: &[Tensor]) -> Result<Weights, EngineError> {
    let bad = || EngineError::Gpu("a parameter is not contiguous f32 on the CPU".into());
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let slices = guards
        .iter()
        .map(
            |(storage, layout)| match (&**storage, layout.contiguous_offsets()) {
                (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(&v[a..b]),
                _ => Err(bad()),
            },
        )
        .collect::<Result<Vec<&[f32]>, _>>()?;
    Ok(gpu.upload(&slices)?)
}

/// A group's parameters on the GPU, with the tensor they were uploaded from
/// (its id says whether the engine's parameters are still those).
pub(crate) struct DeviceCopy {
    from: TensorId,
    weights: Arc<Weights>,
}

impl Engine {
    /// Runs this engine's forward and backward on `gpu` from now on.
    pub fn attach_gpu(&mut self, gpu: GptGpu) {
        self.gpu = Some(Arc::new(gpu));
        self.gpu_copies = (0..self.groups.len()).map(|_| None).collect();
    }

    /// The GPU the micro-batches run on, if any.
    pub fn gpu(&self) -> Option<&GptGpu> {
        self.gpu.as_deref()
    }

    /// Group `g`'s parameters on the GPU. Where the engine keeps the group
    /// whole (stages 0-2) its device copy lasts until the parameters change
    /// (an update, a load): its tensors are then rebuilt, with new ids, and
    /// the next use uploads again; so forward and backward, and every
    /// micro-batch of a step, upload a group once. Stage 3's gathered
    /// groups are uploaded at each use, as they are gathered at each use.
    fn gpu_weights(
        &mut self,
        gpu: &GptGpu,
        gather: &mut Prefetcher,
        g: usize,
    ) -> Result<Arc<Weights>, EngineError> {
        let tensors = self.params_for(g, gather)?;
        let id = tensors.first().map(|t| t.id());
        if let (Some(copy), Some(id)) = (&self.gpu_copies[g], id) {
            if copy.from == id {
                return Ok(copy.weights.clone());
            }
        }
        let weights = Arc::new(upload(gpu, &tensors)?);
        self.gpu_copies[g] = match (self.groups[g].partitioned, id) {
            (false, Some(from)) => Some(DeviceCopy {
                from,
                weights: weights.clone(),
            }),
            _ => None,
        };
        Ok(weights)
    }

    /// The embedding on the GPU: `[b, t, d]` rows.
    fn gpu_embed(
        &mut self,
        gpu: &GptGpu,
        gather: &mut Prefetcher,
        batch: &Batch,
    ) -> Result<Rows, EngineError> {
        let w = self.gpu_weights(gpu, gather, 0)?;
        let x = gpu.embed(&batch.inputs, batch.rows, batch.seq_len, &w)?;
        self.release(0);
        Ok(x)
    }

    /// The head's parameters, and the embedding's when the head is tied to
    /// it (released, as their gathers, by [`Engine::gpu_release_head`]).
    fn gpu_head_weights(
        &mut self,
        gpu: &GptGpu,
        gather: &mut Prefetcher,
    ) -> Result<(Arc<Weights>, Option<Arc<Weights>>), EngineError> {
        let head = self.model.config().n_layers + 1;
        let w = self.gpu_weights(gpu, gather, head)?;
        let tied = self.groups[head].layout.params.len() == 2;
        let wte = match tied {
            true => Some(self.gpu_weights(gpu, gather, 0)?),
            false => None,
        };
        Ok((w, wte))
    }

    fn gpu_release_head(&mut self, tied: bool) {
        self.release(self.model.config().n_layers + 1);
        if tied {
            self.release(0);
        }
    }

    /// One micro-batch's forward and backward on the GPU; its mean loss.
    pub(crate) fn gpu_forward_backward(
        &mut self,
        mb: &mut MicroBatch,
        batch: &Batch,
    ) -> Result<f64, EngineError> {
        let gpu = self.gpu.clone().expect("a GPU attached");
        let (gather, reduce_now) = (&mut mb.gather, mb.reduce_now);
        let n_layers = self.model.config().n_layers;
        let checkpointing = self.spec.train.activation_checkpointing;
        let mut x = self.gpu_embed(&gpu, gather, batch)?;
        let mut saved = Vec::with_capacity(n_layers);
        for block in 1..=n_layers {
            let w = self.gpu_weights(&gpu, gather, block)?;
            self.release(block);
            let (y, acts) = gpu.block_forward(&w, x)?;
            saved.push(match checkpointing {
                true => Saved::Input(acts.into_input()),
                false => Saved::Acts(Box::new(acts)),
            });
            x = y;
        }

        let head = n_layers + 1;
        let (hw, wte) = self.gpu_head_weights(&gpu, gather)?;
        let tied = wte.is_some();
        let scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        let res = gpu.head(&x, &hw, wte.as_deref(), &batch.targets, scale, true)?;
        drop((x, hw, wte));
        if !res.loss.is_finite() {
            return Err(EngineError::NonFinite {
                step: self.step + 1,
                what: "loss",
                value: res.loss,
            });
        }
        let [dw, db, dout] = res.grads.expect("the head's backward ran");
        let mut grads = vec![dw, db];
        if !tied {
            grads.push(dout.clone());
        }
        self.accumulate_tensors(head, &grad_tensors(grads)?.iter().collect::<Vec<_>>())?;
        if tied {
            let wte_range = self.groups[0].layout.params[0].range.clone();
            let n = dout.len();
            let dout = Tensor::from_vec(dout, n, &Device::Cpu)?;
            self.add_grad_to(0, wte_range, &dout, "wte (tied head)")?;
        }
        self.gpu_release_head(tied);
        if reduce_now {
            self.group_done(head)?;
        }

        let mut dx = res.dx.expect("the head's backward ran");
        let gather = &mut mb.gather;
        for block in (1..=n_layers).rev() {
            let w = self.gpu_weights(&gpu, gather, block)?;
            let acts = match saved.pop() {
                Some(Saved::Acts(acts)) => *acts,
                Some(Saved::Input(x)) => gpu.block_forward(&w, x)?.1,
                None => return Err(EngineError::Gpu(format!("block {block}: nothing saved"))),
            };
            let (grads, next) = gpu.block_backward(&w, &acts, &dx)?;
            drop((acts, w));
            self.accumulate_tensors(block, &grad_tensors(grads)?.iter().collect::<Vec<_>>())?;
            self.release(block);
            if reduce_now {
                self.group_done(block)?;
            }
            dx = next;
        }
        let (b, t) = dx.dims();
        let d = self.spec.model.d_model;
        let dx = Tensor::from_vec(gpu.download(&dx)?, (b, t, d), &Device::Cpu)?;
        self.backward_embedding(mb, &dx)?;
        Ok(res.loss)
    }

    /// One batch's loss on the GPU, forward only.
    pub(crate) fn gpu_forward_loss(
        &mut self,
        gather: &mut Prefetcher,
        batch: &Batch,
    ) -> Result<f64, EngineError> {
        let gpu = self.gpu.clone().expect("a GPU attached");
        let mut x = self.gpu_embed(&gpu, gather, batch)?;
        for block in 1..=self.model.config().n_layers {
            let w = self.gpu_weights(&gpu, gather, block)?;
            self.release(block);
            x = gpu.block_forward(&w, x)?.0;
        }
        let (hw, wte) = self.gpu_head_weights(&gpu, gather)?;
        let tied = wte.is_some();
        let loss = gpu
            .head(&x, &hw, wte.as_deref(), &batch.targets, 1.0, false)?
            .loss;
        self.gpu_release_head(tied);
        Ok(loss)
    }
}
