//! What reading a conversation's newest summary costs sled: the reverse scan memproxy made at
//! every request (`scan_prefix(id).next_back()`, which copies the leaf it reads) against
//! `last_in_place` (vendor/sled, the same answer read from the leaf where it lies).
//!
//! ```text
//! cargo run --release -p memproxy-store --example summary_read
//! ```
//!
//! 2,000 conversations with one to four summaries of about 1.5 KB each (a summary record as
//! stored: sealed JSON), in one tree; each read is of every conversation once, round-robin; the
//! best of 7 rounds, µs a read.

#![allow(clippy::print_stdout)]

use std::time::Instant;

const CONVERSATIONS: u64 = 2_000;
const ROUNDS: usize = 7;

fn key(id: u64, number: u64) -> [u8; 16] {
    let mut key = [0; 16];
    key[..8].copy_from_slice(&id.to_be_bytes());
    key[8..].copy_from_slice(&number.to_be_bytes());
    key
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let db = sled::Config::new().path(dir.path()).open()?;
    let tree = db.open_tree("summaries")?;
    for number in 0..4 {
        for id in (0..CONVERSATIONS).filter(|id| number <= id % 4) {
            let value = vec![b'x'; 1_400 + (id % 7) as usize * 40];
            tree.insert(key(id, number), value)?;
        }
    }
    type Read<'a> = &'a dyn Fn(u64) -> sled::Result<usize>;
    let time = |read: Read<'_>| -> sled::Result<(f64, usize)> {
        let mut best = f64::MAX;
        let mut bytes = 0;
        for _ in 0..ROUNDS {
            let started = Instant::now();
            bytes = (0..CONVERSATIONS).map(read).sum::<sled::Result<usize>>()?;
            let each = started.elapsed().as_secs_f64() * 1e6 / CONVERSATIONS as f64;
            best = best.min(each);
        }
        Ok((best, bytes))
    };
    let (scan, scanned) = time(&|id| {
        let last = tree.scan_prefix(id.to_be_bytes()).next_back().transpose()?;
        Ok(last.map_or(0, |(_, value)| value.len()))
    })?;
    let (in_place, read) = time(&|id| {
        let last = tree
            .scan_prefix(id.to_be_bytes())
            .last_in_place()
            .transpose()?;
        Ok(last.map_or(0, |(_, value)| value.len()))
    })?;
    assert_eq!(scanned, read, "the same summaries");
    println!(
        "{CONVERSATIONS} conversations' newest summaries ({} keys): next_back {scan:.2} µs a read, \
         last_in_place {in_place:.2} µs ({:.2}×)",
        tree.len(),
        scan / in_place
    );
    Ok(())
}
