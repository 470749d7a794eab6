//! Sealing: every message body and summary record is encrypted with its conversation's key
//! (`keys.rs`) here, above the engine, before it is written, and opened here when read. Every
//! engine therefore holds only ciphertext for them, and a delete, which removes the key, leaves
//! nothing readable behind, whatever old bytes the engine's files (or their backups) still hold.
//!
//! # Format
//!
//! `sealed:v1:` and then, in base64 (standard alphabet, no padding), a random 96-bit nonce,
//! the AES-256-GCM ciphertext and its 128-bit tag. The associated data names what the value is
//! (`memproxy message`, `memproxy summary`, `memproxy record`, `memproxy vector`), so one is
//! never opened as another. A message
//! body is stored as that text in a JSON string, so [`StoredMessage`] keeps its shape and an
//! engine still reads turn, role, tokens and fingerprint; a summary record is stored as that
//! text.
//!
//! # What is not sealed
//!
//! Conversation records (id, counts, times), the engine's keys (tenant hash, agent,
//! conversation id; a vector's key is its conversation id and turn, `vectors.rs`), TTL records, and each message's role, origin, time, token count and
//! fingerprint (a hash of its text). Values stored by an earlier version (a message body or a
//! summary record that is a JSON object) are read as they are and stay in plaintext until
//! they are rewritten (trimmed, or deleted with their conversation); such a conversation gets
//! its key at its next write.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD_NO_PAD as BASE64;
use ring::aead::{Aad, LessSafeKey, NONCE_LEN, Nonce};
use ring::rand::{SecureRandom, SystemRandom};
use serde_json::value::RawValue;

use super::engine::{Version, Write};
use super::keys::Key;
use super::records::StoredMessage;
use super::{Conversation, Store, StoreError};
use memproxy_base::identity::ConversationKey;

/// What every sealed value starts with.
pub const SEALED_PREFIX: &str = "sealed:v1:";

/// Bytes of the tag AES-GCM appends.
const TAG_LEN: usize = 16;

/// What a sealed value is: the associated data it is sealed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Message,
    Summary,
    /// An owner's long-term record (`owners.rs`).
    Record,
    /// A vector of a message or of an owner's record (`vectors.rs`).
    Vector,
}

impl Kind {
    fn aad(self) -> Aad<&'static [u8]> {
        Aad::from(match self {
            Kind::Message => b"memproxy message".as_slice(),
            Kind::Summary => b"memproxy summary".as_slice(),
            Kind::Record => b"memproxy record".as_slice(),
            Kind::Vector => b"memproxy vector".as_slice(),
        })
    }
}

fn unreadable() -> StoreError {
    StoreError::Corrupt("a sealed value could not be opened (wrong key, or damaged)".into())
}

/// `plaintext` sealed with `key`: `sealed:v1:<base64 of nonce, ciphertext, tag>`.
pub fn seal(key: &LessSafeKey, kind: Kind, plaintext: &[u8]) -> Result<String, StoreError> {
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| StoreError::Crypto("no random bytes for a nonce"))?;
    let mut bytes = Vec::with_capacity(NONCE_LEN + plaintext.len() + TAG_LEN);
    bytes.extend_from_slice(&nonce);
    bytes.extend_from_slice(plaintext);
    let tag = key
        .seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(nonce),
            kind.aad(),
            &mut bytes[NONCE_LEN..],
        )
        .map_err(|_| StoreError::Crypto("sealing failed"))?;
    bytes.extend_from_slice(tag.as_ref());
    let mut text = String::with_capacity(SEALED_PREFIX.len() + bytes.len().div_ceil(3) * 4);
    text.push_str(SEALED_PREFIX);
    BASE64.encode_string(&bytes, &mut text);
    Ok(text)
}

