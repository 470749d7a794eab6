//! One user's index: BM25 over every archived turn of their conversations (the same index
//! as a conversation's, `recall/index.rs`, with neighbour context), documents numbered in the
//! order they were added, each pointing back to its archive record.

use std::collections::HashMap;

use super::archive::{self, Added};
use crate::recall::index::Index;
use crate::recall::stemming;
use crate::recall::tokenize::{Lang, TextLanguage, terms};
use memproxy_base::message::search_text;
use memproxy_store::{OwnerHandle, Store, StoreError};

#[derive(Debug)]
struct Doc {
    /// The archive record's id.
    id: Vec<u8>,
    /// Its conversation, as an index into `names`.
    name: u32,
}

#[derive(Debug)]
pub struct UserIndex {
    setting: TextLanguage,
    latin: Option<Lang>,
    index: Index,
    docs: Vec<Doc>,
    names: Vec<(String, String)>,
    name_ids: HashMap<(String, String), u32>,
}

impl UserIndex {
    /// Builds the index of the user's whole archive.
    pub fn build(
        store: &Store,
        handle: &OwnerHandle,
        setting: TextLanguage,
    ) -> Result<UserIndex, StoreError> {
        let turns = archive::all(store, handle)?;
        let texts: Vec<String> = turns
            .iter()
            .map(|t| search_text(&t.turn.message.message))
            .collect();
        let latin = stemming(setting, texts.iter().map(String::as_str));
        let mut index = UserIndex {
            setting,
            latin,
            index: Index::new(),
            docs: Vec::with_capacity(turns.len()),
            names: Vec::new(),
            name_ids: HashMap::new(),
        };
        for (added, text) in turns.into_iter().zip(texts) {
            index.push_text(added.id, &added.turn.agent, &added.turn.conversation, &text);
        }
        index.index.shrink_to_fit();
        Ok(index)
    }

    pub fn setting(&self) -> TextLanguage {
        self.setting
    }

    /// Adds an archived turn as the newest document.
    pub fn push(&mut self, added: &Added) {
        let text = search_text(&added.turn.message.message);
        self.push_text(
            added.id.clone(),
            &added.turn.agent,
            &added.turn.conversation,
            &text,
        );
    }

    fn push_text(&mut self, id: Vec<u8>, agent: &str, conversation: &str, text: &str) {
        let name = (agent.to_string(), conversation.to_string());
        let next = self.names.len() as u32;
        let name = *self.name_ids.entry(name.clone()).or_insert_with(|| {
            self.names.push(name);
            next
        });
        let seq = self.docs.len() as u64;
        self.index.push(seq, terms(text, self.latin));
        self.docs.push(Doc { id, name });
    }

    /// The `k` best documents for `query` outside the conversation `skip` (agent,
    /// conversation): their scores and archive ids, best first. Scores are on hybrid recall's
    /// lexical scale (0..1, `recall/hybrid.rs`), so these compete with the conversation's own
    /// turns for the same slots.
    pub fn search(
        &mut self,
        query: &str,
        skip: Option<(&str, &str)>,
        k: usize,
    ) -> Vec<(f32, Vec<u8>)> {
        let query = terms(query, self.latin);
        let skipped = skip.and_then(|(agent, conversation)| {
            self.name_ids
                .get(&(agent.to_string(), conversation.to_string()))
                .copied()
        });
        let docs = &self.docs;
        let hits = self.index.search_where(&query, u64::MAX, k, |seq| {
            docs.get(seq as usize)
                .is_some_and(|d| Some(d.name) != skipped)
        });
        let weight = self.index.query_weight(&query);
        hits.into_iter()
            .filter_map(|hit| {
                let doc = self.docs.get(hit.turn as usize)?;
                let score = if weight > 0.0 {
                    (hit.score / weight).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                Some((score, doc.id.clone()))
            })
            .collect()
    }

    /// Approximate heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.index.heap_bytes()
            + self.docs.len() * 48
            + self
                .names
                .iter()
                .map(|(a, c)| 2 * (a.len() + c.len()) + 96)
                .sum::<usize>()
    }
}
