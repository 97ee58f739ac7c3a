//! The processes zrun runs under it end with it. `zrun bench JOB --sweep`
//! and `zrun plan` run each configuration as a `zrun train` child, and
//! `zrun sample` runs `zworker sample`.
//!
//! Two things went wrong before this module. A SIGTERM or SIGKILL to the
//! outer zrun left its child (and a child job's workers) running to its
//! end, orphaned. And a sweep or plan ignored SIGTERM and SIGHUP outright
//! once it had measured this host's GEMM peak: that measurement is a job
//! supervised in this process, tokio's signal handlers stay installed after
//! it, and nothing listened to them any more, so `kill` on a sweep did
//! nothing at all. Now the kernel sends a child SIGTERM when zrun ends
//! ([`ends_with_this_zrun`]), and [`output_of`] stops the child on
//! SIGINT, SIGTERM or SIGHUP and returns exit 130.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::Result;
use tokio::signal::unix::{signal, SignalKind};

use crate::{exit, Failure};

/// How long a stopped child may take to stop its own job before it is
/// killed (a `zrun train` stops its workers within its abort grace).
const STOP_GRACE: Duration = Duration::from_secs(30);

/// `command`, set to be sent SIGTERM by the kernel when this zrun ends,
/// however it ends. A child `zrun train` tears its job down on it as on any
/// SIGTERM.
///
/// The kernel signals when the *thread* that started the child ends, so a
/// child is started on the thread that waits for it (every caller's main
/// thread; [`output_of`] starts it on a current-thread runtime there).
pub(crate) fn ends_with_this_zrun(command: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    let zrun = nix::unistd::getpid().as_raw();
    // SAFETY: the closure runs in the child between fork and exec and calls
    // only prctl and getppid, which are async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // zrun ended before the request took hold: do not start.
            if libc::getppid() != zrun {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        })
    }
}

/// Runs `command` to its end ([`ends_with_this_zrun`]) and collects its
/// output, as [`Command::output`] does; but if SIGINT, SIGTERM or SIGHUP
/// reaches zrun meanwhile, the child is sent SIGTERM (killed if it takes
/// longer than [`STOP_GRACE`]) and the result is exit 130, saying that
/// `what` was stopped.
pub(crate) fn output_of(command: Command, what: &str) -> Result<Output> {
    run_to_end(command, what, true)
}

/// [`output_of`], with the child's stderr shown as it comes (a long
/// child's progress) instead of collected.
pub(crate) fn stdout_of(command: Command, what: &str) -> Result<Output> {
    run_to_end(command, what, false)
}

/// Runs `command` as [`output_of`] describes, collecting its stderr too
/// where `collect_stderr`.
fn run_to_end(mut command: Command, what: &str, collect_stderr: bool) -> Result<Output> {
    // One that came between this child and the one before.
    if let Some(sig) = crate::stop::stop_signal() {
        return Err(Failure {
            code: exit::INTERRUPTED,
            message: format!("{sig} before {what}: not started"),
        }
        .into());
    }
    ends_with_this_zrun(&mut command)
        .stdout(std::process::Stdio::piped())
        .stderr(match collect_stderr {
            true => std::process::Stdio::piped(),
            false => std::process::Stdio::inherit(),
        });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut sighup = signal(SignalKind::hangup())?;
        let mut child = tokio::process::Command::from(command).spawn()?;
        let pid = child.id();
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let collect = async {
            let (status, stdout, stderr) =
                tokio::try_join!(child.wait(), read(stdout), read(stderr))?;
            std::io::Result::Ok(Output {
                status,
                stdout,
                stderr,
            })
        };
        let stopped_by = tokio::select! {
            out = collect => return Ok(out?),
            _ = sigint.recv() => "interrupted (SIGINT)",
            _ = sigterm.recv() => "terminated (SIGTERM)",
            _ = sighup.recv() => "hung up (SIGHUP)",
        };
        if let Some(pid) = pid {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
        if tokio::time::timeout(STOP_GRACE, child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
        Err(Failure {
            code: exit::INTERRUPTED,
            message: format!("{stopped_by}: {what} stopped"),
        }
        .into())
    })
}

/// All of a child's `pipe`, if it has one.
async fn read<R: tokio::io::AsyncRead + Unpin>(pipe: Option<R>) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    if let Some(mut pipe) = pipe {
        tokio::io::AsyncReadExt::read_to_end(&mut pipe, &mut buf).await?;
    }
    Ok(buf)
}