/// The plaintext of `sealed` (what follows [`SEALED_PREFIX`]); an error when `key` is not the
/// one it was sealed with, or when it was changed.
pub fn open(key: &LessSafeKey, kind: Kind, sealed: &str) -> Result<Vec<u8>, StoreError> {
    let mut bytes = BASE64.decode(sealed).map_err(|_| unreadable())?;
    if bytes.len() < NONCE_LEN + TAG_LEN {
        return Err(unreadable());
    }
    let nonce = Nonce::try_assume_unique_for_key(&bytes[..NONCE_LEN]).map_err(|_| unreadable())?;
    let len = key
        .open_within(nonce, kind.aad(), &mut bytes, NONCE_LEN..)
        .map_err(|_| unreadable())?
        .len();
    bytes.truncate(len);
    Ok(bytes)
}

/// The sealed part of a stored message body (a JSON string `"sealed:v1:…"`); `None` for a
/// body stored in plaintext (a JSON object).
pub(super) fn sealed_message(body: &RawValue) -> Option<&str> {
    body.get()
        .strip_prefix('"')?
        .strip_suffix('"')?
        .strip_prefix(SEALED_PREFIX)
}

/// The sealed part of a stored summary record; `None` for a record stored in plaintext.
pub(super) fn sealed_record(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes.strip_prefix(SEALED_PREFIX.as_bytes())?).ok()
}

/// What tells one sealed value from every other without keeping it: its length, its nonce
/// and its tag (the last base64 characters, which hold the tag's 16 bytes whatever the
/// length). A value sealed again gets a new random nonce, and other contents under the same
/// key and nonce would need another tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SealedId {
    len: usize,
    nonce: [u8; 16],
    tag: [u8; 24],
}

impl SealedId {
    /// `None` for a value not sealed, which is then always opened.
    pub(super) fn of(bytes: &[u8]) -> Option<SealedId> {
        let sealed = sealed_record(bytes)?.as_bytes();
        let len = sealed.len();
        Some(SealedId {
            len,
            nonce: sealed.get(..16)?.try_into().ok()?,
            tag: sealed.get(len.checked_sub(24)?..)?.try_into().ok()?,
        })
    }
}

/// Seals the body of each of `messages` with `key`.
pub fn seal_messages(key: &LessSafeKey, messages: &mut [StoredMessage]) -> Result<(), StoreError> {
    for message in messages {
        let text = seal(key, Kind::Message, message.message.get().as_bytes())?;
        // Base64 and the prefix need no escaping in a JSON string.
        message.message = RawValue::from_string(format!("\"{text}\""))
            .map_err(|_| StoreError::Crypto("a sealed body is not a JSON string"))?;
    }
    Ok(())
}

/// A summary record (its JSON bytes) sealed with `key`.
pub fn seal_summary(key: &LessSafeKey, record: &[u8]) -> Result<Vec<u8>, StoreError> {
    Ok(seal(key, Kind::Summary, record)?.into_bytes())
}

/// The stored body `body` opened with `key`; `None` when it was stored in plaintext.
pub fn open_message(
    key: Option<&LessSafeKey>,
    id: u64,
    body: &RawValue,
) -> Result<Option<Box<RawValue>>, StoreError> {
    let Some(sealed) = sealed_message(body) else {
        return Ok(None);
    };
    let key = key.ok_or(StoreError::KeyMissing(id))?;
    let text = String::from_utf8(open(key, Kind::Message, sealed)?).map_err(|_| unreadable())?;
    RawValue::from_string(text)
        .map(Some)
        .map_err(|_| StoreError::Corrupt("an opened message body is not JSON".into()))
}

/// The stored summary record `bytes` opened with `key` (as it is when stored in plaintext).
pub fn open_summary(
    key: Option<&LessSafeKey>,
    id: u64,
    bytes: Vec<u8>,
) -> Result<Vec<u8>, StoreError> {
    match sealed_record(&bytes) {
        None => Ok(bytes),
        Some(sealed) => open(
            key.ok_or(StoreError::KeyMissing(id))?,
            Kind::Summary,
            sealed,
        ),
    }
}

impl Store {
    /// The key of conversation `id` for reading: looked up only when a value is sealed, so
    /// plaintext values of earlier versions read without one.
    fn opening_key(
        &self,
        key: &ConversationKey,
        id: u64,
        needed: bool,
    ) -> Result<Option<Key>, StoreError> {
        if needed {
            self.keys.get(key, id)
        } else {
            Ok(None)
        }
    }

