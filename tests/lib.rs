//! Helpers for the end-to-end tests: find the built binaries, run zrun as a user
//! would (in a temporary directory), look at its processes through /proc, and
//! make sure nothing a test started outlives it.

#![deny(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A binary built next to this test executable (`target/<profile>/NAME`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/..");
    let p = dir.join(name);
    assert!(
        p.is_file(),
        "{} is missing: build the binaries first (cargo build --release)",
        p.display()
    );
    p
}

/// The repository root (configs/, crates/).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the repo")
        .to_path_buf()
}

/// A running `zrun`, killed (with its workers) if the test ends early.
pub struct Zrun {
    child: Option<Child>,
    out: PathBuf,
    err: PathBuf,
    _dir: Option<tempfile::TempDir>,
}

/// A finished `zrun`.
#[derive(Debug)]
pub struct Finished {
    /// Exit status.
    pub status: ExitStatus,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

impl Finished {
    /// Exit code (panics if killed by a signal).
    pub fn code(&self) -> i32 {
        self.status
            .code()
            .unwrap_or_else(|| panic!("zrun was killed: {self:?}"))
    }
}

impl Zrun {
    /// Starts `zrun ARGS` in `cwd`, output captured to files in a fresh temp dir.
    pub fn start(cwd: &Path, args: &[&str]) -> Zrun {
        Zrun::start_with_env(cwd, args, &[])
    }

    /// [`Zrun::start`] with extra environment variables.
    pub fn start_with_env(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Zrun {
        let logs = tempfile::tempdir().expect("temp dir");
        let out = logs.path().join("stdout");
        let err = logs.path().join("stderr");
        let child = Command::new(bin("zrun"))
            .args(args)
            .envs(env.iter().copied())
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("stdout file"))
            .stderr(std::fs::File::create(&err).expect("stderr file"))
            .spawn()
            .expect("start zrun");
        Zrun {
            child: Some(child),
            out,
            err,
            _dir: Some(logs),
        }
    }

    /// zrun's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends a signal to zrun.
    pub fn signal(&self, s: Signal) {
        kill(Pid::from_raw(self.pid() as i32), s).expect("signal zrun");
    }

