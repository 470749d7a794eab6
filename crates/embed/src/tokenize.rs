//! Text into all-MiniLM-L6-v2's word pieces, by the model's own `tokenizer.json` (BERT's
//! uncased WordPiece: clean, split CJK, lowercase, strip accents, split punctuation, greedy
//! longest match). Owns no model: the contextual and static embedders both read from here.

use tokenizers::{ModelWrapper, Tokenizer};

use crate::{EmbedError, ModelFiles};

/// The model's tokenizer, with no truncation or padding of its own: callers say how long.
#[derive(Debug, Clone)]
pub struct WordPieces {
    tokenizer: Tokenizer,
    /// ASCII text's pieces without the general pipeline (`None`: the tokenizer is not BERT's
    /// uncased WordPiece, as checked at load).
    ascii: Option<AsciiWordPieces>,
    cls: u32,
    sep: u32,
}

/// BERT's uncased WordPiece for ASCII text, which is all its normaliser and pre-tokeniser
/// reduce to there: control characters dropped, whitespace splits, each punctuation mark a word
/// of its own, lowercase; then the greedy longest match of each word against the vocabulary,
/// `##` before a continuation, `[UNK]` for a word that does not fit. The general pipeline
/// (Unicode normalisation, offsets, a `String` per token) takes most of a static embedding's
/// time and allocates on every piece, which a busy proxy's allocator feels; the request path
/// embeds every new message. Checked against the general pipeline at load and in the tests.
/// Words are looked up in the tokenizer's own vocabulary (no copy of it is kept).
#[derive(Debug, Clone, Copy)]
struct AsciiWordPieces {
    unk: u32,
    max_word_chars: usize,
}

/// Sentences the ASCII path must split exactly as the general pipeline does before it is used.
const ASCII_CHECK: &[&str] = &[
    "Hello, World! I drive a silver Volvo (2019) -- it's \"great\"; isn't it?",
    "e-mail: someone@example.com, price $42.50 & 100% [ok] {x} <y> ~z` ^_^ #tag | a\\b /c",
    "   tabs\tand\nnew\r\nlines \u{7}bell \u{7f}del a\u{b}b c\u{c}d antidisestablishmentarianism ZZZQQQXXX",
    "",
];

impl AsciiWordPieces {
    /// The ASCII path for `tokenizer`, if it is a WordPiece model with `##` continuations whose
    /// general pipeline splits [`ASCII_CHECK`] as this path does.
    fn of(tokenizer: &Tokenizer) -> Option<AsciiWordPieces> {
        let ModelWrapper::WordPiece(model) = tokenizer.get_model() else {
            return None;
        };
        if model.continuing_subword_prefix != "##" {
            return None;
        }
        let unk = tokenizer.token_to_id(&model.unk_token)?;
        let fast = AsciiWordPieces {
            unk,
            max_word_chars: model.max_input_chars_per_word,
        };
        let agrees = ASCII_CHECK.iter().all(|text| {
            let mut ids = Vec::new();
            fast.pieces(tokenizer, text, &mut ids);
            tokenizer
                .encode_fast(*text, false)
                .is_ok_and(|e| e.get_ids() == ids.as_slice())
        });
        agrees.then_some(fast)
    }

    /// Appends the pieces of `text` (ASCII) to `out`.
    fn pieces(&self, tokenizer: &Tokenizer, text: &str, out: &mut Vec<u32>) {
        let mut word = String::new();
        let mut candidate = String::new();
        for b in text.bytes() {
            if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                self.word(tokenizer, &word, &mut candidate, out);
                word.clear();
            } else if b.is_ascii_control() {
                // Dropped by BERT's text cleaning (vertical tab and form feed too: only
                // space, tab, CR and LF are its whitespace).
            } else if b.is_ascii_punctuation() {
                self.word(tokenizer, &word, &mut candidate, out);
                word.clear();
                word.push(char::from(b));
                self.word(tokenizer, &word, &mut candidate, out);
                word.clear();
            } else {
                word.push(char::from(b.to_ascii_lowercase()));
            }
        }
        self.word(tokenizer, &word, &mut candidate, out);
    }

    /// One word's pieces: the longest prefix in the vocabulary, then the longest `##`
    /// continuation, and so on; `[UNK]` alone when some part matches nothing.
    fn word(&self, tokenizer: &Tokenizer, word: &str, candidate: &mut String, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if word.len() > self.max_word_chars {
            out.push(self.unk);
            return;
        }
        let first = out.len();
        let mut start = 0;
        while start < word.len() {
            let mut end = word.len();
            let mut found = None;
            while start < end {
                candidate.clear();
                if start > 0 {
                    candidate.push_str("##");
                }
                candidate.push_str(&word[start..end]);
                if let Some(id) = tokenizer.token_to_id(candidate) {
                    found = Some(id);
                    break;
                }
                end -= 1;
            }
            match found {
                Some(id) => {
                    out.push(id);
                    start = end;
                }
                None => {
                    out.truncate(first);
                    out.push(self.unk);
                    return;
                }
            }
        }
    }
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
        let ascii = AsciiWordPieces::of(&tokenizer);
        Ok(Self {
            tokenizer,
            ascii,
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
        if let Some(ascii) = self.ascii.filter(|_| text.is_ascii()) {
            let mut ids = Vec::with_capacity(text.len() / 4 + 1);
            ascii.pieces(&self.tokenizer, text, &mut ids);
            return Ok(ids);
        }
        self.general_pieces(text)
    }

    /// [`WordPieces::pieces`] by the tokenizer's general pipeline, whatever the text.
    pub fn general_pieces(&self, text: &str) -> Result<Vec<u32>, EmbedError> {
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

    /// Whether ASCII text takes the short path (the tokenizer is BERT's uncased WordPiece).
    pub fn has_ascii_path(&self) -> bool {
        self.ascii.is_some()
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
