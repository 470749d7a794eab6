//! `[memory]` and `[agents.NAME]`: the memory settings profiles. `[memory]` lies over the
//! built-in defaults and is the profile of any agent not named; each `[agents.NAME]` lies over
//! `[memory]`. Keys are the settings of [`settings::SETTINGS`], checked one by one.

use std::collections::BTreeMap;

use crate::settings::{self, MemorySettings};
use memproxy_base::identity::is_valid_id;

/// `[memory]` and `[agents.*]`, checked.
pub(super) struct Profiles {
    pub allow_header_overrides: bool,
    pub memory: MemorySettings,
    pub agents: BTreeMap<String, MemorySettings>,
    /// Each agent's `compression_max_tokens_per_day`, where set.
    pub max_tokens_per_day: BTreeMap<String, u64>,
}

/// The key of `[agents.NAME]` that is no setting: the agent's daily budget for background
/// model calls. Not a setting, so no `X-Memory-*` header can lift it.
pub const AGENT_BUDGET_KEY: &str = "compression_max_tokens_per_day";

/// The daily budget of background model calls (summaries, memory extraction), per agent
/// label: each agent named in the config has its own; every other agent shares the budget of
/// the label `other`. Tokens of one UTC day; `None`: no limit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackgroundBudget {
    /// `compression.max_tokens_per_day`: agents without their own, and `other`.
    pub default: Option<u64>,
    /// Named agents' budgets (their own, else the default).
    pub agents: BTreeMap<String, Option<u64>>,
}

impl BackgroundBudget {
    /// The budget of an agent label (a name from the config, or `other`).
    pub fn limit(&self, label: &str) -> Option<u64> {
        self.agents.get(label).copied().unwrap_or(self.default)
    }
}

/// Checks `[memory]` (with its one key that is no setting, `allow_header_overrides`) and every
/// `[agents.NAME]`.
pub(super) fn check_profiles(
    mut memory_table: toml::Table,
    agent_tables: &BTreeMap<String, toml::Table>,
    problems: &mut Vec<String>,
) -> Profiles {
    let allow_header_overrides = match memory_table.remove("allow_header_overrides") {
        None => true,
        Some(toml::Value::Boolean(b)) => b,
        Some(other) => {
            problems.push(format!(
                "memory.allow_header_overrides: must be `true` or `false`, got {other}"
            ));
            true
        }
    };
    let memory = apply_table(MemorySettings::default(), &memory_table, "memory", problems);
    let mut agents = BTreeMap::new();
    let mut max_tokens_per_day = BTreeMap::new();
    for (name, table) in agent_tables {
        if !is_valid_id(name) {
            problems.push(format!(
                "agents.{name}: an agent name is 1-128 characters from A-Za-z0-9._:@-"
            ));
        }
        let mut table = table.clone();
        match table.remove(AGENT_BUDGET_KEY) {
            None => {}
            Some(toml::Value::Integer(n)) if n > 0 => {
                max_tokens_per_day.insert(name.clone(), n as u64);
            }
            Some(other) => problems.push(format!(
                "agents.{name}.{AGENT_BUDGET_KEY}: must be a whole number of tokens above 0, got {other}"
            )),
        }
        let profile = apply_table(memory.clone(), &table, &format!("agents.{name}"), problems);
        agents.insert(name.clone(), profile);
    }
    Profiles {
        allow_header_overrides,
        memory,
        agents,
        max_tokens_per_day,
    }
}

/// `table`'s settings over `settings`; each unknown key or bad value is a problem under
/// `section`.
fn apply_table(
    mut settings: MemorySettings,
    table: &toml::Table,
    section: &str,
    problems: &mut Vec<String>,
) -> MemorySettings {
    for (key, value) in table {
        let Some(kind) = settings::kind_of(key) else {
            problems.push(format!("{section}.{key}: unknown setting"));
            continue;
        };
        let text = match (kind, value) {
            (settings::Kind::Bool, toml::Value::Boolean(b)) => b.to_string(),
            (
                settings::Kind::Integer { .. }
                | settings::Kind::OptionalInteger { .. }
                | settings::Kind::IntegerOrAuto { .. },
                toml::Value::Integer(n),
            ) => n.to_string(),
            (settings::Kind::Fraction, toml::Value::Float(f)) => f.to_string(),
            (settings::Kind::Fraction, toml::Value::Integer(n)) => n.to_string(),
            (
                settings::Kind::Duration
                | settings::Kind::PositiveDuration
                | settings::Kind::OptionalDuration
                | settings::Kind::OptionalName
                | settings::Kind::Language
                | settings::Kind::OptionalInteger { .. }
                | settings::Kind::IntegerOrAuto { .. },
                toml::Value::String(s),
            ) => s.clone(),
            _ => {
                problems.push(format!("{section}.{key}: must be {}", kind.describe()));
                continue;
            }
        };
        if let Err(err) = settings.apply(key, &text) {
            problems.push(format!("{section}.{key}: {err}"));
        }
    }
    settings
}