    /// Output so far.
    pub fn stdout_so_far(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Waits for zrun to exit, at most `limit`.
    pub fn wait(mut self, limit: Duration) -> Finished {
        let mut child = self.child.take().expect("running");
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                // Lossy: a sampler's bytes need not be UTF-8, and an
                // output that is not must not read as empty.
                let text = |p: &Path| {
                    String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned()
                };
                return Finished {
                    status,
                    stdout: text(&self.out),
                    stderr: text(&self.err),
                };
            }
            if Instant::now() > deadline {
                self.child = Some(child);
                panic!(
                    "zrun did not exit within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                    self.stdout_so_far(),
                    std::fs::read_to_string(&self.err).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Zrun {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGINT lets zrun stop its workers; SIGKILL if it does not.
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGINT);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `zrun ARGS` to completion in `cwd`.
pub fn zrun(cwd: &Path, args: &[&str]) -> Finished {
    Zrun::start(cwd, args).wait(Duration::from_secs(300))
}

/// A copy of the f32 safetensors file `from` at `to`, each value of tensor
/// `name` of shape `shape` multiplied by `factor(name, shape, i)` (`i`: the
/// value's index, row-major): weights rescaled for a test (sharper
/// attention).
pub fn rescaled_safetensors(from: &Path, to: &Path, factor: impl Fn(&str, &[usize], usize) -> f32) {
    let bytes = std::fs::read(from).expect("read the weights");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let data = view
                .data()
                .chunks_exact(4)
                .enumerate()
                .flat_map(|(i, b)| {
                    let x = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                    (factor(&name, view.shape(), i) * x).to_le_bytes()
                })
                .collect();
            (name, view.shape().to_vec(), data)
        })
        .collect();
    let views = tensors.iter().map(|(name, shape, data)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data);
        (name.clone(), view.expect("a tensor's bytes fit its shape"))
    });
    let out = safetensors::serialize(views, None).expect("serialize");
    std::fs::write(to, out).expect("write the rescaled weights");
}

/// `zrun export CKPT --out OUT --format hf` in `cwd`, which must succeed:
/// a Hugging Face directory of the checkpoint.
pub fn export_hf(cwd: &Path, ckpt: &Path, out: &Path) {
    let f = zrun(
        cwd,
        &[
            "export",
            &ckpt.display().to_string(),
            "--out",
            &out.display().to_string(),
            "--format",
            "hf",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
}

/// `zrun ARGS | head -c BYTES` in `cwd`: the first `bytes` of stdout, then
/// the pipe closed. Returns what was read, zrun's exit code (it must end
/// within 30 s of the close; killed and a panic otherwise), its stderr, and
/// the processes it had started that were still there as it was reading.
pub fn zrun_into_head(cwd: &Path, args: &[&str], bytes: usize) -> (String, i32, String, Vec<u32>) {
    use std::io::Read;
    let err = tempfile::NamedTempFile::new().expect("stderr file");
    let mut child = Command::new(bin("zrun"))
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(err.reopen().expect("stderr file"))
        .spawn()
        .expect("start zrun");
    let mut head = vec![0; bytes];
    let read = child.stdout.take().expect("piped").read_exact(&mut head);
    let children = children_of(child.id());
    // The read end is closed now (the ChildStdout dropped).
    let mut status = None;
    let ended = wait_until(Duration::from_secs(30), || {
        status = child.try_wait().expect("wait for zrun");
        status.is_some()
    });
    if !ended {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stderr = std::fs::read_to_string(err.path()).unwrap_or_default();
    read.unwrap_or_else(|e| panic!("reading zrun's stdout: {e}; stderr: {stderr}"));
    assert!(
        ended,
        "zrun went on for 30 s after its stdout closed: {stderr}"
    );
    let code = status.and_then(|s| s.code()).unwrap_or(-1);
    (
        String::from_utf8_lossy(&head).into_owned(),
        code,
        stderr,
        children,
    )
}

/// The argument list of `zrun train JOB --metrics FILE --no-progress`, to
/// which tests add what they vary.
#[derive(Debug, Clone)]
pub struct TrainArgs {
    args: Vec<String>,
}

impl TrainArgs {
    /// `train JOB --metrics METRICS --no-progress`.
    pub fn new(job: impl AsRef<Path>, metrics: impl AsRef<Path>) -> TrainArgs {
        let path = |p: &Path| p.display().to_string();
        TrainArgs {
            args: vec![
                "train".into(),
                path(job.as_ref()),
                "--metrics".into(),
                path(metrics.as_ref()),
                "--no-progress".into(),
            ],
        }
    }

    /// Adds `--set KEY=VALUE`.
    pub fn set(mut self, assignment: impl Into<String>) -> TrainArgs {
        self.args.push("--set".into());
        self.args.push(assignment.into());
        self
    }

    /// Adds arguments as they are.
    pub fn args<S: AsRef<str>>(mut self, more: &[S]) -> TrainArgs {
        self.args
            .extend(more.iter().map(|a| a.as_ref().to_string()));
        self
    }

    /// The arguments, as `zrun` and `Zrun::start` take them.
    pub fn as_strs(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }

    /// Runs zrun in `cwd` to the end (at most 300 s).
    pub fn run(&self, cwd: &Path) -> Finished {
        zrun(cwd, &self.as_strs())
    }

    /// Starts zrun in `cwd`.
    pub fn start(&self, cwd: &Path) -> Zrun {
        Zrun::start(cwd, &self.as_strs())
    }
}

/// Pids whose parent is `parent`.
pub fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the parenthesised command: state ppid ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(parent) {
            out.push(pid);
        }
    }
    out
}

/// Whether `pid` is a live (non-zombie) process.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            .is_some_and(|s| s != "Z"),
        Err(_) => false,
    }
}

/// A TCP port that was free a moment ago (for `--master-port`).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local address").port()
}

/// A free port below the kernel's ephemeral range, for a test that
/// connects to a port before anything listens there: a connect to an
/// unbound loopback port in the ephemeral range can pick that very port as
/// its own source and connect to itself (TCP's simultaneous open), holding
/// the port so that the listener it waits for cannot bind (a CI run saw
/// "Address already in use" so). Source ports are never below the range.
pub fn free_port_below_ephemeral() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let span = low.saturating_sub(10_000).max(1);
    let start = 10_000 + (std::process::id() % u32::from(span)) as u16;
    (0..span)
        .map(|k| 10_000 + (start - 10_000 + k) % span)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port below the ephemeral range")
}

