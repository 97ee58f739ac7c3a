//! Reduce-scatter, all-reduce, all-gather and barrier straight through a node's
//! shared segment, used when every rank of the group is on this node.
//!
//! The rings of `shm.rs` carry the TCP transport's messages, so a ring step costs
//! three copies (into a message, into the ring, out of it) and a thread hand-off.
//! Here each rank copies its contribution into its own slot once and the others
//! read it in place, the way DeepSpeed's CPU shared-memory all-reduce works.
//! Buffers go through in steps of one slot (1 MiB, so a step's traffic stays in
//! cache); slots come in two sets used in alternate steps, so one barrier per
//! step (two for all-reduce) keeps writers from overwriting what a slower rank
//! still reads.
//!
//! A step of reduce-scatter: rank q writes, for every chunk j, the next part of
//! its chunk j into part j of its slot; barrier; rank r sums part r of every slot
//! in rank order (its own contribution read from its buffer). All-reduce then
//! publishes each rank's sum in its slot and, after a second barrier, every rank
//! copies the others' sums. All-gather: each rank writes the next part of its own
//! chunk; barrier; everyone copies. Every rank adds in rank order, so an element's
//! sum has the same bits whichever collective computed it.
//!
//! Before its first barrier a collective publishes (sequence number, op, length)
//! in one of four per-rank flag slots (a rank is never more than one collective
//! ahead, since every collective has a barrier), and after the barrier every rank
//! checks that all agree, the rings' mismatch check in this path.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::shm::{backoff, Segment, SLOT_BYTES};
use crate::{chunk_range, CommError, Op};

/// Floats per slot.
const SLOT: usize = SLOT_BYTES / 4;
/// Elements summed at a time through a stack buffer.
const BLOCK: usize = 2048;

/// Who is asking, for errors and hang diagnosis.
pub(crate) struct Call<'a> {
    pub(crate) op: Op,
    pub(crate) seq: u64,
    pub(crate) group: &'a str,
    pub(crate) started: Instant,
    pub(crate) deadline: Instant,
    /// Told the rank being waited for once a wait is no longer short.
    pub(crate) waiting_for: &'a dyn Fn(usize),
}

/// This rank's end of the direct area.
pub(crate) struct Direct {
    seg: Arc<Segment>,
    me: usize,
    n: usize,
    /// Barriers passed (the same on every rank).
    generation: u64,
    /// Steps taken (the same on every rank): picks the slot set.
    steps: u64,
}

/// `r`'s part at offset `o` of at most `cap` elements (empty past its end).
fn part(r: &Range<usize>, o: usize, cap: usize) -> Range<usize> {
    let s = (r.start + o).min(r.end);
    s..(s + cap).min(r.end)
}

impl Direct {
    /// Rank `me` (local index, equal to its rank in the group) of a segment that
    /// every rank of the group maps.
    pub(crate) fn new(seg: Arc<Segment>, me: usize) -> Direct {
        let n = seg.local();
        Direct {
            seg,
            me,
            n,
            generation: 0,
            steps: 0,
        }
    }

    fn slot(&self, set: usize, rank: usize, at: usize, len: usize) -> &[f32] {
        assert!(at + len <= SLOT);
        // SAFETY: inside the slot; between the barriers that delimit a step no
        // rank writes a slot another rank reads (module doc).
        unsafe { std::slice::from_raw_parts(self.seg.slot(set, rank).add(at), len) }
    }

