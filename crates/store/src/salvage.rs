//! Salvage: reading what can still be read of a damaged data directory (`memproxy store
//! check`), and writing it into a fresh one (`memproxy store repair --into NEW_DIR`, with
//! `--engine fjall` into a fjall store: how a sled store moves to fjall). What is read is a
//! sled store.
//!
//! Neither ever writes to the damaged directory. The engine's files are copied aside first
//! (into the scratch directory, or into `NEW_DIR`), while holding the lock a running memproxy
//! would hold, and the copy is what is opened: sled writes to its files as it opens them.
//! Key files are only read.
//!
//! What is read, conversation by conversation (`sled_salvage.rs` for how sled is read around
//! its damaged pages): the record, every message, every summary record and the TTL record;
//! each sealed value is opened with the conversation's key to prove it readable. What cannot
//! be read is counted and named (conversation addresses, never message text):
//!
//! - a conversation whose record cannot be read is lost, with all of it;
//! - a message that cannot be read, or does not open with the key, is lost; so are the
//!   messages before it in the same conversation, and the ones after it up to the next user
//!   message: the history that is kept has no hole, so every list memproxy forwards from it
//!   stays valid (a tool call is never kept without its results). sled can also lose records
//!   silently around damage (a read finds nothing, no error): when fewer messages are found
//!   than the conversation's record counts, the history kept starts after the last gap in
//!   the turn numbers;
//! - a conversation whose key file is missing or malformed keeps only what is not sealed
//!   (values of versions before sealing);
//! - a summary record that cannot be read is lost; the others are kept;
//! - a conversation left with no message and no summary is lost.
//!
//! Long-term memory's owners (`store/owners.rs`: users, agents, tenants) are read the same
//! way: an owner whose record cannot be read is lost with its records; a record that does not
//! open with the owner's key is lost; an owner without a readable key keeps nothing. A repair
//! writes each under a new id, its key file copied, its records as they were sealed.
//!
//! Vectors (`vectors.rs`) are neither read nor written: they are derived from the messages and
//! records, and rebuilt for the repaired store (a fresh store holds none of the old ids).
//!
//! A repair writes each salvaged conversation into the fresh store in one atomic write, with
//! its turn numbers, times, token counts, summaries and TTL record, its values as they were
//! sealed and its key file copied (under the conversation's new id: ids are the fresh
//! store's, so they are never reused there), and copies its workspace folder.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::value::RawValue;

use super::engine::{Engine, Version, Write};
use super::keys::{self, KEY_LEN, KeyFiles};
use super::records::{
    ConversationMeta, OwnerKey, OwnerMeta, OwnerRecord, StoredBranch, StoredMessage, TtlRecord,
};
use super::seal::{open_message, open_summary, sealed_message, sealed_record};
use super::sled_salvage::SalvageReader;
use super::{Embedded, StoreError, legacy_workspace_dir, workspace_dir};
use memproxy_base::identity::ConversationKey;
use memproxy_base::message::Role;

/// At most this many problems are listed one by one.
const MAX_LISTED: usize = 50;

/// What was found of one kind of record, and how much of it is readable.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub found: u64,
    /// What a repair keeps of it.
    pub kept: u64,
}

impl Tally {
    pub fn lost(&self) -> u64 {
        self.found.saturating_sub(self.kept)
    }
}

/// What a check or a repair found.
#[derive(Debug, Default)]
pub struct Report {
    /// How the engine's files were read, when not as memproxy reads them, or why they could
    /// not be read at all.
    pub engine: Option<String>,
    pub conversations: Tally,
    /// Found: what the conversation records say they hold.
    pub messages: Tally,
    pub summaries: Tally,
    /// Closed branches (histories a client left by editing or regenerating).
    pub branches: Tally,
    pub ttl_records: Tally,
    /// Long-term memory's owners (users, agents, tenants) and their records.
    pub owners: Tally,
    pub owner_records: Tally,
    /// Key files, and those of them no stored conversation uses (left by a delete that
    /// crashed; harmless).
    pub key_files: u64,
    pub unused_key_files: u64,
    /// What cannot be read, one line each (no message text).
    pub problems: Vec<String>,
}

impl Report {
    /// True when anything could not be read.
    pub fn damaged(&self) -> bool {
        !self.problems.is_empty()
    }

