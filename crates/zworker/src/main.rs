//! `zworker`: started by `zrun` (or `srun`) with the job in its environment.

use std::io::Write;
use std::process::ExitCode;

/// Keeps freed blocks of 32 MiB and more for the next step:
/// [`zworker::large_blocks`].
#[global_allocator]
static ALLOCATOR: zworker::large_blocks::KeepLargeBlocks =
    zworker::large_blocks::KeepLargeBlocks::new();

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // A training worker's cores and threads, before any thread starts.
    let pinned = match args.is_empty() {
        true => zworker::cores::settle(),
        false => Ok(None),
    };
    keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ZRUN_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match pinned {
        Ok(Some(line)) => println!("{line}"),
        Ok(None) => {}
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "zworker: {e:#}");
            return ExitCode::from(1);
        }
    }
    let result = match args.first().map(String::as_str) {
        Some("sample") => zworker::sample::run(&args[1..]),
        Some("eval") => zworker::eval::run(&args[1..]),
        // zrun asks before launching a job that needs one.
        Some("--features") => {
            println!("{}", zworker::features().join(" "));
            Ok(())
        }
        // zrun asks before launching a `device: cuda` job.
        Some("--cuda-probe") => {
            println!("{}", zworker::gpu::host_report());
            Ok(())
        }
        Some("--cuda-devices") => {
            match zworker::gpu::training_devices(args.get(1).map(String::as_str) == Some("nccl")) {
                // The count, and the smallest GPU's memory in bytes where
                // the driver says.
                Ok(n) => {
                    match zworker::gpu::smallest_gpu_memory() {
                        Some(bytes) => println!("{n} {bytes}"),
                        None => println!("{n}"),
                    }
                    Ok(())
                }
                Err(why) => {
                    println!("{why}");
                    return ExitCode::from(1);
                }
            }
        }
        _ => zworker::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "zworker: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Keeps the memory a training step frees inside the process for the next
/// step, as PyTorch's caching allocator does. By default glibc hands blocks of
/// 128 KiB and more back to the kernel (`munmap`, heap trimming), so every
/// step's fresh activations fault their pages in again and the kernel zeroes
/// them. With blocks up to 32 MiB (glibc's largest `M_MMAP_THRESHOLD`) taken
/// from the heap and the heap never trimmed, gpt-anchor's 14 steps took 5.7x
/// fewer page faults (1 worker: 1.11M → 0.19M; 2 workers: 2.26M → 0.35M) and
/// less than half the system time (2.3-2.9 s → 1.0-1.1 s, about 2.5% of the
/// run's CPU time); peak RSS did not change (a step reaches it anyway). Larger
/// blocks are the allocator's ([`zworker::large_blocks`]), which keeps them.
///
/// Training runs on a rayon thread, and glibc gives threads other than the
/// first arenas of their own, whose 64 MiB heaps are unmapped whole as they
/// empty, whatever the trim threshold: a worker with one compute thread
/// (`RAYON_NUM_THREADS=1`, as zrun sets it for two workers on two cores)
/// still faulted in about 10k pages a step. There every thread shares the
/// first arena (`M_ARENA_MAX=1`): under 100 faults a step, and 2 workers f32
/// +2-3% (stage 0 and 3, beside the build before, three rounds). Where two
/// compute threads allocate, one arena made them wait on each other (1
/// worker × 2 threads bf16 1-4% slower in six rounds), so they keep theirs.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let one_thread = std::env::var("RAYON_NUM_THREADS").is_ok_and(|t| t.trim() == "1");
        // SAFETY: mallopt only sets glibc's allocator parameters; it is
        // called first thing in main, before any other thread exists.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
            if one_thread {
                libc::mallopt(libc::M_ARENA_MAX, 1);
            }
        }
    }
}
