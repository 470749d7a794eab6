//! Vectors for recall by meaning (#24): one embedding per stored message, and one per owner's
//! record (long-term memory's archive and memories), each of one embedding space (the
//! embedder's id, e.g. `all-MiniLM-L6-v2/static/256`). This file owns their format and the
//! store's side of them: quantised, sealed with the conversation's (owner's) key like message
//! bodies (`seal.rs`), written only for what is still stored, read back by turn (record id).
//! Each engine keeps them beside what they describe and removes them with it, in the same atomic
//! step (`engine.rs`, [`Vectors`](super::Vectors)), so a delete that erases a conversation
//! erases its vectors too: they are derived from its text.
//!
//! What to embed, when, and with which model is not decided here (the embedding job and
//! recall are the memory core's); nor are vectors exported: they are rebuilt.
//!
//! # Format
//!
//! A vector is quantised to int8 with one f32 scale (`max |x| / 127`; a component is
//! `round(x / scale)`, read back as `q × scale`), then sealed (`seal.rs`, associated data
//! `memproxy vector`) as the bytes: a format byte (1), 8 bytes of a SHA-256 of the space id, the
//! scale (f32, little-endian), one byte per dimension. Sealed, that is `sealed:v1:` and the
//! base64 of a 12-byte nonce, those `13 + dims` bytes and a 16-byte tag: for 256 dimensions
//! 297 bytes before base64, 406 stored. A turn (record) holds one vector, of one space: writing
//! another space's replaces it; reading asks for one space and skips the others.

use sha2::{Digest, Sha256};

use super::keys::Key;
use super::owners::OwnerHandle;
use super::seal::{self, Kind, SEALED_PREFIX};
use super::{Conversation, Store, StoreError, StoredMessage};

/// An owner's record's vector as the store reads it: the record id and the embedding.
pub type RecordVector = (Vec<u8>, Vec<f32>);

/// The format byte of a vector's sealed bytes.
const FORMAT: u8 = 1;

/// Bytes of the space's tag.
const TAG_LEN: usize = 8;

/// Bytes before the components: format, space tag, scale.
const HEADER_LEN: usize = 1 + TAG_LEN + 4;

/// Records of an owner's space looked at in one page when finding those without a vector.
const PAGE: usize = 1000;

/// The tag of embedding space `space`: 8 bytes of its SHA-256.
fn space_tag(space: &str) -> [u8; TAG_LEN] {
    let digest = Sha256::digest(space.as_bytes());
    let mut tag = [0u8; TAG_LEN];
    tag.copy_from_slice(&digest[..TAG_LEN]);
    tag
}

/// A vector quantised ([`quantise`]): one int8 per component and the scale that gives the
/// components back (`q × scale`). What the store seals and the recall indexes
/// (`memproxy-core`'s `recall/vectors.rs`) hold: a vector made in a commit is quantised once
/// for both, and one read back is not widened to floats on its way into an index.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantised {
    pub scale: f32,
    pub values: Vec<i8>,
}

impl Quantised {
    /// The components back as floats.
    pub fn to_floats(&self) -> Vec<f32> {
        self.values
            .iter()
            .map(|&q| f32::from(q) * self.scale)
            .collect()
    }
}

/// `vector` quantised: its scale and one int8 per component; `None` when it is empty or holds
/// a value that is not finite. The one quantisation of vectors: the store's records and the
/// recall indexes hold the same bytes.
pub fn quantise(vector: &[f32]) -> Option<Quantised> {
    if vector.is_empty() || vector.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let max = vector.iter().fold(0f32, |max, x| max.max(x.abs()));
    let scale = max / 127.0;
    if scale == 0.0 || !scale.is_finite() {
        return Some(Quantised {
            scale: 0.0,
            values: vec![0; vector.len()],
        });
    }
    let values = vector.iter().map(|x| round_to_step(x / scale)).collect();
    Some(Quantised { scale, values })
}

/// `y` (finite, within a little of ±127) rounded half away from zero, clamped to ±127: what
/// `y.round().clamp(-127.0, 127.0) as i8` gives, without `round`, which x86-64's baseline
/// instructions lack (a call for each component: half of quantising a vector). `y as i32`
/// truncates towards zero, and `y` less its integer part is exact below 2^23.
fn round_to_step(y: f32) -> i8 {
    let whole = y as i32;
    let part = y - whole as f32;
    let rounded = if part >= 0.5 {
        whole + 1
    } else if part <= -0.5 {
        whole - 1
    } else {
        whole
    };
    rounded.clamp(-127, 127) as i8
}

