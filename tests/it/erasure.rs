//! Erasure at the byte level, through the real proxy: message bodies and summary records are
//! sealed with a key per conversation (`crates/store/src/seal.rs`, `crates/store/src/keys.rs`), so no file
//! of the data directory holds them in plaintext; a delete (of a conversation, or of a whole
//! tenant) removes the key, so that after it, and after a restart on the same directory, no
//! byte of any file under the data directory reads as the deleted text: not as it was sent,
//! not in base64, and not once every sealed value left in the files is opened with every key
//! left on disk. Vectors of messages (recall by meaning, `crates/store/src/vectors.rs`) are
//! sealed the same way and go with their conversation: none is left in the store, nor readable
//! in any file, once it is deleted.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use serde_json::Value;

use crate::support::admin::*;
use crate::support::mock_upstream::{MockUpstream, Reply};
use crate::support::redis_server::RedisServer;
use crate::support::*;
use memproxy::store::{Store, lock};

const OTHER: &str = "sk-test-other";

/// Sync summaries after a few exchanges (as in `tests/it/compression.rs`).
const SETTINGS: &str = "[memory]\nrecent_n = 4\ncompression_threshold_tokens = 150\nrelevance_enabled = false\ncompression_async = false\n";

/// Memproxy with the admin API on and summaries made in sync, over a mock and a data directory.
fn harness() -> Harness {
    Harness::new().admin().config(SETTINGS)
}