    /// Opens the bodies of `messages` of conversation `id` in place.
    pub(super) fn open_messages(
        &self,
        conversation: &ConversationKey,
        id: u64,
        messages: &mut [StoredMessage],
    ) -> Result<(), StoreError> {
        let sealed = messages
            .iter()
            .any(|m| sealed_message(&m.message).is_some());
        let key = self.opening_key(conversation, id, sealed)?;
        for message in messages {
            if let Some(body) = open_message(key.as_deref(), id, &message.message)? {
                message.message = body;
            }
        }
        Ok(())
    }

    /// A stored summary record of conversation `id`, opened.
    pub(super) fn open_summary(
        &self,
        conversation: &ConversationKey,
        id: u64,
        bytes: Vec<u8>,
    ) -> Result<Vec<u8>, StoreError> {
        let key = self.opening_key(conversation, id, sealed_record(&bytes).is_some())?;
        open_summary(key.as_deref(), id, bytes)
    }

    /// The key of conversation `id` for writing (created, and durable, if it has none), and
    /// whether this call created it.
    pub(super) fn sealing_key(
        &self,
        conversation: &ConversationKey,
        id: u64,
    ) -> Result<(Key, bool), StoreError> {
        self.keys.get_or_create(conversation, id)
    }

    /// Writes `write` to `conversation` against the version it holds, and counts the
    /// messages it adds or removes. When the write is refused as stale and `new_key` names the
    /// id of a conversation that this write was to create, with a key made for it, the key
    /// goes too: the id was this writer's alone and nothing sealed with it was stored.
    pub(super) fn write_sealed(
        &self,
        conversation: &Conversation,
        write: Write<'_>,
        new_key: Option<u64>,
    ) -> Result<Version, StoreError> {
        let key = &conversation.key;
        let written = self.engine.write(key, &conversation.version, write);
        match (&written, new_key) {
            (Ok(_), _) => self.count_messages(
                conversation.meta.as_ref().map_or(0, |m| m.message_count),
                write.meta.message_count,
            ),
            (Err(StoreError::Stale), Some(id)) => self.drop_unused_key(key, id),
            _ => {}
        }
        written
    }

    /// Removes the key of a conversation whose write did not happen (a fresh id that lost a
    /// race): nothing was sealed with it for good. A failure leaves a key file that the next
    /// start removes.
    pub(super) fn drop_unused_key(&self, conversation: &ConversationKey, id: u64) {
        if let Err(err) = self.keys.remove(conversation, id) {
            tracing::warn!(error = %err, "removing an unused conversation key failed");
        }
    }

    /// After a conversation was deleted in the engine: makes the delete durable, then removes
    /// the conversation's key, so nothing sealed with it can be read again wherever its bytes
    /// lie. The flush comes first, so a crash never brings a conversation back (from the
    /// engine's log) without its key.
    pub(super) fn erase_key(
        &self,
        conversation: &ConversationKey,
        id: u64,
    ) -> Result<(), StoreError> {
        self.engine.flush()?;
        self.keys.remove(conversation, id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{key as conversation, message, options};
    use crate::{Change, ConversationMeta, SummaryRecord, lock};
    use memproxy_base::message::Role;
    use ring::aead::{AES_256_GCM, UnboundKey};
    use std::path::Path;

    fn key(byte: u8) -> LessSafeKey {
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &[byte; 32]).unwrap())
    }

    #[test]
    fn a_sealed_value_opens_with_its_key_only() {
        let text = seal(&key(1), Kind::Message, b"{\"content\":\"zebra\"}").unwrap();
        let sealed = text.strip_prefix(SEALED_PREFIX).unwrap();
        assert!(!text.contains("zebra"));
        assert_eq!(
            open(&key(1), Kind::Message, sealed).unwrap(),
            b"{\"content\":\"zebra\"}"
        );
        assert!(matches!(
            open(&key(2), Kind::Message, sealed),
            Err(StoreError::Corrupt(_))
        ));
        assert!(
            open(&key(1), Kind::Summary, sealed).is_err(),
            "a message is never opened as a summary"
        );
        let again = seal(&key(1), Kind::Message, b"{\"content\":\"zebra\"}").unwrap();
        assert_ne!(text, again, "a fresh nonce for every value");
    }