    fn problem(&mut self, line: String) {
        self.problems.push(line);
    }

    /// The report as text, for people: what a repair keeps is `salvaged` (for a check: what
    /// it would keep, `salvageable`).
    pub fn render(&self, repaired: bool) -> String {
        let kept = if repaired { "salvaged" } else { "salvageable" };
        let mut out = String::new();
        if let Some(engine) = &self.engine {
            let _ = writeln!(out, "engine: {engine}");
        }
        for (name, tally) in [
            ("conversations", self.conversations),
            ("messages", self.messages),
            ("summaries", self.summaries),
            ("closed branches", self.branches),
            ("TTL records", self.ttl_records),
            ("long-term owners", self.owners),
            ("long-term records", self.owner_records),
        ] {
            let _ = writeln!(
                out,
                "{name}: {} found, {} {kept}, {} lost",
                tally.found,
                tally.kept,
                tally.lost()
            );
        }
        let _ = writeln!(
            out,
            "key files: {} ({} of conversations no longer stored)",
            self.key_files, self.unused_key_files
        );
        if self.problems.is_empty() {
            out.push_str("no problem found\n");
        } else {
            let _ = writeln!(out, "problems ({}):", self.problems.len());
            for line in self.problems.iter().take(MAX_LISTED) {
                let _ = writeln!(out, "  - {line}");
            }
            if self.problems.len() > MAX_LISTED {
                let _ = writeln!(out, "  - ... and {} more", self.problems.len() - MAX_LISTED);
            }
        }
        out
    }
}

/// Why a check or a repair could not run.
#[derive(Debug, thiserror::Error)]
pub enum SalvageError {
    #[error("{0} holds no store (no store/ folder)")]
    NoStore(String),
    #[error(
        "the store in {0} is in use: stop the memproxy that holds it first (a check or repair reads a copy made while nothing writes)"
    )]
    InUse(String),
    #[error("{0} is not empty: a repair writes into a new directory")]
    NotEmpty(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Store(#[from] StoreError),
}

/// One conversation as salvaged, ready for a fresh store.
struct Salvaged {
    key: ConversationKey,
    meta: ConversationMeta,
    messages: Vec<StoredMessage>,
    summaries: Vec<(u64, Vec<u8>)>,
    branches: Vec<StoredBranch>,
    ttl: Option<TtlRecord>,
    secret: Option<[u8; KEY_LEN]>,
}

/// One long-term owner as salvaged, ready for a fresh store.
struct SalvagedOwner {
    owner: OwnerKey,
    meta: OwnerMeta,
    records: Vec<OwnerRecord>,
    secret: [u8; KEY_LEN],
}

/// A key file as found.
enum KeyFile {
    Key([u8; KEY_LEN]),
    Malformed,
}

/// Reads everything that can be read of the data directory `data_dir`, using `scratch` (a
/// directory it creates and removes) for the copy of the engine's files.
pub fn check(data_dir: &Path, scratch: &Path) -> Result<Report, SalvageError> {
    let copy = Copy::make(data_dir, scratch)?;
    let result = read(data_dir, &copy.store, |_| Ok(()), |_| Ok(()));
    drop(copy);
    result
}

/// Salvages what can be read of `data_dir` (a sled store) into the new data directory `into`,
/// which must not exist or be empty, with the engine `engine`: fjall's is how a sled store
/// moves to fjall.
pub fn repair(data_dir: &Path, into: &Path, engine: Embedded) -> Result<Report, SalvageError> {
    match std::fs::read_dir(into) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(SalvageError::NotEmpty(into.display().to_string()));
            }
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(err.into()),
    }
    std::fs::create_dir_all(into)?;
    let copy = Copy::make(data_dir, &into.join(".damaged-copy"))?;
    let writer = Writer::open(into, engine)?;
    let result = read(
        data_dir,
        &copy.store,
        |salvaged| {
            writer.write(salvaged)?;
            copy_workspace(data_dir, into, &salvaged.key)
        },
        |owner| writer.write_owner(owner),
    );
    let flushed = writer.engine.flush();
    drop(copy);
    let report = result?;
    flushed?;
    Ok(report)
}

