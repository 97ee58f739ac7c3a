//! `zrun bench comm`: time each collective at each size on the real transport.
//!
//! Each measurement runs a warm-up call, then repeats the call as often as fits in
//! about 0.3 s (3 to 50 calls, the same count on every rank), with a barrier before each timed call so that
//! ranks start together; the reported time is the median over calls of the
//! slowest rank (all ranks agree on it through an all-gather). Bus bandwidth
//! follows nccl-tests: all_reduce algbw·2(n-1)/n, reduce_scatter and all_gather
//! algbw·(n-1)/n, all_to_all algbw·(n-1)/n, broadcast algbw. all_gather runs
//! in place into an output made before the clock starts, as nccl-tests and
//! torch's preallocated outputs measure it. `all_reduce_bf16`,
//! `reduce_scatter_f16` and the like time the reductions in 16 bits on the
//! wire (`train.reduce_dtype`) on the same f32 buffers, so that their bus
//! bandwidth (of the f32 bytes reduced) compares with the f32 rows'. References:
//! `memcpy` (one thread copying the bytes) and, for TCP, `tcp_stream` (one
//! plain loopback socket, what the transport could carry).
//!
//! NCCL (`--transports nccl`, a zworker built with `cuda`) is timed on
//! buffers in GPU memory, in place, the way nccl-tests times it: after a
//! barrier a batch of calls is enqueued back to back and waited for once
//! (a wait polls, so a call timed alone would carry the poll's delay), the
//! time per call is the batch's over its calls, and the row is the median
//! of five batches of the slowest rank (`gpu::bench_nccl`). Each size is
//! checked first: one call on known values, its result compared whole.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use zcomm::{Communicator, Op};
use zproto::{BenchCommTask, BenchRow, ToServer};

use crate::control::ControlClient;
use crate::env::WorkerEnv;

/// Time spent timing one (op, size) pair, roughly.
pub(crate) const BUDGET: Duration = Duration::from_millis(300);