    fn write_slot(&self, set: usize, at: usize, src: &[f32]) {
        assert!(at + src.len() <= SLOT);
        // SAFETY: inside this rank's own slot, which no other rank reads in this
        // phase of the step.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.seg.slot(set, self.me).add(at),
                src.len(),
            )
        }
    }

    fn next_set(&mut self) -> usize {
        self.steps += 1;
        (self.steps % 2) as usize
    }

    /// Waits until every rank has arrived here.
    fn barrier(&mut self, c: &Call) -> Result<(), CommError> {
        self.generation += 1;
        self.seg
            .flag(self.me, 0)
            .store(self.generation, Ordering::Release);
        for j in (0..self.n).filter(|&j| j != self.me) {
            let flag = self.seg.flag(j, 0);
            let mut round = 0;
            while flag.load(Ordering::Acquire) < self.generation {
                if round == 256 {
                    (c.waiting_for)(j);
                }
                let now = Instant::now();
                if now > c.deadline {
                    return Err(CommError::Timeout {
                        op: c.op.name(),
                        group: c.group.to_string(),
                        peer: Some(j),
                        waited_s: (now - c.started).as_secs_f64(),
                    });
                }
                backoff(&mut round);
            }
        }
        Ok(())
    }

    /// Publishes what this rank is about to run, waits for everyone, and checks
    /// that they all run the same.
    fn begin(&mut self, c: &Call, len: usize) -> Result<(), CommError> {
        let at = 8 + 8 * (c.seq % 4) as usize;
        let mine = [c.seq, c.op.index() as u64, len as u64];
        for (w, v) in mine.iter().enumerate() {
            self.seg.flag(self.me, at + w).store(*v, Ordering::Relaxed);
        }
        self.barrier(c)?;
        let describe = |v: [u64; 3]| {
            let name = Op::from_index(v[1] as usize).map_or("?", Op::name);
            format!("collective #{} ({name} of {} elements)", v[0], v[2])
        };
        for j in (0..self.n).filter(|&j| j != self.me) {
            let theirs: [u64; 3] =
                std::array::from_fn(|w| self.seg.flag(j, at + w).load(Ordering::Relaxed));
            if theirs != mine {
                return Err(CommError::Mismatch {
                    op: c.op.name(),
                    group: c.group.to_string(),
                    peer: j,
                    got: describe(theirs),
                    expected: describe(mine),
                });
            }
        }
        Ok(())
    }

    /// In place: afterwards every chunk of `buf` holds the sum over ranks (with
    /// `gather`), or the first `chunk me`-length elements hold this rank's chunk
    /// of it (without: each step's sums land where the step's input has already
    /// been consumed). Returns the bytes other ranks read of this rank's data.
    fn reduce(&mut self, c: &Call, buf: &mut [f32], gather: bool) -> Result<u64, CommError> {
        let (n, me) = (self.n, self.me);
        self.begin(c, buf.len())?;
        let chunks: Vec<Range<usize>> = (0..n).map(|j| chunk_range(buf.len(), n, j)).collect();
        let cap = SLOT / n;
        let longest = chunks.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut o = 0;
        while o < longest {
            let set = self.next_set();
            for (j, r) in chunks.iter().enumerate().filter(|(j, _)| *j != me) {
                self.write_slot(set, j * cap, &buf[part(r, o, cap)]);
            }
            self.barrier(c)?;
            let mine = part(&chunks[me], o, cap);
            let k = mine.len();
            let sources: Vec<&[f32]> = (0..n)
                .map(|q| self.slot(set, q, me * cap, if q == me { 0 } else { k }))
                .collect();
            if gather || mine.start == o {
                sum_in_rank_order(&mut buf[mine.clone()], None, me, &sources);
            } else {
                // [o, o + k) lies in chunk 0, before this rank's chunk, and this
                // step has already copied it out.
                let (front, back) = buf.split_at_mut(mine.start);
                sum_in_rank_order(&mut front[o..o + k], Some(&back[..k]), me, &sources);
            }
            if gather {
                self.write_slot(set, me * cap, &buf[mine]);
                self.barrier(c)?;
                for (j, r) in chunks.iter().enumerate().filter(|(j, _)| *j != me) {
                    let p = part(r, o, cap);
                    let len = p.len();
                    copy_streaming(&mut buf[p], self.slot(set, j, j * cap, len));
                }
            }
            o += cap;
        }
        let own = chunks[me].len();
        let scattered = buf.len() - own;
        let gathered = if gather { (n - 1) * own } else { 0 };
        Ok(((scattered + gathered) * 4) as u64)
    }

    /// Afterwards the first `chunk me`-length elements of `buf` hold this rank's
    /// chunk of the sum over ranks.
    pub(crate) fn reduce_scatter(&mut self, c: &Call, buf: &mut [f32]) -> Result<u64, CommError> {
        self.reduce(c, buf, false)
    }

    /// In place: afterwards all of `buf` holds the sum over ranks.
    pub(crate) fn all_reduce(&mut self, c: &Call, buf: &mut [f32]) -> Result<u64, CommError> {
        self.reduce(c, buf, true)
    }

    /// Waits for every rank (checking they all called a barrier).
    pub(crate) fn barrier_op(&mut self, c: &Call) -> Result<u64, CommError> {
        self.begin(c, 0)?;
        Ok(0)
    }

    /// In place: chunk `me` of `buf` is this rank's; afterwards every chunk holds
    /// its owner's.
    pub(crate) fn all_gather(&mut self, c: &Call, buf: &mut [f32]) -> Result<u64, CommError> {
        let (n, me) = (self.n, self.me);
        self.begin(c, buf.len())?;
        let chunks: Vec<Range<usize>> = (0..n).map(|j| chunk_range(buf.len(), n, j)).collect();
        let longest = chunks.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut o = 0;
        while o < longest {
            let set = self.next_set();
            self.write_slot(set, 0, &buf[part(&chunks[me], o, SLOT)]);
            self.barrier(c)?;
            for (j, r) in chunks.iter().enumerate().filter(|(j, _)| *j != me) {
                let p = part(r, o, SLOT);
                let len = p.len();
                copy_streaming(&mut buf[p], self.slot(set, j, 0, len));
            }
            o += SLOT;
        }
        Ok(((n - 1) * chunks[me].len() * 4) as u64)
    }
}

