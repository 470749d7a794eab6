//! Turning text into search terms, in any language.
//!
//! Text is cut into runs of one script. Each alphabetic run goes through the `bm25` crate's
//! tokenizer for its language (lowercase, Unicode word boundaries, stopwords, Snowball
//! stemming), with transliteration off so Cyrillic or Greek stay themselves: Latin runs use the
//! conversation's language, Cyrillic runs Russian, Greek Greek, Arabic Arabic. Chinese and
//! Japanese have no spaces between words, so their runs become overlapping character bigrams
//! (and single characters for one-character runs), the usual way to search them with BM25.

use std::sync::{Mutex, OnceLock};

use bm25::{DefaultTokenizer, Language, Tokenizer};

/// Which language Latin-script text is stemmed as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TextLanguage {
    /// Detect once per conversation from its first text (see [`detect`]).
    Auto,
    /// No stemming or stopwords: lowercase words only.
    Plain,
    Fixed(Lang),
}

/// The languages with a stemmer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lang {
    Arabic,
    Danish,
    Dutch,
    English,
    French,
    German,
    Greek,
    Hungarian,
    Italian,
    Norwegian,
    Portuguese,
    Romanian,
    Russian,
    Spanish,
    Swedish,
    Turkish,
}

const LANGS: &[(&str, Lang)] = &[
    ("arabic", Lang::Arabic),
    ("danish", Lang::Danish),
    ("dutch", Lang::Dutch),
    ("english", Lang::English),
    ("french", Lang::French),
    ("german", Lang::German),
    ("greek", Lang::Greek),
    ("hungarian", Lang::Hungarian),
    ("italian", Lang::Italian),
    ("norwegian", Lang::Norwegian),
    ("portuguese", Lang::Portuguese),
    ("romanian", Lang::Romanian),
    ("russian", Lang::Russian),
    ("spanish", Lang::Spanish),
    ("swedish", Lang::Swedish),
    ("turkish", Lang::Turkish),
];

impl TextLanguage {
    /// Parses the `relevance_language` setting: `auto`, `none`, or a language name.
    pub fn parse(text: &str) -> Option<TextLanguage> {
        match text.to_ascii_lowercase().as_str() {
            "auto" => Some(TextLanguage::Auto),
            "none" => Some(TextLanguage::Plain),
            name => LANGS
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, l)| TextLanguage::Fixed(*l)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TextLanguage::Auto => "auto",
            TextLanguage::Plain => "none",
            TextLanguage::Fixed(lang) => LANGS
                .iter()
                .find(|(_, l)| *l == lang)
                .map_or("english", |(n, _)| n),
        }
    }

    /// The accepted values, for error messages.
    pub fn accepted() -> String {
        let mut names = vec!["auto", "none"];
        names.extend(LANGS.iter().map(|(n, _)| *n));
        names.join(", ")
    }
}

