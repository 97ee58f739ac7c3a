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

use std::io::{BufRead, BufReader, Write};
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

/// Connects, verifies the host key and authenticates.
pub fn connect(t: &Target, o: &SshOptions) -> Result<Session, String> {
    let addr = (t.host.as_str(), t.port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {}: {e}", t.host))?
        .next()
        .ok_or_else(|| format!("{} resolves to nothing", t.host))?;
    let tcp = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|e| format!("cannot reach {}:{}: {e}", t.host, t.port))?;
    let mut s = Session::new().map_err(|e| e.to_string())?;
    s.set_tcp_stream(tcp);
    s.set_timeout(CONNECT_TIMEOUT.as_millis() as u32);
    s.handshake()
        .map_err(|e| format!("SSH handshake with {}:{} failed: {e}", t.host, t.port))?;
    verify_host_key(&s, t, o)?;
    authenticate(&s, t, o)?;
    s.set_timeout(0);
    Ok(s)
}

fn verify_host_key(s: &Session, t: &Target, o: &SshOptions) -> Result<(), String> {
    let (key, kind) = s
        .host_key()
        .ok_or_else(|| format!("{} sent no host key", t.host))?;
    let mut kh = s.known_hosts().map_err(|e| e.to_string())?;
    if o.known_hosts.exists() {
        kh.read_file(&o.known_hosts, KnownHostFileKind::OpenSSH)
            .map_err(|e| format!("reading {}: {e}", o.known_hosts.display()))?;
    }
    match kh.check_port(&t.host, t.port, key) {
        CheckResult::Match => Ok(()),
        CheckResult::Mismatch => Err(format!(
            "the host key of {}:{} does not match {} (changed key, or someone in between); refusing to connect",
            t.host,
            t.port,
            o.known_hosts.display()
        )),
        CheckResult::NotFound if o.accept_new => {
            let name = if t.port == 22 { t.host.clone() } else { format!("[{}]:{}", t.host, t.port) };
            kh.add(&name, key, "added by zrun --ssh-accept-new", kind.into()).map_err(|e| e.to_string())?;
            kh.write_file(&o.known_hosts, KnownHostFileKind::OpenSSH)
                .map_err(|e| format!("writing {}: {e}", o.known_hosts.display()))?;
            Ok(())
        }
        CheckResult::NotFound => Err(format!(
            "the host key of {}:{} is not in {} (connect once with ssh, or pass --ssh-accept-new)",
            t.host,
            t.port,
            o.known_hosts.display()
        )),
        CheckResult::Failure => Err(format!("checking the host key of {} failed", t.host)),
    }
}

fn authenticate(s: &Session, t: &Target, o: &SshOptions) -> Result<(), String> {
    let mut tried = Vec::new();
    if let Some(k) = &o.key {
        if let Err(e) = s.userauth_pubkey_file(&t.user, None, k, None) {
            return Err(format!(
                "{}@{} refused the key {}: {e}",
                t.user,
                t.host,
                k.display()
            ));
        }
        return Ok(());
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
    Err(format!(
        "{}@{}: no key was accepted (tried: {}); pass --ssh-key",
        t.user,
        t.host,
        if tried.is_empty() {
            "nothing found".into()
        } else {
            tried.join(", ")
        }
    ))
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
) -> Result<RemoteProc, String> {
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
        .map_err(|e| format!("{}: opening a channel: {e}", target.host))?;
    ch.handle_extended_data(ssh2::ExtendedData::Merge)
        .map_err(|e| e.to_string())?;
    ch.exec(&cmd)
        .map_err(|e| format!("{}: starting the worker: {e}", target.host))?;
    ch.write_all(format!("{}\n", job.token_hex).as_bytes())
        .map_err(|e| e.to_string())?;
    ch.send_eof().map_err(|e| e.to_string())?;
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
        .map_err(|e| e.to_string())?;
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
pub fn kill(p: &RemoteProc, o: &SshOptions) -> Result<(), String> {
    let Some(pid) = *p.pid.lock().unwrap_or_else(|e| e.into_inner()) else {
        return Ok(()); // it never started
    };
    let s = connect(&p.target, o)?;
    let mut ch = s.channel_session().map_err(|e| e.to_string())?;
    ch.exec(&format!(
        "kill -9 -- -{pid} 2>/dev/null; kill -9 {pid} 2>/dev/null; true"
    ))
    .map_err(|e| e.to_string())?;
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
            connect(&t, &o).map_err(|e| (t.host.clone(), e))
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
