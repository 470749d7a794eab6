//! The TOML file read into the raw section structs, with every unknown key and every value of
//! the wrong type reported, not just the first.
//!
//! serde's `deny_unknown_fields` stops at the first unknown key, and a whole-document
//! `toml::from_str` stops at the first wrong value. So the document is parsed into a table
//! first (a syntax error is still the one problem), then each section is read on its own: keys
//! its raw struct does not have are reported as `section.key` and dropped, and a value of the
//! wrong type is reported and dropped before the section is read again. The keys a raw struct
//! has are the field names serde's derive passes to `deserialize_struct` ([`field_names`]), so
//! the structs stay the only list of keys. They keep `deny_unknown_fields` as a guard: by the
//! time a section is deserialized, its unknown keys are gone.

use std::collections::BTreeMap;

use serde::de::{DeserializeOwned, Deserializer, Error as _, Visitor};
use toml::Spanned;
use toml::de::{DeTable, DeValue, ValueDeserializer};

use super::ConfigError;
use super::admin::RawAdmin;
use super::auth::RawAuth;
use super::compression::RawCompression;
use super::embedding::RawEmbedding;
use super::limits::RawLimits;
use super::mcp::RawMcp;
use super::receipts::RawReceipts;
use super::server::{RawLog, RawServer};
use super::storage::RawStorage;
use super::sweeper::RawSweeper;
use super::upstream::RawUpstream;

/// Every section of the file, as written (unset sections at their defaults).
#[derive(Debug, Default)]
pub(super) struct RawConfig {
    pub server: RawServer,
    pub upstream: RawUpstream,
    pub auth: RawAuth,
    pub storage: RawStorage,
    pub log: RawLog,
    pub admin: RawAdmin,
    pub sweeper: RawSweeper,
    pub compression: RawCompression,
    pub limits: RawLimits,
    pub receipts: RawReceipts,
    pub mcp: RawMcp,
    pub embedding: RawEmbedding,
    /// `[memory]`: checked key by key against the settings table.
    pub memory: toml::Table,
    /// `[agents.NAME]`: checked like `[memory]`.
    pub agents: BTreeMap<String, toml::Table>,
}

impl RawConfig {
    /// Reads a TOML document. A syntax error is the one problem returned as an error; otherwise
    /// the problems found while reading the sections come back with what could be read.
    pub(super) fn parse(text: &str) -> Result<(RawConfig, Vec<String>), ConfigError> {
        let root = DeTable::parse(text).map_err(|err| ConfigError {
            problems: vec![one_line(&err)],
        })?;
        let mut document = Document {
            text,
            root: root.into_inner(),
            sections: Vec::new(),
            problems: Vec::new(),
        };
        let raw = RawConfig {
            server: document.section("server"),
            upstream: document.section("upstream"),
            auth: document.section("auth"),
            storage: document.section("storage"),
            log: document.section("log"),
            admin: document.section("admin"),
            sweeper: document.section("sweeper"),
            compression: document.section("compression"),
            limits: document.section("limits"),
            receipts: document.section("receipts"),
            mcp: document.section("mcp"),
            embedding: document.section("embedding"),
            memory: document.section("memory"),
            agents: document.section("agents"),
        };
        Ok((raw, document.finish()))
    }
}

/// A parsed document whose sections are taken out one by one.
struct Document<'i> {
    text: &'i str,
    root: DeTable<'i>,
    /// The sections taken so far: the known top-level keys.
    sections: Vec<&'static str>,
    problems: Vec<String>,
}

