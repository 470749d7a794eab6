//! `memproxy model …`: the embedding model, offline. `distill` writes the static table the
//! image carries; `embed` prints vectors for scripts and tests. Needs no config, store or
//! network; reads the model's files where `ModelFiles::locate` finds them.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Subcommand};

use crate::embed::bert::Precision;
use crate::embed::table::{self, Distillation};
use crate::embed::{Contextual, Embed, EmbedError, ModelFiles, Static};

#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Distill the static table from the model and write it (default: static-256.bin in the
    /// model's directory), whether or not one is there already.
    Distill(DistillArgs),
    /// Print the vectors of the texts as one JSON array of arrays, in order.
    Embed(EmbedArgs),
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
    /// The static table's file. Default: static-256.bin in the model's directory, distilled
    /// and written there first when it is missing or stale.
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

// Allowed: the vectors are the command's answer.
#[allow(clippy::print_stdout)]
fn embed(args: &EmbedArgs) -> Result<(), EmbedError> {
    let files = ModelFiles::locate(args.model_dir.as_deref())?;
    let embedder: Box<dyn Embed> = if args.contextual {
        Box::new(Contextual::load(&files, args.threads)?)
    } else {
        let distillation = Distillation::default();
        let path = args
            .table
            .clone()
            .unwrap_or_else(|| Static::default_cache_path(&files, &distillation));
        Box::new(Static::load_or_distill(&files, &path)?)
    };
    let texts: Vec<&str> = args.texts.iter().map(String::as_str).collect();
    let vectors = embedder.embed(&texts)?;
    let json =
        serde_json::to_string(&vectors).map_err(|err| EmbedError::Failed(err.to_string()))?;
    println!("{json}");
    Ok(())
}
