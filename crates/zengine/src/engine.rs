//! The training step.
//!
//! `forward_backward` runs one micro-batch: forward block by block, each block's
//! input a fresh candle `Var` so that backward can also run block by block, last
//! to first (`(y · dy).sum().backward()` yields the block's parameter gradients and
//! `dx`). On the last micro-batch of a step, each bucket of gradients is handed to
//! the communicator as soon as its blocks' backward is done, and backward carries
//! on while it is reduced (overlap). `step` waits for the buckets, averages,
//! clips by the global norm, runs AdamW, and returns the step's accounting.
//!
//! Stage 0 keeps everything whole on every rank; the global gradient norm is
//! still computed from each rank's owned slices added in rank order, so later
//! stages can produce the same bits.

use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use zcomm::{CommError, Communicator, CounterSnapshot, Op, Work};
use zconfig::JobSpec;
use zmodel::{Batch, Gpt, GptConfig};
use zproto::{CommBytes, MemBytes, OpBytes};

use crate::adam::{adamw, AdamStep};
use crate::flat::{Bucket, GroupLayout};
use crate::schedule::lr_at;

/// Why a step failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// candle failed (shape bugs, allocation).
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
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
    /// A call out of order.
    #[error("engine: {0}")]
    Usage(String),
}

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    /// 1-based step.
    pub step: u64,
    /// Mean loss over this rank's micro-batches.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens this rank trained on.
    pub tokens: u64,
    /// Memory by category at the end of the step (activations and buffers: peak).
    pub mem: MemBytes,
    /// Bytes this rank sent during the step.
    pub comm: CommBytes,
}

/// Optimizer hyper-parameters that SPEC.md does not expose (DeepSpeed's defaults).
const BETA1: f32 = 0.9;
const BETA2: f32 = 0.999;
const EPS: f32 = 1e-8;

/// ZeRO data-parallel training of one model replica on one rank.
pub struct Engine {
    model: Gpt,
    comm: Arc<dyn Communicator>,
    spec: JobSpec,
    layouts: Vec<GroupLayout>,
    buckets: Vec<Bucket>,
    params: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
    exp_avg: Vec<Vec<f32>>,
    exp_avg_sq: Vec<Vec<f32>>,
    /// Parameter tensors for the current step (rebuilt after each update).
    vars: Option<Vec<Vec<Var>>>,
    step: u64,
    micro: usize,
    loss_sum: f64,
    tokens: u64,
    pending: Vec<(usize, Work<Vec<f32>>)>,
    in_flight_bytes: u64,
    peak_comm_buffers: u64,
    peak_activations: u64,
    counters_at_start: Option<CounterSnapshot>,
}

impl Engine {
    /// Builds the model of `spec` with seeded parameters and empty optimizer state.
    pub fn new(spec: &JobSpec, comm: Arc<dyn Communicator>) -> Result<Engine, EngineError> {
        if spec.zero.stage != 0 {
            return Err(EngineError::Usage(format!(
                "ZeRO stage {} is not supported yet",
                spec.zero.stage
            )));
        }
        let m = &spec.model;
        let model = Gpt::new(GptConfig {
            vocab_size: m.vocab_size,
            d_model: m.d_model,
            n_layers: m.n_layers,
            n_heads: m.n_heads,
            seq_len: m.seq_len,
        })?;
        let world = comm.world_size();
        let layouts: Vec<GroupLayout> = model
            .groups()
            .iter()
            .map(|g| GroupLayout::new(g, world))
            .collect();
        let buckets = Bucket::plan(&layouts, spec.zero.reduce_bucket_size.0.max(1) as usize);
        let mut params = Vec::with_capacity(layouts.len());
        for (g, l) in layouts.iter().enumerate() {
            let mut flat = vec![0f32; l.padded];
            for (slot, values) in l.params.iter().zip(model.init_group(g, spec.train.seed)) {
                flat[slot.range.clone()].copy_from_slice(&values);
            }
            params.push(flat);
        }
        let zeros = || {
            layouts
                .iter()
                .map(|l| vec![0f32; l.padded])
                .collect::<Vec<_>>()
        };
        Ok(Engine {
            grads: zeros(),
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            model,
            comm,
            spec: spec.clone(),
            layouts,
            buckets,
            params,
            vars: None,
            step: 0,
            micro: 0,
            loss_sum: 0.0,
            tokens: 0,
            pending: Vec::new(),
            in_flight_bytes: 0,
            peak_comm_buffers: 0,
            peak_activations: 0,
            counters_at_start: None,
        })
    }