/// The text a sealed value starts with (`crates/store/src/seal.rs`).
const SEALED: &[u8] = b"sealed:v1:";

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The forms `text` could take in a file: as sent (JSON escaping leaves these markers as
/// they are), and in base64 at each of the three alignments: the characters that do not
/// depend on the bytes around it. At the first alignment the text starts a group of four, so
/// only the last group is left out; at the other two the first group holds a byte before the
/// text too. (Leaving the first group out at every alignment made a 9-letter marker's first
/// form 4 characters long, which the base64 of sealed values held by chance now and then.)
fn forms(text: &str) -> Vec<Vec<u8>> {
    let mut forms = vec![text.as_bytes().to_vec()];
    for offset in 0..3 {
        let mut bytes = vec![0u8; offset];
        bytes.extend_from_slice(text.as_bytes());
        let encoded = STANDARD.encode(&bytes);
        let first = if offset == 0 { 0 } else { 4 };
        forms.push(encoded.as_bytes()[first..encoded.len() - 4].to_vec());
    }
    forms
}

/// Wherever a marker lies in a base64 value, one of its forms is in the encoding; and no form
/// of a 9-letter marker is short enough for random base64 to hold it by chance.
#[test]
fn a_marker_in_base64_is_found_at_every_alignment_by_forms_of_eight_characters_or_more() {
    let text = "dingo9e7b";
    let forms = forms(text);
    assert!(forms.iter().all(|f| f.len() >= 8), "{forms:?}");
    for before in 0..6usize {
        for after in 0..4usize {
            let mut bytes: Vec<u8> = (0..before).map(|i| (i * 37 + 11) as u8).collect();
            bytes.extend_from_slice(text.as_bytes());
            bytes.extend((0..after).map(|i| (i * 53 + 7) as u8));
            let encoded = STANDARD.encode(&bytes);
            assert!(
                forms[1..].iter().any(|f| contains(encoded.as_bytes(), f)),
                "{before} bytes before, {after} after: {encoded}"
            );
        }
    }
}

/// The files under `dir` that hold `text` in any of its forms.
fn files_holding(dir: &Path, text: &str) -> Vec<PathBuf> {
    let forms = forms(text);
    files(dir)
        .into_iter()
        .filter(|(_, bytes)| forms.iter().any(|form| contains(bytes, form)))
        .map(|(path, _)| path)
        .collect()
}

/// Every sealed value in any file under `dir`, opened with every key file under
/// `dir/keys/` that opens it: what anyone holding the directory can read of the sealed text.
/// The format is read here as documented, independently of the code that writes it.
fn readable_sealed_text(dir: &Path) -> Vec<String> {
    open_sealed(dir, &[b"memproxy message", b"memproxy summary"])
}

/// The plaintext of every sealed value of the `kinds` (associated data) in any file under
/// `dir` that a key file under `dir/keys/` opens.
fn open_sealed(dir: &Path, kinds: &[&[u8]]) -> Vec<String> {
    let all = files(dir);
    let keys: Vec<LessSafeKey> = all
        .iter()
        .filter(|(path, bytes)| path.extension().is_some_and(|e| e == "key") && bytes.len() == 32)
        .map(|(_, bytes)| LessSafeKey::new(UnboundKey::new(&AES_256_GCM, bytes).unwrap()))
        .collect();
    let mut opened = Vec::new();
    for (_, bytes) in &all {
        let mut at = 0;
        while let Some(found) = bytes[at..].windows(SEALED.len()).position(|w| w == SEALED) {
            let start = at + found + SEALED.len();
            let end = bytes[start..]
                .iter()
                .position(|b| !(b.is_ascii_alphanumeric() || *b == b'+' || *b == b'/'))
                .map_or(bytes.len(), |n| start + n);
            at = end;
            // A sealed value with no terminator of its own (a summary record) may run into the
            // next record's bytes in sled's files: shorter runs are tried too.
            for cut in (start.max(end.saturating_sub(MAX_RUN_ON))..=end).rev() {
                if let Some(plain) = open_as(&keys, &bytes[start..cut], kinds) {
                    opened.push(plain);
                    break;
                }
            }
        }
    }
    opened
}

/// How many bytes past a sealed value's end [`readable_sealed_text`] allows for.
const MAX_RUN_ON: usize = 64;

/// The plaintext of the base64 `text` under any of `keys`, sealed as any of `kinds`.
fn open_as(keys: &[LessSafeKey], text: &[u8], kinds: &[&[u8]]) -> Option<String> {
    let sealed = STANDARD_NO_PAD.decode(text).ok()?;
    if sealed.len() < NONCE_LEN + 16 {
        return None;
    }
    for key in keys {
        for &aad in kinds {
            let mut buffer = sealed.clone();
            let nonce = Nonce::try_assume_unique_for_key(&buffer[..NONCE_LEN]).unwrap();
            if let Ok(plain) = key.open_within(nonce, Aad::from(aad), &mut buffer, NONCE_LEN..) {
                return Some(String::from_utf8_lossy(plain).into_owned());
            }
        }
    }
    None
}

/// How many sealed vectors in the files under `dir` open with a key file under `dir/keys/`:
/// the vectors anyone holding the directory can read.
fn readable_vectors(dir: &Path) -> usize {
    open_sealed(dir, &[b"memproxy vector"]).len()
}

/// The embedding space the tests' vectors are of.
const SPACE: &str = "test/space/8";

/// Puts a vector of every stored turn of conversation `id` of `token`, as the embedding job
/// does (under the conversation's lock); the count written.
fn embed(store: &Store, token: &str, id: &str) -> usize {
    let handle = store
        .conversation(&key_for(Some(token), "default", id))
        .unwrap();
    let mut conversation = lock(&handle);
    store.refresh(&mut conversation).unwrap();
    let turns = store.turns_without_vectors(&conversation, SPACE).unwrap();
    let vectors: Vec<(u64, Vec<f32>)> = turns
        .iter()
        .map(|&turn| (turn, (0..8).map(|i| (turn * 8 + i) as f32).collect()))
        .collect();
    store.put_vectors(&conversation, SPACE, &vectors).unwrap()
}

/// Asserts that nothing anyone holding `dir` can read shows any of `texts`.
fn assert_unreadable(dir: &Path, texts: &[&str], when: &str) {
    let opened = readable_sealed_text(dir);
    for text in texts {
        assert_eq!(
            files_holding(dir, text),
            Vec::<PathBuf>::new(),
            "{text} {when}"
        );
        assert!(
            !opened.iter().any(|plain| plain.contains(text)),
            "{text} opens with a key left on disk {when}"
        );
    }
}

/// `turns` exchanges in conversation `id` of `token`, each user message and each reply
/// carrying `marker`.
async fn converse(
    proxy: &Proxy,
    mock: &MockUpstream,
    token: &str,
    id: &str,
    marker: &str,
    turns: usize,
) {
    let mut history = Vec::new();
    for i in 1..=turns {
        history.push(user(&format!(
            "{marker}-user fact {i}: the blue lantern stands on shelf {i} in the north storeroom"
        )));
        mock.push(Reply::Text(format!("{marker}-reply noted {i}")));
        let answer = chat_as(proxy, token, id, &body(&history), &[]).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.header("x-memory-status"), "stored");
        history.push(reply_message(&answer));
    }
}

