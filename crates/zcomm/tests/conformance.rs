//! Every collective against a naive reference, over real TCP sockets on loopback
//! and over shared memory: world sizes 1-5, lengths that do not divide evenly,
//! random data.

use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zcomm::{
    chunk_range, CommError, Communicator, ErrorFeedback, Half, Op, Quantization, TcpCommunicator,
    TcpOptions,
};
use zproto::Token;
use zquant::{Bits, Quantized};

/// How ranks of one node talk: the suite runs once per transport.
#[derive(Debug, Clone, Copy)]
enum Transport {
    /// TCP between every pair of ranks.
    Tcp,
    /// Shared memory within a node (TCP between nodes), all-gathers reading
    /// peers' buffers directly where the system allows.
    Shm,
    /// Shared memory with every all-gather copied through the segment.
    ShmSlots,
}

/// Stamps each test body out once per transport: `tcp::NAME`, `shm::NAME`
/// and `shm_slots::NAME`.
macro_rules! per_transport {
    ($($name:ident),* $(,)?) => {
        mod tcp {
            $(#[test]
            fn $name() {
                super::$name(super::Transport::Tcp)
            })*
        }
        mod shm {
            $(#[test]
            fn $name() {
                super::$name(super::Transport::Shm)
            })*
        }
        mod shm_slots {
            $(#[test]
            fn $name() {
                super::$name(super::Transport::ShmSlots)
            })*
        }
    };
}

per_transport!(
    all_reduce_matches_naive_sum_and_is_identical_on_every_rank,
    reduce_scatter_then_all_gather_equals_all_reduce_bitwise,
    all_gather_concatenates_chunks_in_rank_order,
    all_gather16_refuses_odd_counts_and_wrong_chunks,
    all_to_all_delivers_every_piece_with_its_own_length,
    broadcast_from_every_root_and_barrier,
    barrier_returns_only_after_every_rank_entered,
    async_work_overlaps_and_completes_in_issue_order,
    bytes_are_counted_per_op_and_split_by_node,
    waits_are_counted_per_op_where_a_rank_comes_late,
    collectives_are_tallied_by_op_and_size_and_timed_waiting_included,
    a_missing_peer_times_out_naming_op_group_and_peer,
    mismatched_collectives_are_reported_not_mixed,
    large_uneven_messages_cross_slots_and_ring_wraps_in_mixed_topologies,
    quantized_reduce_scatter_is_within_its_error_bound_on_any_node_shape,
    quantized_reduce_scatter_sends_one_quantized_partial_per_node_across,
    quantized_reduce_scatter_turns_an_infinity_into_nan_not_an_error,
    loco_feedback_makes_repeated_quantized_sums_average_to_the_exact_sum,
    half_reductions_round_each_piece_once_a_hop_and_the_all_reduce_is_the_owners_sum,
    half_reductions_send_half_of_f32s_bytes,
    half_reductions_carry_an_infinity_to_the_sum,
    in_flight_names_the_op_its_group_bytes_and_the_awaited_peer,
    a_peer_that_is_gone_is_reported_at_once_not_at_the_deadline,
);

/// Builds a world of `n` communicators in this process, each on its own socket.
/// Worlds built so far (each names its segments with its number).
static WORLDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn world(t: Transport, n: usize, nodes: &[usize], timeout: Duration) -> Vec<Arc<dyn Communicator>> {
    numbered_world(t, n, nodes, timeout).1
}

/// [`world`], with its number.
fn numbered_world(
    t: Transport,
    n: usize,
    nodes: &[usize],
    timeout: Duration,
) -> (usize, Vec<Arc<dyn Communicator>>) {
    let id = WORLDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let token = Token::generate();
    let listeners: Vec<_> = (0..n)
        .map(|_| TcpCommunicator::bind("127.0.0.1").unwrap())
        .collect();
    let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let addrs = addrs.clone();
            let opts = TcpOptions {
                token: token.clone(),
                timeout,
                node_of_rank: nodes.to_vec(),
                group: "world".into(),
                // One segment per simulated node.
                shm: matches!(t, Transport::Shm | Transport::ShmSlots)
                    .then(|| format!("zcomm-test-{}-{id}-n{}", std::process::id(), nodes[rank])),
                single_copy: matches!(t, Transport::Shm),
            };
            std::thread::spawn(move || TcpCommunicator::connect(rank, l, &addrs, opts).unwrap())
        })
        .collect();
    let comms = handles
        .into_iter()
        .map(|h| Arc::new(h.join().unwrap()) as Arc<dyn Communicator>)
        .collect();
    (id, comms)
}

/// Runs `f(rank, comm)` on every rank in parallel and returns the results by rank.
fn on_all<T: Send + 'static>(
    comms: &[Arc<dyn Communicator>],
    f: impl Fn(usize, &dyn Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let hs: Vec<_> = comms
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let (c, f) = (c.clone(), f.clone());
            std::thread::spawn(move || f(r, c.as_ref()))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn random(seed: u64, len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn naive_sum(n: usize, len: usize) -> Vec<f64> {
    let mut s = vec![0f64; len];
    for r in 0..n {
        for (a, b) in s.iter_mut().zip(random(r as u64, len)) {
            *a += b as f64;
        }
    }
    s
}

fn assert_close(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "element {i}: {g} vs {w}"
        );
    }
}

const LENS: [usize; 6] = [0, 1, 3, 7, 1000, 4099];

fn all_reduce_matches_naive_sum_and_is_identical_on_every_rank(t: Transport) {
    for n in 1..=5 {
        let comms = world(t, n, &vec![0; n], Duration::from_secs(20));
        for len in LENS {
            let out = on_all(&comms, move |r, c| {
                c.all_reduce(random(r as u64, len)).unwrap()
            });
            let want = naive_sum(n, len);
            for o in &out {
                assert_close(o, &want);
                assert_eq!(o, &out[0], "ranks disagree bitwise at n={n} len={len}");
            }
        }
    }
}