/// The plaintext of `vector` of the space tagged `tag`.
fn encode(tag: &[u8; TAG_LEN], vector: &Quantised) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER_LEN + vector.values.len());
    bytes.push(FORMAT);
    bytes.extend_from_slice(tag);
    bytes.extend_from_slice(&vector.scale.to_le_bytes());
    bytes.extend(vector.values.iter().map(|q| q.to_le_bytes()[0]));
    bytes
}

/// The vector in the plaintext `bytes` when it is of the space tagged `tag`.
fn decode(tag: &[u8; TAG_LEN], bytes: &[u8]) -> Result<Option<Quantised>, StoreError> {
    let malformed = || StoreError::Corrupt("a stored vector is malformed".into());
    if bytes.len() <= HEADER_LEN || bytes[0] != FORMAT {
        return Err(malformed());
    }
    if bytes[1..=TAG_LEN] != tag[..] {
        return Ok(None);
    }
    let scale: [u8; 4] = bytes[1 + TAG_LEN..HEADER_LEN]
        .try_into()
        .map_err(|_| malformed())?;
    let values: Vec<i8> = bytes[HEADER_LEN..]
        .iter()
        .map(|&b| i8::from_le_bytes([b]))
        .collect();
    Ok(Some(Quantised {
        scale: f32::from_le_bytes(scale),
        values,
    }))
}

/// The vectors of a change's added messages (`added.of`: one per message of `add`, whose turns
/// are assigned), sealed with the conversation's `key` as [`Store::put_vectors`] seals them,
/// by turn; a vector that could not be quantised (`None`) is left out, as there.
pub(crate) fn seal_added(
    key: &Key,
    added: &crate::AddedVectors,
    add: &[StoredMessage],
) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
    let tag = space_tag(&added.space);
    let mut sealed = Vec::with_capacity(added.of.len());
    for (message, vector) in add.iter().zip(&added.of) {
        if let Some(vector) = vector {
            sealed.push((message.turn, seal_quantised(key, &tag, vector)?));
        }
    }
    Ok(sealed)
}

/// `vector` of the space tagged `tag`, sealed with `key` as an engine stores it; `None` when it
/// cannot be quantised (empty, or a value that is not finite).
fn seal_vector(
    key: &Key,
    tag: &[u8; TAG_LEN],
    vector: &[f32],
) -> Result<Option<Vec<u8>>, StoreError> {
    match quantise(vector) {
        Some(vector) => Ok(Some(seal_quantised(key, tag, &vector)?)),
        None => Ok(None),
    }
}

/// `vector` of the space tagged `tag`, sealed with `key` as an engine stores it.
fn seal_quantised(
    key: &Key,
    tag: &[u8; TAG_LEN],
    vector: &Quantised,
) -> Result<Vec<u8>, StoreError> {
    Ok(seal::seal(key, Kind::Vector, &encode(tag, vector))?.into_bytes())
}

/// The vector an engine stored as `stored`, opened with `key`, when it is of the space tagged
/// `tag`.
fn open_vector(
    key: &Key,
    tag: &[u8; TAG_LEN],
    stored: &[u8],
) -> Result<Option<Quantised>, StoreError> {
    let sealed = std::str::from_utf8(stored)
        .ok()
        .and_then(|v| v.strip_prefix(SEALED_PREFIX))
        .ok_or_else(|| StoreError::Corrupt("a stored vector is not sealed".into()))?;
    decode(tag, &seal::open(key, Kind::Vector, sealed)?)
}

impl Store {
    /// Stores `vectors` (turn, embedding) of `space` for the conversation as the caller holds
    /// it (locked, refreshed): only for turns it holds that are still stored when the engine
    /// writes (a turn trimmed, replaced or moved to a closed branch meanwhile gets none; nor
    /// does anything once the conversation was deleted, even if started again: that is another
    /// id). A turn's vector of another space is replaced. Returns how many were written; an
    /// empty vector or one holding a value that is not finite is not (nor counted).
    pub fn put_vectors(
        &self,
        conversation: &Conversation,
        space: &str,
        vectors: &[(u64, Vec<f32>)],
    ) -> Result<usize, StoreError> {
        let put = self.put_conversation_vectors(conversation, space, vectors);
        self.watch(put)
    }

