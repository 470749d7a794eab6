//! Extracted memories (layer 2): what memproxy learned about a user, as records with the
//! reference design's fields, kept per owner (the user for `private`, the agent for `agent`,
//! the tenant for `tenant`) in space [`SPACE_MEMORIES`], sealed like everything of an owner.
//!
//! - **Insert** ([`apply`]): each extracted candidate is checked (text, type, scope, scores),
//!   then compared with the owner's memories: one it names in `supersedes`, or one of the same
//!   type with a very similar text, is updated (a new version; the old text kept in its
//!   history); a near-duplicate (by text, or by meaning: its vector's cosine with a stored
//!   memory's at least [`MEANING_DUPLICATE`], unless each names something the other does not,
//!   [`names_differ`]) only refreshes the one stored; anything else is
//!   added. A memory given a new text loses its vector in the same write, and gets the new
//!   one when it is made ([`Meanings`]).
//! - **Decay**: `0.5 ^ (time since last access / (half_life × (0.5 + importance)))`, so an
//!   important memory fades slower; recalling a memory refreshes its last access. The sweeper
//!   deletes memories whose score falls under `memory_min_decay`.
//! - **In the prompt** ([`select`], [`render`]): the memories most relevant to the new
//!   message (relevance times `0.5 + importance`, times decay; relevance is BM25 over their
//!   text on hybrid recall's 0..1 scale, fused with the cosine of the memory's vector and the
//!   query's as hybrid recall fuses them, `recall/hybrid.rs`) up to
//!   `long_term_top_k`, plus the user's preference and profile memories, within
//!   `long_term_max_tokens`, as one system message right after the client's instructions.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::embedding::{Embedding, RecordText, RecordTexts};
use crate::recall::Query;
use crate::recall::tokenize::terms;
use memproxy_base::message::MEMORIES_MARKER;
use memproxy_store::{OwnerHandle, OwnerKey, OwnerKind, Store, StoreError};

/// The memories of an owner.
pub const SPACE_MEMORIES: u8 = 3;

/// The most memories one owner keeps; past it the most decayed go first.
pub const MAX_MEMORIES_PER_OWNER: usize = 500;
/// The longest memory text kept, in characters.
pub const MAX_MEMORY_CHARS: usize = 1000;
/// Candidates less certain than this are not stored.
pub const MIN_CONFIDENCE: f64 = 0.3;
/// Texts at least this similar (Jaccard over their terms) are the same memory.
const DUPLICATE_SIMILARITY: f64 = 0.85;
/// Texts at least this similar, of the same type, are a new version of the same memory.
const UPDATE_SIMILARITY: f64 = 0.6;
/// Memories whose vectors' cosine is at least this are the same memory said in other words
/// (unless [`names_differ`]). Chosen with the default embedder (the learned static table) on
/// `tests/it/longterm_meaning.rs`'s 12 paraphrased and 12 distinct pairs: the distinct pairs
/// that name the same things reach 0.753 ("allergic to peanuts" / "allergic to cats"), the
/// paraphrases range from 0.52 to 0.97; at 0.775 (midway between 0.753 and the next paraphrase
/// up, 0.793) no distinct pair is merged and 9 of 12 paraphrases are caught (the rest are left
/// to the text checks, or stored twice): merging two facts loses one, a duplicate only costs a
/// line of the prompt. (With the distilled table this was 0.88, for 5 of 12.)
pub const MEANING_DUPLICATE: f32 = 0.775;

