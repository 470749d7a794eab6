//! `memproxy model …`: the embedding model, offline. `learn` writes the learned static table
//! the image carries (the default embedder's), `distill` the distilled one (used when the
//! learned one is missing); `embed` prints vectors for scripts and tests. Needs no config, store or
//! network; reads the model's files where `ModelFiles::locate` finds them.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Subcommand};

use crate::embed::bert::Precision;
use crate::embed::learn::{self, WORDNET_DIR};
use crate::embed::table::{self, Distillation};
use crate::embed::{Contextual, Embed, EmbedError, ModelFiles, Static};

#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Distill the static table from the model and write it (default: static-256.bin in the
    /// model's directory), whether or not one is there already.
    Distill(DistillArgs),
    /// Learn the static table from the model and WordNet's definitions (Debian's
    /// `wordnet-base`) and write it (default: static-learned-256.bin in the model's directory).
    /// A few minutes on two cores; does nothing when a valid one is there, unless --force.
    Learn(LearnArgs),
    /// Print the vectors of the texts as one JSON array of arrays, in order.
    Embed(EmbedArgs),
}

#[derive(Debug, Args)]
pub struct LearnArgs {
    /// The model's directory (as for `distill`).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// WordNet's database (data.noun, data.verb, data.adj, data.adv).
    #[arg(long, default_value = WORDNET_DIR)]
    pub wordnet: PathBuf,
    /// Where to write the table. Default: static-learned-256.bin in the model's directory.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Threads for the forward passes and the fit. Default: one per core.
    #[arg(long)]
    pub threads: Option<NonZeroUsize>,
    /// Learn and write it even when a valid table is there.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args)]
pub struct DistillArgs {
    /// The model's directory. Default: $MEMPROXY_MODEL_DIR, ./models/all-MiniLM-L6-v2, the
    /// workspace's models/, /usr/share/memproxy/models/all-MiniLM-L6-v2, the first that holds it.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Where to write the table. Default: static-256.bin in the model's directory.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Threads for the forward passes. Default: one per core.
    #[arg(long)]
    pub threads: Option<NonZeroUsize>,
}

#[derive(Debug, Args)]
pub struct EmbedArgs {
    /// The static table (the default): a lookup per word piece.
    #[arg(long = "static", conflicts_with = "contextual")]
    pub use_static: bool,
    /// The model's full forward pass.
    #[arg(long)]
    pub contextual: bool,
    /// The model's directory (as for `distill`).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// The static table's file (learned or distilled). Default: the learned table beside the
    /// model, else static-256.bin there, distilled and written first when it is missing or
    /// stale.
    #[arg(long, conflicts_with = "contextual")]
    pub table: Option<PathBuf>,
    /// Threads for the contextual forward pass. Default: one per core.
    #[arg(long)]
    pub threads: Option<NonZeroUsize>,
    /// The texts.
    #[arg(required = true)]
    pub texts: Vec<String>,
}

/// Runs a `memproxy model` command: 0 on success, 1 with the reason on standard error.
pub fn run(command: &ModelCommand) -> ExitCode {
    let outcome = match command {
        ModelCommand::Distill(args) => distill(args),
        ModelCommand::Learn(args) => learn_table(args),
        ModelCommand::Embed(args) => embed(args),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("memproxy: {err}");
            ExitCode::FAILURE
        }
    }
}

// Allowed: the command's answer (what was written) goes to standard output.
#[allow(clippy::print_stdout)]
fn distill(args: &DistillArgs) -> Result<(), EmbedError> {
    let files = ModelFiles::locate(args.model_dir.as_deref())?;
    let distillation = Distillation::default();
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| Static::default_cache_path(&files, &distillation));
    let start = Instant::now();
    let model = Contextual::load_at(&files, args.threads, Precision::Bf16)?;
    let table = table::distill(&model, &distillation)?;
    table.save(&files, &out)?;
    println!(
        "{} ({} MiB) written to {} in {:.1} s",
        table.id(),
        table.table_bytes() >> 20,
        out.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

// Allowed: the command's answer (what was written) goes to standard output.
#[allow(clippy::print_stdout)]
fn learn_table(args: &LearnArgs) -> Result<(), EmbedError> {
    let files = ModelFiles::locate(args.model_dir.as_deref())?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| learn::learned_path(&files));
    if !args.force && learn::load_learned(&files, &out).is_ok() {
        println!("{}: up to date in {}", learn::learned_id(), out.display());
        return Ok(());
    }
    let start = Instant::now();
    let texts = learn::wordnet_texts(&args.wordnet)?;
    let table = learn::learn_from_model(&files, &texts, args.threads)?;
    table.save(&files, &out)?;
    println!(
        "{} ({} MiB, from {} texts) written to {} in {:.1} s",
        table.id(),
        table.table_bytes() >> 20,
        texts.len(),
        out.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

// Allowed: the vectors are the command's answer.
#[allow(clippy::print_stdout)]
fn embed(args: &EmbedArgs) -> Result<(), EmbedError> {
    let files = ModelFiles::locate(args.model_dir.as_deref())?;
    let embedder: Box<dyn Embed> = if args.contextual {
        Box::new(Contextual::load(&files, args.threads)?)
    } else {
        Box::new(match &args.table {
            Some(path) => learn::load_static(&files, path)?,
            None => learn::load_learned(&files, &learn::learned_path(&files)).or_else(|_| {
                let path = Static::default_cache_path(&files, &Distillation::default());
                Static::load_or_distill(&files, &path)
            })?,
        })
    };
    let texts: Vec<&str> = args.texts.iter().map(String::as_str).collect();
    let vectors = embedder.embed(&texts)?;
    let json =
        serde_json::to_string(&vectors).map_err(|err| EmbedError::Failed(err.to_string()))?;
    println!("{json}");
    Ok(())
}
