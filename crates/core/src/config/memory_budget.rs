//! `server.memory_budget`: the memory the whole process may take (its RSS), and how it is
//! shared out. Sizing a sidecar is then one number, the pod's limit less a margin (README,
//! "Sizing the sidecar").
//!
//! The split ([`split`]): the process itself first, [`PROCESS_BASE`] (binary, runtime,
//! threads and connections, the tokenizer's tables, and what the allocator keeps under load),
//! and the
//! embedder's table or model (`[embedding]`: [`STATIC_EMBEDDER_BYTES`] for the default static
//! table, [`CONTEXTUAL_EMBEDDER_BYTES`] for the full model, nothing for the provider's or none;
//! the table below is without one); of the rest, in eighths,
//!
//! | share | eighths | at the default 192 MiB |
//! |---|---|---|
//! | conversation state cache (`storage.state_cache_bytes`) | 1 | 16 MiB |
//! | sled page cache (`storage.cache_bytes`) | 1 | 16 MiB |
//! | the storage engine's own memory beyond its cache | 2 | 32 MiB |
//! | recall indexes (`storage.recall_cache_bytes`) | 2 | 32 MiB |
//! | requests in flight, allocator slack | 2 | 32 MiB |
//!
//! Receipts (`receipts.max_bytes`) take a quarter of the requests' two eighths (8 MiB at the
//! default): a receipt is what a request held (the body it forwarded, the prompt's parts),
//! kept a little longer. A size set explicitly may take up to half of those two eighths.
//!
//! sled's memory is not bounded by its page cache: its page table (an entry for every page, and
//! where each paged-out page's fragments lie in the log) grows with what is stored, about 6
//! bytes a message ([`STORE_BYTES_PER_MESSAGE`]), and up to about four times that where the
//! embedder's vectors are stored beside the messages ([`StoreGrowth`]), so it gets a reserve
//! of its own. With Redis (no sled in the process) those shares go to the recall indexes and
//! to requests in flight ([`split_for`]).
//!
//! The caches are full in a steady state, by design; what requests in flight take comes and
//! goes. So admission (`memory_guard.rs`) stops giving new chat requests memory once the RSS
//! reaches the high-water mark, one eighth of the rest below the budget (176 MiB at the
//! default): the requests already admitted and the degraded ones (forwarded untouched) still
//! have room under the budget.
//!
//! A cache size set explicitly wins over its share, but the three caches together may take
//! at most their four eighths: more would leave requests no room, so the config is refused,
//! with the sizes and the budget named.

/// sled's own memory beyond its page cache grows with what is stored: about 6 bytes per stored
/// message past a base of about 16 MiB (measured with `examples/store_growth.rs`, the default
/// 16 MiB page cache, 20,000 conversations of exchanges the soak's size, release build of
/// 9c0c449, 2026-12-07: over the opened store and its full page cache, 19.5 MiB at 500,000
/// messages, 20.1 at a million, 29.2 at 2 million, 37.8 at 3 million, 40.7 at 4 million),
/// rounded up to 10 bytes and 15 MiB so the line is over every point measured (by 0.3 MiB at
/// 500,000, the closest) and a 128 MiB budget's reserve (16 MiB) holds a small store. It was
/// 16 bytes past 14 MiB before memproxy's copy of sled let a leaf hold up to 64 small keys
/// instead of 16 (fewer pages, a smaller page table: 40.4 MiB at 2 million), and 56 bytes
/// before the page cache's accounting was made prompt (`vendor/sled`, vendor/README.md): most
/// of that was pages read back and held past the cache's capacity.
/// [`StoreGrowth::MESSAGES`] adds [`STORE_BASE_BYTES`].
pub const STORE_BYTES_PER_MESSAGE: u64 = 10;

/// What sled takes beyond its page cache before that growth (same measurement).
pub const STORE_BASE_BYTES: u64 = 15 * MIB;

/// What a stored message takes on sled's disk, at least (same measurement: 321 MiB at 500,000
/// messages, 673 bytes each, 987 at 2 million, 1,405 at 4 million: sled's log keeps what was
/// rewritten until it is cleaned; rounded down, so a store's messages are not undercounted):
/// how [`messages_on_disk`] tells a store's messages from its size, where the store cannot be
/// opened to count them (`check-config`, beside a running memproxy that holds its lock).
pub const STORE_DISK_BYTES_PER_MESSAGE: u64 = 600;

