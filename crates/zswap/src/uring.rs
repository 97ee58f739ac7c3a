//! The io_uring path: one thread owns a ring and keeps up to `queue_depth`
//! block-sized reads and writes in flight, refilling the ring as completions
//! arrive. Short transfers are resubmitted for the rest; interrupted ones again.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;

use io_uring::{opcode, types, IoUring};

use crate::error::SwapError;
use crate::swapper::Piece;

/// The ring's thread; dropping it finishes what was submitted and joins it.
pub(crate) struct Ring {
    tx: Option<Sender<Vec<Piece>>>,
    thread: Option<JoinHandle<()>>,
}

impl Ring {
    pub(crate) fn new(depth: usize) -> Result<Ring, SwapError> {
        let entries = depth.next_power_of_two().min(4096) as u32;
        let ring = IoUring::new(entries)
            .map_err(|e| SwapError::Config(format!("io_uring setup refused: {e}")))?;
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("zswap-uring".into())
            .spawn(move || run(ring, depth, &rx))
            .map_err(|e| SwapError::Config(format!("cannot start the io_uring thread: {e}")))?;
        Ok(Ring {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    pub(crate) fn submit(&self, pieces: Vec<Piece>) {
        if let Some(tx) = &self.tx {
            // A dead ring thread drops the pieces; their handles then report Closed.
            let _ = tx.send(pieces);
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut ring: IoUring, depth: usize, rx: &Receiver<Vec<Piece>>) {
    let mut queue: VecDeque<Piece> = VecDeque::new();
    let mut slots: Vec<Option<Piece>> = (0..depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    loop {
        let in_flight = depth - free.len();
        if in_flight == 0 && queue.is_empty() {
            match rx.recv() {
                Ok(p) => queue.extend(p),
                Err(_) => return,
            }
        }
        while let Ok(p) = rx.try_recv() {
            queue.extend(p);
        }
        {
            let mut sq = ring.submission();
            while let (Some(&slot), Some(p)) = (free.last(), queue.front()) {
                let fd = types::Fd(p.req.file.file.as_raw_fd());
                let entry = if p.req.write {
                    opcode::Write::new(fd, p.addr as *const u8, p.len as u32)
                        .offset(p.offset)
                        .build()
                } else {
                    opcode::Read::new(fd, p.addr as *mut u8, p.len as u32)
                        .offset(p.offset)
                        .build()
                }
                .user_data(slot as u64);
                // SAFETY: the entry points into the piece's request buffer, which
                // the request keeps alive and unmoved until the piece completes;
                // the piece stays in `slots` until its completion is reaped.
                if unsafe { sq.push(&entry) }.is_err() {
                    break;
                }
                free.pop();
                slots[slot] = queue.pop_front();
            }
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::debug!("io_uring submit: {e}");
            }
        }
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (slot, res) in done {
            let slot = slot as usize;
            free.push(slot);
            let Some(mut p) = slots[slot].take() else {
                continue;
            };
            if res < 0 {
                if -res == libc::EINTR || -res == libc::EAGAIN {
                    queue.push_front(p);
                    continue;
                }
                p.req.fail(std::io::Error::from_raw_os_error(-res));
                p.req.piece_done();
            } else if res == 0 {
                p.req.fail(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("end of file at byte {}", p.offset),
                ));
                p.req.piece_done();
            } else if (res as usize) < p.len {
                let n = res as usize;
                (p.offset, p.addr, p.len) = (p.offset + n as u64, p.addr + n, p.len - n);
                queue.push_front(p);
            } else {
                p.req.piece_done();
            }
        }
    }
}
