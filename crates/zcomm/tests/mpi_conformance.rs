//! The collective conformance suite on the MPI transport (cargo feature `mpi`):
//! real processes under `mpirun --oversubscribe` on this host, world sizes 1-5,
//! one or two simulated nodes, lengths that do not divide evenly and that pass
//! several MiB.
//!
//! Each rank checks its own results (against a naive f64 sum, exact patterns,
//! byte counts) and writes the bits of what it computed to a file. This test
//! then checks that every rank holds the same bits, and the same bits as the
//! TCP transport gives in this process for the same inputs: the ring runs in
//! zrun's order on both, which is what keeps ZeRO's stages bit-identical on MPI.
//!
//! Without `mpirun` the tests print that they skipped; with
//! `ZRUN_REQUIRE_MPI=1` (CI) they fail instead.

#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zcomm::mpi::{MpiCommunicator, MpiOptions, Runtime};
use zcomm::{
    chunk_range, CommError, Communicator, ErrorFeedback, Half, Op, Quantization, TcpCommunicator,
    TcpOptions,
};
use zquant::Bits;

const SLOT: usize = (1 << 20) / 4;
const LENS: [usize; 8] = [0, 1, 3, 7, 1000, 4099, 3 * SLOT + 17, 2_500_003];
const QGZ: Quantization = Quantization {
    bits: Bits::Int8,
    block_size: 16,
};

fn random(seed: u64, len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn naive_sum(n: usize, len: usize) -> Vec<f64> {
    let mut s = vec![0f64; len];
    for r in 0..n {
        for (a, b) in s.iter_mut().zip(random(r as u64, len)) {
            *a += f64::from(b);
        }
    }
    s
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what} element {i}: {g} vs {w}"
        );
    }
}

/// FNV-1a over the floats' bits.
fn bits_hash(v: &[f32]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3)
    })
}

/// Three qgZ reductions of this rank's data of `len` through one LoCo
/// feedback, as a line of the third's bits' hash (which carry the errors
/// the first two kept).
fn loco_line(c: &dyn Communicator, len: usize) -> String {
    let feedback = Arc::new(Mutex::new(ErrorFeedback::new(0.8, 1000)));
    let mut q = Vec::new();
    for _ in 0..3 {
        let x = random(c.rank() as u64, len);
        q = (c.quantized_reduce_scatter(x, QGZ, Some(feedback.clone()))).unwrap();
    }
    format!("loco {len} {:x}", bits_hash(&q))
}

