//! Catching up with a shared store: before a request plans, and when its commit found the
//! conversation stale, the cached conversation and its recall index are brought to the stored
//! version (with Redis another replica may have written since); only what was appended is
//! read, anything else reloads.

use crate::memory::Memory;
use memproxy_base::identity::ConversationKey;
use memproxy_store::{Conversation, Refreshed, StoreError};

/// Reads a conversation again after its commit found it stale: with a shared store only what
/// another replica changed (the recall index kept in step, [`catch_up`]); otherwise whole.
pub fn reread(
    memory: &Memory,
    key: &ConversationKey,
    conversation: &mut Conversation,
) -> Result<(), StoreError> {
    if memory.store.shared() {
        catch_up(memory, key, conversation)
    } else {
        memory.store.reload(conversation)
    }
}

/// Brings the cached conversation and its recall index up to the stored version (a shared
/// store: another replica may have committed since): what was only appended is added to both;
/// anything else was reloaded, and the index is rebuilt at its next search.
pub fn catch_up(
    memory: &Memory,
    key: &ConversationKey,
    conversation: &mut Conversation,
) -> Result<(), StoreError> {
    match memory.store.refresh(conversation)? {
        Refreshed::Unchanged => {}
        Refreshed::Reloaded => memory.recall.forget(key),
        Refreshed::Appended { before, added } => {
            let texts: Vec<(u64, String)> = added
                .iter()
                .map(|m| (m.turn, memproxy_base::message::search_text(&m.message)))
                .collect();
            let after = conversation.meta.as_ref().map_or(1, |m| m.next_turn);
            // The static table's vectors are not stored: the replica that committed the
            // turns made its own, and `append` makes this one's.
            memory
                .recall
                .append(key, Some(before.unwrap_or(1)), &texts, after);
        }
    }
    Ok(())
}
