//! Starting workers on other hosts over SSH (libssh2 through the ssh2 crate; no
//! `ssh` or `pdsh` binaries).
//!
//! Every host is connected and verified before any worker starts: its host key
//! must match `--known-hosts` (an unknown key is added only with
//! `--ssh-accept-new`), and the user authenticates with `--ssh-key`, else the
//! ssh-agent, else `~/.ssh/id_ed25519` / `id_rsa`. Any failure there is a launch
//! failure (exit 3) naming the host, before anything trains.
//!
//! Each rank then gets its own session and channel running
//! `cd CWD && echo ZRUN_PID $$ && exec env VARS... WORKER`, with the job token
//! read from the channel's stdin so it never appears in a command line. `$$` is
//! the remote shell's pid, which `exec` hands to the worker; sshd made it the
//! leader of its own process group, so killing `-PID` stops the worker and
//! anything it started. ssh2 is blocking: all of this runs on blocking threads,
//! never on the control server's runtime.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ssh2::{CheckResult, KnownHostFileKind, Session};
use tokio::sync::mpsc;

use crate::worker::{JobEnv, ProcEvent, SshOptions};
use crate::Failure;

/// How long connecting to and authenticating with one host may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One host to start workers on.
#[derive(Debug, Clone)]
pub struct Target {
    /// Host name or address.
    pub host: String,
    /// SSH port.
    pub port: u16,
    /// User.
    pub user: String,
}

/// Why reaching or using a host over SSH failed. Every message names the host.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SshError {
    /// The host name does not resolve.
    #[error("cannot resolve {host}: {cause}")]
    Resolve {
        /// Host.
        host: String,
        /// Cause.
        cause: io::Error,
    },
    /// The host name resolves to no address.
    #[error("{host} resolves to nothing")]
    NoAddress {
        /// Host.
        host: String,
    },
    /// No TCP connection.
    #[error("cannot reach {host}:{port}: {cause}")]
    Unreachable {
        /// Host.
        host: String,
        /// Port.
        port: u16,
        /// Cause.
        cause: io::Error,
    },
    /// The SSH handshake failed.
    #[error("SSH handshake with {host}:{port} failed: {cause}")]
    Handshake {
        /// Host.
        host: String,
        /// Port.
        port: u16,
        /// Cause.
        cause: ssh2::Error,
    },
    /// The host's key is not the one recorded.
    #[error("the host key of {host}:{port} does not match {} (changed key, or someone in between); refusing to connect", known_hosts.display())]
    HostKeyMismatch {
        /// Host.
        host: String,
        /// Port.
        port: u16,
        /// The known_hosts file.
        known_hosts: PathBuf,
    },
    /// The host's key is not recorded and `--ssh-accept-new` was not given.
    #[error("the host key of {host}:{port} is not in {} (connect once with ssh, or pass --ssh-accept-new)", known_hosts.display())]
    UnknownHostKey {
        /// Host.
        host: String,
        /// Port.
        port: u16,
        /// The known_hosts file.
        known_hosts: PathBuf,
    },
    /// The host sent no key, or libssh2 could not check it.
    #[error("checking the host key of {host} failed")]
    HostKeyCheck {
        /// Host.
        host: String,
    },
    /// Reading or writing the known_hosts file failed.
    #[error("{what} {}: {cause}", path.display())]
    KnownHosts {
        /// `reading` or `writing`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Cause.
        cause: ssh2::Error,
    },
    /// The host refused the key given with `--ssh-key`.
    #[error("{user}@{host} refused the key {}: {cause}", key.display())]
    KeyRefused {
        /// User.
        user: String,
        /// Host.
        host: String,
        /// The key file.
        key: PathBuf,
        /// Cause.
        cause: ssh2::Error,
    },
    /// Neither the agent nor a default key was accepted.
    #[error("{user}@{host}: no key was accepted (tried: {}); pass --ssh-key", if tried.is_empty() { "nothing found".to_string() } else { tried.join(", ") })]
    NoKeyAccepted {
        /// User.
        user: String,
        /// Host.
        host: String,
        /// What was tried, with why it failed.
        tried: Vec<String>,
    },
    /// A step of running a command on the host failed.
    #[error("{host}: {what}: {cause}")]
    Remote {
        /// Host.
        host: String,
        /// The step (opening a channel, starting the worker, ...).
        what: &'static str,
        /// Cause.
        cause: ssh2::Error,
    },
    /// A local I/O step failed (sending the token, starting a thread).
    #[error("{host}: {what}: {cause}")]
    Io {
        /// Host.
        host: String,
        /// The step.
        what: &'static str,
        /// Cause.
        cause: io::Error,
    },
}

