//! The embedder `[embedding]` names, made at start: the in-process ones of `memproxy-embed`
//! (the model's files found, the learned static table read, or the distilled one made once and
//! kept), or the upstream's
//! OpenAI-compatible `/v1/embeddings` ([`UpstreamEmbedder`]). One that cannot be made leaves
//! recall by words alone, with the reason in the log and `/readyz`: never a failed start.
//!
//! `memproxy vectors rebuild` (`cli/vectors.rs`) gives every stored message a vector with it.

use std::num::NonZeroUsize;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::HeaderMap;
use serde_json::{Value, json};
use tokio::runtime::Handle;

use crate::config::{Config, EmbedderKind};
use crate::embedding::Embedder;
use crate::upstream::Upstream;
use memproxy_base::model::Credentials;
use memproxy_embed::learn;
use memproxy_embed::table::Distillation;
use memproxy_embed::vector::normalize;
use memproxy_embed::{Contextual, Embed, EmbedError, ModelFiles, Static};

/// Texts one `/v1/embeddings` call carries at most.
const UPSTREAM_BATCH: usize = 64;

/// The embedder `config` names; `upstream` is the client of `[upstream]`, for `upstream`.
pub fn load(config: &Config, upstream: &Upstream) -> Embedder {
    let settings = &config.embedding;
    match settings.embedder {
        EmbedderKind::Off => Embedder::Off,
        EmbedderKind::Upstream => match Handle::try_current() {
            Ok(runtime) => Embedder::Ready(Arc::new(UpstreamEmbedder {
                upstream: upstream.clone(),
                model: settings.upstream_model.clone(),
                id: format!("upstream/{}", settings.upstream_model),
                dims: OnceLock::new(),
                timeout: config.upstream.timeout,
                runtime,
            })),
            Err(_) => Embedder::Unavailable("no async runtime for the upstream embedder".into()),
        },
        EmbedderKind::Static | EmbedderKind::Contextual => in_process(config),
    }
}

/// The in-process embedders: the model's files found (`embedding.model_dir`, then the usual
/// places, `memproxy_embed::ModelFiles::locate`); the static table read from its file
/// (`embedding.table`, else the learned one beside the model), or the distilled one distilled
/// once and written there (or, when that directory is read-only, into the data directory).
fn in_process(config: &Config) -> Embedder {
    let settings = &config.embedding;
    let files = match ModelFiles::locate(settings.model_dir.as_deref()) {
        Ok(files) => files,
        Err(err) => return Embedder::Unavailable(err.to_string()),
    };
    let threads = NonZeroUsize::new(settings.threads);
    let made: Result<Arc<dyn Embed>, EmbedError> = match settings.embedder {
        EmbedderKind::Contextual => {
            Contextual::load(&files, threads).map(|e| Arc::new(e) as Arc<dyn Embed>)
        }
        _ => static_table(config, &files).map(|e| Arc::new(e) as Arc<dyn Embed>),
    };
    match made {
        Ok(embedder) => {
            tracing::info!(
                embedder = embedder.id(),
                dims = embedder.dims(),
                model_dir = %files.dir().display(),
                "recall by meaning is on"
            );
            Embedder::Ready(embedder)
        }
        Err(err) => Embedder::Unavailable(err.to_string()),
    }
}

/// The static table: the learned one (`memproxy model learn`, beside the model or at
/// `embedding.table`), else the distilled one from its file or distilled once. Without the
/// learned table recall by meaning still works, a little less well, and the log says how to
/// make it.
fn static_table(config: &Config, files: &ModelFiles) -> Result<Static, EmbedError> {
    let distillation = Distillation::default();
    if let Some(path) = &config.embedding.table {
        return learn::load_static(files, path);
    }
    let learned = learn::learned_path(files);
    match learn::load_learned(files, &learned) {
        Ok(table) => return Ok(table),
        Err(err) => tracing::warn!(
            reason = %err,
            "the learned static table is missing: recall by meaning uses the distilled table, \
             which recalls less; `memproxy model learn` makes it (needs Debian's wordnet-base)"
        ),
    }
    let beside = Static::default_cache_path(files, &distillation);
    if let Ok(table) = Static::load(files, &beside, &distillation) {
        return Ok(table);
    }
    let in_data = config
        .data_dir
        .join("embedding")
        .join(distillation.file_name());
    if let Ok(table) = Static::load(files, &in_data, &distillation) {
        return Ok(table);
    }
    tracing::info!("distilling the static embedding table from the model (once; kept on disk)");
    match Static::load_or_distill(files, &beside) {
        Err(EmbedError::Failed(why)) if why.starts_with("cannot write") => {
            Static::load_or_distill(files, &in_data)
        }
        other => other,
    }
}

