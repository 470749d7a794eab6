//! The one small seeded random generator of the benches and examples, so that synthetic text is
//! the same on every run. Not part of the memproxy crate: each target includes this file with
//! `#[path = ".../tests/support/rng.rs"] mod rng;`.
//!
//! The algorithm is Marsaglia's xorshift64 (shifts 13, 7, 17) with the seed as its state, as the
//! figures of `examples/compression_replay.rs` in the README were made with it: changing the
//! algorithm or the seeding changes those figures.
// Each target that includes this file uses a different part of it.
#![allow(dead_code)]

/// A xorshift64 generator. Not for anything that needs unpredictable numbers.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose state is `seed`. Xorshift never leaves a zero state, so a zero seed is
    /// replaced by a fixed non-zero one.
    pub fn new(seed: u64) -> Rng {
        Rng(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n` (`n` must not be zero); the remainder of [`Rng::next_u64`], so the
    /// small bias of a modulo is kept as the figures were made with it.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// An item of `items` (which must not be empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}