/// Asserts that every process of `pids` is gone within `limit`.
pub fn assert_gone(pids: &[u32], limit: Duration, when: &str) {
    assert!(
        wait_until(limit, || pids.iter().all(|&p| !alive(p))),
        "{when}: still running: {:?}",
        pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
    );
}

/// The complete JSON lines of a metrics file. A last line without its
/// newline is one zrun is still writing (tests poll running jobs), so it is
/// left for the next read; every complete line must parse.
pub fn metrics(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad metrics line `{l}`: {e}")))
        .collect()
}

/// Waits until `f` is true, at most `limit`; returns whether it became true.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

/// `zrun export dir/ckpt --out dir/NAME`, and the exported bytes.
pub fn export_ckpt(dir: &Path, name: &str) -> Vec<u8> {
    let out = dir.join(name);
    let f = zrun(
        dir,
        &[
            "export",
            dir.join("ckpt").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    std::fs::read(out).expect("the export")
}

/// A small job on synthetic data, written into `dir`; returns its path.
pub fn small_job(dir: &Path, name: &str, steps: u64) -> PathBuf {
    let p = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &p,
        format!(
            "name: {name}\n\
             model: {{vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, seq_len: 32}}\n\
             data: {{format: synthetic}}\n\
             train:\n  steps: {steps}\n  micro_batch_size: 4\n  lr: 3.0e-3\n  warmup_steps: 2\n\
             run_dir: {}/runs/{name}\n",
            dir.display()
        ),
    )
    .expect("write job");
    p
}

/// `zrun train` arguments for one step from the weights at `init`
/// (`model.init_from`), with no checkpoints: a job's first loss from them.
pub fn one_step_from(init: &Path) -> Vec<String> {
    [
        "train.steps=1".to_string(),
        format!("model.init_from={}", init.display()),
        "checkpoint.dir=null".into(),
        "checkpoint.every=0".into(),
    ]
    .into_iter()
    .flat_map(|set| ["--set".to_string(), set])
    .collect()
}

/// A small job with checkpoints under `dir/ckpt`, written into `dir`.
pub fn ckpt_job(dir: &Path, name: &str, steps: u64, every: u64) -> PathBuf {
    let p = small_job(dir, name, steps);
    let mut text = std::fs::read_to_string(&p).expect("job");
    text.push_str(&format!(
        "checkpoint: {{dir: {}/ckpt, every: {every}, keep: 2}}\n",
        dir.display()
    ));
    std::fs::write(&p, text).expect("write job");
    p
}

/// The `loss` of every step line, in order.
pub fn losses(lines: &[serde_json::Value]) -> Vec<f64> {
    lines
        .iter()
        .filter_map(|l| l.get("loss").and_then(|x| x.as_f64()))
        .collect()
}

/// Each metrics line's step and `key`'s value, the value read from the
/// line's own text with Rust's parser, which rounds correctly (serde_json's
/// default reader can miss the last bit of a 17-digit number): for values
/// compared to the bit with text written elsewhere, such as the CSV files.
/// Lines without the key (or with null) are left out.
pub fn exact_by_step(path: &Path, key: &str) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let field = format!("\"{key}\":");
    text.lines()
        .filter_map(|l| {
            let line: serde_json::Value = serde_json::from_str(l).ok()?;
            let step = line.get("step")?.as_u64()?;
            let at = l.find(&field)? + field.len();
            let raw: String = l[at..]
                .chars()
                .take_while(|c| !matches!(c, ',' | '}'))
                .collect();
            Some((step, raw.trim().parse().ok()?))
        })
        .collect()
}

/// A CSV monitor file's (step, value) lines, after its header.
pub fn csv_by_step(path: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .skip(1)
        .map(|l| {
            let (step, value) = l.split_once(',').unwrap_or_else(|| panic!("`{l}`"));
            (step.parse().unwrap(), value.parse().unwrap())
        })
        .collect()
}

/// Losses by step from a metrics file.
pub fn losses_by_step(path: &Path) -> Vec<(u64, f64)> {
    metrics(path)
        .iter()
        .filter_map(|l| Some((l.get("step")?.as_u64()?, l.get("loss")?.as_f64()?)))
        .collect()
}