    /// The model.
    pub fn model(&self) -> &Gpt {
        &self.model
    }

    /// Optimizer steps taken.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The full parameters of every group (unpadded), as this rank sees them.
    pub fn full_params(&self) -> Vec<Vec<f32>> {
        self.params
            .iter()
            .zip(&self.layouts)
            .map(|(p, l)| p[..l.numel].to_vec())
            .collect()
    }

    fn vars(&mut self) -> Result<&Vec<Vec<Var>>, EngineError> {
        if self.vars.is_none() {
            let mut all = Vec::with_capacity(self.layouts.len());
            for (l, flat) in self.layouts.iter().zip(&self.params) {
                let mut g = Vec::with_capacity(l.params.len());
                for slot in &l.params {
                    g.push(Var::from_slice(
                        &flat[slot.range.clone()],
                        slot.shape.as_slice(),
                        &Device::Cpu,
                    )?);
                }
                all.push(g);
            }
            self.vars = Some(all);
        }
        Ok(self.vars.as_ref().expect("built above"))
    }

    /// Runs forward and backward of one micro-batch and accumulates its gradients.
    /// Returns the micro-batch's mean loss.
    pub fn forward_backward(&mut self, batch: &Batch) -> Result<f64, EngineError> {
        if self.micro == 0 {
            self.counters_at_start = Some(self.comm.counters());
        }
        let last_micro = self.micro + 1 == self.spec.train.grad_accum;
        let (rows, t) = (batch.rows, batch.seq_len);
        let tokens = Tensor::from_slice(&batch.inputs, (rows, t), &Device::Cpu)?;
        let targets = Tensor::from_slice(&batch.targets, (rows, t), &Device::Cpu)?;
        let n_layers = self.model.config().n_layers;
        let head = n_layers + 1;
        let vars = self.vars()?.clone();
        let tensors =
            |g: usize| -> Vec<Tensor> { vars[g].iter().map(|v| v.as_tensor().clone()).collect() };

        // Forward, keeping each block's input Var and output.
        let y0 = self.model.embed(&tensors(0), &tokens)?;
        let mut saved: Vec<(Var, Tensor)> = Vec::with_capacity(n_layers);
        let mut x = y0.detach();
        for b in 1..=n_layers {
            let input = Var::from_tensor(&x)?;
            let y = self.model.block(&tensors(b), input.as_tensor())?;
            x = y.detach();
            saved.push((input, y));
        }
        let head_in = Var::from_tensor(&x)?;
        let loss = self.model.head_loss(
            &tensors(head),
            vars[0][0].as_tensor(),
            head_in.as_tensor(),
            &targets,
        )?;
        let loss_value = f64::from(loss.to_scalar::<f32>()?);
        if !loss_value.is_finite() {
            return Err(EngineError::NonFinite {
                step: self.step + 1,
                what: "loss",
                value: loss_value,
            });
        }
        self.peak_activations = self.peak_activations.max(
            n_layers as u64 * self.model.block_activation_bytes(rows, t)
                + self.model.head_activation_bytes(rows, t),
        );

        // Backward, last block first; buckets leave as soon as their groups are done.
        let grads = loss.backward()?;
        self.accumulate(head, &vars[head], &grads)?;
        let wte_grad = grads
            .get(vars[0][0].as_tensor())
            .ok_or_else(|| EngineError::Usage("the tied head produced no wte gradient".into()))?;
        add_into(
            &mut self.grads[0][self.layouts[0].params[0].range.clone()],
            wte_grad,
        )?;
        let mut dx = grads
            .get(head_in.as_tensor())
            .cloned()
            .ok_or_else(|| missing("head input"))?;
        drop(grads);
        if last_micro {
            self.group_done(head)?;
        }
        for b in (1..=n_layers).rev() {
            let (input, y) = saved.pop().expect("one saved pair per block");
            let grads = (y * &dx)?.sum_all()?.backward()?;
            self.accumulate(b, &vars[b], &grads)?;
            dx = grads
                .get(input.as_tensor())
                .cloned()
                .ok_or_else(|| missing("block input"))?;
            if last_micro {
                self.group_done(b)?;
            }
        }
        let grads = (y0 * &dx)?.sum_all()?.backward()?;
        self.accumulate(0, &vars[0], &grads)?;
        if last_micro {
            self.group_done(0)?;
        }

        self.loss_sum += loss_value;
        self.tokens += (rows * t) as u64;
        self.micro += 1;
        Ok(loss_value)
    }