    fn put_conversation_vectors(
        &self,
        conversation: &Conversation,
        space: &str,
        vectors: &[(u64, Vec<f32>)],
    ) -> Result<usize, StoreError> {
        let Some(meta) = &conversation.meta else {
            return Ok(0);
        };
        let held = |turn: &u64| conversation.position(*turn).is_some();
        let wanted: Vec<&(u64, Vec<f32>)> = vectors.iter().filter(|(t, _)| held(t)).collect();
        if wanted.is_empty() {
            return Ok(0);
        }
        let (key, created) = self.sealing_key(&conversation.key, meta.id)?;
        let tag = space_tag(space);
        let mut sealed = Vec::with_capacity(wanted.len());
        for (turn, vector) in wanted {
            if let Some(value) = seal_vector(&key, &tag, vector)? {
                sealed.push((*turn, value));
            }
        }
        match self
            .engine
            .put_vectors(&conversation.key, meta.id, &sealed)?
        {
            Some(written) => Ok(written),
            None => {
                // The conversation is gone (ids are never reused): a key made for it now goes.
                if created {
                    self.drop_unused_key(&conversation.key, meta.id);
                }
                Ok(0)
            }
        }
    }

    /// The conversation's vectors of `space` (turn, embedding as stored, quantised), by turn,
    /// for the turns the caller's conversation holds: one engine read for the whole
    /// conversation (what building its recall index asks for).
    pub fn vectors(
        &self,
        conversation: &Conversation,
        space: &str,
    ) -> Result<Vec<(u64, Quantised)>, StoreError> {
        let Some(meta) = &conversation.meta else {
            return Ok(Vec::new());
        };
        let stored = self.unreachable_is_down(self.engine.vectors(&conversation.key, meta.id))?;
        if stored.is_empty() {
            return Ok(Vec::new());
        }
        let key = self
            .keys
            .get(&conversation.key, meta.id)?
            .ok_or(StoreError::KeyMissing(meta.id))?;
        let tag = space_tag(space);
        let mut out = Vec::with_capacity(stored.len());
        for (turn, value) in stored {
            if conversation.position(turn).is_none() {
                continue;
            }
            if let Some(vector) = open_vector(&key, &tag, &value)? {
                out.push((turn, vector));
            }
        }
        Ok(out)
    }

    /// The turns the conversation holds that have no vector of `space` (none, or another
    /// space's), in turn order: what a rebuild embeds (walking conversations with
    /// [`Store::scan`] or [`Store::list`]).
    pub fn turns_without_vectors(
        &self,
        conversation: &Conversation,
        space: &str,
    ) -> Result<Vec<u64>, StoreError> {
        let have: Vec<u64> = self
            .vectors(conversation, space)?
            .into_iter()
            .map(|(turn, _)| turn)
            .collect();
        Ok(conversation
            .entries
            .iter()
            .map(|e| e.turn)
            .filter(|turn| have.binary_search(turn).is_err())
            .collect())
    }

    /// Stores `vectors` (record space, record id, embedding) of embedding space `space` for the
    /// owner's records, sealed with the owner's key: only for records still stored when the
    /// engine writes, and nothing once the owner was deleted. A record's vector of another
    /// space is replaced. Returns how many were written (not an empty vector, nor one holding
    /// a value that is not finite).
    pub fn put_owner_vectors(
        &self,
        handle: &OwnerHandle,
        space: &str,
        vectors: &[(u8, Vec<u8>, Vec<f32>)],
    ) -> Result<usize, StoreError> {
        let tag = space_tag(space);
        let mut sealed = Vec::with_capacity(vectors.len());
        for (records, id, vector) in vectors {
            if let Some(value) = seal_vector(&handle.key, &tag, vector)? {
                sealed.push((*records, id.clone(), value));
            }
        }
        if sealed.is_empty() {
            return Ok(0);
        }
        let written = self
            .engine
            .put_owner_vectors(&handle.owner, handle.id, &sealed);
        Ok(self.watch(written)?.unwrap_or(0))
    }