/// Runs the benchmark; rank 0 reports the rows.
pub fn bench_comm(
    task: &BenchCommTask,
    comm: Arc<dyn Communicator>,
    env: &WorkerEnv,
    client: &ControlClient,
) -> Result<()> {
    let (n, r) = (comm.world_size(), comm.rank());
    let mut rows = match task.transport.as_str() {
        "nccl" => crate::gpu::bench_nccl(task, comm.as_ref(), env)?,
        _ => host_rows(task, comm.as_ref())?,
    };
    if task.transport == "tcp" && n >= 2 {
        rows.extend(tcp_stream_rows(&task.sizes, comm.as_ref())?);
    }
    if r == 0 {
        // The reference the transports are judged against: one thread copying
        // the same bytes within this process.
        for &bytes in &task.sizes {
            let src = vec![1u8; bytes as usize];
            let mut dst = vec![0u8; bytes as usize];
            dst.copy_from_slice(&src); // fault the pages in
            let secs = (0..5)
                .map(|_| {
                    let t0 = Instant::now();
                    dst.copy_from_slice(std::hint::black_box(&src));
                    t0.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min);
            let gbps = bytes as f64 / secs / 1e9;
            rows.push(BenchRow {
                op: "memcpy".into(),
                bytes,
                workers: 1,
                transport: "local".into(),
                time_us: secs * 1e6,
                algbw_gbps: gbps,
                busbw_gbps: gbps,
            });
        }
        client.send(&ToServer::BenchRows(rows))?;
    }
    Ok(())
}

/// The rows of the host transports (TCP, shared memory, MPI): each call
/// timed alone after a barrier.
fn host_rows(task: &BenchCommTask, comm: &dyn Communicator) -> Result<Vec<BenchRow>> {
    let n = comm.world_size();
    let mut rows = Vec::new();
    for name in &task.ops {
        let Some((op, wire)) = Op::from_bench_name(name) else {
            bail!("unknown op `{name}`");
        };
        let half = wire.and_then(zengine::precision::half_of);
        for &bytes in &task.sizes {
            let elems = (bytes / 4) as usize;
            // Inputs are made before the clock starts (nccl-tests does not time
            // allocation either); each call consumes its own copy.
            // all_gather runs in place, into an output the caller holds, as
            // nccl-tests and gloo's all_gather (torch's preallocated outputs) do.
            let input = vec![1.0f32; elems];
            // Inputs are copied before the barrier that starts each call, so that
            // every rank starts the collective at once; each is written once
            // (a broadcast's too), so no call's time is its pages faulting in.
            let call = |c: &dyn Communicator| -> Result<f64> {
                let (f, p, b) = match op {
                    Op::AllToAll => (
                        Vec::new(),
                        vec![vec![0u8; bytes as usize / n]; n],
                        Vec::new(),
                    ),
                    Op::Broadcast => (Vec::new(), Vec::new(), vec![1u8; bytes as usize]),
                    _ => (input.clone(), Vec::new(), Vec::new()),
                };
                c.barrier()?;
                // Outputs are freed after the clock stops.
                let t0 = Instant::now();
                let (secs, out): (f64, Box<dyn std::any::Any>) = match op {
                    Op::AllReduce => match half {
                        Some(h) => timed(t0, c.half_all_reduce_async(f, h).wait()?),
                        None => timed(t0, c.all_reduce(f)?),
                    },
                    Op::ReduceScatter => match half {
                        Some(h) => timed(t0, c.half_reduce_scatter_async(f, h).wait()?),
                        None => timed(t0, c.reduce_scatter(f)?),
                    },
                    Op::AllGather => timed(t0, c.all_gather_in_place(f)?),
                    Op::AllToAll => timed(t0, c.all_to_all(p)?),
                    Op::Broadcast => timed(t0, c.broadcast(b, 0)?),
                    Op::Barrier => bail!("barrier moves no data to time"),
                    Op::QuantizedReduceScatter => {
                        bail!("quantized_reduce_scatter is not benchmarked alone")
                    }
                };
                drop(out);
                Ok(secs)
            };
            let warm = call(comm)?;
            let calls = agree_calls(comm, warm, BUDGET)?;
            let times = (0..calls)
                .map(|_| call(comm).map(|s| s as f32))
                .collect::<Result<Vec<f32>>>()?;
            let secs = slowest_median(comm, &times)?;
            // Named as asked (`all_reduce_bf16`); its bytes are the f32
            // buffer's, so that its bus bandwidth compares with f32's row.
            rows.push(BenchRow {
                op: name.clone(),
                ..row(op, bytes, n, &task.transport, secs)
            });
        }
    }
    Ok(rows)
}

/// Warm up, and agree on how many calls of the slowest rank's `warm`
/// seconds fit in `budget` (3 to 50: every rank must make the same number
/// of calls).
pub(crate) fn agree_calls(comm: &dyn Communicator, warm: f64, budget: Duration) -> Result<usize> {
    let n = comm.world_size();
    let warm = comm
        .all_gather(vec![warm as f32], n)?
        .into_iter()
        .fold(0.0, f32::max);
    Ok(((budget.as_secs_f32() / warm.max(1e-6)) as usize).clamp(3, 50))
}

/// The median over `times` (each rank's, in the same order) of the slowest
/// rank's time, which every rank agrees on.
pub(crate) fn slowest_median(comm: &dyn Communicator, times: &[f32]) -> Result<f64> {
    let n = comm.world_size();
    let all = comm.all_gather(times.to_vec(), times.len() * n)?;
    let mut slowest: Vec<f32> = (0..times.len())
        .map(|i| (0..n).map(|k| all[k * times.len() + i]).fold(0.0, f32::max))
        .collect();
    slowest.sort_by(f32::total_cmp);
    Ok(f64::from(slowest[slowest.len() / 2]))
}

/// A row for `op` moving `bytes` between `n` ranks in `secs`, with
/// nccl-tests' bus-bandwidth factor.
pub(crate) fn row(op: Op, bytes: u64, n: usize, transport: &str, secs: f64) -> BenchRow {
    let algbw = bytes as f64 / secs / 1e9;
    BenchRow {
        op: op.name().to_string(),
        bytes,
        workers: n,
        transport: transport.to_string(),
        time_us: secs * 1e6,
        algbw_gbps: algbw,
        busbw_gbps: algbw * op.bus_factor(n),
    }
}

/// The reference for the TCP transport: one plain loopback stream from rank 0
/// to rank 1 (no framing, no collective, no reduction), the best of 3 sends of
/// each size, each timed until rank 1 acknowledges the last byte. Rows come
/// back on rank 0 only; ranks past 1 only take part in the collectives.
fn tcp_stream_rows(sizes: &[u64], comm: &dyn Communicator) -> Result<Vec<BenchRow>> {
    use std::io::{Read, Write};
    let r = comm.rank();
    let deadline = comm.timeout();
    let listener = (r == 1)
        .then(|| std::net::TcpListener::bind("127.0.0.1:0"))
        .transpose()?;
    let addr = match &listener {
        Some(l) => l.local_addr()?.to_string(),
        None => String::new(),
    };
    let addr = String::from_utf8(comm.broadcast(addr.into_bytes(), 1)?)?;
    let mut rows = Vec::new();
    if r == 0 {
        let mut s = std::net::TcpStream::connect(&addr)?;
        s.set_read_timeout(Some(deadline))?;
        s.set_write_timeout(Some(deadline))?;
        for &bytes in sizes {
            let buf = vec![1u8; bytes as usize];
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t0 = Instant::now();
                s.write_all(&buf)?;
                s.read_exact(&mut [0u8; 1])?;
                best = best.min(t0.elapsed().as_secs_f64());
            }
            let gbps = bytes as f64 / best / 1e9;
            rows.push(BenchRow {
                op: "tcp_stream".into(),
                bytes,
                workers: 2,
                transport: "tcp".into(),
                time_us: best * 1e6,
                algbw_gbps: gbps,
                busbw_gbps: gbps,
            });
        }
    } else if let Some(l) = listener {
        l.set_nonblocking(true)?;
        let until = Instant::now() + deadline;
        let mut s = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => bail!("tcp_stream: rank 0 did not connect: {e}"),
            }
        };
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(deadline))?;
        s.set_write_timeout(Some(deadline))?;
        let mut buf = vec![0u8; sizes.iter().copied().max().unwrap_or(0) as usize];
        for &bytes in sizes {
            for _ in 0..3 {
                s.read_exact(&mut buf[..bytes as usize])?;
                s.write_all(&[1])?;
            }
        }
    }
    comm.barrier()?;
    Ok(rows)
}

/// Seconds since `t0`, and the output to free later.
fn timed<T: 'static>(t0: Instant, out: T) -> (f64, Box<dyn std::any::Any>) {
    (t0.elapsed().as_secs_f64(), Box::new(out))
}
