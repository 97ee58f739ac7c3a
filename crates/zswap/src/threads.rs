//! The thread path: `thread_count` threads taking block-sized pieces from one
//! queue and doing `pread` / `pwrite`, for machines where io_uring is refused.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::error::SwapError;
use crate::swapper::Piece;

#[derive(Default)]
struct Queue {
    pieces: VecDeque<Piece>,
    closing: bool,
}

/// The pool; dropping it finishes the queued pieces and joins the threads.
pub(crate) struct Pool {
    shared: Arc<(Mutex<Queue>, Condvar)>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    pub(crate) fn new(count: usize) -> Result<Pool, SwapError> {
        let shared: Arc<(Mutex<Queue>, Condvar)> = Arc::default();
        let mut threads = Vec::with_capacity(count);
        for i in 0..count {
            let shared = shared.clone();
            let t = std::thread::Builder::new()
                .name(format!("zswap-io-{i}"))
                .spawn(move || run(&shared))
                .map_err(|e| SwapError::Config(format!("cannot start an I/O thread: {e}")))?;
            threads.push(t);
        }
        Ok(Pool { shared, threads })
    }

    pub(crate) fn submit(&self, pieces: Vec<Piece>) {
        let (queue, ready) = &*self.shared;
        queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pieces
            .extend(pieces);
        ready.notify_all();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let (queue, ready) = &*self.shared;
        queue.lock().unwrap_or_else(|p| p.into_inner()).closing = true;
        ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn run(shared: &(Mutex<Queue>, Condvar)) {
    let (queue, ready) = shared;
    loop {
        let piece = {
            let mut q = queue.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(p) = q.pieces.pop_front() {
                    break p;
                }
                if q.closing {
                    return;
                }
                q = ready.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        if let Err(e) = transfer(&piece) {
            piece.req.fail(e);
        }
        piece.req.piece_done();
    }
}

/// Moves the whole piece, retrying short transfers and interruptions.
fn transfer(p: &Piece) -> std::io::Result<()> {
    let fd = p.req.file.file.as_raw_fd();
    let mut done = 0;
    while done < p.len {
        let (addr, len, off) = (p.addr + done, p.len - done, p.offset + done as u64);
        // SAFETY: [addr, addr + len) lies inside the request's buffer, which the
        // request owns and keeps alive and unmoved until every piece is done;
        // pieces of one request never overlap, so no two threads touch the same
        // bytes.
        let n = unsafe {
            if p.req.write {
                libc::pwrite(fd, addr as *const libc::c_void, len, off as libc::off_t)
            } else {
                libc::pread(fd, addr as *mut libc::c_void, len, off as libc::off_t)
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("end of file at byte {off}"),
            ));
        }
        done += n as usize;
    }
    Ok(())
}
