//! Memory estimates: ZeRO's model-state formulas, offload variants, and the
//! activations of a job's micro-batch.
//!
//! Model states per device, with p / g bytes per parameter and gradient and K
//! bytes of optimizer state per parameter, Ψ parameters and N data-parallel
//! ranks (the ZeRO paper, section 5):
//!
//! | stage | bytes per device |
//! |---|---|
//! | 0 | (p + g + K)Ψ |
//! | 1 | (p + g)Ψ + KΨ/N |
//! | 2 | pΨ + (g + K)Ψ/N |
//! | 3 | (p + g + K)Ψ/N |
//!
//! Mixed precision is p = g = 2, K = 12 (f32 master, m, v): Table 1 of the paper.
//! zrun's f32 training keeps no separate master copy: p = g = 4, K = 8.
//! Lion keeps one moment instead of two, Adagrad one sum of squares: K is 4
//! less (8 mixed, 4 in f32).
//! Offload rows move the optimizer state (ZeRO-Offload) and, at stage 3, the
//! parameters too (ZeRO-Infinity) to host memory or NVMe; what must stay on the
//! device is then the largest layer, which has to be whole while it computes.

use serde::Serialize;

use crate::spec::{Device, Dtype, JobSpec, ModelSpec, OptimizerKind, ZeroStage};

/// Bytes per parameter of each kind of model state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StateBytes {
    /// Working parameters.
    pub param: f64,
    /// Gradients.
    pub grad: f64,
    /// Optimizer state (and master weights).
    pub optimizer: f64,
}

impl StateBytes {
    /// For a training dtype with AdamW: f32 (4, 4, 8) or mixed precision
    /// (2, 2, 12).
    pub fn for_dtype(d: Dtype) -> StateBytes {
        StateBytes::for_training(d, OptimizerKind::Adamw)
    }

    /// For a training dtype and update rule: AdamW's two moments are 8 bytes
    /// per parameter, Lion's one (and Adagrad's sum) 4; mixed precision adds
    /// the f32 master copy's 4 (Lion in bf16: 2, 2, 8).
    pub fn for_training(d: Dtype, rule: OptimizerKind) -> StateBytes {
        let moments = match rule.second_moment() {
            true => 8.0,
            false => 4.0,
        };
        match d {
            Dtype::F32 => StateBytes {
                param: 4.0,
                grad: 4.0,
                optimizer: moments,
            },
            Dtype::Bf16 | Dtype::F16 => StateBytes {
                param: 2.0,
                grad: 2.0,
                optimizer: moments + 4.0,
            },
        }
    }

    /// A job's: its dtype and its optimizer's rule, and 4 bytes of
    /// gradient where `train.grad_accum_dtype: f32` holds them in f32.
    pub fn for_job(spec: &JobSpec) -> StateBytes {
        let t = &spec.train;
        let bytes = StateBytes::for_training(t.dtype, t.optimizer.kind);
        match t.grads_dtype() {
            Dtype::F32 => StateBytes { grad: 4.0, ..bytes },
            _ => bytes,
        }
    }
}

/// One configuration's memory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// ZeRO stage.
    pub stage: ZeroStage,
    /// `none`, `optimizer:cpu`, `optimizer:nvme`, `optimizer+param:cpu`, `optimizer+param:nvme`.
    pub offload: &'static str,
    /// Model states on each device.
    pub bytes_per_device: f64,
    /// Model states in host memory, per node.
    pub host_bytes_per_node: f64,
    /// Model states on NVMe, per node.
    pub nvme_bytes_per_node: f64,
}

/// Model-state memory of every stage and offload variant.
pub fn model_state_rows(
    psi: f64,
    nodes: usize,
    workers_per_node: usize,
    b: StateBytes,
    largest_layer: f64,
) -> Vec<Row> {
    let n = (nodes * workers_per_node) as f64;
    let w = workers_per_node as f64;
    let StateBytes {
        param: p,
        grad: g,
        optimizer: k,
    } = b;
    // Each kind of state costs its bytes per element on every device, or 1/N
    // of that where the stage partitions it.
    let device = |stage: ZeroStage| {
        let share = |partitioned: bool, bytes: f64| {
            if partitioned {
                bytes * psi / n
            } else {
                bytes * psi
            }
        };
        share(stage.partitions_parameters(), p)
            + share(stage.partitions_gradients(), g)
            + share(stage.partitions_optimizer(), k)
    };
    let mut rows: Vec<Row> = ZeroStage::ALL
        .into_iter()
        .map(|s| Row {
            stage: s,
            offload: "none",
            bytes_per_device: device(s),
            host_bytes_per_node: 0.0,
            nvme_bytes_per_node: 0.0,
        })
        .collect();
    for s in ZeroStage::ALL
        .into_iter()
        .filter(|s| s.partitions_optimizer())
    {
        let on_device = device(s) - k * psi / n;
        let off = k * psi / n * w;
        rows.push(Row {
            stage: s,
            offload: "optimizer:cpu",
            bytes_per_device: on_device,
            host_bytes_per_node: off,
            nvme_bytes_per_node: 0.0,
        });
        rows.push(Row {
            stage: s,
            offload: "optimizer:nvme",
            bytes_per_device: on_device,
            host_bytes_per_node: 0.0,
            nvme_bytes_per_node: off,
        });
    }
    let layer = p * largest_layer;
    let all = (p + g + k) * psi / n * w;
    rows.push(Row {
        stage: ZeroStage::Weights,
        offload: "optimizer+param:cpu",
        bytes_per_device: layer,
        host_bytes_per_node: all,
        nvme_bytes_per_node: 0.0,
    });
    // ZeRO-Infinity keeps gradients in host memory and the rest on NVMe.
    let grads = g * psi / n * w;
    rows.push(Row {
        stage: ZeroStage::Weights,
        offload: "optimizer+param:nvme",
        bytes_per_device: layer,
        host_bytes_per_node: grads,
        nvme_bytes_per_node: all - grads,
    });
    rows
}

/// One CPU worker's model states: what stays in memory and what its swap
/// files hold (NVMe offload).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WorkerStates {
    /// Bytes in memory: parameters, gradients and optimizer state not
    /// offloaded, plus (parameter offload) about two gathered blocks.
    pub memory: f64,
    /// Bytes of swap files.
    pub nvme: f64,
}

/// `spec`'s model states on one of `world` CPU workers, with its offload
/// settings (on CPU workers `device: cpu` keeps states where they are).
pub fn worker_states(spec: &JobSpec, world: usize) -> WorkerStates {
    let psi = model_params(&spec.model);
    let n = world.max(1) as f64;
    let b = StateBytes::for_job(spec);
    let stage = spec.zero.stage;
    let share = |partitioned: bool, bytes: f64| {
        if partitioned {
            bytes / n
        } else {
            bytes
        }
    };
    // `train.freeze`: gradients and moments for the parameters that train
    // (a frozen parameter's pages are given back, in whole gradients and
    // in slices alike); the master copy (mixed precision) for all.
    let t = trained_elements(&spec.model, &spec.train.freeze);
    let master = match spec.train.dtype {
        Dtype::F32 => 0.0,
        Dtype::Bf16 | Dtype::F16 => 4.0,
    };
    let params = share(stage.partitions_parameters(), b.param * psi);
    let grads = share(stage.partitions_gradients(), b.grad * t.trained);
    let optimizer = share(
        stage.partitions_optimizer(),
        master * psi + (b.optimizer - master) * t.trained,
    );
    let mut states = WorkerStates {
        memory: params + grads + optimizer,
        nvme: 0.0,
    };
    if spec.zero.offload_optimizer.is_nvme() {
        // The swap files hold every parameter's state, frozen or not.
        states.memory -= optimizer;
        states.nvme += share(stage.partitions_optimizer(), b.optimizer * psi);
        if stage.partitions_gradients() {
            // Reduced gradient slices go to swap; one group's is held while
            // a micro-batch's is added to it.
            states.memory -= grads;
            states.nvme += share(true, b.grad * psi);
            states.memory += b.grad * largest_group(&spec.model) / n;
        }
    }
    if spec.zero.offload_param.is_nvme() {
        states.memory -= params;
        states.nvme += params;
        states.memory += 2.0 * b.param * largest_group(&spec.model);
    }
    let hpz = spec.zero.hpz_partition_size;
    if hpz > 1 {
        // hpZ: between forward and backward every block's secondary shard
        // (1/hpz of it, in the working type) is held.
        states.memory += b.param * psi / hpz as f64;
    }
    states
}