    /// Adds a block's parameter gradients into its flat gradient buffer.
    fn accumulate(
        &mut self,
        g: usize,
        vars: &[Var],
        grads: &candle_core::backprop::GradStore,
    ) -> Result<(), EngineError> {
        for (slot, var) in self.layouts[g].params.iter().zip(vars) {
            let grad = grads
                .get(var.as_tensor())
                .ok_or_else(|| missing(&slot.name))?;
            add_into(&mut self.grads[g][slot.range.clone()], grad)?;
        }
        Ok(())
    }

    /// Called when backward has finished with group `g` on the last micro-batch:
    /// launches the reduction of every bucket whose groups are all done.
    fn group_done(&mut self, g: usize) -> Result<(), EngineError> {
        let Some(bi) = self
            .buckets
            .iter()
            .position(|b| b.groups.last() == Some(&g))
        else {
            return Ok(()); // more groups of this bucket are still to come
        };
        let world = self.comm.world_size();
        let packed = self.buckets[bi].pack(&self.layouts, &self.grads, world);
        let bytes = (packed.len() * 4) as u64;
        self.in_flight_bytes += bytes;
        self.peak_comm_buffers = self.peak_comm_buffers.max(self.in_flight_bytes);
        let work = self.comm.all_reduce_async(packed);
        if self.spec.zero.overlap_comm {
            self.pending.push((bi, work));
        } else {
            let reduced = work.wait()?;
            self.finish_bucket(bi, reduced);
        }
        Ok(())
    }

    fn finish_bucket(&mut self, bi: usize, reduced: Vec<f32>) {
        self.in_flight_bytes -= (reduced.len() * 4) as u64;
        let world = self.comm.world_size();
        self.buckets[bi].unpack(&self.layouts, &reduced, &mut self.grads, world);
    }

