//! Checks every section shares: durations, counts that must be at least 1, and secrets read
//! from a named environment variable. Each pushes a problem naming its key and returns the
//! default, so checking goes on and every problem is reported at once.

use std::time::Duration;

use crate::settings::parse_iso8601_duration;

/// A secret string whose `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// An ISO-8601 duration such as `PT30S`; `default` when unset or wrong.
pub(super) fn duration(
    key: &str,
    value: Option<String>,
    default: Duration,
    problems: &mut Vec<String>,
) -> Duration {
    match value {
        None => default,
        Some(text) => parse_iso8601_duration(&text).unwrap_or_else(|| {
            problems.push(format!(
                "{key}: `{text}` is not an ISO-8601 duration such as PT30S or PT1H"
            ));
            default
        }),
    }
}

/// A duration longer than zero; `default` when unset or wrong.
pub(super) fn nonzero_duration(
    key: &str,
    value: Option<String>,
    default: Duration,
    problems: &mut Vec<String>,
) -> Duration {
    let every = duration(key, value, default, problems);
    if every.is_zero() {
        problems.push(format!("{key}: must be longer than zero"));
    }
    every
}

/// A count of at least 1; `default` when unset or 0.
pub(super) fn at_least_one(
    key: &str,
    value: Option<u64>,
    default: usize,
    problems: &mut Vec<String>,
) -> usize {
    match value {
        None => default,
        Some(0) => {
            problems.push(format!("{key}: must be at least 1"));
            default
        }
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
    }
}

/// The trimmed value of the environment variable `name`, which `key` names; a problem when it
/// is not set or empty.
pub(super) fn secret_from_env(
    key: &str,
    name: &str,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<String>,
) -> Option<Secret> {
    let secret = env(name)
        .filter(|value| !value.trim().is_empty())
        .map(|value| Secret(value.trim().to_string()));
    if secret.is_none() {
        problems.push(format!(
            "{key}: environment variable `{name}` is not set or empty"
        ));
    }
    secret
}