impl Document<'_> {
    /// Takes the section `name` out of the document and reads it as `T`, reporting each unknown
    /// key and each wrong value; what cannot be read keeps its default.
    fn section<T: DeserializeOwned + Default>(&mut self, name: &'static str) -> T {
        self.sections.push(name);
        let Some(value) = self.root.remove(name) else {
            return T::default();
        };
        let span = value.span();
        let mut value = value.into_inner();
        if let (DeValue::Table(table), Some(known)) = (&mut value, field_names::<T>()) {
            let unknown: Vec<String> = table
                .keys()
                .map(|key| key.get_ref().to_string())
                .filter(|key| !known.contains(&key.as_str()))
                .collect();
            for key in unknown {
                table.remove(key.as_str());
                self.problems
                    .push(unknown_key(&format!("{name}.{key}"), known));
            }
        }
        // Each pass drops the value it failed on, so this ends after at most one pass per key.
        loop {
            let deserializer = ValueDeserializer::from(Spanned::new(span.clone(), value.clone()));
            let mut err = match T::deserialize(deserializer) {
                Ok(section) => return section,
                Err(err) => err,
            };
            err.set_input(Some(self.text));
            self.problems.push(one_line(&err));
            let culprit = match (&value, err.span()) {
                (DeValue::Table(table), Some(at)) => table
                    .iter()
                    .find(|(_, v)| v.span().contains(&at.start))
                    .map(|(key, _)| key.clone()),
                _ => None,
            };
            match (&mut value, culprit) {
                (DeValue::Table(table), Some(key)) => {
                    table.remove(&key);
                }
                _ => return T::default(),
            }
        }
    }

    /// The problems found, with every top-level key that is no section.
    fn finish(mut self) -> Vec<String> {
        for key in self.root.keys() {
            let problem = unknown_key(key.get_ref(), &self.sections);
            self.problems.push(problem);
        }
        self.problems
    }
}

fn unknown_key(path: &str, known: &[&str]) -> String {
    format!("{path}: unknown key (known: {})", known.join(", "))
}

/// A TOML error on one line, as every problem is.
fn one_line(err: &toml::de::Error) -> String {
    err.to_string().trim().replace('\n', " ")
}

/// The field names of a struct deriving `Deserialize`, or `None` for any other type (a map, a
/// table). serde's derive hands them to `deserialize_struct`; this deserializer keeps them
/// and stops there.
fn field_names<T: DeserializeOwned>() -> Option<&'static [&'static str]> {
    #[derive(Default)]
    struct FieldNames(Option<&'static [&'static str]>);

    impl<'de> Deserializer<'de> for &mut FieldNames {
        type Error = serde::de::value::Error;

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = Some(fields);
            Err(Self::Error::custom("field names read"))
        }

        fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Self::Error> {
            Err(Self::Error::custom("not a struct"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }

    let mut names = FieldNames::default();
    // The error is the stop this deserializer always gives; the names are what was wanted.
    let _ = T::deserialize(&mut names);
    names.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_names_are_the_raw_structs_keys() {
        assert_eq!(
            field_names::<RawSweeper>(),
            Some(&["interval", "max_scanned", "max_deleted"][..])
        );
        assert_eq!(field_names::<toml::Table>(), None);
        assert_eq!(field_names::<BTreeMap<String, toml::Table>>(), None);
    }

    #[test]
    fn every_unknown_key_and_wrong_value_is_reported_and_the_rest_is_read() {
        let text = "nope = 1\n[server]\nlisten = \"127.0.0.1:9\"\nfoo = 1\nbar = 2\n\
                    worker_threads = \"many\"\nbody_limit_bytes = \"big\"\n[log]\nformat = 7\n";
        let (raw, problems) = RawConfig::parse(text).unwrap();
        // What is right in a section with problems is still read.
        assert!(format!("{:?}", raw.server).contains(r#"listen: Some("127.0.0.1:9")"#));
        assert_eq!(problems.len(), 6, "{problems:#?}");
        let has = |start: &str| problems.iter().any(|p| p.starts_with(start));
        assert!(has(
            "server.foo: unknown key (known: listen, body_limit_bytes, "
        ));
        assert!(has("server.bar: unknown key"));
        assert!(has("nope: unknown key (known: server, upstream, "));
        // Wrong values are reported as toml words them, with their line.
        for line in ["line 6", "line 7", "line 9"] {
            assert!(
                problems.iter().any(|p| p.contains(line)),
                "{line}: {problems:#?}"
            );
        }
    }

    #[test]
    fn a_syntax_error_is_the_one_problem() {
        let err = RawConfig::parse("[server\nlisten = 1\n").unwrap_err();
        assert_eq!(err.problems.len(), 1);
        assert!(err.problems[0].contains("line 1"), "{err}");
    }
}
