//! Who a request belongs to: the tenant (from the bearer token), the agent and the
//! conversation, and the rules their names follow.
//!
//! The tenant is a hash of the bearer token, never the token itself, so the store and the logs
//! hold nothing that could be replayed upstream, and two keys that use the same conversation id
//! never share a history.

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

/// A tenant: 32 hex characters of SHA-256 over the client's bearer token.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(String);

impl TenantId {
    /// The tenant of a request; requests without a bearer token share the tenant `anonymous`.
    pub fn from_token(token: Option<&str>) -> TenantId {
        match token {
            None => TenantId("anonymous".to_string()),
            Some(token) => {
                let digest = Sha256::digest([b"memproxy-tenant-v1\0", token.as_bytes()].concat());
                TenantId(hex(&digest[..16]))
            }
        }
    }

    /// A tenant id as shown by the admin API and stored in keys.
    pub fn from_stored(text: &str) -> Option<TenantId> {
        let ok = text == "anonymous"
            || (text.len() == 32 && text.bytes().all(|b| b.is_ascii_hexdigit()));
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

fn hex(bytes: &[u8]) -> String {
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