fn reduce_scatter_then_all_gather_equals_all_reduce_bitwise(t: Transport) {
    for n in 1..=5 {
        let comms = world(t, n, &vec![0; n], Duration::from_secs(20));
        for len in LENS {
            let out = on_all(&comms, move |r, c| {
                let full = c.all_reduce(random(r as u64, len)).unwrap();
                let mine = c.reduce_scatter(random(r as u64, len)).unwrap();
                assert_eq!(mine.len(), chunk_range(len, c.world_size(), r).len());
                let gathered = c.all_gather(mine, len).unwrap();
                (full, gathered)
            });
            let want = naive_sum(n, len);
            for (full, gathered) in &out {
                assert_close(gathered, &want);
                assert_eq!(full, gathered);
            }
        }
    }
}

/// Sizes where the shared-memory paths change behaviour, checked element by
/// element against a naive f64 sum: beyond the first 1 MiB direct slot (3.1
/// slots), past the 4 MiB ring's end (10 MB, and consecutive operations that
/// wrap it mid-message), odd lengths that split unevenly over ranks; on one
/// node and on two simulated nodes (shared memory within, TCP between).
fn large_uneven_messages_cross_slots_and_ring_wraps_in_mixed_topologies(t: Transport) {
    const SLOT: usize = (1 << 20) / 4;
    let lens = [3 * SLOT + 17, 2_500_003, SLOT - 1, 1_300_001];
    for nodes in [vec![0, 0, 0], vec![0, 0, 1, 1], vec![0, 1, 1]] {
        let n = nodes.len();
        let comms = world(t, n, &nodes, Duration::from_secs(60));
        for len in lens {
            let out = on_all(&comms, move |r, c| {
                let full = c.all_reduce(random(r as u64, len)).unwrap();
                let mine = c.reduce_scatter(random(r as u64, len)).unwrap();
                let mut buf = vec![f32::NAN; len];
                buf[chunk_range(len, c.world_size(), r)].copy_from_slice(&mine);
                let in_place = c.all_gather_in_place(buf).unwrap();
                let gathered = c.all_gather(mine.clone(), len).unwrap();
                assert_eq!(gathered, in_place, "rank {r}: in place differs");
                (full, mine, gathered)
            });
            let want = naive_sum(n, len);
            for (r, (full, mine, gathered)) in out.iter().enumerate() {
                let what = format!("{t:?} nodes {nodes:?} len {len} rank {r}");
                assert_eq!(full.len(), len, "{what}");
                assert_close(full, &want);
                assert_close(mine, &want[chunk_range(len, n, r)]);
                assert_close(gathered, &want);
                assert_eq!(full, &out[0].0, "{what}: ranks disagree bitwise");
            }
        }
    }
}

fn all_gather_concatenates_chunks_in_rank_order(t: Transport) {
    for n in 1..=5 {
        let comms = world(t, n, &vec![0; n], Duration::from_secs(20));
        for len in LENS {
            let out = on_all(&comms, move |r, c| {
                let own = chunk_range(len, c.world_size(), r);
                let chunk: Vec<f32> = own.clone().map(|i| (i * 10 + r) as f32).collect();
                // In place: what is not this rank's starts as NaN and must be
                // overwritten.
                let mut buf = vec![f32::NAN; len];
                buf[own].copy_from_slice(&chunk);
                let in_place = c.all_gather_in_place(buf).unwrap();
                (c.all_gather(chunk, len).unwrap(), in_place)
            });
            let want: Vec<f32> = (0..len)
                .map(|i| {
                    (i * 10
                        + (0..n)
                            .find(|&r| chunk_range(len, n, r).contains(&i))
                            .unwrap()) as f32
                })
                .collect();
            for (gathered, in_place) in out {
                assert_eq!(gathered, want);
                assert_eq!(in_place, want);
            }
            // 16-bit elements, `len` words of two: each rank's chunk of the
            // words, element e of it `e·10 + rank` in 16 bits.
            let out = on_all(&comms, move |r, c| {
                let own = chunk_range(len, c.world_size(), r);
                let chunk: Vec<u16> = (2 * own.start..2 * own.end)
                    .map(|e| (e * 10 + r) as u16)
                    .collect();
                // In place: what is not this rank's starts as all ones.
                let mut buf = vec![u16::MAX; 2 * len];
                buf[2 * own.start..2 * own.end].copy_from_slice(&chunk);
                (
                    c.all_gather16(chunk, 2 * len).unwrap(),
                    c.all_gather16_in_place(buf).unwrap(),
                )
            });
            let want16: Vec<u16> = (0..2 * len)
                .map(|e| {
                    let owner = (0..n)
                        .find(|&r| chunk_range(len, n, r).contains(&(e / 2)))
                        .unwrap();
                    (e * 10 + owner) as u16
                })
                .collect();
            for (gathered, in_place) in out {
                assert_eq!(gathered, want16, "{n} ranks, 16-bit, {len} words");
                assert_eq!(in_place, want16, "{n} ranks, 16-bit in place, {len} words");
            }
        }
    }
}

/// A 16-bit all-gather of an odd count, or with a chunk of the wrong
/// length, is refused with a usage error on the rank that made it.
fn all_gather16_refuses_odd_counts_and_wrong_chunks(t: Transport) {
    let comms = world(t, 2, &[0, 0], Duration::from_secs(20));
    let out = on_all(&comms, |r, c| {
        let odd = c.all_gather16(vec![1; 1 + r], 3);
        let wrong = c.all_gather16(vec![1; 3], 8);
        let odd_in_place = c.all_gather16_in_place(vec![1; 5]);
        (odd.map(|_| ()), wrong.map(|_| ()), odd_in_place.map(|_| ()))
    });
    for (odd, wrong, odd_in_place) in out {
        for e in [
            odd.unwrap_err(),
            wrong.unwrap_err(),
            odd_in_place.unwrap_err(),
        ] {
            assert!(
                matches!(
                    e,
                    CommError::Usage {
                        op: "all_gather",
                        ..
                    }
                ),
                "{e}"
            );
        }
    }
}

fn all_to_all_delivers_every_piece_with_its_own_length(t: Transport) {
    for n in 1..=5 {
        let comms = world(t, n, &vec![0; n], Duration::from_secs(20));
        let out = on_all(&comms, move |r, c| {
            let pieces = (0..n)
                .map(|j| vec![(r * 16 + j) as u8; r + 2 * j])
                .collect();
            c.all_to_all(pieces).unwrap()
        });
        for (r, got) in out.iter().enumerate() {
            assert_eq!(got.len(), n, "rank {r} got {} pieces", got.len());
            for (i, piece) in got.iter().enumerate() {
                assert_eq!(piece, &vec![(i * 16 + r) as u8; i + 2 * r]);
            }
        }
    }
}

