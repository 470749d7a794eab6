//! Reading a damaged sled store for salvage (`salvage.rs`): whatever sled can still read,
//! record by record, around the parts it cannot.
//!
//! Always on a copy: sled writes to its files as it opens them (see `sled_engine.rs`: a
//! damaged record in the log it replays is taken for the log's end and the rest of that
//! segment overwritten).
//!
//! - **Open.** First as memproxy does. If sled refuses (its snapshot says the log went further
//!   than the damage lets it read) or panics, the snapshot files of the copy are removed and it
//!   is opened again: sled then replays its whole log from the start and keeps what precedes
//!   the first damaged record, and nothing after it.
//! - **Read.** A scan of a tree stops at the first page sled cannot read (sled's iterator
//!   then repeats the error forever). So every walk here goes forwards until an error and
//!   backwards until an error; the records of a conversation are read by key, which fails only
//!   for the keys kept in a damaged page.

use std::collections::BTreeMap;
use std::path::Path;

use super::StoreError;
use super::layout::{decode, decode_batch, message_key, turn_of};
use super::records::{ConversationMeta, OwnerMeta, StoredBranch, StoredMessage, TtlRecord};
use super::sled_engine::{Trees, first_holder, open_trees, read_branches};
use memproxy_base::identity::ConversationKey;

/// Turns read one by one, at most, for one conversation once its scan failed.
const MAX_PROBES: u64 = 1 << 20;

/// Summary numbers tried one by one after a failed scan, past the last one read.
const MAX_SUMMARY_PROBES: u64 = 1024;

/// A damaged sled store, open for reading.
pub struct SalvageReader {
    trees: Trees,
    /// How it was opened, when not as memproxy opens it.
    pub note: Option<String>,
}

/// A walk over a tree: what was read, and whether it read everything.
#[derive(Debug, Default)]
pub struct Walk<T> {
    pub records: Vec<T>,
    pub complete: bool,
}

/// The messages of one conversation that could be read.
#[derive(Debug, Default)]
pub struct Messages {
    pub read: Vec<StoredMessage>,
    /// The last turn whose record could not be read (or decoded), if any: messages before it
    /// may be missing.
    pub last_unreadable: Option<u64>,
    /// Records found but not decodable.
    pub undecodable: usize,
}

/// Every entry of `tree` sled can reach: forwards until an error, backwards until an error.
fn walk(tree: &sled::Tree) -> Walk<(sled::IVec, sled::IVec)> {
    let mut seen = BTreeMap::new();
    let mut complete = true;
    for item in tree.iter() {
        match item {
            Ok((key, value)) => {
                seen.insert(key, value);
            }
            Err(_) => {
                complete = false;
                break;
            }
        }
    }
    if !complete {
        for item in tree.iter().rev() {
            match item {
                Ok((key, value)) => {
                    seen.insert(key, value);
                }
                Err(_) => break,
            }
        }
    }
    Walk {
        records: seen.into_iter().collect(),
        complete,
    }
}

