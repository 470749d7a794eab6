//! Identify: which conversation a request belongs to, whose it is, and the settings it runs
//! with.
//!
//! Reads the `X-Memory-*` headers (and the path form's ids), checks every one, and merges the
//! settings: the agent's profile from the config, then the headers. Any header memproxy does not
//! know, or a bad value, is a 400 that names the header and what it accepts.
//!
//! The tenant is the hash of the credential the request presents in any of
//! [`CREDENTIAL_HEADERS`] (`identity::Credential` says what is hashed): two different ones are
//! a 400 naming the headers, none a 401 unless `auth.allow_anonymous` is set. Only a request
//! with a conversation id needs a tenant; pass-through requests are not looked at.

use http::HeaderMap;
use http::header::{AUTHORIZATION, HeaderName};

use crate::config::Config;
use crate::error::ProxyError;
use crate::identity::{ConversationKey, Credential, DEFAULT_AGENT, TenantId, is_valid_id};
use crate::settings::{self, MemorySettings, SettingError};

pub const CONVERSATION_HEADER: &str = "x-memory-conversation-id";
pub const AGENT_HEADER: &str = "x-memory-agent";
/// Names the user within the tenant: long-term memory (`crate::longterm`) runs for it.
pub const USER_HEADER: &str = "x-memory-user-id";

/// The headers a client may present its credential in: `Authorization` (any scheme), `api-key`
/// (Azure) and `x-api-key` (Anthropic). A summary call made on a request's behalf carries them
/// upstream too.
pub static CREDENTIAL_HEADERS: [HeaderName; 3] = [
    AUTHORIZATION,
    HeaderName::from_static("api-key"),
    HeaderName::from_static("x-api-key"),
];

/// Who the request is for and how memory behaves for it.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The conversation memory runs for: a request of one of the APIs memory serves (chat
    /// completions, Responses, Anthropic Messages) with a conversation id and memory on.
    /// `None`: the request is forwarded untouched.
    pub key: Option<ConversationKey>,
    /// The conversation id the request names, also when memory does not run for it.
    pub conversation: Option<String>,
    pub agent: String,
    /// The user the request names (`X-Memory-User-Id`), also when memory does not run for it.
    pub user: Option<String>,
    pub settings: MemorySettings,
}

/// Ids given by the path form `/agents/{agent}/conversations/{conversation}/v1/...`.
#[derive(Debug, Clone, Copy)]
pub struct PathIds<'a> {
    pub agent: &'a str,
    pub conversation: &'a str,
}

/// Identifies a request. `is_chat`: it is a request of an API memory serves (chat completions,
/// Responses, Anthropic Messages), so the only kind whose tenant is looked for.
pub fn identify(
    config: &Config,
    headers: &HeaderMap,
    path_ids: Option<PathIds<'_>>,
    is_chat: bool,
) -> Result<Identity, ProxyError> {
    let mut named = MemoryHeaders::read(headers)?;
    if let Some(ids) = path_ids {
        named.take_path_ids(ids)?;
    }
    let MemoryHeaders {
        conversation,
        agent,
        user,
        overrides,
    } = named;
    let agent = agent.unwrap_or_else(|| DEFAULT_AGENT.to_string());
    let settings = profile_with_overrides(config, &agent, overrides)?;

    // The tenant (a hash of the credential) is only needed when memory runs: pass-through
    // requests, and chat with memory off, skip the hashing and need no credential.
    let key = match &conversation {
        Some(conversation) if is_chat && settings.enabled => Some(ConversationKey {
            tenant: tenant_of(config, headers)?,
            agent: agent.clone(),
            conversation: conversation.clone(),
        }),
        _ => None,
    };
    Ok(Identity {
        key,
        conversation,
        agent,
        user,
        settings,
    })
}

/// The tenant of a request's credential ([`credential_of`]): none is a 401 unless
/// `auth.allow_anonymous` gives it the shared tenant `anonymous`. Chat requests with memory and
/// the memory tools (`/mcp`) alike.
pub fn tenant_of(config: &Config, headers: &HeaderMap) -> Result<TenantId, ProxyError> {
    let credential = credential_of(headers)?;
    match credential {
        None if !config.allow_anonymous => Err(ProxyError::NoCredential),
        None => Ok(TenantId::of(None)),
        Some(credential) => Ok(tenant_of_credential(credential)),
    }
}

