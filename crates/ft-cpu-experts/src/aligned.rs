//! `Int16Lines`: a reusable int16 buffer on 64-byte cache lines. The VNNI kernels load x 64 bytes at a time, and a
//! load that straddles two lines costs about twice: on this crate's Sapphire Rapids host, vectors at a 16-byte
//! offset (where the allocator puts a `Vec<i16>`) made the NVFP4 kernel 15-20 % slower (2026-12-07).

/// One cache line of int16.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([i16; 32]);

#[derive(Default)]
pub(crate) struct Int16Lines(Vec<Line>);

impl Int16Lines {
    /// The first `len` elements (a multiple of 32), the buffer grown if needed; what an earlier call left in them
    /// is still there.
    pub(crate) fn first(&mut self, len: usize) -> &mut [i16] {
        assert!(len.is_multiple_of(32), "whole lines: {len}");
        if self.0.len() < len / 32 {
            self.0.resize(len / 32, Line([0; 32]));
        }
        let lines = &mut self.0[..len / 32];
        // SAFETY: `lines` is `len / 32` lines of 32 int16 each, contiguous (repr C, no padding: 64 bytes a line)
        unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut i16, len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_aligned_and_grow() {
        let mut b = Int16Lines::default();
        b.first(64).fill(5);
        let v = b.first(96);
        assert_eq!(v.len(), 96);
        assert!(v[..64].iter().all(|x| *x == 5) && v[64..].iter().all(|x| *x == 0));
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert_eq!(std::mem::size_of::<Line>(), 64);
    }
}
