//! The caches bounded in bytes that give memory back under pressure: moka's cache, each
//! entry stamped with its last use, so [`Cache::shrink_to`] can evict the least recently used
//! first and hold the cache under a lower limit until there is room again ([`Shrink`]).
//!
//! memproxy's caches (conversation state, recall indexes, users' long-term memory, receipts)
//! fill up by design. When the process nears its memory budget, the guard
//! (`memory_guard.rs` in the edge) lowers their limits, down to a floor, before it refuses
//! any request memory, and lifts them as the RSS falls.

use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use crate::heap;

/// The weight of an entry in bytes, as the cache's weigher reports it.
pub type Weigher<K, V> = Arc<dyn Fn(&K, &V) -> u32 + Send + Sync>;

/// The share of a cache's capacity it is never shrunk below: the conversations and users in
/// use right now stay cached.
pub const FLOOR_DIVISOR: u64 = 8;

/// A cache that can give memory back: what the memory guard sees of each cache.
pub trait Shrink: Send + Sync {
    /// The `cache` label of its metrics.
    fn name(&self) -> &'static str;
    /// The bytes its entries weigh now.
    fn weighted_bytes(&self) -> u64;
    /// Its size, the limit it is held to and what was evicted to hold it there.
    fn limits(&self) -> &Limit;
    /// Evicts what it holds, least recently used first, until it weighs at most `target`
    /// bytes; returns the bytes evicted.
    fn evict_to(&self, target: u64) -> u64;

    /// Its configured size in bytes.
    fn capacity(&self) -> u64 {
        self.limits().capacity
    }
    /// The limit it is held to now: its capacity, or less after [`Shrink::limit_to`].
    fn limit(&self) -> u64 {
        self.limits().limit.load(Ordering::Relaxed)
    }
    /// Holds the cache to `limit` bytes (never under its floor, [`FLOOR_DIVISOR`]th of its
    /// capacity, never over its capacity), evicting what is over it now; returns the bytes
    /// evicted.
    fn limit_to(&self, limit: u64) -> u64 {
        let limits = self.limits();
        let limit = limit.clamp(limits.capacity / FLOOR_DIVISOR, limits.capacity);
        limits.limit.store(limit, Ordering::Relaxed);
        let freed = self.evict_to(limit);
        limits.shrunk.fetch_add(freed, Ordering::Relaxed);
        freed
    }
    /// Bytes evicted by [`Shrink::limit_to`] since the start.
    fn shrunk_bytes(&self) -> u64 {
        self.limits().shrunk.load(Ordering::Relaxed)
    }
}

/// What every [`Shrink`] keeps alike: its size, the limit it is held to now, and the bytes
/// evicted to hold it there.
#[derive(Debug)]
pub struct Limit {
    capacity: u64,
    limit: AtomicU64,
    shrunk: AtomicU64,
}

impl Limit {
    /// A cache of `capacity` bytes, held to all of it.
    pub fn new(capacity: u64) -> Limit {
        Limit {
            capacity,
            limit: AtomicU64::new(capacity),
            shrunk: AtomicU64::new(0),
        }
    }
}

/// One cached value and its [`Stamp`].
struct Slot<V> {
    value: V,
    stamp: Arc<Stamp>,
}

/// When a cached value was last used (milliseconds after the cache's start), and the weight
/// the cache counts it at (what the weigher said when it was last put in).
#[derive(Debug)]
struct Stamp {
    used: AtomicU64,
    counted: AtomicU32,
}

impl Stamp {
    /// Used at `now`, not counted yet (the weigher counts it when the cache takes it).
    fn new(now: u64) -> Arc<Stamp> {
        Arc::new(Stamp {
            used: AtomicU64::new(now),
            counted: AtomicU32::new(0),
        })
    }
}

impl<V: Clone> Clone for Slot<V> {
    fn clone(&self) -> Self {
        Slot {
            value: self.value.clone(),
            stamp: Arc::clone(&self.stamp),
        }
    }
}

/// A cached value as [`Cache::get_held`] gave it, to be weighed again after a change
/// ([`Cache::reweigh`]).
pub struct Held<V> {
    value: V,
    stamp: Arc<Stamp>,
}

impl<V> Held<V> {
    pub fn value(&self) -> &V {
        &self.value
    }
}

/// [`Cache::reweigh`] puts a value back (for the cache to count its new weight) only when its
/// weight moved by more than this fraction of what the cache counts: a conversation that
/// grows by an exchange, or is trimmed by one as much as it grows, is not put back at every
/// commit (a fifth of a stored exchange's cache work, 1.6% of its CPU, was those puts).
const REWEIGH_SLACK: u32 = 16;

