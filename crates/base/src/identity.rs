//! Who a request belongs to: the tenant (from the credential the request presents), the agent
//! and the conversation, and the rules their names follow.
//!
//! The tenant is a hash of the credential, never the credential itself, so the store and the
//! logs hold nothing that could be replayed upstream, and two credentials that use the same
//! conversation id never share a history.
//!
//! # Which credential, and what is hashed
//!
//! A request presents its credential in `Authorization` (any scheme), `api-key` (Azure) or
//! `x-api-key` (Anthropic). What is hashed is the credential in a canonical form
//! ([`Credential`]):
//!
//! - an **API key** — `Authorization: Bearer K`, `api-key: K`, `x-api-key: K`, or a bare
//!   `Authorization: K` — is the key `K` alone, whichever header carried it. They are the same
//!   secret in the header style of another SDK: an agent that moves from the OpenAI SDK to the
//!   Azure or Anthropic one keeps its memory, and whoever knows `K` can send it in any of them
//!   anyway, so telling them apart would protect nothing. The hash is the one bearer tokens have
//!   always had, so conversations stored before keep their tenant.
//! - **any other `Authorization` scheme** (`Basic`, `Digest`, a vendor's own) is the scheme,
//!   lower-cased, and the credentials after it, hashed in a separate domain: `Basic x` and
//!   `Bearer x` are two tenants. A `Basic` credential is a user and password, not a key; no
//!   upstream takes one for the other, so memproxy does not either. (A scheme whose credentials
//!   change on every request, such as `Digest` or a request signature, gets a new tenant each
//!   time: such clients have no lasting memory.)
//!
//! Credentials are compared in that canonical form: the same key in `Authorization` and
//! `x-api-key` is one credential; two different ones are refused by the caller.

use sha2::{Digest, Sha256};

/// The longest agent or conversation id.
pub const MAX_ID_LEN: usize = 128;

/// The agent used when a request names none.
pub const DEFAULT_AGENT: &str = "default";

/// True when `id` is 1–128 characters from `A-Za-z0-9._:@-`.
pub fn is_valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'@' | b'-'))
}

/// The tenant of requests that present no credential (with `auth.allow_anonymous`).
pub const ANONYMOUS: &str = "anonymous";

/// What every tenant hash starts with.
const TENANT_DOMAIN: &[u8] = b"memproxy-tenant-v1\0";

/// What every prompt cache key's hash starts with.
const PROMPT_CACHE_DOMAIN: &[u8] = b"memproxy-prompt-cache-v1\0";

/// A credential a request presents, in the canonical form its tenant is the hash of (see the
/// module's documentation). `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub enum Credential {
    /// An API key, whichever header carried it.
    Key(String),
    /// Any other `Authorization` scheme: the scheme lower-cased, and its credentials as sent.
    Scheme { scheme: String, credentials: String },
}

impl Credential {
    /// The credential of an `Authorization` value: `Bearer K` and a bare `K` (as some gateways
    /// accept) are the key `K`, any other `Scheme C` is that scheme's. `None` for an empty value
    /// or `Bearer`/`Basic` with nothing after it (`Bearer ` is what an SDK sends for an empty
    /// key): it presents no secret, and is not taken for a key named `Bearer`.
    pub fn from_authorization(value: &str) -> Option<Credential> {
        let value = value.trim();
        match value.split_once([' ', '\t']) {
            Some((scheme, credentials)) => {
                let credentials = credentials.trim();
                if credentials.is_empty() {
                    None
                } else if scheme.eq_ignore_ascii_case("bearer") {
                    Some(Credential::Key(credentials.to_string()))
                } else {
                    Some(Credential::Scheme {
                        scheme: scheme.to_ascii_lowercase(),
                        credentials: credentials.to_string(),
                    })
                }
            }
            None if value.is_empty()
                || value.eq_ignore_ascii_case("bearer")
                || value.eq_ignore_ascii_case("basic") =>
            {
                None
            }
            None => Some(Credential::Key(value.to_string())),
        }
    }

    /// The credential of an `api-key` or `x-api-key` value: the key, or `None` when empty.
    pub fn from_key(value: &str) -> Option<Credential> {
        let value = value.trim();
        (!value.is_empty()).then(|| Credential::Key(value.to_string()))
    }

    /// The API key, for the `auth.client_keys` allow-list (which lists keys only).
    pub fn key(&self) -> Option<&str> {
        match self {
            Credential::Key(key) => Some(key),
            Credential::Scheme { .. } => None,
        }
    }
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::Key(_) => f.write_str("Credential::Key(..)"),
            Credential::Scheme { scheme, .. } => write!(f, "Credential::Scheme({scheme}, ..)"),
        }
    }
}

