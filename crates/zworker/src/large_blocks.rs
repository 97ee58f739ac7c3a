//! The worker's allocator: glibc's for everything, except that blocks of
//! 32 MiB and more are kept when freed and handed out again, as PyTorch's
//! caching allocator keeps its blocks.
//!
//! glibc maps each block of [`LARGE`] bytes or more on its own and unmaps it
//! when it is freed (32 MiB is the largest threshold it takes), so every step
//! of a job whose activations are that large faulted them in again and the
//! kernel zeroed them: at seq 2048 × micro-batch 8 on the anchor model (MLP
//! activations of 96 MiB) one worker × 2 threads took 860k page faults a step
//! and 11% of its samples were in the fault path. Routing every thread to
//! one glibc arena with no mapped blocks (`M_ARENA_MAX=1`, `M_MMAP_MAX=0`)
//! removed the faults (+11% at that shape) but cost two threads 1-3% at the
//! anchor's small shapes (buffers a core had just used went to the other
//! core); mimalloc without purging ran as fast but with 21% more peak RSS.
//! So only the large blocks are kept here, and the small ones stay in
//! glibc's per-thread arenas.
//!
//! The rule that bounds what is kept ([`Policy`]): the bytes of large blocks
//! mapped (in use plus kept) never exceed the most that were ever in use at
//! once. A block is reused only for a request of its own length (a training
//! step asks for the same lengths every step); a request that finds none
//! gives back the longest-kept blocks until the new one fits under that
//! bound. So peak RSS is never above what the same run reaches without the
//! cache, and a step that repeats the last one's requests finds most of its
//! blocks kept: not all, since lengths peak at different times (the
//! gradients of one length after those of another) and keeping each
//! length's peak would hold more than was ever in use. At that shape the
//! faults fell from 860k to 116k a step (6 steps, `perf stat`), the steps
//! ran 1.16x as fast, and peak RSS stayed 2.87 GiB.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr;
use std::sync::Mutex;

/// Blocks at least this long are kept; shorter ones are glibc's (which
/// keeps them in its heaps since `zworker` raises its mapping threshold to
/// this).
pub const LARGE: usize = 32 << 20;

/// How many freed blocks are kept at most.
const SLOTS: usize = 64;

/// The page length every large block is a multiple of.
const PAGE: usize = 4096;

/// A kept block: its address and mapped length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kept {
    addr: usize,
    len: usize,
    /// When it was freed (a counter): the smallest goes back first.
    when: u64,
}

/// What the allocator decides, apart from the mapping calls: which freed
/// block serves a request and which are given back. `addr`s are opaque.
#[derive(Debug)]
pub struct Policy {
    kept: [Option<Kept>; SLOTS],
    /// Bytes of large blocks handed out and not yet freed.
    in_use: usize,
    /// Bytes of large blocks kept.
    kept_bytes: usize,
    /// The most bytes of large blocks ever in use at once.
    most_in_use: usize,
    clock: u64,
}

impl Policy {
    /// Nothing kept, nothing in use.
    pub const fn new() -> Self {
        Policy {
            kept: [None; SLOTS],
            in_use: 0,
            kept_bytes: 0,
            most_in_use: 0,
            clock: 0,
        }
    }

    /// A request for a block of `len` bytes (a multiple of the page): the
    /// address of a kept block of that length, or `None`, when the caller
    /// maps a new one (and calls [`Policy::failed`] if that fails), after
    /// the longest-kept blocks that would leave more mapped than was ever
    /// in use went to `give_back` (address, length).
    pub fn take(&mut self, len: usize, give_back: &mut impl FnMut(usize, usize)) -> Option<usize> {
        let found = self
            .kept
            .iter()
            .enumerate()
            .filter_map(|(i, k)| k.filter(|k| k.len == len).map(|k| (i, k)))
            .max_by_key(|(_, k)| k.when);
        self.in_use += len;
        self.most_in_use = self.most_in_use.max(self.in_use);
        if let Some((i, k)) = found {
            self.kept[i] = None;
            self.kept_bytes -= len;
            return Some(k.addr);
        }
        while self.in_use + self.kept_bytes > self.most_in_use {
            let Some(k) = self.oldest() else { break };
            give_back(k.addr, k.len);
        }
        None
    }

    /// The mapping [`Policy::take`] asked for failed: `len` is not in use.
    pub fn failed(&mut self, len: usize) {
        self.in_use -= len;
    }

    /// Every kept block goes back (a mapping failed: the memory is needed).
    pub fn give_back_all(&mut self, give_back: &mut impl FnMut(usize, usize)) {
        while let Some(k) = self.oldest() {
            give_back(k.addr, k.len);
        }
    }

