//! The training loop: data, engine, one report per optimizer step.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use zcomm::Communicator;
use zconfig::JobSpec;
use zengine::Engine;
use zmodel::{Batcher, Corpus};
use zproto::{StepReport, ToServer};

use crate::control::ControlClient;
use crate::env::WorkerEnv;

/// Trains `spec` on this rank and reports each step.
pub fn train(
    spec: &JobSpec,
    env: &WorkerEnv,
    comm: Arc<dyn Communicator>,
    client: &ControlClient,
) -> Result<()> {
    let t = &spec.train;
    let corpus = Corpus::load(
        &spec.data.path,
        spec.data.format,
        spec.model.vocab_size,
        t.seed,
    )?;
    let mut data = Batcher::new(
        corpus,
        spec.model.seq_len,
        t.micro_batch_size,
        t.grad_accum,
        env.world_size,
        env.rank,
        t.seed,
    )?;
    let mut engine = Engine::new(spec, comm)?;
    let params = engine.model().param_count() as u64;
    let flops_per_token = engine.model().flops_per_token();
    for s in 0..t.steps {
        let started = Instant::now();
        for micro in 0..t.grad_accum {
            engine.forward_backward(&data.batch(s, micro))?;
        }
        let st = engine.step()?;
        let step_ms = started.elapsed().as_secs_f64() * 1e3;
        client.send(&ToServer::Report(StepReport {
            step: st.step,
            loss: st.loss,
            lr: st.lr,
            grad_norm: st.grad_norm,
            step_ms,
            tokens: st.tokens,
            flops: st.tokens as f64 * flops_per_token,
            params,
            zero_stage: spec.zero.stage,
            mem: st.mem,
            comm: st.comm,
            loss_scale: None,
        }))?;
    }
    Ok(())
}