fn broadcast_from_every_root_and_barrier(t: Transport) {
    for n in 1..=5 {
        let comms = world(t, n, &vec![0; n], Duration::from_secs(20));
        for root in 0..n {
            let out = on_all(&comms, move |r, c| {
                c.barrier().unwrap();
                // Other ranks pass buffers shorter, as long as and longer
                // than the root's, with stale bytes: none of them may show.
                let buf = if r == root {
                    vec![root as u8; 1001]
                } else {
                    vec![0xee; [0, 1001, 4096][r % 3]]
                };
                c.broadcast(buf, root).unwrap()
            });
            for o in out {
                assert_eq!(o, vec![root as u8; 1001]);
            }
        }
    }
}

/// Whichever rank comes last, no rank leaves the barrier before it entered:
/// every rank counts itself in just before entering and checks the count just
/// after leaving.
fn barrier_returns_only_after_every_rank_entered(t: Transport) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    for n in 2..=4 {
        let comms = world(t, n, &vec![0; n], Duration::from_secs(10));
        for late in 0..n {
            let entered = Arc::new(AtomicUsize::new(0));
            let e = entered.clone();
            let seen = on_all(&comms, move |r, c| {
                if r == late {
                    std::thread::sleep(Duration::from_millis(50));
                }
                e.fetch_add(1, Ordering::SeqCst);
                c.barrier().unwrap();
                e.load(Ordering::SeqCst)
            });
            assert_eq!(seen, vec![n; n], "{n} ranks, rank {late} last");
        }
    }
}

fn async_work_overlaps_and_completes_in_issue_order(t: Transport) {
    let comms = world(t, 3, &[0, 0, 0], Duration::from_secs(20));
    let out = on_all(&comms, |r, c| {
        let works: Vec<_> = (0..8)
            .map(|k| c.all_reduce_async(vec![(r + k) as f32; 5000 + k]))
            .collect();
        works
            .into_iter()
            .map(|w| w.wait().unwrap()[0])
            .collect::<Vec<_>>()
    });
    for o in out {
        assert_eq!(o, (0..8).map(|k| (3 * k + 3) as f32).collect::<Vec<_>>());
    }
}

fn bytes_are_counted_per_op_and_split_by_node(t: Transport) {
    // Ranks 0, 1 on node 0; ranks 2, 3 on node 1. Ring neighbours: 0->1 intra,
    // 1->2 inter, 2->3 intra, 3->0 inter.
    let comms = world(t, 4, &[0, 0, 1, 1], Duration::from_secs(20));
    let len = 1000;
    let out = on_all(&comms, move |r, c| {
        let before = c.counters();
        c.all_reduce(random(r as u64, len)).unwrap();
        c.counters().since(&before)
    });
    // A ring all-reduce sends 2(n-1)/n of the buffer: 1500 floats = 6000 bytes.
    for (r, d) in out.iter().enumerate() {
        assert_eq!(d.op(Op::AllReduce), 6000, "rank {r}");
        let (intra, inter) = if r % 2 == 0 { (6000, 0) } else { (0, 6000) };
        assert_eq!((d.intra_node, d.inter_node), (intra, inter), "rank {r}");
    }
}

/// The time a caller blocks in `wait` is counted under the op it waited for:
/// while rank 0 arrives 300 ms late at an all-gather, the others wait at
/// least that long there and nowhere else; rank 0, arriving last, waits far
/// less. (Lower bounds only: a wait cannot end before the late rank arrives.)
fn waits_are_counted_per_op_where_a_rank_comes_late(t: Transport) {
    let late = Duration::from_millis(300);
    let comms = world(t, 3, &[0, 0, 0], Duration::from_secs(20));
    let out = on_all(&comms, move |r, c| {
        c.all_reduce(vec![1.0; 64]).unwrap();
        let before = c.counters();
        if r == 0 {
            std::thread::sleep(late);
        }
        c.all_gather(vec![r as f32; 1000], 3000).unwrap();
        c.counters().since(&before)
    });
    for (r, d) in out.iter().enumerate().skip(1) {
        let waited = d.waited(Op::AllGather);
        assert!(waited >= late * 9 / 10, "rank {r} waited {waited:?}");
        assert_eq!(d.waited_total(), waited, "rank {r}: only the all-gather");
    }
    assert!(
        out[0].waited_total() < out[1].waited(Op::AllGather) / 2,
        "the late rank waited {:?}, the others {:?}",
        out[0].waited_total(),
        out[1].waited(Op::AllGather)
    );
}

/// `comms_logger`'s tally: each collective counted under its op and its
/// buffer's bytes, taken once; its time runs from its start to its end on
/// the communicator's thread, so while rank 0 arrives 300 ms late at the
/// all-gather, the others' all-gather lasts at least that long, and rank
/// 0's, arriving last, far less.
fn collectives_are_tallied_by_op_and_size_and_timed_waiting_included(t: Transport) {
    let late = Duration::from_millis(300);
    let comms = world(t, 3, &[0, 0, 0], Duration::from_secs(20));
    let out = on_all(&comms, move |r, c| {
        c.take_op_log();
        c.all_reduce(vec![1.0; 100]).unwrap();
        c.all_reduce(vec![2.0; 100]).unwrap();
        c.all_reduce(vec![3.0; 7]).unwrap();
        if r == 0 {
            std::thread::sleep(late);
        }
        c.all_gather(vec![r as f32; 1000], 3000).unwrap();
        (c.take_op_log(), c.take_op_log())
    });
    for (r, (log, again)) in out.iter().enumerate() {
        let kinds: Vec<(Op, u64, u64)> = log.iter().map(|t| (t.op, t.bytes, t.count)).collect();
        assert_eq!(
            kinds,
            [
                (Op::AllReduce, 28, 1),
                (Op::AllReduce, 400, 2),
                (Op::AllGather, 12_000, 1)
            ],
            "rank {r}"
        );
        for t in log {
            assert!(t.min <= t.max && t.max <= t.total, "rank {r}: {t:?}");
        }
        assert!(again.is_empty(), "rank {r}: taken twice {again:?}");
        if r > 0 {
            assert!(log[2].total >= late * 9 / 10, "rank {r}: {:?}", log[2]);
        }
    }
    assert!(
        out[0].0[2].total < out[1].0[2].total / 2,
        "the late rank's all-gather took {:?}, another's {:?}",
        out[0].0[2].total,
        out[1].0[2].total
    );
}

