//! `[upstream]`: where requests go, with which key, and how long memproxy waits; and
//! `[upstream.anthropic]`: where the Anthropic Messages API goes (same time limits).

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use super::values::{Secret, duration, nonzero_duration, secret_from_env};

pub const DEFAULT_UPSTREAM: &str = "https://api.openai.com/v1";
pub const DEFAULT_ANTHROPIC_UPSTREAM: &str = "https://api.anthropic.com";
/// The `anthropic-version` memproxy's own calls to the Anthropic API send.
pub const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);
/// Time allowed for a JSON answer's body once its head arrived. Upstreams send a non-streaming
/// answer's head when the completion is done, so its body follows at once; a long completion
/// is bounded by `timeout`, not by this.
pub const DEFAULT_UPSTREAM_READ_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest pause between two pieces of an upstream body (an SSE stream, a pass-through
/// download). Models send SSE chunks (or keep-alive comments) far more often than this.
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// The base URL including its version path, like an SDK's `base_url`.
    pub base_url: BaseUrl,
    /// The key memproxy sends instead of the client's `Authorization`, when configured.
    pub api_key: Option<Secret>,
    pub connect_timeout: Duration,
    /// How long to wait for the upstream's response head.
    pub timeout: Duration,
    /// How long to wait for the whole body of an answer memproxy reads (JSON), once its head
    /// arrived.
    pub read_timeout: Duration,
    /// The longest pause between two frames of any upstream body.
    pub idle_timeout: Duration,
    /// The header memproxy's own key goes in.
    pub key_header: KeyHeader,
    /// `[upstream.anthropic]`.
    pub anthropic: AnthropicUpstream,
}

/// How an upstream takes memproxy's own key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyHeader {
    /// `Authorization: Bearer KEY` (OpenAI-compatible).
    Bearer,
    /// `x-api-key: KEY` (Anthropic).
    XApiKey,
}

/// `[upstream.anthropic]`: the Anthropic Messages API's upstream.
#[derive(Debug, Clone)]
pub struct AnthropicUpstream {
    /// The base URL as an Anthropic SDK takes it (no `/v1`), with `/v1` added: `/v1/messages`
    /// maps onto it like every path onto `[upstream] base_url`.
    pub base_url: BaseUrl,
    /// The key memproxy sends as `x-api-key` instead of the client's, when configured.
    pub api_key: Option<Secret>,
    /// `anthropic-version` of memproxy's own calls (summaries).
    pub version: String,
    /// Models whose names start with one of these are called on this upstream when memproxy
    /// calls them itself (summaries).
    pub model_prefixes: Vec<String>,
}