/// A cache bounded in bytes by a weigher, that can be held under a lower limit ([`Shrink`]).
pub struct Cache<K, V> {
    /// Keys hashed with foldhash, seeded per process (moka's default, SipHash, was most of
    /// hashing a conversation's key at each lookup).
    inner: moka::sync::Cache<K, Slot<V>, foldhash::fast::RandomState>,
    name: &'static str,
    limits: Limit,
    weigher: Weigher<K, V>,
    origin: Instant,
}

impl<K, V> std::fmt::Debug for Cache<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("name", &self.name)
            .field("limits", &self.limits)
            .field("entries", &self.inner.entry_count())
            .finish_non_exhaustive()
    }
}

/// How the cache picks what to evict when it is full by itself (moka's policies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// moka's default: TinyLFU admission, LRU eviction.
    TinyLfu,
    /// Plain least recently used.
    Lru,
}

impl<K, V> Cache<K, V>
where
    K: Hash + Eq + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// A cache named `name` (its metrics' label) of `capacity` bytes, each entry weighed by
    /// `weigher` plus what the stamp of its last use takes.
    pub fn new(
        name: &'static str,
        capacity: u64,
        policy: Policy,
        weigher: impl Fn(&K, &V) -> u32 + Send + Sync + 'static,
    ) -> Cache<K, V> {
        let weigher: Weigher<K, V> = Arc::new(weigher);
        let weigh = Arc::clone(&weigher);
        let mut builder = moka::sync::Cache::builder().max_capacity(capacity).weigher(
            move |key: &K, slot: &Slot<V>| {
                let weight = weigh(key, &slot.value).saturating_add(STAMP_BYTES);
                slot.stamp.counted.store(weight, Ordering::Relaxed);
                weight
            },
        );
        if policy == Policy::Lru {
            builder = builder.eviction_policy(moka::policy::EvictionPolicy::lru());
        }
        Cache {
            inner: builder.build_with_hasher(foldhash::fast::RandomState::default()),
            name,
            limits: Limit::new(capacity),
            weigher,
            origin: Instant::now(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The cached value, marked as used now.
    pub fn get(&self, key: &K) -> Option<V> {
        self.get_held(key).map(|held| held.value)
    }

    /// [`Cache::get`], with what [`Cache::reweigh`] needs once the value has changed.
    pub fn get_held(&self, key: &K) -> Option<Held<V>> {
        let slot = self.inner.get(key)?;
        slot.stamp.used.store(self.now_ms(), Ordering::Relaxed);
        Some(Held {
            value: slot.value,
            stamp: slot.stamp,
        })
    }

    /// After `held` (cached under `key`) changed in place: puts it back, for the cache to
    /// count its new weight, when that moved by more than a [`REWEIGH_SLACK`]th of what the
    /// cache counts (so the cache may count an entry up to that much under its weight until
    /// the next reweighing); else leaves it as it is, evicted meanwhile or not.
    pub fn reweigh(&self, key: K, held: Held<V>) {
        let counted = held.stamp.counted.load(Ordering::Relaxed);
        let weight = (self.weigher)(&key, &held.value).saturating_add(STAMP_BYTES);
        if weight.abs_diff(counted) <= counted / REWEIGH_SLACK {
            return;
        }
        self.inner.insert(
            key,
            Slot {
                value: held.value,
                stamp: held.stamp,
            },
        );
    }

    /// Caches `value` under `key` (replacing what was there), marked as used now.
    pub fn insert(&self, key: K, value: V) {
        let stamp = Stamp::new(self.now_ms());
        self.inner.insert(key, Slot { value, stamp });
    }

    /// The value cached under `key`, or `make()` cached under it if there is none: two callers
    /// racing keep the first one inserted.
    pub fn get_or_insert_with(&self, key: K, make: impl FnOnce() -> V) -> V {
        let now = self.now_ms();
        let slot = self
            .inner
            .entry(key)
            .or_insert_with(|| Slot {
                value: make(),
                stamp: Stamp::new(now),
            })
            .into_value();
        slot.stamp.used.store(now, Ordering::Relaxed);
        slot.value
    }

    pub fn invalidate(&self, key: &K) {
        self.inner.invalidate(key);
    }

    pub fn invalidate_all(&self) {
        self.inner.invalidate_all();
    }

    /// Entries cached (after the pending evictions ran).
    pub fn entry_count(&self) -> u64 {
        self.inner.run_pending_tasks();
        self.inner.entry_count()
    }

    /// Bytes the entries weigh (after the pending evictions ran).
    pub fn weighted_size(&self) -> u64 {
        self.inner.run_pending_tasks();
        self.inner.weighted_size()
    }

    /// The cached keys and values, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (Arc<K>, V)> + '_ {
        self.inner.iter().map(|(key, slot)| (key, slot.value))
    }
}

/// What an entry's [`Stamp`] takes besides the value.
const STAMP_BYTES: u32 = heap::arc::<Stamp>() as u32;

impl<K, V> Shrink for Cache<K, V>
where
    K: Hash + Eq + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn weighted_bytes(&self) -> u64 {
        self.weighted_size()
    }

    fn limits(&self) -> &Limit {
        &self.limits
    }

    fn evict_to(&self, target: u64) -> u64 {
        self.inner.run_pending_tasks();
        let size = self.inner.weighted_size();
        if size <= target {
            return 0;
        }
        let mut entries: Vec<(u64, Arc<K>)> = self
            .inner
            .iter()
            .map(|(key, slot)| (slot.stamp.used.load(Ordering::Relaxed), key))
            .collect();
        entries.sort_unstable_by_key(|(used, _)| *used);
        let mut freed = 0u64;
        for (_, key) in entries {
            if size.saturating_sub(freed) <= target {
                break;
            }
            if let Some(slot) = self.inner.remove(&*key) {
                let weight = (self.weigher)(&key, &slot.value).saturating_add(STAMP_BYTES);
                freed += u64::from(weight);
            }
        }
        self.inner.run_pending_tasks();
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(capacity: u64) -> Cache<u32, Arc<Vec<u8>>> {
        Cache::new("test", capacity, Policy::Lru, |_k, v: &Arc<Vec<u8>>| {
            v.len() as u32
        })
    }

    fn weight(n: usize) -> u64 {
        n as u64 + u64::from(STAMP_BYTES)
    }

    #[test]
    fn shrinking_evicts_the_least_recently_used_first_down_to_the_limit() {
        // Its floor: 4 entries.
        let c = cache(FLOOR_DIVISOR * 4 * weight(1000));
        for k in 0..10u32 {
            c.insert(k, Arc::new(vec![0; 1000]));
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        // 0 and 1 used again: now the most recent.
        assert!(c.get(&0).is_some());
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(c.get(&1).is_some());
        assert_eq!(c.weighted_size(), 10 * weight(1000));
        let freed = c.limit_to(4 * weight(1000));
        assert_eq!(freed, 6 * weight(1000));
        assert_eq!(c.weighted_size(), 4 * weight(1000));
        let kept: Vec<u32> = (0..10).filter(|k| c.get(k).is_some()).collect();
        assert_eq!(kept, vec![0, 1, 8, 9]);
        assert_eq!(c.shrunk_bytes(), 6 * weight(1000));
        assert_eq!(c.limit(), 4 * weight(1000));
    }

    #[test]
    fn the_limit_stays_between_the_floor_and_the_capacity() {
        let c = cache(8000);
        c.limit_to(0);
        assert_eq!(c.limit(), 1000);
        c.limit_to(u64::MAX);
        assert_eq!(c.limit(), 8000);
        // Under its limit already: nothing evicted.
        c.insert(1, Arc::new(vec![0; 100]));
        assert_eq!(c.limit_to(5000), 0);
        assert!(c.get(&1).is_some());
    }

    #[test]
    fn a_changed_value_is_counted_again_once_its_weight_moved_past_the_slack() {
        let c: Cache<u32, Arc<AtomicU32>> =
            Cache::new("test", 1 << 20, Policy::Lru, |_k, v: &Arc<AtomicU32>| {
                v.load(Ordering::Relaxed)
            });
        let value = Arc::new(AtomicU32::new(1000));
        c.insert(1, Arc::clone(&value));
        assert_eq!(c.weighted_size(), weight(1000));
        let counted = weight(1000) as u32;
        let reweighed = |to: u32| {
            value.store(to, Ordering::Relaxed);
            let held = c.get_held(&1).unwrap();
            assert!(Arc::ptr_eq(held.value(), &value));
            c.reweigh(1, held);
            c.weighted_size()
        };
        // Within a sixteenth of what is counted, either way: left as counted.
        let slack = counted / REWEIGH_SLACK;
        assert_eq!(reweighed(1000 + slack), weight(1000));
        assert_eq!(reweighed(1000 - slack), weight(1000));
        // Past it: counted again, and the next change is measured from there.
        assert_eq!(
            reweighed(1000 + slack + 1),
            weight(1000 + slack as usize + 1)
        );
        assert_eq!(reweighed(500), weight(500));
        assert_eq!(reweighed(510), weight(500));
        // Still the one entry, never a second.
        assert_eq!(c.entry_count(), 1);
    }

    #[test]
    fn the_first_of_two_racing_inserts_is_kept() {
        let c = cache(1 << 20);
        let first = c.get_or_insert_with(7, || Arc::new(vec![1]));
        let second = c.get_or_insert_with(7, || Arc::new(vec![2]));
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(c.entry_count(), 1);
        c.invalidate(&7);
        assert_eq!(c.entry_count(), 0);
    }
}
