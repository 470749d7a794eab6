//! `[mcp]`: the memory tools over the Model Context Protocol (`src/mcp/`): whether `/mcp` is
//! served, and the `Host` names it answers (a browser page that a DNS name rebinds to
//! memproxy's address must not reach the tools).

use serde::Deserialize;

/// The `Host` names `/mcp` answers by default: loopback only (a port is allowed after each).
pub const DEFAULT_MCP_ALLOWED_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// `[mcp]`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpConfig {
    /// `/mcp` is served (default); off, it is 404 like any unknown path.
    pub enabled: bool,
    /// The `Host` names (or `host:port`) `/mcp` answers; empty: any (`allowed_hosts = ["*"]`).
    pub allowed_hosts: Vec<String>,
}

impl Default for McpConfig {
    fn default() -> McpConfig {
        McpConfig {
            enabled: true,
            allowed_hosts: DEFAULT_MCP_ALLOWED_HOSTS.map(String::from).to_vec(),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMcp {
    enabled: Option<bool>,
    allowed_hosts: Option<Vec<String>>,
}

/// Checks `[mcp]`: every allowed host a name or `host:port` without spaces or slashes, or
/// `"*"` alone.
pub(super) fn check_mcp(raw: RawMcp, problems: &mut Vec<String>) -> McpConfig {
    let defaults = McpConfig::default();
    let hosts = raw.allowed_hosts.unwrap_or(defaults.allowed_hosts);
    let allowed_hosts = if hosts.len() == 1 && hosts[0] == "*" {
        Vec::new()
    } else {
        let bad = |h: &String| {
            h.is_empty() || h == "*" || h.contains(|c: char| c.is_whitespace() || c == '/')
        };
        if hosts.is_empty() || hosts.iter().any(bad) {
            problems.push(
                "mcp.allowed_hosts: a list of host names (or host:port), or [\"*\"] for any host"
                    .to_string(),
            );
        }
        hosts
    };
    McpConfig {
        enabled: raw.enabled.unwrap_or(defaults.enabled),
        allowed_hosts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checked(toml: &str) -> (McpConfig, Vec<String>) {
        let raw: RawMcp = toml::from_str(toml).unwrap();
        let mut problems = Vec::new();
        (check_mcp(raw, &mut problems), problems)
    }

    #[test]
    fn mcp_is_on_for_loopback_hosts_by_default_and_a_star_allows_any() {
        let (config, problems) = checked("");
        assert!(problems.is_empty());
        assert_eq!(config, McpConfig::default());
        assert!(config.enabled);
        let (config, _) = checked("enabled = false\nallowed_hosts = [\"*\"]");
        assert!(!config.enabled);
        assert!(config.allowed_hosts.is_empty());
        let (config, problems) = checked("allowed_hosts = [\"memproxy\", \"memproxy:8080\"]");
        assert!(problems.is_empty());
        assert_eq!(config.allowed_hosts, ["memproxy", "memproxy:8080"]);
    }

    #[test]
    fn bad_hosts_are_named() {
        for bad in [
            "allowed_hosts = []",
            "allowed_hosts = [\"\"]",
            "allowed_hosts = [\"a b\"]",
            "allowed_hosts = [\"*\", \"x\"]",
            "allowed_hosts = [\"http://x/\"]",
        ] {
            let (_, problems) = checked(bad);
            assert_eq!(problems.len(), 1, "{bad}");
            assert!(problems[0].starts_with("mcp.allowed_hosts"), "{bad}");
        }
    }
}