/// The copy of a data directory's engine files, removed when dropped.
struct Copy {
    dir: PathBuf,
    store: PathBuf,
}

impl Copy {
    /// Copies `data_dir/store` into `dir/store`, holding the store's lock meanwhile.
    fn make(data_dir: &Path, dir: &Path) -> Result<Copy, SalvageError> {
        let source = data_dir.join("store");
        if !source.is_dir() {
            return Err(SalvageError::NoStore(data_dir.display().to_string()));
        }
        // sled holds an exclusive lock on its `db` file while it is open: holding it too, no
        // memproxy writes while the copy is made (and one that is running is found here).
        let lock = match std::fs::File::open(source.join("db")) {
            Ok(file) => match file.try_lock() {
                Ok(()) => Some(file),
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(SalvageError::InUse(data_dir.display().to_string()));
                }
                Err(std::fs::TryLockError::Error(err)) => return Err(err.into()),
            },
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => None,
            Err(err) => return Err(err.into()),
        };
        let copy = Copy {
            dir: dir.to_path_buf(),
            store: dir.join("store"),
        };
        copy_dir(&source, &copy.store)?;
        drop(lock);
        Ok(copy)
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        if let Err(err) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(error = %err, dir = %self.dir.display(), "removing the copy of the store failed");
        }
    }
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// Copies the workspace folders of `key` (its current and its legacy name), if any.
fn copy_workspace(data_dir: &Path, into: &Path, key: &ConversationKey) -> Result<(), StoreError> {
    for (from, to) in [
        (workspace_dir(data_dir, key), workspace_dir(into, key)),
        (
            legacy_workspace_dir(data_dir, key),
            legacy_workspace_dir(into, key),
        ),
    ] {
        if from.is_dir() {
            copy_dir(&from, &to).map_err(StoreError::File)?;
        }
    }
    Ok(())
}

/// Every key file of `data_dir`, read (never written).
fn key_files(data_dir: &Path) -> Result<BTreeMap<u64, KeyFile>, StoreError> {
    let mut files = BTreeMap::new();
    let entries = match std::fs::read_dir(data_dir.join("keys")) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(files),
        Err(err) => return Err(StoreError::KeyFile(err)),
    };
    for entry in entries {
        let entry = entry.map_err(StoreError::KeyFile)?;
        let Some(id) = entry.file_name().to_str().and_then(keys::id_of) else {
            continue;
        };
        let bytes = std::fs::read(entry.path()).map_err(StoreError::KeyFile)?;
        let file = match <[u8; KEY_LEN]>::try_from(bytes.as_slice()) {
            Ok(key) if keys::key_of(&key).is_ok() => KeyFile::Key(key),
            _ => KeyFile::Malformed,
        };
        files.insert(id, file);
    }
    Ok(files)
}

/// Reads the copy of the engine's files at `store` and the key files of `data_dir`, calling
/// `salvaged` with each conversation that keeps anything and `owner` with each long-term
/// owner.
fn read(
    data_dir: &Path,
    store: &Path,
    mut salvaged: impl FnMut(&Salvaged) -> Result<(), StoreError>,
    owner: impl FnMut(&SalvagedOwner) -> Result<(), StoreError>,
) -> Result<Report, SalvageError> {
    let mut report = Report::default();
    let keys = key_files(data_dir)?;
    report.key_files = keys.len() as u64;
    let reader = match SalvageReader::open(store) {
        Ok(reader) => reader,
        Err(err) => {
            let line = format!("sled cannot read the store at all: {err}");
            report.engine = Some(line.clone());
            report.problem(line);
            report.unused_key_files = report.key_files;
            return Ok(report);
        }
    };
    if let Some(note) = &reader.note {
        report.engine = Some(note.clone());
        report.problem(format!("{note}; writes made after that record are lost"));
    }
    let index = reader.conversations();
    if !index.complete {
        report.problem(
            "the conversation index has pages that cannot be read: conversations kept there are lost (but those found through their TTL records)"
                .to_string(),
        );
    }
    if !reader.ttl_keys().complete {
        report.problem("the TTL records have pages that cannot be read".to_string());
    }
    let mut ids = BTreeSet::new();
    for (key_bytes, meta) in index.records {
        report.conversations.found += 1;
        let Some(key) = ConversationKey::from_bytes(&key_bytes) else {
            report.problem("a conversation record has a key that cannot be read".to_string());
            continue;
        };
        let address = format!("{}/{}/{}", key.tenant, key.agent, key.conversation);
        let Some(meta) = meta else {
            report.problem(format!("{address}: its record cannot be read; it is lost"));
            continue;
        };
        ids.insert(meta.id);
        let Some(conversation) = salvage_one(&reader, &keys, key, &address, meta, &mut report)
        else {
            continue;
        };
        report.conversations.kept += 1;
        salvaged(&conversation)?;
    }
    salvage_owners(&reader, &keys, &mut ids, &mut report, owner)?;
    report.unused_key_files = keys.keys().filter(|id| !ids.contains(id)).count() as u64;
    let messages = reader.message_ids();
    let orphans: Vec<(u64, usize)> = messages
        .records
        .into_iter()
        .filter(|(id, _)| !ids.contains(id))
        .collect();
    if !orphans.is_empty() {
        let count: usize = orphans.iter().map(|(_, n)| n).sum();
        report.messages.found += count as u64;
        report.problem(format!(
            "{count} messages of {} conversation(s) whose records cannot be read are lost",
            orphans.len()
        ));
    }
    if !messages.complete && index.complete {
        report.problem("the messages have pages that cannot be read".to_string());
    }
    Ok(report)
}

