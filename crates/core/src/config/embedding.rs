//! `[embedding]`: how memproxy turns text into vectors for recall by meaning
//! (`memproxy-embed`; `crate::embedding` runs it): which embedder, where its model is, and how
//! long the new message's embedding may take on the request path.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::values::{at_least_one, nonzero_duration};

/// The in-process embedders and the provider's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbedderKind {
    /// A static table distilled from all-MiniLM-L6-v2: a lookup per word piece (the default).
    Static,
    /// all-MiniLM-L6-v2's full forward pass: better vectors, milliseconds per text.
    Contextual,
    /// The upstream's OpenAI-compatible `/v1/embeddings`, with `upstream_model`.
    Upstream,
    /// No vectors: recall by words alone.
    Off,
}

impl EmbedderKind {
    /// What the embedder keeps resident in the process, which `server.memory_budget` sets
    /// aside before its split (`memory_budget.rs`).
    pub fn resident_bytes(self) -> u64 {
        match self {
            EmbedderKind::Static => super::memory_budget::STATIC_EMBEDDER_BYTES,
            EmbedderKind::Contextual => super::memory_budget::CONTEXTUAL_EMBEDDER_BYTES,
            EmbedderKind::Upstream | EmbedderKind::Off => 0,
        }
    }

    /// Whether its vectors are stored beside the messages (and so grow the store): the
    /// contextual model's and the provider's; the static table's are derived from the texts
    /// when a recall index is built.
    pub fn stores_vectors(self) -> bool {
        matches!(self, EmbedderKind::Contextual | EmbedderKind::Upstream)
    }

    pub fn name(self) -> &'static str {
        match self {
            EmbedderKind::Static => "static",
            EmbedderKind::Contextual => "contextual",
            EmbedderKind::Upstream => "upstream",
            EmbedderKind::Off => "off",
        }
    }
}

/// How long the new message's embedding may take before recall goes on by words alone.
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_millis(250);
/// Background embedding jobs waiting at most (each a commit's new messages); past it, a job
/// is dropped and counted (`memproxy vectors rebuild` makes what was missed).
pub const DEFAULT_EMBEDDING_QUEUE: usize = 4096;

/// `[embedding]`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingConfig {
    pub embedder: EmbedderKind,
    /// Where the model's files are (`None`: searched for, `memproxy_embed::ModelFiles`).
    pub model_dir: Option<PathBuf>,
    /// The static table's file, learned or distilled (`None`: the learned one beside the
    /// model, else the distilled one beside it or in the data directory).
    pub table: Option<PathBuf>,
    /// The provider's embedding model (`upstream` only).
    pub upstream_model: String,
    pub query_timeout: Duration,
    pub queue: usize,
    /// Threads one embedding may use (in-process embedders).
    pub threads: usize,
}

impl Default for EmbeddingConfig {
    fn default() -> EmbeddingConfig {
        EmbeddingConfig {
            embedder: EmbedderKind::Static,
            model_dir: None,
            table: None,
            upstream_model: "text-embedding-3-small".to_string(),
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            queue: DEFAULT_EMBEDDING_QUEUE,
            threads: 1,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEmbedding {
    embedder: Option<String>,
    model_dir: Option<PathBuf>,
    table: Option<PathBuf>,
    upstream_model: Option<String>,
    query_timeout: Option<String>,
    queue: Option<u64>,
    threads: Option<u64>,
}

/// Checks `[embedding]`.
pub(super) fn check_embedding(raw: RawEmbedding, problems: &mut Vec<String>) -> EmbeddingConfig {
    let defaults = EmbeddingConfig::default();
    let embedder = match raw.embedder.as_deref() {
        None | Some("static") => EmbedderKind::Static,
        Some("contextual") => EmbedderKind::Contextual,
        Some("upstream") => EmbedderKind::Upstream,
        Some("off") => EmbedderKind::Off,
        Some(other) => {
            problems.push(format!(
                "embedding.embedder: `{other}` is not one of static, contextual, upstream, off"
            ));
            defaults.embedder
        }
    };
    let upstream_model = raw.upstream_model.unwrap_or(defaults.upstream_model);
    if upstream_model.trim().is_empty() {
        problems.push("embedding.upstream_model: a model name".to_string());
    }
    let threads = at_least_one("embedding.threads", raw.threads, 1, problems);
    EmbeddingConfig {
        embedder,
        model_dir: raw.model_dir,
        table: raw.table,
        upstream_model,
        query_timeout: nonzero_duration(
            "embedding.query_timeout",
            raw.query_timeout,
            defaults.query_timeout,
            problems,
        ),
        queue: at_least_one("embedding.queue", raw.queue, defaults.queue, problems),
        threads,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checked(toml: &str) -> (EmbeddingConfig, Vec<String>) {
        let raw: RawEmbedding = toml::from_str(toml).unwrap();
        let mut problems = Vec::new();
        (check_embedding(raw, &mut problems), problems)
    }

    #[test]
    fn the_static_embedder_is_the_default() {
        let (config, problems) = checked("");
        assert!(problems.is_empty());
        assert_eq!(config, EmbeddingConfig::default());
        let (config, problems) = checked(
            "embedder = \"upstream\"\nupstream_model = \"e5\"\nquery_timeout = \"PT1S\"\nthreads = 2",
        );
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(config.embedder, EmbedderKind::Upstream);
        assert_eq!(config.upstream_model, "e5");
        assert_eq!(config.query_timeout, Duration::from_secs(1));
        assert_eq!(config.threads, 2);
    }

    #[test]
    fn bad_values_are_named() {
        for (bad, key) in [
            ("embedder = \"bert\"", "embedding.embedder"),
            ("upstream_model = \" \"", "embedding.upstream_model"),
            ("query_timeout = \"PT0S\"", "embedding.query_timeout"),
        ] {
            let (_, problems) = checked(bad);
            assert_eq!(problems.len(), 1, "{bad}: {problems:?}");
            assert!(problems[0].starts_with(key), "{bad}: {problems:?}");
        }
    }
}
