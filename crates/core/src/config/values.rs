//! Checks every section shares: durations, counts that must be at least 1, sizes in bytes, and
//! secrets read from a named environment variable. Each pushes a problem naming its key and returns the
//! default, so checking goes on and every problem is reported at once.

use std::time::Duration;

use serde::Deserialize;

use crate::settings::parse_iso8601_duration;

/// A size as written: a number of bytes, or a string with a binary unit (`"192MiB"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum RawSize {
    Bytes(u64),
    Text(String),
}

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

/// A size in bytes: a number, or a string such as `"192MiB"`, `"1 GiB"` or `"256Mi"` (KiB, MiB,
/// GiB, and Kubernetes' Ki, Mi, Gi, all powers of 1024); `None` when unset or wrong.
pub(super) fn size(key: &str, value: Option<RawSize>, problems: &mut Vec<String>) -> Option<u64> {
    match value? {
        RawSize::Bytes(bytes) => Some(bytes),
        RawSize::Text(text) => {
            let bytes = parse_size(&text);
            if bytes.is_none() {
                problems.push(format!(
                    "{key}: `{text}` is not a size such as \"192MiB\", \"1GiB\" or a number of bytes"
                ));
            }
            bytes
        }
    }
}

/// Parses `"192MiB"`, `"1 GiB"`, `"256Mi"`, `"4096"` (bytes).
fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: u64 = number.parse().ok()?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" | "Ki" => 10,
        "MiB" | "Mi" => 20,
        "GiB" | "Gi" => 30,
        _ => return None,
    };
    number.checked_mul(1 << shift)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_units() {
        for (text, bytes) in [
            ("4096", Some(4096)),
            ("192MiB", Some(192 << 20)),
            ("192 MiB", Some(192 << 20)),
            ("256Mi", Some(256 << 20)),
            ("1GiB", Some(1 << 30)),
            ("2Gi", Some(2 << 30)),
            ("512KiB", Some(512 << 10)),
            ("100B", Some(100)),
            ("192MB", None),
            ("192 mib", None),
            ("MiB", None),
            ("-1MiB", None),
            ("1.5GiB", None),
            ("99999999999999GiB", None),
        ] {
            assert_eq!(parse_size(text), bytes, "{text}");
        }
        let mut problems = Vec::new();
        assert_eq!(size("k", None, &mut problems), None);
        assert_eq!(size("k", Some(RawSize::Bytes(9)), &mut problems), Some(9));
        assert_eq!(
            size("k", Some(RawSize::Text("2MiB".into())), &mut problems),
            Some(2 << 20)
        );
        assert!(problems.is_empty());
        assert_eq!(
            size("k", Some(RawSize::Text("lots".into())), &mut problems),
            None
        );
        assert!(
            problems[0].starts_with("k: `lots` is not a size"),
            "{problems:?}"
        );
    }
}