/// Reads long-term memory's owners and their records, calling `salvaged` with each owner
/// that keeps its key; their ids go into `ids` (their key files are in use).
fn salvage_owners(
    reader: &SalvageReader,
    keys: &BTreeMap<u64, KeyFile>,
    ids: &mut BTreeSet<u64>,
    report: &mut Report,
    mut salvaged: impl FnMut(&SalvagedOwner) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let owners = reader.owners();
    let records = reader.owner_records();
    if !owners.complete {
        report.problem("the long-term owners have pages that cannot be read".to_string());
    }
    if !records.complete {
        report.problem("the long-term records have pages that cannot be read".to_string());
    }
    report.owner_records.found += records.records.len() as u64;
    for (bytes, meta) in owners.records {
        report.owners.found += 1;
        let (Some(owner), Some(meta)) = (OwnerKey::from_bytes(&bytes), meta) else {
            report.problem("a long-term owner's record cannot be read; it is lost".to_string());
            continue;
        };
        ids.insert(meta.id);
        let address = format!("{}/{:?}/{}", owner.tenant, owner.kind, owner.name);
        let secret = match keys.get(&meta.id) {
            Some(KeyFile::Key(bytes)) => *bytes,
            _ => {
                report.problem(format!(
                    "long-term owner {address}: its key file is missing or malformed; its records are lost"
                ));
                continue;
            }
        };
        let key = keys::key_of(&secret)?;
        let mut prefix = bytes.clone();
        prefix.push(0);
        let mut kept = Vec::new();
        let mut lost = 0;
        for (record_key, value) in &records.records {
            let Some(rest) = record_key.strip_prefix(prefix.as_slice()) else {
                continue;
            };
            let Some((space, id)) = rest.split_first() else {
                lost += 1;
                continue;
            };
            let opens = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.strip_prefix(super::seal::SEALED_PREFIX))
                .is_some_and(|sealed| {
                    super::seal::open(&key, super::seal::Kind::Record, sealed).is_ok()
                });
            if opens {
                kept.push(OwnerRecord {
                    space: *space,
                    id: id.to_vec(),
                    value: value.clone(),
                });
            } else {
                lost += 1;
            }
        }
        if lost > 0 {
            report.problem(format!(
                "long-term owner {address}: {lost} record(s) cannot be read; they are lost"
            ));
        }
        report.owners.kept += 1;
        report.owner_records.kept += kept.len() as u64;
        salvaged(&SalvagedOwner {
            owner,
            meta,
            records: kept,
            secret,
        })?;
    }
    Ok(())
}

