//! Building the TCP mesh: every pair of ranks gets one authenticated connection.
//!
//! Rank i dials every rank j < i and accepts from every j > i. Both sides prove the
//! job token (zproto's HMAC proofs, data-plane context): the dialer proves to the
//! acceptor and the acceptor to the dialer, each over a fresh nonce of the other.
//! The acceptor handles each incoming connection on its own short-lived thread
//! with a handshake deadline, so a stranger who connects and stalls, or sends
//! garbage, is dropped without delaying the real peers.

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use zproto::auth::nonce;
use zproto::frame::{read_frame, write_frame, HANDSHAKE_MAX};
use zproto::{Nonce, Proof, Token};

use crate::SetupError;

const DIALER_CONTEXT: &str = "zrun-data-dialer-v1";
const ACCEPTOR_CONTEXT: &str = "zrun-data-acceptor-v1";
/// How long a connecting stranger may take to finish its handshake.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Serialize, Deserialize)]
struct DialHello {
    from: u64,
    to: u64,
    nonce: Nonce,
}

#[derive(Serialize, Deserialize)]
struct AcceptChallenge {
    nonce: Nonce,
    proof: Proof,
}

#[derive(Serialize, Deserialize)]
struct DialProof {
    proof: Proof,
}

/// Connects to every peer; returns one stream per rank (`None` for this rank).
pub(crate) fn connect_mesh(
    rank: usize,
    listener: TcpListener,
    addrs: &[SocketAddr],
    token: &Token,
    timeout: Duration,
) -> Result<Vec<Option<TcpStream>>, SetupError> {
    let w = addrs.len();
    let deadline = Instant::now() + timeout;
    let mut streams: Vec<Option<TcpStream>> = (0..w).map(|_| None).collect();
    let expected_accepts = w - rank - 1;
    let acceptor = {
        let token = token.clone();
        std::thread::Builder::new()
            .name("zcomm-accept".into())
            .spawn(move || accept_peers(rank, listener, expected_accepts, &token, deadline))
            .map_err(|e| SetupError::Thread(Arc::new(e)))?
    };
    for (peer, addr) in addrs.iter().enumerate().take(rank) {
        streams[peer] = Some(dial(rank, peer, *addr, token, deadline)?);
    }
    let accepted = acceptor.join().map_err(|_| SetupError::AcceptPanicked)??;
    for (peer, s) in accepted {
        streams[peer] = Some(s);
    }
    Ok(streams)
}

fn dial(
    rank: usize,
    peer: usize,
    addr: SocketAddr,
    token: &Token,
    deadline: Instant,
) -> Result<TcpStream, SetupError> {
    let mut last = None;
    let handshake = |cause: zproto::FrameError| SetupError::Handshake {
        peer,
        addr,
        cause: Arc::new(cause),
    };
    while Instant::now() < deadline {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_secs(5));
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(mut s) => {
                s.set_read_timeout(Some(HANDSHAKE_DEADLINE))?;
                let mine = nonce();
                write_frame(
                    &mut s,
                    &DialHello {
                        from: rank as u64,
                        to: peer as u64,
                        nonce: mine,
                    },
                )
                .map_err(handshake)?;
                let ch: AcceptChallenge = read_frame(&mut s, HANDSHAKE_MAX).map_err(handshake)?;
                if !token.verify(ACCEPTOR_CONTEXT, &mine, peer as u64, &ch.proof) {
                    return Err(SetupError::BadProof { peer, addr });
                }
                let proof = token.prove(DIALER_CONTEXT, &ch.nonce, rank as u64);
                write_frame(&mut s, &DialProof { proof }).map_err(handshake)?;
                s.set_read_timeout(None)?;
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => {
                last = Some(Arc::new(e));
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    Err(SetupError::Unreachable { peer, addr, last })
}

fn accept_peers(
    rank: usize,
    listener: TcpListener,
    expected: usize,
    token: &Token,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>, SetupError> {
    let mut got: Vec<(usize, TcpStream)> = Vec::new();
    if expected == 0 {
        return Ok(got);
    }
    listener.set_nonblocking(true)?;
    let (tx, rx) = mpsc::channel::<(usize, TcpStream)>();
    while got.len() < expected {
        if Instant::now() >= deadline {
            return Err(SetupError::AcceptTimeout {
                rank,
                expected,
                have: got.iter().map(|(p, _)| *p).collect(),
            });
        }
        match listener.accept() {
            Ok((s, _)) => {
                let tx = tx.clone();
                let token = token.clone();
                // A stranger's stalled handshake must not block the real peers.
                std::thread::spawn(move || {
                    if let Some(ok) = answer(rank, s, &token) {
                        let _ = tx.send(ok);
                    }
                });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
        while let Ok((peer, s)) = rx.try_recv() {
            if peer > rank && !got.iter().any(|(p, _)| *p == peer) {
                got.push((peer, s));
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(got)
}

/// Runs the acceptor's side of the handshake; `None` drops the connection.
fn answer(rank: usize, mut s: TcpStream, token: &Token) -> Option<(usize, TcpStream)> {
    s.set_nonblocking(false).ok()?;
    s.set_read_timeout(Some(HANDSHAKE_DEADLINE)).ok()?;
    let hello: DialHello = read_frame(&mut s, HANDSHAKE_MAX).ok()?;
    if hello.to != rank as u64 {
        return None;
    }
    let mine = nonce();
    let proof = token.prove(ACCEPTOR_CONTEXT, &hello.nonce, rank as u64);
    write_frame(&mut s, &AcceptChallenge { nonce: mine, proof }).ok()?;
    let p: DialProof = read_frame(&mut s, HANDSHAKE_MAX).ok()?;
    if !token.verify(DIALER_CONTEXT, &mine, hello.from, &p.proof) {
        tracing::warn!(
            "data-plane connection claiming rank {} failed authentication",
            hello.from
        );
        return None;
    }
    s.set_read_timeout(None).ok()?;
    s.set_nodelay(true).ok()?;
    Some((hello.from as usize, s))
}