impl SalvageReader {
    /// Opens the copy of a sled store in `dir` (see the module documentation).
    pub fn open(dir: &Path) -> Result<SalvageReader, StoreError> {
        let config = sled::Config::new().path(dir).cache_capacity(16 << 20);
        let first = match open_trees(dir, &config) {
            Ok(trees) => return Ok(SalvageReader { trees, note: None }),
            Err(err) => err,
        };
        for entry in std::fs::read_dir(dir).map_err(StoreError::Disk)? {
            let path = entry.map_err(StoreError::Disk)?.path();
            if path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("snap."))
            {
                std::fs::remove_file(&path).map_err(StoreError::Disk)?;
            }
        }
        let trees = open_trees(dir, &config)?;
        Ok(SalvageReader {
            trees,
            note: Some(format!(
                "sled would not open the store ({first}); it was read without its snapshot: what its log holds before the first damaged record"
            )),
        })
    }

    /// Every conversation record sled can reach: the key bytes and the record (or `None` when
    /// it does not decode). Keys of TTL records are tried too, which finds conversations kept
    /// in a damaged stretch of the index that the walks could not pass.
    pub fn conversations(&self) -> Walk<(Vec<u8>, Option<ConversationMeta>)> {
        let mut found: BTreeMap<Vec<u8>, Option<ConversationMeta>> = BTreeMap::new();
        let index = walk(&self.trees.conversations);
        for (key, value) in &index.records {
            found.insert(key.to_vec(), decode(value).ok());
        }
        if !index.complete {
            for (key, _) in walk(&self.trees.ttl).records {
                if found.contains_key(key.as_ref()) {
                    continue;
                }
                if let Ok(Some(value)) = self.trees.conversations.get(&key) {
                    found.insert(key.to_vec(), decode(&value).ok());
                }
            }
        }
        Walk {
            records: found.into_iter().collect(),
            complete: index.complete,
        }
    }

    /// Every long-term owner record sled can reach: the owner key bytes and the record (or
    /// `None` when it does not decode).
    pub fn owners(&self) -> Walk<(Vec<u8>, Option<OwnerMeta>)> {
        let walked = walk(&self.trees.owners);
        Walk {
            records: walked
                .records
                .iter()
                .map(|(key, value)| (key.to_vec(), decode(value).ok()))
                .collect(),
            complete: walked.complete,
        }
    }

    /// Every owner's record sled can reach, as stored: (owner key bytes `\0` space id, value).
    pub fn owner_records(&self) -> Walk<(Vec<u8>, Vec<u8>)> {
        let walked = walk(&self.trees.owner_records);
        Walk {
            records: walked
                .records
                .iter()
                .map(|(key, value)| (key.to_vec(), value.to_vec()))
                .collect(),
            complete: walked.complete,
        }
    }

    /// The messages of conversation `id` (turns in `first_turn..next_turn`) that can be read.
    pub fn messages(&self, id: u64, first_turn: u64, next_turn: u64) -> Messages {
        let tree = &self.trees.messages;
        let mut out = Messages::default();
        // A value holds one turn or a batch from its key's on (`sled_engine.rs`).
        let keep = |out: &mut Messages, turn: u64, value: &[u8]| match decode_batch(value) {
            Ok(batch) => out.read.extend(
                batch
                    .into_iter()
                    .filter(|m| (first_turn..next_turn).contains(&m.turn)),
            ),
            Err(_) => {
                out.undecodable += 1;
                out.last_unreadable = Some(turn);
            }
        };
        let mut from = first_holder(first_turn);
        'scan: while from < next_turn {
            let mut failed = false;
            for item in tree.range(message_key(id, from)..message_key(id, next_turn)) {
                let Ok((key, value)) = item else {
                    failed = true;
                    break;
                };
                let turn = turn_of(&key).unwrap_or(0);
                keep(&mut out, turn, &value);
                from = turn.saturating_add(1);
            }
            if !failed {
                break;
            }
            if next_turn.saturating_sub(from) > MAX_PROBES {
                out.last_unreadable = Some(next_turn - 1);
                break;
            }
            // Turn by turn past the damaged page, then a scan again.
            while from < next_turn {
                let turn = from;
                from += 1;
                match tree.get(message_key(id, turn)) {
                    Ok(Some(value)) => {
                        keep(&mut out, turn, &value);
                        continue 'scan;
                    }
                    Ok(None) => {}
                    Err(_) => out.last_unreadable = Some(turn),
                }
            }
        }
        out.read.sort_by_key(|m| m.turn);
        out.read.dedup_by_key(|m| m.turn);
        out
    }

    /// The summary records of conversation `id` that can be read (number, record), and how
    /// many could not be.
    pub fn summaries(&self, id: u64) -> (Vec<(u64, Vec<u8>)>, usize) {
        let tree = &self.trees.summaries;
        let mut read = BTreeMap::new();
        let mut failed = false;
        for item in tree.scan_prefix(id.to_be_bytes()) {
            match item {
                Ok((key, value)) => {
                    read.insert(turn_of(&key).unwrap_or(0), value.to_vec());
                }
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        let mut unreadable = 0;
        if failed {
            // Numbers run from 1 without gaps: try each past the last read until one is absent.
            let first = read.keys().next_back().copied().unwrap_or(0) + 1;
            for number in first..first + MAX_SUMMARY_PROBES {
                match tree.get(message_key(id, number)) {
                    Ok(Some(value)) => {
                        read.insert(number, value.to_vec());
                    }
                    Ok(None) => break,
                    Err(_) => unreadable += 1,
                }
            }
            unreadable = unreadable.max(1);
        }
        (read.into_iter().collect(), unreadable)
    }

    /// The closed branches of conversation `id`: `Err` when any of them cannot be read.
    pub fn branches(&self, id: u64) -> Result<Vec<StoredBranch>, StoreError> {
        read_branches(&self.trees.branches, id)
    }

    /// The TTL record of `key`: `Err` when it cannot be read or decoded.
    pub fn ttl(&self, key: &ConversationKey) -> Result<Option<TtlRecord>, StoreError> {
        self.trees
            .ttl
            .get(key.to_bytes())?
            .map(|value| decode(&value))
            .transpose()
    }

    /// How many message records each conversation id has, as far as a walk of the messages
    /// can see.
    pub fn message_ids(&self) -> Walk<(u64, usize)> {
        let all = walk(&self.trees.messages);
        let mut ids: BTreeMap<u64, usize> = BTreeMap::new();
        for (key, value) in &all.records {
            if let Some(id) = key
                .get(..8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map(u64::from_be_bytes)
            {
                // A batch's messages, each (one when it cannot be read).
                *ids.entry(id).or_default() += decode_batch(value).map_or(1, |b| b.len());
            }
        }
        Walk {
            records: ids.into_iter().collect(),
            complete: all.complete,
        }
    }

    /// The TTL tree's keys that could be read, and whether all could.
    pub fn ttl_keys(&self) -> Walk<Vec<u8>> {
        let all = walk(&self.trees.ttl);
        Walk {
            records: all.records.into_iter().map(|(k, _)| k.to_vec()).collect(),
            complete: all.complete,
        }
    }
}