/// The most gradient buckets the engine holds at once, packed or in flight:
/// one reducing while the next is packed, as DeepSpeed's two IPG buffers.
/// Where the reductions lag behind backward (a slower rank, a loaded
/// machine), backward waits for the oldest before it packs another: left
/// unbounded, gpt-anchor's one-block buckets (7 MB each) once took a
/// worker's peak RSS 16 MB above its figure alone, in CI beside other
/// tests; a test that makes one rank lag saw all of them held at once.
pub const REDUCE_BUCKETS_HELD: usize = 2;

/// Elements of every parameter group in the order backward completes their
/// gradients: the head, then each block's tiles (last linear first, each
/// linear's tiles in column order) and the rest of the block, last block
/// first, and the embedding (the engine's groups; see [`largest_group`]).
fn backward_group_elements(m: &ModelSpec) -> Vec<f64> {
    let tile_size = m.tile_size.map(|n| n.0 as usize);
    let mut block = Vec::new();
    let mut rest = m.block_params() as f64;
    let linears = m.block_linears().into_iter().zip(m.linear_biases());
    for ((layer, inputs, outputs), bias) in linears.rev() {
        let Ok(tiles) = crate::tiles::column_tiles(layer, inputs, outputs, tile_size) else {
            continue;
        };
        if tiles.len() > 1 {
            let rows = (inputs + usize::from(bias)) as f64;
            rest -= rows * outputs as f64;
            block.extend(tiles.iter().map(|c| rows * c.len() as f64));
        }
    }
    block.push(rest);
    let blocks = std::iter::repeat_n(block, m.n_layers).flatten();
    std::iter::once(m.head_params() as f64)
        .chain(blocks)
        .chain(std::iter::once(m.embedding_params() as f64))
        .collect()
}

/// Elements of each reduce bucket, as the engine plans them: groups taken in
/// backward's order until a bucket holds at least `bucket_size` (so one
/// group larger than that is a bucket of its own), the last bucket what is
/// left. Every group counted, frozen or not.
pub fn reduce_bucket_elements(m: &ModelSpec, bucket_size: u64) -> Vec<f64> {
    let mut buckets = Vec::new();
    let mut filling = 0.0;
    for n in backward_group_elements(m) {
        filling += n;
        if filling >= bucket_size as f64 {
            buckets.push(std::mem::take(&mut filling));
        }
    }
    if filling > 0.0 {
        buckets.push(filling);
    }
    buckets
}

/// Bytes of the reduce buckets (f32) one of `world` workers of `spec`
/// holds at once: the [`REDUCE_BUCKETS_HELD`] largest of
/// [`reduce_bucket_elements`], at most the elements the buckets carry
/// (frozen parameters left out, but under qgZ); none on one worker, which
/// reduces nothing.
pub fn held_bucket_bytes(spec: &JobSpec, world: usize) -> f64 {
    if world <= 1 {
        return 0.0;
    }
    let z = &spec.zero;
    let carried = match z.quantized_gradients {
        true => model_params(&spec.model),
        false => trained_elements(&spec.model, &spec.train.freeze).trained,
    };
    let mut buckets = reduce_bucket_elements(&spec.model, z.reduce_bucket_size.0);
    buckets.sort_by(|a, b| b.total_cmp(a));
    let held: f64 = buckets.iter().take(REDUCE_BUCKETS_HELD).sum();
    held.min(carried) * 4.0
}

/// Bytes a CPU worker's collectives hold at its step's peak, beside its
/// model states, for `spec` on `world` ranks.
///
/// - Reduce buckets of f32 gradients, where there are two ranks or more to
///   reduce between ([`held_bucket_bytes`]). Stages 0-2 keep the
///   buffers between steps, so they are there while forward's activations
///   pile up; at stage 3 the last bucket, packed after backward has freed
///   them, is one large buffer of its own (measured on gpt-anchor: the peak
///   RSS rose by it with the default bucket and not with small ones, which
///   reuse the activations' freed memory).
/// - Stages 2-3: the output matrix's gradient staged for its bucket, in
///   the gradients' type, where it trains: the head's group (and the
///   embedding's, where the head is tied) gets its gradient first in
///   backward, while every block's activations are held, and a tied
///   embedding's bucket leaves only when the embedding's backward is done
///   (`vocab × d`: a sixth of a width-256 GPT-2-vocabulary worker's peak).
/// - LoCo's kept errors, where qgZ has them ([`loco_error_bytes`]).
/// - Stage 3: the gathered parameters in the working type, the group in use
///   and, with `overlap_comm`, up to `prefetch_bucket_size` elements of the
///   next ones; under parameter offload to NVMe the states already count two
///   gathered groups.
pub fn comm_buffer_bytes(spec: &JobSpec, world: usize) -> f64 {
    let z = &spec.zero;
    let psi = model_params(&spec.model);
    let bucket = held_bucket_bytes(spec, world);
    let m = &spec.model;
    let output = match m.tied() {
        true => format!("{}.weight", m.token_table_name()),
        false => "lm_head.weight".into(),
    };
    let staged = match z.stage.partitions_gradients()
        && !crate::freeze::frozen(&spec.train.freeze, &output)
    {
        true => (m.vocab_size * m.d_model) as f64 * StateBytes::for_job(spec).grad,
        false => 0.0,
    };
    let gathered = match z.stage.partitions_parameters() && !z.offload_param.is_nvme() {
        true => {
            let ahead = match z.overlap_comm {
                true => z.prefetch_bucket_size.0 as f64,
                false => 0.0,
            };
            let param = StateBytes::for_job(spec).param;
            (largest_group(&spec.model) + ahead).min(psi) * param
        }
        false => 0.0,
    };
    bucket + staged + gathered + loco_error_bytes(spec, world)
}

/// Bytes of LoCo's kept errors (`zero.loco`) one of `world` workers holds
/// between steps: a byte for each value it sends of every bucket that qgZ
/// quantizes (those whose chunks hold a quantization block at least; the
/// rest go as plain reduce-scatters), which is all but its own chunk, and
/// an f32 scale a quantization block of them.
pub fn loco_error_bytes(spec: &JobSpec, world: usize) -> f64 {
    let z = &spec.zero;
    if world <= 1 || !z.quantized_gradients || z.loco.is_none() {
        return 0.0;
    }
    let (w, block) = (world as f64, z.quantization.block_size as f64);
    reduce_bucket_elements(&spec.model, z.reduce_bucket_size.0)
        .into_iter()
        .filter(|&b| (b / w).floor() >= block)
        .map(|b| b * (w - 1.0) / w * (1.0 + 4.0 / block))
        .sum()
}

/// Bytes one node sends to other nodes in one stage-3 step, by phase, as
/// zrun moves them (ring collectives with ranks numbered node by node, so a
/// ring collective on a buffer of B bytes crosses each node boundary with
/// (W-1)/W·B; qgZ's hierarchical reduce-scatter sends each other node one
/// partial of each of the node's chunks).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CrossNodeBytes {
    /// Forward all-gathers of the weights.
    pub forward: f64,
    /// Backward all-gathers of the weights.
    pub backward: f64,
    /// Gradient reduce-scatters.
    pub gradients: f64,
}

impl CrossNodeBytes {
    /// Stage 3 or ZeRO++ (qwZ int8, hpZ, qgZ int4) for Ψ parameters of
    /// `param_bytes` bytes, `nodes` nodes of `per_node` ranks, gradients
    /// reduced in `reduce_bytes` an element (f32's 4 in a ring; 16 bits in
    /// qgZ's two hops, one partial per other node); scales and the tied
    /// head's extra gather are left out (they are a few percent).
    pub fn stage3(
        psi: f64,
        param_bytes: f64,
        (nodes, per_node): (usize, usize),
        reduce_bytes: f64,
        zero_pp: bool,
    ) -> CrossNodeBytes {
        let w = (nodes * per_node) as f64;
        let n = nodes as f64;
        let ring = (w - 1.0) / w;
        if nodes < 2 {
            return CrossNodeBytes {
                forward: 0.0,
                backward: 0.0,
                gradients: 0.0,
            };
        }
        if zero_pp {
            CrossNodeBytes {
                forward: ring * psi,
                backward: 0.0,
                gradients: (n - 1.0) / n * 0.5 * psi,
            }
        } else {
            let gradients = match reduce_bytes < 4.0 {
                true => (n - 1.0) / n * reduce_bytes * psi,
                false => ring * 4.0 * psi,
            };
            CrossNodeBytes {
                forward: ring * param_bytes * psi,
                backward: ring * param_bytes * psi,
                gradients,
            }
        }
    }

    /// All phases.
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.gradients
    }
}

