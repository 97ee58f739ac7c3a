//! NCCL's collectives against the host's sums, at a world size of two on one
//! GPU: this test starts two copies of its own executable (each running
//! [`nccl_rank`] as one rank, with its own `NCCL_HOSTID`, see `nccl`'s docs),
//! and each checks its results. Two ranks add each value once (`a + b`, which
//! does not depend on the order), so the host's sum is the oracle to the bit.
//! The last collective is issued by rank 0 alone, rank 1 alive but silent:
//! its deadline must end it, abort the communicator and name it. A second
//! pair of ranks checks the other way a peer fails: rank 1 exits, and rank
//! 0's collective must end at once with NCCL's remote error, well before
//! its deadline. Skipped without a GPU or NCCL (mandatory under
//! `ZRUN_REQUIRE_GPU=1`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::*;

const RANK_VAR: &str = "ZRUN_NCCL_TEST_RANK";
const DIR_VAR: &str = "ZRUN_NCCL_TEST_DIR";
/// `exit`: the ranks of [`a_peer_that_exits_ends_the_collective_at_once`].
const SCENARIO_VAR: &str = "ZRUN_NCCL_TEST_SCENARIO";
/// The deadline of the collective that only rank 0 issues.
const LONE_TIMEOUT: Duration = Duration::from_secs(5);

/// Finite values over many magnitudes, subnormals and signed zeros among
/// them, different per `seed`.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|i| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            match i % 61 {
                0 => 0.0,
                1 => -0.0,
                2 => f32::from_bits(s >> 9), // subnormal
                _ => f32::from_bits(((s >> 1) % 0x7E80_0000) | (s << 31)),
            }
        })
        .collect()
}

fn same_bits(got: &[f32], want: &[f32]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
}

#[test]
fn nccl_collectives_equal_the_hosts_sums_at_two_ranks() {
    run_ranks("nccl_collectives_equal_the_hosts_sums", "sums");
}

#[test]
fn a_peer_that_exits_ends_the_collective_at_once() {
    run_ranks("a_peer_that_exits_ends_the_collective_at_once", "exit");
}

