//! NCCL between GPUs: the collectives of the resident flow on device buffers.
//!
//! Why not cudarc's `Comm`: its initialisation blocks until every rank has
//! joined, and its calls block where NCCL waits for a peer, with no deadline;
//! zrun promises a deadline for every blocking wait. So the communicator is
//! made in NCCL's non-blocking mode (`ncclConfig_t.blocking = 0`): every call
//! returns at once, and [`Nccl`] polls `ncclCommGetAsyncError` (and an event
//! on the stream, for the kernels) until the work is done, an error comes
//! back, or the deadline passes, when it aborts the communicator
//! (`ncclCommAbort`) and says which operation was in flight.
//!
//! The unique id (128 bytes that name rank 0's bootstrap address) is made by
//! rank 0 ([`NcclId::new`]) and handed to the other ranks by the caller over
//! zrun's authenticated host communicator.
//!
//! Ranks that share one GPU: NCCL refuses two ranks on one device of one host
//! ("Duplicate GPU detected"). Ranks given different `NCCL_HOSTID`s count as
//! different hosts to NCCL and talk over its socket transport; zworker sets
//! that for ranks that share a GPU ([`host_id_for_shared_gpu`]), which is how
//! a one-GPU machine runs NCCL at a world size of two (slowly: the bytes go
//! through the host's loopback).

use std::ffi::{c_void, CStr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, CudaViewMut, DevicePtrMut};
use cudarc::nccl::sys;

use crate::{CudaError, Gpu};

/// Why NCCL cannot be loaded, given the library path: cudarc opens
/// `libnccl.so`, which NCCL's pip wheel (the one PyTorch brings) lacks; it
/// has `libnccl.so.2` only. Where that lies in a directory of `ld_path`,
/// the message says which link to make.
fn no_nccl(ld_path: Option<&str>) -> String {
    let found = ld_path
        .into_iter()
        .flat_map(|p| p.split(':'))
        .filter(|d| !d.is_empty())
        .map(|d| std::path::Path::new(d).join("libnccl.so.2"))
        .find(|f| f.exists());
    match found {
        Some(f) => format!(
            "NCCL (libnccl.so) was not found, but {} is on LD_LIBRARY_PATH (NCCL's pip \
             wheel ships no libnccl.so): link it, e.g. `ln -s {} {}`",
            f.display(),
            f.display(),
            f.with_file_name("libnccl.so").display()
        ),
        None => "NCCL (libnccl.so) was not found: install NCCL (Debian/Ubuntu: libnccl2 and \
                 libnccl-dev), or `pip install nvidia-nccl-cu12` and link its lib/libnccl.so.2 \
                 as libnccl.so in a directory on LD_LIBRARY_PATH"
            .into(),
    }
}

/// NCCL's library is loadable.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { sys::is_culib_present() }
}

/// NCCL's version as `major·10000 + minor·100 + patch`, or what is missing.
pub fn nccl_version() -> Result<i32, CudaError> {
    if !nccl_present() {
        let ld_path = std::env::var("LD_LIBRARY_PATH").ok();
        return Err(CudaError::Missing(no_nccl(ld_path.as_deref())));
    }
    let mut v = 0;
    // SAFETY: writes one int.
    let r = unsafe { sys::ncclGetVersion(&mut v) };
    check(r, "reading NCCL's version")?;
    Ok(v)
}

/// Where ranks share a GPU, a host id of their own for NCCL (see the module
/// docs): `Some` when `local_world` ranks on this host have `gpus` GPUs
/// between them.
pub fn host_id_for_shared_gpu(
    node: &str,
    rank: usize,
    local_world: usize,
    gpus: usize,
) -> Option<String> {
    (local_world > gpus).then(|| format!("{node}:zrun-shared-gpu-rank{rank}"))
}

/// The 128 bytes by which ranks find one communicator.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl NcclId {
    /// A new id (rank 0 makes it; the others receive it).
    pub fn new() -> Result<NcclId, CudaError> {
        nccl_version()?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes one ncclUniqueId.
        let r = unsafe { sys::ncclGetUniqueId(&mut id) };
        check(r, "making NCCL's unique id")?;
        Ok(NcclId(id.internal.map(|c| c as u8)))
    }

    fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId {
            internal: self.0.map(|b| b as ::core::ffi::c_char),
        }
    }
}

/// The collectives, for byte accounting and messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclOp {
    /// Sum over ranks, every rank gets it.
    AllReduce,
    /// Sum over ranks, each rank gets its chunk.
    ReduceScatter,
    /// Each rank's chunk to every rank.
    AllGather,
}