/// A tenant: 32 hex characters of SHA-256 over the request's credential, or `anonymous`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(String);

impl TenantId {
    /// The tenant of a request's credential; `None` is the shared tenant `anonymous`.
    pub fn of(credential: Option<&Credential>) -> TenantId {
        let digest = match credential {
            None => return TenantId(ANONYMOUS.to_string()),
            // Keys hash as bearer tokens always have. Header values never hold a NUL, so the
            // other schemes' input, which starts with one, can never equal a key's.
            Some(Credential::Key(key)) => Sha256::digest([TENANT_DOMAIN, key.as_bytes()].concat()),
            Some(Credential::Scheme {
                scheme,
                credentials,
            }) => Sha256::digest(
                [
                    TENANT_DOMAIN,
                    b"\0",
                    scheme.as_bytes(),
                    b"\0",
                    credentials.as_bytes(),
                ]
                .concat(),
            ),
        };
        TenantId(hex(&digest[..16]))
    }

    /// The tenant of an API key (`None`: `anonymous`).
    pub fn from_token(token: Option<&str>) -> TenantId {
        TenantId::of(token.map(|t| Credential::Key(t.to_string())).as_ref())
    }

    /// A tenant id as shown by the admin API and stored in keys.
    pub fn from_stored(text: &str) -> Option<TenantId> {
        let ok =
            text == ANONYMOUS || (text.len() == 32 && text.bytes().all(|b| b.is_ascii_hexdigit()));
        ok.then(|| TenantId(text.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for TenantId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The storage key of a conversation: (tenant, agent, conversation).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConversationKey {
    pub tenant: TenantId,
    pub agent: String,
    pub conversation: String,
}

impl ConversationKey {
    /// The heap its three strings hold (for the caches' weighers).
    pub fn heap_bytes(&self) -> usize {
        crate::heap::string(self.tenant.0.capacity())
            + crate::heap::string(self.agent.capacity())
            + crate::heap::string(self.conversation.capacity())
    }

    /// The key's byte form in the store: `tenant \0 agent \0 conversation`. Ids never contain
    /// `\0`, so the form is unambiguous and sorts by tenant, then agent.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            self.tenant.0.len() + self.agent.len() + self.conversation.len() + 2,
        );
        out.extend_from_slice(self.tenant.0.as_bytes());
        out.push(0);
        out.extend_from_slice(self.agent.as_bytes());
        out.push(0);
        out.extend_from_slice(self.conversation.as_bytes());
        out
    }

    /// The `prompt_cache_key` memproxy sets for the conversation when the client set none:
    /// `mp-` and 32 hex digits of a SHA-256 over the key in its own domain. The tenant in it is
    /// already a hash of the credential; the hash also keeps agent and conversation ids out of
    /// what the upstream sees, and no two conversations share a key.
    pub fn prompt_cache_key(&self) -> String {
        let digest = Sha256::digest([PROMPT_CACHE_DOMAIN, &self.to_bytes()].concat());
        format!("mp-{}", hex(&digest[..16]))
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<ConversationKey> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut parts = text.split('\0');
        let key = ConversationKey {
            tenant: TenantId::from_stored(parts.next()?)?,
            agent: parts.next()?.to_string(),
            conversation: parts.next()?.to_string(),
        };
        (parts.next().is_none() && is_valid_id(&key.agent) && is_valid_id(&key.conversation))
            .then_some(key)
    }
}

/// The bearer token of an `Authorization` header value, if it has one.
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The path form `/agents/{agent}/conversations/{conversation}/v1/...`, split into the agent,
/// the conversation and the `/v1/...` rest. `None` when the path is not of that form.
pub fn split_path_form(path: &str) -> Option<(&str, &str, &str)> {
    let rest = path.strip_prefix("/agents/")?;
    let (agent, rest) = rest.split_once('/')?;
    let rest = rest.strip_prefix("conversations/")?;
    let (conversation, rest) = rest.split_once('/')?;
    let tail_start = path.len() - rest.len() - 1;
    let tail = &path[tail_start..];
    (tail == "/v1" || tail.starts_with("/v1/")).then_some((agent, conversation, tail))
}

/// Lowercase hexadecimal of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_follow_the_character_rules() {
        assert!(is_valid_id("user-42:chat@web_1.x"));
        assert!(is_valid_id(&"a".repeat(128)));
        for bad in ["", "../x", "/etc", "a b", "é", "a\0b", &"a".repeat(129)] {
            assert!(!is_valid_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn prompt_cache_keys_are_hashes_per_conversation() {
        let key = |token: &str, conversation: &str| ConversationKey {
            tenant: TenantId::from_token(Some(token)),
            agent: "default".into(),
            conversation: conversation.into(),
        };
        let a = key("sk-secret", "chat-1").prompt_cache_key();
        assert_eq!(a, key("sk-secret", "chat-1").prompt_cache_key());
        assert_eq!(a.len(), 35);
        assert!(a.starts_with("mp-") && a[3..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!a.contains("chat-1") && !a.contains(key("sk-secret", "x").tenant.as_str()));
        assert_ne!(a, key("sk-other", "chat-1").prompt_cache_key());
        assert_ne!(a, key("sk-secret", "chat-2").prompt_cache_key());
    }

    #[test]
    fn tenants_are_hashes_and_differ_by_token() {
        let a = TenantId::from_token(Some("sk-aaa"));
        let b = TenantId::from_token(Some("sk-bbb"));
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 32);
        assert!(!a.as_str().contains("aaa"));
        assert_eq!(a, TenantId::from_token(Some("sk-aaa")));
        assert_eq!(TenantId::from_stored(a.as_str()), Some(a));
        assert_eq!(TenantId::from_token(None).as_str(), "anonymous");
    }

    #[test]
    fn credentials_are_canonical_whichever_header_carries_them() {
        let key = Credential::from_key("sk-1");
        assert!(key.is_some());
        assert_eq!(Credential::from_authorization("Bearer sk-1"), key);
        assert_eq!(Credential::from_authorization("bearer \t sk-1 "), key);
        assert_eq!(Credential::from_authorization("sk-1"), key);
        assert_eq!(Credential::from_key(" sk-1 "), key);
        let basic = Credential::from_authorization("Basic dXNlcjpwdw==");
        assert_eq!(
            basic,
            Some(Credential::Scheme {
                scheme: "basic".into(),
                credentials: "dXNlcjpwdw==".into()
            })
        );
        assert_eq!(Credential::from_authorization("BASIC dXNlcjpwdw=="), basic);
        for empty in ["", "  ", "Bearer", "Bearer   ", "basic "] {
            assert_eq!(Credential::from_authorization(empty), None, "{empty:?}");
        }
        assert_eq!(Credential::from_key(""), None);
        assert_eq!(key.as_ref().and_then(Credential::key), Some("sk-1"));
        assert_eq!(basic.as_ref().and_then(Credential::key), None);
        assert!(!format!("{key:?}{basic:?}").contains("sk-1"));
        assert!(!format!("{basic:?}").contains("dXNl"));
    }

    #[test]
    fn a_scheme_is_part_of_the_tenant_but_the_key_header_is_not() {
        let tenant = |value: &str| TenantId::of(Credential::from_authorization(value).as_ref());
        assert_eq!(tenant("Bearer x"), TenantId::from_token(Some("x")));
        assert_eq!(
            tenant("Bearer x"),
            TenantId::of(Credential::from_key("x").as_ref())
        );
        assert_ne!(tenant("Basic x"), tenant("Bearer x"));
        assert_ne!(tenant("Basic x"), tenant("Digest x"));
        assert_ne!(tenant("Basic x"), tenant("Basic y"));
        assert_eq!(tenant("basic x"), tenant("Basic x"));
        // A key that spells out a scheme is still not that scheme's credential.
        assert_ne!(
            tenant("Basic x"),
            TenantId::of(Credential::from_key("basic x").as_ref())
        );
        assert_eq!(TenantId::of(None).as_str(), ANONYMOUS);
        assert!(TenantId::from_stored(tenant("Basic x").as_str()).is_some());
    }

    #[test]
    fn keys_round_trip_through_bytes() {
        let key = ConversationKey {
            tenant: TenantId::from_token(Some("t")),
            agent: "default".into(),
            conversation: "c:1".into(),
        };
        assert_eq!(ConversationKey::from_bytes(&key.to_bytes()), Some(key));
        assert_eq!(ConversationKey::from_bytes(b"anonymous\0a\0b\0c"), None);
    }

    #[test]
    fn bearer_tokens_are_extracted() {
        assert_eq!(bearer_token("Bearer sk-1"), Some("sk-1"));
        assert_eq!(bearer_token("bearer  sk-1 "), Some("sk-1"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer"), None);
    }

    #[test]
    fn path_form_is_split() {
        assert_eq!(
            split_path_form("/agents/a1/conversations/c-9/v1/chat/completions"),
            Some(("a1", "c-9", "/v1/chat/completions"))
        );
        assert_eq!(
            split_path_form("/agents/a/conversations/c/v1"),
            Some(("a", "c", "/v1"))
        );
        assert_eq!(split_path_form("/agents/a/conversations/c/v2/x"), None);
        assert_eq!(split_path_form("/v1/chat/completions"), None);
    }
}