/// The bf16 reduce-scatter and all-reduce of this rank's data of `len`, as
/// a line of their bits' hashes; the all-reduce's own chunk is checked to
/// be the reduce-scatter's.
fn half_line(c: &dyn Communicator, len: usize) -> String {
    let (n, r) = (c.world_size(), c.rank());
    let rs = c
        .half_reduce_scatter_async(random(r as u64, len), Half::Bf16)
        .wait()
        .unwrap();
    let ar = c
        .half_all_reduce_async(random(r as u64, len), Half::Bf16)
        .wait()
        .unwrap();
    assert_eq!(
        ar[chunk_range(len, n, r)],
        rs[..],
        "rank {r} of {n}, len {len}"
    );
    format!("half {len} {:x} {:x}", bits_hash(&rs), bits_hash(&ar))
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// One rank of a case; started by the tests below under `mpirun`.
#[test]
#[ignore = "one rank of the MPI suite: the tests below start it under mpirun"]
fn rank_main() {
    let rt = Runtime::init().unwrap();
    let nodes: Vec<usize> = env("ZCOMM_MPI_NODES")
        .split(',')
        .map(|n| n.parse().unwrap())
        .collect();
    let out = PathBuf::from(env("ZCOMM_MPI_OUT")).join(format!("rank{}", rt.rank()));
    let timeout = Duration::from_secs_f64(env("ZCOMM_MPI_TIMEOUT").parse().unwrap());
    let opts = MpiOptions {
        timeout,
        node_of_rank: nodes,
        group: "world".into(),
    };
    let comm = MpiCommunicator::world(&rt, opts.clone()).unwrap();
    let lines = match env("ZCOMM_MPI_CASE").as_str() {
        "collectives" => collectives(&comm),
        "mismatch" => mismatch(&rt, &comm, &opts),
        "timeout" => timeout_case(&comm),
        other => panic!("unknown case {other}"),
    };
    std::fs::write(out, lines.join("\n") + "\n").unwrap();
    drop(comm);
}

/// Every collective, checked here; returns `all_reduce LEN HASH`,
/// `qgz LEN HASH` and `loco LEN HASH` lines for the cross-rank and
/// cross-transport checks.
fn collectives(c: &MpiCommunicator) -> Vec<String> {
    let (n, r) = (c.world_size(), c.rank());
    let mut lines = Vec::new();
    for len in LENS {
        let what = format!("rank {r} of {n}, len {len}");
        let full = c.all_reduce(random(r as u64, len)).unwrap();
        let want = naive_sum(n, len);
        assert_close(&full, &want, &what);
        let mine = c.reduce_scatter(random(r as u64, len)).unwrap();
        assert_close(&mine, &want[chunk_range(len, n, r)], &what);
        let mut buf = vec![f32::NAN; len];
        buf[chunk_range(len, n, r)].copy_from_slice(&mine);
        let in_place = c.all_gather_in_place(buf).unwrap();
        let gathered = c.all_gather(mine, len).unwrap();
        assert_eq!(
            gathered, full,
            "{what}: reduce-scatter + all-gather != all-reduce"
        );
        assert_eq!(in_place, full, "{what}: all-gather in place");
        lines.push(format!("all_reduce {len} {:x}", bits_hash(&full)));
        let q = c
            .quantized_reduce_scatter(random(r as u64, len), QGZ, None)
            .unwrap();
        lines.push(format!("qgz {len} {:x}", bits_hash(&q)));
        lines.push(loco_line(c, len));
        lines.push(half_line(c, len));
        // all_gather of an exact pattern: element i comes from its owner.
        let own = chunk_range(len, n, r);
        let chunk: Vec<f32> = own.map(|i| (i * 10 + r) as f32).collect();
        let got = c.all_gather(chunk, len).unwrap();
        for (i, g) in got.iter().enumerate() {
            let owner = (0..n)
                .find(|&o| chunk_range(len, n, o).contains(&i))
                .unwrap();
            assert_eq!(
                *g,
                (i * 10 + owner) as f32,
                "{what}: all_gather element {i}"
            );
        }
    }
    // The same in 16-bit elements, two a word: element e of the gather
    // comes from the owner of word e / 2.
    for len in LENS {
        let own = chunk_range(len, n, r);
        let chunk: Vec<u16> = (2 * own.start..2 * own.end)
            .map(|e| (e * 10 + r) as u16)
            .collect();
        let mut buf = vec![u16::MAX; 2 * len];
        buf[2 * own.start..2 * own.end].copy_from_slice(&chunk);
        let in_place = c.all_gather16_in_place(buf).unwrap();
        let got = c.all_gather16(chunk, 2 * len).unwrap();
        assert_eq!(in_place, got, "16-bit all_gather in place");
        for (e, g) in got.iter().enumerate() {
            let owner = (0..n)
                .find(|&o| chunk_range(len, n, o).contains(&(e / 2)))
                .unwrap();
            assert_eq!(*g, (e * 10 + owner) as u16, "16-bit all_gather element {e}");
        }
    }
    // all_to_all with a different length for every pair.
    let pieces = (0..n)
        .map(|j| vec![(r * 16 + j) as u8; r + 2 * j])
        .collect();
    let got = c.all_to_all(pieces).unwrap();
    for (i, piece) in got.iter().enumerate() {
        assert_eq!(
            piece,
            &vec![(i * 16 + r) as u8; i + 2 * r],
            "all_to_all from {i}"
        );
    }
    for root in 0..n {
        c.barrier().unwrap();
        let buf = if r == root {
            vec![root as u8; 1001]
        } else {
            vec![]
        };
        assert_eq!(c.broadcast(buf, root).unwrap(), vec![root as u8; 1001]);
    }
    // Eight collectives in flight at once complete in issue order.
    let works: Vec<_> = (0..8)
        .map(|k| c.all_reduce_async(vec![(r + k) as f32; 5000 + k]))
        .collect();
    for (k, w) in works.into_iter().enumerate() {
        let sum: usize = (0..n).map(|x| x + k).sum();
        assert_eq!(w.wait().unwrap(), vec![sum as f32; 5000 + k]);
    }
    // Bytes: a ring all-reduce sends 2(n-1)/n of the buffer, all of it to the
    // right neighbour; an all-gather sends the own chunk to every other rank.
    let nodes: Vec<usize> = env("ZCOMM_MPI_NODES")
        .split(',')
        .map(|x| x.parse().unwrap())
        .collect();
    let len = 250 * n;
    let before = c.counters();
    c.all_reduce(random(r as u64, len)).unwrap();
    let d = c.counters().since(&before);
    let want = (2 * (n - 1) * 250 * 4) as u64;
    assert_eq!(d.op(Op::AllReduce), want);
    let same = nodes[r] == nodes[(r + 1) % n];
    assert_eq!(
        (d.intra_node, d.inter_node),
        if same { (want, 0) } else { (0, want) }
    );
    let before = c.counters();
    c.all_gather(vec![1.0; 250], len).unwrap();
    let d = c.counters().since(&before);
    assert_eq!(d.op(Op::AllGather), (1000 * (n - 1)) as u64);
    let across = (0..n).filter(|&p| nodes[p] != nodes[r]).count() as u64;
    assert_eq!(d.inter_node, 1000 * across);
    // `comms_logger`'s tally: each collective under its op and its
    // buffer's bytes, taken once.
    c.take_op_log();
    c.all_reduce(vec![1.0; 100]).unwrap();
    c.all_reduce(vec![2.0; 100]).unwrap();
    c.all_gather(vec![1.0; 250], len).unwrap();
    let kinds: Vec<_> = c
        .take_op_log()
        .iter()
        .map(|t| (t.op, t.bytes, t.count))
        .collect();
    let gathered = (len * 4) as u64;
    assert_eq!(
        kinds,
        [(Op::AllReduce, 400, 2), (Op::AllGather, gathered, 1)]
    );
    assert!(c.take_op_log().is_empty());
    lines.push("ok".into());
    lines
}

/// Ranks that disagree: lengths first (on a fresh communicator), then
/// collectives. Returns each error's text.
fn mismatch(rt: &Runtime, c: &MpiCommunicator, opts: &MpiOptions) -> Vec<String> {
    let r = c.rank();
    let e = c
        .all_reduce(vec![1.0; if r == 0 { 64 } else { 32 }])
        .unwrap_err();
    assert!(
        matches!(
            e,
            CommError::Mismatch {
                op: "all_reduce",
                ..
            }
        ),
        "{e}"
    );
    let after = c.barrier().unwrap_err().to_string();
    let c2 = MpiCommunicator::world(rt, opts.clone()).unwrap();
    let e2 = if r == 0 {
        c2.all_reduce(vec![1.0; 64]).map(|_| ())
    } else {
        c2.all_gather(vec![1.0; 32], 64).map(|_| ())
    }
    .unwrap_err();
    vec![e.to_string(), after, e2.to_string()]
}

/// Rank 1 comes 3 s late to a barrier whose deadline is 1 s: rank 0 times out
/// naming the barrier, and while it waits `in_flight` names it too.
fn timeout_case(c: &MpiCommunicator) -> Vec<String> {
    if c.rank() == 1 {
        std::thread::sleep(Duration::from_secs(3));
        return vec![c.barrier().map_or_else(|e| e.to_string(), |()| "ok".into())];
    }
    let start = Instant::now();
    let work = c.barrier_async();
    std::thread::sleep(Duration::from_millis(500));
    let seen = c.in_flight().map(|f| f.to_string()).unwrap_or_default();
    let e = work.wait().unwrap_err();
    vec![
        e.to_string(),
        seen,
        format!("{:.1}", start.elapsed().as_secs_f64()),
    ]
}

/// `mpirun`, or `None` after saying why the test skips (CI sets
/// `ZRUN_REQUIRE_MPI=1`, and then a missing `mpirun` fails).
fn mpirun() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("mpirun"))
            .find(|f| f.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var("ZRUN_REQUIRE_MPI").as_deref() != Ok("1"),
            "ZRUN_REQUIRE_MPI=1 but mpirun is not on PATH"
        );
        eprintln!("SKIPPED: mpirun is not on PATH (Debian: apt-get install openmpi-bin)");
    }
    found
}