thread_local! {
    /// The credential this thread last made a tenant of, with that tenant: a sidecar's
    /// requests mostly carry one key, and hashing it (SHA-256) was half a percent of a
    /// read-only request's CPU.
    static LAST_TENANT: std::cell::RefCell<Option<(Credential, TenantId)>> =
        const { std::cell::RefCell::new(None) };
}

/// [`TenantId::of`] a credential, taken from this thread's last when it is the same one. The
/// secret is compared in constant time, so how long a request takes tells nothing of the key
/// held (only whether the lengths differ).
fn tenant_of_credential(credential: Credential) -> TenantId {
    LAST_TENANT.with_borrow_mut(|last| {
        if let Some((held, tenant)) = last.as_ref()
            && same_credential(held, &credential)
        {
            return tenant.clone();
        }
        let tenant = TenantId::of(Some(&credential));
        *last = Some((credential, tenant.clone()));
        tenant
    })
}

fn same_credential(a: &Credential, b: &Credential) -> bool {
    use subtle::ConstantTimeEq;
    match (a, b) {
        (Credential::Key(a), Credential::Key(b)) => bool::from(a.as_bytes().ct_eq(b.as_bytes())),
        (
            Credential::Scheme {
                scheme: a_scheme,
                credentials: a,
            },
            Credential::Scheme {
                scheme: b_scheme,
                credentials: b,
            },
        ) => a_scheme == b_scheme && bool::from(a.as_bytes().ct_eq(b.as_bytes())),
        _ => false,
    }
}

/// What a request's `X-Memory-*` headers (and its path form's ids) name, each checked.
struct MemoryHeaders {
    conversation: Option<String>,
    agent: Option<String>,
    user: Option<String>,
    /// The settings the headers override: `(setting, header, value)`, in the headers' order.
    overrides: Vec<(&'static str, String, String)>,
}

impl MemoryHeaders {
    /// Reads every `X-Memory-*` header: each given once, in visible ASCII, ids valid, and
    /// every other one a setting's.
    fn read(headers: &HeaderMap) -> Result<MemoryHeaders, ProxyError> {
        let mut named = MemoryHeaders {
            conversation: None,
            agent: None,
            user: None,
            overrides: Vec::new(),
        };
        for name in headers.keys() {
            let name = name.as_str();
            if !name.starts_with("x-memory-") {
                continue;
            }
            let mut values = headers.get_all(name).iter();
            let value = values.next().map(|v| v.to_str());
            if values.next().is_some() {
                return Err(bad_header(name, "is given more than once"));
            }
            let Some(Ok(value)) = value else {
                return Err(bad_header(name, "must be visible ASCII"));
            };
            let value = value.trim().to_string();
            match name {
                CONVERSATION_HEADER => named.conversation = Some(checked_id(name, value)?),
                AGENT_HEADER => named.agent = Some(checked_id(name, value)?),
                USER_HEADER => named.user = Some(checked_id(name, value)?),
                _ => match settings::setting_for_header(name) {
                    Some(setting) => named.overrides.push((setting, name.to_string(), value)),
                    None => return Err(unknown_header(name)),
                },
            }
        }
        Ok(named)
    }