/// Picks the language of Latin-script text from a sample (the start of a conversation).
/// Languages written in another script fall back to English for their Latin words.
pub fn detect(sample: &str) -> Lang {
    use whichlang::Lang as W;
    let latin_letters = sample
        .chars()
        .filter(|c| script_of(*c) == Script::Latin)
        .count();
    if latin_letters < 20 {
        return Lang::English;
    }
    match whichlang::detect_language(sample) {
        W::Deu => Lang::German,
        W::Fra => Lang::French,
        W::Ita => Lang::Italian,
        W::Nld => Lang::Dutch,
        W::Por => Lang::Portuguese,
        W::Spa => Lang::Spanish,
        W::Swe => Lang::Swedish,
        W::Tur => Lang::Turkish,
        _ => Lang::English,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Script {
    Latin,
    Cyrillic,
    Greek,
    Arabic,
    /// Han, Hiragana, Katakana: no spaces between words.
    Cjk,
    /// Any other letters (Hangul, Devanagari…): words, no stemming.
    Other,
    /// Digits, spaces, punctuation: belong to the run around them.
    Neutral,
}

fn script_of(c: char) -> Script {
    let u = c as u32;
    if c.is_ascii_alphabetic() || (0x00C0..=0x024F).contains(&u) || (0x1E00..=0x1EFF).contains(&u) {
        return if c == '×' || c == '÷' {
            Script::Neutral
        } else {
            Script::Latin
        };
    }
    if !c.is_alphabetic() {
        return Script::Neutral;
    }
    match u {
        0x0400..=0x052F | 0x1C80..=0x1C8F | 0x2DE0..=0x2DFF | 0xA640..=0xA69F => Script::Cyrillic,
        0x0370..=0x03FF | 0x1F00..=0x1FFF => Script::Greek,
        0x0600..=0x06FF | 0x0750..=0x077F | 0xFB50..=0xFDFF | 0xFE70..=0xFEFF => Script::Arabic,
        0x3040..=0x30FF
        | 0x3400..=0x4DBF
        | 0x4E00..=0x9FFF
        | 0xF900..=0xFAFF
        | 0x20000..=0x2FA1F
        | 0x31F0..=0x31FF => Script::Cjk,
        _ => Script::Other,
    }
}

fn bm25_language(lang: Lang) -> Language {
    match lang {
        Lang::Arabic => Language::Arabic,
        Lang::Danish => Language::Danish,
        Lang::Dutch => Language::Dutch,
        Lang::English => Language::English,
        Lang::French => Language::French,
        Lang::German => Language::German,
        Lang::Greek => Language::Greek,
        Lang::Hungarian => Language::Hungarian,
        Lang::Italian => Language::Italian,
        Lang::Norwegian => Language::Norwegian,
        Lang::Portuguese => Language::Portuguese,
        Lang::Romanian => Language::Romanian,
        Lang::Russian => Language::Russian,
        Lang::Spanish => Language::Spanish,
        Lang::Swedish => Language::Swedish,
        Lang::Turkish => Language::Turkish,
    }
}

/// The `bm25` tokenizer for a language, built once per process (stopword sets and stemmers
/// are not cheap to make).
fn tokenizer_for(lang: Lang) -> &'static DefaultTokenizer {
    static TOKENIZERS: [OnceLock<DefaultTokenizer>; LANGS.len()] =
        [const { OnceLock::new() }; LANGS.len()];
    TOKENIZERS[lang_index(lang)].get_or_init(|| {
        DefaultTokenizer::builder()
            .language_mode(bm25_language(lang))
            .normalization(false)
            .stemming(true)
            .stopwords(true)
            .build()
    })
}

/// Where `lang` is in [`LANGS`] (each has its place).
fn lang_index(lang: Lang) -> usize {
    LANGS.iter().position(|(_, l)| *l == lang).unwrap_or(3)
}

/// A tokenizer with no stemming or stopwords.
fn plain_tokenizer() -> &'static DefaultTokenizer {
    static PLAIN: OnceLock<DefaultTokenizer> = OnceLock::new();
    PLAIN.get_or_init(|| {
        DefaultTokenizer::builder()
            .normalization(false)
            .stemming(false)
            .stopwords(false)
            .build()
    })
}

/// Terms of `text` for a conversation whose Latin text is in `latin` (`None`: no stemming).
pub fn terms(text: &str, latin: Option<Lang>) -> Vec<String> {
    let mut out = Vec::new();
    let mut run_start = 0;
    let mut run_script = Script::Neutral;
    for (i, c) in text.char_indices() {
        let script = script_of(c);
        if script == Script::Neutral || script == run_script {
            continue;
        }
        if run_script != Script::Neutral || i > run_start {
            emit(&text[run_start..i], run_script, latin, &mut out);
        }
        run_start = i;
        run_script = script;
    }
    emit(&text[run_start..], run_script, latin, &mut out);
    out
}

fn emit(run: &str, script: Script, latin: Option<Lang>, out: &mut Vec<String>) {
    if run.trim().is_empty() {
        return;
    }
    let tokenizer = match (script, latin) {
        (Script::Cjk, _) => return cjk_terms(run, out),
        (_, None) | (Script::Other | Script::Neutral, _) => plain_tokenizer(),
        (Script::Latin, Some(lang)) if run.is_ascii() => return ascii_terms(run, lang, out),
        (Script::Latin, Some(lang)) => tokenizer_for(lang),
        (Script::Cyrillic, Some(_)) => tokenizer_for(Lang::Russian),
        (Script::Greek, Some(_)) => tokenizer_for(Lang::Greek),
        (Script::Arabic, Some(_)) => tokenizer_for(Lang::Arabic),
    };
    out.extend(tokenizer.tokenize(run));
}