    /// A block of `len` bytes at `addr` is freed: kept, unless every slot
    /// is taken, when the longest-kept block goes back to make room.
    pub fn free(&mut self, addr: usize, len: usize, give_back: &mut impl FnMut(usize, usize)) {
        self.in_use -= len;
        let slot = match self.kept.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                let Some((i, _)) = self.oldest_slot() else {
                    return give_back(addr, len);
                };
                let k = self.kept[i].take().expect("the oldest slot holds a block");
                self.kept_bytes -= k.len;
                give_back(k.addr, k.len);
                i
            }
        };
        self.clock += 1;
        self.kept[slot] = Some(Kept {
            addr,
            len,
            when: self.clock,
        });
        self.kept_bytes += len;
    }

    /// Bytes of large blocks mapped: in use and kept.
    pub fn mapped(&self) -> usize {
        self.in_use + self.kept_bytes
    }

    /// The most bytes of large blocks ever in use at once.
    pub fn most_in_use(&self) -> usize {
        self.most_in_use
    }

    fn oldest_slot(&self) -> Option<(usize, Kept)> {
        self.kept
            .iter()
            .enumerate()
            .filter_map(|(i, k)| k.map(|k| (i, k)))
            .min_by_key(|(_, k)| k.when)
    }

    /// Removes and returns the longest-kept block.
    fn oldest(&mut self) -> Option<Kept> {
        let (i, k) = self.oldest_slot()?;
        self.kept[i] = None;
        self.kept_bytes -= k.len;
        Some(k)
    }
}

impl Default for Policy {
    fn default() -> Self {
        Self::new()
    }
}

/// The global allocator `zworker` runs with: [`System`] for blocks under
/// [`LARGE`] bytes (or aligned beyond a page), anonymous mappings kept by
/// [`Policy`] for the rest.
pub struct KeepLargeBlocks {
    policy: Mutex<Policy>,
}

impl KeepLargeBlocks {
    /// An allocator that keeps nothing yet.
    pub const fn new() -> Self {
        KeepLargeBlocks {
            policy: Mutex::new(Policy::new()),
        }
    }

    fn policy(&self) -> std::sync::MutexGuard<'_, Policy> {
        // The policy never panics while locked; a poisoned lock still holds
        // consistent counts.
        self.policy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The mapped length of a large block of `size` bytes.
    fn length(size: usize) -> usize {
        size.div_ceil(PAGE) * PAGE
    }

    /// A block of at least `size` (large) bytes: a kept one, or a fresh
    /// mapping (`true`: it reads as zeros); null where mapping failed.
    fn large_block(&self, size: usize) -> (*mut u8, bool) {
        let len = Self::length(size);
        let reused = self.policy().take(len, &mut unmap);
        if let Some(addr) = reused {
            return (addr as *mut u8, false);
        }
        let mut p = map(len);
        if p.is_null() {
            self.policy().give_back_all(&mut unmap);
            p = map(len);
            if p.is_null() {
                self.policy().failed(len);
            }
        }
        (p, true)
    }

    fn large(layout: Layout) -> bool {
        layout.size() >= LARGE && layout.align() <= PAGE
    }
}

impl Default for KeepLargeBlocks {
    fn default() -> Self {
        Self::new()
    }
}

/// Unmaps a block this allocator mapped.
fn unmap(addr: usize, len: usize) {
    // SAFETY: `addr` and `len` are a mapping this allocator made and no
    // longer hands out (the policy gives back only kept blocks).
    unsafe { libc::munmap(addr as *mut libc::c_void, len) };
}

/// Maps `len` bytes of zeroed, private, anonymous memory; null on failure.
fn map(len: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping at an address the kernel picks
    // touches no existing memory.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        ptr::null_mut()
    } else {
        p.cast()
    }
}