    /// Takes the path form's ids, which must be valid and agree with the headers' ids.
    fn take_path_ids(&mut self, ids: PathIds<'_>) -> Result<(), ProxyError> {
        for (header, from_path, from_header) in [
            (
                CONVERSATION_HEADER,
                ids.conversation,
                self.conversation.as_deref(),
            ),
            (AGENT_HEADER, ids.agent, self.agent.as_deref()),
        ] {
            if !is_valid_id(from_path) {
                return Err(ProxyError::invalid(
                    "path",
                    "invalid_path",
                    "agent and conversation ids in the path are 1-128 characters from A-Za-z0-9._:@-",
                ));
            }
            if from_header.is_some_and(|h| h != from_path) {
                return Err(bad_header(
                    header,
                    "disagrees with the id in the request path",
                ));
            }
        }
        self.conversation = Some(ids.conversation.to_string());
        self.agent = Some(ids.agent.to_string());
        Ok(())
    }
}

/// An `X-Memory-*` header memproxy does not know: the error names every one it does.
fn unknown_header(name: &str) -> ProxyError {
    ProxyError::invalid(
        name,
        "unknown_header",
        format!(
            "unknown header `{name}`: memproxy accepts {}, {}, {} and {}",
            CONVERSATION_HEADER,
            AGENT_HEADER,
            USER_HEADER,
            settings::SETTINGS
                .iter()
                .map(|(s, _)| settings::header_name(s))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
}

/// The agent's profile from the config, with the headers' overrides applied (refused, the
/// first named, when the config does not allow them).
fn profile_with_overrides(
    config: &Config,
    agent: &str,
    overrides: Vec<(&'static str, String, String)>,
) -> Result<MemorySettings, ProxyError> {
    let mut settings = config.profile(agent).clone();
    if !overrides.is_empty() && !config.allow_header_overrides {
        let (_, header, _) = &overrides[0];
        return Err(ProxyError::invalid(
            header.clone(),
            "header_overrides_disabled",
            format!(
                "`{header}` is not allowed: this memproxy does not accept settings from headers (memory.allow_header_overrides = false)"
            ),
        ));
    }
    for (setting, header, value) in overrides {
        settings.apply(setting, &value).map_err(|err| match err {
            SettingError::BadValue { expected, .. } => {
                bad_header(&header, &format!("must be {expected}"))
            }
            SettingError::Unknown(_) => bad_header(&header, "is not a setting"),
        })?;
    }
    Ok(settings)
}

/// The one credential a request presents in its [`CREDENTIAL_HEADERS`] (each may be given more
/// than once), or `None`. The same credential in several of them is one credential; two
/// different ones, or a value that is not visible ASCII, are a 400 naming the headers. Never
/// puts a value in the error.
pub fn credential_of(headers: &HeaderMap) -> Result<Option<Credential>, ProxyError> {
    let mut found: Option<(Credential, &HeaderName)> = None;
    for name in &CREDENTIAL_HEADERS {
        for value in headers.get_all(name) {
            let Ok(value) = value.to_str() else {
                return Err(bad_header(name.as_str(), "must be visible ASCII"));
            };
            let credential = if name == AUTHORIZATION {
                Credential::from_authorization(value)
            } else {
                Credential::from_key(value)
            };
            let Some(credential) = credential else {
                continue;
            };
            match &found {
                None => found = Some((credential, name)),
                Some((first, _)) if *first == credential => {}
                Some((_, first_name)) => {
                    let names = if *first_name == name {
                        name.to_string()
                    } else {
                        format!("{first_name}, {name}")
                    };
                    return Err(ProxyError::invalid(
                        names.clone(),
                        "conflicting_credentials",
                        format!(
                            "the request presents two different credentials ({names}): memory \
                             cannot tell whose conversation it is; send one credential, or the \
                             same one in each header"
                        ),
                    ));
                }
            }
        }
    }
    Ok(found.map(|(credential, _)| credential))
}

fn bad_header(name: &str, why: &str) -> ProxyError {
    ProxyError::invalid(name, "invalid_header", format!("header `{name}` {why}"))
}

fn checked_id(header: &str, value: String) -> Result<String, ProxyError> {
    if is_valid_id(&value) {
        Ok(value)
    } else {
        Err(bad_header(
            header,
            "must be 1-128 characters from A-Za-z0-9._:@-",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(*k, HeaderValue::from_static(v));
        }
        map
    }

    fn config() -> Config {
        crate::config::from_toml(
            "[auth]\nallow_anonymous = true\n[agents.support]\nrecent_n = 3\n",
            &|_| None,
        )
        .unwrap()
    }

    #[test]
    fn a_tenant_held_for_the_last_credential_is_that_credentials_own() {
        let key = |k: &str| Credential::Key(k.into());
        let scheme = |s: &str, c: &str| Credential::Scheme {
            scheme: s.into(),
            credentials: c.into(),
        };
        // Each in turn, twice (the second from what the thread holds), then back: every one
        // is the tenant its credential hashes to, never the one held for another.
        let credentials = [
            key("sk-one"),
            key("sk-one"),
            key("sk-onf"),
            key("sk-on"),
            scheme("basic", "sk-one"),
            scheme("basic", "sk-one"),
            scheme("token", "sk-one"),
            scheme("basic", "sk-two"),
            key("sk-one"),
        ];
        for credential in credentials {
            let expected = TenantId::of(Some(&credential));
            assert_eq!(tenant_of_credential(credential.clone()), expected);
            assert_eq!(tenant_of_credential(credential), expected);
        }
        assert_ne!(
            tenant_of_credential(key("sk-one")),
            tenant_of_credential(key("sk-onf"))
        );
        assert!(!same_credential(&key("a"), &scheme("bearer", "a")));
    }

    fn tenant_of(pairs: &[(&'static str, &'static str)]) -> Result<TenantId, ProxyError> {
        let mut pairs = pairs.to_vec();
        pairs.push(("x-memory-conversation-id", "c"));
        identify(&config(), &headers(&pairs), None, true).map(|id| id.key.unwrap().tenant)
    }

    fn param_of(result: Result<Identity, ProxyError>) -> String {
        match result.unwrap_err() {
            ProxyError::InvalidRequest { param, .. } => param.unwrap(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn headers_pick_the_conversation_agent_and_settings() {
        let id = identify(
            &config(),
            &headers(&[
                ("x-memory-conversation-id", "c1"),
                ("x-memory-agent", "support"),
                ("x-memory-persist", "false"),
                ("authorization", "Bearer sk-1"),
            ]),
            None,
            true,
        )
        .unwrap();
        let key = id.key.unwrap();
        assert_eq!(key.conversation, "c1");
        assert_eq!(key.agent, "support");
        assert_eq!(key.tenant, TenantId::from_token(Some("sk-1")));
        assert_eq!(id.settings.recent_n, 3);
        assert!(!id.settings.persist);
    }

    #[test]
    fn the_user_id_follows_the_conversation_id_rules() {
        let id = identify(
            &config(),
            &headers(&[
                ("x-memory-conversation-id", "c1"),
                ("x-memory-user-id", "user-42:web@x"),
                ("x-memory-long-term-top-k", "7"),
                ("x-memory-memory-min-decay", "0.5"),
            ]),
            None,
            true,
        )
        .unwrap();
        assert_eq!(id.user.as_deref(), Some("user-42:web@x"));
        assert_eq!(id.settings.long_term_top_k, 7);
        assert_eq!(id.settings.memory_min_decay_micros, 500_000);
        let none = identify(
            &config(),
            &headers(&[("x-memory-conversation-id", "c1")]),
            None,
            true,
        )
        .unwrap();
        assert!(none.user.is_none());
        for (name, bad) in [
            ("x-memory-user-id", "../u"),
            ("x-memory-user-id", ""),
            ("x-memory-long-term-top-k", "51"),
            ("x-memory-long-term-max-tokens", "-1"),
            ("x-memory-long-term-enabled", "yes"),
            ("x-memory-extraction-every", "0"),
            ("x-memory-memory-half-life", "P1M"),
            ("x-memory-memory-min-decay", "2"),
        ] {
            let mut map = headers(&[("x-memory-conversation-id", "c1")]);
            map.insert(
                http::HeaderName::from_static(name),
                HeaderValue::from_static(bad),
            );
            assert_eq!(param_of(identify(&config(), &map, None, true)), name);
        }
        let twice = headers(&[("x-memory-user-id", "a"), ("x-memory-user-id", "b")]);
        assert_eq!(
            param_of(identify(&config(), &twice, None, true)),
            "x-memory-user-id"
        );
    }

    #[test]
    fn no_conversation_means_no_key() {
        let id = identify(&config(), &headers(&[]), None, true).unwrap();
        assert!(id.key.is_none());
        assert_eq!(id.agent, "default");
    }

    #[test]
    fn bad_headers_are_named() {
        let c = config();
        assert_eq!(
            param_of(identify(
                &c,
                &headers(&[("x-memory-recent-n", "many")]),
                None,
                true,
            )),
            "x-memory-recent-n"
        );
        assert_eq!(
            param_of(identify(
                &c,
                &headers(&[("x-memory-colour", "red")]),
                None,
                true
            )),
            "x-memory-colour"
        );
        assert_eq!(
            param_of(identify(
                &c,
                &headers(&[("x-memory-conversation-id", "../etc")]),
                None,
                true,
            )),
            "x-memory-conversation-id"
        );
        assert_eq!(
            param_of(identify(
                &c,
                &headers(&[("x-memory-agent", "a"), ("x-memory-agent", "b")]),
                None,
                true,
            )),
            "x-memory-agent"
        );
    }

    #[test]
    fn path_ids_are_equivalent_to_headers() {
        let ids = PathIds {
            agent: "support",
            conversation: "p1",
        };
        let id = identify(&config(), &headers(&[]), Some(ids), true).unwrap();
        assert_eq!(id.key.unwrap().conversation, "p1");
        assert_eq!(id.settings.recent_n, 3);
        let clash = identify(
            &config(),
            &headers(&[("x-memory-conversation-id", "other")]),
            Some(ids),
            true,
        );
        assert_eq!(param_of(clash), "x-memory-conversation-id");
    }

    #[test]
    fn the_tenant_comes_from_whichever_header_carries_the_credential() {
        let key = TenantId::from_token(Some("sk-1"));
        for pairs in [
            &[("authorization", "Bearer sk-1")][..],
            &[("api-key", "sk-1")],
            &[("x-api-key", "sk-1")],
            &[("authorization", "Bearer sk-1"), ("x-api-key", "sk-1")],
            &[("api-key", "sk-1"), ("api-key", "sk-1")],
            // An empty bearer (an SDK with no key) presents nothing next to a real key.
            &[("authorization", "Bearer"), ("api-key", "sk-1")],
        ] {
            assert_eq!(tenant_of(pairs).unwrap(), key, "{pairs:?}");
        }
        let basic = tenant_of(&[("authorization", "Basic dXNlcjpwdw==")]).unwrap();
        assert_ne!(basic, key);
        assert_ne!(
            basic,
            tenant_of(&[("authorization", "Basic b3RoZXI6cHc=")]).unwrap()
        );
        assert_eq!(tenant_of(&[]).unwrap().as_str(), "anonymous");
    }

    #[test]
    fn two_different_credentials_are_a_400_naming_both_headers() {
        for (pairs, named) in [
            (
                &[("authorization", "Bearer a"), ("x-api-key", "b")][..],
                "authorization, x-api-key",
            ),
            (
                &[("api-key", "a"), ("x-api-key", "b")],
                "api-key, x-api-key",
            ),
            (&[("api-key", "a"), ("api-key", "b")], "api-key"),
            (
                &[("authorization", "Basic a"), ("x-api-key", "a")],
                "authorization, x-api-key",
            ),
        ] {
            let err = tenant_of(pairs).unwrap_err();
            assert!(!err.to_string().contains(" a"), "{err}");
            match err {
                ProxyError::InvalidRequest { param, code, .. } => {
                    assert_eq!(param.as_deref(), Some(named));
                    assert_eq!(code, "conflicting_credentials");
                }
                other => panic!("{other:?}"),
            }
        }
        // Pass-through requests are not looked at.
        let through = headers(&[("api-key", "a"), ("x-api-key", "b")]);
        assert!(
            identify(&config(), &through, None, true)
                .unwrap()
                .key
                .is_none()
        );
    }

    #[test]
    fn no_credential_is_refused_unless_anonymous_memory_is_allowed() {
        let strict = crate::config::from_toml("", &|_| None).unwrap();
        let none = headers(&[("x-memory-conversation-id", "c")]);
        let err = identify(&strict, &none, None, true).unwrap_err();
        assert_eq!(err.status(), http::StatusCode::UNAUTHORIZED);
        assert!(err.to_string().contains("auth.allow_anonymous"), "{err}");
        let keyed = headers(&[("x-memory-conversation-id", "c"), ("x-api-key", "k")]);
        assert!(identify(&strict, &keyed, None, true).is_ok());
        assert!(identify(&strict, &headers(&[]), None, true).is_ok());
        // Only memory needs a tenant: not another route, not memory switched off.
        let other_route = identify(&strict, &none, None, false).unwrap();
        assert!(other_route.key.is_none());
        assert_eq!(other_route.conversation.as_deref(), Some("c"));
        let off = headers(&[
            ("x-memory-conversation-id", "c"),
            ("x-memory-enabled", "false"),
        ]);
        assert!(identify(&strict, &off, None, true).unwrap().key.is_none());
    }

    #[test]
    fn overrides_can_be_disabled() {
        let c = crate::config::from_toml("[memory]\nallow_header_overrides = false\n", &|_| None)
            .unwrap();
        let result = identify(&c, &headers(&[("x-memory-recent-n", "2")]), None, true);
        assert_eq!(param_of(result), "x-memory-recent-n");
    }

    proptest::proptest! {
        /// Any `x-memory-*` header with any visible value: accepted or a 400 naming it.
        #[test]
        fn arbitrary_memory_headers_are_accepted_or_named(
            name in "x-memory-[a-z-]{1,24}",
            value in "[ -~]{0,40}",
        ) {
            let mut map = HeaderMap::new();
            let (Ok(header), Ok(v)) = (http::HeaderName::try_from(name.as_str()), HeaderValue::from_str(&value)) else {
                return Ok(());
            };
            map.insert(header, v);
            match identify(&config(), &map, None, true) {
                Ok(_) => {}
                Err(ProxyError::InvalidRequest { param, .. }) => proptest::prop_assert_eq!(param, Some(name.clone())),
                Err(other) => proptest::prop_assert!(false, "{other:?}"),
            }
        }
    }
}