/// Copies `src` into `dst` with stores that bypass the cache: `dst` is a large
/// buffer that nothing reads soon, and a plain store would first read each line
/// of it (a third more memory traffic for a copy). Whole 64-byte lines at a
/// time with AVX-512, 16 bytes with SSE.
fn copy_streaming(dst: &mut [f32], src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    copy_streaming_with(dst, src, std::arch::is_x86_feature_detected!("avx512f"));
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// [`copy_streaming`] with AVX-512 stores (`wide`, which the CPU must have)
/// or SSE ones.
#[cfg(target_arch = "x86_64")]
fn copy_streaming_with(dst: &mut [f32], src: &[f32], wide: bool) {
    assert_eq!(dst.len(), src.len());
    {
        let align = if wide { 64 } else { 16 };
        let lanes = align / 4;
        // Plain stores up to the first aligned address, then a vector a store.
        let head = (dst.as_ptr().align_offset(align)).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let body = (dst.len() - head) / lanes * lanes;
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        if wide {
            // SAFETY: the CPU has AVX-512F (checked); [head, head + body) is
            // inside both slices and every store's destination is 64-byte
            // aligned.
            unsafe { stream64(d, s, body) };
        } else {
            // SAFETY: SSE is part of x86_64; as above, 16-byte aligned.
            unsafe { stream16(d, s, body) };
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
    }
}

/// `n` floats (a multiple of 16) from `s` to the 64-byte aligned `d`, in
/// non-temporal stores of a whole line.
///
/// # Safety
///
/// The CPU has AVX-512F; `d` and `s` are valid for `n` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream64(d: *mut f32, s: *const f32, n: usize) {
    use std::arch::x86_64::{_mm512_loadu_ps, _mm512_stream_ps, _mm_sfence};
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 ≤ n (caller), d + i is 64-byte aligned.
        unsafe { _mm512_stream_ps(d.add(i), _mm512_loadu_ps(s.add(i))) };
        i += 16;
    }
    _mm_sfence();
}

/// [`stream64`] with 16-byte SSE stores: `n` a multiple of 4, `d` 16-byte
/// aligned.
///
/// # Safety
///
/// `d` and `s` are valid for `n` floats.
#[cfg(target_arch = "x86_64")]
unsafe fn stream16(d: *mut f32, s: *const f32, n: usize) {
    use std::arch::x86_64::{_mm_loadu_ps, _mm_sfence, _mm_stream_ps};
    let mut i = 0;
    while i < n {
        // SAFETY: i + 4 ≤ n (caller), d + i is 16-byte aligned.
        unsafe { _mm_stream_ps(d.add(i), _mm_loadu_ps(s.add(i))) };
        i += 4;
    }
    // SAFETY: SSE is part of x86_64.
    unsafe { _mm_sfence() };
}

