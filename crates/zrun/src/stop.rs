//! Stop signals (SIGINT, SIGTERM, SIGHUP) noted for the whole process.
//!
//! A supervised job hears them through tokio, whose handlers stay
//! installed when the job's runtime is gone; a signal that came between two
//! jobs of one zrun (a restart's search for its checkpoint, a sweep between
//! two configurations, a job still being started) had no listener and was
//! lost, and the next job started anyway. From the first job on, every stop
//! signal is also noted here, and whatever starts a job or a child asks
//! [`stop_signal`] first.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// The last stop signal received (0: none), once [`note_stop_signals`] ran.
static LAST: OnceLock<Arc<AtomicUsize>> = OnceLock::new();

/// From now on, notes every SIGINT, SIGTERM and SIGHUP.
pub(crate) fn note_stop_signals() {
    LAST.get_or_init(|| {
        let last = Arc::new(AtomicUsize::new(0));
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // Registration fails only for signals that cannot be caught.
            let _ = signal_hook::flag::register_usize(signal, last.clone(), signal as usize);
        }
        last
    });
}

/// The stop signal noted last, if any, by name.
pub(crate) fn stop_signal() -> Option<&'static str> {
    match LAST.get()?.load(Ordering::SeqCst) as i32 {
        libc::SIGINT => Some("SIGINT"),
        libc::SIGTERM => Some("SIGTERM"),
        libc::SIGHUP => Some("SIGHUP"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Noted once asked for, and not before: a signal raised with no job
    /// running is there for the next one to see.
    #[test]
    fn a_stop_signal_is_noted_with_no_job_listening() {
        assert_eq!(stop_signal(), None);
        note_stop_signals();
        assert_eq!(stop_signal(), None);
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGHUP).unwrap();
        assert_eq!(stop_signal(), Some("SIGHUP"));
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM).unwrap();
        assert_eq!(stop_signal(), Some("SIGTERM"));
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGINT).unwrap();
        assert_eq!(stop_signal(), Some("SIGINT"));
    }
}
