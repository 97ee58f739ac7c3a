//! The control server: the only listening socket of a job on zrun's side.
//!
//! Each connection gets a fresh nonce and must answer with the job token's HMAC
//! proof within [`HANDSHAKE_DEADLINE`], in one frame of at most
//! [`zproto::HANDSHAKE_MAX`] bytes; otherwise it is dropped and never reaches the
//! job. A semaphore bounds the connections alive at once, so strangers cannot
//! exhaust zrun. Authenticated workers get their task, then stream messages that
//! the server forwards as [`Event`]s, except key-value requests, which it answers
//! itself (torch's TCPStore: set, get, wait with a deadline).
//!
//! In per-node mode the zruns of the other nodes connect here too (a
//! `NodeHello` under its own auth context): their relayed worker output and
//! exits become [`Event::Node`]s, and at the end they are told how the job
//! finished ([`Server::finish_nodes`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify, Semaphore};
use zproto::auth::nonce;
use zproto::frame::{read_frame_async, write_frame_async, HANDSHAKE_MAX, MAX_FRAME};
use zproto::{
    NodeWelcome, Task, ToServer, ToWorker, Token, Welcome, CONTROL_CONTEXT, NODE_CONTEXT,
    NODE_SERVER_CONTEXT, SERVER_CONTEXT,
};

/// How long a new connection may take to authenticate.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// Something a worker did.
#[derive(Debug)]
pub enum Event {
    /// A rank authenticated and received its task.
    Joined {
        /// Rank.
        rank: usize,
        /// Its host name.
        hostname: String,
        /// Its process id.
        pid: u32,
    },
    /// A message from an authenticated rank.
    Message {
        /// Rank.
        rank: usize,
        /// The message (boxed: step reports are large, events many).
        msg: Box<ToServer>,
    },
    /// A rank's control connection ended.
    Lost {
        /// Rank.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// Per-node mode: something about another node's zrun.
    Node {
        /// Its node rank.
        node: usize,
        /// What.
        what: NodeEvent,
    },
}

/// What another node's zrun did (per-node mode).
#[derive(Debug)]
pub enum NodeEvent {
    /// It authenticated and was welcomed.
    Joined {
        /// Its host name.
        hostname: String,
        /// Its process id.
        pid: u32,
    },
    /// A message from it (`NodeOutput`, `NodeExited`, `NodeStopping`).
    Message(Box<ToServer>),
    /// Its connection ended.
    Lost(String),
}

/// The key-value store.
#[derive(Default)]
struct Store {
    map: Mutex<HashMap<String, String>>,
    changed: Notify,
}

impl Store {
    fn set(&self, k: String, v: String) {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(k, v);
        self.changed.notify_waiters();
    }

    fn get(&self, k: &str) -> Option<String> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(k)
            .cloned()
    }

    async fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>, Vec<String>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| self.get(k).is_none())
                .cloned()
                .collect();
            if missing.is_empty() {
                return Ok(keys
                    .iter()
                    .map(|k| self.get(k).unwrap_or_default())
                    .collect());
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(missing);
            }
        }
    }
}

/// What the server needs to know about the job.
pub struct JobInfo {
    /// The job token.
    pub token: Token,
    /// Job id workers must present.
    pub job_id: String,
    /// Ranks expected.
    pub world_size: usize,
    /// Node of every rank.
    pub node_of_rank: Vec<usize>,
    /// The task every rank runs.
    pub task: Task,
    /// Per-node mode: the number of nodes (each but node 0 joins with its own
    /// zrun) and workers per node; `(0, 0)` otherwise.
    pub nodes: (usize, usize),
}

type Senders = Arc<Mutex<HashMap<usize, mpsc::UnboundedSender<ToWorker>>>>;