/// What a stored vector adds to sled's memory beyond its page cache, a message: each is a key
/// of its own in the `vectors` tree beside its message, so a store whose embedder's vectors are
/// stored (the contextual model's, the provider's) has about twice the keys of one without, and
/// a larger page table. A leaf of small values holds up to 64 keys, but one of large values
/// splits past 16 keys as before (vendor/README.md), so the large vectors cost the most.
/// Measured as [`STORE_BYTES_PER_MESSAGE`] (9c0c449's build); past the page cache, with
/// `--vector-dims 1536` (the provider's `text-embedding-3-small`) 29.2 MiB at 500,000 messages,
/// 44.3 at a million, 53.5 at 1.5 million, 65.9 at 2 million, 81.5 at 2.5 million; with 384
/// (the contextual model's) 24.5, 30.1, 40.1, 43.7, 52.3 and 57.9 at 3 million. With
/// [`STORE_VECTORS_BASE_BYTES`], 28 bytes a message past 18 MiB in all, over every point (by
/// 0.4 MiB at a million with 1536 dimensions, the closest). It was 16 past 8 MiB more before the
/// fuller leaves: 32 bytes a message past 22 MiB.
pub const STORE_BYTES_PER_VECTOR: u64 = 18;

/// What the `vectors` tree adds to [`STORE_BASE_BYTES`] (same measurement).
pub const STORE_VECTORS_BASE_BYTES: u64 = 3 * MIB;

/// How sled's memory beyond its page cache grows with what is stored: the store's share of the
/// budget ([`MemoryBudget::engine_need`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreGrowth {
    /// Before the first message.
    pub base: u64,
    /// Each stored message.
    pub per_message: u64,
}

impl StoreGrowth {
    /// Messages alone: no embedder, or the static table's vectors (derived from the texts when
    /// an index is built, never stored).
    pub const MESSAGES: StoreGrowth = StoreGrowth {
        base: STORE_BASE_BYTES,
        per_message: STORE_BYTES_PER_MESSAGE,
    };

    /// Each message with its vector stored beside it (`[embedding] embedder = "contextual"` or
    /// `"upstream"`).
    pub const WITH_VECTORS: StoreGrowth = StoreGrowth {
        base: STORE_BASE_BYTES + STORE_VECTORS_BASE_BYTES,
        per_message: STORE_BYTES_PER_MESSAGE + STORE_BYTES_PER_VECTOR,
    };

    /// The growth of a store whose embedder stores its vectors (`stores_vectors`) or not.
    pub fn of(stores_vectors: bool) -> StoreGrowth {
        if stores_vectors {
            StoreGrowth::WITH_VECTORS
        } else {
            StoreGrowth::MESSAGES
        }
    }

    /// What sled takes in memory beyond its page cache for a store of `messages` messages.
    pub fn need(self, messages: u64) -> u64 {
        self.base
            .saturating_add(messages.saturating_mul(self.per_message))
    }
}

/// About how many messages a sled store of `bytes` on disk holds.
pub fn messages_on_disk(bytes: u64) -> u64 {
    bytes / STORE_DISK_BYTES_PER_MESSAGE
}

impl MemoryBudget {
    /// What sled takes in memory beyond its page cache for a store of `messages` messages,
    /// with or without its vectors as the embedder stores them ([`MemoryBudget::store_growth`]).
    pub fn engine_need(&self, messages: u64) -> u64 {
        self.store_growth.need(messages)
    }

    /// What the store's memory needs beyond the reserve the split gave it, for a sled store of
    /// `messages` messages (0 with Redis, or when the reserve covers it): the caches give it
    /// up (`memory_guard.rs` holds them that much lower).
    pub fn store_overdraft(&self, messages: u64) -> u64 {
        if self.engine_reserve == 0 {
            return 0;
        }
        self.engine_need(messages)
            .saturating_sub(self.engine_reserve)
    }

    /// The smallest budget whose split gives sled's memory beyond its page cache room for a
    /// store of `messages` messages with this budget's embedder (its resident bytes, and
    /// whether its vectors are stored), rounded up to a MiB (never under the minimum for it).
    pub fn budget_for_messages(&self, messages: u64) -> u64 {
        let need = self.engine_need(messages);
        // The reserve is ENGINE_EIGHTHS eighths of what is past the process base and the
        // embedder.
        let total = (PROCESS_BASE + self.embedder)
            .saturating_add(need.saturating_mul(8).div_ceil(ENGINE_EIGHTHS));
        total
            .div_ceil(MIB)
            .saturating_mul(MIB)
            .max(MIN_MEMORY_BUDGET + self.embedder)
    }
}

