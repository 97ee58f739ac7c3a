//! Page-aligned host buffers, the only kind `O_DIRECT` accepts.
//!
//! `O_DIRECT` transfers go straight between the device and the buffer, so the
//! buffer's address, the file offset and the length must all be multiples of
//! the logical block size; 4 KiB covers every NVMe and ext4/xfs setup. A buffer
//! owns its allocation, so it can travel to an I/O thread and back by value
//! while its bytes stay where the kernel was told they are.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// The alignment of addresses, offsets and lengths of every swap transfer.
pub const ALIGN: usize = 4096;

/// A zeroed, [`ALIGN`]-aligned byte buffer whose length is a multiple of [`ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (like a Vec<u8>); moving it
// to another thread moves that ownership.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only read the bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of at least `bytes` bytes (rounded up to [`ALIGN`], at least one block).
    pub fn zeroed(bytes: usize) -> AlignedBuf {
        let len = round_up(bytes.max(1));
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, ALIGN).expect("swap buffer size overflows")
    }

    /// Length in bytes (a multiple of [`ALIGN`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: a buffer holds at least one block.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes as f32 values.
    pub fn f32s(&self) -> &[f32] {
        bytemuck::cast_slice(self.bytes())
    }

    /// The bytes as f32 values, writable.
    pub fn f32s_mut(&mut self) -> &mut [f32] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }

    /// The bytes as 16-bit words, writable (bf16 / f16 parameters).
    pub fn u16s_mut(&mut self) -> &mut [u16] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }

    /// The bytes as 16-bit words.
    pub fn u16s(&self) -> &[u16] {
        bytemuck::cast_slice(self.bytes())
    }

    /// The start address, for the I/O paths.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this very layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

/// `n` rounded up to a multiple of [`ALIGN`].
pub fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_rounded() {
        for want in [1, 4095, 4096, 4097, 3 * 4096 + 5] {
            let mut b = AlignedBuf::zeroed(want);
            assert_eq!(b.as_mut_ptr() as usize % ALIGN, 0);
            assert!(b.len() >= want && b.len().is_multiple_of(ALIGN) && b.len() - want < ALIGN);
            assert!(b.bytes().iter().all(|&x| x == 0));
            b.f32s_mut()[1] = 2.5;
            assert_eq!(b.f32s()[1], 2.5);
            assert_eq!(b.u16s().len(), b.len() / 2);
            b.u16s_mut()[3] = 0xbeef;
            assert_eq!(b.bytes()[6..8], 0xbeefu16.to_le_bytes());
            assert_eq!(b.u16s_mut().len(), b.len() / 2);
            assert!(!b.is_empty());
            assert_eq!(format!("{b:?}"), format!("AlignedBuf({} bytes)", b.len()));
        }
    }
}