/// A running control server.
pub struct Server {
    /// Where it listens.
    pub addr: SocketAddr,
    senders: Senders,
    /// Other nodes' zruns, by node rank (per-node mode).
    node_senders: Senders,
    /// Their connections' writers, which end after `Finished`.
    node_writers: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Server {
    /// Starts serving on `listener`; events go to `events`.
    pub fn start(
        listener: TcpListener,
        info: JobInfo,
        events: mpsc::UnboundedSender<Event>,
    ) -> std::io::Result<Server> {
        let addr = listener.local_addr()?;
        let senders: Senders = Arc::default();
        let node_senders: Senders = Arc::default();
        let node_writers: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let info = Arc::new(info);
        let store = Arc::new(Store::default());
        let limit = Arc::new(Semaphore::new(info.world_size + 64));
        let conns = Connections {
            workers: senders.clone(),
            nodes: node_senders.clone(),
            node_writers: node_writers.clone(),
        };
        tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    continue;
                };
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    tracing::warn!("dropping connection from {peer}: too many connections");
                    continue;
                };
                let (info, store, conns, events) =
                    (info.clone(), store.clone(), conns.clone(), events.clone());
                tokio::spawn(async move {
                    serve(stream, peer, &info, &store, &conns, &events).await;
                    drop(permit);
                });
            }
        });
        Ok(Server {
            addr,
            senders,
            node_senders,
            node_writers,
        })
    }

    /// Sends a message to one rank, if it is connected.
    pub fn send(&self, rank: usize, msg: ToWorker) {
        if let Some(tx) = self
            .senders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&rank)
        {
            let _ = tx.send(msg);
        }
    }

    /// Tells every connected rank, and every other node's zrun, to stop.
    pub fn abort_all(&self, reason: &str) {
        for senders in [&self.senders, &self.node_senders] {
            for tx in senders.lock().unwrap_or_else(|p| p.into_inner()).values() {
                let _ = tx.send(ToWorker::Abort {
                    reason: reason.to_string(),
                });
            }
        }
    }

    /// Tells every other node's zrun that the job ended with `code`, and waits
    /// (at most `limit`) until that has been written to each.
    pub async fn finish_nodes(&self, code: u8, limit: Duration) {
        for tx in self
            .node_senders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            let _ = tx.send(ToWorker::Finished { code });
        }
        let writers =
            std::mem::take(&mut *self.node_writers.lock().unwrap_or_else(|p| p.into_inner()));
        let _ = tokio::time::timeout(limit, async {
            for w in writers {
                let _ = w.await;
            }
        })
        .await;
    }
}

/// The authenticated connections, shared by the per-connection tasks.
#[derive(Clone)]
struct Connections {
    workers: Senders,
    nodes: Senders,
    node_writers: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

async fn serve(
    mut stream: TcpStream,
    peer: SocketAddr,
    info: &JobInfo,
    store: &Arc<Store>,
    conns: &Connections,
    events: &mpsc::UnboundedSender<Event>,
) {
    let senders = &conns.workers;
    let _ = stream.set_nodelay(true);
    let challenge = nonce();
    let hello = tokio::time::timeout(HANDSHAKE_DEADLINE, async {
        write_frame_async(&mut stream, &ToWorker::Challenge { nonce: challenge }).await?;
        read_frame_async::<_, ToServer>(&mut stream, HANDSHAKE_MAX).await
    })
    .await;
    let (rank, worker_nonce, hostname, pid) = match hello {
        Ok(Ok(ToServer::Hello {
            rank,
            job_id,
            proof,
            nonce,
            pid,
            hostname,
        })) => {
            if !info.token.verify(CONTROL_CONTEXT, &challenge, rank, &proof) {
                tracing::warn!("dropping {peer}: wrong job token");
                return;
            }
            if job_id != info.job_id || rank as usize >= info.world_size {
                tracing::warn!(
                    "dropping {peer}: job `{job_id}` rank {rank} is not part of this job"
                );
                return;
            }
            (rank as usize, nonce, hostname, pid)
        }
        Ok(Ok(ToServer::NodeHello {
            node,
            proof,
            nonce,
            pid,
            hostname,
            workers,
        })) => {
            if !info.token.verify(NODE_CONTEXT, &challenge, node, &proof) {
                tracing::warn!("dropping {peer}: wrong job token");
                return;
            }
            let hello = NodeHello {
                node: node as usize,
                nonce,
                pid,
                hostname,
                workers: workers as usize,
            };
            serve_node(stream, peer, info, hello, conns, events).await;
            return;
        }
        Ok(Ok(_)) => {
            tracing::warn!("dropping {peer}: did not say hello");
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!("dropping {peer}: {e}");
            return;
        }
        Err(_) => {
            tracing::warn!("dropping {peer}: no handshake within {HANDSHAKE_DEADLINE:?}");
            return;
        }
    };
    let (tx, outbox) = mpsc::unbounded_channel::<ToWorker>();
    {
        let mut s = senders.lock().unwrap_or_else(|p| p.into_inner());
        if s.contains_key(&rank) {
            tracing::warn!("dropping {peer}: rank {rank} is already connected");
            return;
        }
        s.insert(rank, tx.clone());
    }
    let welcome = Welcome {
        server_proof: info.token.prove(SERVER_CONTEXT, &worker_nonce, rank as u64),
        node_of_rank: info.node_of_rank.clone(),
        task: info.task.clone(),
    };
    if write_frame_async(&mut stream, &ToWorker::Welcome(Box::new(welcome)))
        .await
        .is_err()
    {
        senders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&rank);
        let _ = events.send(Event::Lost {
            rank,
            reason: "closed during the handshake".into(),
        });
        return;
    }
    let _ = events.send(Event::Joined {
        rank,
        hostname,
        pid,
    });
    let (mut rd, wr) = stream.into_split();
    let writer = spawn_writer(wr, outbox);
    let reason = loop {
        match read_frame_async::<_, ToServer>(&mut rd, MAX_FRAME).await {
            Ok(ToServer::KvSet { key, value }) => store.set(key, value),
            Ok(ToServer::KvGet { key }) => {
                let _ = tx.send(ToWorker::KvValue {
                    value: store.get(&key),
                    key,
                });
            }
            Ok(ToServer::KvWait { keys, timeout_ms }) => {
                let (store, tx) = (store.clone(), tx.clone());
                tokio::spawn(async move {
                    let result = store.wait(&keys, Duration::from_millis(timeout_ms)).await;
                    let _ = tx.send(ToWorker::KvWaited { result });
                });
            }
            Ok(msg) => {
                let _ = events.send(Event::Message {
                    rank,
                    msg: Box::new(msg),
                });
            }
            Err(e) => break e.to_string(),
        }
    };
    senders
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&rank);
    writer.abort();
    let _ = events.send(Event::Lost { rank, reason });
}