/// Runs [`nccl_rank`] as two processes in `scenario`; each checks its own
/// results and exits 0 if they hold.
fn run_ranks(test: &str, scenario: &str) {
    let have = probe()
        .usable_devices()
        .and_then(|n| nccl_version().map(|_| n).map_err(|e| e.to_string()));
    if !gpu_or_skip(test, have) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<Child> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "tests_nccl::nccl_rank", "--nocapture"])
                .env(RANK_VAR, rank.to_string())
                .env(DIR_VAR, dir.path())
                .env(SCENARIO_VAR, scenario)
                .env(
                    "NCCL_HOSTID",
                    host_id_for_shared_gpu("test", rank, 2, 1).unwrap(),
                )
                .env("NCCL_SOCKET_IFNAME", "lo")
                .spawn()
                .expect("starting a rank")
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut codes = vec![None, None];
    while codes.iter().any(Option::is_none) && Instant::now() < deadline {
        for (c, code) in children.iter_mut().zip(&mut codes) {
            if code.is_none() {
                *code = c.try_wait().unwrap().map(|s| s.success());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (c, code) in children.iter_mut().zip(&codes) {
        if code.is_none() {
            let _ = c.kill(); // our own child, by its handle
            let _ = c.wait();
        }
    }
    assert_eq!(
        codes,
        vec![Some(true), Some(true)],
        "the ranks' results (see their output)"
    );
}

/// One rank of the test above; does nothing when run on its own.
#[test]
fn nccl_rank() {
    let Ok(rank) = std::env::var(RANK_VAR) else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let dir = PathBuf::from(std::env::var(DIR_VAR).unwrap());
    let id = exchange_id(rank, &dir);
    let gpu = Gpu::open(0).expect("opening GPU 0");
    let timeout = if rank == 0 {
        LONE_TIMEOUT
    } else {
        Duration::from_secs(60)
    };
    let mut nccl = Nccl::init(&gpu, rank, 2, &id, timeout).expect("joining");
    assert_eq!((nccl.rank(), nccl.world_size()), (rank, 2));
    if std::env::var(SCENARIO_VAR).as_deref() == Ok("exit") {
        return peer_exits(rank, &gpu, nccl);
    }

    let mut expect_bytes = [0u64; 3];
    for (i, n) in [1usize, 7, 4096, (1 << 20) + 3].into_iter().enumerate() {
        let mine = |r: usize| values(n, (i * 10 + r) as u32);
        let sum: Vec<f32> = mine(0).iter().zip(mine(1)).map(|(a, b)| a + b).collect();

        let mut buf = gpu.upload(&mine(rank)).unwrap();
        nccl.all_reduce_sum(&mut buf.slice_mut(..), "test values")
            .unwrap();
        nccl.wait().unwrap();
        assert!(
            same_bits(&gpu.download(&buf).unwrap(), &sum),
            "all_reduce of {n}"
        );
        expect_bytes[NcclOp::AllReduce as usize] += 4 * n as u64; // 2·(n-1)/n = 1

        let whole = |r: usize| values(2 * n, (i * 10 + 5 + r) as u32);
        let mut buf = gpu.upload(&whole(rank)).unwrap();
        nccl.reduce_scatter_sum_in_place(&mut buf.slice_mut(..), "test values")
            .unwrap();
        nccl.wait().unwrap();
        let own: Vec<f32> = whole(0)[rank * n..(rank + 1) * n]
            .iter()
            .zip(&whole(1)[rank * n..(rank + 1) * n])
            .map(|(a, b)| a + b)
            .collect();
        let got = gpu.download(&buf).unwrap();
        assert!(
            same_bits(&got[rank * n..(rank + 1) * n], &own),
            "reduce_scatter of {n}"
        );
        expect_bytes[NcclOp::ReduceScatter as usize] += 4 * n as u64;

        // This rank's chunk in place, the other NaN until the gather.
        let mut start = vec![f32::NAN; 2 * n];
        start[rank * n..(rank + 1) * n].copy_from_slice(&mine(rank));
        let mut all = gpu.upload(&start).unwrap();
        nccl.all_gather_in_place(&mut all.slice_mut(..), "test values")
            .unwrap();
        nccl.wait().unwrap();
        let both: Vec<f32> = mine(0).into_iter().chain(mine(1)).collect();
        assert!(
            same_bits(&gpu.download(&all).unwrap(), &both),
            "all_gather of {n}"
        );
        expect_bytes[NcclOp::AllGather as usize] += 4 * n as u64;

        // 16-bit words (any bits, NaN patterns among them) move unchanged.
        let words = |r: usize| -> Vec<u16> { mine(r).iter().map(|x| x.to_bits() as u16).collect() };
        let mut start = vec![0x7FC1u16; 2 * n];
        start[rank * n..(rank + 1) * n].copy_from_slice(&words(rank));
        let mut all = gpu.upload(&start).unwrap();
        nccl.all_gather16_in_place(&mut all.slice_mut(..), "test words")
            .unwrap();
        nccl.wait().unwrap();
        let both: Vec<u16> = words(0).into_iter().chain(words(1)).collect();
        assert_eq!(
            gpu.download(&all).unwrap(),
            both,
            "16-bit all_gather of {n}"
        );
        expect_bytes[NcclOp::AllGather as usize] += 2 * n as u64;
    }
    for op in [NcclOp::AllReduce, NcclOp::ReduceScatter, NcclOp::AllGather] {
        assert_eq!(
            nccl.bytes_sent(op),
            expect_bytes[op as usize],
            "{}",
            op.name()
        );
        assert!(
            nccl.waited(op) > Duration::ZERO,
            "{}: no wait counted",
            op.name()
        );
    }
    let bad = nccl.all_gather_in_place(&mut gpu.zeros(5).unwrap().slice_mut(..), "x");
    assert!(
        matches!(bad, Err(CudaError::Invalid(_))),
        "a buffer that does not split over the ranks is refused"
    );

    if rank == 1 {
        // Alive but silent: rank 0's next collective can only end at its
        // deadline (a peer that exits instead ends it sooner, with NCCL's
        // "remote process exited", which the first GPU run of this test saw).
        std::thread::sleep(LONE_TIMEOUT + Duration::from_secs(5));
        return;
    }
    let mut buf = gpu.upload(&values(1000, 99)).unwrap();
    let started = Instant::now();
    let err = nccl
        .all_reduce_sum(&mut buf.slice_mut(..), "the lone collective")
        .and_then(|()| nccl.wait())
        .expect_err("a collective no peer joins must fail");
    let waited = started.elapsed();
    let text = err.to_string();
    eprintln!("rank 0 alone: {text} (after {waited:.1?})");
    assert!(
        text.contains("all_reduce of the lone collective (1000 f32) did not finish within")
            && text.contains("aborted"),
        "{text}"
    );
    assert!(
        waited >= LONE_TIMEOUT && waited < LONE_TIMEOUT + Duration::from_secs(3),
        "{waited:?}"
    );
}

/// One collective together; then rank 1 exits (its process ends with this
/// test) and rank 0's next collective must fail with NCCL's remote error
/// before its deadline, naming the operation.
fn peer_exits(rank: usize, gpu: &Gpu, mut nccl: Nccl) {
    let mut buf = gpu.upload(&values(1000, 7)).unwrap();
    nccl.all_reduce_sum(&mut buf.slice_mut(..), "the shared collective")
        .unwrap();
    nccl.wait().unwrap();
    if rank == 1 {
        return;
    }
    let started = Instant::now();
    let err = nccl
        .all_reduce_sum(&mut buf.slice_mut(..), "the orphaned collective")
        .and_then(|()| nccl.wait())
        .expect_err("a collective whose peer exited must fail");
    let waited = started.elapsed();
    let text = err.to_string();
    eprintln!("rank 0 after its peer exited: {text} (after {waited:.1?})");
    assert!(
        text.contains("all_reduce of the orphaned collective") && text.contains("remote"),
        "{text}"
    );
    assert!(
        waited < LONE_TIMEOUT,
        "{waited:?}: the deadline ended it, not the peer's exit"
    );
}

/// Rank 0 makes the id and writes it to `dir`; rank 1 reads it (written
/// under another name first, then renamed, so never read half-written).
fn exchange_id(rank: usize, dir: &Path) -> NcclId {
    let path = dir.join("nccl-id");
    if rank == 0 {
        let id = NcclId::new().expect("making NCCL's id");
        std::fs::write(dir.join("nccl-id.partial"), id.0).unwrap();
        std::fs::rename(dir.join("nccl-id.partial"), &path).unwrap();
        return id;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(bytes) = std::fs::read(&path) {
            return NcclId(bytes.try_into().expect("128 bytes"));
        }
        assert!(Instant::now() < deadline, "no NCCL id from rank 0");
        std::thread::sleep(Duration::from_millis(20));
    }
}