    /// Finishes the optimizer step after `grad_accum` micro-batches.
    pub fn step(&mut self) -> Result<StepStats, EngineError> {
        let accum = self.spec.train.grad_accum;
        if self.micro != accum {
            return Err(EngineError::Usage(format!(
                "step after {} of {accum} micro-batches",
                self.micro
            )));
        }
        for (bi, work) in std::mem::take(&mut self.pending) {
            let reduced = work.wait()?;
            self.finish_bucket(bi, reduced);
        }
        let world = self.comm.world_size();
        let rank = self.comm.rank();
        let step = self.step + 1;
        let scale = 1.0 / (world * accum) as f32;
        for g in &mut self.grads {
            g.iter_mut().for_each(|x| *x *= scale);
        }

        // Global norm: each rank's owned slices, added across ranks in rank order.
        let own_sq: f64 = self
            .layouts
            .iter()
            .zip(&self.grads)
            .map(|(l, g)| {
                g[l.slice(rank)]
                    .iter()
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum::<f64>()
            })
            .sum();
        let hi = own_sq as f32;
        let lo = (own_sq - f64::from(hi)) as f32;
        let parts = self.comm.all_gather(vec![hi, lo], 2 * world)?;
        let total_sq: f64 = parts
            .chunks(2)
            .map(|p| f64::from(p[0]) + f64::from(p[1]))
            .sum();
        let grad_norm = total_sq.sqrt();
        if !grad_norm.is_finite() {
            return Err(EngineError::NonFinite {
                step,
                what: "gradient norm",
                value: grad_norm,
            });
        }
        let clip = self.spec.train.grad_clip;
        if clip > 0.0 && grad_norm > clip {
            let coef = (clip / (grad_norm + 1e-6)) as f32;
            for g in &mut self.grads {
                g.iter_mut().for_each(|x| *x *= coef);
            }
        }

        let t = &self.spec.train;
        let lr = lr_at(step, t.steps, t.lr, t.warmup_steps, t.schedule);
        let hp = AdamStep {
            lr: lr as f32,
            beta1: BETA1,
            beta2: BETA2,
            eps: EPS,
            weight_decay: t.weight_decay as f32,
            step,
        };
        for (g, l) in self.layouts.iter().enumerate() {
            for (r, decay) in l.decay_runs(0..l.padded) {
                adamw(
                    &mut self.params[g][r.clone()],
                    &self.grads[g][r.clone()],
                    &mut self.exp_avg[g][r.clone()],
                    &mut self.exp_avg_sq[g][r.clone()],
                    decay,
                    &hp,
                );
            }
        }
        for g in &mut self.grads {
            g.iter_mut().for_each(|x| *x = 0.0);
        }
        self.vars = None;

        let counters = self.comm.counters();
        let comm = comm_bytes(&counters.since(&self.counters_at_start.take().unwrap_or(counters)));
        let f32_bytes =
            |bufs: &Vec<Vec<f32>>| bufs.iter().map(|b| (b.len() * 4) as u64).sum::<u64>();
        let mem = MemBytes {
            params: f32_bytes(&self.params),
            grads: f32_bytes(&self.grads),
            master: 0,
            optimizer: f32_bytes(&self.exp_avg) + f32_bytes(&self.exp_avg_sq),
            activations: self.peak_activations,
            comm_buffers: self.peak_comm_buffers,
            offload_buffers: 0,
            peak_rss: peak_rss_bytes(),
        };
        let stats = StepStats {
            step,
            loss: self.loss_sum / accum as f64,
            lr,
            grad_norm,
            tokens: self.tokens,
            mem,
            comm,
        };
        self.step = step;
        self.micro = 0;
        self.loss_sum = 0.0;
        self.tokens = 0;
        self.peak_comm_buffers = 0;
        self.peak_activations = 0;
        Ok(stats)
    }
}

fn missing(what: &str) -> EngineError {
    EngineError::Usage(format!("backward produced no gradient for {what}"))
}

fn add_into(dst: &mut [f32], grad: &Tensor) -> Result<(), EngineError> {
    let flat = grad.flatten_all()?;
    let v = flat.to_vec1::<f32>()?;
    if v.len() != dst.len() {
        return Err(EngineError::Usage(format!(
            "gradient of {} elements for a slot of {}",
            v.len(),
            dst.len()
        )));
    }
    dst.iter_mut().zip(&v).for_each(|(d, s)| *d += *s);
    Ok(())
}

fn comm_bytes(d: &CounterSnapshot) -> CommBytes {
    CommBytes {
        intra_node: d.intra_node,
        inter_node: d.inter_node,
        by_op: OpBytes {
            all_reduce: d.op(Op::AllReduce),
            reduce_scatter: d.op(Op::ReduceScatter),
            all_gather: d.op(Op::AllGather),
            all_to_all: d.op(Op::AllToAll),
            broadcast: d.op(Op::Broadcast),
        },
    }
}

/// Peak resident set size of this process (Linux `VmHWM`), 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}