/// Runs `case` on `nodes.len()` ranks under mpirun; returns each rank's lines
/// and mpirun's exit status and output.
fn launch(
    mpirun: &Path,
    case: &str,
    nodes: &[usize],
    timeout_s: f64,
) -> (Vec<Vec<String>>, String, bool) {
    let dir = tempfile::tempdir().unwrap();
    let list: Vec<String> = nodes.iter().map(usize::to_string).collect();
    let mut cmd = Command::new(mpirun);
    cmd.args(["--oversubscribe", "-np", &nodes.len().to_string()]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    let mut child = cmd
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "rank_main",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ZCOMM_MPI_CASE", case)
        .env("ZCOMM_MPI_NODES", list.join(","))
        .env("ZCOMM_MPI_OUT", dir.path())
        .env("ZCOMM_MPI_TIMEOUT", timeout_s.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("mpirun ({case}, nodes {nodes:?}) ran past 180 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let ranks = (0..nodes.len())
        .map(|r| {
            std::fs::read_to_string(dir.path().join(format!("rank{r}")))
                .map(|s| s.lines().map(str::to_string).collect())
                .unwrap_or_default()
        })
        .collect();
    (ranks, text, out.status.success())
}

/// The TCP transport's `all_reduce` and qgZ bits for the same inputs, rank by
/// rank, in this process.
fn tcp_lines(nodes: &[usize]) -> Vec<Vec<String>> {
    let n = nodes.len();
    let token = zproto::Token::generate();
    let listeners: Vec<_> = (0..n)
        .map(|_| TcpCommunicator::bind("127.0.0.1").unwrap())
        .collect();
    let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let comms: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let opts = TcpOptions {
                token: token.clone(),
                timeout: Duration::from_secs(60),
                node_of_rank: nodes.to_vec(),
                group: "world".into(),
                shm: None,
                single_copy: true,
            };
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                Arc::new(TcpCommunicator::connect(rank, l, &addrs, opts).unwrap())
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let hs: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            std::thread::spawn(move || {
                let mut lines = Vec::new();
                for len in LENS {
                    let full = c.all_reduce(random(r as u64, len)).unwrap();
                    lines.push(format!("all_reduce {len} {:x}", bits_hash(&full)));
                    let q = c
                        .quantized_reduce_scatter(random(r as u64, len), QGZ, None)
                        .unwrap();
                    lines.push(format!("qgz {len} {:x}", bits_hash(&q)));
                    lines.push(loco_line(c.as_ref(), len));
                    lines.push(half_line(c.as_ref(), len));
                }
                lines
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn every_collective_on_1_to_5_ranks_matches_the_reference_and_tcp_bit_for_bit() {
    let Some(mpirun) = mpirun() else { return };
    let shapes: [&[usize]; 5] = [&[0], &[0, 1], &[0, 0, 1], &[0, 0, 1, 1], &[0, 0, 0, 1, 1]];
    for nodes in shapes {
        let (ranks, text, ok) = launch(&mpirun, "collectives", nodes, 60.0);
        assert!(ok, "mpirun failed for nodes {nodes:?}:\n{text}");
        let tcp = tcp_lines(nodes);
        for (r, lines) in ranks.iter().enumerate() {
            assert_eq!(
                lines.last().map(String::as_str),
                Some("ok"),
                "rank {r}:\n{text}"
            );
            let hashes = &lines[..lines.len() - 1];
            let all_reduce = |l: &[String]| -> Vec<String> {
                l.iter()
                    .filter(|x| x.starts_with("all_reduce"))
                    .cloned()
                    .collect()
            };
            assert_eq!(
                all_reduce(hashes),
                all_reduce(&ranks[0]),
                "nodes {nodes:?}: rank {r} differs from rank 0"
            );
            assert_eq!(
                hashes,
                &tcp[r][..],
                "nodes {nodes:?}: rank {r} differs from TCP"
            );
        }
    }
}

#[test]
fn ranks_that_disagree_get_a_mismatch_naming_both_sides() {
    let Some(mpirun) = mpirun() else { return };
    let (ranks, text, _) = launch(&mpirun, "mismatch", &[0, 0], 20.0);
    for (r, lines) in ranks.iter().enumerate() {
        assert_eq!(lines.len(), 3, "rank {r}:\n{text}");
        assert!(
            lines[0].contains("length/root 64") && lines[0].contains("length/root 32"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].contains("all_reduce"),
            "a failed communicator repeats its error: {}",
            lines[1]
        );
        assert!(
            lines[2].contains("all_reduce") && lines[2].contains("all_gather"),
            "{}",
            lines[2]
        );
    }
}

#[test]
fn a_late_rank_is_a_timeout_naming_the_op_and_in_flight_shows_it() {
    let Some(mpirun) = mpirun() else { return };
    let (ranks, text, _) = launch(&mpirun, "timeout", &[0, 0], 1.0);
    let rank0 = &ranks[0];
    assert_eq!(rank0.len(), 3, "rank 0:\n{text}");
    assert!(
        rank0[0].contains("barrier") && rank0[0].contains("timed out"),
        "{}",
        rank0[0]
    );
    assert!(
        rank0[1].starts_with("in barrier (group world"),
        "{}",
        rank0[1]
    );
    let waited: f64 = rank0[2].parse().unwrap();
    assert!(
        (0.9..2.9).contains(&waited),
        "timed out after {waited} s, deadline 1 s"
    );
}