/// A conversation of `token` with replies and a summary, all carrying `marker`.
async fn converse_with_summary(
    proxy: &Proxy,
    mock: &MockUpstream,
    token: &str,
    id: &str,
    marker: &str,
) {
    let summaries = mock.summary_requests().len();
    mock.push_summary(Reply::Text(format!(
        "{marker}-summary of the storeroom facts"
    )));
    converse(proxy, mock, token, id, marker, 8).await;
    assert_eq!(mock.summary_requests().len(), summaries + 1);
    let shown = admin(proxy, "GET", &conversation_path(token, "default", id), "").await;
    let text = shown.json()["summaries"][0]["record"]["text"].clone();
    assert!(
        text.as_str()
            .unwrap()
            .starts_with(&format!("{marker}-summary")),
        "{text}"
    );
}

/// The export of a conversation, as text.
async fn export(proxy: &Proxy, token: &str, id: &str) -> String {
    let path = format!("{}/export", conversation_path(token, "default", id));
    let answer = admin(proxy, "GET", &path, "").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    String::from_utf8(answer.body.to_vec()).unwrap()
}

/// Asserts that no file under `dir` holds any of `texts` in any form.
fn assert_in_no_file(dir: &Path, texts: &[&str]) {
    for text in texts {
        assert_eq!(files_holding(dir, text), Vec::<PathBuf>::new(), "{text}");
    }
}

/// Deletes through the admin API (`DELETE path`), then checks that `gone` is unreadable in
/// every file under `dir`, after the delete and after a restart on the same directory.
/// Returns the restarted proxy and the delete's answer.
async fn delete_and_restart(
    proxy: Proxy,
    mock: &MockUpstream,
    dir: &Path,
    path: &str,
    gone: &[&str],
) -> (Proxy, Value) {
    let deleted = admin(&proxy, "DELETE", path, "").await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    assert_unreadable(dir, gone, "after the delete");
    proxy.stop().await;
    let proxy = harness().proxy_on(mock, dir).await;
    assert_unreadable(dir, gone, "after a restart");
    (proxy, deleted.json())
}