/// The direct path (every rank on one node, shared memory) counts, per rank, the
/// bytes other ranks read of its data: reduce-scatter every chunk but its own,
/// all-gather its own chunk once per other rank, all-reduce both. Three ranks
/// and 1000 floats give chunks of 334, 333 and 333, so each term shows.
#[test]
fn direct_path_counts_the_bytes_other_ranks_read() {
    let comms = world(Transport::Shm, 3, &[0, 0, 0], Duration::from_secs(20));
    let len = 1000;
    let out = on_all(&comms, move |r, c| {
        let mut seen = Vec::new();
        for op in [Op::ReduceScatter, Op::AllGather, Op::AllReduce] {
            let before = c.counters();
            let buf = random(r as u64, len);
            match op {
                Op::ReduceScatter => drop(c.reduce_scatter(buf).unwrap()),
                Op::AllGather => {
                    let own = buf[chunk_range(len, 3, r)].to_vec();
                    drop(c.all_gather(own, len).unwrap())
                }
                _ => drop(c.all_reduce(buf).unwrap()),
            }
            seen.push((op, c.counters().since(&before)));
        }
        seen
    });
    for (r, seen) in out.iter().enumerate() {
        let own = chunk_range(len, 3, r).len() as u64;
        let scattered = (len as u64 - own) * 4;
        let gathered = 2 * own * 4;
        for (op, d) in seen {
            let want = match op {
                Op::ReduceScatter => scattered,
                Op::AllGather => gathered,
                _ => scattered + gathered,
            };
            assert_eq!(d.op(*op), want, "rank {r} {op:?}");
            assert_eq!((d.intra_node, d.inter_node), (want, 0), "rank {r} {op:?}");
        }
    }
}