/// The model's elements by what `train.freeze` leaves them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TrainedElements {
    /// In groups that train: the engine holds a gradient buffer for a
    /// group (the embedding, a block without its tiled linears, a tiled
    /// linear's tiles, the head) unless every parameter in it is frozen.
    pub with_grads: f64,
    /// Those that train: the only ones holding optimizer moments (a
    /// frozen parameter's go back to the kernel).
    pub trained: f64,
}

/// [`TrainedElements`] of the model `m` under the `freeze` patterns.
pub fn trained_elements(m: &ModelSpec, freeze: &[String]) -> TrainedElements {
    let tile_size = m.tile_size.map(|n| n.0 as usize);
    let tiled: Vec<&str> = m
        .block_linears()
        .into_iter()
        .filter(|&(name, inputs, outputs)| {
            crate::tiles::column_tiles(name, inputs, outputs, tile_size).is_ok_and(|t| t.len() > 1)
        })
        .map(|(name, _, _)| name)
        .collect();
    let embedding = [
        format!("{}.weight", m.token_table_name()),
        "wpe.weight".to_string(),
    ];
    let group_of = |name: &str| -> String {
        if let Some((i, rest)) = m.block_of(name) {
            let linear = tiled.iter().find(|l| rest.starts_with(&format!("{l}.")));
            return format!("{}.{}", m.block_prefix(i), linear.copied().unwrap_or(""));
        }
        match embedding.iter().any(|e| e == name) {
            true => "embedding".into(),
            false => "head".into(),
        }
    };
    // Per group: its elements and those that train.
    let mut groups: std::collections::BTreeMap<String, (f64, f64)> = Default::default();
    for (name, shape) in m.param_shapes() {
        let numel = shape.iter().product::<usize>() as f64;
        let g = groups.entry(group_of(&name)).or_default();
        g.0 += numel;
        if !crate::freeze::frozen(freeze, &name) {
            g.1 += numel;
        }
    }
    TrainedElements {
        with_grads: groups.values().filter(|g| g.1 > 0.0).map(|g| g.0).sum(),
        trained: groups.values().map(|g| g.1).sum(),
    }
}

/// Model FLOPs per token of one training step under the `freeze` patterns,
/// in PaLM's accounting (6 per block parameter and head-matrix weight,
/// 12·h·hd·T for attention) less what freezing leaves out: a frozen
/// weight's gradient product (2 per element), the head's where its matrix
/// is frozen, and below the lowest block that trains (the embedding
/// frozen) all of backward. The engine's count by its groups
/// (`zengine::Engine::flops_per_token`) is tested against the same
/// arithmetic.
pub fn frozen_flops_per_token(m: &ModelSpec, freeze: &[String]) -> f64 {
    let frozen = |name: &str| crate::freeze::frozen(freeze, name);
    let shapes = m.param_shapes();
    let table = format!("{}.weight", m.token_table_name());
    let head = (m.vocab_size * m.d_model) as f64;
    let output_frozen = frozen(if m.tied() { &table } else { "lm_head.weight" });
    let attention = 4.0 * (m.attn_width() * m.window().unwrap_or(m.seq_len)) as f64;
    let reach = backward_reach(m, freeze);
    let mut flops = if output_frozen { 4.0 } else { 6.0 } * head;
    // Each block's elements, and those of them that train.
    let mut blocks = vec![(0.0, 0.0); m.n_layers];
    for (n, s) in &shapes {
        if let Some((i, _)) = m.block_of(n) {
            let e = s.iter().product::<usize>() as f64;
            blocks[i].0 += e;
            blocks[i].1 += if frozen(n) { 0.0 } else { e };
        }
    }
    for (i, (all, trained)) in blocks.into_iter().enumerate() {
        flops += 2.0 * all + attention;
        if i >= reach {
            flops += 2.0 * all + 2.0 * trained + 2.0 * attention;
        }
    }
    flops
}

/// Parameters of the model `m` describes.
pub fn model_params(m: &ModelSpec) -> f64 {
    m.param_count() as f64
}

/// Elements of the largest parameter group: the embeddings, a block, or with
/// `model.tile_size` a block without its tiled linears, or one tile.
pub fn largest_group(m: &ModelSpec) -> f64 {
    let mut block = m.block_params() as f64;
    let mut largest_tile = 0f64;
    let tile_size = m.tile_size.map(|n| n.0 as usize);
    for ((layer, inputs, outputs), bias) in m.block_linears().into_iter().zip(m.linear_biases()) {
        let bias = usize::from(bias);
        let Ok(tiles) = crate::tiles::column_tiles(layer, inputs, outputs, tile_size) else {
            continue;
        };
        if tiles.len() > 1 {
            block -= ((inputs + bias) * outputs) as f64;
            let widest = tiles.iter().map(|c| c.len()).max().unwrap_or(0);
            largest_tile = largest_tile.max(((inputs + bias) * widest) as f64);
        }
    }
    block
        .max(largest_tile)
        .max(m.embedding_params() as f64)
        .max(m.head_params() as f64)
}

/// The types a worker's blocks keep their activations in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// f32 throughout: f32 products on the CPU, and every GPU job (whose
    /// kept values the GPU model holds in f32).
    F32,
    /// A CPU worker whose products take bf16 (`train.dtype: bf16` where the
    /// CPU multiplies bf16 natively): the linears' inputs, the attention's
    /// output and its (rotated) q, k and v, and GPT's GELU input in bf16;
    /// the residual stream, SwiGLU's input and Qwen3's q, k and v before
    /// their norms in f32.
    Bf16Products,
}

impl Kept {
    /// What `spec`'s workers keep, where the CPU multiplies bf16 natively
    /// or not (`cpu_multiplies_bf16`: `zgemm::has_native_bf16`, which
    /// decides the model's products).
    pub fn for_job(spec: &JobSpec, cpu_multiplies_bf16: bool) -> Kept {
        match spec.device == Device::Cpu && spec.train.dtype == Dtype::Bf16 && cpu_multiplies_bf16 {
            true => Kept::Bf16Products,
            false => Kept::F32,
        }
    }

    /// Bytes of an element that the products read: bf16 or f32.
    fn product_input(self) -> usize {
        match self {
            Kept::F32 => 4,
            Kept::Bf16Products => 2,
        }
    }
}

/// Bytes of activations one transformer block keeps for backward, for `b`
/// sequences of `t` tokens, in the types `kept` says: what
/// `zmodel::BlockActs::bytes` measures (tested against it).
pub fn block_activation_bytes(m: &ModelSpec, b: usize, t: usize, kept: Kept) -> f64 {
    let (d, f) = (m.d_model, m.ffn());
    let half = kept.product_input();
    // What zmodel's block keeps for its backward: input, first norm, q k v,
    // attention output, x + attn, second norm, the MLP's hidden layer before
    // and after its activation (GPT-2: 4d each, GELU's slope or under bf16
    // products its bf16 input, and its output; LLaMA: gate and up before,
    // f32, their product after). Attention probabilities are recomputed in
    // backward, not kept. Qwen3's q and k norms keep the projection's
    // output before them too (f32).
    let hidden = match m.kind {
        crate::spec::ModelKind::Gpt => half * 2 * f,
        crate::spec::ModelKind::Llama => 4 * 2 * f + half * f,
    };
    let qkv = half * m.qkv_width();
    let before_qk_norms = match m.qk_normed() {
        true => 4 * m.qkv_width(),
        false => 0,
    };
    let residuals = 4 * 2 * d;
    let norms = half * 2 * d;
    let per_token = residuals + norms + half * m.attn_width() + qkv + before_qk_norms + hidden;
    (b * t) as f64 * per_token as f64
}

