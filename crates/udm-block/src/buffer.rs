//! Page-aligned byte buffers, so that data can go to O_DIRECT files without a bounce copy.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ops::{Deref, DerefMut};

const ALIGN: usize = 4096;

/// A growable, zero-initialised, 4 KiB-aligned buffer. Exports keep one per worker thread and
/// reuse it, so the data path does not allocate per request.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    capacity: usize,
    /// Mapped with mmap rather than taken from the allocator (see [`AlignedBuf::mapped`]).
    mapped: bool,
}

// The buffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new() -> Self {
        AlignedBuf {
            ptr: ALIGN as *mut u8,
            len: 0,
            capacity: 0,
            mapped: false,
        }
    }

    /// A zeroed buffer of `len` bytes mapped straight from the kernel. Its memory goes back to
    /// the kernel when it is dropped, whereas the allocator may keep freed memory for reuse:
    /// what a bound on memory (the NBD server's buffer budget) needs. Growing it later
    /// moves it to the allocator.
    pub fn mapped(len: usize) -> Self {
        let mut buf = Self::new();
        if len == 0 {
            return buf;
        }
        let capacity = len.next_multiple_of(ALIGN);
        // SAFETY: an anonymous private mapping; the kernel picks the (page-aligned) address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                capacity,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            std::alloc::handle_alloc_error(
                Layout::from_size_align(capacity, ALIGN).expect("buffer layout"),
            );
        }
        buf.ptr = ptr.cast();
        buf.capacity = capacity;
        buf.len = len;
        buf.mapped = true;
        buf
    }

    pub fn zeroed(len: usize) -> Self {
        let mut buf = Self::new();
        buf.resize(len);
        buf
    }

    /// Sets the length; grows the allocation when needed. Contents up to the old length are
    /// kept; newly exposed bytes are unspecified (zero on a fresh allocation).
    pub fn resize(&mut self, len: usize) {
        if len > self.capacity {
            let capacity = len.next_multiple_of(ALIGN);
            let layout = Layout::from_size_align(capacity, ALIGN).expect("buffer layout");
            // SAFETY: capacity is non-zero and the layout is valid.
            let ptr = unsafe { alloc_zeroed(layout) };
            if ptr.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            if self.len > 0 {
                // SAFETY: both regions are valid for self.len bytes and do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(self.ptr, ptr, self.len) };
            }
            self.release();
            self.ptr = ptr;
            self.capacity = capacity;
            self.mapped = false;
        }
        self.len = len;
    }

    fn release(&mut self) {
        if self.mapped {
            // SAFETY: ptr..ptr+capacity is the mapping made in `mapped`, used by nothing else.
            unsafe { libc::munmap(self.ptr.cast(), self.capacity) };
        } else if self.capacity > 0 {
            let layout = Layout::from_size_align(self.capacity, ALIGN).expect("buffer layout");
            // SAFETY: ptr was allocated with exactly this layout.
            unsafe { dealloc(self.ptr, layout) };
        }
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.release();
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid (or dangling-but-aligned with len 0) for len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_keeps_contents_and_stays_aligned() {
        let mut buf = AlignedBuf::zeroed(10);
        buf.copy_from_slice(b"0123456789");
        buf.resize(100_000);
        assert_eq!(&buf[..10], b"0123456789");
        assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
        buf.resize(5);
        assert_eq!(&buf[..], b"01234");
    }

    #[test]
    fn mapped_buffers_are_zeroed_aligned_and_can_grow() {
        let mut buf = AlignedBuf::mapped(10_000);
        assert_eq!(buf.len(), 10_000);
        assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
        assert!(buf.iter().all(|&b| b == 0));
        buf[9_999] = 7;
        buf.resize(12_288); // within the mapping's last page
        assert_eq!(buf[9_999], 7);
        buf.resize(100_000); // beyond it: moves to the allocator
        assert_eq!(buf[9_999], 7);
        assert!(AlignedBuf::mapped(0).is_empty());
    }
}