/// The embedder's memory, resident from start: the default static table (int8 rows, 7.6 MiB,
/// and the tokenizer; +16.4 MiB RSS measured with `memproxy-embed`'s `embed_cost` example).
pub const STATIC_EMBEDDER_BYTES: u64 = 17 * MIB;

/// The full model's: +54.2 MiB RSS measured the same way with its weights as bf16 (+47.0 on
/// AMX, +36.2 with int8 weights on AVX-512 VNNI), and the tokenizer, and about 4 MiB for each
/// of two threads' forward passes over 256 word pieces (the activations of one text at a time:
/// queries, keys, values and the wide layer; the scratch of two passes of 64 pieces or fewer,
/// 1.1 to 2.6 MiB each by the buffers' sizes, is kept for the next within that).
pub const CONTEXTUAL_EMBEDDER_BYTES: u64 = 63 * MIB;

/// The smallest budget accepted without an embedder: the process base and 32 MiB to share (an
/// embedder adds its own bytes).
pub const MIN_MEMORY_BUDGET: u64 = PROCESS_BASE + 32 * MIB;

/// What the process takes apart from its caches and its requests' own bytes. Idle, 28 MiB
/// (RSS, embedder off, sled; 20.7 MiB of it the binary's pages) since `o200k_base` is held
/// compact (`memproxy_base::tokens::Lean`; 57 MiB before). Under the soak's load (16 clients,
/// `loadbench --soak`) the heap in use past the caches and the reservations grows by about
/// 30 MiB more (`memproxy_allocator_bytes`: up to 45 threads, their allocator caches, the
/// connections' buffers), and the allocator keeps a few MiB free: the base keeps room for both.
pub const PROCESS_BASE: u64 = 64 * MIB;

const MIB: u64 = 1024 * 1024;

/// Eighths of the budget past [`PROCESS_BASE`] each cache takes, and the storage engine's
/// memory beyond its cache; requests in flight take the rest (2).
const STATE_EIGHTHS: u64 = 1;
const STORE_EIGHTHS: u64 = 1;
const ENGINE_EIGHTHS: u64 = 2;
const RECALL_EIGHTHS: u64 = 2;

/// The budget, its high-water mark and the cache sizes taken from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    /// `server.memory_budget`, in bytes.
    pub total: u64,
    /// RSS from which new chat requests are served with memory off.
    pub high_water: u64,
    /// `storage.state_cache_bytes`: explicit, or the share.
    pub state_cache: u64,
    /// `storage.cache_bytes` (sled's page cache): explicit, or the share.
    pub store_cache: u64,
    /// `storage.recall_cache_bytes`: explicit, or the share.
    pub recall_cache: u64,
    /// Left for the storage engine's memory beyond its page cache (sled's page table and
    /// write buffers, which grow with what is stored).
    pub engine_reserve: u64,
    /// `receipts.max_bytes`: explicit, or the share (0 with receipts off).
    pub receipts: u64,
    /// The embedder's table or model, taken before the split (0: none, or the provider's).
    pub embedder: u64,
    /// How the storage engine's memory beyond its page cache grows with what is stored (with
    /// the embedder's vectors when they are stored).
    pub store_growth: StoreGrowth,
}

impl MemoryBudget {
    /// What the budget leaves for requests in flight once the process and the caches have
    /// their part.
    pub fn in_flight(&self) -> u64 {
        self.total
            .saturating_sub(PROCESS_BASE + self.embedder)
            .saturating_sub(self.state_cache + self.store_cache + self.recall_cache)
            .saturating_sub(self.engine_reserve)
            .saturating_sub(self.receipts)
    }
}

/// The cache sizes set explicitly in `[storage]` (`None`: take the share).
#[derive(Debug, Clone, Copy, Default)]
pub struct ExplicitCaches {
    pub state: Option<u64>,
    pub store: Option<u64>,
    pub recall: Option<u64>,
}

/// The receipts' share: a quarter of what requests in flight would have.
fn receipts_share(budget: &MemoryBudget) -> u64 {
    budget.in_flight() / 4
}

