//! `[auth]`: the keys clients must present, kept only as hashes, and whether requests without
//! any credential get a memory.

use std::collections::HashSet;

use serde::Deserialize;
use sha2::{Digest, Sha256};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAuth {
    #[serde(default)]
    client_keys: Vec<String>,
    client_keys_env: Option<String>,
    #[serde(default)]
    allow_anonymous: bool,
}

/// `[auth]`, checked.
pub(super) struct Auth {
    /// SHA-256 of each accepted client key; empty: any client may call.
    pub client_key_hashes: HashSet<[u8; 32]>,
    /// Requests with a conversation id but no credential share the tenant `anonymous`;
    /// otherwise they are refused (401).
    pub allow_anonymous: bool,
}

/// Checks `[auth]`: the SHA-256 of each accepted client key (empty: any client may call), from
/// the file and the comma-separated variable `client_keys_env` names; `allow_anonymous`.
pub(super) fn check_auth(
    raw: RawAuth,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<String>,
) -> Auth {
    let mut client_keys = raw.client_keys;
    if let Some(name) = raw.client_keys_env.filter(|n| !n.is_empty()) {
        match env(&name) {
            Some(value) => client_keys.extend(value.split(',').map(|k| k.trim().to_string())),
            None => problems.push(format!(
                "auth.client_keys_env: environment variable `{name}` is not set"
            )),
        }
    }
    let mut client_key_hashes = HashSet::new();
    for (i, key) in client_keys.iter().enumerate() {
        if key.is_empty() {
            problems.push(format!("auth.client_keys[{i}]: a key must not be empty"));
        } else {
            client_key_hashes.insert(hash_key(key));
        }
    }
    Auth {
        client_key_hashes,
        allow_anonymous: raw.allow_anonymous,
    }
}

/// SHA-256 of a client key: keys are compared as hashes, so the comparison's timing says
/// nothing about the key.
pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}