/// The upstream's `/v1/embeddings`: the provider's model, called with `[upstream]`'s key
/// (`upstream.api_key`; the calls are memproxy's own, made without a client's credentials).
/// Blocks the calling thread (a blocking-pool thread: the plan and the background jobs run
/// there) while the call runs on the runtime, for at most `upstream.timeout`.
pub struct UpstreamEmbedder {
    upstream: Upstream,
    model: String,
    id: String,
    /// Learned from the first answer.
    dims: OnceLock<usize>,
    timeout: Duration,
    runtime: Handle,
}

impl std::fmt::Debug for UpstreamEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamEmbedder")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

/// One `/v1/embeddings` call: a unit-length vector per text, in order.
async fn embeddings(
    upstream: Upstream,
    model: String,
    texts: Vec<String>,
) -> Result<Vec<Vec<f32>>, EmbedError> {
    let count = texts.len();
    let body = json!({"model": model, "input": texts, "encoding_format": "float"});
    let answer = upstream
        .model_post(
            "/v1/embeddings",
            &Credentials::default(),
            HeaderMap::new(),
            body.to_string(),
            "embedding",
        )
        .await
        .map_err(|err| EmbedError::Failed(err.to_string()))?;
    let value: Value = serde_json::from_slice(&answer)
        .map_err(|_| EmbedError::Failed("the embeddings answer is not JSON".into()))?;
    let data = value
        .get("data")
        .and_then(Value::as_array)
        .ok_or_else(|| EmbedError::Failed("the embeddings answer has no `data`".into()))?;
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; count];
    for (position, item) in data.iter().enumerate() {
        let index = item
            .get("index")
            .and_then(Value::as_u64)
            .map_or(position, |i| i as usize);
        let mut vector: Vec<f32> = item
            .get("embedding")
            .and_then(Value::as_array)
            .ok_or_else(|| EmbedError::Failed("an embedding is not a list".into()))?
            .iter()
            .map(|v| v.as_f64().unwrap_or(0.0) as f32)
            .collect();
        if let Some(slot) = vectors.get_mut(index) {
            normalize(&mut vector);
            *slot = Some(vector);
        }
    }
    vectors
        .into_iter()
        .map(|v| v.ok_or_else(|| EmbedError::Failed("an input has no embedding".into())))
        .collect()
}

impl Embed for UpstreamEmbedder {
    fn id(&self) -> &str {
        &self.id
    }

    fn dims(&self) -> usize {
        self.dims.get().copied().unwrap_or(0)
    }

    /// A call to the upstream.
    fn worth_a_thread(&self) -> bool {
        true
    }

    /// Texts with nothing to embed (the API refuses an empty string) get a zero vector without
    /// a call.
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let sent: Vec<&str> = texts
            .iter()
            .copied()
            .filter(|t| !t.trim().is_empty())
            .collect();
        let mut made = self.embed_all(&sent)?.into_iter();
        let dims = self.dims();
        Ok(texts
            .iter()
            .map(|t| match t.trim().is_empty() {
                true => vec![0.0; dims],
                false => made.next().unwrap_or_else(|| vec![0.0; dims]),
            })
            .collect())
    }
}

impl UpstreamEmbedder {
    /// One vector per text, in calls of at most [`UPSTREAM_BATCH`] texts.
    fn embed_all(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let mut out = Vec::with_capacity(texts.len());
        for batch in texts.chunks(UPSTREAM_BATCH) {
            let owned: Vec<String> = batch.iter().map(|t| t.to_string()).collect();
            let (tx, rx) = std::sync::mpsc::channel();
            let call = embeddings(self.upstream.clone(), self.model.clone(), owned);
            self.runtime.spawn(async move {
                let _ = tx.send(call.await);
            });
            let vectors = rx
                .recv_timeout(self.timeout)
                .map_err(|_| EmbedError::Failed("the embeddings call timed out".into()))??;
            if let Some(first) = vectors.first() {
                let _ = self.dims.set(first.len());
            }
            out.extend(vectors);
        }
        Ok(out)
    }
}