/// Bytes a block's backward holds at its most beyond the activations its
/// forward kept and the gradient it is handed, for `b` sequences of `t`
/// tokens under `kept`'s products: the gradients passing through it (the
/// MLP's dropped once read for the last time, the attention's held to the
/// block's end) and a linear's weight gradient on its way to its group's buffer
/// (zmodel's `backward_memory` test measures it). A worker's peak comes
/// while its top block's backward runs, every block's activations held.
pub fn block_backward_bytes(m: &ModelSpec, b: usize, t: usize, kept: Kept) -> f64 {
    let (d, f, aw, qw) = (m.d_model, m.ffn(), m.attn_width(), m.qkv_width());
    let bf16 = kept == Kept::Bf16Products;
    let llama = m.kind == crate::spec::ModelKind::Llama;
    // The bf16 copy a linear's backward makes of its f32 output gradient
    // under bf16 products, while the f32 one is held.
    let rounded = |width: usize| if bf16 { 2 * width } else { 0 };
    // Bytes a row: dg, the MLP's hidden layer's gradient (f32); dh, its
    // expansion's output's, as the activation's backward makes it (GPT's
    // is dg itself under f32 products, which multiply by GELU's slope;
    // bf16 under bf16 products; LLaMA's gate and up, f32) and as the
    // expansion's backward holds it (LLaMA's rounded to bf16 under bf16
    // products, the f32 one dropped).
    let dg = 4 * f;
    let (dh_made, dh_held) = match (llama, bf16) {
        (false, false) => (0, dg),
        (false, true) => (2 * f, 2 * f),
        (true, false) => (8 * f, 8 * f),
        (true, true) => (8 * f, 4 * f),
    };
    let expansion = if llama { 2 * f } else { f };
    let dqkv = 4 * qw;
    // Each phase in order: the gradients it holds a row, and the weight
    // gradient (elements, f32) it makes. From the expansion's backward on,
    // its input's gradient (4d a row), the second norm's (4d, the first
    // residual's) and the attention output's (4·aw) are held to the end.
    let held = 4 * d + 4 * d + 4 * aw;
    let mut phases = vec![
        (rounded(d) + dg, f * d),
        (dg + dh_made, 0),
        (dh_held + 4 * d, d * expansion),
        (4 * d + 4 * d, 0),
        (8 * d + rounded(d) + 4 * aw, aw * d),
        (held + dqkv, 0),
        (held + dqkv + 4 * d, d * qw),
        (held + 4 * d + 4 * d, 0),
    ];
    if llama && bf16 {
        phases.push((dh_made + rounded(2 * f), 0));
    }
    if llama {
        // The rotation (and Qwen3's q and k norms) write dq, dk and dv
        // again while the first are held.
        phases.push((held + 2 * dqkv, 0));
    }
    if bf16 {
        phases.push((held + dqkv + rounded(qw), 0));
    }
    (phases.into_iter())
        .map(|(per_row, weight)| (b * t * per_row + 4 * weight) as f64)
        .fold(0.0, f64::max)
}

/// Of [`block_activation_bytes`], the inputs of the block's four linears
/// (in [`ModelSpec::block_linears`] order), which only their weight
/// gradients read: a block keeps none of a linear whose weight is frozen.
pub fn linear_input_bytes(m: &ModelSpec, b: usize, t: usize, kept: Kept) -> [f64; 4] {
    let half = kept.product_input();
    m.block_linears()
        .map(|(_, inputs, _)| (half * b * t * inputs) as f64)
}

/// The lowest block (0-based) that backward reaches under the `freeze`
/// patterns: 0 where the embedding trains, else the lowest block with a
/// parameter that trains (`n_layers` where none has): the blocks below get
/// no backward at all, as the engine's groups decide it.
fn backward_reach(m: &ModelSpec, freeze: &[String]) -> usize {
    let frozen = |name: &str| crate::freeze::frozen(freeze, name);
    let embedding_trains = !frozen(&format!("{}.weight", m.token_table_name()))
        || (m.learned_positions() && !frozen("wpe.weight"));
    if embedding_trains {
        return 0;
    }
    (m.param_shapes().iter())
        .filter(|(n, _)| !frozen(n))
        .filter_map(|(n, _)| m.block_of(n).map(|(i, _)| i))
        .min()
        .unwrap_or(m.n_layers)
}

/// Which of a block's four linears ([`ModelSpec::block_linears`]) keep no
/// input where their weight is frozen: on the CPU all four; on the GPU all
/// but the attention's output projection, whose input (the attention's
/// output) the attention's own backward reads there.
pub fn frozen_inputs_dropped(gpu: bool) -> [bool; 4] {
    [true, !gpu, true, true]
}

/// [`activation_bytes`] under the `freeze` patterns: blocks below the
/// lowest that trains (where the embedding is frozen) keep nothing, since
/// backward stops above them, and the others no input of a linear whose
/// weight is frozen where the device drops it ([`frozen_inputs_dropped`]);
/// and no output matrix gradient of the head's where the CPU worker adds
/// it in place (`in_place`, [`output_gradient_in_place`]).
pub fn frozen_activation_bytes(
    m: &ModelSpec,
    micro_batch: usize,
    freeze: &[String],
    (gpu, kept, in_place): (bool, Kept, bool),
) -> (f64, f64) {
    let t = m.seq_len;
    let frozen = |name: &str| crate::freeze::frozen(freeze, name);
    let dropped = frozen_inputs_dropped(gpu);
    let reach = backward_reach(m, freeze);
    let block = block_activation_bytes(m, micro_batch, t, kept);
    let output = match m.tied() {
        true => format!("{}.weight", m.token_table_name()),
        false => "lm_head.weight".into(),
    };
    let apart = !frozen(&output) && !in_place;
    let head = head_activation_bytes(m, micro_batch, t, (gpu, apart));
    let input = 4.0 * (micro_batch * t * m.d_model) as f64;
    let linears = m.block_linears();
    let inputs = linear_input_bytes(m, micro_batch, t, kept);
    // What each block keeps, forward-only ones below `reach` included.
    let blocks: Vec<f64> = (0..m.n_layers)
        .map(|i| {
            let prefix = m.block_prefix(i);
            let not_kept: f64 = (linears.iter().zip(inputs).zip(dropped))
                .filter(|(((name, _, _), _), drops)| {
                    *drops && frozen(&format!("{prefix}.{name}.weight"))
                })
                .map(|((_, bytes), _)| bytes)
                .sum();
            block - not_kept
        })
        .collect();
    let saved = (m.n_layers - reach) as f64;
    // With checkpointing, one block's at a time: on the CPU the most any
    // block keeps (its recomputation drops what its forward dropped); on a
    // GPU a whole block's.
    let recomputed = match gpu {
        true => block,
        false => blocks.iter().copied().fold(0.0, f64::max),
    };
    (
        blocks[reach..].iter().sum::<f64>() + head,
        saved * input + recomputed + head,
    )
}

/// Bytes the head holds for `b` sequences of `t` tokens: its input, the
/// normed rows and their gradient, and the logits: on a GPU all of them
/// and two copies' worth, on the CPU the rows of [`head_logit_rows`] and,
/// where the output matrix's gradient is made apart from its group's
/// buffer (`apart`: it trains, and is not added in place,
/// [`output_gradient_in_place`]), that f32 gradient: a run of
/// [`output_gradient_block_rows`] at a time where one chunk of logits
/// covers the rows, else whole (`vocab × d`, made while every block's
/// activations are held: 622 MB at Qwen3's vocabulary and d 1024).
pub fn head_activation_bytes(m: &ModelSpec, b: usize, t: usize, (gpu, apart): (bool, bool)) -> f64 {
    let (n, d, vocab) = ((b * t) as f64, m.d_model as f64, m.vocab_size as f64);
    let chunk = head_logit_rows(b * t, m.vocab_size);
    let logits = match gpu {
        true => 3.0 * n * vocab,
        false => chunk as f64 * vocab,
    };
    let output_gradient = match (!gpu && apart, b * t <= chunk) {
        (false, _) => 0.0,
        (true, true) => output_gradient_block_rows(m.vocab_size, m.d_model) as f64 * d,
        (true, false) => vocab * d,
    };
    4.0 * (3.0 * n * d + logits + output_gradient)
}

/// Bytes of a run of the output matrix's gradient that the CPU's head makes
/// at a time where it hands the gradient over in runs (zmodel's
/// `Gpt::head_backward_adding`).
pub const OUTPUT_GRADIENT_BLOCK_BYTES: usize = 16 << 20;

/// Rows of the output matrix's gradient (`vocab × d`, f32) in a run of
/// [`OUTPUT_GRADIENT_BLOCK_BYTES`], at least 64.
pub fn output_gradient_block_rows(vocab: usize, d: usize) -> usize {
    (OUTPUT_GRADIENT_BLOCK_BYTES / (4 * d.max(1)))
        .max(64)
        .min(vocab.max(1))
}

/// The logits the CPU's head holds at most (but for
/// [`LEAST_HEAD_LOGIT_ROWS`]).
pub const HEAD_LOGIT_BYTES: usize = 64 << 20;

/// The fewest rows of a chunk of the CPU head's logits: each chunk reads
/// and writes the whole weight gradient (`vocab × d`) once, so the chunk's
/// depth in rows is that product's floating-point operations per byte over
/// 4; at 1024 rows that traffic is a few percent of the products' time.
pub const LEAST_HEAD_LOGIT_ROWS: usize = 1024;

