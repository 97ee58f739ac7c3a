//! What the launchers, the SSH module and the supervisor share: the
//! environment every worker of a job gets, the events a worker process
//! produces, and how remote hosts are reached and trusted. A leaf: it uses no
//! other module of zrun, so the arrows between the others go one way
//! (`supervise → launch → ssh → worker`, `plan → worker`).

use std::path::PathBuf;
use std::process::ExitStatus;

/// The environment every worker of a job shares.
pub struct JobEnv {
    /// zrun's control address as workers see it.
    pub master_addr: String,
    /// zrun's control port.
    pub master_port: u16,
    /// Job id.
    pub job_id: String,
    /// Hex token.
    pub token_hex: String,
}

/// Something a worker process did.
#[derive(Debug)]
pub enum ProcEvent {
    /// A line of output.
    Output {
        /// Rank.
        rank: usize,
        /// The line, without its newline.
        line: String,
        /// From stderr (else stdout).
        stderr: bool,
    },
    /// The process ended.
    Exited {
        /// Rank.
        rank: usize,
        /// How.
        status: ExitStatus,
    },
}

/// How to reach and trust hosts.
#[derive(Debug, Clone)]
pub struct SshOptions {
    /// Private key (`--ssh-key`).
    pub key: Option<PathBuf>,
    /// known_hosts file.
    pub known_hosts: PathBuf,
    /// Add unknown host keys instead of refusing them.
    pub accept_new: bool,
    /// The port of hosts whose hostfile line names none (`--ssh-port`).
    pub port: u16,
}
