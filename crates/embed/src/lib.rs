//! Embedders: text in, unit-length vectors out, for recall by meaning.
//!
//! [`Embed`] is what the memory core calls. Implementations are synchronous CPU work (the core
//! runs them off the async runtime's threads) or, for an embedder behind HTTP (the upstream's
//! `/v1/embeddings`), implemented at the edge.
//!
//! # Layout
//!
//! - [`files`] finds the model's files on disk ([`ModelFiles::locate`]); nothing here downloads
//!   anything (`scripts/fetch-model.sh` does, before a build or in the image);
//! - [`tokenize`] turns text into all-MiniLM-L6-v2's word pieces (the `tokenizers` crate, the
//!   model's own `tokenizer.json`);
//! - [`bert`] is the model's forward pass written out, one text at a time (f32 activations,
//!   compiled for AVX-512 or AVX2 where the CPU has them);
//! - `products` holds its matrix products and the kernels that run them (`Kernel`: AMX tiles
//!   with bf16 weights, AVX-512 VNNI with int8 weights and activations, AVX-512 BF16, AVX2 and
//!   FMA, plain);
//! - [`contextual`] is the full-model embedder ([`Contextual`]): BERT, mean pooled;
//! - [`table`] is the static embedder ([`Static`]): a table of one vector per word piece,
//!   distilled from [`Contextual`] ([`table::distill`]) and kept in a cache file;
//! - `team` shares one pass between the thread that runs it and one that waits for it
//!   ([`Assist`]);
//! - [`pca`] is the principal component analysis the distillation projects the table with;
//! - [`vector`] holds the arithmetic both share (L2 normalisation).

pub mod bert;
pub mod contextual;
pub mod files;
pub mod learn;
pub mod pca;
mod products;
pub mod table;
mod team;
pub mod tokenize;
pub mod vector;

pub use contextual::Contextual;
pub use files::ModelFiles;
pub use table::Static;
pub use team::Assist;

/// Why texts could not be embedded. Never fails a chat request: recall falls back to lexical.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// The model's files are missing or unreadable; the message says how to get them.
    #[error("embedding model unavailable: {0}")]
    Unavailable(String),
    /// The model ran and failed.
    #[error("embedding failed: {0}")]
    Failed(String),
}

/// Turns texts into vectors of one space.
pub trait Embed: Send + Sync + std::fmt::Debug {
    /// Names the vector space: model, variant and dimension, e.g.
    /// `all-MiniLM-L6-v2/static/384`. Stored with every vector, so vectors of another space
    /// are never compared with this one's.
    fn id(&self) -> &str;

    /// The length of every vector.
    fn dims(&self) -> usize;

    /// One unit-length vector (L2 norm 1, or all zeros for a text with nothing to embed) per
    /// text, in order.
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError>;

    /// Whether one text costs enough to embed on another thread while the caller does other
    /// work (a forward pass, a call to a service: yes; a table's few additions: no, the
    /// hand-over would cost more). The new message of a chat request is embedded ahead when
    /// it is.
    fn worth_a_thread(&self) -> bool {
        false
    }

    /// Whether a text's vector is cheap to make again whenever it is needed (a table's
    /// additions: no model runs, no service is called), so that it is not stored: a recall
    /// index built from the store embeds the stored texts again instead of reading their
    /// vectors. A stored exchange then writes its two messages alone, not two vectors beside
    /// them, and the store holds (in memory and on disk) what it holds per message without
    /// them. By default, no: vectors are stored.
    fn derived(&self) -> bool {
        false
    }

    /// [`Embed::embed`] of one text, offering the work to a thread that waits for the result
    /// and calls [`Assist::help`] (the full model's pass: that thread runs half of the rows
    /// of every step it joins). By default, `embed` alone. The caller closes `assist` after.
    fn embed_assisted(&self, text: &str, assist: &Assist) -> Result<Vec<Vec<f32>>, EmbedError> {
        let _ = assist;
        self.embed(&[text])
    }
}