impl NcclOp {
    /// The operation's name, as torch.distributed's.
    pub fn name(self) -> &'static str {
        match self {
            NcclOp::AllReduce => "all_reduce",
            NcclOp::ReduceScatter => "reduce_scatter",
            NcclOp::AllGather => "all_gather",
        }
    }

    /// Bytes a rank sends for `total` bytes of the whole buffer in a ring
    /// (nccl-tests' bus-bandwidth factors): all-reduce 2(n-1)/n, the others
    /// (n-1)/n.
    pub fn bytes_sent(self, total: u64, world: usize) -> u64 {
        let (n, w) = (world as u64, total);
        match self {
            NcclOp::AllReduce => 2 * w * (n - 1) / n,
            NcclOp::ReduceScatter | NcclOp::AllGather => w * (n - 1) / n,
        }
    }
}

/// What a collective's buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    /// f32 values, summed by the reductions.
    F32,
    /// bf16 or f16 values, only ever gathered.
    Bits16,
}

/// One rank's NCCL communicator on one GPU's stream.
pub struct Nccl {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// What was enqueued since the last [`Nccl::wait`] (for a hang's report).
    in_flight: Vec<String>,
    /// Bytes sent, by [`NcclOp`] as declared.
    sent: [u64; 3],
    /// Time [`Nccl::wait`] blocked, by the kind of the last operation
    /// enqueued before it (the callers wait on one kind at a time).
    waited: [Duration; 3],
    last_op: Option<NcclOp>,
    aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls
// on it do not overlap; every call here takes `&mut self` (or `self`).
unsafe impl Send for Nccl {}

impl Nccl {
    /// Joins communicator `id` as `rank` of `world` on `gpu`'s stream;
    /// fails after `timeout` if the other ranks have not all joined.
    pub fn init(
        gpu: &Gpu,
        rank: usize,
        world: usize,
        id: &NcclId,
        timeout: Duration,
    ) -> Result<Nccl, CudaError> {
        let version = nccl_version()?;
        if rank >= world {
            return Err(CudaError::Invalid(format!(
                "NCCL: rank {rank} of a world of {world}"
            )));
        }
        gpu.context()
            .bind_to_thread()
            .map_err(|source| CudaError::Driver {
                what: "binding the GPU for NCCL".into(),
                source,
            })?;
        let mut config = nonblocking_config(version);
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` outlive the call; NCCL copies the config.
        let r = unsafe {
            sys::ncclCommInitRankConfig(&mut comm, world as i32, id.raw(), rank as i32, &mut config)
        };
        let mut me = Nccl {
            comm,
            stream: gpu.stream().clone(),
            rank,
            world,
            timeout,
            in_flight: vec![format!("joining the communicator (rank {rank} of {world})")],
            sent: [0; 3],
            waited: [Duration::ZERO; 3],
            last_op: None,
            aborted: false,
        };
        if comm.is_null() {
            check(r, "creating the NCCL communicator")?;
            return Err(CudaError::Nccl(
                "creating the NCCL communicator returned no communicator".into(),
            ));
        }
        me.enqueued(r)?;
        me.settle(Instant::now() + timeout)?;
        me.in_flight.clear();
        Ok(me)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Bytes this rank sent, per [`NcclOp`] (nccl-tests' ring factors).
    pub fn bytes_sent(&self, op: NcclOp) -> u64 {
        self.sent[op as usize]
    }

    /// Time [`Nccl::wait`] blocked on operations of kind `op`.
    pub fn waited(&self, op: NcclOp) -> Duration {
        self.waited[op as usize]
    }

    /// Enqueues the sum over ranks of `buf`, in place; `what` names it in a
    /// hang's report. Done once [`Nccl::wait`] returns (or, for work on the
    /// same stream, in stream order).
    pub fn all_reduce_sum(
        &mut self,
        buf: &mut CudaViewMut<f32>,
        what: &str,
    ) -> Result<(), CudaError> {
        let n = buf.len();
        let stream = self.stream.clone();
        let (ptr, _sync) = buf.device_ptr_mut(&stream);
        // SAFETY: `ptr` holds the `n` values sent and received.
        unsafe { self.enqueue(NcclOp::AllReduce, Wire::F32, ptr, ptr, n, what) }
    }

    /// Enqueues the sum over ranks of `buf` (`world` equal chunks), this
    /// rank's chunk left in place (NCCL's in-place reduce-scatter); the
    /// other chunks are left undefined.
    pub fn reduce_scatter_sum_in_place(
        &mut self,
        buf: &mut CudaViewMut<f32>,
        what: &str,
    ) -> Result<(), CudaError> {
        let n = self.chunk_of(buf.len(), "reduce_scatter", what)?;
        let (stream, at) = (self.stream.clone(), (self.rank * n * 4) as u64);
        let (ptr, _sync) = buf.device_ptr_mut(&stream);
        // SAFETY: `buf` holds world·n values; the output is its chunk
        // `rank`, as NCCL's in-place form requires.
        unsafe { self.enqueue(NcclOp::ReduceScatter, Wire::F32, ptr, ptr + at, n, what) }
    }

    /// Enqueues every rank's chunk of `buf` (`world` equal chunks, this
    /// rank's at its index) into every rank's `buf` (NCCL's in-place
    /// all-gather).
    pub fn all_gather_in_place(
        &mut self,
        buf: &mut CudaViewMut<f32>,
        what: &str,
    ) -> Result<(), CudaError> {
        let n = self.chunk_of(buf.len(), "all_gather", what)?;
        let (stream, at) = (self.stream.clone(), (self.rank * n * 4) as u64);
        let (ptr, _sync) = buf.device_ptr_mut(&stream);
        // SAFETY: `buf` holds world·n values; the input is its chunk `rank`,
        // as NCCL's in-place form requires.
        unsafe { self.enqueue(NcclOp::AllGather, Wire::F32, ptr + at, ptr, n, what) }
    }

    /// [`Nccl::all_gather_in_place`] of 16-bit values (a bf16 or f16
    /// working copy), moved as they are: half the bytes of their f32
    /// values, as the host gathers them.
    pub fn all_gather16_in_place(
        &mut self,
        buf: &mut CudaViewMut<u16>,
        what: &str,
    ) -> Result<(), CudaError> {
        let n = self.chunk_of(buf.len(), "all_gather", what)?;
        let (stream, at) = (self.stream.clone(), (self.rank * n * 2) as u64);
        let (ptr, _sync) = buf.device_ptr_mut(&stream);
        // SAFETY: `buf` holds world·n 16-bit values; the input is its chunk
        // `rank`, as NCCL's in-place form requires.
        unsafe { self.enqueue(NcclOp::AllGather, Wire::Bits16, ptr + at, ptr, n, what) }
    }

    /// Calls NCCL's collective `op` on the stream: `count` values of `wire`
    /// per rank's chunk (all of them for an all-reduce).
    ///
    /// # Safety
    /// `send` and `recv` address buffers of `wire`'s values on this
    /// communicator's GPU of the lengths `op` reads and writes for `count`
    /// on this world size, live until the stream has run the collective;
    /// the reductions take f32 only.
    unsafe fn enqueue(
        &mut self,
        op: NcclOp,
        wire: Wire,
        send: u64,
        recv: u64,
        count: usize,
        what: &str,
    ) -> Result<(), CudaError> {
        let (s, r) = (send as *const c_void, recv as *mut c_void);
        let (f32, sum) = (sys::ncclDataType_t::ncclFloat32, sys::ncclRedOp_t::ncclSum);
        let (comm, stream) = (self.comm, self.stream.cu_stream() as _);
        // SAFETY: as the caller promises; 16-bit values are gathered as
        // bytes, which NCCL copies without reading them as numbers.
        let result = unsafe {
            match (op, wire) {
                (NcclOp::AllReduce, Wire::F32) => {
                    sys::ncclAllReduce(s, r, count, f32, sum, comm, stream)
                }
                (NcclOp::ReduceScatter, Wire::F32) => {
                    sys::ncclReduceScatter(s, r, count, f32, sum, comm, stream)
                }
                (NcclOp::AllGather, Wire::F32) => {
                    sys::ncclAllGather(s, r, count, f32, comm, stream)
                }
                (NcclOp::AllGather, Wire::Bits16) => {
                    let bytes = sys::ncclDataType_t::ncclUint8;
                    sys::ncclAllGather(s, r, 2 * count, bytes, comm, stream)
                }
                (_, Wire::Bits16) => {
                    return Err(CudaError::Invalid(format!(
                        "NCCL {} of {what}: 16-bit values are gathered, never summed",
                        op.name()
                    )))
                }
            }
        };
        let elems = match op {
            NcclOp::AllReduce => count,
            _ => count * self.world,
        };
        self.issued(op, wire, elems, what, result)
    }

    /// The chunk length of a `len`-value buffer split over the ranks.
    fn chunk_of(&self, len: usize, op: &str, what: &str) -> Result<usize, CudaError> {
        match len % self.world {
            0 => Ok(len / self.world),
            _ => Err(CudaError::Invalid(format!(
                "NCCL {op} of {what}: {len} values do not split over {} ranks",
                self.world
            ))),
        }
    }

    /// Waits, up to the communicator's timeout, until everything enqueued
    /// has finished on the GPU. At the deadline, or on an error NCCL reports
    /// (a peer gone), the communicator is aborted and the error names the
    /// operations in flight.
    pub fn wait(&mut self) -> Result<(), CudaError> {
        let started = Instant::now();
        let result = self.wait_until(started + self.timeout);
        if let Some(op) = self.last_op.take() {
            self.waited[op as usize] += started.elapsed();
        }
        result
    }

    fn wait_until(&mut self, deadline: Instant) -> Result<(), CudaError> {
        self.settle(deadline)?;
        let done = self
            .stream
            .record_event(None)
            .map_err(|source| CudaError::Driver {
                what: "recording an event after NCCL's work".into(),
                source,
            })?;
        let mut pause = Duration::from_micros(20);
        loop {
            match done.try_is_complete() {
                Ok(true) => break,
                Ok(false) => {}
                Err(source) => {
                    return Err(CudaError::Driver {
                        what: format!("waiting for NCCL: {}", self.in_flight.join(", ")),
                        source,
                    })
                }
            }
            let state = self.async_state()?;
            if state != sys::ncclResult_t::ncclSuccess && state != sys::ncclResult_t::ncclInProgress
            {
                return Err(self.failed(state));
            }
            if Instant::now() >= deadline {
                return Err(self.timed_out());
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        // A drained stream is not a success: a collective that failed can
        // end without its result (the CPU GPU's do, on a peer's exit), and
        // its error must not pass as done.
        let state = self.async_state()?;
        if state != sys::ncclResult_t::ncclSuccess && state != sys::ncclResult_t::ncclInProgress {
            return Err(self.failed(state));
        }
        self.in_flight.clear();
        Ok(())
    }

    /// Bookkeeping after a collective's call returned `r`.
    fn issued(
        &mut self,
        op: NcclOp,
        wire: Wire,
        elems: usize,
        what: &str,
        r: sys::ncclResult_t,
    ) -> Result<(), CudaError> {
        let (name, size) = match wire {
            Wire::F32 => ("f32", 4),
            Wire::Bits16 => ("16-bit", 2),
        };
        self.in_flight
            .push(format!("{} of {what} ({elems} {name})", op.name()));
        self.last_op = Some(op);
        self.sent[op as usize] += op.bytes_sent(size * elems as u64, self.world);
        self.enqueued(r)?;
        if r == sys::ncclResult_t::ncclInProgress {
            // Non-blocking mode: the next call waits for this one's enqueue.
            self.settle(Instant::now() + self.timeout)?;
        }
        Ok(())
    }

    /// A call's immediate result: success and in-progress pass.
    fn enqueued(&mut self, r: sys::ncclResult_t) -> Result<(), CudaError> {
        match r {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            e => Err(self.failed(e)),
        }
    }

    /// Polls until the communicator has no call in progress.
    fn settle(&mut self, deadline: Instant) -> Result<(), CudaError> {
        let mut pause = Duration::from_micros(20);
        loop {
            match self.async_state()? {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress => {}
                e => return Err(self.failed(e)),
            }
            if Instant::now() >= deadline {
                return Err(self.timed_out());
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn async_state(&mut self) -> Result<sys::ncclResult_t, CudaError> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is live (not aborted: every abort returns an error
        // that ends the communicator's use).
        let r = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        match r {
            sys::ncclResult_t::ncclSuccess => Ok(state),
            e => Err(self.failed(e)),
        }
    }

    /// Aborts and describes NCCL's error `e`.
    fn failed(&mut self, e: sys::ncclResult_t) -> CudaError {
        // SAFETY: NCCL's last-error text for this communicator, read before
        // the abort frees it.
        let detail = unsafe { c_text(sys::ncclGetLastError(self.comm)) };
        self.abort();
        CudaError::Nccl(format!(
            "NCCL failed on rank {} of {} during {}: {}{}; the communicator was aborted",
            self.rank,
            self.world,
            self.in_flight_text(),
            describe(e),
            if detail.is_empty() {
                String::new()
            } else {
                format!(" ({detail})")
            }
        ))
    }

    fn timed_out(&mut self) -> CudaError {
        self.abort();
        CudaError::Nccl(format!(
            "NCCL on rank {} of {}: {} did not finish within comm.timeout_s = {} s (a peer gone or stuck?); the communicator was aborted",
            self.rank,
            self.world,
            self.in_flight_text(),
            self.timeout.as_secs_f64()
        ))
    }

    fn in_flight_text(&self) -> String {
        match self.in_flight.len() {
            0 => "no operation".into(),
            1..=4 => self.in_flight.join(", "),
            n => format!("{}, and {} more", self.in_flight[..3].join(", "), n - 3),
        }
    }

    fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: `comm` is live; aborting twice is prevented above.
            unsafe { sys::ncclCommAbort(self.comm) };
        }
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // Abort frees the communicator without waiting for the other ranks
        // (`ncclCommDestroy` would, in non-blocking mode, need polling).
        self.abort();
    }
}

/// NCCL's config with `blocking = 0` and every other field "undefined"
/// (NCCL's defaults), as `NCCL_CONFIG_INITIALIZER` makes it. Fields are only
/// ever appended, so the library is told the version and size of the prefix
/// it knows (2.27's config ends before `nChannelsPerNetPeer`, 2.28's before
/// `graphUsageMode`).
fn nonblocking_config(library_version: i32) -> sys::ncclConfig_t {
    use std::mem::{offset_of, size_of};
    type C = sys::ncclConfig_t;
    const UNDEF: i32 = i32::MIN;
    let (version, size) = match library_version {
        v if v >= 23000 => (23000, size_of::<C>()),
        v if v >= 22800 => (22800, offset_of!(C, graphUsageMode)),
        v => (v.max(0) as u32, offset_of!(C, nChannelsPerNetPeer)),
    };
    C {
        size,
        magic: 0xcafe_beef,
        version,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

fn check(r: sys::ncclResult_t, what: &str) -> Result<(), CudaError> {
    match r {
        sys::ncclResult_t::ncclSuccess => Ok(()),
        e => Err(CudaError::Nccl(format!("{what}: {}", describe(e)))),
    }
}

fn describe(e: sys::ncclResult_t) -> String {
    // SAFETY: NCCL returns a static string for every result code.
    let text = unsafe { c_text(sys::ncclGetErrorString(e)) };
    format!("{e:?} ({text})")
}

/// # Safety
/// `p` is null or a NUL-terminated string that lives through the call.
unsafe fn c_text(p: *const ::core::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_follow_nccl_tests_ring_factors() {
        assert_eq!(NcclOp::AllReduce.bytes_sent(4000, 1), 0);
        assert_eq!(NcclOp::AllReduce.bytes_sent(4000, 2), 4000);
        assert_eq!(NcclOp::AllReduce.bytes_sent(4000, 4), 6000);
        assert_eq!(NcclOp::ReduceScatter.bytes_sent(4000, 4), 3000);
        assert_eq!(NcclOp::AllGather.bytes_sent(4000, 2), 2000);
    }

    /// NCCL's pip wheel on LD_LIBRARY_PATH: the message names its
    /// libnccl.so.2 and the link to make; without it, how to install NCCL.
    #[test]
    fn a_wheels_libnccl_so_2_on_the_path_is_named_with_the_link_to_make() {
        let (empty, wheel) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let so2 = wheel.path().join("libnccl.so.2");
        std::fs::write(&so2, b"").unwrap();
        let path = format!("{}::{}", empty.path().display(), wheel.path().display());
        let msg = no_nccl(Some(&path));
        let link = wheel.path().join("libnccl.so");
        assert!(
            msg.contains(&format!("`ln -s {} {}`", so2.display(), link.display())),
            "{msg}"
        );
        for path in [None, Some(empty.path().to_str().unwrap())] {
            let msg = no_nccl(path);
            assert!(
                msg.contains("install NCCL") && !msg.contains("ln -s"),
                "{msg}"
            );
        }
    }

    /// The sizes NCCL's headers give each version's config (72 bytes in
    /// 2.27, 80 in 2.28-2.29, 96 in 2.30), so that the prefix told to an
    /// older library is the one it knows.
    #[test]
    fn the_config_is_cut_to_the_librarys_version() {
        let c = |v| {
            let c = nonblocking_config(v);
            (c.version, c.size, c.blocking)
        };
        assert_eq!(c(22703), (22703, 72, 0));
        assert_eq!(c(22805), (22800, 80, 0));
        assert_eq!(c(23001), (23000, 96, 0));
    }

    #[test]
    fn only_ranks_that_share_a_gpu_get_a_host_id_of_their_own() {
        assert_eq!(host_id_for_shared_gpu("n0", 3, 2, 2), None);
        assert_eq!(host_id_for_shared_gpu("n0", 3, 8, 8), None);
        let a = host_id_for_shared_gpu("n0", 0, 2, 1).unwrap();
        let b = host_id_for_shared_gpu("n0", 1, 2, 1).unwrap();
        assert_ne!(a, b);
    }
}