/// Whether each text names something the other does not: a capitalised word, not the text's
/// first, whose lower case is not among the other text's words ("supports Arsenal" /
/// "supports Chelsea", "lives in Lisbon" / "lives in Berlin"). Such memories are different facts
/// however close their vectors (an embedding puts two football clubs or two cities close
/// together), so they are never merged by meaning.
pub fn names_differ(a: &str, b: &str) -> bool {
    fn words(text: &str) -> Vec<&str> {
        text.split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect()
    }
    fn unshared_name(words: &[&str], other: &HashSet<String>) -> bool {
        words.iter().skip(1).any(|w| {
            w.chars().next().is_some_and(char::is_uppercase) && !other.contains(&w.to_lowercase())
        })
    }
    let (a, b) = (words(a), words(b));
    let lower = |ws: &[&str]| -> HashSet<String> { ws.iter().map(|w| w.to_lowercase()).collect() };
    unshared_name(&a, &lower(&b)) && unshared_name(&b, &lower(&a))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryType {
    Preference,
    Profile,
    Semantic,
    Episodic,
    Procedural,
}

impl MemoryType {
    pub const ALL: [&'static str; 5] = [
        "preference",
        "profile",
        "semantic",
        "episodic",
        "procedural",
    ];

    pub fn parse(text: &str) -> Option<MemoryType> {
        serde_json::from_value(serde_json::Value::String(text.to_ascii_lowercase())).ok()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            MemoryType::Preference => "preference",
            MemoryType::Profile => "profile",
            MemoryType::Semantic => "semantic",
            MemoryType::Episodic => "episodic",
            MemoryType::Procedural => "procedural",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryScope {
    /// The user alone (the default).
    Private,
    /// Every user of the agent in the tenant.
    Agent,
    /// Every user of the tenant.
    Tenant,
}

impl MemoryScope {
    pub fn parse(text: &str) -> Option<MemoryScope> {
        serde_json::from_value(serde_json::Value::String(text.to_ascii_lowercase())).ok()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            MemoryScope::Private => "private",
            MemoryScope::Agent => "agent",
            MemoryScope::Tenant => "tenant",
        }
    }

    /// The owner a memory of this scope is kept under.
    pub fn owner(self, user: &OwnerKey, agent: &str) -> OwnerKey {
        match self {
            MemoryScope::Private => user.clone(),
            MemoryScope::Agent => OwnerKey::agent(&user.tenant, agent),
            MemoryScope::Tenant => OwnerKey::tenant(&user.tenant),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemorySource {
    ExplicitUserInput,
    ImplicitInference,
    CorrectedMemory,
}

/// An earlier version of a memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PastVersion {
    pub version: u32,
    pub text: String,
    pub source: MemorySource,
    pub updated_ms: i64,
}

/// One memory, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryRecord {
    pub id: u64,
    /// The tenant (a hash of the credential).
    pub tenant: String,
    /// The user it was learned from.
    pub user: String,
    pub agent: String,
    #[serde(rename = "type")]
    pub kind: MemoryType,
    pub scope: MemoryScope,
    /// The memory as a statement.
    pub text: String,
    /// The raw source excerpt it was learned from (the turns' text, shortened).
    #[serde(default)]
    pub excerpt: String,
    pub importance: f64,
    pub confidence: f64,
    #[serde(default)]
    pub tags: Vec<String>,
    pub source: MemorySource,
    /// The conversation and turns it was learned from.
    #[serde(default)]
    pub conversation: Option<String>,
    #[serde(default)]
    pub source_turns: Vec<u64>,
    pub version: u32,
    #[serde(default)]
    pub history: Vec<PastVersion>,
    pub created_ms: i64,
    pub updated_ms: i64,
    pub last_accessed_ms: i64,
    /// Memories this one replaced (their text is in `history`, or they were deleted).
    #[serde(default)]
    pub supersedes: Vec<u64>,
    #[serde(default)]
    pub related_to: Vec<u64>,
}

/// Decay settings.
#[derive(Debug, Clone, Copy)]
pub struct Decay {
    pub half_life_ms: f64,
    pub min: f64,
}

impl MemoryRecord {
    /// The decay score at `now_ms`: 1 when just accessed, halving every
    /// `half_life × (0.5 + importance)`.
    pub fn decay(&self, now_ms: i64, decay: Decay) -> f64 {
        let elapsed = (now_ms - self.last_accessed_ms).max(0) as f64;
        let half_life = decay.half_life_ms * (0.5 + self.importance.clamp(0.0, 1.0));
        if half_life <= 0.0 {
            return 0.0;
        }
        0.5f64.powf(elapsed / half_life)
    }

    /// A new version with `text`, the current one kept in the history.
    pub fn revise(&mut self, text: String, source: MemorySource, now_ms: i64) {
        self.history.push(PastVersion {
            version: self.version,
            text: std::mem::replace(&mut self.text, text),
            source: self.source,
            updated_ms: self.updated_ms,
        });
        self.version += 1;
        self.source = source;
        self.updated_ms = now_ms;
        self.last_accessed_ms = now_ms;
    }
}

/// A memory as the extraction model proposed it (the wire contract, `docs/memories.md`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Candidate {
    pub text: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub scope: Option<String>,
    pub importance: f64,
    pub confidence: f64,
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default)]
    pub source_turns: Vec<u64>,
    #[serde(default)]
    pub supersedes: Vec<u64>,
}

/// Where a batch of candidates came from.
#[derive(Debug, Clone)]
pub struct CandidateSource {
    pub user: OwnerKey,
    pub agent: String,
    pub conversation: Option<String>,
    /// The source text by turn, for excerpts and to tell explicit statements from inferences.
    pub turns: HashMap<u64, String>,
    /// The candidates are the user's own words (a memory the user asked to keep, the
    /// `memory_remember` tool): explicit whatever their source turns.
    pub stated: bool,
    pub now_ms: i64,
}

/// What [`apply`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub added: usize,
    /// New versions of a similar memory.
    pub updated: usize,
    /// New versions of a memory the model named in `supersedes`.
    pub superseded: usize,
    pub ignored: usize,
    pub rejected: usize,
}

fn encode(record: &MemoryRecord) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(record).map_err(|err| StoreError::Corrupt(err.to_string()))
}

/// The record id of memory `id`.
pub fn record_id(id: u64) -> Vec<u8> {
    id.to_be_bytes().to_vec()
}

/// Queues the embedding of memories `ids` of `owner` with `embedding`'s background worker,
/// from their text as it is when the job runs (a memory gone by then is skipped).
pub fn embed_later(embedding: Option<&Embedding>, owner: &OwnerKey, ids: Vec<u64>) {
    let Some(embedding) = embedding else {
        return;
    };
    if ids.is_empty() || embedding.embedder().is_none() {
        return;
    }
    let read = move |store: &Store, handle: &OwnerHandle| -> Result<Vec<RecordText>, StoreError> {
        let mut texts = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(bytes) = store.owner_record(handle, SPACE_MEMORIES, &record_id(id))? {
                let memory: MemoryRecord = serde_json::from_slice(&bytes)
                    .map_err(|e| StoreError::Corrupt(e.to_string()))?;
                texts.push((SPACE_MEMORIES, record_id(id), memory.text));
            }
        }
        Ok(texts)
    };
    embedding.after_records(owner, RecordTexts::Read(Box::new(read)), None);
}

