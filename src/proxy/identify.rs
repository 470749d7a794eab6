//! Identify: which conversation a request belongs to and the settings it runs with.
//!
//! Reads the `X-Memory-*` headers (and the path form's ids), checks every one, and merges the
//! settings: the agent's profile from the config, then the headers. Any header memproxy does not
//! know, or a bad value, is a 400 that names the header and what it accepts.

use http::HeaderMap;

use crate::config::Config;
use crate::error::ProxyError;
use crate::identity::{ConversationKey, DEFAULT_AGENT, TenantId, bearer_token, is_valid_id};
use crate::settings::{self, MemorySettings, SettingError};

pub const CONVERSATION_HEADER: &str = "x-memory-conversation-id";
pub const AGENT_HEADER: &str = "x-memory-agent";

/// Who the request is for and how memory behaves for it.
#[derive(Debug, Clone)]
pub struct Identity {
    /// `None` when the request carries no conversation id: it is forwarded untouched.
    pub key: Option<ConversationKey>,
    pub agent: String,
    pub settings: MemorySettings,
}

/// Ids given by the path form `/agents/{agent}/conversations/{conversation}/v1/...`.
#[derive(Debug, Clone, Copy)]
pub struct PathIds<'a> {
    pub agent: &'a str,
    pub conversation: &'a str,
}

pub fn identify(
    config: &Config,
    headers: &HeaderMap,
    path_ids: Option<PathIds<'_>>,
) -> Result<Identity, ProxyError> {
    let mut conversation: Option<String> = None;
    let mut agent: Option<String> = None;
    let mut overrides: Vec<(&'static str, String, String)> = Vec::new();

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
            CONVERSATION_HEADER => conversation = Some(checked_id(name, value)?),
            AGENT_HEADER => agent = Some(checked_id(name, value)?),
            _ => match settings::setting_for_header(name) {
                Some(setting) => overrides.push((setting, name.to_string(), value)),
                None => {
                    return Err(ProxyError::invalid(
                        name,
                        "unknown_header",
                        format!(
                            "unknown header `{name}`: memproxy accepts {}, {} and {}",
                            CONVERSATION_HEADER,
                            AGENT_HEADER,
                            settings::SETTINGS
                                .iter()
                                .map(|(s, _)| settings::header_name(s))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    ));
                }
            },
        }
    }

    if let Some(ids) = path_ids {
        for (header, from_path, from_header) in [
            (
                CONVERSATION_HEADER,
                ids.conversation,
                conversation.as_deref(),
            ),
            (AGENT_HEADER, ids.agent, agent.as_deref()),
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
        conversation = Some(ids.conversation.to_string());
        agent = Some(ids.agent.to_string());
    }

    let agent = agent.unwrap_or_else(|| DEFAULT_AGENT.to_string());
    let mut settings = config.profile(&agent).clone();
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

    // The tenant (a hash of the token) is only needed with a conversation: pass-through
    // requests skip the hashing.
    let key = conversation.map(|conversation| ConversationKey {
        tenant: TenantId::from_token(
            headers
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(bearer_token),
        ),
        agent: agent.clone(),
        conversation,
    });
    Ok(Identity {
        key,
        agent,
        settings,
    })
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
        crate::config::from_toml("[agents.support]\nrecent_n = 3\n", &|_| None).unwrap()
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
    fn no_conversation_means_no_key() {
        let id = identify(&config(), &headers(&[]), None).unwrap();
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
                None
            )),
            "x-memory-recent-n"
        );
        assert_eq!(
            param_of(identify(&c, &headers(&[("x-memory-colour", "red")]), None)),
            "x-memory-colour"
        );
        assert_eq!(
            param_of(identify(
                &c,
                &headers(&[("x-memory-conversation-id", "../etc")]),
                None
            )),
            "x-memory-conversation-id"
        );
        assert_eq!(
            param_of(identify(
                &c,
                &headers(&[("x-memory-agent", "a"), ("x-memory-agent", "b")]),
                None
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
        let id = identify(&config(), &headers(&[]), Some(ids)).unwrap();
        assert_eq!(id.key.unwrap().conversation, "p1");
        assert_eq!(id.settings.recent_n, 3);
        let clash = identify(
            &config(),
            &headers(&[("x-memory-conversation-id", "other")]),
            Some(ids),
        );
        assert_eq!(param_of(clash), "x-memory-conversation-id");
    }

    #[test]
    fn overrides_can_be_disabled() {
        let c = crate::config::from_toml("[memory]\nallow_header_overrides = false\n", &|_| None)
            .unwrap();
        let result = identify(&c, &headers(&[("x-memory-recent-n", "2")]), None);
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
            match identify(&config(), &map, None) {
                Ok(_) => {}
                Err(ProxyError::InvalidRequest { param, .. }) => proptest::prop_assert_eq!(param, Some(name.clone())),
                Err(other) => proptest::prop_assert!(false, "{other:?}"),
            }
        }
    }
}