/// A throwaway sshd on 127.0.0.2 and 127.0.0.3 (scripts/sshd.sh), stopped on drop.
pub struct Sshd {
    /// Its directory: keys, known_hosts, config, log.
    pub dir: tempfile::TempDir,
    /// Its port.
    pub port: u16,
}

/// Set by `.ci/run`: an SSH test that cannot start its sshd fails instead of
/// skipping.
pub const REQUIRE_SSHD: &str = "ZRUN_REQUIRE_SSHD";

/// Why this machine cannot start a test sshd, if it cannot.
fn sshd_missing() -> Option<String> {
    let on_path = |name: &str| {
        std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
    };
    if !on_path("sshd") && !Path::new("/usr/sbin/sshd").is_file() {
        return Some(
            "/usr/sbin/sshd not found; install openssh-server to run the SSH tests".into(),
        );
    }
    if !on_path("ssh-keygen") {
        return Some("ssh-keygen not found; install openssh-client to run the SSH tests".into());
    }
    if !nix::unistd::geteuid().is_root() {
        return Some("starting a test sshd needs root (it creates /run/sshd)".into());
    }
    None
}

/// A test sshd, or `return` from the calling test after printing why none
/// can run here (a failure instead when `ZRUN_REQUIRE_SSHD` is set).
#[macro_export]
macro_rules! sshd_or_skip {
    () => {
        match $crate::Sshd::start_or_skip(std::thread::current().name().unwrap_or("an SSH test")) {
            Some(sshd) => sshd,
            None => return,
        }
    };
}

impl Sshd {
    /// Starts one, or returns `None` after printing why this machine cannot
    /// (unless `ZRUN_REQUIRE_SSHD` is set, as CI sets it: then it panics).
    /// Panics with the script's message if starting fails.
    pub fn start_or_skip(test: &str) -> Option<Sshd> {
        if let Some(why) = sshd_missing() {
            assert!(
                std::env::var_os(REQUIRE_SSHD).is_none(),
                "{test}: {why} ({REQUIRE_SSHD} is set, so this is a failure)"
            );
            eprintln!("{test}: skipped: {why}");
            return None;
        }
        Some(Sshd::start())
    }

    /// Starts one; panics with the script's message if it cannot.
    fn start() -> Sshd {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = Command::new("bash")
            .arg(repo_root().join("scripts/sshd.sh"))
            .arg("start")
            .arg(dir.path())
            .output()
            .expect("run scripts/sshd.sh");
        assert!(
            out.status.success(),
            "sshd did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("a port");
        Sshd { dir, port }
    }

    /// The sshd's pid.
    pub fn pid(&self) -> u32 {
        std::fs::read_to_string(self.dir.path().join("sshd.pid"))
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid")
    }

    /// A hostfile with one slot on each loopback host.
    pub fn hostfile(&self) -> PathBuf {
        let p = self.dir.path().join("hosts");
        std::fs::write(
            &p,
            format!(
                "127.0.0.2 slots=1 port={p}\n127.0.0.3 slots=1 port={p}\n",
                p = self.port
            ),
        )
        .expect("hostfile");
        p
    }

    /// Whether no zworker is left under this sshd within `limit`.
    pub fn workers_gone(&self, limit: Duration) -> bool {
        wait_until(limit, || {
            descendants_named(self.pid(), "zworker").is_empty()
        })
    }

    /// zrun's flags for a job on its two hosts over SSH, with its keys.
    pub fn launch_args(&self) -> Vec<String> {
        vec![
            "--hostfile".into(),
            self.hostfile().display().to_string(),
            "--launcher".into(),
            "ssh".into(),
            "--ssh-key".into(),
            self.file("client_key"),
            "--known-hosts".into(),
            self.file("known_hosts"),
        ]
    }

    /// Path of a file in its directory.
    pub fn file(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(repo_root().join("scripts/sshd.sh"))
            .arg("stop")
            .arg(self.dir.path())
            .status();
    }
}

/// Pids of processes named `name` anywhere below `root` in the process tree.
pub fn descendants_named(root: u32, name: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for c in children_of(p) {
            let comm = std::fs::read_to_string(format!("/proc/{c}/comm")).unwrap_or_default();
            if comm.trim() == name && alive(c) {
                out.push(c);
            }
            frontier.push(c);
        }
    }
    out
}