/// What can be kept of one conversation, its problems added to `report`; `None` when nothing.
fn salvage_one(
    reader: &SalvageReader,
    keys: &BTreeMap<u64, KeyFile>,
    key: ConversationKey,
    address: &str,
    mut meta: ConversationMeta,
    report: &mut Report,
) -> Option<Salvaged> {
    let id = meta.id;
    let (secret, key_problem) = match keys.get(&id) {
        Some(KeyFile::Key(bytes)) => (Some(*bytes), None),
        Some(KeyFile::Malformed) => (None, Some("its key file is malformed")),
        None => (None, Some("its key file is missing")),
    };
    let check = KeyCheck {
        id,
        key: secret.as_ref().and_then(|bytes| keys::key_of(bytes).ok()),
    };
    let messages = salvage_messages(reader, &meta, &check);
    report.messages.found += messages.stored;
    report.messages.kept += messages.kept.len() as u64;
    let summaries = salvage_summaries(reader, &check, address, report);
    let branches = salvage_branches(reader, &check, address, report);
    let ttl = salvage_ttl(reader, &key, address, report);

    let why = messages.why_lost(key_problem);
    let (stored, kept) = (messages.stored, messages.kept);
    let lost = stored - kept.len() as u64;
    if kept.is_empty() && summaries.is_empty() && stored > 0 {
        report.problem(format!(
            "{address}: none of its {stored} messages can be kept ({why}); it is lost"
        ));
        return None;
    }
    if lost > 0 {
        report.problem(format!(
            "{address}: {lost} of {stored} messages lost ({why}; the history kept starts after the last gap)"
        ));
    }
    meta.message_count = kept.len() as u64;
    meta.total_tokens = kept.iter().map(|m| u64::from(m.tokens)).sum();
    let needs_key = kept.iter().any(|m| sealed_message(&m.message).is_some())
        || summaries.iter().any(|(_, r)| sealed_record(r).is_some())
        || branches.iter().any(|b| {
            b.messages
                .iter()
                .any(|m| sealed_message(&m.message).is_some())
                || b.summaries.iter().any(|(_, r)| sealed_record(r).is_some())
        });
    Some(Salvaged {
        key,
        meta,
        messages: kept,
        summaries,
        branches,
        ttl,
        secret: secret.filter(|_| needs_key),
    })
}

/// A conversation's key as its key file gave it (`None`: missing or malformed), to prove its
/// sealed values readable.
struct KeyCheck {
    id: u64,
    key: Option<keys::Key>,
}

impl KeyCheck {
    /// True when a message body is not sealed, or opens with the key.
    fn message_opens(&self, body: &RawValue) -> bool {
        sealed_message(body).is_none()
            || matches!(
                open_message(self.key.as_deref(), self.id, body),
                Ok(Some(_))
            )
    }

    /// True when a summary record is not sealed, or opens with the key.
    fn summary_opens(&self, record: &[u8]) -> bool {
        sealed_record(record).is_none()
            || open_summary(self.key.as_deref(), self.id, record.to_vec()).is_ok()
    }
}

/// The messages a repair keeps of one conversation, and what was lost.
struct KeptMessages {
    kept: Vec<StoredMessage>,
    /// What the conversation held: what its record counts, or what was read when more.
    stored: u64,
    /// How many were read but do not open with the key.
    sealed_lost: usize,
    /// Fewer were read than the record counts, none of them unreadable.
    silent: bool,
}