    /// The vectors of `space` of the owner's records in record space `records` (record id,
    /// embedding), by id, in one engine read.
    pub fn owner_vectors(
        &self,
        handle: &OwnerHandle,
        records: u8,
        space: &str,
    ) -> Result<Vec<RecordVector>, StoreError> {
        let stored = self.unreachable_is_down(self.engine.owner_vectors(&handle.owner, records))?;
        let tag = space_tag(space);
        let mut out = Vec::with_capacity(stored.len());
        for (id, value) in stored {
            if let Some(vector) = open_vector(&handle.key, &tag, &value)? {
                out.push((id, vector.to_floats()));
            }
        }
        Ok(out)
    }

    /// The ids of the owner's records in record space `records` that have no vector of
    /// `space`, in id order: what a rebuild embeds (walking owners with [`Store::owners`]).
    pub fn owner_records_without_vectors(
        &self,
        handle: &OwnerHandle,
        records: u8,
        space: &str,
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        let have: Vec<Vec<u8>> = self
            .owner_vectors(handle, records, space)?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        let mut out = Vec::new();
        let mut after: Option<Vec<u8>> = None;
        loop {
            let (page, next) =
                self.engine
                    .owner_records(&handle.owner, records, after.as_deref(), PAGE)?;
            out.extend(
                page.into_iter()
                    .map(|record| record.id)
                    .filter(|id| have.binary_search(id).is_err()),
            );
            match next {
                Some(next) => after = Some(next),
                None => return Ok(out),
            }
        }
    }