impl UpstreamConfig {
    /// The config of the Anthropic upstream: its base URL and key, these time limits.
    pub fn anthropic_upstream(&self) -> UpstreamConfig {
        UpstreamConfig {
            base_url: self.anthropic.base_url.clone(),
            api_key: self.anthropic.api_key.clone(),
            key_header: KeyHeader::XApiKey,
            ..self.clone()
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAnthropic {
    base_url: Option<String>,
    api_key_env: Option<String>,
    version: Option<String>,
    model_prefixes: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    base_url: Option<String>,
    api_key_env: Option<String>,
    connect_timeout: Option<String>,
    timeout: Option<String>,
    read_timeout: Option<String>,
    idle_timeout: Option<String>,
    anthropic: Option<RawAnthropic>,
}

/// Checks `[upstream]`; `base_url` (from a flag or the environment) wins over the file, and
/// `env` reads the variable `api_key_env` names.
pub(super) fn check_upstream(
    raw: RawUpstream,
    base_url: Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<String>,
) -> UpstreamConfig {
    let base_text = base_url
        .or(raw.base_url)
        .unwrap_or_else(|| DEFAULT_UPSTREAM.to_string());
    let base_url = BaseUrl::parse(&base_text).unwrap_or_else(|why| {
        problems.push(format!("upstream.base_url: `{base_text}` {why}"));
        BaseUrl::default_openai()
    });
    let api_key = raw
        .api_key_env
        .filter(|name| !name.is_empty())
        .and_then(|name| secret_from_env("upstream.api_key_env", &name, env, problems));
    let anthropic = check_anthropic(raw.anthropic.unwrap_or_default(), env, problems);
    UpstreamConfig {
        key_header: KeyHeader::Bearer,
        anthropic,
        base_url,
        api_key,
        connect_timeout: duration(
            "upstream.connect_timeout",
            raw.connect_timeout,
            DEFAULT_CONNECT_TIMEOUT,
            problems,
        ),
        timeout: duration(
            "upstream.timeout",
            raw.timeout,
            DEFAULT_UPSTREAM_TIMEOUT,
            problems,
        ),
        read_timeout: nonzero_duration(
            "upstream.read_timeout",
            raw.read_timeout,
            DEFAULT_UPSTREAM_READ_TIMEOUT,
            problems,
        ),
        idle_timeout: nonzero_duration(
            "upstream.idle_timeout",
            raw.idle_timeout,
            DEFAULT_UPSTREAM_IDLE_TIMEOUT,
            problems,
        ),
    }
}

/// Checks `[upstream.anthropic]`.
fn check_anthropic(
    raw: RawAnthropic,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<String>,
) -> AnthropicUpstream {
    let text = raw
        .base_url
        .unwrap_or_else(|| DEFAULT_ANTHROPIC_UPSTREAM.to_string());
    let with_version = format!("{}/v1", text.trim_end_matches('/'));
    let base_url = BaseUrl::parse(&with_version).unwrap_or_else(|why| {
        problems.push(format!("upstream.anthropic.base_url: `{text}` {why}"));
        BaseUrl::default_anthropic()
    });
    let api_key = raw
        .api_key_env
        .filter(|name| !name.is_empty())
        .and_then(|name| secret_from_env("upstream.anthropic.api_key_env", &name, env, problems));
    let version = raw
        .version
        .unwrap_or_else(|| DEFAULT_ANTHROPIC_VERSION.to_string());
    if version.is_empty() || !version.bytes().all(|b| b.is_ascii_graphic()) {
        problems.push("upstream.anthropic.version: must be a non-empty header value".to_string());
    }
    AnthropicUpstream {
        base_url,
        api_key,
        version,
        model_prefixes: raw
            .model_prefixes
            .unwrap_or_else(|| vec!["claude".to_string()]),
    }
}

/// An upstream's base URL, checked when the config is read: `http` or `https`, a host, and a
/// path (the version path) with no query, kept without its trailing `/`. The edge turns it into
/// the URIs it sends to (`upstream.rs`); the config itself has no HTTP types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    scheme: String,
    authority: String,
    path: String,
}

impl BaseUrl {
    /// Checks `text` as an upstream base URL; the reason it is not one, else the URL.
    pub fn parse(text: &str) -> Result<BaseUrl, &'static str> {
        let text = text.trim_end_matches('/');
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_graphic()) || text.contains('#') {
            return Err("is not a URL");
        }
        let Some((scheme, rest)) = text.split_once("://") else {
            return Err("must start with http:// or https://");
        };
        let scheme = scheme.to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err("must start with http:// or https://");
        }
        let (authority, path) = rest.find('/').map_or((rest, ""), |at| rest.split_at(at));
        if authority.contains('?') || path.contains('?') {
            return Err("must not have a query");
        }
        let host_and_port = authority
            .rsplit_once('@')
            .map_or(authority, |(_, after)| after);
        let host = match host_and_port.strip_prefix('[') {
            Some(bracketed) => bracketed.split_once(']').map(|(ip6, _)| ip6),
            None => host_and_port.split(':').next(),
        };
        if host.is_none_or(str::is_empty) {
            return Err("has no host");
        }
        Ok(BaseUrl {
            scheme,
            authority: authority.to_string(),
            path: path.to_string(),
        })
    }

    /// `http` or `https`.
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// `host[:port]` (with `user@` if the URL gave one).
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// The version path without its trailing `/` (`/v1`), or empty.
    pub fn path(&self) -> &str {
        &self.path
    }

    fn default_openai() -> BaseUrl {
        BaseUrl {
            scheme: "https".into(),
            authority: "api.openai.com".into(),
            path: "/v1".into(),
        }
    }

    fn default_anthropic() -> BaseUrl {
        BaseUrl {
            scheme: "https".into(),
            authority: "api.anthropic.com".into(),
            path: "/v1".into(),
        }
    }
}

/// `scheme://authority/path`, with `/` for an empty path.
impl fmt::Display for BaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = if self.path.is_empty() {
            "/"
        } else {
            &self.path
        };
        write!(f, "{}://{}{}", self.scheme, self.authority, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_checked_and_kept_without_their_trailing_slash() {
        let url = BaseUrl::parse("HTTPS://user@api.example.com:8443/v1/").unwrap();
        assert_eq!(url.scheme(), "https");
        assert_eq!(url.authority(), "user@api.example.com:8443");
        assert_eq!(url.path(), "/v1");
        assert_eq!(url.to_string(), "https://user@api.example.com:8443/v1");
        assert_eq!(
            BaseUrl::parse("http://[::1]:9").unwrap().to_string(),
            "http://[::1]:9/"
        );
        assert_eq!(BaseUrl::default_openai().to_string(), DEFAULT_UPSTREAM);
        for (text, why) in [
            ("ftp://x/v1", "must start with http:// or https://"),
            ("api.openai.com/v1", "must start with http:// or https://"),
            ("http:///v1", "has no host"),
            ("http://:80/v1", "has no host"),
            ("http://x/v1?key=1", "must not have a query"),
            ("http://x y/v1", "is not a URL"),
            ("", "is not a URL"),
        ] {
            assert_eq!(BaseUrl::parse(text), Err(why), "{text}");
        }
    }
}
