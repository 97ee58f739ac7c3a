//! Names that zrun and zworker must spell the same way although they link
//! different crates: the collectives (torch.distributed's names, used by
//! `zrun bench comm` and by the transports' accounting and messages) and the
//! shared-memory segment of a job's node.

use std::path::PathBuf;

/// A collective operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Sum over ranks, result everywhere.
    AllReduce,
    /// Sum over ranks, rank r keeps chunk r.
    ReduceScatter,
    /// Concatenate every rank's chunk everywhere.
    AllGather,
    /// Rank r sends its j-th piece to rank j.
    AllToAll,
    /// One rank's buffer everywhere.
    Broadcast,
    /// Wait for every rank.
    Barrier,
    /// ZeRO++ qgZ: a reduce-scatter sent quantized, in two hops (within the
    /// node, then across nodes).
    QuantizedReduceScatter,
}

impl Op {
    /// Every operation, in declaration order ([`Op::index`]).
    pub const ALL: [Op; 7] = [
        Op::AllReduce,
        Op::ReduceScatter,
        Op::AllGather,
        Op::AllToAll,
        Op::Broadcast,
        Op::Barrier,
        Op::QuantizedReduceScatter,
    ];

    /// The operations that move data (what `zrun bench comm` measures).
    pub const DATA: [Op; 5] = [
        Op::AllReduce,
        Op::ReduceScatter,
        Op::AllGather,
        Op::AllToAll,
        Op::Broadcast,
    ];

    /// torch.distributed's name.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::AllToAll => "all_to_all",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::QuantizedReduceScatter => "quantized_reduce_scatter",
        }
    }

    /// The operation of a torch.distributed name.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }

    /// What `zrun bench comm` times under `name`: a data operation by its
    /// name, or a reduction in 16 bits on the wire (`train.reduce_dtype`)
    /// as `all_reduce_bf16`, `reduce_scatter_f16` and the like.
    pub fn from_bench_name(name: &str) -> Option<(Op, Option<zconfig::Dtype>)> {
        use zconfig::Dtype;
        let (base, wire) = match name.rsplit_once('_') {
            Some((base, "bf16")) => (base, Some(Dtype::Bf16)),
            Some((base, "f16")) => (base, Some(Dtype::F16)),
            _ => (name, None),
        };
        let op = Op::from_name(base).filter(|op| Op::DATA.contains(op))?;
        match (op, wire) {
            (_, None) | (Op::AllReduce | Op::ReduceScatter, Some(_)) => Some((op, wire)),
            _ => None,
        }
    }

    /// nccl-tests' bus-bandwidth factor over `n` ranks: what each rank's
    /// links carry for one byte of the collective's buffer (the
    /// all-reduce's, the reduce-scatter's input, the all-gather's output),
    /// so that bus bandwidth compares with a link's whatever the op.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::Broadcast => 1.0,
            _ => (n - 1.0) / n,
        }
    }

    /// Position in [`Op::ALL`] (for counters indexed by op).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The operation at [`Op::index`] `i`.
    pub fn from_index(i: usize) -> Option<Op> {
        Op::ALL.get(i).copied()
    }
}

/// The name of the shared-memory segment of `node` in job `job_id`.
pub fn shm_segment_name(job_id: &str, node: usize) -> String {
    format!("zrun-{job_id}-n{node}")
}

/// The name of the shared-memory segment of hpZ group `group` (ranks
/// `group·P .. (group+1)·P`, all on one node) in job `job_id`.
pub fn hpz_segment_name(job_id: &str, group: usize) -> String {
    format!("zrun-{job_id}-hpz{group}")
}

/// Where a segment named `name` lives.
pub fn shm_segment_path(name: &str) -> PathBuf {
    PathBuf::from("/dev/shm").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(Op::from_name(op.name()), Some(op));
            assert_eq!(Op::from_index(op.index()), Some(op));
            assert_eq!(op.index(), i);
        }
        // The names a job spec's `comms_logger.prof_ops` accepts.
        assert_eq!(Op::ALL.map(Op::name), zconfig::spec::COMM_OPS);
        assert_eq!(Op::from_name("allreduce"), None);
        for op in Op::DATA {
            assert_eq!(Op::from_bench_name(op.name()), Some((op, None)));
        }
        use zconfig::Dtype;
        assert_eq!(
            Op::from_bench_name("all_reduce_bf16"),
            Some((Op::AllReduce, Some(Dtype::Bf16)))
        );
        assert_eq!(
            Op::from_bench_name("reduce_scatter_f16"),
            Some((Op::ReduceScatter, Some(Dtype::F16)))
        );
        for bad in [
            "all_gather_bf16",
            "barrier",
            "all_reduce_f32",
            "bf16",
            "quantized_reduce_scatter",
        ] {
            assert_eq!(Op::from_bench_name(bad), None, "{bad}");
        }
        assert!(!Op::DATA.contains(&Op::Barrier));
        assert_eq!(
            shm_segment_path(&shm_segment_name("j1", 2)),
            PathBuf::from("/dev/shm/zrun-j1-n2")
        );
    }
}