/// Rows of logits the CPU's head holds at once (zmodel's head takes the
/// number from here), out of `n` rows over `vocab`: all of them while they
/// fit in [`HEAD_LOGIT_BYTES`], else a chunk of whole 64-row steps (bf16
/// products pair rows: the weight gradient's chunks then chain to the bits
/// of one product) of at least [`LEAST_HEAD_LOGIT_ROWS`]. A micro-batch's
/// logits grow with its rows and the vocabulary (8192 rows of Qwen's
/// 151,936 tokens: 5 GB), and nothing needs more than a chunk of them at
/// once: each chunk's loss terms, input gradient and share of the weight
/// gradient are made before the next chunk's logits.
pub fn head_logit_rows(n: usize, vocab: usize) -> usize {
    let fitting = HEAD_LOGIT_BYTES / (4 * vocab.max(1));
    let chunk = (fitting / 64 * 64).max(LEAST_HEAD_LOGIT_ROWS);
    chunk.min(n).max(1)
}

/// Activation bytes of one micro-batch per worker, without and with
/// checkpointing, on a GPU or the CPU (whose head holds less), kept in the
/// types `kept` says.
pub fn activation_bytes(
    m: &ModelSpec,
    micro_batch: usize,
    (gpu, kept): (bool, Kept),
) -> (f64, f64) {
    let t = m.seq_len;
    let block = block_activation_bytes(m, micro_batch, t, kept);
    let head = head_activation_bytes(m, micro_batch, t, (gpu, true));
    let inputs = 4.0 * (micro_batch * t * m.d_model) as f64;
    let l = m.n_layers as f64;
    (l * block + head, l * inputs + block + head)
}

/// Query rows whose probabilities the CPU's attention holds at once
/// (zmodel's attention takes the number from here): each thread computing
/// attention holds that many rows (or all `t`, when fewer) of `P` and of
/// its gradient, `t` wide, which keeps that memory linear in `t`.
pub const ATTENTION_CHUNK_ROWS: usize = 768;

/// Bytes of the work matrices each thread of a CPU worker holds while it
/// computes attention (kept between steps): a chunk of
/// [`ATTENTION_CHUNK_ROWS`] query rows of `P` and of `dS`, f32, and under
/// bf16 their bf16 copies (which the products read where the CPU
/// multiplies bf16). Not activations: a thread's, whatever the micro-batch.
pub fn attention_work_bytes(m: &ModelSpec, dtype: Dtype) -> f64 {
    let t = m.seq_len;
    let per_element = if dtype == Dtype::Bf16 { 6.0 } else { 4.0 };
    2.0 * (ATTENTION_CHUNK_ROWS.min(t) * t) as f64 * per_element
}

/// Bytes of the probabilities `[b·heads, t, t]` the GPU's unfused attention
/// keeps for a block's backward: f32, and under 16-bit products their
/// 16-bit copy too (the operand of the products with v and dO). The CPU
/// model and the GPU's fused attention recompute them instead.
pub fn gpu_probabilities_bytes(m: &ModelSpec, b: usize, half_products: bool) -> f64 {
    let scores = (b * m.n_heads) as f64 * (m.seq_len * m.seq_len) as f64;
    scores * if half_products { 6.0 } else { 4.0 }
}

/// Activation bytes of one micro-batch per worker of `spec`'s job, without
/// and with checkpointing: [`activation_bytes`] ([`frozen_activation_bytes`]
/// under `train.freeze`), and on a GPU whose attention is unfused
/// (`fused_attention` false) every kept block's probabilities
/// ([`gpu_probabilities_bytes`]) and, while a block's backward runs, its dP
/// and dS of the same shape and bytes.
pub fn job_activation_bytes(spec: &JobSpec, fused_attention: bool, kept: Kept) -> (f64, f64) {
    let micro = spec.train.micro_batch_size;
    let gpu = spec.device == Device::Cuda;
    let in_place = output_gradient_in_place(spec);
    let (plain, checkpointed) = frozen_activation_bytes(
        &spec.model,
        micro,
        &spec.train.freeze,
        (gpu, kept, in_place),
    );
    if !gpu || fused_attention {
        return (plain, checkpointed);
    }
    let probs = gpu_probabilities_bytes(&spec.model, micro, spec.train.dtype != Dtype::F32);
    let kept = (spec.model.n_layers - backward_reach(&spec.model, &spec.train.freeze)) as f64;
    (plain + (kept + 1.0) * probs, checkpointed + 2.0 * probs)
}

/// Bytes a CPU worker of `spec` holds at its most beyond its activations
/// ([`job_activation_bytes`], which count the head's as held together with
/// every block's): while the top block's backward runs, the head's rows
/// and gradients are gone (its logits' buffer stays: the thread's, kept
/// from step to step) but the gradient it handed down (`b·t·d`, f32) and
/// the block's passing gradients ([`block_backward_bytes`]) are held.
/// Nothing where no block trains.
pub fn job_backward_bytes(spec: &JobSpec, kept: Kept) -> f64 {
    let m = &spec.model;
    if backward_reach(m, &spec.train.freeze) >= m.n_layers {
        return 0.0;
    }
    let (b, t) = (spec.train.micro_batch_size, m.seq_len);
    let handed = 4.0 * (b * t * m.d_model) as f64;
    let apart = !output_gradient_in_place(spec);
    let head = head_activation_bytes(m, b, t, (false, apart));
    let logits = 4.0 * (head_logit_rows(b * t, m.vocab_size) * m.vocab_size) as f64;
    (handed + block_backward_bytes(m, b, t, kept) - (head - logits)).max(0.0)
}

/// Bytes a worker process holds before any model: its code and libraries,
/// its threads' stacks, its runtime and control connection. Measured on
/// 2026-12-07: a worker training a GPT of width 32 on 16 tokens (model
/// states and activations under 0.5 MB) peaked at 12.7-12.8 MiB.
pub const WORKER_PROCESS_BYTES: f64 = 12.0 * 1024.0 * 1024.0;

/// What one of `world` CPU workers of `spec`, each of `threads` compute
/// threads keeping activations in the types `kept` says, holds at its
/// peak: the process itself ([`WORKER_PROCESS_BYTES`]), its model states
/// ([`worker_states`]), its collectives' buffers ([`comm_buffer_bytes`]),
/// its activations (checkpointed where the job checkpoints) and backward's
/// passing gradients ([`job_backward_bytes`]), and each thread's attention
/// work matrices ([`attention_work_bytes`]). What `zrun train` checks
/// against the host's memory before launch and `zrun plan` ranks by.
pub fn cpu_worker_peak_bytes(spec: &JobSpec, world: usize, threads: usize, kept: Kept) -> f64 {
    let (plain, checkpointed) = job_activation_bytes(spec, true, kept);
    let activations = match spec.train.activation_checkpointing {
        true => checkpointed,
        false => plain,
    };
    WORKER_PROCESS_BYTES
        + worker_states(spec, world).memory
        + comm_buffer_bytes(spec, world)
        + activations
        + job_backward_bytes(spec, kept)
        + threads as f64 * attention_work_bytes(&spec.model, spec.train.dtype)
}

/// Whether a CPU worker of `spec` has the head add the output matrix's
/// gradient into its group's gradient buffer itself, rather than make it
/// apart (`vocab × d` f32) and add it: where gradients are f32 (the
/// working type, or `train.grad_accum_dtype: f32`) and that buffer holds
/// none of the micro-batch's yet when the head runs: at stages 2-3, whose
/// every micro-batch stages its own; at stages 0-1 with one micro-batch a
/// step (a later micro-batch's would be added to the earlier ones', and a
/// chain of products started from them would not have every stage's bits).
pub fn output_gradient_in_place(spec: &JobSpec) -> bool {
    spec.device == Device::Cpu
        && spec.train.grads_dtype() == Dtype::F32
        && (spec.zero.stage.partitions_gradients() || spec.train.grad_accum == 1)
}

/// What one of `world` workers of a `device: cuda` job is estimated to hold
/// on its GPU: its model states where they live there (nothing offloaded,
/// and one worker or `comm.backend: nccl`: the resident flows; the host
/// flow keeps them on the host), and its activations at the job's
/// micro-batch, checkpointed where the job checkpoints.
pub fn gpu_worker_bytes(spec: &JobSpec, world: usize, fused_attention: bool) -> GpuWorkerBytes {
    use crate::spec::{Backend, OffloadDevice};
    let z = &spec.zero;
    let offloaded = (z.offload_optimizer.device, z.offload_param.device)
        != (OffloadDevice::None, OffloadDevice::None);
    let resident = !offloaded && (world <= 1 || spec.comm.backend == Backend::Nccl);
    let (plain, checkpointed) = job_activation_bytes(spec, fused_attention, Kept::F32);
    // `train.freeze` saves no state there: the GPU holds a frozen
    // parameter's gradient and moments.
    let mut unfrozen = spec.clone();
    unfrozen.train.freeze.clear();
    GpuWorkerBytes {
        states: resident.then(|| worker_states(&unfrozen, world).memory),
        activations: match spec.train.activation_checkpointing {
            true => checkpointed,
            false => plain,
        },
    }
}