/// The terms of an ASCII run, as the `bm25` tokenizer for `lang` makes them (the same words,
/// checked against it by a property test below), without its cost per word: a word's term
/// (its stem, or none for a stopword) is looked up in [`TERMS`] and made by the tokenizer only
/// the first time. Stored messages and questions repeat their words, and the tokenizer's
/// Unicode segmentation, stopword set and stemmer were most of what indexing a message took.
fn ascii_terms(run: &str, lang: Lang, out: &mut Vec<String>) {
    let mut lower = String::new();
    for word in ascii_words(run) {
        // A number is its own term in every language (no stopword or stem is made of digits):
        // made here, not kept in `TERMS`, where the one-off numbers of questions and ids would
        // push out the words that repeat.
        if is_number(word) {
            out.push(word.to_string());
            continue;
        }
        lower.clear();
        lower.extend(word.bytes().map(|b| char::from(b.to_ascii_lowercase())));
        TERMS.push(lang, &lower, out);
    }
}

/// A word of [`ascii_words`] made of digits alone. (Not `1,000` or `3.14`: some languages'
/// stemmers drop the marks between the digits.)
fn is_number(word: &str) -> bool {
    !word.is_empty() && word.bytes().all(|b| b.is_ascii_digit())
}

/// What the word-boundary rules of Unicode's UAX #29 (as the `unicode-segmentation` crate
/// applies them for `bm25`) make of ASCII text: the words that hold a letter or a digit.
/// Letters, digits and `_` join; `.` `'` `:` join letters on both sides (`e.g`, `can't`);
/// `.` `'` `,` `;` join digits on both sides (`3.14`, `1,000`).
fn ascii_words(text: &str) -> impl Iterator<Item = &str> {
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Class {
        Letter,
        Digit,
        Underscore,
        /// `:` (MidLetter).
        MidLetter,
        /// `.` and `'` (MidNumLet, Single_Quote).
        MidNumLet,
        /// `,` and `;` (MidNum).
        MidNum,
        Other,
    }
    fn class(b: u8) -> Class {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
            b'0'..=b'9' => Class::Digit,
            b'_' => Class::Underscore,
            b':' => Class::MidLetter,
            b'.' | b'\'' => Class::MidNumLet,
            b',' | b';' => Class::MidNum,
            _ => Class::Other,
        }
    }
    let bytes = text.as_bytes();
    let at = |i: usize| bytes.get(i).map_or(Class::Other, |b| class(*b));
    // No boundary between bytes i - 1 and i.
    let joined = move |i: usize| {
        use Class::*;
        let (before, prev, cur, next) = (
            if i >= 2 { at(i - 2) } else { Other },
            at(i - 1),
            at(i),
            at(i + 1),
        );
        let mid_letter = |c| matches!(c, MidLetter | MidNumLet);
        let mid_num = |c| matches!(c, MidNum | MidNumLet);
        match (prev, cur) {
            (Letter | Digit, Letter | Digit) => true,
            (Letter | Digit | Underscore, Underscore) | (Underscore, Letter | Digit) => true,
            (Letter, c) if mid_letter(c) => next == Letter,
            (p, Letter) if mid_letter(p) => before == Letter,
            (Digit, c) if mid_num(c) => next == Digit,
            (p, Digit) if mid_num(p) => before == Digit,
            _ => false,
        }
    };
    let mut start = 0;
    let mut i = 1;
    std::iter::from_fn(move || {
        while start < bytes.len() {
            while i < bytes.len() && joined(i) {
                i += 1;
            }
            let word = &text[start..i];
            start = i;
            i += 1;
            if word.bytes().any(|b| b.is_ascii_alphanumeric()) {
                return Some(word);
            }
        }
        None
    })
}

