//! A global allocator that counts the bytes live on the Rust heap and their peak, to measure the
//! host memory a code path allocates (include it with
//! `#[path = "support/counting_alloc.rs"] mod counting_alloc;` and declare
//! `#[global_allocator] static ALLOC: counting_alloc::Counting = counting_alloc::Counting;`).
//! Counts every thread's allocations: measure one thing at a time ([`measure`] holds a lock).
//! Memory the CUDA driver or `mmap` allocates itself is not counted.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The system allocator, counting.
pub struct Counting;

// SAFETY: every call forwards to `System` unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grow(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::SeqCst);
            }
        }
        p
    }
}

fn grow(n: usize) {
    let live = LIVE.fetch_add(n, Ordering::SeqCst) + n;
    PEAK.fetch_max(live, Ordering::SeqCst);
}

/// Runs `f`; returns its result, the peak of live heap bytes above the level at the start
/// while it ran, and the bytes still live at the end above that level (what `f` returned or
/// leaked).
pub fn measure<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let start = LIVE.load(Ordering::SeqCst);
    PEAK.store(start, Ordering::SeqCst);
    let out = f();
    let (peak, end) = (PEAK.load(Ordering::SeqCst), LIVE.load(Ordering::SeqCst));
    (out, peak.saturating_sub(start), end.saturating_sub(start))
}