impl KeptMessages {
    /// Why messages were lost, for the report (`key_problem`: what is wrong with the key file).
    fn why_lost(&self, key_problem: Option<&'static str>) -> &'static str {
        match (self.sealed_lost, key_problem) {
            (n, Some(problem)) if n > 0 => problem,
            (n, None) if n > 0 => "sealed values do not open with its key",
            _ if self.silent => "records are missing",
            _ => "records cannot be read",
        }
    }
}

/// Messages: read, then proven to open; the history kept has no hole.
fn salvage_messages(
    reader: &SalvageReader,
    meta: &ConversationMeta,
    check: &KeyCheck,
) -> KeptMessages {
    let read = reader.messages(meta.id, meta.first_turn, meta.next_turn);
    let mut last_bad = read.last_unreadable;
    let mut kept = Vec::with_capacity(read.read.len());
    let mut sealed_lost = 0;
    for message in read.read {
        if !check.message_opens(&message.message) {
            sealed_lost += 1;
            last_bad = last_bad.max(Some(message.turn));
            continue;
        }
        kept.push(message);
    }
    let readable = kept.len();
    // Fewer than the record says, none of them unreadable: sled lost some silently (it can,
    // around damage). Where is not known: the history kept starts after the last gap in the
    // turn numbers (gaps are normal where a reply was replaced, but only looked at now).
    let silent = meta.message_count > readable as u64 && last_bad.is_none();
    if silent {
        let gap = kept
            .windows(2)
            .rev()
            .find(|w| w[1].turn > w[0].turn + 1)
            .map(|w| w[1].turn - 1);
        last_bad = last_bad.max(gap);
    }
    if let Some(bad) = last_bad {
        kept.retain(|m| m.turn > bad);
        let start = kept
            .iter()
            .position(|m| m.role == Role::User)
            .unwrap_or(kept.len());
        kept.drain(..start);
    }
    KeptMessages {
        kept,
        stored: meta.message_count.max(readable as u64),
        sealed_lost,
        silent,
    }
}

/// Summaries: each kept that opens.
fn salvage_summaries(
    reader: &SalvageReader,
    check: &KeyCheck,
    address: &str,
    report: &mut Report,
) -> Vec<(u64, Vec<u8>)> {
    let (summaries, unreadable) = reader.summaries(check.id);
    report.summaries.found += (summaries.len() + unreadable) as u64;
    let total = summaries.len() + unreadable;
    let summaries: Vec<(u64, Vec<u8>)> = summaries
        .into_iter()
        .filter(|(_, record)| check.summary_opens(record))
        .collect();
    report.summaries.kept += summaries.len() as u64;
    if summaries.len() < total {
        report.problem(format!(
            "{address}: {} of {total} summaries lost",
            total - summaries.len()
        ));
    }
    summaries
}

/// Closed branches: each kept whole when every sealed value in it opens.
fn salvage_branches(
    reader: &SalvageReader,
    check: &KeyCheck,
    address: &str,
    report: &mut Report,
) -> Vec<StoredBranch> {
    let branches = match reader.branches(check.id) {
        Ok(branches) => branches,
        Err(_) => {
            report.branches.found += 1;
            report.problem(format!("{address}: its closed branches cannot be read"));
            Vec::new()
        }
    };
    report.branches.found += branches.len() as u64;
    let total = branches.len();
    let branches: Vec<StoredBranch> = branches
        .into_iter()
        .filter(|branch| {
            branch
                .messages
                .iter()
                .all(|m| check.message_opens(&m.message))
                && branch
                    .summaries
                    .iter()
                    .all(|(_, record)| check.summary_opens(record))
        })
        .collect();
    report.branches.kept += branches.len() as u64;
    if branches.len() < total {
        report.problem(format!(
            "{address}: {} of {total} closed branches lost",
            total - branches.len()
        ));
    }
    branches
}

/// The TTL record, when it can be read.
fn salvage_ttl(
    reader: &SalvageReader,
    key: &ConversationKey,
    address: &str,
    report: &mut Report,
) -> Option<TtlRecord> {
    match reader.ttl(key) {
        Ok(ttl) => {
            report.ttl_records.found += u64::from(ttl.is_some());
            report.ttl_records.kept += u64::from(ttl.is_some());
            ttl
        }
        Err(_) => {
            report.ttl_records.found += 1;
            report.problem(format!("{address}: its TTL record cannot be read"));
            None
        }
    }
}

/// The fresh store a repair writes.
struct Writer {
    engine: Arc<dyn Engine>,
    keys: KeyFiles,
}

impl Writer {
    fn open(into: &Path, engine: Embedded) -> Result<Writer, StoreError> {
        Ok(Writer {
            engine: engine.open_engine(into, 16 << 20, None)?,
            keys: KeyFiles::open(into.join("keys"))?,
        })
    }

    /// Writes one conversation under a new id: its key first, then everything else in one
    /// atomic write, then its TTL record.
    fn write(&self, salvaged: &Salvaged) -> Result<(), StoreError> {
        let mut meta = salvaged.meta.clone();
        meta.id = self.engine.new_id()?;
        if let Some(secret) = &salvaged.secret {
            self.keys.install(meta.id, secret)?;
        }
        let summaries: Vec<(u64, &[u8])> = salvaged
            .summaries
            .iter()
            .map(|(number, record)| (*number, record.as_slice()))
            .collect();
        self.engine.write(
            &salvaged.key,
            &Version::absent(),
            Write {
                meta: &meta,
                remove_turns: &[],
                add: &salvaged.messages,
                vectors: &[],
                summaries: &summaries,
                remove_summaries: &[],
                branches: &salvaged.branches,
                response_ids: &[],
            },
        )?;
        if let Some(ttl) = &salvaged.ttl {
            self.engine.put_ttl(&salvaged.key, ttl)?;
        }
        Ok(())
    }

