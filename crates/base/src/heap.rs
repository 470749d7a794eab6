//! What values really take on the heap: the sizes the caches weigh their entries by.
//!
//! A cache's `max_capacity` is only as true as its weigher. Counting the bytes a value asks for
//! misses what the allocator adds to each allocation and what the cache keeps per entry; with
//! many small allocations (a posting list per term, three strings per key) that is half as much
//! again. Measured with the soak (`loadbench --soak`, 10,000 conversations): the state and
//! recall caches, weighed by requested bytes, took 1.5 times their configured size in RSS.
//! These functions count what the allocator hands out instead: jemalloc's size classes when
//! memproxy is built with it (its `jemalloc` feature, the default: `src/allocator.rs`), glibc's
//! chunks otherwise.

use std::mem::size_of;

/// What the cache keeps per entry besides key and value: its hash map slot, the access- and
/// write-order queue nodes, the entry's metadata (moka 0.12, read from its source: about 250
/// bytes), rounded up.
pub const CACHE_ENTRY: usize = 256;

/// The bytes an allocation of `n` bytes takes from the heap (0 for no allocation).
pub const fn chunk(n: usize) -> usize {
    if cfg!(feature = "jemalloc") {
        jemalloc_class(n)
    } else {
        glibc_chunk(n)
    }
}

/// glibc's malloc adds an 8-byte header, rounds to 16 and never hands out less than 32.
pub const fn glibc_chunk(n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let rounded = (n + 8).next_multiple_of(16);
    if rounded < 32 { 32 } else { rounded }
}

/// jemalloc has no header; it rounds up to its size class: 8, then multiples of 16 up to 128,
/// then four classes to each doubling (160, 192, 224, 256, 320, …).
pub const fn jemalloc_class(n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    if n <= 8 {
        return 8;
    }
    if n <= 128 {
        return n.next_multiple_of(16);
    }
    // 2^lg < n <= 2^(lg + 1); classes in this doubling are 2^(lg - 2) apart.
    let lg = usize::BITS - 1 - (n - 1).leading_zeros();
    n.next_multiple_of(1 << (lg - 2))
}

/// The heap a `Vec<T>` of `capacity` holds (its buffer; the three words of the `Vec` itself
/// are wherever it lives).
pub fn vec<T>(capacity: usize) -> usize {
    chunk(capacity * size_of::<T>())
}

/// The heap an `Arc<T>` holds: `T` and the two counts.
pub const fn arc<T>() -> usize {
    chunk(2 * size_of::<usize>() + size_of::<T>())
}

/// The heap a `String` of `capacity` bytes holds.
pub fn string(capacity: usize) -> usize {
    chunk(capacity)
}

/// The heap a `HashMap` with room for `capacity` entries of `entry` bytes each holds in its
/// table (hashbrown: buckets a power of two at most 7/8 full, one control byte each), not
/// counting what the entries point to.
pub fn hash_table(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = (capacity * 8).div_ceil(7).next_power_of_two().max(4);
    chunk(buckets * (entry + 1) + 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_counted_as_the_allocator_hands_them_out() {
        assert_eq!(glibc_chunk(0), 0);
        assert_eq!(glibc_chunk(1), 32);
        assert_eq!(glibc_chunk(24), 32);
        assert_eq!(glibc_chunk(25), 48);
        assert_eq!(glibc_chunk(1000), 1008);
        let classes = [
            (0, 0),
            (1, 8),
            (8, 8),
            (9, 16),
            (24, 32),
            (128, 128),
            (129, 160),
            (256, 256),
            (257, 320),
            (1000, 1024),
            (1025, 1280),
            (4097, 5120),
        ];
        for (n, class) in classes {
            assert_eq!(jemalloc_class(n), class, "{n}");
        }
        assert_eq!(vec::<u64>(3), chunk(24));
        assert_eq!(vec::<u64>(0), 0);
        assert_eq!(string(0), 0);
        assert_eq!(hash_table(0, 24), 0);
        // Room for 100 entries: 128 buckets of 24 + 1 bytes.
        assert_eq!(hash_table(100, 24), chunk(128 * 25 + 16));
    }
}