/// Makes `out` the sum of every rank's contribution, added in rank order:
/// `sources[q]` for q ≠ me, and rank `me`'s from `own` (or `out` itself if
/// `None`), through a small stack buffer.
fn sum_in_rank_order(out: &mut [f32], own: Option<&[f32]>, me: usize, sources: &[&[f32]]) {
    let mut acc = [0f32; BLOCK];
    let mut at = 0;
    while at < out.len() {
        let k = BLOCK.min(out.len() - at);
        let acc = &mut acc[..k];
        let dst = &mut out[at..at + k];
        for (q, src) in sources.iter().enumerate() {
            let src = match (q == me, own) {
                (true, Some(own)) => &own[at..at + k],
                (true, None) => &*dst,
                (false, _) => &src[at..at + k],
            };
            if q == 0 {
                acc.copy_from_slice(src);
            } else {
                crate::reduce_add(acc, src);
            }
        }
        dst.copy_from_slice(acc);
        at += k;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_order_sum_matches_a_left_fold() {
        let n = 5000;
        let srcs: Vec<Vec<f32>> = (0..4)
            .map(|q| {
                (0..n)
                    .map(|i| ((i * 7 + q * 13) % 97) as f32 * 0.1)
                    .collect()
            })
            .collect();
        for me in 0..4 {
            let views: Vec<&[f32]> = srcs.iter().map(Vec::as_slice).collect();
            let mut in_place = srcs[me].clone();
            sum_in_rank_order(&mut in_place, None, me, &views);
            let mut elsewhere = vec![0f32; n];
            sum_in_rank_order(&mut elsewhere, Some(&srcs[me]), me, &views);
            for i in 0..n {
                let want = ((srcs[0][i] + srcs[1][i]) + srcs[2][i]) + srcs[3][i];
                assert_eq!(in_place[i].to_bits(), want.to_bits());
                assert_eq!(elsewhere[i].to_bits(), want.to_bits());
            }
        }
    }

    #[test]
    fn parts_clip_to_their_chunk() {
        assert_eq!(part(&(10..25), 0, 8), 10..18);
        assert_eq!(part(&(10..25), 8, 8), 18..25);
        assert_eq!(part(&(10..25), 16, 8), 25..25);
    }

    /// Every start alignment and length, the unaligned head and the tail
    /// around the vector body included, copies exactly `src` and nothing
    /// past it, with SSE stores and (where the CPU has them) AVX-512 ones.
    #[test]
    fn streaming_copy_copies_every_element_at_any_alignment() {
        let src: Vec<f32> = (0..200).map(|i| i as f32 * 0.5 + 1.0).collect();
        #[cfg(target_arch = "x86_64")]
        let paths: Vec<bool> = [false, true]
            .into_iter()
            .filter(|&wide| !wide || std::arch::is_x86_feature_detected!("avx512f"))
            .collect();
        #[cfg(not(target_arch = "x86_64"))]
        let paths = [false];
        for (offset, wide) in (0..17).flat_map(|o| paths.iter().map(move |&w| (o, w))) {
            for len in [0, 1, 3, 4, 15, 16, 17, 31, 64, 65, 130, 183 - offset] {
                let mut buf = vec![-1f32; 200];
                #[cfg(target_arch = "x86_64")]
                copy_streaming_with(&mut buf[offset..offset + len], &src[..len], wide);
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (
                    wide,
                    copy_streaming(&mut buf[offset..offset + len], &src[..len]),
                );
                assert_eq!(
                    &buf[offset..offset + len],
                    &src[..len],
                    "offset {offset} len {len} wide {wide}"
                );
                assert!(buf[..offset].iter().all(|&v| v == -1.0));
                assert!(buf[offset + len..].iter().all(|&v| v == -1.0));
            }
        }
    }
}
