//! The worker's side of the control connection to zrun.
//!
//! After the handshake a reader thread owns the socket's read half: an `Abort`
//! from zrun, or zrun going away, ends the process at once (zrun is tearing the
//! job down; there is nothing to save). Replies to key-value requests go to the
//! thread that asked, through a channel. Sends are serialised by a mutex so the
//! heartbeat thread and the training loop can share the socket.

use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use zcomm::Communicator;
use zproto::auth::nonce;
use zproto::frame::{read_frame, write_frame, HANDSHAKE_MAX, MAX_FRAME};
use zproto::{ToServer, ToWorker, Welcome, CONTROL_CONTEXT, SERVER_CONTEXT};

use crate::env::WorkerEnv;

/// How long a worker keeps trying to reach zrun.
const CONNECT_DEADLINE: Duration = Duration::from_secs(30);

/// An authenticated control connection.
pub struct ControlClient {
    writer: Mutex<TcpStream>,
    replies: Mutex<mpsc::Receiver<ToWorker>>,
    rank: usize,
    /// The world communicator once it exists: heartbeats say which collective
    /// the worker is in, for zrun's hang diagnosis.
    comms: Mutex<Vec<Arc<dyn Communicator>>>,
    /// Set by zrun's `Stop` or by SIGUSR1: end the job after a step.
    stop: Arc<AtomicBool>,
}

impl ControlClient {
    /// The flag that zrun's `Stop` and SIGUSR1 set (for
    /// `zengine::Engine::stop_on`).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// Connects, proves the token, checks zrun's proof, and returns the task.
    pub fn connect(env: &WorkerEnv) -> Result<(Arc<ControlClient>, Welcome)> {
        let target = format!("{}:{}", env.master_addr, env.master_port);
        let deadline = Instant::now() + CONNECT_DEADLINE;
        // zrun drops connections beyond its limit (a flood of strangers): retry
        // until a challenge arrives or the deadline passes.
        let (mut stream, server_nonce) = loop {
            let addr = target
                .to_socket_addrs()
                .with_context(|| format!("cannot resolve zrun's address {target}"))?
                .next()
                .ok_or_else(|| anyhow!("{target} resolves to nothing"))?;
            let attempt = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                .map_err(anyhow::Error::from)
                .and_then(|mut s| {
                    s.set_read_timeout(Some(Duration::from_secs(10)))?;
                    s.set_nodelay(true)?;
                    match read_frame(&mut s, HANDSHAKE_MAX)? {
                        ToWorker::Challenge { nonce } => Ok((s, nonce)),
                        _ => Err(anyhow!("zrun at {target} did not open with a challenge")),
                    }
                });
            match attempt {
                Ok(ok) => break ok,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("connecting to zrun at {target}: {e:#}; retrying");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => bail!("cannot reach zrun at {target}: {e:#}"),
            }
        };
        stream.set_read_timeout(Some(CONNECT_DEADLINE))?;
        let my_nonce = nonce();
        let hello = ToServer::Hello {
            rank: env.rank as u64,
            job_id: env.job_id.clone(),
            proof: env
                .token
                .prove(CONTROL_CONTEXT, &server_nonce, env.rank as u64),
            nonce: my_nonce,
            pid: std::process::id(),
            hostname: hostname(),
        };
        write_frame(&mut stream, &hello)?;
        let welcome = match read_frame(&mut stream, MAX_FRAME) {
            Ok(ToWorker::Welcome(w)) => *w,
            Ok(ToWorker::Abort { reason }) => bail!("zrun refused rank {}: {reason}", env.rank),
            Ok(other) => bail!("unexpected answer from zrun: {other:?}"),
            Err(e) => bail!("zrun closed the handshake (wrong job token?): {e}"),
        };
        if !env.token.verify(
            SERVER_CONTEXT,
            &my_nonce,
            env.rank as u64,
            &welcome.server_proof,
        ) {
            bail!("the server at {target} does not know the job token");
        }
        stream.set_read_timeout(None)?;
        let mut reader = stream.try_clone()?;
        let (tx, rx) = mpsc::channel();
        let rank = env.rank;
        let stop = Arc::new(AtomicBool::new(false));
        // SIGUSR1 to the worker itself (Slurm's `--signal=USR1@90`, or
        // `scancel --signal=USR1`, reach every process of the step) asks
        // for the same as zrun's `Stop`; without a handler it would kill it.
        signal_hook::flag::register(signal_hook::consts::SIGUSR1, stop.clone())
            .context("installing the SIGUSR1 handler")?;
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("zworker-control".into())
            .spawn(move || loop {
                match read_frame::<_, ToWorker>(&mut reader, MAX_FRAME) {
                    Ok(ToWorker::Abort { reason }) => {
                        // Not eprintln!: with zrun gone, stderr may be a broken pipe, and a
                        // panic here would leave this worker running.
                        let _ = writeln!(
                            std::io::stderr(),
                            "zworker rank {rank}: stopped by zrun: {reason}"
                        );
                        std::process::exit(1);
                    }
                    Ok(ToWorker::Ping) => {}
                    Ok(ToWorker::Stop) => stop.store(true, Ordering::SeqCst),
                    Ok(reply) => {
                        let _ = tx.send(reply);
                    }
                    Err(e) => {
                        let _ = writeln!(
                        std::io::stderr(),
                        "zworker rank {rank}: lost the control connection to zrun ({e}); exiting"
                    );
                        std::process::exit(1);
                    }
                }
            })?;
        let client = ControlClient {
            writer: Mutex::new(stream),
            replies: Mutex::new(rx),
            rank,
            comms: Mutex::new(Vec::new()),
            stop: flag,
        };
        Ok((Arc::new(client), welcome))
    }