/// [`gpu_worker_bytes`]' answer.
#[derive(Debug, Clone, Copy)]
pub struct GpuWorkerBytes {
    /// Model states on the GPU, where they live there.
    pub states: Option<f64>,
    /// Activations of one micro-batch.
    pub activations: f64,
}

impl GpuWorkerBytes {
    /// Both together.
    pub fn total(&self) -> f64 {
        self.states.unwrap_or(0.0) + self.activations
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head's output matrix gradient (`vocab × d` f32) is counted
    /// where a CPU worker makes it apart: 16-bit gradients, or stages 0-1
    /// with more than one micro-batch a step; not where it is added in
    /// place, nor where the matrix is frozen.
    /// Backward's passing gradients come on top of the activations where a
    /// block trains, and not at all where backward stops above every
    /// block (the embedding and the blocks frozen); a worker's peak is
    /// the sum of its parts, and grows by them with its threads.
    #[test]
    fn a_workers_peak_adds_backwards_gradients_where_a_block_trains() {
        let mut spec: JobSpec = serde_saphyr::from_str(
            "model: {vocab_size: 256, d_model: 64, n_layers: 2, n_heads: 2, seq_len: 16}\n\
             data: {format: synthetic}\ntrain: {micro_batch_size: 4}\n",
        )
        .unwrap();
        let backward = job_backward_bytes(&spec, Kept::F32);
        // GPT-2 in f32 at its most in the q, k and v projection's backward:
        // the second norm's, the attention output's and the MLP input's
        // gradients, dq, dk and dv, the projection's input gradient (seven
        // rows of d) and its weight gradient (d × 3d); and the gradient the
        // head handed down, less the head's three rows of d.
        let n_d = 4.0 * (4 * 16 * 64) as f64;
        let block = 7.0 * n_d + 4.0 * (64 * 3 * 64) as f64;
        assert_eq!(block_backward_bytes(&spec.model, 4, 16, Kept::F32), block);
        assert_eq!(backward, n_d + block - 3.0 * n_d);
        let parts = WORKER_PROCESS_BYTES
            + worker_states(&spec, 1).memory
            + comm_buffer_bytes(&spec, 1)
            + job_activation_bytes(&spec, true, Kept::F32).0
            + backward;
        let work = attention_work_bytes(&spec.model, spec.train.dtype);
        assert_eq!(cpu_worker_peak_bytes(&spec, 1, 1, Kept::F32), parts + work);
        assert_eq!(
            cpu_worker_peak_bytes(&spec, 1, 3, Kept::F32),
            parts + 3.0 * work
        );
        spec.train.freeze = vec!["w*.weight".into(), "h.*".into()];
        assert_eq!(job_backward_bytes(&spec, Kept::F32), 0.0);
    }

    #[test]
    fn the_output_gradient_is_counted_where_it_is_made_apart() {
        let base: JobSpec = serde_saphyr::from_str(
            "model: {vocab_size: 1000, d_model: 64, n_layers: 1, n_heads: 2, seq_len: 16}\n\
             data: {format: synthetic}\ntrain: {micro_batch_size: 2}\n",
        )
        .unwrap();
        type Change = dyn Fn(&mut JobSpec);
        let of = |change: &Change| {
            let mut spec = base.clone();
            change(&mut spec);
            let (plain, checkpointed) = job_activation_bytes(&spec, true, Kept::F32);
            (output_gradient_in_place(&spec), plain, checkpointed)
        };
        let gradient = 4.0 * 1000.0 * 64.0;
        let (in_place, plain, checkpointed) = of(&|_| {});
        assert!(in_place);
        let apart: [(&str, &Change); 3] = [
            ("two micro-batches", &|s| s.train.grad_accum = 2),
            ("bf16", &|s| s.train.dtype = Dtype::Bf16),
            ("f16", &|s| s.train.dtype = Dtype::F16),
        ];
        for (what, change) in apart {
            let (in_place, p, c) = of(change);
            assert!(!in_place, "{what}");
            assert_eq!(
                (p - plain, c - checkpointed),
                (gradient, gradient),
                "{what}"
            );
        }
        let kept: [(&str, &Change); 3] = [
            ("stage 2, two micro-batches", &|s| {
                s.zero.stage = ZeroStage::Gradients;
                s.train.grad_accum = 2;
            }),
            ("bf16 summed in f32", &|s| {
                s.train.dtype = Dtype::Bf16;
                s.train.grad_accum_dtype = Some(Dtype::F32);
            }),
            ("frozen, two micro-batches", &|s| {
                s.train.freeze = vec!["wte.weight".into()];
                s.train.grad_accum = 2;
            }),
        ];
        for (what, change) in kept {
            // (The frozen table's job counts no gradient of it either way.)
            let (in_place, p, _) = of(change);
            assert_eq!(p, plain, "{what}");
            assert_eq!(in_place, !what.starts_with("frozen"), "{what}");
        }
    }

    #[test]
    fn the_collectives_buffers_are_two_buckets_a_staged_output_gradient_and_stage_3_gathers() {
        let mut spec: JobSpec = serde_saphyr::from_str(
            "model: {vocab_size: 256, d_model: 384, n_layers: 6, n_heads: 6, seq_len: 256}\n\
             data: {format: synthetic}\nzero: {stage: 0, prefetch_bucket_size: 1e6}\n",
        )
        .unwrap();
        let psi = model_params(&spec.model);
        assert_eq!(comm_buffer_bytes(&spec, 1), 0.0, "one rank reduces nothing");
        // The default bucket (5e7) holds the whole gradient, in f32.
        assert_eq!(comm_buffer_bytes(&spec, 2), 4.0 * psi);
        // Buckets of 1e6 elements: a block each (1.77M), the first with the
        // head's norm, the last the embedding alone; the two largest are
        // held at once.
        spec.zero.reduce_bucket_size.0 = 1_000_000;
        let block = spec.model.block_params() as f64;
        let embedding = (256.0 + 256.0) * 384.0;
        let buckets = reduce_bucket_elements(&spec.model, 1_000_000);
        assert_eq!(buckets.len(), 7, "{buckets:?}");
        assert_eq!(buckets[0], 768.0 + block);
        assert!(buckets[1..6].iter().all(|&b| b == block));
        assert_eq!(buckets[6], embedding);
        assert_eq!(buckets.iter().sum::<f64>(), psi);
        assert_eq!(comm_buffer_bytes(&spec, 2), 4.0 * (768.0 + 2.0 * block));
        // Buckets of 4e6: three blocks each (the first with the head's
        // norm), then the embedding: all but the embedding held.
        spec.zero.reduce_bucket_size.0 = 4_000_000;
        let three = reduce_bucket_elements(&spec.model, 4_000_000);
        assert_eq!(three, [768.0 + 3.0 * block, 3.0 * block, embedding]);
        assert_eq!(comm_buffer_bytes(&spec, 2), 4.0 * (psi - embedding));
        // Frozen parameters leave the bucket; not under qgZ.
        spec.zero.reduce_bucket_size.0 = 50_000_000;
        spec.train.freeze = vec!["h.{0-2}.*".into()];
        let trained = trained_elements(&spec.model, &spec.train.freeze).trained;
        assert!(trained < psi);
        assert_eq!(comm_buffer_bytes(&spec, 2), 4.0 * trained);
        spec.zero.quantized_gradients = true;
        assert_eq!(comm_buffer_bytes(&spec, 2), 4.0 * psi);
        // LoCo keeps a byte for each value a rank sends of the one bucket
        // (half of it, on two ranks) and a scale a 2048.
        spec.zero.loco = Some(crate::spec::LocoSpec::default());
        let kept = psi / 2.0 * (1.0 + 4.0 / 2048.0);
        assert_eq!(comm_buffer_bytes(&spec, 2), 4.0 * psi + kept);
        assert_eq!(
            comm_buffer_bytes(&spec, 1),
            0.0,
            "one worker reduces nothing"
        );
        spec.zero.loco = None;
        spec.zero.quantized_gradients = false;
        spec.train.freeze.clear();
        // Stages 2-3 stage the output matrix's gradient (the tied
        // embedding's, vocab × d) in the gradients' type, on one rank too;
        // not where it is frozen.
        let table = 256.0 * 384.0;
        spec.zero.stage = ZeroStage::Gradients;
        assert_eq!(comm_buffer_bytes(&spec, 1), 4.0 * table);
        assert_eq!(comm_buffer_bytes(&spec, 2), 4.0 * psi + 4.0 * table);
        spec.train.freeze = vec!["wte.weight".into()];
        let trained = trained_elements(&spec.model, &spec.train.freeze).trained;
        assert_eq!(comm_buffer_bytes(&spec, 2), 4.0 * trained);
        spec.train.freeze.clear();
        // Stage 3 gathers the group in use and the prefetch bucket ahead,
        // in the working type; without overlap one group.
        spec.zero.stage = ZeroStage::Weights;
        let group = largest_group(&spec.model);
        let staged = 4.0 * psi + 4.0 * table;
        assert_eq!(comm_buffer_bytes(&spec, 2), staged + 4.0 * (group + 1e6));
        spec.train.dtype = Dtype::Bf16;
        let staged = 4.0 * psi + 2.0 * table;
        assert_eq!(comm_buffer_bytes(&spec, 2), staged + 2.0 * (group + 1e6));
        spec.zero.overlap_comm = false;
        assert_eq!(comm_buffer_bytes(&spec, 2), staged + 2.0 * group);
        // The whole model at most.
        spec.zero.overlap_comm = true;
        spec.zero.prefetch_bucket_size.0 = 1_000_000_000;
        assert_eq!(comm_buffer_bytes(&spec, 2), staged + 2.0 * psi);
    }

    #[test]
    fn freezing_on_the_gpu_saves_only_the_blocks_below_the_lowest_that_trains() {
        let mut spec: JobSpec = serde_saphyr::from_str(
            "model: {vocab_size: 1000, d_model: 256, n_layers: 4, n_heads: 8, seq_len: 512}\n\
             data: {format: synthetic}\ndevice: cuda\n",
        )
        .unwrap();
        let whole = gpu_worker_bytes(&spec, 1, true);
        // Every weight frozen, the biases trained: every block is reached,
        // and keeps no input of its q, k and v projection (d a token) or
        // its MLP's two linears (d and 4d), though it keeps the attention's
        // output (d), which the CPU's block drops too.
        spec.train.freeze = vec!["*.weight".into()];
        let bitfit = gpu_worker_bytes(&spec, 1, true);
        assert_eq!(bitfit.states, whole.states);
        let (m, micro) = (&spec.model, spec.train.micro_batch_size);
        let row = 4.0 * (micro * m.seq_len * m.d_model) as f64;
        let layers = m.n_layers as f64;
        assert_eq!(bitfit.activations, whole.activations - layers * 6.0 * row);
        let mut cpu = spec.clone();
        cpu.device = Device::Cpu;
        assert!(worker_states(&spec, 1).memory < whole.states.unwrap());
        // The CPU's head holds one chunk of logits, the GPU's three copies.
        let t = m.seq_len;
        let heads = head_activation_bytes(m, micro, t, (true, false))
            - head_activation_bytes(m, micro, t, (false, false));
        assert!(heads > 0.0);
        assert_eq!(
            job_activation_bytes(&cpu, true, Kept::F32).0,
            bitfit.activations - layers * row - heads
        );
        // The embedding and the lower two blocks frozen: those blocks'
        // activations (and, unfused, their probabilities) are not kept.
        spec.train.freeze = vec!["w*".into(), "h.{0-1}.*".into()];
        let (m, micro) = (&spec.model, spec.train.micro_batch_size);
        let (block, probs) = (
            block_activation_bytes(m, micro, m.seq_len, Kept::F32),
            gpu_probabilities_bytes(m, micro, false),
        );
        let lower = gpu_worker_bytes(&spec, 1, true);
        assert_eq!(lower.states, whole.states);
        assert_eq!(lower.activations, whole.activations - 2.0 * block);
        let unfused = |s: &JobSpec| gpu_worker_bytes(s, 1, false).activations;
        spec.train.freeze.clear();
        let unfused_whole = unfused(&spec);
        spec.train.freeze = vec!["w*".into(), "h.{0-1}.*".into()];
        assert_eq!(unfused(&spec), unfused_whole - 2.0 * (block + probs));
    }

    #[test]
    fn the_gpus_unfused_attention_adds_its_probabilities_to_the_activations() {
        let mut spec: JobSpec = serde_saphyr::from_str(
            "model: {vocab_size: 1000, d_model: 256, n_layers: 4, n_heads: 8, seq_len: 512}\n\
             data: {format: synthetic}\ntrain: {micro_batch_size: 2}\n",
        )
        .unwrap();
        // (An f32 CPU job of one micro-batch a step adds the head's output
        // gradient in place.)
        let cpu = frozen_activation_bytes(&spec.model, 2, &[], (false, Kept::F32, true));
        let gpu = activation_bytes(&spec.model, 2, (true, Kept::F32));
        assert_eq!(
            job_activation_bytes(&spec, false, Kept::F32),
            cpu,
            "the CPU keeps none"
        );
        spec.device = Device::Cuda;
        assert_eq!(
            job_activation_bytes(&spec, true, Kept::F32),
            gpu,
            "fused keeps none"
        );
        // 2 sequences × 8 heads × 512², 4 bytes each in f32: per block kept,
        // and once more for one block's backward (dP, dS).
        let scores = 2.0 * 8.0 * 512.0 * 512.0;
        let (plain, ckpt) = job_activation_bytes(&spec, false, Kept::F32);
        assert_eq!(plain, gpu.0 + 5.0 * 4.0 * scores);
        assert_eq!(ckpt, gpu.1 + 2.0 * 4.0 * scores);
        spec.train.dtype = Dtype::Bf16;
        let (plain, _) = job_activation_bytes(&spec, false, Kept::F32);
        assert_eq!(plain, gpu.0 + 5.0 * 6.0 * scores, "f32 and bf16 copies");
    }

    #[test]
    fn reproduces_table_1_of_the_zero_paper() {
        // Ψ = 7.5B, 4 nodes × 16 devices, mixed-precision Adam (K = 12).
        let rows = model_state_rows(7.5e9, 4, 16, StateBytes::for_dtype(Dtype::Bf16), 0.0);
        let gb: Vec<String> = rows[..4]
            .iter()
            .map(|r| format!("{:.1}", r.bytes_per_device / 1e9))
            .collect();
        assert_eq!(gb, ["120.0", "31.4", "16.6", "1.9"]);
        assert_eq!(rows[1].bytes_per_device, 4.0 * 7.5e9 + 12.0 * 7.5e9 / 64.0);
    }

    /// `train.freeze`: moments only for what trains, gradients for every
    /// group not frozen whole (a tiled linear's tiles are groups of their
    /// own), and the worker's states follow, the master copy kept for all.
    #[test]
    fn freezing_drops_moments_and_whole_groups_gradients() {
        let mut spec: JobSpec = serde_saphyr::from_str(
            "model: {vocab_size: 1000, d_model: 64, n_layers: 3, n_heads: 4, seq_len: 32}\n\
             data: {format: synthetic}\n",
        )
        .unwrap();
        let m = spec.model.clone();
        let psi = model_params(&m);
        let patterns = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let none = trained_elements(&m, &[]);
        assert_eq!((none.with_grads, none.trained), (psi, psi));
        // GPT-2's block: four weights, (3 + 1 + 4 + 1)·d biases, two norms.
        let d = 64.0;
        let weights = 12.0 * d * d;
        let bitfit = trained_elements(&m, &patterns(&["h.*.*.*.weight"]));
        assert_eq!(bitfit.with_grads, psi);
        assert_eq!(bitfit.trained, psi - 3.0 * weights);
        let below = trained_elements(&m, &patterns(&["w*.weight", "h.{0-1}.*"]));
        let frozen = m.embedding_params() as f64 + 2.0 * m.block_params() as f64;
        assert_eq!(
            (below.with_grads, below.trained),
            (psi - frozen, psi - frozen)
        );
        // LLaMA's gate/up projection (64 x 512) in tiles of 16384: frozen,
        // its tile groups hold no gradient; the rest of the block does.
        let llama: ModelSpec = serde_saphyr::from_str(
            "{kind: llama, vocab_size: 1000, d_model: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 256, seq_len: 32, tile_size: 16384}",
        )
        .unwrap();
        let gate_up = 64.0 * 512.0;
        let t = trained_elements(&llama, &patterns(&["layers.*.mlp.gate_up_proj.weight"]));
        let all = model_params(&llama);
        assert_eq!(
            (t.with_grads, t.trained),
            (all - 2.0 * gate_up, all - 2.0 * gate_up)
        );
        let untiled = ModelSpec {
            tile_size: None,
            ..llama.clone()
        };
        let t = trained_elements(&untiled, &patterns(&["layers.*.mlp.gate_up_proj.weight"]));
        assert_eq!((t.with_grads, t.trained), (all, all - 2.0 * gate_up));
        // f32 at stage 0: 4 bytes of parameter each, 4 of gradient and 8 of
        // moments where the parameter trains.
        spec.train.freeze = patterns(&["w*.weight", "h.{0-1}.*", "h.2.mlp.c_fc.weight"]);
        let t = trained_elements(&m, &spec.train.freeze);
        assert_eq!(t.trained, psi - frozen - 4.0 * d * d);
        let states = worker_states(&spec, 2);
        assert_eq!(states.memory, 4.0 * psi + 4.0 * t.trained + 8.0 * t.trained);
        // bf16 at stage 2 over 4: the master copy's 4 bytes for every
        // parameter, the moments' 8 for those that train.
        spec.train.dtype = Dtype::Bf16;
        spec.zero.stage = ZeroStage::Gradients;
        let states = worker_states(&spec, 4);
        let want = 2.0 * psi + (2.0 * t.trained + 4.0 * psi + 8.0 * t.trained) / 4.0;
        assert!(
            (states.memory - want).abs() < 1e-6,
            "{} {want}",
            states.memory
        );
    }

    /// The model FLOPs a step does: PaLM's 6 per block parameter and head
    /// weight and 12·h·hd·T per block unfrozen; a frozen weight's gradient
    /// product (2 per element) and the tied head's left out; and below the
    /// lowest block that trains, backward's 4 per parameter and 8·h·hd·T
    /// (its weights' gradient products among them).
    #[test]
    fn a_frozen_job_does_fewer_flops() {
        let m: ModelSpec = serde_saphyr::from_str(
            "{vocab_size: 1000, d_model: 64, n_layers: 3, n_heads: 4, seq_len: 32}",
        )
        .unwrap();
        let (v, d, bp) = (1000.0, 64.0, m.block_params() as f64);
        let attention = 4.0 * d * 32.0;
        let all = 6.0 * (3.0 * bp + v * d) + 3.0 * 3.0 * attention;
        let patterns = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(frozen_flops_per_token(&m, &[]), all);
        let bitfit = patterns(&["*.weight"]);
        // Every weight: 12·d² a block's matrices, 2·d its norms; the tied head.
        let weights = 3.0 * (12.0 * d * d + 2.0 * d);
        assert_eq!(
            frozen_flops_per_token(&m, &bitfit),
            all - 2.0 * weights - 2.0 * v * d
        );
        let below = patterns(&["w*.weight", "h.0.*"]);
        let want = all - 2.0 * v * d - 4.0 * bp - 2.0 * attention;
        assert_eq!(frozen_flops_per_token(&m, &below), want);
    }

    #[test]
    fn worker_states_move_to_swap_files_as_offload_says() {
        let mut spec: JobSpec = serde_saphyr::from_str(
            "model: {vocab_size: 1000, d_model: 256, n_layers: 8, n_heads: 8, seq_len: 128}\n\
             data: {format: synthetic}\ntrain: {dtype: bf16}\nzero: {stage: 3}\n",
        )
        .unwrap();
        let psi = model_params(&spec.model);
        let plain = worker_states(&spec, 4);
        assert_eq!(plain.nvme, 0.0);
        assert!((plain.memory - 16.0 * psi / 4.0).abs() < 1.0);
        spec.zero.offload_optimizer.device = crate::spec::OffloadDevice::Nvme;
        let opt = worker_states(&spec, 4);
        let largest = largest_group(&spec.model);
        assert!((opt.nvme - 14.0 * psi / 4.0).abs() < 1.0);
        assert!((opt.memory + opt.nvme - plain.memory - 2.0 * largest / 4.0).abs() < 1.0);
        spec.zero.offload_param.device = crate::spec::OffloadDevice::Nvme;
        let both = worker_states(&spec, 4);
        assert!((both.nvme - 16.0 * psi / 4.0).abs() < 1.0);
        let working = 2.0 * 2.0 * largest + 2.0 * largest / 4.0;
        assert!((both.memory - working).abs() < 1.0);
        spec.zero.offload_param.device = crate::spec::OffloadDevice::Cpu;
        spec.zero.offload_optimizer.device = crate::spec::OffloadDevice::Cpu;
        assert_eq!(
            worker_states(&spec, 4),
            plain,
            "cpu offload on CPU workers changes nothing"
        );
        spec.zero.hpz_partition_size = 2;
        let hpz = worker_states(&spec, 4);
        // The paper's 3M -> 0.75M (M = 16-bit weights) at 2 nodes of 4, with
        // zrun's f32 gradients: stage 3 sends 3/4·(2 + 2 + 4)Ψ, ZeRO++
        // 3/4·Ψ + 1/2·Ψ/2.
        let s3 = CrossNodeBytes::stage3(psi, 2.0, (2, 2), 4.0, false);
        let pp = CrossNodeBytes::stage3(psi, 2.0, (2, 2), 4.0, true);
        assert!((s3.total() - 0.75 * 8.0 * psi).abs() < 1.0);
        assert!((pp.total() - (0.75 + 0.25) * psi).abs() < 1.0);
        assert_eq!(
            CrossNodeBytes::stage3(psi, 2.0, (1, 4), 4.0, false).total(),
            0.0
        );
        // bf16 reductions: one 2-byte partial of each chunk to the other node.
        let s3_16 = CrossNodeBytes::stage3(psi, 2.0, (2, 2), 2.0, false);
        assert!((s3_16.gradients - 0.5 * 2.0 * psi).abs() < 1.0);
        assert_eq!(s3_16.forward, s3.forward);
        assert!((hpz.memory - plain.memory - 2.0 * psi / 2.0).abs() < 1.0);
    }

    /// Lion keeps one moment: K = 8 in bf16 (master and m), 4 in f32,
    /// against AdamW's 12 and 8; on NVMe its files are 8Ψ/N, not 12Ψ/N.
    #[test]
    fn lion_keeps_four_bytes_less_optimizer_state_per_parameter() {
        let mut spec: JobSpec = serde_saphyr::from_str(
            "model: {vocab_size: 1000, d_model: 256, n_layers: 8, n_heads: 8, seq_len: 128}\n\
             data: {format: synthetic}\ntrain: {dtype: bf16, optimizer: {type: lion}}\n\
             zero: {stage: 3}\n",
        )
        .unwrap();
        let psi = model_params(&spec.model);
        assert!((worker_states(&spec, 4).memory - 12.0 * psi / 4.0).abs() < 1.0);
        spec.zero.offload_optimizer.device = crate::spec::OffloadDevice::Nvme;
        spec.zero.stage = ZeroStage::OptimizerStates;
        assert!((worker_states(&spec, 4).nvme - 8.0 * psi / 4.0).abs() < 1.0);
        spec.train.dtype = Dtype::F32;
        assert!((worker_states(&spec, 4).nvme - 4.0 * psi / 4.0).abs() < 1.0);
        let lion = StateBytes::for_job(&spec);
        assert_eq!((lion.param, lion.grad, lion.optimizer), (4.0, 4.0, 4.0));
        spec.train.optimizer.kind = OptimizerKind::Adagrad;
        assert_eq!(StateBytes::for_job(&spec), lion, "Adagrad keeps one sum");
    }

    #[test]
    fn offload_moves_optimizer_state_off_the_device() {
        let psi = 1e9;
        let rows = model_state_rows(psi, 2, 8, StateBytes::for_dtype(Dtype::Bf16), 1e7);
        let s2_cpu = rows
            .iter()
            .find(|r| r.stage == ZeroStage::Gradients && r.offload == "optimizer:cpu")
            .unwrap();
        assert_eq!(s2_cpu.bytes_per_device, 2.0 * psi + 2.0 * psi / 16.0);
        assert_eq!(s2_cpu.host_bytes_per_node, 12.0 * psi / 16.0 * 8.0);
        let inf = rows
            .iter()
            .find(|r| r.offload == "optimizer+param:nvme")
            .unwrap();
        assert_eq!(inf.bytes_per_device, 2.0 * 1e7);
        assert_eq!(
            inf.host_bytes_per_node + inf.nvme_bytes_per_node,
            16.0 * psi / 16.0 * 8.0
        );
    }
}