    #[test]
    fn a_changed_or_cut_sealed_value_is_refused() {
        let text = seal(&key(1), Kind::Summary, b"summary text").unwrap();
        let sealed = text.strip_prefix(SEALED_PREFIX).unwrap();
        let mut bytes = BASE64.decode(sealed).unwrap();
        for i in [0, NONCE_LEN, bytes.len() - 1] {
            bytes[i] ^= 1;
            let tampered = BASE64.encode(&bytes);
            assert!(open(&key(1), Kind::Summary, &tampered).is_err(), "byte {i}");
            bytes[i] ^= 1;
        }
        for cut in ["", "AAAA", &sealed[..sealed.len() - 4], "not base64!"] {
            assert!(open(&key(1), Kind::Summary, cut).is_err(), "{cut:?}");
        }
    }

    #[test]
    fn messages_keep_their_shape_and_plaintext_ones_pass_through() {
        let mut messages = vec![message(Role::User, "zebra secret")];
        let plain = messages[0].message.get().to_string();
        seal_messages(&key(3), &mut messages).unwrap();
        let stored = serde_json::to_string(&messages[0]).unwrap();
        assert!(!stored.contains("zebra"), "{stored}");
        let back: StoredMessage = serde_json::from_str(&stored).unwrap();
        assert_eq!(back.fingerprint, messages[0].fingerprint);
        let opened = open_message(Some(&key(3)), 9, &back.message)
            .unwrap()
            .unwrap();
        assert_eq!(opened.get(), plain);
        assert!(matches!(
            open_message(None, 9, &back.message),
            Err(StoreError::KeyMissing(9))
        ));

        // Stored by an earlier version: read as it is, with or without a key.
        let legacy = message(Role::User, "old text");
        assert!(open_message(None, 9, &legacy.message).unwrap().is_none());
        let record = b"{\"number\":1,\"text\":\"old\"}".to_vec();
        assert_eq!(open_summary(None, 9, record.clone()).unwrap(), record);
        let sealed = seal_summary(&key(3), &record).unwrap();
        assert_eq!(
            open_summary(Some(&key(3)), 9, sealed.clone()).unwrap(),
            record
        );
        assert!(matches!(
            open_summary(None, 9, sealed),
            Err(StoreError::KeyMissing(9))
        ));
    }

    fn store(dir: &Path) -> Store {
        Store::open(dir, options()).unwrap()
    }

    fn commit(store: &Store, name: &str, texts: &[&str]) -> u64 {
        let handle = store.conversation(&conversation(name)).unwrap();
        let mut conv = lock(&handle);
        let change = Change {
            add: texts.iter().map(|t| message(Role::User, t)).collect(),
            ..Change::default()
        };
        store.commit(&mut conv, change).unwrap();
        conv.meta.as_ref().unwrap().id
    }

    fn summary(number: u64, text: &str) -> SummaryRecord {
        serde_json::from_value(serde_json::json!({
            "number": number, "text": text, "from_turn": 1, "to_turn": 1, "tokens": 1,
            "original_tokens": 2, "ratio": 0.5, "from_ms": 1, "to_ms": 2, "model": "m",
            "created_ms": 3, "heuristic": false
        }))
        .unwrap()
    }

    fn key_file(dir: &Path, id: u64) -> std::path::PathBuf {
        dir.join("keys").join(format!("{id:016x}.key"))
    }