    /// How many vectors the engine holds, of every conversation and owner: a full scan, to
    /// prove a deletion left none (tests, audits).
    pub fn vector_count(&self) -> Result<u64, StoreError> {
        self.engine.vector_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine(a: &[f32], b: &[f32]) -> f32 {
        let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        dot / (norm(a) * norm(b))
    }

    /// A deterministic vector of `dims` components, roughly normal.
    fn vector(seed: u64, dims: usize) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (0..dims)
            .map(|_| {
                let mut sum = 0.0;
                for _ in 0..4 {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    sum += (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                }
                sum
            })
            .collect()
    }

    #[test]
    fn a_step_is_rounded_as_round_does_halves_away_from_zero() {
        let mut values = vec![
            0.0f32, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 127.0, -127.0, 127.00002,
            -127.00002, 130.0, -130.0, 1e-30, -1e-30,
        ];
        // The values next to every half step, and next to the whole ones.
        for whole in -128..=128 {
            for step in [whole as f32, whole as f32 + 0.5] {
                values.extend([step.next_down(), step, step.next_up()]);
            }
        }
        for y in values {
            assert_eq!(
                round_to_step(y),
                y.round().clamp(-127.0, 127.0) as i8,
                "{y:e}"
            );
        }
    }

    #[test]
    fn a_quantised_vector_reads_back_within_half_a_step_and_points_the_same_way() {
        for (seed, dims) in [(1, 256), (2, 384), (3, 768), (4, 3), (5, 1)] {
            let original = vector(seed, dims);
            let quantised = quantise(&original).unwrap();
            assert_eq!(quantised.values.len(), dims);
            let back = quantised.to_floats();
            let max = original.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (x, y) in original.iter().zip(&back) {
                // Rounding: at most half a step (max / 254), plus float error.
                assert!((x - y).abs() <= max / 254.0 * 1.0001, "{x} {y}");
            }
            let similarity = cosine(&original, &back);
            assert!(similarity >= 0.999, "{dims} dims: cosine {similarity}");
        }
        // The largest component is exact in magnitude, at ±127.
        let quantised = quantise(&[0.5, -1.0, 0.25]).unwrap();
        assert_eq!(quantised.values, [64, -127, 32]);
        assert!((quantised.scale - 1.0 / 127.0).abs() < 1e-9);
        assert_eq!(
            quantise(&[0.0, 0.0]).unwrap(),
            Quantised {
                scale: 0.0,
                values: vec![0, 0]
            }
        );
        assert!(quantise(&[]).is_none());
        assert!(quantise(&[1.0, f32::NAN]).is_none());
        assert!(quantise(&[f32::INFINITY]).is_none());
    }

    #[test]
    fn a_sealed_vector_opens_with_its_key_and_space_only() {
        use ring::aead::{AES_256_GCM, LessSafeKey, UnboundKey};
        let key = |b: u8| -> Key {
            std::sync::Arc::new(LessSafeKey::new(
                UnboundKey::new(&AES_256_GCM, &[b; 32]).unwrap(),
            ))
        };
        let original = vector(7, 256);
        let space = space_tag("all-MiniLM-L6-v2/static/256");
        let stored = seal_vector(&key(1), &space, &original).unwrap().unwrap();
        // `sealed:v1:` and base64 of nonce, 13 + 256 bytes and the tag.
        assert_eq!(stored.len(), SEALED_PREFIX.len() + 396);
        assert!(stored.starts_with(SEALED_PREFIX.as_bytes()));
        let back = open_vector(&key(1), &space, &stored).unwrap().unwrap();
        assert_eq!(back, quantise(&original).unwrap());
        assert!(cosine(&original, &back.to_floats()) >= 0.999);
        assert!(open_vector(&key(2), &space, &stored).is_err());
        assert!(
            open_vector(&key(1), &space_tag("other/space"), &stored)
                .unwrap()
                .is_none()
        );
        assert!(seal_vector(&key(1), &space, &[]).unwrap().is_none());
    }

    // The store's side, on each engine: sealing, spaces, and every way a message leaves.

    use crate::tests::{key, message};
    use crate::{Change, ImportMeta, LedgerTotals, lock};
    use memproxy_base::message::Role;

    /// Commits `texts` to conversation `name` (alternating user and assistant).
    fn commit(store: &Store, name: &str, texts: &[&str]) {
        let handle = store.conversation(&key(name)).unwrap();
        let mut conv = lock(&handle);
        let add = texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                message(
                    if i % 2 == 0 {
                        Role::User
                    } else {
                        Role::Assistant
                    },
                    t,
                )
            })
            .collect();
        store
            .commit(
                &mut conv,
                Change {
                    add,
                    ledger: LedgerTotals::default(),
                    ..Change::default()
                },
            )
            .unwrap();
    }

    /// Puts a vector of `space` for each of `turns` of conversation `name`, as the embedding
    /// job does (under the lock, refreshed first); the count written.
    fn embed(store: &Store, name: &str, space: &str, turns: &[u64]) -> usize {
        let handle = store.conversation(&key(name)).unwrap();
        let mut conv = lock(&handle);
        store.refresh(&mut conv).unwrap();
        let vectors: Vec<(u64, Vec<f32>)> = turns.iter().map(|&t| (t, vector(t, 16))).collect();
        store.put_vectors(&conv, space, &vectors).unwrap()
    }

    fn turns_of(store: &Store, name: &str, space: &str) -> Vec<u64> {
        let handle = store.conversation(&key(name)).unwrap();
        let conv = lock(&handle);
        store
            .vectors(&conv, space)
            .unwrap()
            .into_iter()
            .map(|(turn, _)| turn)
            .collect()
    }

    const SPACE: &str = "all-MiniLM-L6-v2/static/256";

    fn vectors_round_trip_sealed_and_one_space_per_turn(store: &Store) {
        commit(store, "c", &["q1", "a1", "q2", "a2"]);
        assert_eq!(embed(store, "c", SPACE, &[1, 2, 3, 99]), 3);
        let handle = store.conversation(&key("c")).unwrap();
        {
            let conv = lock(&handle);
            let read = store.vectors(&conv, SPACE).unwrap();
            assert_eq!(read.iter().map(|(t, _)| *t).collect::<Vec<_>>(), [1, 2, 3]);
            for (turn, back) in &read {
                assert_eq!(*back, quantise(&vector(*turn, 16)).unwrap());
            }
            assert_eq!(store.turns_without_vectors(&conv, SPACE).unwrap(), [4]);
            // Empty, or not finite: not written, not counted.
            assert_eq!(
                store
                    .put_vectors(&conv, SPACE, &[(4, vec![]), (4, vec![f32::NAN])])
                    .unwrap(),
                0
            );
        }
        // Sealed: the engine holds no component's bytes in the clear.
        let quantised = quantise(&vector(2, 16)).unwrap();
        let mut plain = quantised.scale.to_le_bytes().to_vec();
        plain.extend(quantised.values.iter().map(|q| q.to_le_bytes()[0]));
        assert!(!store.engine.any_trace_of(&plain).unwrap());
        // Another space replaces a turn's vector: each space reads only its own.
        assert_eq!(embed(store, "c", "other/space", &[2]), 1);
        assert_eq!(turns_of(store, "c", SPACE), [1, 3]);
        assert_eq!(turns_of(store, "c", "other/space"), [2]);
        let conv = lock(&handle);
        assert_eq!(store.turns_without_vectors(&conv, SPACE).unwrap(), [2, 4]);
        assert_eq!(store.vector_count().unwrap(), 3);
        // The conversation's version is untouched: a request planned before commits.
        drop(conv);
        commit(store, "c", &["q3"]);
    }

    fn every_way_a_message_leaves_takes_its_vector(store: &Store) {
        commit(store, "c", &["q1", "a1", "q2", "a2", "q3", "a3"]);
        assert_eq!(embed(store, "c", SPACE, &[1, 2, 3, 4, 5, 6]), 6);
        let handle = store.conversation(&key("c")).unwrap();
        {
            // Trimmed rounds, and a replaced reply (6 removed, its new version added).
            let mut conv = lock(&handle);
            let change = Change {
                remove_turns: vec![1, 2, 6],
                add: vec![message(Role::Assistant, "a3 again")],
                ..Change::default()
            };
            store.commit(&mut conv, change).unwrap();
        }
        assert_eq!(turns_of(store, "c", SPACE), [3, 4, 5]);
        assert_eq!(embed(store, "c", SPACE, &[7]), 1);
        {
            // A branch closed from turn 4 takes 4, 5 and 7 off the main line.
            let mut conv = lock(&handle);
            let change = Change {
                add: vec![message(Role::User, "q2 edited")],
                branch_from_turn: Some(4),
                ..Change::default()
            };
            store.commit(&mut conv, change).unwrap();
            assert_eq!(
                conv.entries.iter().map(|e| e.turn).collect::<Vec<_>>(),
                [3, 8]
            );
        }
        assert_eq!(turns_of(store, "c", SPACE), [3]);
        assert_eq!(store.vector_count().unwrap(), 1);

        // A delete, and the TTL sweeper's idle delete.
        commit(store, "idle", &["q1", "a1"]);
        assert_eq!(embed(store, "idle", SPACE, &[1, 2]), 2);
        store.delete_conversation(&key("c")).unwrap().unwrap();
        assert_eq!(store.vector_count().unwrap(), 2);
        store
            .delete_idle_conversation(&key("idle"), i64::MAX)
            .unwrap()
            .unwrap();
        assert_eq!(store.vector_count().unwrap(), 0);

        // Started again at the same key (a new id, the same turns): nothing of the old life,
        // and a job still holding the old life writes nothing.
        commit(store, "again", &["q1", "a1"]);
        let old = store.load(&key("again")).unwrap();
        assert_eq!(embed(store, "again", SPACE, &[1, 2]), 2);
        store.delete_conversation(&key("again")).unwrap().unwrap();
        commit(store, "again", &["new q1", "new a1"]);
        assert_eq!(
            store
                .put_vectors(&old, SPACE, &[(1, vector(1, 16))])
                .unwrap(),
            0
        );
        assert!(turns_of(store, "again", SPACE).is_empty());
        assert_eq!(store.vector_count().unwrap(), 0);
    }

    fn an_import_leaves_no_vector_of_a_turn_it_replaced(store: &Store) {
        commit(store, "c", &["q1", "a1", "q2", "a2"]);
        assert_eq!(embed(store, "c", SPACE, &[1, 2, 3, 4]), 4);
        let meta = store.meta(&key("c")).unwrap().unwrap();
        let exported = store.all_messages(&key("c"), &meta).unwrap();
        // Imported over what it holds: only appended turns, the stored ones keep theirs.
        let mut more = exported.clone();
        more.push(message(Role::User, "q3"));
        let imported = store
            .import_conversation(&key("c"), more, vec![], vec![], ImportMeta::default())
            .unwrap();
        assert_eq!(imported.added, 1);
        let handle = store.conversation(&key("c")).unwrap();
        assert_eq!(
            store.turns_without_vectors(&lock(&handle), SPACE).unwrap(),
            [5]
        );
        // Deleted, then imported back (the same turns, a new life): no vector of the old one.
        store.delete_conversation(&key("c")).unwrap().unwrap();
        store
            .import_conversation(&key("c"), exported, vec![], vec![], ImportMeta::default())
            .unwrap();
        assert_eq!(store.vector_count().unwrap(), 0);
        assert!(turns_of(store, "c", SPACE).is_empty());
        let handle = store.conversation(&key("c")).unwrap();
        assert_eq!(
            store.turns_without_vectors(&lock(&handle), SPACE).unwrap(),
            [1, 2, 3, 4]
        );
    }

    fn owner_vectors_are_sealed_by_record_and_gone_with_the_owner(store: &Store) {
        use memproxy_base::identity::TenantId;
        let owner = crate::OwnerKey::user(&TenantId::from_token(Some("t")), "ana");
        let handle = store.owner(&owner, true).unwrap().unwrap();
        let put = vec![
            (3, b"m1".to_vec(), b"Lives in Lisbon".to_vec()),
            (3, b"m2".to_vec(), b"Likes jazz".to_vec()),
            (1, b"t1".to_vec(), b"archived turn".to_vec()),
        ];
        assert!(store.write_owner(&handle, put, &[]).unwrap());
        let vectors = vec![
            (3, b"m2".to_vec(), vector(2, 16)),
            (3, b"m1".to_vec(), vector(1, 16)),
            (3, b"gone".to_vec(), vector(3, 16)),
            (1, b"t1".to_vec(), vector(4, 16)),
        ];
        assert_eq!(
            store.put_owner_vectors(&handle, SPACE, &vectors).unwrap(),
            3
        );
        let memories = store.owner_vectors(&handle, 3, SPACE).unwrap();
        assert_eq!(
            memories
                .iter()
                .map(|(id, _)| id.as_slice())
                .collect::<Vec<_>>(),
            [b"m1".as_slice(), b"m2"]
        );
        assert!(cosine(&memories[0].1, &vector(1, 16)) >= 0.999);
        assert!(
            store
                .owner_vectors(&handle, 3, "other/space")
                .unwrap()
                .is_empty()
        );
        assert!(
            store
                .owner_records_without_vectors(&handle, 3, SPACE)
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            store
                .owner_records_without_vectors(&handle, 1, "other/space")
                .unwrap(),
            [b"t1".to_vec()]
        );
        // A memory removed takes its vector.
        assert!(
            store
                .write_owner(&handle, Vec::new(), &[(3, b"m2".to_vec())])
                .unwrap()
        );
        assert_eq!(store.owner_vectors(&handle, 3, SPACE).unwrap().len(), 1);
        assert_eq!(store.vector_count().unwrap(), 2);
        // The user deleted: none left, and a late job writes nothing.
        assert!(store.delete_owner(&owner).unwrap());
        assert_eq!(store.vector_count().unwrap(), 0);
        assert_eq!(
            store
                .put_owner_vectors(&handle, SPACE, &[(3, b"m1".to_vec(), vector(1, 16))])
                .unwrap(),
            0
        );
        assert_eq!(store.vector_count().unwrap(), 0);
    }

    /// Runs each test on a store over sled and over Redis.
    macro_rules! on_each_engine {
        ($($test:ident),*) => {
            mod sled {
                $(
                    #[tokio::test]
                    async fn $test() {
                        let dir = tempfile::tempdir().unwrap();
                        let store = crate::Store::open(dir.path(), crate::tests::options()).unwrap();
                        super::$test(&store);
                    }
                )*
            }
            mod redis {
                $(
                    #[tokio::test]
                    async fn $test() {
                        let server = crate::contract::redis_server::RedisServer::start();
                        let engine = crate::RedisEngine::open(
                            &crate::contract::redis_options(&server.url()),
                        )
                        .unwrap();
                        let dir = tempfile::tempdir().unwrap();
                        let store = crate::Store::with_engine(
                            crate::Backing::Shared(std::sync::Arc::new(engine)),
                            dir.path(),
                            crate::tests::options(),
                        )
                        .unwrap();
                        super::$test(&store);
                    }
                )*
            }
        };
    }

    on_each_engine!(
        vectors_round_trip_sealed_and_one_space_per_turn,
        every_way_a_message_leaves_takes_its_vector,
        an_import_leaves_no_vector_of_a_turn_it_replaced,
        owner_vectors_are_sealed_by_record_and_gone_with_the_owner
    );
}
