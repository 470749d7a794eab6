//! `[admin]`: the admin API's token and whether `GET /metrics` needs it too.

use serde::Deserialize;

use super::values::{Secret, secret_from_env};

/// The environment variable holding the admin token when `admin.token_env` names none.
pub const DEFAULT_ADMIN_TOKEN_ENV: &str = "MEMPROXY_ADMIN_TOKEN";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    token_env: Option<String>,
    protect_metrics: Option<bool>,
}

/// `[admin]`, checked.
pub(super) struct Admin {
    /// `None`: the admin API is off (404).
    pub token: Option<Secret>,
    pub protect_metrics: bool,
}

/// Checks `[admin]`. The token comes from the named variable (which must then be set), else
/// from [`DEFAULT_ADMIN_TOKEN_ENV`] when it is set; none means the admin API is off.
pub(super) fn check_admin(
    raw: RawAdmin,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<String>,
) -> Admin {
    let token = match raw.token_env.as_deref().filter(|name| !name.is_empty()) {
        Some(name) => secret_from_env("admin.token_env", name, env, problems),
        None => env(DEFAULT_ADMIN_TOKEN_ENV)
            .filter(|v| !v.trim().is_empty())
            .map(|v| Secret(v.trim().to_string())),
    };
    let token_env_named = raw.token_env.is_some_and(|name| !name.is_empty());
    let protect_metrics = raw.protect_metrics.unwrap_or(false);
    if protect_metrics && token.is_none() && !token_env_named {
        problems.push(format!(
            "admin.protect_metrics: needs an admin token ({DEFAULT_ADMIN_TOKEN_ENV} or admin.token_env)"
        ));
    }
    Admin {
        token,
        protect_metrics,
    }
}
