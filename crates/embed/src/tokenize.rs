//! Text into all-MiniLM-L6-v2's word pieces, by the model's own `tokenizer.json` (BERT's
//! uncased WordPiece: clean, split CJK, lowercase, strip accents, split punctuation, greedy
//! longest match). Owns no model: the contextual and static embedders both read from here.

use tokenizers::Tokenizer;

use crate::{EmbedError, ModelFiles};

/// The model's tokenizer, with no truncation or padding of its own: callers say how long.
#[derive(Debug, Clone)]
pub struct WordPieces {
    tokenizer: Tokenizer,
    cls: u32,
    sep: u32,
}

impl WordPieces {
    /// Reads `tokenizer.json`.
    pub fn load(files: &ModelFiles) -> Result<Self, EmbedError> {
        let path = files.tokenizer();
        let mut tokenizer = Tokenizer::from_file(&path).map_err(|err| {
            EmbedError::Unavailable(format!("cannot read {}: {err}", path.display()))
        })?;
        tokenizer
            .with_truncation(None)
            .map_err(|err| EmbedError::Failed(err.to_string()))?;
        tokenizer.with_padding(None);
        let special = |token: &str| {
            tokenizer.token_to_id(token).ok_or_else(|| {
                EmbedError::Unavailable(format!("{} has no {token} token", path.display()))
            })
        };
        let (cls, sep) = (special("[CLS]")?, special("[SEP]")?);
        Ok(Self {
            tokenizer,
            cls,
            sep,
        })
    }

    /// How many word pieces the vocabulary has (the added special tokens included).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The text's word pieces, without `[CLS]` and `[SEP]`, however many.
    pub fn pieces(&self, text: &str) -> Result<Vec<u32>, EmbedError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|err| EmbedError::Failed(format!("cannot tokenize: {err}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The model's input: `[CLS]`, the text's first `max_len - 2` pieces, `[SEP]` (as
    /// sentence-transformers truncates at `max_seq_length`, the special tokens included).
    pub fn model_input(&self, text: &str, max_len: usize) -> Result<Vec<u32>, EmbedError> {
        let mut pieces = self.pieces(text)?;
        pieces.truncate(max_len.saturating_sub(2));
        let mut ids = Vec::with_capacity(pieces.len() + 2);
        ids.push(self.cls);
        ids.extend(pieces);
        ids.push(self.sep);
        Ok(ids)
    }

    /// The word piece with this id, as the vocabulary writes it (`##s` for a continuation).
    pub fn token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }

    /// `[CLS]`'s id.
    pub fn cls(&self) -> u32 {
        self.cls
    }

    /// `[SEP]`'s id.
    pub fn sep(&self) -> u32 {
        self.sep
    }
}