    /// Sends one message.
    pub fn send(&self, msg: &ToServer) -> Result<()> {
        let mut w = self
            .writer
            .lock()
            .map_err(|_| anyhow!("control socket lock poisoned"))?;
        write_frame(&mut *w, msg).context("sending to zrun")
    }

    /// Stores `value` under `key` in zrun's key-value store.
    pub fn kv_set(&self, key: &str, value: &str) -> Result<()> {
        self.send(&ToServer::KvSet {
            key: key.into(),
            value: value.into(),
        })
    }

    /// Waits until every key is set; returns the values in order.
    pub fn kv_wait(&self, keys: Vec<String>, timeout: Duration) -> Result<Vec<String>> {
        let replies = self
            .replies
            .lock()
            .map_err(|_| anyhow!("control reply lock poisoned"))?;
        self.send(&ToServer::KvWait {
            keys,
            timeout_ms: timeout.as_millis() as u64,
        })?;
        match replies.recv_timeout(timeout + Duration::from_secs(10)) {
            Ok(ToWorker::KvWaited { result: Ok(values) }) => Ok(values),
            Ok(ToWorker::KvWaited {
                result: Err(missing),
            }) => Err(anyhow!(
                "rank {}: rendezvous timed out after {:.0}s waiting for {}",
                self.rank,
                timeout.as_secs_f64(),
                missing.join(", ")
            )),
            Ok(other) => Err(anyhow!("unexpected reply from zrun: {other:?}")),
            Err(_) => Err(anyhow!("zrun did not answer a key-value wait")),
        }
    }

    /// Lets heartbeats report the collective one of `comms` is in (an empty
    /// list lets go of them, so that dropping the last handles flushes the
    /// communicators).
    pub fn watch_comms(&self, comms: Vec<Arc<dyn Communicator>>) {
        if let Ok(mut c) = self.comms.lock() {
            *c = comms;
        }
    }

    /// Sends a heartbeat every `every` until the process ends; each says which
    /// collective the worker is in, if any.
    pub fn start_heartbeat(self: &Arc<Self>, every: Duration) {
        let me = self.clone();
        let _ = std::thread::Builder::new()
            .name("zworker-heartbeat".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                let op = me
                    .comms
                    .lock()
                    .ok()
                    .and_then(|c| c.iter().find_map(|c| c.in_flight()))
                    .map(|f| f.to_string());
                if me.send(&ToServer::Heartbeat { op }).is_err() {
                    return;
                }
            });
    }
}

/// This host's name, for messages.
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use zproto::{Task, Token};

    use super::*;

    /// A stand-in zrun on loopback that challenges one worker and answers its
    /// hello with `server_proof(worker nonce)`. Returns its port.
    fn fake_zrun(
        server_proof: impl FnOnce(&zproto::auth::Nonce) -> zproto::auth::Proof + Send + 'static,
    ) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            write_frame(&mut s, &ToWorker::Challenge { nonce: [1; 32] }).unwrap();
            let ToServer::Hello { nonce, .. } = read_frame(&mut s, HANDSHAKE_MAX).unwrap() else {
                panic!("the worker did not say hello")
            };
            let welcome = Welcome {
                server_proof: server_proof(&nonce),
                node_of_rank: vec![0],
                task: Task::BenchKernels {
                    elements: 1024,
                    gemm_peak_only: false,
                },
            };
            write_frame(&mut s, &ToWorker::Welcome(Box::new(welcome))).unwrap();
            // Held open for the rest of the test process: a worker whose
            // control connection closes exits the process.
            std::mem::forget(s);
        });
        port
    }

    fn env(port: u16, token: &Token) -> WorkerEnv {
        WorkerEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            job_id: "job".into(),
            token: token.clone(),
            node_addr: "127.0.0.1".into(),
        }
    }

    /// Authentication runs both ways: a worker refuses a zrun that cannot prove
    /// the job token (a stranger's proof, or a proof for another nonce, as a
    /// replay would be) and accepts the one that can.
    #[test]
    fn a_worker_refuses_a_zrun_without_the_job_token() {
        let token = Token::generate();
        let stranger = Token::generate();
        let port = fake_zrun(move |n| stranger.prove(SERVER_CONTEXT, n, 0));
        let e = ControlClient::connect(&env(port, &token)).err().unwrap();
        assert!(
            format!("{e:#}").contains("does not know the job token"),
            "{e:#}"
        );
        let t = token.clone();
        let port = fake_zrun(move |_| t.prove(SERVER_CONTEXT, &[9; 32], 0));
        let e = ControlClient::connect(&env(port, &token)).err().unwrap();
        assert!(
            format!("{e:#}").contains("does not know the job token"),
            "{e:#}"
        );
        let t = token.clone();
        let port = fake_zrun(move |n| t.prove(SERVER_CONTEXT, n, 0));
        let (_, welcome) = ControlClient::connect(&env(port, &token)).unwrap();
        assert!(matches!(
            welcome.task,
            Task::BenchKernels {
                elements: 1024,
                gemm_peak_only: false,
            }
        ));
    }
}