impl Target {
    fn remote(&self, what: &'static str) -> impl FnOnce(ssh2::Error) -> SshError + '_ {
        move |cause| SshError::Remote {
            host: self.host.clone(),
            what,
            cause,
        }
    }

    fn io(&self, what: &'static str) -> impl FnOnce(io::Error) -> SshError + '_ {
        move |cause| SshError::Io {
            host: self.host.clone(),
            what,
            cause,
        }
    }
}

/// Connects, verifies the host key and authenticates.
pub fn connect(t: &Target, o: &SshOptions) -> Result<Session, SshError> {
    let host = || t.host.clone();
    let addr = (t.host.as_str(), t.port)
        .to_socket_addrs()
        .map_err(|cause| SshError::Resolve {
            host: host(),
            cause,
        })?
        .next()
        .ok_or_else(|| SshError::NoAddress { host: host() })?;
    let tcp = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(|cause| {
        SshError::Unreachable {
            host: host(),
            port: t.port,
            cause,
        }
    })?;
    let handshake = |cause| SshError::Handshake {
        host: host(),
        port: t.port,
        cause,
    };
    let mut s = Session::new().map_err(handshake)?;
    s.set_tcp_stream(tcp);
    s.set_timeout(CONNECT_TIMEOUT.as_millis() as u32);
    s.handshake().map_err(handshake)?;
    verify_host_key(&s, t, o)?;
    authenticate(&s, t, o)?;
    s.set_timeout(0);
    Ok(s)
}

fn verify_host_key(s: &Session, t: &Target, o: &SshOptions) -> Result<(), SshError> {
    let check_failed = || SshError::HostKeyCheck {
        host: t.host.clone(),
    };
    let known_hosts = |what| {
        move |cause| SshError::KnownHosts {
            what,
            path: o.known_hosts.clone(),
            cause,
        }
    };
    let (key, kind) = s.host_key().ok_or_else(check_failed)?;
    // Hosts are connected to in parallel, and recording a new key rewrites the
    // whole file: without this lock, two new hosts' threads each read the file
    // and the second write drops the first's key.
    static KNOWN_HOSTS_FILE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _file = KNOWN_HOSTS_FILE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut kh = s.known_hosts().map_err(known_hosts("reading"))?;
    if o.known_hosts.exists() {
        kh.read_file(&o.known_hosts, KnownHostFileKind::OpenSSH)
            .map_err(known_hosts("reading"))?;
    }
    match kh.check_port(&t.host, t.port, key) {
        CheckResult::Match => Ok(()),
        CheckResult::Mismatch => Err(SshError::HostKeyMismatch {
            host: t.host.clone(),
            port: t.port,
            known_hosts: o.known_hosts.clone(),
        }),
        CheckResult::NotFound if o.accept_new => {
            let name = if t.port == 22 {
                t.host.clone()
            } else {
                format!("[{}]:{}", t.host, t.port)
            };
            kh.add(&name, key, "added by zrun --ssh-accept-new", kind.into())
                .map_err(known_hosts("writing"))?;
            kh.write_file(&o.known_hosts, KnownHostFileKind::OpenSSH)
                .map_err(known_hosts("writing"))?;
            Ok(())
        }
        CheckResult::NotFound => Err(SshError::UnknownHostKey {
            host: t.host.clone(),
            port: t.port,
            known_hosts: o.known_hosts.clone(),
        }),
        CheckResult::Failure => Err(check_failed()),
    }
}

fn authenticate(s: &Session, t: &Target, o: &SshOptions) -> Result<(), SshError> {
    let mut tried = Vec::new();
    if let Some(k) = &o.key {
        return s
            .userauth_pubkey_file(&t.user, None, k, None)
            .map_err(|cause| SshError::KeyRefused {
                user: t.user.clone(),
                host: t.host.clone(),
                key: k.clone(),
                cause,
            });
    }
    if std::env::var_os("SSH_AUTH_SOCK").is_some() {
        match s.userauth_agent(&t.user) {
            Ok(()) => return Ok(()),
            Err(e) => tried.push(format!("ssh-agent ({e})")),
        }
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    for name in ["id_ed25519", "id_rsa"] {
        let k = home.join(".ssh").join(name);
        if k.is_file() {
            match s.userauth_pubkey_file(&t.user, None, &k, None) {
                Ok(()) => return Ok(()),
                Err(e) => tried.push(format!("{} ({e})", k.display())),
            }
        }
    }
    Err(SshError::NoKeyAccepted {
        user: t.user.clone(),
        host: t.host.clone(),
        tried,
    })
}

/// Quotes a string for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A started remote worker: where it runs and, once it has said so, its pid.
#[derive(Debug, Clone)]
pub struct RemoteProc {
    /// Host.
    pub target: Target,
    /// The worker's pid (and process group) on that host.
    pub pid: Arc<Mutex<Option<u32>>>,
}

/// Starts one worker over an authenticated session; output and exit come back as
/// events. Runs the channel on a thread of its own.
#[allow(clippy::too_many_arguments)]
pub fn start_worker(
    session: Session,
    target: Target,
    rank: usize,
    cwd: &Path,
    worker_bin: &Path,
    env: &[(String, String)],
    job: &JobEnv,
    events: mpsc::UnboundedSender<ProcEvent>,
) -> Result<RemoteProc, SshError> {
    let mut vars = String::new();
    for (k, v) in env {
        vars.push_str(&format!("{k}={} ", shell_quote(v)));
    }
    let cmd = format!(
        "cd {} && read -r ZRUN_TOKEN && export ZRUN_TOKEN && echo ZRUN_PID $$ && exec env {vars}{}",
        shell_quote(&cwd.display().to_string()),
        shell_quote(&worker_bin.display().to_string())
    );
    let mut ch = session
        .channel_session()
        .map_err(target.remote("opening a channel"))?;
    ch.handle_extended_data(ssh2::ExtendedData::Merge)
        .map_err(target.remote("merging the worker's stderr"))?;
    ch.exec(&cmd)
        .map_err(target.remote("starting the worker"))?;
    ch.write_all(format!("{}\n", job.token_hex).as_bytes())
        .map_err(target.io("sending the job token"))?;
    ch.send_eof()
        .map_err(target.remote("sending the job token"))?;
    let host = target.host.clone();
    let pid = Arc::new(Mutex::new(None));
    let proc = RemoteProc {
        target: target.clone(),
        pid: pid.clone(),
    };
    std::thread::Builder::new()
        .name(format!("zrun-ssh-{rank}"))
        .spawn(move || {
            let _session = session; // keep the connection open while the channel lives
            let mut reader = BufReader::new(&mut ch);
            let mut line = String::new();
            while matches!(reader.read_line(&mut line), Ok(n) if n > 0) {
                let text = line.trim_end_matches(['\n', '\r']).to_string();
                line.clear();
                if let Some(p) = text
                    .strip_prefix("ZRUN_PID ")
                    .and_then(|p| p.trim().parse().ok())
                {
                    *pid.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
                    continue;
                }
                let _ = events.send(ProcEvent::Output {
                    rank,
                    line: format!("({}) {text}", target.host),
                    stderr: false,
                });
            }
            drop(reader);
            let _ = ch.wait_close();
            let status = match ch.exit_signal().ok().and_then(|s| s.exit_signal) {
                Some(sig) => ExitStatus::from_raw(signal_number(&sig)),
                None => ExitStatus::from_raw((ch.exit_status().unwrap_or(255) & 0xff) << 8),
            };
            let _ = events.send(ProcEvent::Exited { rank, status });
        })
        .map_err(|cause| SshError::Io {
            host,
            what: "starting the output thread",
            cause,
        })?;
    Ok(proc)
}

fn signal_number(name: &str) -> i32 {
    match name {
        "HUP" => 1,
        "INT" => 2,
        "QUIT" => 3,
        "ABRT" => 6,
        "KILL" => 9,
        "SEGV" => 11,
        "PIPE" => 13,
        "TERM" => 15,
        _ => 9,
    }
}

/// Kills a remote worker's process group (blocking; bounded by the connect timeout).
pub fn kill(p: &RemoteProc, o: &SshOptions) -> Result<(), SshError> {
    let Some(pid) = *p.pid.lock().unwrap_or_else(|e| e.into_inner()) else {
        return Ok(()); // it never started
    };
    let s = connect(&p.target, o)?;
    let t = &p.target;
    let mut ch = s.channel_session().map_err(t.remote("opening a channel"))?;
    ch.exec(&format!(
        "kill -9 -- -{pid} 2>/dev/null; kill -9 {pid} 2>/dev/null; true"
    ))
    .map_err(t.remote("killing the worker"))?;
    let _ = ch.wait_close();
    Ok(())
}

/// Connects to every target (in parallel, on blocking threads); any failure is a
/// launch failure naming the host.
pub async fn connect_all(targets: &[Target], o: &SshOptions) -> anyhow::Result<Vec<Session>> {
    let mut tasks = Vec::new();
    for t in targets {
        let (t, o) = (t.clone(), o.clone());
        tasks.push(tokio::task::spawn_blocking(move || {
            connect(&t, &o).map_err(|e| (t.host.clone(), Box::new(e)))
        }));
    }
    let mut out = Vec::new();
    for task in tasks {
        match tokio::time::timeout(CONNECT_TIMEOUT * 2, task).await {
            Ok(Ok(Ok(s))) => out.push(s),
            Ok(Ok(Err((host, e)))) => return Err(Failure::launch(format!("ssh to {host}: {e}"))),
            Ok(Err(e)) => return Err(Failure::launch(format!("ssh: {e}"))),
            Err(_) => return Err(Failure::launch("ssh: connecting timed out".to_string())),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_quotes() {
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