/// Where the store lives, which the budget is split for (the storage trait is `store::Engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreResidence {
    /// sled, in the process: its page cache and its own memory take their shares.
    Embedded,
    /// Redis, another process: the sled shares go to the recall indexes (two eighths) and to
    /// requests in flight (one).
    Remote,
}

/// The split of `total` with no cache size set explicitly (sled).
pub fn split(total: u64) -> MemoryBudget {
    split_for(total, StoreResidence::Embedded)
}

/// The split of `total` for `engine`, with no cache size set explicitly and no embedder.
pub fn split_for(total: u64, engine: StoreResidence) -> MemoryBudget {
    split_with(total, engine, 0)
}

/// The split of `total` for `engine` and an embedder of `embedder` bytes, with no cache size
/// set explicitly.
pub fn split_with(total: u64, engine: StoreResidence, embedder: u64) -> MemoryBudget {
    let eighth = total.saturating_sub(PROCESS_BASE + embedder) / 8;
    let embedded = MemoryBudget {
        total,
        high_water: total - eighth,
        state_cache: STATE_EIGHTHS * eighth,
        store_cache: STORE_EIGHTHS * eighth,
        recall_cache: RECALL_EIGHTHS * eighth,
        engine_reserve: ENGINE_EIGHTHS * eighth,
        receipts: 0,
        embedder,
        store_growth: StoreGrowth::MESSAGES,
    };
    let embedded = MemoryBudget {
        receipts: receipts_share(&embedded),
        ..embedded
    };
    match engine {
        StoreResidence::Embedded => embedded,
        StoreResidence::Remote => {
            let remote = MemoryBudget {
                store_cache: 0,
                engine_reserve: 0,
                recall_cache: (RECALL_EIGHTHS + 2) * eighth,
                receipts: 0,
                ..embedded
            };
            MemoryBudget {
                receipts: receipts_share(&remote),
                ..remote
            }
        }
    }
}

/// The embedder (`[embedding]`) as the budget sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Embedder<'a> {
    /// Its name in `embedding.embedder`.
    pub name: &'a str,
    /// What it keeps resident, taken before the split.
    pub resident: u64,
    /// Whether its vectors are stored beside the messages ([`StoreGrowth::WITH_VECTORS`]).
    pub stores_vectors: bool,
}

/// Checks the budget and the explicit cache sizes against it; a problem for a budget under
/// [`MIN_MEMORY_BUDGET`] (and the embedder's resident bytes) and for caches that together take more
/// than their part.
pub(super) fn check_budget(
    total: u64,
    engine: StoreResidence,
    embedder: Embedder<'_>,
    explicit: ExplicitCaches,
    problems: &mut Vec<String>,
) -> MemoryBudget {
    let store_growth = StoreGrowth::of(embedder.stores_vectors);
    let (embedder_name, embedder) = (embedder.name, embedder.resident);
    let minimum = MIN_MEMORY_BUDGET + embedder;
    if total < minimum {
        let with = if embedder > 0 {
            format!(
                " and the {embedder_name} embedder {} MiB; or set [embedding] embedder = \"off\" or \"upstream\"",
                embedder / MIB
            )
        } else {
            String::new()
        };
        problems.push(format!(
            "server.memory_budget: {} MiB is too small: at least {} MiB (the process itself takes about {} MiB{with})",
            total / MIB,
            minimum / MIB,
            PROCESS_BASE / MIB
        ));
        return MemoryBudget {
            store_growth,
            ..split_with(minimum, engine, embedder)
        };
    }
    let shares = split_with(total, engine, embedder);
    let budget = MemoryBudget {
        store_growth,
        state_cache: explicit.state.unwrap_or(shares.state_cache),
        store_cache: explicit.store.unwrap_or(shares.store_cache),
        recall_cache: explicit.recall.unwrap_or(shares.recall_cache),
        ..shares
    };
    let caches = budget.state_cache + budget.store_cache + budget.recall_cache;
    // The caches may take together what their shares add up to.
    let room = shares.state_cache + shares.store_cache + shares.recall_cache;
    if caches > room {
        problems.push(format!(
            "storage: the caches take {} MiB (state_cache_bytes {} + cache_bytes {} + recall_cache_bytes {}), more than the {} MiB server.memory_budget = {} MiB leaves them; lower them, leave them unset to take their shares, or raise the budget",
            caches / MIB,
            budget.state_cache / MIB,
            budget.store_cache / MIB,
            budget.recall_cache / MIB,
            room / MIB,
            total / MIB
        ));
    }
    budget
}