// SAFETY: small blocks are System's; a large block is a fresh mapping of at
// least `size` bytes, page-aligned (which covers `align <= PAGE`), handed out
// to one caller at a time (the policy keeps a block only once it is freed,
// and hands a kept block to one request), and unmapped only when no caller
// holds it.
unsafe impl GlobalAlloc for KeepLargeBlocks {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !Self::large(layout) {
            // SAFETY: the caller's layout contract passes through.
            return unsafe { System.alloc(layout) };
        }
        self.large_block(layout.size()).0
    }

    /// Zeroes only a kept block: a fresh mapping reads as zeros already,
    /// and its pages stay unmapped until written. (`GlobalAlloc`'s own
    /// `alloc_zeroed` wrote zeros over every block, which made a fresh
    /// mapping resident whole: a `vec![0.0; n]` whose frozen parts nothing
    /// writes took its full size while a worker started.)
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !Self::large(layout) {
            // SAFETY: the caller's layout contract passes through.
            return unsafe { System.alloc_zeroed(layout) };
        }
        let (p, fresh) = self.large_block(layout.size());
        if !p.is_null() && !fresh {
            // SAFETY: a kept block is at least `layout.size()` bytes long.
            unsafe { p.write_bytes(0, layout.size()) };
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !Self::large(layout) {
            // SAFETY: `ptr` came from System.alloc with this layout.
            return unsafe { System.dealloc(ptr, layout) };
        }
        let len = Self::length(layout.size());
        self.policy().free(ptr as usize, len, &mut unmap);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract: `new_size` is valid for `layout`'s alignment.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (Self::large(layout), Self::large(new)) {
            // SAFETY: `ptr` came from System.alloc with `layout`.
            (false, false) => unsafe { System.realloc(ptr, layout, new_size) },
            (true, true) if Self::length(layout.size()) == Self::length(new_size) => ptr,
            _ => {
                // SAFETY: a fresh block of `new`, the old one valid for
                // `layout.size()` bytes until freed here.
                unsafe {
                    let p = self.alloc(new);
                    if !p.is_null() {
                        ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    p
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// A stand-in for the mappings: hands out fresh addresses, records what
    /// goes back.
    struct Mappings {
        next: usize,
        mapped: usize,
        made: usize,
    }

    impl Mappings {
        fn new() -> Self {
            Mappings {
                next: 1,
                mapped: 0,
                made: 0,
            }
        }

        fn alloc(&mut self, p: &mut Policy, len: usize) -> usize {
            let mut back = 0;
            let r = p.take(len, &mut |_, l| back += l);
            self.mapped -= back;
            r.unwrap_or_else(|| {
                self.next += 1;
                self.mapped += len;
                self.made += 1;
                self.next
            })
        }

        fn free(&mut self, p: &mut Policy, addr: usize, len: usize) {
            let mut back = 0;
            p.free(addr, len, &mut |_, l| back += l);
            self.mapped -= back;
        }
    }

    /// A step's large blocks, forward then backward: each layer's
    /// activations kept to the backward (a temporary of another length
    /// between them where `temporary`), a gradient of each one's length
    /// made as it is freed. Returns the requests.
    fn step(m: &mut Mappings, p: &mut Policy, temporary: bool) -> usize {
        let (mut saved, mut requests) = (Vec::new(), 0);
        for _ in 0..6 {
            saved.push((m.alloc(p, 72 * MIB), 72 * MIB));
            let t = temporary.then(|| m.alloc(p, 48 * MIB));
            saved.push((m.alloc(p, 96 * MIB), 96 * MIB));
            if let Some(t) = t {
                m.free(p, t, 48 * MIB);
            }
            saved.push((m.alloc(p, 96 * MIB), 96 * MIB));
            requests += 3 + usize::from(temporary);
        }
        while let Some((a, len)) = saved.pop() {
            let g = m.alloc(p, len);
            m.free(p, a, len);
            m.free(p, g, len);
            requests += 1;
        }
        requests
    }

    /// A step that repeats the last one's requests finds most of its
    /// blocks kept. Not all: the lengths peak at different times (the
    /// gradients of the 72 MiB activations after those of the 96 MiB
    /// ones), and keeping every length's peak would map more than was
    /// ever in use at once, which the policy does not. Here later steps
    /// map 2 of 36 requests (4 of 42 with a temporary between the
    /// activations) where glibc maps every one.
    #[test]
    fn a_repeated_step_maps_few_blocks_again() {
        for temporary in [false, true] {
            let (mut m, mut p) = (Mappings::new(), Policy::new());
            step(&mut m, &mut p, temporary);
            for _ in 0..5 {
                let before = m.made;
                let requests = step(&mut m, &mut p, temporary);
                let again = m.made - before;
                assert!(
                    again * 8 <= requests,
                    "{again} of {requests} requests mapped"
                );
                assert_eq!(p.mapped(), m.mapped);
                assert!(m.mapped <= p.most_in_use());
            }
        }
    }

    #[test]
    fn what_is_mapped_never_exceeds_the_most_ever_in_use() {
        // A seeded walk of requests of a few lengths, freed in any order.
        let (mut m, mut p) = (Mappings::new(), Policy::new());
        let mut live: Vec<(usize, usize)> = Vec::new();
        let mut x: u64 = 7;
        let (mut in_use, mut most) = (0, 0);
        for _ in 0..20_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (x >> 33) as usize;
            if !r.is_multiple_of(3) || live.is_empty() {
                let len = [32, 40, 72, 96, 200][r % 5] * MIB;
                live.push((m.alloc(&mut p, len), len));
                in_use += len;
            } else {
                let (a, len) = live.swap_remove(r % live.len());
                m.free(&mut p, a, len);
                in_use -= len;
            }
            most = usize::max(most, in_use);
            assert_eq!(p.mapped(), m.mapped);
            assert!(
                m.mapped <= most,
                "{} mapped over {most} ever in use",
                m.mapped
            );
            assert!(m.mapped >= in_use);
        }
    }

    #[test]
    fn a_full_set_of_slots_gives_back_the_longest_kept() {
        let mut p = Policy::new();
        let mut back = Vec::new();
        let lens: Vec<usize> = (0..=SLOTS).map(|i| (32 + i) * MIB).collect();
        let addrs: Vec<usize> = lens
            .iter()
            .map(|&l| {
                assert_eq!(p.take(l, &mut |a, l| back.push((a, l))), None);
                l
            })
            .collect();
        for &a in &addrs {
            p.free(a, a, &mut |a, l| back.push((a, l)));
        }
        assert_eq!(back, vec![(lens[0], lens[0])]);
        assert_eq!(
            p.take(lens[1], &mut |a, l| back.push((a, l))),
            Some(lens[1])
        );
    }

    #[test]
    fn the_allocator_reuses_a_freed_block_and_keeps_its_contents_apart() {
        let a = KeepLargeBlocks::new();
        let layout = Layout::from_size_align(LARGE + 100, 64).unwrap();
        // SAFETY: a valid layout; each block is written within its size and
        // freed once with the layout it was made with.
        unsafe {
            let p = a.alloc(layout);
            assert!(!p.is_null());
            p.write_bytes(7, layout.size());
            a.dealloc(p, layout);
            let q = a.alloc(layout);
            assert_eq!(q, p, "the kept block was not reused");
            let r = a.alloc(layout);
            assert!(!r.is_null() && r != q);
            // A fresh mapping reads zeroes; the kept one what was written.
            assert_eq!(*r.add(layout.size() - 1), 0);
            assert_eq!(*q.add(layout.size() - 1), 7);
            let grown = a.realloc(q, layout, 2 * LARGE);
            assert_eq!(*grown.add(layout.size() - 1), 7);
            a.dealloc(grown, Layout::from_size_align(2 * LARGE, 64).unwrap());
            a.dealloc(r, layout);
            let small = Layout::from_size_align(1000, 8).unwrap();
            let s = a.alloc(small);
            assert!(!s.is_null());
            a.dealloc(s, small);
        }
        let p = a.policy();
        assert!(p.mapped() <= p.most_in_use());
    }

    /// A zeroed large block is zeros whether fresh or kept, and a fresh one
    /// is not made resident by it (`mincore`): only the pages written are.
    #[test]
    fn a_zeroed_block_is_zeros_and_a_fresh_one_takes_no_memory_until_written() {
        let a = KeepLargeBlocks::new();
        let layout = Layout::from_size_align(LARGE + 100, 64).unwrap();
        let resident = |p: *mut u8| {
            let pages = KeepLargeBlocks::length(layout.size()) / PAGE;
            let mut flags = vec![0u8; pages];
            // SAFETY: `p` is a page-aligned mapping of `pages` pages.
            let rc = unsafe { libc::mincore(p.cast(), pages * PAGE, flags.as_mut_ptr()) };
            assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
            flags.iter().filter(|&&f| f & 1 == 1).count()
        };
        // SAFETY: a valid layout; each block is written within its size and
        // freed once with the layout it was made with.
        unsafe {
            let p = a.alloc_zeroed(layout);
            assert!(!p.is_null());
            assert_eq!(resident(p), 0, "a fresh zeroed block was written over");
            p.add(3 * PAGE).write(1);
            assert_eq!(resident(p), 1);
            p.write_bytes(9, layout.size());
            a.dealloc(p, layout);
            let q = a.alloc_zeroed(layout);
            assert_eq!(q, p, "the kept block was not reused");
            let bytes = std::slice::from_raw_parts(q, layout.size());
            assert!(bytes.iter().all(|&b| b == 0), "a kept block was not zeroed");
            a.dealloc(q, layout);
        }
    }
}
