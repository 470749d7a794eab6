//! `memproxy vectors rebuild`: every stored message, archived turn and memory given a vector
//! of the configured embedder's space (`crate::embedding::rebuild`), for what was stored before
//! the embedder was configured, jobs dropped under load, or another embedder.

use std::sync::Arc;

use serde_json::json;

use crate::config::Config;

/// `memproxy vectors ...`.
#[derive(Debug, clap::Subcommand)]
pub enum VectorsCommand {
    /// Give every stored message, and every archived turn and memory of long-term memory, a
    /// vector of the configured embedder (`[embedding]`): for data stored before it was
    /// configured, jobs dropped under load, memories edited offline, or another embedder.
    /// What has one is left alone. On sled, with memproxy stopped; on
    /// Redis, while replicas run. Prints one JSON line of totals.
    Rebuild,
}

/// Runs `memproxy vectors rebuild` on the store of `config`.
pub async fn run(config: Config, command: VectorsCommand) -> std::process::ExitCode {
    use std::io::Write;
    use std::process::ExitCode;
    let VectorsCommand::Rebuild = command;
    let fail = |message: String| {
        let _ = writeln!(std::io::stderr(), "memproxy: {message}");
        ExitCode::FAILURE
    };
    let grace = config.shutdown_grace;
    let state = match crate::state::AppState::build(config) {
        Ok(state) => state,
        Err(err) => return fail(format!("cannot start: {err}")),
    };
    let memory = match &state.memory {
        Ok(memory) => Arc::clone(memory),
        Err(unavailable) => return fail(format!("cannot open the store: {unavailable}")),
    };
    let Some(embedder) = memory.embedding.embedder().cloned() else {
        let why = memory
            .embedding
            .unavailable()
            .unwrap_or("no embedder is configured ([embedding] embedder = \"off\")")
            .to_string();
        return fail(why);
    };
    let working = Arc::clone(&memory);
    let done = tokio::task::spawn_blocking(move || {
        let records = &crate::longterm::VECTOR_RECORDS;
        crate::embedding::rebuild(
            &working.store,
            &working.recall,
            &*embedder,
            records,
            |_, done| {
                if done.conversations % 100 == 0 {
                    tracing::info!(
                        conversations = done.conversations,
                        vectors = done.vectors,
                        "rebuilding vectors"
                    );
                }
            },
        )
    })
    .await;
    let closed = memory.shutdown(grace).await;
    match (done, closed) {
        (Ok(Ok(done)), Ok(())) => {
            let line = json!({
                "space": memory.embedding.space().map(|(id, _)| id),
                // The static table's message vectors are made from the texts when an index
                // is built, not stored: no conversation is looked at.
                "messages_derived": memory.embedding.derived().is_some(),
                "conversations": done.conversations,
                "vectors_made": done.vectors,
                "already_present": done.present,
                "owners": done.owners,
                "records_vectors_made": done.records,
                "records_already_present": done.records_present,
            });
            let _ = writeln!(std::io::stdout(), "{line}");
            ExitCode::SUCCESS
        }
        (Ok(Err(err)), _) => fail(format!("rebuilding vectors failed: {err}")),
        (Err(err), _) => fail(format!("rebuilding vectors failed: {err}")),
        (_, Err(err)) => fail(format!("closing the store failed: {err}")),
    }
}