/// Every memory of an owner.
pub fn all(store: &Store, handle: &OwnerHandle) -> Result<Vec<MemoryRecord>, StoreError> {
    store
        .all_owner_records(handle, SPACE_MEMORIES)?
        .into_iter()
        .map(|r| serde_json::from_slice(&r.value).map_err(|e| StoreError::Corrupt(e.to_string())))
        .collect()
}

/// Writes `records` of one owner (creating it when missing) and removes `remove`. Those of
/// `records` whose id is in `new_texts` have a new text: their vector, made from the old one,
/// goes in the same write (an engine removes before it puts), until a new one is stored.
pub fn write(
    store: &Store,
    owner: &OwnerKey,
    records: &[MemoryRecord],
    new_texts: &[u64],
    remove: &[u64],
) -> Result<bool, StoreError> {
    let Some(handle) = store.owner(owner, true)? else {
        return Ok(false);
    };
    let put = records
        .iter()
        .map(|r| Ok((SPACE_MEMORIES, record_id(r.id), encode(r)?)))
        .collect::<Result<Vec<_>, StoreError>>()?;
    let remove: Vec<(u8, Vec<u8>)> = remove
        .iter()
        .chain(
            new_texts
                .iter()
                .filter(|id| records.iter().any(|r| r.id == **id)),
        )
        .map(|id| (SPACE_MEMORIES, record_id(*id)))
        .collect();
    store.write_owner(&handle, put, &remove)
}

/// Writes what [`apply`] changed, owner by owner, with the vectors of the memories it gave
/// a new text (`meanings`, of embedding space `space`), and keeps each owner within
/// [`MAX_MEMORIES_PER_OWNER`] (`known`: the owners' memories as [`apply`] left them).
pub fn store_changed(
    store: &Store,
    changed: HashMap<OwnerKey, Vec<MemoryRecord>>,
    known: &HashMap<OwnerKey, Vec<MemoryRecord>>,
    meanings: &Meanings,
    space: Option<&str>,
) -> Result<(), StoreError> {
    for (owner, records) in changed {
        let renewed: Vec<u64> = records
            .iter()
            .map(|r| r.id)
            .filter(|id| meanings.renewed.contains(id))
            .collect();
        write(store, &owner, &records, &renewed, &[])?;
        if let Some(space) = space {
            let vectors: Vec<(u8, Vec<u8>, Vec<f32>)> = renewed
                .iter()
                .filter_map(|id| {
                    let vector = meanings.memories.get(id)?;
                    Some((SPACE_MEMORIES, record_id(*id), vector.clone()))
                })
                .collect();
            if !vectors.is_empty()
                && let Some(handle) = store.owner(&owner, false)?
            {
                store.put_owner_vectors(&handle, space, &vectors)?;
            }
        }
        prune(store, &owner, known.get(&owner).map_or(0, Vec::len))?;
    }
    Ok(())
}

/// What deduplication by meaning reads and [`apply`] leaves for [`store_changed`].
#[derive(Debug, Default, Clone)]
pub struct Meanings {
    /// Each candidate's vector, in the candidates' order (empty: none was embedded, and
    /// candidates are compared by text alone).
    pub candidates: Vec<Vec<f32>>,
    /// The memories' vectors by id, as stored; [`apply`] sets those of the memories it
    /// gives a new text (and drops them when the candidate has no vector).
    pub memories: HashMap<u64, Vec<f32>>,
    /// The memories [`apply`] added or gave a new text: their vector is new.
    pub renewed: HashSet<u64>,
}

/// The vectors (of `space`) of an owner's memories, by memory id.
pub fn vectors(
    store: &Store,
    handle: &OwnerHandle,
    space: &str,
) -> Result<HashMap<u64, Vec<f32>>, StoreError> {
    Ok(store
        .owner_vectors(handle, SPACE_MEMORIES, space)?
        .into_iter()
        .filter_map(|(id, vector)| {
            let id = <[u8; 8]>::try_from(id.as_slice()).ok()?;
            Some((u64::from_be_bytes(id), vector))
        })
        .collect())
}

impl Meanings {
    /// The vectors (of `space`) of every memory in `known`.
    pub fn of_known(
        store: &Store,
        known: &HashMap<OwnerKey, Vec<MemoryRecord>>,
        space: &str,
    ) -> Result<HashMap<u64, Vec<f32>>, StoreError> {
        let mut out = HashMap::new();
        for owner in known.keys() {
            if let Some(handle) = store.owner(owner, false)? {
                out.extend(vectors(store, &handle, space)?);
            }
        }
        Ok(out)
    }

    /// The vector of candidate `index`, if candidates were embedded.
    fn candidate(&self, index: usize) -> Option<&[f32]> {
        self.candidates.get(index).map(Vec::as_slice)
    }
}

/// The cosine of two vectors (0 when either is all zeros or their lengths differ).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return 0.0;
    }
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norms =
        a.iter().map(|x| x * x).sum::<f32>().sqrt() * b.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norms > 0.0 { dot / norms } else { 0.0 }
}

