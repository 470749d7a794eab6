//! The embedders against the real model: the reference vectors (`reference.rs`), the
//! paraphrase set (`paraphrase.rs`), the static table's cache file (`table.rs`). These tests
//! need the model's files and fail, saying how to get them, when they are missing
//! (`scripts/fetch-model.sh`; `scripts/test.sh` runs it first).

// Allowed: the helpers of a test binary, outside `#[test]` functions, fail as tests do.
#![allow(clippy::unwrap_used, clippy::panic)]

mod paraphrase;
mod paraphrase_set;
mod reference;
mod table;

use std::path::{Path, PathBuf};

use memproxy_embed::ModelFiles;

/// The repository's `models/all-MiniLM-L6-v2`, where `scripts/fetch-model.sh` puts the files.
fn workspace_model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/all-MiniLM-L6-v2")
}

/// The model's files, or a failure that says where they were looked for and how to get them.
fn model_files() -> ModelFiles {
    match ModelFiles::locate(Some(&workspace_model_dir())) {
        Ok(files) => files,
        Err(err) => panic!("{err}"),
    }
}
