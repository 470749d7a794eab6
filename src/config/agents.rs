//! `[memory]` and `[agents.NAME]`: the memory settings profiles. `[memory]` lies over the
//! built-in defaults and is the profile of any agent not named; each `[agents.NAME]` lies over
//! `[memory]`. Keys are the settings of [`settings::SETTINGS`], checked one by one.

use std::collections::BTreeMap;

use crate::identity::is_valid_id;
use crate::settings::{self, MemorySettings};

/// `[memory]` and `[agents.*]`, checked.
pub(super) struct Profiles {
    pub allow_header_overrides: bool,
    pub memory: MemorySettings,
    pub agents: BTreeMap<String, MemorySettings>,
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
    for (name, table) in agent_tables {
        if !is_valid_id(name) {
            problems.push(format!(
                "agents.{name}: an agent name is 1-128 characters from A-Za-z0-9._:@-"
            ));
        }
        let profile = apply_table(memory.clone(), table, &format!("agents.{name}"), problems);
        agents.insert(name.clone(), profile);
    }
    Profiles {
        allow_header_overrides,
        memory,
        agents,
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