#[tokio::test]
async fn stored_text_is_sealed_and_a_deleted_conversation_is_unreadable_in_every_file() {
    let Started {
        mock, dir, proxy, ..
    } = harness().start().await;
    let data = dir.path();
    converse_with_summary(&proxy, &mock, TOKEN, "gone", "wombat4d1e").await;
    converse(&proxy, &mock, TOKEN, "kept", "quokka8b2f", 2).await;
    let gone = ["wombat4d1e-user", "wombat4d1e-reply", "wombat4d1e-summary"];

    // Sealed while stored: the text is in no file of the data directory, except the summary's
    // Markdown copy meant for people, in the conversation's workspace folder.
    assert_in_no_file(
        data,
        &["wombat4d1e-user", "wombat4d1e-reply", "quokka8b2f-user"],
    );
    let copies = files_holding(data, "wombat4d1e-summary");
    assert!(!copies.is_empty());
    for copy in &copies {
        assert!(copy.starts_with(data.join("workspaces")), "{copy:?}");
        assert!(copy.extension().is_some_and(|e| e == "md"), "{copy:?}");
    }
    // The key on disk opens it (so the check after the delete is not vacuous).
    let opened = readable_sealed_text(data);
    for text in gone {
        assert!(opened.iter().any(|p| p.contains(text)), "{text}");
    }
    // Vectors of the deleted conversation's messages, sealed and readable with its key too.
    let embedded = embed(proxy.store(), TOKEN, "gone");
    assert_eq!(embedded, 16);
    proxy.store().sync().await.unwrap();
    assert!(readable_vectors(data) >= embedded);

    let path = conversation_path(TOKEN, "default", "gone");
    let (proxy, deleted) = delete_and_restart(proxy, &mock, data, &path, &gone).await;
    assert_eq!(deleted["deleted"]["summaries"], 1);
    assert_eq!(proxy.store().vector_count().unwrap(), 0);
    assert_eq!(
        readable_vectors(data),
        0,
        "a vector opens with a key left on disk"
    );

    // The other conversation's key was kept: it reads in plaintext, in an export and in the
    // prompt its next turn forwards.
    assert!(
        export(&proxy, TOKEN, "kept")
            .await
            .contains("quokka8b2f-user fact 1")
    );
    let answer = chat(&proxy, "kept", &body(&[user("and what else?")]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    let forwarded = Value::Array(mock.last_messages()).to_string();
    assert!(forwarded.contains("quokka8b2f-user fact 2"), "{forwarded}");
    assert_in_no_file(data, &["quokka8b2f-user"]);
    proxy.stop().await;
}

#[tokio::test]
async fn a_deleted_tenant_is_unreadable_in_every_file() {
    let Started {
        mock, dir, proxy, ..
    } = harness().start().await;
    let data = dir.path();
    converse_with_summary(&proxy, &mock, TOKEN, "first", "numbat5c3a").await;
    converse(&proxy, &mock, TOKEN, "second", "numbat5c3a-second", 3).await;
    converse(&proxy, &mock, OTHER, "theirs", "dingo9e7b", 2).await;
    let gone = [
        "numbat5c3a-user",
        "numbat5c3a-reply",
        "numbat5c3a-summary",
        "numbat5c3a-second",
    ];
    assert_in_no_file(data, &["numbat5c3a-user", "numbat5c3a-reply", "dingo9e7b"]);
    let store = proxy.store();
    let theirs = embed(store, OTHER, "theirs");
    assert!(embed(store, TOKEN, "first") > 0 && embed(store, TOKEN, "second") > 0);

    let path = format!("/admin/v1/tenants/{}", tenant(TOKEN));
    let (proxy, deleted) = delete_and_restart(proxy, &mock, data, &path, &gone).await;
    assert_eq!(deleted["deleted_conversations"], 2);
    // The tenant's vectors went with its conversations; the other tenant's are all there.
    assert_eq!(proxy.store().vector_count().unwrap(), theirs as u64);
    let handle = proxy
        .store()
        .conversation(&key_for(Some(OTHER), "default", "theirs"))
        .unwrap();
    assert_eq!(
        proxy.store().vectors(&lock(&handle), SPACE).unwrap().len(),
        theirs
    );
    assert!(
        export(&proxy, OTHER, "theirs")
            .await
            .contains("dingo9e7b-user fact 2")
    );
    proxy.stop().await;
}

#[tokio::test]
async fn an_export_is_plaintext_and_its_import_is_sealed() {
    let Started {
        mock, dir, proxy, ..
    } = harness().start().await;
    let data = dir.path();
    converse_with_summary(&proxy, &mock, TOKEN, "source", "bilby2a6d").await;
    let exported = export(&proxy, TOKEN, "source").await;
    for text in [
        "bilby2a6d-user fact 1",
        "bilby2a6d-reply noted 8",
        "bilby2a6d-summary",
    ] {
        assert!(exported.contains(text), "{text}");
    }
    let copy = conversation_path(TOKEN, "default", "copy");
    let imported = admin(&proxy, "POST", &format!("{copy}/import"), &exported).await;
    assert_eq!(imported.status, 200, "{:?}", imported.body);
    let reexported: Value = serde_json::from_str(&export(&proxy, TOKEN, "copy").await).unwrap();
    let original: Value = serde_json::from_str(&exported).unwrap();
    assert_eq!(reexported["messages"], original["messages"]);
    assert_eq!(reexported["summaries"], original["summaries"]);
    assert_in_no_file(data, &["bilby2a6d-user", "bilby2a6d-reply"]);

    // Deleting the source leaves the copy readable, under its own key.
    let path = conversation_path(TOKEN, "default", "source");
    let (proxy, _) = delete_and_restart(proxy, &mock, data, &path, &[]).await;
    assert_eq!(
        serde_json::from_str::<Value>(&export(&proxy, TOKEN, "copy").await).unwrap()["messages"],
        original["messages"]
    );
    proxy.stop().await;
}

#[tokio::test]
async fn with_redis_a_deleted_conversation_and_tenant_leave_no_vector() {
    let redis = RedisServer::start();
    let Started { mock, proxy, .. } = harness().redis(&redis).start().await;
    for (token, id) in [(TOKEN, "gone"), (TOKEN, "kept"), (OTHER, "theirs")] {
        converse(&proxy, &mock, token, id, &format!("emu{id}"), 2).await;
        assert_eq!(embed(proxy.store(), token, id), 4);
    }
    let store = proxy.store();
    assert_eq!(store.vector_count().unwrap(), 12);
    let path = conversation_path(TOKEN, "default", "gone");
    assert_eq!(admin(&proxy, "DELETE", &path, "").await.status, 200);
    assert_eq!(store.vector_count().unwrap(), 8);
    let path = format!("/admin/v1/tenants/{}", tenant(TOKEN));
    assert_eq!(admin(&proxy, "DELETE", &path, "").await.status, 200);
    assert_eq!(store.vector_count().unwrap(), 4);
    let handle = store
        .conversation(&key_for(Some(OTHER), "default", "theirs"))
        .unwrap();
    assert_eq!(store.vectors(&lock(&handle), SPACE).unwrap().len(), 4);
    proxy.stop().await;
}