/// Keeps an owner within [`MAX_MEMORIES_PER_OWNER`]: the least important, least recently
/// used go first.
fn prune(store: &Store, owner: &OwnerKey, count: usize) -> Result<(), StoreError> {
    if count <= MAX_MEMORIES_PER_OWNER {
        return Ok(());
    }
    let Some(handle) = store.owner(owner, false)? else {
        return Ok(());
    };
    let mut all = all(store, &handle)?;
    all.sort_by(|a, b| {
        (a.importance, a.last_accessed_ms)
            .partial_cmp(&(b.importance, b.last_accessed_ms))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let excess = all.len().saturating_sub(MAX_MEMORIES_PER_OWNER);
    let remove: Vec<(u8, Vec<u8>)> = all[..excess]
        .iter()
        .map(|m| (SPACE_MEMORIES, record_id(m.id)))
        .collect();
    store.write_owner(&handle, Vec::new(), &remove)?;
    Ok(())
}

fn term_set(text: &str) -> HashSet<String> {
    terms(text, None).into_iter().collect()
}

/// Jaccard similarity of two texts' terms.
pub fn similarity(a: &str, b: &str) -> f64 {
    let (a, b) = (term_set(a), term_set(b));
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    let shared = a.intersection(&b).count() as f64;
    shared / ((a.len() + b.len()) as f64 - shared)
}

/// Shared terms over the terms of the shorter text (how much of one the other says).
fn overlap(a: &str, b: &str) -> f64 {
    let (a, b) = (term_set(a), term_set(b));
    let shorter = a.len().min(b.len());
    if shorter == 0 {
        return 0.0;
    }
    a.intersection(&b).count() as f64 / shorter as f64
}

/// A candidate checked: `None` when it is unusable (empty or too long, an unknown type or
/// scope, scores outside 0..1, too uncertain).
fn checked(candidate: &Candidate) -> Option<(MemoryType, MemoryScope)> {
    let text = candidate.text.trim();
    let kind = MemoryType::parse(&candidate.kind)?;
    let scope = match candidate.scope.as_deref() {
        None | Some("") => MemoryScope::Private,
        Some(scope) => MemoryScope::parse(scope)?,
    };
    let unit = |x: f64| (0.0..=1.0).contains(&x);
    (!text.is_empty()
        && text.chars().count() <= MAX_MEMORY_CHARS
        && unit(candidate.importance)
        && unit(candidate.confidence)
        && candidate.confidence >= MIN_CONFIDENCE
        && candidate.tags.len() <= 32)
        .then_some((kind, scope))
}

/// Applies extracted `candidates` to the memories of `existing` (owner → its memories, as
/// read; every owner a candidate's scope may name must be there), returning the records to
/// write per owner. `new_id` hands out memory ids; `meanings` holds the vectors that
/// deduplicate by meaning, and is told which memories have a new text (and vector).
pub fn apply(
    existing: &mut HashMap<OwnerKey, Vec<MemoryRecord>>,
    candidates: &[Candidate],
    origin: &CandidateSource,
    meanings: &mut Meanings,
    mut new_id: impl FnMut() -> Result<u64, StoreError>,
) -> Result<(Applied, HashMap<OwnerKey, Vec<MemoryRecord>>), StoreError> {
    let mut applied = Applied::default();
    let mut changed: HashMap<OwnerKey, Vec<MemoryRecord>> = HashMap::new();
    for (index, candidate) in candidates.iter().enumerate() {
        let Some(reading) = Reading::of(candidate, origin) else {
            applied.rejected += 1;
            continue;
        };
        let vector = meanings.candidate(index).map(<[f32]>::to_vec);
        let owner = reading.scope.owner(&origin.user, &origin.agent);
        let memories = existing.entry(owner.clone()).or_default();
        let (record, renewed) =
            match Target::in_memories(memories, &reading, vector.as_deref(), &meanings.memories) {
                Some(target) => {
                    let memory = &mut memories[target.index];
                    let merged = reading.merge_into(memory, &target, origin);
                    match merged {
                        Merged::Ignored => applied.ignored += 1,
                        Merged::Updated => applied.updated += 1,
                        Merged::Superseded => applied.superseded += 1,
                    }
                    (memory.clone(), !matches!(merged, Merged::Ignored))
                }
                None => {
                    let record = reading.new_record(new_id()?, origin);
                    memories.push(record.clone());
                    applied.added += 1;
                    (record, true)
                }
            };
        if renewed {
            meanings.renewed.insert(record.id);
            match vector {
                Some(vector) => meanings.memories.insert(record.id, vector),
                None => meanings.memories.remove(&record.id),
            };
        }
        upsert(changed.entry(owner).or_default(), record);
    }
    Ok((applied, changed))
}

/// A candidate checked and read against the turns it came from: what a memory takes from it.
struct Reading<'a> {
    candidate: &'a Candidate,
    kind: MemoryType,
    scope: MemoryScope,
    /// The candidate's text, trimmed.
    text: String,
    /// Explicit when one of its source turns says at least half of it, else an inference.
    source: MemorySource,
    /// Its source turns' text, shortened to [`MAX_MEMORY_CHARS`].
    excerpt: String,
}

/// What a candidate did to the stored memory it matched.
enum Merged {
    /// A near-duplicate: the stored one is only refreshed.
    Ignored,
    /// A new version of a similar memory.
    Updated,
    /// A new version of the memory the candidate named in `supersedes`.
    Superseded,
}

impl<'a> Reading<'a> {
    /// `None` when the candidate is unusable ([`checked`]).
    fn of(candidate: &'a Candidate, origin: &CandidateSource) -> Option<Reading<'a>> {
        let (kind, scope) = checked(candidate)?;
        let text = candidate.text.trim().to_string();
        let quoted = candidate
            .source_turns
            .iter()
            .filter_map(|t| origin.turns.get(t))
            .any(|said| overlap(said, &text) >= 0.5);
        let source = if quoted || origin.stated {
            MemorySource::ExplicitUserInput
        } else {
            MemorySource::ImplicitInference
        };
        let excerpt: String = candidate
            .source_turns
            .iter()
            .filter_map(|t| origin.turns.get(t))
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
            .chars()
            .take(MAX_MEMORY_CHARS)
            .collect();
        Some(Reading {
            candidate,
            kind,
            scope,
            text,
            source,
            excerpt,
        })
    }

    /// Applies the candidate to the stored `memory` it matched: a near-duplicate (not named
    /// in `supersedes`) raises its scores and refreshes its last access; anything else makes
    /// a new version of it, the tags and superseded ids added to its own.
    fn merge_into(
        self,
        memory: &mut MemoryRecord,
        target: &Target,
        origin: &CandidateSource,
    ) -> Merged {
        let candidate = self.candidate;
        if !target.superseding && (target.duplicate || memory.text == self.text) {
            memory.importance = memory.importance.max(candidate.importance);
            memory.confidence = memory.confidence.max(candidate.confidence);
            memory.last_accessed_ms = origin.now_ms;
            return Merged::Ignored;
        }
        memory.revise(self.text, self.source, origin.now_ms);
        memory.kind = self.kind;
        memory.importance = candidate.importance;
        memory.confidence = candidate.confidence;
        memory.excerpt = self.excerpt;
        memory.source_turns = candidate.source_turns.clone();
        memory.conversation = origin.conversation.clone();
        for tag in &candidate.tags {
            if !memory.tags.contains(tag) {
                memory.tags.push(tag.clone());
            }
        }
        // Other memories it names are superseded too: related from now on.
        for id in &candidate.supersedes {
            if *id != memory.id && !memory.supersedes.contains(id) {
                memory.supersedes.push(*id);
            }
        }
        if target.superseding {
            Merged::Superseded
        } else {
            Merged::Updated
        }
    }

    /// The candidate as a new memory, numbered `id`.
    fn new_record(self, id: u64, origin: &CandidateSource) -> MemoryRecord {
        let candidate = self.candidate;
        MemoryRecord {
            id,
            tenant: origin.user.tenant.as_str().to_string(),
            user: origin.user.name.clone(),
            agent: origin.agent.clone(),
            kind: self.kind,
            scope: self.scope,
            text: self.text,
            excerpt: self.excerpt,
            importance: candidate.importance,
            confidence: candidate.confidence,
            tags: candidate.tags.clone(),
            source: self.source,
            conversation: origin.conversation.clone(),
            source_turns: candidate.source_turns.clone(),
            version: 1,
            history: Vec::new(),
            created_ms: origin.now_ms,
            updated_ms: origin.now_ms,
            last_accessed_ms: origin.now_ms,
            supersedes: Vec::new(),
            related_to: Vec::new(),
        }
    }
}

/// The stored memory a candidate matches, and how.
struct Target {
    /// Its index among the owner's memories.
    index: usize,
    /// A near-duplicate: by text, or by meaning.
    duplicate: bool,
    /// The candidate names it in `supersedes`.
    superseding: bool,
}

impl Target {
    /// The memory the candidate names in `supersedes`; else the one whose text is most
    /// similar, when it is a near-duplicate; else the one closest in meaning (`vector`
    /// against the memories' `vectors`), when that is a near-duplicate; else the one whose
    /// text is most similar, when it is of the same type and similar enough to be a new
    /// version of it.
    fn in_memories(
        memories: &[MemoryRecord],
        reading: &Reading<'_>,
        vector: Option<&[f32]>,
        vectors: &HashMap<u64, Vec<f32>>,
    ) -> Option<Target> {
        let superseded = memories
            .iter()
            .position(|m| reading.candidate.supersedes.contains(&m.id));
        if let Some(index) = superseded {
            return Some(Target {
                index,
                duplicate: false,
                superseding: true,
            });
        }
        let by_text = memories
            .iter()
            .enumerate()
            .map(|(i, m)| (i, similarity(&m.text, &reading.text)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let target = |index, duplicate| Target {
            index,
            duplicate,
            superseding: false,
        };
        if let Some((index, s)) = by_text
            && s >= DUPLICATE_SIMILARITY
        {
            return Some(target(index, true));
        }
        let by_meaning = vector.and_then(|vector| {
            memories
                .iter()
                .enumerate()
                .filter(|(_, m)| !names_differ(&m.text, &reading.text))
                .filter_map(|(i, m)| Some((i, cosine(vector, vectors.get(&m.id)?))))
                .max_by(|a, b| a.1.total_cmp(&b.1))
        });
        if let Some((index, c)) = by_meaning
            && c >= MEANING_DUPLICATE
        {
            return Some(target(index, true));
        }
        memories
            .iter()
            .enumerate()
            .filter(|(_, m)| m.kind == reading.kind)
            .map(|(i, m)| (i, similarity(&m.text, &reading.text)))
            .filter(|(_, s)| *s >= UPDATE_SIMILARITY)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(index, _)| target(index, false))
    }
}

fn upsert(list: &mut Vec<MemoryRecord>, record: MemoryRecord) {
    match list.iter_mut().find(|m| m.id == record.id) {
        Some(slot) => *slot = record,
        None => list.push(record),
    }
}

/// A memory chosen for the prompt, with its score.
#[derive(Debug, Clone)]
pub struct Chosen {
    pub owner: OwnerKey,
    pub memory: MemoryRecord,
    pub score: f64,
    pub decay: f64,
}

/// Tokens a memory takes in the prompt (a line with its type), estimated from its text.
pub fn memory_tokens(memory: &MemoryRecord) -> u64 {
    memproxy_base::tokens::count_message(None, &memory.text) as u64 + 4
}

/// What memories are chosen for: the query (its words, its vector, how the two are fused)
/// and the memories' vectors by id (of the query vector's space).
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub query: Query<'a>,
    pub vectors: &'a HashMap<u64, Vec<f32>>,
}

impl Ask<'_> {
    /// A memory's relevance, 0..1, from its normalised BM25 score (`lexical`): fused with
    /// its cosine when the query and some memory have a vector (one without a vector yet by
    /// its words alone, at the lexical weight), as hybrid recall fuses a turn's; 0 under the
    /// floor.
    fn relevance(&self, memory: &MemoryRecord, lexical: f64) -> f64 {
        let fusion = self.query.fusion;
        let relevance = match self.query.vector.get() {
            Some(query) if !self.vectors.is_empty() => {
                let w = f64::from(fusion.lexical_weight.clamp(0.0, 1.0));
                let semantic = self
                    .vectors
                    .get(&memory.id)
                    .map_or(0.0, |v| f64::from(cosine(query, v).clamp(0.0, 1.0)));
                w * lexical + (1.0 - w) * semantic
            }
            _ => lexical,
        };
        if relevance >= f64::from(fusion.floor) {
            relevance
        } else {
            0.0
        }
    }
}

/// The memories for the prompt (see the module documentation), best first.
pub fn select(
    candidates: Vec<(OwnerKey, MemoryRecord)>,
    ask: Ask<'_>,
    now_ms: i64,
    decay: Decay,
    top_k: usize,
    max_tokens: u64,
) -> Vec<Chosen> {
    if top_k == 0 || max_tokens == 0 || candidates.is_empty() {
        return Vec::new();
    }
    // Stemmed in the language of the memories (detected as for a conversation).
    let latin = crate::recall::stemming(
        crate::recall::tokenize::TextLanguage::Auto,
        candidates.iter().map(|(_, m)| m.text.as_str()),
    );
    let query: HashSet<String> = terms(ask.query.text, latin).into_iter().collect();
    let docs: Vec<Vec<String>> = candidates
        .iter()
        .map(|(_, m)| terms(&m.text, latin))
        .collect();
    let n = docs.len() as f64;
    let avgdl = (docs.iter().map(Vec::len).sum::<usize>() as f64 / n).max(1.0);
    let mut df: HashMap<&str, f64> = HashMap::new();
    for doc in &docs {
        let unique: HashSet<&str> = doc.iter().map(String::as_str).collect();
        for term in unique {
            *df.entry(term).or_default() += 1.0;
        }
    }
    let idf = |term: &str| {
        let df = df.get(term).copied().unwrap_or(0.0);
        (1.0 + (n - df.max(1.0) + 0.5) / (df.max(1.0) + 0.5)).ln()
    };
    // The query's best possible score, as `Index::query_weight`: each word matched once in a
    // memory of average length.
    let weight: f64 = query.iter().map(|term| idf(term)).sum();
    let mut scored: Vec<Chosen> = candidates
        .into_iter()
        .zip(&docs)
        .map(|((owner, memory), doc)| {
            let mut bm25 = 0.0;
            for term in &query {
                let tf = doc.iter().filter(|t| *t == term).count() as f64;
                if tf == 0.0 {
                    continue;
                }
                bm25 +=
                    idf(term) * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * doc.len() as f64 / avgdl));
            }
            let lexical = if weight > 0.0 {
                (bm25 / weight).clamp(0.0, 1.0)
            } else {
                0.0
            };
            let decayed = memory.decay(now_ms, decay);
            Chosen {
                score: ask.relevance(&memory, lexical) * (0.5 + memory.importance) * decayed,
                decay: decayed,
                owner,
                memory,
            }
        })
        .filter(|c| c.decay >= decay.min)
        .collect();
    scored.sort_by(|a, b| b.score.total_cmp(&a.score));
    let mut chosen: Vec<Chosen> = Vec::new();
    let mut tokens = 0;
    let mut relevant = 0;
    let about_user = |c: &Chosen| {
        matches!(c.memory.kind, MemoryType::Preference | MemoryType::Profile)
            && c.owner.kind == OwnerKind::User
    };
    // The relevant ones first, then the user's preferences and profile by importance.
    let (hits, rest): (Vec<Chosen>, Vec<Chosen>) = scored.into_iter().partition(|c| c.score > 0.0);
    let mut profile: Vec<Chosen> = rest.into_iter().filter(about_user).collect();
    profile.sort_by(|a, b| {
        (b.memory.importance * b.decay).total_cmp(&(a.memory.importance * a.decay))
    });
    for c in hits.into_iter().chain(profile) {
        let is_profile = about_user(&c);
        if c.score > 0.0 && relevant == top_k && !is_profile {
            continue;
        }
        let cost = memory_tokens(&c.memory);
        if tokens + cost > max_tokens {
            continue;
        }
        if c.score > 0.0 {
            if relevant == top_k {
                continue;
            }
            relevant += 1;
        }
        tokens += cost;
        chosen.push(c);
    }
    chosen
}