/// Writes a connection's outgoing messages in order until the channel closes,
/// a write fails, or `Finished` (the last word to a node) has been written.
fn spawn_writer(
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    mut outbox: mpsc::UnboundedReceiver<ToWorker>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(msg) = outbox.recv().await {
            let last = matches!(msg, ToWorker::Finished { .. });
            if write_frame_async(&mut wr, &msg).await.is_err() || last {
                break;
            }
        }
    })
}

/// A node's authenticated hello (per-node mode).
struct NodeHello {
    node: usize,
    nonce: zproto::Nonce,
    pid: u32,
    hostname: String,
    workers: usize,
}

/// Serves another node's zrun: welcome (or refusal), then its relayed events.
async fn serve_node(
    mut stream: TcpStream,
    peer: SocketAddr,
    info: &JobInfo,
    hello: NodeHello,
    conns: &Connections,
    events: &mpsc::UnboundedSender<Event>,
) {
    let (nodes, per_node) = info.nodes;
    let node = hello.node;
    let refusal = if node == 0 || node >= nodes {
        Some(format!(
            "node rank {node} is not part of this {nodes}-node job (node 0 is this zrun; the others are 1..{})",
            nodes.max(1) - 1
        ))
    } else if hello.workers != per_node {
        Some(format!(
            "node {node} would start {} workers; every node of this job has {per_node} (--workers-per-node)",
            hello.workers
        ))
    } else {
        None
    };
    let (tx, outbox) = mpsc::unbounded_channel::<ToWorker>();
    let refusal = refusal.or_else(|| {
        let mut s = conns.nodes.lock().unwrap_or_else(|p| p.into_inner());
        if s.contains_key(&node) {
            return Some(format!("node {node} has already joined"));
        }
        s.insert(node, tx.clone());
        None
    });
    if let Some(reason) = refusal {
        tracing::warn!("refusing {peer}: {reason}");
        let _ = write_frame_async(&mut stream, &ToWorker::Abort { reason }).await;
        return;
    }
    let welcome = NodeWelcome {
        server_proof: info
            .token
            .prove(NODE_SERVER_CONTEXT, &hello.nonce, node as u64),
        job_id: info.job_id.clone(),
        task: info.task.clone(),
    };
    if write_frame_async(&mut stream, &ToWorker::NodeWelcome(Box::new(welcome)))
        .await
        .is_err()
    {
        conns
            .nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&node);
        let _ = events.send(Event::Node {
            node,
            what: NodeEvent::Lost("closed during the handshake".into()),
        });
        return;
    }
    let _ = events.send(Event::Node {
        node,
        what: NodeEvent::Joined {
            hostname: hello.hostname,
            pid: hello.pid,
        },
    });
    let (mut rd, wr) = stream.into_split();
    let writer = spawn_writer(wr, outbox);
    conns
        .node_writers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(writer);
    let reason = loop {
        match read_frame_async::<_, ToServer>(&mut rd, MAX_FRAME).await {
            Ok(
                msg @ (ToServer::NodeOutput { .. }
                | ToServer::NodeExited { .. }
                | ToServer::NodeStopping { .. }),
            ) => {
                let _ = events.send(Event::Node {
                    node,
                    what: NodeEvent::Message(Box::new(msg)),
                });
            }
            Ok(other) => tracing::warn!("node {node} sent an unexpected message: {other:?}"),
            Err(e) => break e.to_string(),
        }
    };
    conns
        .nodes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&node);
    let _ = events.send(Event::Node {
        node,
        what: NodeEvent::Lost(reason),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One handshake as a client: reads the challenge, answers with what
    /// `answer` makes of it, and returns the nonce it was given and zrun's
    /// reply (`None`: zrun closed the connection).
    async fn handshake(
        addr: SocketAddr,
        answer: impl FnOnce(&zproto::auth::Nonce) -> ToServer,
    ) -> (zproto::auth::Nonce, Option<ToWorker>) {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let ToWorker::Challenge { nonce } = read_frame_async(&mut s, HANDSHAKE_MAX).await.unwrap()
        else {
            panic!("zrun did not open with a challenge")
        };
        write_frame_async(&mut s, &answer(&nonce)).await.unwrap();
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            read_frame_async::<_, ToWorker>(&mut s, MAX_FRAME),
        )
        .await
        .expect("zrun neither answered nor closed within 10 s");
        (nonce, reply.ok())
    }

    fn hello(job_id: &str, rank: u64, proof: zproto::auth::Proof) -> ToServer {
        ToServer::Hello {
            rank,
            job_id: job_id.into(),
            proof,
            nonce: [7; 32],
            pid: 1,
            hostname: "test".into(),
        }
    }

    /// The HMAC is what admits a worker: a peer that knows the job id but not
    /// the token is dropped, and so is a valid proof replayed on another
    /// connection (its nonce differs); the right token gets a welcome whose
    /// proof shows that zrun knows the token too.
    #[tokio::test]
    async fn only_the_job_token_admits_a_worker_and_proofs_do_not_replay() {
        let token = Token::generate();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (events, mut seen) = mpsc::unbounded_channel();
        let info = JobInfo {
            token: token.clone(),
            job_id: "job-1".into(),
            world_size: 2,
            node_of_rank: vec![0, 0],
            task: Task::BenchKernels {
                elements: 1024,
                gemm_peak_only: false,
            },
            nodes: (0, 0),
        };
        let server = Server::start(listener, info, events).unwrap();
        let stranger = Token::generate();
        let (_, reply) = handshake(server.addr, |n| {
            hello("job-1", 0, stranger.prove(CONTROL_CONTEXT, n, 0))
        })
        .await;
        assert!(reply.is_none(), "a wrong token was answered: {reply:?}");
        // A proof made for another context (zrun's own) is no worker's proof.
        let (_, reply) = handshake(server.addr, |n| {
            hello("job-1", 0, token.prove(SERVER_CONTEXT, n, 0))
        })
        .await;
        assert!(reply.is_none(), "another context's proof was answered");
        // Rank 1 joins properly; its proof, replayed for rank 1 on a new
        // connection (with a new nonce), is refused.
        let mut recorded = None;
        let (_, reply) = handshake(server.addr, |n| {
            let p = token.prove(CONTROL_CONTEXT, n, 1);
            recorded = Some(p.clone());
            hello("job-1", 1, p)
        })
        .await;
        let Some(ToWorker::Welcome(w)) = reply else {
            panic!("the right token was refused: {reply:?}")
        };
        assert!(token.verify(SERVER_CONTEXT, &[7; 32], 1, &w.server_proof));
        assert!(!stranger.verify(SERVER_CONTEXT, &[7; 32], 1, &w.server_proof));
        let (_, reply) = handshake(server.addr, |_| hello("job-1", 0, recorded.unwrap())).await;
        assert!(reply.is_none(), "a replayed proof was answered");
        // The right token with the wrong job id is refused too.
        let (_, reply) = handshake(server.addr, |n| {
            hello("job-2", 0, token.prove(CONTROL_CONTEXT, n, 0))
        })
        .await;
        assert!(reply.is_none(), "another job's id was answered");
        // Exactly one rank joined.
        let mut joined = Vec::new();
        while let Ok(e) = seen.try_recv() {
            if let Event::Joined { rank, .. } = e {
                joined.push(rank);
            }
        }
        assert_eq!(joined, [1]);
    }

    #[tokio::test]
    async fn kv_wait_sees_keys_set_later_and_times_out_naming_the_missing() {
        let s = Arc::new(Store::default());
        let s2 = s.clone();
        let waiter = tokio::spawn(async move {
            s2.wait(&["a".into(), "b".into()], Duration::from_secs(5))
                .await
        });
        s.set("a".into(), "1".into());
        tokio::time::sleep(Duration::from_millis(20)).await;
        s.set("b".into(), "2".into());
        assert_eq!(
            waiter.await.unwrap(),
            Ok(vec!["1".to_string(), "2".to_string()])
        );
        let r = s
            .wait(&["a".into(), "zzz".into()], Duration::from_millis(50))
            .await;
        assert_eq!(r, Err(vec!["zzz".to_string()]));
    }
}