    #[tokio::test]
    async fn the_engine_holds_ciphertext_and_the_store_reads_plaintext() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let id = commit(&store, "c", &["zebra one", "zebra two"]);
        let k = conversation("c");
        {
            let handle = store.conversation(&k).unwrap();
            let conv = lock(&handle);
            assert!(
                store
                    .save_summary(&conv, id, &summary(1, "zebra summary"))
                    .unwrap()
            );
            let read = store.messages(&conv, [1, 2]).unwrap();
            assert!(read[1].message.get().contains("zebra two"));
        }
        assert!(!store.engine.any_trace_of(b"zebra").unwrap());
        assert!(store.engine.any_trace_of(SEALED_PREFIX.as_bytes()).unwrap());
        assert!(store.any_trace_of(b"zebra two").unwrap());
        assert!(store.any_trace_of(b"zebra summary").unwrap());
        assert_eq!(
            store.latest_summary(&k, id).unwrap().unwrap().text,
            "zebra summary"
        );
        let raw = store.raw_summaries(&k, id).unwrap();
        assert!(raw[0].1.get().contains("zebra summary"));
        assert!(key_file(dir.path(), id).exists());

        store.delete_conversation(&k).unwrap().unwrap();
        assert!(!key_file(dir.path(), id).exists(), "the key went with it");
        assert!(!store.any_trace_of(b"zebra").unwrap());
    }

    #[tokio::test]
    async fn a_missing_key_is_an_error_and_a_restart_keeps_keys() {
        let dir = tempfile::tempdir().unwrap();
        let (kept, lost) = {
            let store = store(dir.path());
            let kept = commit(&store, "kept", &["kept text"]);
            let lost = commit(&store, "lost", &["lost text"]);
            store.close().await.unwrap();
            (kept, lost)
        };
        std::fs::remove_file(key_file(dir.path(), lost)).unwrap();
        let store = store(dir.path());
        let meta = store.meta(&conversation("kept")).unwrap().unwrap();
        assert_eq!(meta.id, kept);
        let read = store.all_messages(&conversation("kept"), &meta).unwrap();
        assert!(read[0].message.get().contains("kept text"));
        let meta = store.meta(&conversation("lost")).unwrap().unwrap();
        let err = store
            .all_messages(&conversation("lost"), &meta)
            .unwrap_err();
        assert!(
            matches!(err, StoreError::KeyMissing(id) if id == lost),
            "{err}"
        );
        assert!(!err.to_string().contains("lost text"));
    }

    #[tokio::test]
    async fn the_newest_summary_is_opened_once_per_stored_value() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let id = commit(&store, "c", &["one", "two"]);
        let handle = store.conversation(&conversation("c")).unwrap();
        let conv = lock(&handle);
        assert_eq!(store.newest_summary(&conv).unwrap(), None);
        assert!(store.save_summary(&conv, id, &summary(1, "first")).unwrap());
        let before = conv.own_heap_bytes();
        assert_eq!(store.newest_summary(&conv).unwrap().unwrap().text, "first");
        assert!(conv.own_heap_bytes() > before, "the held record is weighed");
        // What is held is what is given while the stored value is the same…
        let held = |text: &str| {
            let mut held = conv.summary.lock().unwrap();
            held.as_mut().unwrap().record_mut().text = text.to_string();
        };
        held("held");
        assert_eq!(store.newest_summary(&conv).unwrap().unwrap().text, "held");
        // …and not once another is stored: a newer summary, or the same one sealed again.
        assert!(
            store
                .save_summary(&conv, id, &summary(2, "second"))
                .unwrap()
        );
        assert_eq!(store.newest_summary(&conv).unwrap().unwrap().text, "second");
        held("held");
        assert!(
            store
                .save_summary(&conv, id, &summary(2, "second"))
                .unwrap()
        );
        assert_eq!(store.newest_summary(&conv).unwrap().unwrap().text, "second");
        assert_eq!(
            store.newest_summary(&conv).unwrap(),
            store.latest_summary(&conv.key, id).unwrap()
        );
    }

    #[test]
    fn a_sealed_value_is_told_from_others_by_its_nonce_and_tag() {
        let record = b"{\"number\":1,\"text\":\"a summary\"}".to_vec();
        let one = seal_summary(&key(3), &record).unwrap();
        let again = seal_summary(&key(3), &record).unwrap();
        assert_eq!(SealedId::of(&one), SealedId::of(&one.clone()));
        assert_ne!(SealedId::of(&one), SealedId::of(&again));
        // A value that is not sealed has no id: it is always opened.
        assert_eq!(SealedId::of(&record), None);
        assert_eq!(SealedId::of(b"sealed:v1:short"), None);
        // Each of the tag's bytes is in the id, whatever the length's remainder by 3.
        for extra in 0..3 {
            let mut longer = record.clone();
            longer.extend(std::iter::repeat_n(b' ', extra));
            let sealed = seal_summary(&key(3), &longer).unwrap();
            let raw = BASE64.decode(sealed_record(&sealed).unwrap()).unwrap();
            for at in raw.len() - TAG_LEN..raw.len() {
                let mut changed = raw.clone();
                changed[at] ^= 1;
                let changed = format!("{SEALED_PREFIX}{}", BASE64.encode(&changed));
                assert_ne!(
                    SealedId::of(&sealed),
                    SealedId::of(changed.as_bytes()),
                    "length {}, byte {at}",
                    raw.len()
                );
            }
        }
    }

    #[tokio::test]
    async fn values_of_earlier_versions_read_as_they_are_and_new_ones_are_sealed() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let k = conversation("old");
        // Written as a version without sealing wrote it: straight to the engine.
        let id = store.engine.new_id().unwrap();
        let mut old = message(Role::User, "plain old text");
        old.turn = 1;
        let mut meta = ConversationMeta::new(id, 1);
        meta.next_turn = 2;
        meta.message_count = 1;
        let record = serde_json::to_vec(&summary(1, "plain old summary")).unwrap();
        store
            .engine
            .write(
                &k,
                &Version::absent(),
                Write {
                    meta: &meta,
                    remove_turns: &[],
                    add: &[old],
                    vectors: &[],
                    summaries: &[(1, &record)],
                    remove_summaries: &[],
                    branches: &[],
                    response_ids: &[],
                },
            )
            .unwrap();
        assert!(!key_file(dir.path(), id).exists());
        assert_eq!(
            store.latest_summary(&k, id).unwrap().unwrap().text,
            "plain old summary"
        );
        commit(&store, "old", &["new sealed text"]);
        assert!(key_file(dir.path(), id).exists(), "a key at its next write");
        let meta = store.meta(&k).unwrap().unwrap();
        let texts: Vec<String> = store
            .all_messages(&k, &meta)
            .unwrap()
            .iter()
            .map(|m| m.message.get().to_string())
            .collect();
        assert!(texts[0].contains("plain old text") && texts[1].contains("new sealed text"));
        assert!(store.engine.any_trace_of(b"plain old text").unwrap());
        assert!(!store.engine.any_trace_of(b"new sealed text").unwrap());
    }

    #[tokio::test]
    async fn keys_without_a_conversation_are_removed_and_never_left_by_a_lost_race() {
        let dir = tempfile::tempdir().unwrap();
        let live = {
            let store = store(dir.path());
            let live = commit(&store, "live", &["a"]);
            // A first write that lost its race to another writer: its fresh key goes.
            let mut late = store.load(&conversation("live")).unwrap();
            late.reset();
            let change = Change {
                add: vec![message(Role::User, "b")],
                ..Change::default()
            };
            assert!(matches!(
                store.commit(&mut late, change),
                Err(StoreError::Stale)
            ));
            // A summary finishing after its conversation was deleted leaves no key.
            let gone = commit(&store, "gone", &["c"]);
            let handle = store.conversation(&conversation("gone")).unwrap();
            store.delete_conversation(&conversation("gone")).unwrap();
            assert!(
                !store
                    .save_summary(&lock(&handle), gone, &summary(1, "late"))
                    .unwrap()
            );
            assert_eq!(store.keys.files().unwrap().ids().unwrap(), [live]);
            store.close().await.unwrap();
            live
        };
        // A delete that crashed before its key was removed.
        std::fs::write(key_file(dir.path(), 999), [7u8; 32]).unwrap();
        let store = store(dir.path());
        assert_eq!(store.keys.files().unwrap().ids().unwrap(), [live]);
    }
}