/// The one system message holding `chosen`.
pub fn render(chosen: &[Chosen]) -> Option<Box<RawValue>> {
    if chosen.is_empty() {
        return None;
    }
    let mut content =
        format!("{MEMORIES_MARKER}, remembered from earlier conversations; most relevant first]");
    for c in chosen {
        content.push_str(&format!(
            "\n- ({}) {}",
            c.memory.kind.as_str(),
            c.memory.text
        ));
    }
    let message = serde_json::json!({"role": "system", "content": content});
    RawValue::from_string(message.to_string()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::recall::hybrid::Fusion;
    use memproxy_base::identity::TenantId;

    #[test]
    fn memories_naming_different_things_are_never_merged_by_meaning() {
        assert!(names_differ(
            "The user supports Arsenal football club",
            "The user supports Chelsea football club"
        ));
        assert!(names_differ("Anna lives in Lisbon", "Tom lives in Madrid"));
        // The same names, in any case or place; the text's first word is not a name.
        assert!(!names_differ(
            "The user's sister Anna lives in Lisbon",
            "Anna, the user's sister, lives in Lisbon"
        ));
        assert!(!names_differ(
            "The user is vegetarian",
            "User does not eat meat"
        ));
        // A name on one side only is a detail, not another fact.
        assert!(!names_differ(
            "The user drives a Volvo",
            "The user drives a car"
        ));
    }

    fn origin() -> CandidateSource {
        CandidateSource {
            user: OwnerKey::user(&TenantId::from_token(Some("t")), "ana"),
            agent: "default".into(),
            conversation: Some("c".into()),
            turns: HashMap::from([(1, "I live in Lisbon".to_string())]),
            stated: false,
            now_ms: 1_000,
        }
    }

    /// A stored private memory of ana's, of importance 0.5, never accessed.
    fn stored(id: u64, text: &str, kind: MemoryType) -> MemoryRecord {
        MemoryRecord {
            id,
            tenant: "t".into(),
            user: "ana".into(),
            agent: "default".into(),
            kind,
            scope: MemoryScope::Private,
            text: text.into(),
            excerpt: String::new(),
            importance: 0.5,
            confidence: 0.9,
            tags: vec![],
            source: MemorySource::ImplicitInference,
            conversation: None,
            source_turns: vec![],
            version: 1,
            history: vec![],
            created_ms: 0,
            updated_ms: 0,
            last_accessed_ms: 0,
            supersedes: vec![],
            related_to: vec![],
        }
    }

    fn candidate(text: &str, kind: &str) -> Candidate {
        Candidate {
            text: text.into(),
            kind: kind.into(),
            scope: None,
            importance: 0.8,
            confidence: 0.9,
            tags: vec!["home".into()],
            source_turns: vec![1],
            supersedes: vec![],
        }
    }

    #[test]
    fn add_then_supersede_keeps_one_current_memory_with_its_history() {
        let origin = origin();
        let mut existing = HashMap::new();
        let mut next = 10;
        let mut ids = || {
            next += 1;
            Ok(next)
        };
        let (applied, changed) = apply(
            &mut existing,
            &[candidate("The user lives in Lisbon", "profile")],
            &origin,
            &mut Meanings::default(),
            &mut ids,
        )
        .unwrap();
        assert_eq!(applied.added, 1);
        let id = changed[&origin.user][0].id;
        assert_eq!(
            changed[&origin.user][0].source,
            MemorySource::ExplicitUserInput
        );
        // The same fact again changes nothing but its scores.
        let (applied, _) = apply(
            &mut existing,
            &[candidate("The user lives in Lisbon", "profile")],
            &origin,
            &mut Meanings::default(),
            &mut ids,
        )
        .unwrap();
        assert_eq!(applied.ignored, 1);
        let mut moved = candidate("The user moved from Lisbon to Berlin", "profile");
        moved.supersedes = vec![id];
        let (applied, changed) = apply(
            &mut existing,
            &[moved],
            &origin,
            &mut Meanings::default(),
            &mut ids,
        )
        .unwrap();
        assert_eq!((applied.superseded, applied.updated), (1, 0));
        let memory = &changed[&origin.user][0];
        assert_eq!(memory.id, id);
        assert_eq!(memory.version, 2);
        assert!(memory.text.contains("Berlin"));
        assert_eq!(memory.history[0].text, "The user lives in Lisbon");
        assert_eq!(existing[&origin.user].len(), 1);
    }

    #[test]
    fn bad_candidates_are_rejected_and_scopes_pick_the_owner() {
        let origin = origin();
        let mut existing = HashMap::new();
        let mut bad_type = candidate("x", "opinion");
        bad_type.kind = "opinion".into();
        let mut unsure = candidate("The user might like jazz", "preference");
        unsure.confidence = 0.1;
        let mut out_of_range = candidate("y", "semantic");
        out_of_range.importance = 1.5;
        let mut shared = candidate("Refunds need the order number", "procedural");
        shared.scope = Some("agent".into());
        let mut other_tenant = candidate("z", "semantic");
        other_tenant.scope = Some("global".into());
        let mut n = 0;
        let (applied, changed) = apply(
            &mut existing,
            &[
                bad_type,
                unsure,
                out_of_range,
                shared,
                other_tenant,
                candidate("   ", "profile"),
            ],
            &origin,
            &mut Meanings::default(),
            || {
                n += 1;
                Ok(n)
            },
        )
        .unwrap();
        assert_eq!(applied.rejected, 5);
        assert_eq!(applied.added, 1);
        let agent = OwnerKey::agent(&origin.user.tenant, "default");
        assert_eq!(changed[&agent][0].scope, MemoryScope::Agent);
    }

    #[test]
    fn decay_halves_over_the_half_life_stretched_by_importance() {
        let origin = origin();
        let mut existing = HashMap::new();
        let (_, changed) = apply(
            &mut existing,
            &[candidate("The user lives in Lisbon", "profile")],
            &origin,
            &mut Meanings::default(),
            || Ok(1),
        )
        .unwrap();
        let mut memory = changed[&origin.user][0].clone();
        memory.importance = 0.5;
        let decay = Decay {
            half_life_ms: 1000.0,
            min: 0.2,
        };
        assert!((memory.decay(1_000, decay) - 1.0).abs() < 1e-9);
        assert!((memory.decay(2_000, decay) - 0.5).abs() < 1e-9);
        memory.importance = 1.0;
        assert!(memory.decay(2_000, decay) > 0.6);
    }

    #[test]
    fn selection_takes_relevant_memories_and_the_profile_within_the_budget() {
        let user = origin().user;
        let mk = stored;
        let all = vec![
            (
                user.clone(),
                mk(
                    1,
                    "The user prefers window seats on flights",
                    MemoryType::Preference,
                ),
            ),
            (
                user.clone(),
                mk(2, "The user's dog is called Pixel", MemoryType::Episodic),
            ),
            (
                user.clone(),
                mk(3, "The user booked a hotel in Porto", MemoryType::Episodic),
            ),
        ];
        let decay = Decay {
            half_life_ms: 1e12,
            min: 0.2,
        };
        let none = HashMap::new();
        let words = |text| Ask {
            query: Query {
                text,
                vector: crate::recall::QueryVector::None,
                fusion: Fusion::default(),
                when: None,
            },
            vectors: &none,
        };
        let chosen = select(
            all.clone(),
            words("what is my dog called?"),
            0,
            decay,
            5,
            600,
        );
        let ids: Vec<u64> = chosen.iter().map(|c| c.memory.id).collect();
        assert_eq!(ids, [2, 1], "the relevant one, then the preference");
        assert!(select(all.clone(), words("dog"), 0, decay, 5, 3).is_empty());
        let old = Decay {
            half_life_ms: 1.0,
            min: 0.2,
        };
        assert!(
            select(all, words("dog"), 1_000_000, old, 5, 600).is_empty(),
            "decayed"
        );
        let message: serde_json::Value =
            serde_json::from_str(render(&chosen).unwrap().get()).unwrap();
        assert!(
            message["content"]
                .as_str()
                .unwrap()
                .starts_with(MEMORIES_MARKER)
        );
    }

    #[test]
    fn a_candidate_close_in_meaning_is_a_duplicate_and_a_new_text_a_new_vector() {
        let origin = origin();
        let mut existing = HashMap::new();
        let mut next = 0;
        let mut ids = || {
            next += 1;
            Ok(next)
        };
        let mut meanings = Meanings {
            candidates: vec![vec![1.0, 0.0, 0.0]],
            ..Meanings::default()
        };
        let (applied, _) = apply(
            &mut existing,
            &[candidate("The user lives in Lisbon", "profile")],
            &origin,
            &mut meanings,
            &mut ids,
        )
        .unwrap();
        assert_eq!(applied.added, 1);
        assert!(meanings.renewed.contains(&1) && meanings.memories.contains_key(&1));
        // Other words, the same meaning: the stored one's scores are raised, no new text.
        let mut paraphrase = candidate("Lisbon is the user's home town", "semantic");
        paraphrase.importance = 0.95;
        let mut meanings = Meanings {
            candidates: vec![vec![0.99, 0.1, 0.0]],
            memories: HashMap::from([(1, vec![1.0, 0.0, 0.0])]),
            ..Meanings::default()
        };
        let (applied, changed) = apply(
            &mut existing,
            std::slice::from_ref(&paraphrase),
            &origin,
            &mut meanings,
            &mut ids,
        )
        .unwrap();
        assert_eq!((applied.ignored, applied.added), (1, 0));
        assert_eq!(changed[&origin.user][0].importance, 0.95);
        assert!(meanings.renewed.is_empty());
        // Far in meaning: added.
        let mut meanings = Meanings {
            candidates: vec![vec![0.0, 1.0, 0.0]],
            memories: HashMap::from([(1, vec![1.0, 0.0, 0.0])]),
            ..Meanings::default()
        };
        let (applied, _) = apply(
            &mut existing,
            &[paraphrase],
            &origin,
            &mut meanings,
            &mut ids,
        )
        .unwrap();
        assert_eq!(applied.added, 1);
    }

    #[test]
    fn selection_by_meaning_finds_a_memory_sharing_no_word() {
        let user = origin().user;
        let mk = |id: u64, text: &str| stored(id, text, MemoryType::Episodic);
        let all = vec![
            (user.clone(), mk(1, "The user drives a silver Volvo")),
            (user.clone(), mk(2, "The user booked a hotel in Porto")),
        ];
        let vectors = HashMap::from([(1, vec![0.9, 0.1]), (2, vec![0.1, 0.9])]);
        let decay = Decay {
            half_life_ms: 1e12,
            min: 0.2,
        };
        let ask = |vector| Ask {
            query: Query {
                text: "what kind of automobile do I own?",
                vector,
                fusion: Fusion {
                    lexical_weight: 0.5,
                    floor: 0.3,
                    relative_floor: 0.0,
                    feedback: false,
                },
                when: None,
            },
            vectors: &vectors,
        };
        assert!(select(all.clone(), ask(None.into()), 0, decay, 1, 600).is_empty());
        let chosen = select(all, ask(Some(&[1.0f32, 0.0][..]).into()), 0, decay, 1, 600);
        assert_eq!(chosen.len(), 1);
        assert_eq!(chosen[0].memory.id, 1);
        assert!(chosen[0].score > 0.0);
    }
}