fn a_missing_peer_times_out_naming_op_group_and_peer(t: Transport) {
    let comms = world(t, 2, &[0, 0], Duration::from_millis(500));
    // Only rank 0 enters the collective.
    let e = comms[0].all_reduce(vec![1.0; 10]).unwrap_err();
    match &e {
        CommError::Timeout {
            op, group, peer, ..
        } => {
            assert_eq!(
                (*op, group.as_str(), *peer),
                ("all_reduce", "world", Some(1))
            );
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(e.to_string().contains("all_reduce in group world"));
    // The communicator is poisoned: the next call fails at once with the same error.
    assert!(matches!(comms[0].barrier(), Err(CommError::Timeout { .. })));
    // Two nodes, so no direct path: rank 1 waits on its link from rank 0
    // (shared memory under Shm) and must time out naming it.
    let comms = world(t, 3, &[0, 0, 1], Duration::from_millis(500));
    let c1 = comms[1].clone();
    let waiting = std::thread::spawn(move || c1.all_reduce(vec![1.0; 10]).unwrap_err());
    let _ = comms[2].all_reduce(vec![1.0; 10]);
    match waiting.join().unwrap() {
        CommError::Timeout { peer, .. } => assert_eq!(peer, Some(0), "{t:?}"),
        other => panic!("{t:?}: expected a timeout, got {other}"),
    }
}

/// Ranks that call different collectives (or the same with other lengths)
/// get a mismatch error naming what each side ran, on every transport.
fn mismatched_collectives_are_reported_not_mixed(t: Transport) {
    let comms = world(t, 2, &[0, 0], Duration::from_secs(5));
    let out = on_all(&comms, |r, c| {
        if r == 0 {
            c.all_reduce(vec![1.0; 64]).map(|_| ())
        } else {
            c.all_reduce(vec![1.0; 32]).map(|_| ())
        }
    });
    let e = out
        .iter()
        .find_map(|o| o.as_ref().err())
        .unwrap_or_else(|| panic!("{t:?}: both ranks succeeded"));
    match e {
        CommError::Mismatch { op, .. } => assert_eq!(*op, "all_reduce"),
        other => panic!("{t:?}: expected a mismatch, got {other}"),
    }
    // Different collectives: some rank's error names both.
    let comms = world(t, 2, &[0, 0], Duration::from_secs(5));
    let out = on_all(&comms, |r, c| {
        if r == 0 {
            c.all_reduce(vec![1.0; 64]).map(|_| ())
        } else {
            c.all_gather(vec![1.0; 32], 64).map(|_| ())
        }
    });
    let texts: Vec<String> = out
        .iter()
        .filter_map(|o| o.as_ref().err())
        .map(|e| e.to_string())
        .collect();
    assert!(!texts.is_empty(), "{t:?}: both ranks succeeded");
    assert!(
        texts
            .iter()
            .any(|m| m.contains("all_reduce") && m.contains("all_gather")),
        "{t:?}: no error names both collectives: {texts:?}"
    );
}

#[test]
fn a_stranger_on_the_data_port_cannot_join() {
    use std::io::Write;
    let token = Token::generate();
    let l0 = TcpCommunicator::bind("127.0.0.1").unwrap();
    let l1 = TcpCommunicator::bind("127.0.0.1").unwrap();
    let addrs = vec![l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    // Strangers connect to rank 0 first: one sends garbage, one stalls silently.
    let mut garbage = std::net::TcpStream::connect(addrs[0]).unwrap();
    garbage.write_all(&[0xff; 64]).unwrap();
    let _stall = std::net::TcpStream::connect(addrs[0]).unwrap();
    let opts = |t: &Token| TcpOptions {
        shm: None,
        single_copy: true,
        token: t.clone(),
        timeout: Duration::from_secs(10),
        node_of_rank: vec![0, 0],
        group: "world".into(),
    };
    let (o0, o1) = (opts(&token), opts(&token));
    let a2 = addrs.clone();
    let h = std::thread::spawn(move || TcpCommunicator::connect(0, l0, &a2, o0).unwrap());
    let c1 = TcpCommunicator::connect(1, l1, &addrs, o1).unwrap();
    let c0 = h.join().unwrap();
    let t = std::thread::spawn(move || c0.all_reduce(vec![1.0, 2.0]).unwrap());
    assert_eq!(c1.all_reduce(vec![3.0, 4.0]).unwrap(), vec![4.0, 6.0]);
    assert_eq!(t.join().unwrap(), vec![4.0, 6.0]);

    // A peer with the wrong token is refused.
    let l0 = TcpCommunicator::bind("127.0.0.1").unwrap();
    let l1 = TcpCommunicator::bind("127.0.0.1").unwrap();
    let addrs = vec![l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let mut o0 = opts(&token);
    o0.timeout = Duration::from_secs(2);
    let mut o1 = opts(&Token::generate());
    o1.timeout = Duration::from_secs(2);
    let a2 = addrs.clone();
    let h = std::thread::spawn(move || TcpCommunicator::connect(0, l0, &a2, o0).is_err());
    let e = TcpCommunicator::connect(1, l1, &addrs, o1)
        .err()
        .expect("wrong token must fail");
    assert!(
        e.to_string().contains("failed to prove the job token"),
        "{e}"
    );
    assert!(h.join().unwrap());
}

/// The worst error of a qgZ result for inputs of magnitude at most `a`:
/// one quantization (at most half a step, a step being the block's largest
/// magnitude over qmax) per piece a node's handler receives, plus one per
/// partial sum that arrives from another node. Rounding adds 0.1% and 1e-6.
fn qgz_bound(nodes: &[usize], home: usize, bits: Bits, a: f64) -> f64 {
    let q = f64::from(bits.qmax());
    let count = nodes.iter().max().unwrap() + 1;
    let mut bound = 0.0;
    for n in 0..count {
        let l = nodes.iter().filter(|&&x| x == n).count() as f64;
        let hop1 = (l - 1.0) * a / (2.0 * q);
        bound += hop1;
        if n != home {
            bound += (l * a + hop1) / (2.0 * q);
        }
    }
    bound * 1.001 + 1e-6
}

/// ZeRO++ qgZ against a naive f64 sum, element by element, at world sizes
/// 2-8 over one node, equal nodes, uneven nodes and one rank per node, int8
/// and int4, lengths that do not split evenly: every element within the bound
/// (which a halved sum would break: checked), and quantization visible (some
/// error). Buffers with chunks shorter than a block fall back to the plain
/// reduce-scatter: bit-identical to it and counted as one. The bound is a
/// worst case and the data reach it: measured worst errors, int8 / int4,
/// 0.0039 / 0.071 at 2 ranks (bounds 0.0039 / 0.072), 0.025 / 0.42 at 7 and 8.
fn quantized_reduce_scatter_is_within_its_error_bound_on_any_node_shape(t: Transport) {
    let shapes: [&[usize]; 8] = [
        &[0, 0],
        &[0, 1],
        &[0, 1, 2],
        &[0, 0, 1, 1],
        &[0, 0, 0, 1, 1],
        &[0, 0, 0, 0, 0, 0],
        &[0, 0, 0, 1, 1, 1, 2],
        &[0, 0, 0, 0, 1, 1, 1, 1],
    ];
    for nodes in shapes {
        let n = nodes.len();
        let comms = world(t, n, nodes, Duration::from_secs(30));
        for bits in [Bits::Int8, Bits::Int4] {
            let q = Quantization {
                bits,
                block_size: 16,
            };
            for len in [n * 16 + 7, 4099, n * 16 - 1] {
                let out = on_all(&comms, move |r, c| {
                    let before = c.counters();
                    let got = c
                        .quantized_reduce_scatter(random(r as u64, len), q, None)
                        .unwrap();
                    let plain = c.reduce_scatter(random(r as u64, len)).unwrap();
                    (got, plain, c.counters().since(&before))
                });
                let want = naive_sum(n, len);
                let fallback = len / n < 16;
                let mut worst = 0f64;
                for (r, (got, plain, sent)) in out.iter().enumerate() {
                    let what = format!("{t:?} nodes {nodes:?} {bits:?} len {len} rank {r}");
                    let want = &want[chunk_range(len, n, r)];
                    assert_eq!(got.len(), want.len(), "{what}");
                    if fallback {
                        assert_eq!(
                            got, plain,
                            "{what}: the fallback is the plain reduce-scatter"
                        );
                        assert_eq!(sent.op(Op::QuantizedReduceScatter), 0, "{what}");
                        continue;
                    }
                    assert!(
                        sent.op(Op::QuantizedReduceScatter) > 0,
                        "{what}: not counted"
                    );
                    let bound = qgz_bound(nodes, nodes[r], bits, 1.0);
                    let largest = want.iter().fold(0f64, |m, w| m.max(w.abs()));
                    assert!(largest / 2.0 > bound, "{what}: a halved sum would pass");
                    for (i, (g, w)) in got.iter().zip(want).enumerate() {
                        let err = (f64::from(*g) - w).abs();
                        worst = worst.max(err);
                        assert!(
                            err <= bound,
                            "{what} element {i}: {g} vs {w} (bound {bound})"
                        );
                    }
                }
                assert!(
                    fallback || worst > 0.0,
                    "{t:?} {nodes:?} {bits:?}: nothing quantized"
                );
            }
        }
    }
}

/// The paper's volume on equal nodes (N nodes of L ranks, chunks of c values):
/// each rank sends each local peer N chunks quantized and each other node one
/// quantized partial, so across nodes it sends (N-1) quantized chunks instead
/// of the ring's share of (W-1) f32 chunks. Exact, per rank.
fn quantized_reduce_scatter_sends_one_quantized_partial_per_node_across(t: Transport) {
    for nodes in [vec![0, 0, 1, 1], vec![0, 0, 0, 1, 1, 1], vec![0, 1, 2]] {
        let w = nodes.len();
        let count = nodes[w - 1] + 1;
        let l = w / count;
        let comms = world(t, w, &nodes, Duration::from_secs(30));
        for bits in [Bits::Int8, Bits::Int4] {
            let q = Quantization {
                bits,
                block_size: 64,
            };
            let c = 1000;
            let out = on_all(&comms, move |r, comm| {
                let before = comm.counters();
                comm.quantized_reduce_scatter(random(r as u64, w * c), q, None)
                    .unwrap();
                comm.counters().since(&before)
            });
            let wire = |values: usize| Quantized::wire_len(bits, 64, values) as u64;
            for (r, sent) in out.iter().enumerate() {
                let what = format!("{t:?} nodes {nodes:?} {bits:?} rank {r}");
                let intra = (l as u64 - 1) * wire(count * c);
                let inter = (count as u64 - 1) * wire(c);
                assert_eq!((sent.intra_node, sent.inter_node), (intra, inter), "{what}");
                assert_eq!(sent.op(Op::QuantizedReduceScatter), intra + inter, "{what}");
            }
        }
    }
}

/// LoCo's error feedback against the exact sum: the same inputs reduced
/// 64 times, on two nodes of two ranks (both hops quantize), int4. Without
/// feedback every reduction loses the same remainder, so the mean of the
/// results keeps qgZ's whole error; with it the remainders cancel, and the
/// mean's worst error must fall below a fifth of that (measured: 0.04-0.05
/// of it; the bound of the module doc, the largest kept error over
/// 64 · 0.2, is 0.08 of one reduction's bound). Each single result stays
/// within twice qgZ's bound (the values sent carry their errors too), and
/// feedback that restarts after every reduction is plain qgZ, bit for bit.
fn loco_feedback_makes_repeated_quantized_sums_average_to_the_exact_sum(t: Transport) {
    let nodes = [0, 0, 1, 1];
    let comms = world(t, 4, &nodes, Duration::from_secs(30));
    let q = Quantization {
        bits: Bits::Int4,
        block_size: 16,
    };
    let (len, rounds) = (4 * 64 + 6, 64);
    let out = on_all(&comms, move |r, c| {
        let loco = std::sync::Arc::new(std::sync::Mutex::new(ErrorFeedback::new(0.8, 1000)));
        let every = std::sync::Arc::new(std::sync::Mutex::new(ErrorFeedback::new(0.8, 1)));
        let mut results = Vec::new();
        for _ in 0..rounds {
            let x = random(r as u64, len);
            results.push(
                c.quantized_reduce_scatter(x, q, Some(loco.clone()))
                    .unwrap(),
            );
        }
        let plain = c.quantized_reduce_scatter(random(r as u64, len), q, None);
        let reset = (0..3)
            .map(|_| {
                let x = random(r as u64, len);
                c.quantized_reduce_scatter(x, q, Some(every.clone()))
                    .unwrap()
            })
            .collect::<Vec<_>>();
        (results, plain.unwrap(), reset)
    });
    let want = naive_sum(4, len);
    for (r, (results, plain, reset)) in out.iter().enumerate() {
        let what = format!("{t:?} rank {r}");
        let want = &want[chunk_range(len, 4, r)];
        let bound = qgz_bound(&nodes, nodes[r], Bits::Int4, 1.0);
        for got in results {
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (f64::from(*g) - w).abs() <= 2.0 * bound,
                    "{what}: {g} vs {w}"
                );
            }
        }
        let worst = |got: &dyn Fn(usize) -> f64| {
            (0..want.len()).fold(0f64, |m, i| m.max((got(i) - want[i]).abs()))
        };
        let mean = |i: usize| results.iter().map(|x| f64::from(x[i])).sum::<f64>() / rounds as f64;
        let (with, without) = (worst(&mean), worst(&|i| f64::from(plain[i])));
        println!("{what}: the mean's worst error {with:.5} with feedback, {without:.5} without");
        assert!(without > 0.0, "{what}: nothing quantized");
        assert!(
            with < 0.2 * without,
            "{what}: {with} with feedback, {without} without"
        );
        for got in reset {
            assert_eq!(
                got, plain,
                "{what}: restarting every reduction is plain qgZ"
            );
        }
    }
}

/// A quantizer refuses infinities, but an f16 overflow must reach the loss
/// scaler as a non-finite gradient, not fail the step: an infinity (here on
/// rank 3, in rank 0's chunk) makes the piece that carries it NaN, so the
/// owner's result is non-finite (and rank 2's, whose chunk shared rank 3's
/// piece to rank 2); the chunks of ranks 1 and 3 stay finite.
fn quantized_reduce_scatter_turns_an_infinity_into_nan_not_an_error(t: Transport) {
    let comms = world(t, 4, &[0, 0, 1, 1], Duration::from_secs(30));
    let q = Quantization {
        bits: Bits::Int4,
        block_size: 16,
    };
    let len = 4 * 64;
    let out = on_all(&comms, move |r, c| {
        let mut x = random(r as u64, len);
        if r == 3 {
            x[5] = f32::INFINITY;
        }
        c.quantized_reduce_scatter(x, q, None).unwrap()
    });
    assert!(
        out[0].iter().any(|v| !v.is_finite()),
        "{t:?}: the infinity vanished"
    );
    for r in [1, 3] {
        assert!(
            out[r].iter().all(|v| v.is_finite()),
            "{t:?}: rank {r}'s chunk was poisoned"
        );
    }
}

/// The relative error of one rounding to `half` (round to nearest: half
/// an ulp, 2^-p for p bits of precision).
fn unit_roundoff(half: Half) -> f64 {
    match half {
        Half::Bf16 => 2f64.powi(-8),
        Half::F16 => 2f64.powi(-11),
    }
}

/// `train.reduce_dtype`'s reductions against a naive f64 sum, at world
/// sizes 1-7 over one node, equal and uneven nodes and one rank per node,
/// bf16 and f16, lengths that do not split evenly (odd chunks too), and
/// pieces sent in several parts. Values
/// in [-1, 1]: a handler rounds each of its node's other L - 1 pieces once
/// (error at most u each), a partial crossing from another node of L ranks
/// is rounded once more (at most u·L), and the owner's sum is rounded to
/// the type (at most u·|sum|), with f32's adds and f16's subnormals far
/// below. Every result is a value of the type, every rank's all-reduce is
/// the same, and its chunk r is rank r's reduce-scatter, bit for bit.
fn half_reductions_round_each_piece_once_a_hop_and_the_all_reduce_is_the_owners_sum(t: Transport) {
    let shapes: [&[usize]; 7] = [
        &[0],
        &[0, 0],
        &[0, 1],
        &[0, 1, 2],
        &[0, 0, 1, 1],
        &[0, 0, 0, 1, 1],
        &[0, 0, 0, 1, 1, 1, 2],
    ];
    for nodes in shapes {
        let n = nodes.len();
        let comms = world(t, n, nodes, Duration::from_secs(30));
        // Long enough, on two shapes, that messages go in several parts
        // of 2^18 values, a part's span crossing from one chunk to the next
        // (a rank of the 3-rank node handles two chunks).
        let long = (nodes == [0, 1] || nodes == [0, 0, 0, 1, 1]).then_some(3 * (1 << 18) + 7);
        for half in [Half::Bf16, Half::F16] {
            for len in [4099, n * 3 + 1, 1].into_iter().chain(long) {
                let out = on_all(&comms, move |r, c| {
                    let rs = c.half_reduce_scatter_async(random(r as u64, len), half);
                    let ar = c.half_all_reduce_async(random(r as u64, len), half);
                    (rs.wait().unwrap(), ar.wait().unwrap())
                });
                let want = naive_sum(n, len);
                let u = unit_roundoff(half);
                let mut worst = 0f64;
                for (r, (rs, ar)) in out.iter().enumerate() {
                    let what = format!("{t:?} nodes {nodes:?} {half:?} len {len} rank {r}");
                    let chunk = chunk_range(len, n, r);
                    assert_eq!(ar, &out[0].1, "{what}: ranks' all-reduces differ");
                    assert_eq!(
                        rs.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        ar[chunk.clone()]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>(),
                        "{what}: the all-reduce is not the reduce-scatter's sum"
                    );
                    let home = nodes[r];
                    let count = nodes.iter().max().unwrap() + 1;
                    let hops: f64 = (0..count)
                        .map(|m| {
                            let l = nodes.iter().filter(|&&x| x == m).count() as f64;
                            (l - 1.0) + if m == home { 0.0 } else { l }
                        })
                        .sum();
                    for (i, (g, w)) in rs.iter().zip(&want[chunk]).enumerate() {
                        assert_eq!(
                            half.widen(half.round(*g)),
                            *g,
                            "{what} element {i}: {g} is no {half:?}"
                        );
                        let bound = (u * (hops + w.abs() + 1.0) * 1.001) + 1e-6;
                        let err = (f64::from(*g) - w).abs();
                        worst = worst.max(err);
                        assert!(
                            err <= bound,
                            "{what} element {i}: {g} vs {w} (bound {bound})"
                        );
                        assert!(
                            w.abs() < 0.5 || bound < w.abs() / 2.0,
                            "{what}: a halved sum would pass"
                        );
                    }
                }
                assert!(
                    len < 8 || worst > 0.0,
                    "{t:?} {nodes:?} {half:?} {len}: nothing rounded"
                );
            }
        }
    }
}

/// Each value crosses the wire in 2 bytes where the f32 ring sends 4: the
/// reduce-scatter sends qgZ's volume in 16 bits (each local peer N chunks,
/// each other node one partial), counted as a reduce-scatter; the
/// all-reduce adds the owner's chunk to every other rank, counted as an
/// all-reduce. Exact, per rank; on one node of 2 ranks, half of the f32
/// reduce-scatter's bytes.
fn half_reductions_send_half_of_f32s_bytes(t: Transport) {
    for nodes in [
        vec![0, 0],
        vec![0, 0, 1, 1],
        vec![0, 0, 0, 1, 1, 1],
        vec![0, 1, 2],
    ] {
        let w = nodes.len();
        let count = nodes[w - 1] + 1;
        let l = w / count;
        let comms = world(t, w, &nodes, Duration::from_secs(30));
        let c = 1000;
        let out = on_all(&comms, move |r, comm| {
            let mut sent = Vec::new();
            for op in 0..3 {
                let before = comm.counters();
                let x = random(r as u64, w * c);
                match op {
                    0 => drop(
                        comm.half_reduce_scatter_async(x, Half::Bf16)
                            .wait()
                            .unwrap(),
                    ),
                    1 => drop(comm.half_all_reduce_async(x, Half::Bf16).wait().unwrap()),
                    _ => drop(comm.reduce_scatter(x).unwrap()),
                }
                sent.push(comm.counters().since(&before));
            }
            sent
        });
        for (r, sent) in out.iter().enumerate() {
            let what = format!("{t:?} nodes {nodes:?} rank {r}");
            let (intra, inter) = (
                ((l - 1) * count * c * 2) as u64,
                ((count - 1) * c * 2) as u64,
            );
            assert_eq!(
                (sent[0].intra_node, sent[0].inter_node),
                (intra, inter),
                "{what}"
            );
            assert_eq!(sent[0].op(Op::ReduceScatter), intra + inter, "{what}");
            let (gather_intra, gather_inter) = (((l - 1) * c * 2) as u64, ((w - l) * c * 2) as u64);
            assert_eq!(
                (sent[1].intra_node, sent[1].inter_node),
                (intra + gather_intra, inter + gather_inter),
                "{what}"
            );
            assert_eq!(
                sent[1].op(Op::AllReduce),
                sent[1].intra_node + sent[1].inter_node,
                "{what}"
            );
            if w == 2 {
                assert_eq!(
                    2 * sent[0].op(Op::ReduceScatter),
                    sent[2].op(Op::ReduceScatter),
                    "{what}"
                );
            }
        }
    }
}

/// An infinity (here on rank 3, in rank 0's chunk) reaches its owner's sum
/// as an infinity or a NaN, in bf16 and in f16 (whose loss scaler must see
/// an overflow); the other ranks' chunks stay finite.
fn half_reductions_carry_an_infinity_to_the_sum(t: Transport) {
    let comms = world(t, 4, &[0, 0, 1, 1], Duration::from_secs(30));
    for half in [Half::Bf16, Half::F16] {
        let len = 4 * 64;
        let out = on_all(&comms, move |r, c| {
            let mut x = random(r as u64, len);
            if r == 3 {
                x[5] = f32::INFINITY;
            }
            let rs = c.half_reduce_scatter_async(x.clone(), half).wait().unwrap();
            let ar = c.half_all_reduce_async(x, half).wait().unwrap();
            (rs, ar)
        });
        assert!(
            !out[0].0[5].is_finite(),
            "{t:?} {half:?}: the infinity vanished"
        );
        for (r, (rs, ar)) in out.iter().enumerate() {
            assert!(
                !ar[5].is_finite(),
                "{t:?} {half:?}: rank {r}'s all-reduce lost it"
            );
            if r > 0 {
                assert!(
                    rs.iter().all(|v| v.is_finite()),
                    "{t:?} {half:?}: rank {r} poisoned"
                );
            }
        }
    }
}

/// Setup refuses a rank outside the world and a node list of the wrong
/// length (one per rank), naming both counts.
#[test]
fn a_topology_that_does_not_fit_the_world_is_refused() {
    for (rank, nodes) in [(0, vec![0]), (2, vec![0, 0])] {
        let l = TcpCommunicator::bind("127.0.0.1").unwrap();
        let addrs = vec![l.local_addr().unwrap(); 2];
        let opts = TcpOptions {
            token: Token::generate(),
            timeout: Duration::from_secs(2),
            node_of_rank: nodes.clone(),
            group: "world".into(),
            shm: None,
            single_copy: true,
        };
        let e = TcpCommunicator::connect(rank, l, &addrs, opts)
            .err()
            .expect("a bad topology must fail")
            .to_string();
        assert!(
            e.contains(&format!("rank {rank}")) && e.contains(&format!("{} node", nodes.len())),
            "{e}"
        );
    }
}

/// Shared memory is used where two or more ranks share a node, and only
/// there: on nodes [0, 0, 1] node 0's segment is mapped into this process
/// (its ranks are threads here) and node 1's is not.
#[test]
fn shared_memory_serves_exactly_the_nodes_with_several_ranks() {
    let (id, comms) = numbered_world(Transport::Shm, 3, &[0, 0, 1], Duration::from_secs(20));
    let out = on_all(&comms, |r, c| c.all_reduce(random(r as u64, 100)).unwrap());
    assert_close(&out[2], &naive_sum(3, 100));
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let name = |n: usize| format!("zcomm-test-{}-{id}-n{n}", std::process::id());
    assert!(maps.contains(&name(0)), "node 0's segment is not mapped");
    assert!(!maps.contains(&name(1)), "node 1 (one rank) has a segment");
}

/// What hang diagnosis reads: while rank 0 waits in a collective that rank 1
/// has not entered, `in_flight` names the op, the group, the caller's buffer
/// in bytes and rank 1; afterwards nothing is in flight. The accessors say
/// what the communicator was built with.
fn in_flight_names_the_op_its_group_bytes_and_the_awaited_peer(t: Transport) {
    // A short deadline, so that a failed check does not leave rank 0 waiting
    // long in its collective.
    let comms = world(t, 2, &[0, 0], Duration::from_secs(3));
    let (c0, c1) = (comms[0].clone(), comms[1].clone());
    assert_eq!((c0.rank(), c1.rank(), c1.world_size()), (0, 1, 2));
    assert_eq!(c0.group_name(), "world");
    assert_eq!(c0.timeout(), Duration::from_secs(3));
    let len = 1000;
    for (op, bytes) in [
        ("all_reduce", len * 4),
        ("reduce_scatter", len * 4),
        ("all_gather", len * 4),
    ] {
        let start = |c: &dyn Communicator, r: usize| match op {
            "all_reduce" => c.all_reduce_async(random(r as u64, len)),
            "reduce_scatter" => c.reduce_scatter_async(random(r as u64, len)),
            _ => c.all_gather_async(random(r as u64, len / 2), len),
        };
        let w0 = start(c0.as_ref(), 0);
        let seen = wait_for(|| c0.in_flight().filter(|f| f.peer.is_some()));
        assert_eq!(seen.op, op, "{t:?}");
        assert_eq!(seen.group, "world", "{t:?} {op}");
        assert_eq!(seen.bytes, bytes, "{t:?} {op}");
        assert_eq!(seen.peer, Some(1), "{t:?} {op}");
        let w1 = start(c1.as_ref(), 1);
        w0.wait().unwrap();
        w1.wait().unwrap();
        assert!(c0.in_flight().is_none(), "{t:?} {op}: still in flight");
    }
}

/// Polls `f` every 5 ms until it gives something (at most 2 s).
fn wait_for<T>(mut f: impl FnMut() -> Option<T>) -> T {
    let end = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        if let Some(x) = f() {
            return x;
        }
        assert!(
            std::time::Instant::now() < end,
            "nothing in flight after 2 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A peer whose process is gone closes its links: the rank waiting on it gets
/// a link error naming it at once, not a timeout at the deadline (20 s here).
fn a_peer_that_is_gone_is_reported_at_once_not_at_the_deadline(t: Transport) {
    let mut comms = world(t, 3, &[0, 0, 1], Duration::from_secs(20));
    drop(comms.pop()); // rank 2, the only rank of node 1, leaves
    let started = std::time::Instant::now();
    let e = comms[0].all_reduce(vec![1.0; 10]).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{t:?}: {e} took {:?}",
        started.elapsed()
    );
    assert!(
        !matches!(e, CommError::Timeout { .. }) && e.to_string().contains("rank 2"),
        "{t:?}: {e}"
    );
    // A peer that leaves with our bytes unread resets the connection: that
    // error too is reported at once.
    let mut comms = world(t, 2, &[0, 1], Duration::from_secs(20));
    let c0 = comms[0].clone();
    let started = std::time::Instant::now();
    let waiting =
        std::thread::spawn(move || c0.all_to_all(vec![vec![7u8; 1 << 16]; 2]).unwrap_err());
    std::thread::sleep(Duration::from_millis(300));
    drop(comms.pop());
    let e = waiting.join().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10) && !matches!(e, CommError::Timeout { .. }),
        "{t:?}: {e} after {:?}",
        started.elapsed()
    );
    // The same in the middle of a ring whose writer still holds pieces of
    // the buffer to send in place (64 MiB: more than the sockets hold): the
    // error comes at once, and the buffer is given up only after the writer
    // has let go of it (abandon_sends; a later collective fails the same way).
    let mut comms = world(t, 2, &[0, 1], Duration::from_secs(20));
    let c0 = comms[0].clone();
    let started = std::time::Instant::now();
    let waiting = std::thread::spawn(move || {
        let e = c0.all_reduce(vec![1.0; 16 << 20]).unwrap_err();
        (e, c0.all_reduce(vec![1.0; 16]).unwrap_err())
    });
    std::thread::sleep(Duration::from_millis(300));
    drop(comms.pop());
    let (e, later) = waiting.join().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10) && !matches!(e, CommError::Timeout { .. }),
        "{t:?}: {e} after {:?}",
        started.elapsed()
    );
    assert_eq!(e.to_string(), later.to_string(), "{t:?}: poisoned");
}