/// Starts a long job and waits until it has written `steps` metrics lines.
pub fn start_long_job(dir: &Path, name: &str, extra: &[&str]) -> (Zrun, std::path::PathBuf) {
    let job = small_job(dir, name, 100_000);
    let m = dir.join(format!("{name}.jsonl"));
    let z = TrainArgs::new(&job, &m).args(extra).start(dir);
    assert!(
        wait_until(Duration::from_secs(60), || metrics(&m).len() >= 2),
        "the job did not start training: {}",
        z.stdout_so_far()
    );
    (z, m)
}

/// The records of each event file in `dir` (oldest first), each record's
/// framing checked: its length, the masked CRC-32C of the length, the data
/// and the masked CRC-32C of the data (TFRecord's format).
pub fn tfrecords(dir: &Path) -> Vec<usize> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let masked = |d: &[u8]| {
        let c = crc32c::crc32c(d);
        c.rotate_right(15).wrapping_add(0xa282_ead8)
    };
    files
        .iter()
        .map(|f| {
            let bytes = std::fs::read(f).unwrap();
            let (mut at, mut records) = (0, 0);
            while at < bytes.len() {
                let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
                let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap());
                assert_eq!(
                    u32_at(at + 8),
                    masked(&bytes[at..at + 8]),
                    "{f:?} {records}"
                );
                let data = &bytes[at + 12..at + 12 + len];
                assert_eq!(u32_at(at + 12 + len), masked(data), "{f:?} {records}");
                (at, records) = (at + 16 + len, records + 1);
            }
            records
        })
        .collect()
}

/// A Python package used as a test's reference: `ZRUN_<NAME>_PYTHON` (else
/// `python3`) runs `script` with `args` and `stdin`, and its stdout is the
/// answer; None (said) where the script printed `NO_<NAME>` (the package is
/// missing) and `ZRUN_REQUIRE_<NAME>` is not 1 (CI sets it).
pub fn python_reference(name: &str, script: &str, args: &[&str], stdin: &str) -> Option<String> {
    use std::io::Write;
    let var = |what: &str| std::env::var(format!("ZRUN_{what}_{name}"));
    let python = std::env::var(format!("ZRUN_{name}_PYTHON")).unwrap_or_else(|_| "python3".into());
    let mut child = std::process::Command::new(&python)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{python}: {out:?}");
    let out = String::from_utf8(out.stdout).unwrap();
    if out.starts_with(&format!("NO_{name}")) {
        assert!(
            var("REQUIRE").as_deref() != Ok("1"),
            "ZRUN_REQUIRE_{name}=1, but {python} lacks it: {out}"
        );
        eprintln!("SKIPPED the comparison with the Python reference: {out}");
        return None;
    }
    Some(out)
}

/// Every scalar tag's (step, value) pairs as TensorBoard's own reader sees
/// the event files in `dir`, or None (said) where its Python has no
/// `tensorboard` package and `ZRUN_REQUIRE_TENSORBOARD` is not 1.
pub fn tensorboard_scalars(
    dir: &Path,
) -> Option<std::collections::HashMap<String, Vec<(u64, f64)>>> {
    let reader = r#"
import json, sys
try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:
    print("NO_TENSORBOARD", e)
    sys.exit(0)
acc = EventAccumulator(sys.argv[1])
acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;
    let out = python_reference("TENSORBOARD", reader, &[dir.to_str().unwrap()], "")?;
    Some(serde_json::from_str(&out).unwrap())
}

/// A chat template that lays out tools and tool calls as Qwen2.5's does
/// (the tools' schemas in the system turn, each written by `tojson`; an
/// assistant's calls as `<tool_call>` blocks; a tool's answer in a user
/// turn), reasoning as Qwen3's does (`reasoning_content`, which
/// transformers also fills from `reasoning` or `thinking`), and Qwen3's
/// `enable_thinking` switch on the generation prompt.
pub const TOOLS_TEMPLATE: &str = r#"{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You may call tools.' }}{%- endif %}
{{- "\n\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content %}{{- '<think>' + message.reasoning_content + '</think>' }}{%- endif %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"#;

/// A tool's JSON schema, its keys in no sorted order (`tojson` keeps the
/// order they are written in).
pub const WEATHER_TOOL: &str = r#"{"type": "function", "function": {"name": "weather", "description": "Today's weather, ü", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}}}}"#;
