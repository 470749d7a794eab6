//! Summary records: stored by the engine under the conversation's id, sealed with the
//! conversation's key (`seal.rs`), each with a Markdown copy in the conversation's workspace
//! folder for people to read (`memory/summary-{from}-{to}.md`). The copy is plaintext, as
//! meant: it is a file of the conversation's own folder, removed with it on delete.

use serde_json::value::RawValue;

use super::records::SummaryRecord;
use super::seal::{SealedId, seal_summary};
use super::{Conversation, Store, StoreError, workspace_dir};
use memproxy_base::heap;
use memproxy_base::identity::ConversationKey;

/// The newest summary record a cached conversation last opened, and the stored value it was
/// opened from. Each request puts the newest summary in its prompt; opening it again (the
/// key's lookup, a base64 decode, the decryption, the JSON) was 1.2% of a stored exchange's
/// CPU. The engine's value is still read every time, since the summary worker, a branch's
/// close or another replica may have stored a newer one: only when it is the value held is
/// the opening skipped.
#[derive(Debug)]
pub(super) struct HeldSummary {
    id: u64,
    from: SealedId,
    record: SummaryRecord,
}

impl HeldSummary {
    /// What it holds on the heap, itself included (it is boxed).
    pub(super) fn heap_bytes(&self) -> usize {
        std::mem::size_of::<HeldSummary>()
            + heap::string(self.record.text.capacity())
            + heap::string(self.record.model.capacity())
    }

    #[cfg(test)]
    pub(super) fn record_mut(&mut self) -> &mut SummaryRecord {
        &mut self.record
    }
}

fn decode(bytes: &[u8]) -> Result<SummaryRecord, StoreError> {
    serde_json::from_slice(bytes).map_err(|err| StoreError::Corrupt(err.to_string()))
}

impl Store {
    /// The newest summary record of conversation `id`.
    pub fn latest_summary(
        &self,
        key: &ConversationKey,
        id: u64,
    ) -> Result<Option<SummaryRecord>, StoreError> {
        self.engine
            .latest_summary(key, id)?
            .map(|bytes| decode(&self.open_summary(key, id, bytes)?))
            .transpose()
    }

    /// The newest summary record of `conversation` (`None` before its first write), as
    /// [`Store::latest_summary`] reads it, opened only when the stored value is not the one
    /// the conversation last opened ([`HeldSummary`]).
    pub fn newest_summary(
        &self,
        conversation: &Conversation,
    ) -> Result<Option<SummaryRecord>, StoreError> {
        let Some(meta) = &conversation.meta else {
            return Ok(None);
        };
        let (key, id) = (&conversation.key, meta.id);
        let Some(bytes) = self.engine.latest_summary(key, id)? else {
            return Ok(None);
        };
        let from = SealedId::of(&bytes);
        let mut held = conversation
            .summary
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let (Some(held), Some(from)) = (held.as_deref(), &from)
            && held.id == id
            && held.from == *from
        {
            return Ok(Some(held.record.clone()));
        }
        let record = decode(&self.open_summary(key, id, bytes)?)?;
        *held = from.map(|from| {
            Box::new(HeldSummary {
                id,
                from,
                record: record.clone(),
            })
        });
        Ok(Some(record))
    }

    /// Every summary record of conversation `id`, oldest first.
    pub fn summaries(
        &self,
        key: &ConversationKey,
        id: u64,
    ) -> Result<Vec<SummaryRecord>, StoreError> {
        self.engine
            .summaries(key, id)?
            .into_iter()
            .map(|(_, bytes)| decode(&self.open_summary(key, id, bytes)?))
            .collect()
    }

    /// The newest summary record of conversation `id` that `wanted` accepts, opening records
    /// from the newest back only until one does.
    pub fn newest_summary_where(
        &self,
        key: &ConversationKey,
        id: u64,
        wanted: impl Fn(&SummaryRecord) -> bool,
    ) -> Result<Option<SummaryRecord>, StoreError> {
        for (_, bytes) in self.engine.summaries(key, id)?.into_iter().rev() {
            let record = decode(&self.open_summary(key, id, bytes)?)?;
            if wanted(&record) {
                return Ok(Some(record));
            }
        }
        Ok(None)
    }

    /// The summary records of conversation `id` as stored (opaque JSON, opened), by number:
    /// what an export carries.
    pub fn raw_summaries(
        &self,
        key: &ConversationKey,
        id: u64,
    ) -> Result<Vec<(u64, Box<RawValue>)>, StoreError> {
        self.engine
            .summaries(key, id)?
            .into_iter()
            .map(|(number, bytes)| {
                let text = String::from_utf8(self.open_summary(key, id, bytes)?)
                    .map_err(|_| StoreError::Corrupt("a summary record is not UTF-8".into()))?;
                let raw = RawValue::from_string(text)
                    .map_err(|err| StoreError::Corrupt(format!("a summary record: {err}")))?;
                Ok((number, raw))
            })
            .collect()
    }

    /// Stores `record` for the conversation whose id was `id`, and writes its Markdown copy,
    /// unless the conversation was deleted (or started afresh) meanwhile: then nothing is
    /// written and the result is `false`. `conversation` is the locked conversation: a delete
    /// takes the same lock, so no file outlives its conversation.
    pub fn save_summary(
        &self,
        conversation: &Conversation,
        id: u64,
        record: &SummaryRecord,
    ) -> Result<bool, StoreError> {
        let saved = self.write_summary(conversation, id, record);
        self.watch(saved)
    }

    fn write_summary(
        &self,
        conversation: &Conversation,
        id: u64,
        record: &SummaryRecord,
    ) -> Result<bool, StoreError> {
        let key = &conversation.key;
        let value =
            serde_json::to_vec(record).map_err(|err| StoreError::Corrupt(err.to_string()))?;
        let (secret, created) = self.sealing_key(key, id)?;
        let sealed = seal_summary(&secret, &value)?;
        if !self.engine.put_summary(key, id, record.number, &sealed)? {
            // The conversation is gone (ids are never reused): a key made for it now goes too.
            if created {
                self.drop_unused_key(key, id);
            }
            return Ok(false);
        }
        if self.shared() {
            // Records live in the shared engine and the admin API serves them: a replica's
            // local files would be one replica's view only.
            return Ok(true);
        }
        let folder = workspace_dir(&self.data_dir, key).join("memory");
        std::fs::create_dir_all(&folder)?;
        let file = folder.join(format!(
            "summary-{}-{}.md",
            record.from_turn, record.to_turn
        ));
        let markdown = format!(
            "# Summary of turns {}–{}{}\n\n- made: {} ms since epoch by {}\n- tokens: {} (from {}, ratio {:.2})\n\n{}\n",
            record.from_turn,
            record.to_turn,
            if record.heuristic { " (heuristic)" } else { "" },
            record.created_ms,
            record.model,
            record.tokens,
            record.original_tokens,
            record.ratio,
            record.text
        );
        // Written aside and renamed, so a reader never sees half a file.
        let partial = folder.join(format!(".summary-{}.partial", record.number));
        std::fs::write(&partial, markdown)?;
        std::fs::rename(&partial, &file)?;
        Ok(true)
    }
}