/// Each word's term, by language: the `bm25` tokenizer's output for the word alone, kept once
/// made. Sixteen shards a language under their own locks, each emptied when it reaches its
/// size (under 1 MiB a language in use when full).
static TERMS: Terms = Terms {
    shards: [const { [const { Mutex::new(None) }; TERM_SHARDS] }; LANGS.len()],
};

const TERM_SHARDS: usize = 16;
const TERMS_PER_SHARD: usize = 1024;

/// Words to their term (`None`: a stopword).
type TermShard = std::collections::HashMap<Box<str>, Option<Box<str>>, foldhash::fast::RandomState>;

struct Terms {
    shards: [[Mutex<Option<TermShard>>; TERM_SHARDS]; LANGS.len()],
}

impl Terms {
    /// Adds the term of `word` (ASCII, lower case) in `lang` to `out`: none for a stopword.
    fn push(&self, lang: Lang, word: &str, out: &mut Vec<String>) {
        use std::hash::BuildHasher;
        static SEED: std::sync::LazyLock<foldhash::fast::RandomState> =
            std::sync::LazyLock::new(foldhash::fast::RandomState::default);
        let by_lang = &self.shards[lang_index(lang)];
        let shard = &by_lang[(SEED.hash_one(word) as usize) % TERM_SHARDS];
        if let Some(found) = lock(shard).as_ref().and_then(|map| map.get(word)) {
            out.extend(found.as_deref().map(str::to_string));
            return;
        }
        let mut made = tokenizer_for(lang).tokenize(word);
        if made.len() > 1 {
            // Not one word after all (never seen): the tokenizer's terms, not kept.
            out.append(&mut made);
            return;
        }
        let term = made.pop();
        let mut shard = lock(shard);
        let map = shard.get_or_insert_with(TermShard::default);
        if map.len() >= TERMS_PER_SHARD {
            map.clear();
        }
        map.insert(Box::from(word), term.as_deref().map(Box::from));
        out.extend(term);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Overlapping bigrams of each run of CJK characters; a lone character stands for itself.
/// Digits and Latin letters inside the run are left to their own runs.
fn cjk_terms(run: &str, out: &mut Vec<String>) {
    let mut chars: Vec<char> = Vec::new();
    let flush = |chars: &mut Vec<char>, out: &mut Vec<String>| {
        match chars.len() {
            0 => {}
            1 => out.push(chars[0].to_string()),
            _ => {
                for pair in chars.windows(2) {
                    out.push(pair.iter().collect());
                }
            }
        }
        chars.clear();
    };
    for c in run.chars() {
        if script_of(c) == Script::Cjk {
            chars.push(c);
        } else {
            flush(&mut chars, out);
            if c.is_alphanumeric() {
                out.push(c.to_lowercase().collect());
            }
        }
    }
    flush(&mut chars, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the `bm25` tokenizer alone makes of a run (the way before [`ascii_terms`]).
    fn by_bm25(run: &str, lang: Lang) -> Vec<String> {
        tokenizer_for(lang).tokenize(run)
    }

    #[test]
    fn ascii_words_split_as_unicode_does() {
        let cases = [
            "e.g. can't 3.14 1,000 a:b a..b x_y _ __ _a a_ v1.2 1;2 a;b a,b 'quoted' x.1 1.x",
            "Don't stop: the U.S.A. had 12,500.75 units; ids AC-99812 and foo__bar__ ok...",
            "  \t\n leading and trailing  ",
            "",
            "...,;:'_",
        ];
        for case in cases {
            for lang in [Lang::English, Lang::German, Lang::French] {
                let mut fast = Vec::new();
                ascii_terms(case, lang, &mut fast);
                assert_eq!(fast, by_bm25(case, lang), "{case:?} in {lang:?}");
            }
        }
    }

    #[test]
    fn numbers_are_their_own_terms_in_every_language() {
        let text = "7 42 0 007 3.14 1,000 2'500 10;20 12th 0.5. 99812 v2 x9 1_000 1234567890123";
        for (_, lang) in LANGS {
            let mut fast = Vec::new();
            ascii_terms(text, *lang, &mut fast);
            assert_eq!(fast, by_bm25(text, *lang), "{lang:?}");
            assert!(fast.contains(&"99812".to_string()), "{lang:?}: {fast:?}");
        }
        assert!(is_number("7") && is_number("007"));
        assert!(!is_number("1,000") && !is_number("12th") && !is_number(""));
    }

    proptest::proptest! {
        #[test]
        fn ascii_terms_are_the_bm25_tokenizers(
            text in r#"[a-zA-Z0-9_.:',; "!?()/\n-]{0,60}"#,
            words in proptest::collection::vec(
                proptest::sample::select(vec![
                    "the", "running", "runners", "I", "can't", "U.S.", "3.14", "1,000", "a:b",
                    "e.g.", "_x", "x_", "it's", "Volvo", "automobile", "don't", "12th", "ok",
                ]),
                0..12,
            ),
            joiners in proptest::collection::vec(
                proptest::sample::select(vec![" ", ".", "'", ",", ":", ";", "_", "-", "", "  "]),
                12,
            ),
        ) {
            let mut built = text.clone();
            for (word, joiner) in words.iter().zip(&joiners) {
                built.push_str(joiner);
                built.push_str(word);
            }
            for case in [&text, &built] {
                let mut fast = Vec::new();
                ascii_terms(case, Lang::English, &mut fast);
                proptest::prop_assert_eq!(&fast, &by_bm25(case, Lang::English), "{:?}", case);
                // A second time, from what was kept.
                let mut again = Vec::new();
                ascii_terms(case, Lang::English, &mut again);
                proptest::prop_assert_eq!(&again, &fast);
            }
        }
    }

    #[test]
    fn english_is_stemmed_and_stopwords_dropped() {
        let t = terms(
            "The runners were running to the stations",
            Some(Lang::English),
        );
        assert_eq!(t, ["runner", "run", "station"]);
    }

    #[test]
    fn numbers_and_ids_survive() {
        let t = terms("My account is AC-99812, PIN 4421.", Some(Lang::English));
        assert!(t.contains(&"99812".to_string()), "{t:?}");
        assert!(t.contains(&"4421".to_string()), "{t:?}");
    }

    #[test]
    fn russian_keeps_cyrillic_and_stems_it() {
        let a = terms(
            "Мой номер счёта и любимый город — Новосибирск",
            Some(Lang::English),
        );
        let b = terms("в каком городе я живу? Новосибирске", Some(Lang::English));
        assert!(
            a.iter()
                .all(|t| t.chars().any(|c| script_of(c) == Script::Cyrillic)),
            "{a:?}"
        );
        // "город" and "городе" share a stem; so do the two forms of the city.
        let shared: Vec<_> = a.iter().filter(|t| b.contains(t)).collect();
        assert!(shared.len() >= 2, "{a:?} {b:?}");
    }

    #[test]
    fn chinese_becomes_bigrams() {
        let t = terms("我的猫叫小白", Some(Lang::English));
        assert_eq!(t, ["我的", "的猫", "猫叫", "叫小", "小白"]);
        assert_eq!(terms("猫", Some(Lang::English)), ["猫"]);
        let mixed = terms("我用iPhone 15拍照", Some(Lang::English));
        assert!(mixed.contains(&"iphon".to_string()), "{mixed:?}");
        assert!(mixed.contains(&"拍照".to_string()), "{mixed:?}");
    }

    #[test]
    fn languages_parse_and_detect() {
        assert_eq!(TextLanguage::parse("auto"), Some(TextLanguage::Auto));
        assert_eq!(
            TextLanguage::parse("German"),
            Some(TextLanguage::Fixed(Lang::German))
        );
        assert_eq!(TextLanguage::parse("klingon"), None);
        assert_eq!(
            detect(
                "Ich habe gestern mit meiner Schwester über den Urlaub in Italien gesprochen und wir haben viel gelacht"
            ),
            Lang::German
        );
        assert_eq!(detect("hi"), Lang::English);
        assert_eq!(
            detect("Я вчера говорил с сестрой об отпуске в Италии, и мы много смеялись"),
            Lang::English
        );
    }
}
