//! Why a collective or the building of a communicator failed. Every variant
//! names the operation, group and peer it is about; causes are shown in the
//! message (and not also chained as a `source`, so they print once).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use zproto::FrameError;

fn waiting_for(peer: Option<usize>) -> String {
    peer.map(|p| format!(" waiting for rank {p}"))
        .unwrap_or_default()
}

/// A communication failure. Every variant names the operation, group and peer.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// A deadline passed.
    #[error("{op} in group {group}: timed out after {waited_s:.1}s{}", waiting_for(*peer))]
    Timeout {
        /// Operation.
        op: &'static str,
        /// Group.
        group: String,
        /// The rank that did not deliver, where one rank is to blame.
        peer: Option<usize>,
        /// Seconds waited.
        waited_s: f64,
    },
    /// A socket failed or closed.
    #[error("{op} in group {group}: link to rank {peer} failed: {message}")]
    Link {
        /// Operation.
        op: &'static str,
        /// Group.
        group: String,
        /// Peer rank.
        peer: usize,
        /// Cause.
        message: String,
    },
    /// Ranks disagree on which collective comes next (a program bug on some rank).
    #[error("{op} in group {group}: rank {peer} sent {got}, expected {expected}")]
    Mismatch {
        /// Operation.
        op: &'static str,
        /// Group.
        group: String,
        /// Peer rank.
        peer: usize,
        /// What arrived.
        got: String,
        /// What this rank expected.
        expected: String,
    },
    /// Building the communicator failed.
    #[error("connecting group {group}: {cause}")]
    Setup {
        /// Group.
        group: String,
        /// What failed.
        cause: SetupError,
    },
    /// Arguments that no rank could satisfy.
    #[error("{op}: {message}")]
    Usage {
        /// Operation.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The communicator's thread is gone (a previous error killed it).
    #[error("{op} in group {group}: the communicator has shut down")]
    Closed {
        /// Operation.
        op: &'static str,
        /// Group.
        group: String,
    },
}

/// Why a communicator could not be built.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The arguments describe no valid rank.
    #[error("rank {rank} with {world} addresses and {node_entries} node entries")]
    BadTopology {
        /// This rank.
        rank: usize,
        /// Addresses given.
        world: usize,
        /// Entries of `node_of_rank`.
        node_entries: usize,
    },
    /// A thread could not be started.
    #[error("cannot start the accept thread: {0}")]
    Thread(Arc<io::Error>),
    /// The thread accepting peers panicked.
    #[error("the accept thread panicked")]
    AcceptPanicked,
    /// A peer answered the handshake wrongly or not at all.
    #[error("rank {peer} at {addr} did not complete the handshake: {cause}")]
    Handshake {
        /// Peer rank.
        peer: usize,
        /// Its address.
        addr: SocketAddr,
        /// What went wrong.
        cause: Arc<FrameError>,
    },
    /// A peer could not prove the job token.
    #[error("rank {peer} at {addr} failed to prove the job token")]
    BadProof {
        /// Peer rank.
        peer: usize,
        /// Its address.
        addr: SocketAddr,
    },
    /// A peer could not be reached before the deadline.
    #[error("could not reach rank {peer} at {addr} before the deadline{}", last.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
    Unreachable {
        /// Peer rank.
        peer: usize,
        /// Its address.
        addr: SocketAddr,
        /// The last connection error, if an attempt was made.
        last: Option<Arc<io::Error>>,
    },
    /// Not every higher rank connected before the deadline.
    #[error("rank {rank} accepted {} of {expected} peers before the deadline (have {have:?})", have.len())]
    AcceptTimeout {
        /// This rank.
        rank: usize,
        /// Peers expected to connect.
        expected: usize,
        /// Those that did.
        have: Vec<usize>,
    },
    /// A socket operation failed.
    #[error("socket: {0}")]
    Socket(Arc<io::Error>),
    /// MPI refused (cargo feature `mpi`).
    #[cfg(feature = "mpi")]
    #[error("MPI: {0}")]
    Mpi(String),
    /// The node's shared-memory segment could not be set up.
    #[error("shared memory {name}: {cause}")]
    SharedMemory {
        /// Segment name.
        name: String,
        /// What failed.
        cause: Arc<io::Error>,
    },
}

impl From<io::Error> for SetupError {
    fn from(e: io::Error) -> SetupError {
        SetupError::Socket(Arc::new(e))
    }
}