    /// Writes one long-term owner under a new id: its key first, then its record, then its
    /// records in one write.
    fn write_owner(&self, salvaged: &SalvagedOwner) -> Result<(), StoreError> {
        let meta = OwnerMeta {
            id: self.engine.new_id()?,
            ..salvaged.meta
        };
        self.keys.install(meta.id, &salvaged.secret)?;
        self.engine.create_owner(&salvaged.owner, meta)?;
        self.engine
            .write_owner(&salvaged.owner, meta.id, &salvaged.records, &[])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{key, message, options};
    use crate::{Change, Store, lock};

    /// A store of some MiB written over several opens, so most of it lies in log segments
    /// sled no longer replays when it opens (their damage shows only when read).
    async fn write_store(data: &Path) {
        let padding = "lorem ipsum ".repeat(250);
        for life in 0..4 {
            let store = Store::open(data, options()).unwrap();
            for c in 0..25 {
                let handle = store.conversation(&key(&format!("c{life}-{c}"))).unwrap();
                let mut conversation = lock(&handle);
                for turn in 0..3 {
                    let question = format!("question {turn} {padding}");
                    let change = Change {
                        add: vec![
                            message(Role::User, &question),
                            message(Role::Assistant, "reply"),
                        ],
                        ..Change::default()
                    };
                    store.commit(&mut conversation, change).unwrap();
                }
            }
            store.sync().await.unwrap();
            store.close().await.unwrap();
            drop(store);
            released(data).await;
        }
    }

    /// Waits (at most 10 s) until no handle of the closed store holds sled's lock on its `db`
    /// file: sled's IO threads let go of it shortly after the last handle is dropped, and a
    /// salvage (as memproxy's next start) finds the store in use until then.
    async fn released(data: &Path) {
        let db = data.join("store").join("db");
        for _ in 0..1000 {
            match std::fs::File::open(&db).map(|file| file.try_lock()) {
                Ok(Err(std::fs::TryLockError::WouldBlock)) => {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                _ => return,
            }
        }
        panic!(
            "{} still locked 10 s after the store was closed",
            db.display()
        );
    }

    #[tokio::test]
    async fn a_repair_carries_long_term_owners_and_their_records() {
        use memproxy_base::identity::TenantId;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let tenant = TenantId::from_token(Some("t"));
        let (ana, gone) = (
            OwnerKey::user(&tenant, "ana"),
            OwnerKey::user(&tenant, "gone"),
        );
        {
            let store = Store::open(&data, options()).unwrap();
            for (owner, text) in [(&ana, "ana lives in Lisbon"), (&gone, "gone likes tea")] {
                let handle = store.owner(owner, true).unwrap().unwrap();
                let records = (0u8..3)
                    .map(|n| (n, vec![n], format!("{text} {n}").into_bytes()))
                    .collect();
                assert!(store.write_owner(&handle, records, &[]).unwrap());
            }
            // The second owner's key file goes: its records cannot be read any more.
            let gone_id = store.owner(&gone, false).unwrap().unwrap().id;
            store.close().await.unwrap();
            std::fs::remove_file(data.join("keys").join(format!("{gone_id:016x}.key"))).unwrap();
        }
        let report = check(&data, &dir.path().join("scratch")).unwrap();
        assert_eq!(report.owners, Tally { found: 2, kept: 1 });
        assert_eq!(report.owner_records, Tally { found: 6, kept: 3 });
        assert!(
            report
                .render(false)
                .contains("long-term owners: 2 found, 1 salvageable, 1 lost")
        );
        assert!(
            report
                .problems
                .iter()
                .any(|p| p.contains("key file is missing"))
        );
        let into = dir.path().join("repaired");
        let repaired = repair(&data, &into, Embedded::Sled).unwrap();
        assert_eq!(repaired.owner_records, report.owner_records);
        let store = Store::open(&into, options()).unwrap();
        let handle = store.owner(&ana, false).unwrap().unwrap();
        for space in 0u8..3 {
            assert_eq!(
                store.owner_record(&handle, space, &[space]).unwrap(),
                Some(format!("ana lives in Lisbon {space}").into_bytes())
            );
        }
        assert!(store.owner(&gone, false).unwrap().is_none());
        store.close().await.unwrap();
        drop(store);
        released(&into).await;
        assert!(!check(&into, &dir.path().join("scratch")).unwrap().damaged());
    }

    #[tokio::test]
    async fn damage_is_salvaged_around_and_a_repair_reads_whole() {
        let dir = tempfile::tempdir().unwrap();
        let clean = dir.path().join("clean");
        write_store(&clean).await;
        let whole = check(&clean, &dir.path().join("scratch")).unwrap();
        assert!(!whole.damaged(), "{}", whole.render(false));
        assert_eq!(
            whole.conversations,
            Tally {
                found: 100,
                kept: 100
            }
        );
        assert_eq!(
            whole.messages,
            Tally {
                found: 600,
                kept: 600
            }
        );
        assert_eq!(whole.key_files, 100);

        // 32 bytes overwritten in a few places: where sled notices (at open, or when a page
        // is read) depends on how its log lies, so every place is checked and repaired.
        let db = std::fs::read(clean.join("store").join("db")).unwrap();
        let damaged = dir.path().join("damaged");
        let into = dir.path().join("repaired");
        let mut partial = 0;
        // Eighths of the file, then (only while no place has shown a partial salvage: how
        // sled lays its log out differs from run to run) sixteenths and thirty-seconds between.
        let places: Vec<(usize, usize)> = (1..8)
            .map(|k| (k, 8))
            .chain((1..16).step_by(2).map(|k| (k, 16)))
            .chain((1..32).step_by(2).map(|k| (k, 32)))
            .collect();
        for (tried, (k, parts)) in places.into_iter().enumerate() {
            if tried >= 7 && partial > 0 {
                break;
            }
            let offset = db.len() * k / parts;
            for old in [&damaged, &into] {
                let _ = std::fs::remove_dir_all(old);
            }
            copy_dir(&clean, &damaged).unwrap();
            let mut bytes = db.clone();
            bytes[offset..offset + 32].fill(0xab);
            std::fs::write(damaged.join("store").join("db"), bytes).unwrap();
            let report = check(&damaged, &dir.path().join("scratch")).unwrap();
            let text = report.render(false);
            assert!(!text.contains("lorem"), "{text}");
            if report.messages.lost() > 0 {
                assert!(report.damaged(), "{text}");
            }
            if report.messages.kept > 0 && report.messages.lost() > 0 {
                partial += 1;
            }
            let repaired = repair(&damaged, &into, Embedded::Sled).unwrap();
            assert_eq!(repaired.messages, report.messages, "{text}");
            let again = check(&into, &dir.path().join("scratch")).unwrap();
            assert!(!again.damaged(), "{}", again.render(false));
            assert_eq!(again.messages.found, report.messages.kept, "{text}");
            assert_eq!(
                again.conversations.found, report.conversations.kept,
                "{text}"
            );

            // What was kept of each conversation is whole exchanges from a question on.
            let store = Store::open(&into, options()).unwrap();
            let (page, _) = store.list(Default::default(), None, 1000).unwrap();
            for conversation in page {
                let messages = store
                    .all_messages(&conversation.key, &conversation.meta)
                    .unwrap();
                let turns: Vec<(u64, Role)> = messages.iter().map(|m| (m.turn, m.role)).collect();
                assert_eq!(
                    turns.first().map(|t| t.1),
                    Some(Role::User),
                    "{turns:?} {text}"
                );
                assert!(turns.len().is_multiple_of(2), "{turns:?} {text}");
                assert!(messages.windows(2).all(|w| w[0].turn < w[1].turn));
            }
            store.close().await.unwrap();
        }
        assert!(partial > 0, "no damage that sled reads around");
        assert!(matches!(
            repair(&damaged, &into, Embedded::Sled),
            Err(SalvageError::NotEmpty(_))
        ));
    }
}