/// Sets the receipts' part of `budget` (`receipts`: `[receipts]` as checked, `explicit`: its
/// `max_bytes` when set): nothing with receipts off, else the size set or the share; a size
/// past half of what requests in flight and receipts have together is a problem.
pub(super) fn apply_receipts(
    budget: &mut MemoryBudget,
    receipts: &mut super::ReceiptsConfig,
    explicit: Option<u64>,
    problems: &mut Vec<String>,
) {
    let room = (budget.in_flight() + budget.receipts) / 2;
    if !receipts.enabled {
        budget.receipts = 0;
    } else if let Some(bytes) = explicit {
        if bytes > room {
            problems.push(format!(
                "receipts.max_bytes: {} MiB is more than the {} MiB server.memory_budget = {} MiB leaves receipts; lower it or raise the budget",
                bytes / MIB,
                room / MIB,
                budget.total / MIB
            ));
        } else {
            budget.receipts = bytes;
        }
    }
    receipts.max_bytes = budget.receipts;
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: Embedder<'static> = Embedder {
        name: "off",
        resident: 0,
        stores_vectors: false,
    };
    const STATIC: Embedder<'static> = Embedder {
        name: "static",
        resident: STATIC_EMBEDDER_BYTES,
        stores_vectors: false,
    };
    const CONTEXTUAL: Embedder<'static> = Embedder {
        name: "contextual",
        resident: CONTEXTUAL_EMBEDDER_BYTES,
        stores_vectors: true,
    };
    const UPSTREAM: Embedder<'static> = Embedder {
        name: "upstream",
        resident: 0,
        stores_vectors: true,
    };

    fn check(total: u64, explicit: ExplicitCaches) -> (MemoryBudget, Vec<String>) {
        check_with(total, NONE, explicit)
    }

    /// [`check_budget`] of an embedded store with `embedder`.
    fn check_with(
        total: u64,
        embedder: Embedder<'_>,
        explicit: ExplicitCaches,
    ) -> (MemoryBudget, Vec<String>) {
        let mut problems = Vec::new();
        let budget = check_budget(
            total,
            StoreResidence::Embedded,
            embedder,
            explicit,
            &mut problems,
        );
        (budget, problems)
    }

    #[test]
    fn the_store_reserve_follows_what_is_stored() {
        // An empty store fits the default budget's reserve (32 MiB).
        let budget = split(192 * MIB);
        assert_eq!(budget.store_overdraft(0), 0);
        assert_eq!(budget.store_overdraft(200_000), 0);
        assert_eq!(budget.store_overdraft(1_500_000), 0);
        // Four million messages need 15 MiB + 40 MB: 21 MiB more than the reserve.
        assert_eq!(budget.engine_need(4_000_000), 15 * MIB + 40_000_000);
        assert_eq!(
            budget.store_overdraft(4_000_000),
            15 * MIB + 40_000_000 - 32 * MIB
        );
        // With Redis there is no sled in the process.
        assert_eq!(
            split_for(192 * MIB, StoreResidence::Remote).store_overdraft(10_000_000),
            0
        );
        // The budget whose reserve covers it.
        let needed = budget.budget_for_messages(1_000_000);
        assert_eq!(split(needed).store_overdraft(1_000_000), 0);
        assert!(split(needed - MIB).store_overdraft(1_000_000) > 0);
        // An empty store: sled's base alone, two eighths of 60 MiB.
        assert_eq!(budget.budget_for_messages(0), 124 * MIB);
        // The static embedder comes first.
        let table = split_with(192 * MIB, StoreResidence::Embedded, STATIC_EMBEDDER_BYTES);
        let with_table = table.budget_for_messages(1_000_000);
        assert_eq!(with_table, needed + STATIC_EMBEDDER_BYTES);
        let split = split_with(with_table, StoreResidence::Embedded, STATIC_EMBEDDER_BYTES);
        assert_eq!(split.store_overdraft(1_000_000), 0);
        assert_eq!(messages_on_disk(600 * 1000), 1000);
    }

    #[test]
    fn a_store_with_its_vectors_gets_the_reserve_they_need() {
        let checked = |kind| {
            let (budget, problems) = check_with(256 * MIB, kind, ExplicitCaches::default());
            assert!(problems.is_empty(), "{problems:?}");
            budget
        };
        // The static table's vectors are derived, not stored; none without an embedder.
        for embedder in [STATIC, NONE] {
            assert_eq!(checked(embedder).store_growth, StoreGrowth::MESSAGES);
        }
        for kind in [CONTEXTUAL, UPSTREAM] {
            let budget = checked(kind);
            assert_eq!(budget.store_growth, StoreGrowth::WITH_VECTORS);
            let messages = 4_000_000;
            assert_eq!(
                budget.engine_need(messages),
                STORE_BASE_BYTES
                    + STORE_VECTORS_BASE_BYTES
                    + messages * (STORE_BYTES_PER_MESSAGE + STORE_BYTES_PER_VECTOR)
            );
            let without = MemoryBudget {
                store_growth: StoreGrowth::MESSAGES,
                ..budget
            };
            assert!(budget.store_overdraft(messages) > without.store_overdraft(messages));
            // The budget it names covers the store with its vectors, and a MiB less does not.
            let needed = budget.budget_for_messages(messages);
            assert!(needed > without.budget_for_messages(messages));
            let at = |total| MemoryBudget {
                store_growth: StoreGrowth::WITH_VECTORS,
                ..split_with(total, StoreResidence::Embedded, kind.resident)
            };
            assert_eq!(at(needed).store_overdraft(messages), 0);
            assert!(at(needed - MIB).store_overdraft(messages) > 0);
        }
        // Even too small a budget keeps the growth of its embedder.
        let (small, problems) = check_with(64 * MIB, CONTEXTUAL, ExplicitCaches::default());
        assert_eq!(problems.len(), 1);
        assert_eq!(small.store_growth, StoreGrowth::WITH_VECTORS);
    }

    #[test]
    fn the_default_budget_is_split_as_documented() {
        let budget = split(192 * MIB);
        assert_eq!(
            budget,
            MemoryBudget {
                total: 192 * MIB,
                high_water: 176 * MIB,
                state_cache: 16 * MIB,
                store_cache: 16 * MIB,
                recall_cache: 32 * MIB,
                engine_reserve: 32 * MIB,
                receipts: 8 * MIB,
                embedder: 0,
                store_growth: StoreGrowth::MESSAGES,
            }
        );
        assert_eq!(budget.in_flight(), 24 * MIB);
    }

    #[test]
    fn every_budget_adds_up_and_keeps_the_high_water_under_it() {
        for total_mib in [96, 97, 128, 192, 256, 300, 512, 1024, 4096, 65_536] {
            let total = total_mib * MIB;
            let budget = split(total);
            let parts = PROCESS_BASE
                + budget.state_cache
                + budget.store_cache
                + budget.recall_cache
                + budget.engine_reserve
                + budget.receipts
                + budget.in_flight();
            assert_eq!(parts, total, "{total_mib} MiB");
            assert!(budget.high_water < total, "{total_mib} MiB");
            // The high-water mark is above the process and its full caches.
            assert!(
                budget.high_water
                    > PROCESS_BASE
                        + budget.state_cache
                        + budget.store_cache
                        + budget.recall_cache
                        + budget.engine_reserve,
                "{total_mib} MiB"
            );
            assert_eq!(check(total, ExplicitCaches::default()), (budget, vec![]));
        }
    }

    #[test]
    fn explicit_sizes_win_within_the_caches_part() {
        let explicit = ExplicitCaches {
            state: Some(8 * MIB),
            store: None,
            recall: Some(40 * MIB),
        };
        let (budget, problems) = check(192 * MIB, explicit);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(budget.state_cache, 8 * MIB);
        assert_eq!(budget.store_cache, 16 * MIB);
        assert_eq!(budget.recall_cache, 40 * MIB);
        assert_eq!(budget.high_water, 176 * MIB);
    }

    #[test]
    fn explicit_sizes_past_the_budget_are_refused_with_the_numbers() {
        // The sizes of the earlier defaults (64 + 64 + 256 MiB) under the default budget.
        let explicit = ExplicitCaches {
            state: Some(64 * MIB),
            store: Some(64 * MIB),
            recall: Some(256 * MIB),
        };
        let (_, problems) = check(192 * MIB, explicit);
        assert_eq!(problems.len(), 1, "{problems:?}");
        for needle in ["384 MiB", "64 MiB", "server.memory_budget = 192 MiB"] {
            assert!(problems[0].contains(needle), "{needle}: {}", problems[0]);
        }
        // The same sizes fit a budget big enough.
        assert!(check(1024 * MIB, explicit).1.is_empty());
        // And the caches' part is four eighths of the rest: 64 MiB at the default.
        let within = ExplicitCaches {
            state: Some(16 * MIB),
            store: Some(16 * MIB),
            recall: Some(33 * MIB),
        };
        assert_eq!(check(192 * MIB, within).1.len(), 1);
    }

    #[test]
    fn with_redis_the_sled_shares_go_to_recall_and_requests() {
        let budget = split_for(192 * MIB, StoreResidence::Remote);
        assert_eq!(
            (
                budget.state_cache,
                budget.store_cache,
                budget.recall_cache,
                budget.engine_reserve,
                budget.high_water
            ),
            (16 * MIB, 0, 64 * MIB, 0, 176 * MIB)
        );
        assert_eq!((budget.receipts, budget.in_flight()), (12 * MIB, 36 * MIB));
        let mut problems = Vec::new();
        assert_eq!(
            check_budget(
                192 * MIB,
                StoreResidence::Remote,
                NONE,
                ExplicitCaches::default(),
                &mut problems
            ),
            budget
        );
        assert!(problems.is_empty());
    }

    #[test]
    fn receipts_take_their_share_or_the_size_set_within_half_the_requests_part() {
        let config = |enabled| super::super::ReceiptsConfig {
            enabled,
            retention: std::time::Duration::from_secs(900),
            max_bytes: 0,
        };
        let mut problems = Vec::new();
        let mut budget = split(192 * MIB);
        let mut receipts = config(true);
        apply_receipts(&mut budget, &mut receipts, None, &mut problems);
        assert_eq!(receipts.max_bytes, 8 * MIB);
        apply_receipts(&mut budget, &mut receipts, Some(16 * MIB), &mut problems);
        assert_eq!(
            (receipts.max_bytes, budget.in_flight()),
            (16 * MIB, 16 * MIB)
        );
        assert!(problems.is_empty());
        apply_receipts(&mut budget, &mut receipts, Some(17 * MIB), &mut problems);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("receipts.max_bytes"),
            "{}",
            problems[0]
        );
        let mut off = config(false);
        let mut budget = split(192 * MIB);
        apply_receipts(&mut budget, &mut off, None, &mut Vec::new());
        assert_eq!((off.max_bytes, budget.in_flight()), (0, 32 * MIB));
    }

    #[test]
    fn a_budget_under_the_minimum_is_refused() {
        let (budget, problems) = check(64 * MIB, ExplicitCaches::default());
        assert_eq!(problems.len(), 1);
        assert!(problems[0].contains("at least 96 MiB"), "{}", problems[0]);
        assert_eq!(budget, split(MIN_MEMORY_BUDGET));
    }

    #[test]
    fn the_embedder_is_taken_before_the_split_and_raises_the_minimum() {
        let mut problems = Vec::new();
        let budget = check_budget(
            192 * MIB,
            StoreResidence::Embedded,
            STATIC,
            ExplicitCaches::default(),
            &mut problems,
        );
        assert!(problems.is_empty(), "{problems:?}");
        // (192 − 64 − 17) / 8 = 13.875 MiB an eighth.
        let eighth = (192 - 64 - 17) * MIB / 8;
        assert_eq!(
            (budget.embedder, budget.state_cache, budget.high_water),
            (STATIC_EMBEDDER_BYTES, eighth, 192 * MIB - eighth)
        );
        assert_eq!(
            PROCESS_BASE
                + budget.embedder
                + budget.state_cache
                + budget.store_cache
                + budget.recall_cache
                + budget.engine_reserve
                + budget.receipts
                + budget.in_flight(),
            192 * MIB
        );
        // The full model fits the default budget, not the static table's minimum.
        let mut problems = Vec::new();
        check_budget(
            192 * MIB,
            StoreResidence::Embedded,
            CONTEXTUAL,
            ExplicitCaches::default(),
            &mut problems,
        );
        assert!(problems.is_empty(), "{problems:?}");
        check_budget(
            113 * MIB,
            StoreResidence::Embedded,
            CONTEXTUAL,
            ExplicitCaches::default(),
            &mut problems,
        );
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].contains("at least 159 MiB")
                && problems[0].contains("the contextual embedder 63 MiB"),
            "{}",
            problems[0]
        );
    }
}
