//! Any bytes as `b_sel u8 | n_sel u8 | n_arg u32 | packed codes` through `pq_core::unpack`:
//! exactly the errors spec/PQ.md §2 requires, codes `< 2^b` equal to a bit-by-bit reading, `pack`
//! gives the input back, and no allocation beyond the `n` codes the byte length pays for (none
//! when the length is wrong). Body: `pq_core::fuzzing::pq_unpack_counting`.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes it hands out (never decremented).
struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counter
// only observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size.saturating_sub(layout.size()), Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fuzz_target!(|data: &[u8]| {
    pq_core::fuzzing::pq_unpack_counting(data, || ALLOCATED.load(Ordering::Relaxed));
});
