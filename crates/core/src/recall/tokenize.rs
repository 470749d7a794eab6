//! Turning text into search terms, in any language.
//!
//! Text is cut into runs of one script. Each alphabetic run goes through the `bm25` crate's
//! tokenizer for its language (lowercase, Unicode word boundaries, stopwords, Snowball
//! stemming), with transliteration off so Cyrillic or Greek stay themselves: Latin runs use the
//! conversation's language, Cyrillic runs Russian, Greek Greek, Arabic Arabic. Chinese and
//! Japanese have no spaces between words, so their runs become overlapping character bigrams
//! (and single characters for one-character runs), the usual way to search them with BM25.

use std::sync::OnceLock;

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
    static TOKENIZERS: [OnceLock<DefaultTokenizer>; 16] = [const { OnceLock::new() }; 16];
    let index = LANGS.iter().position(|(_, l)| *l == lang).unwrap_or(3);
    TOKENIZERS[index].get_or_init(|| {
        DefaultTokenizer::builder()
            .language_mode(bm25_language(lang))
            .normalization(false)
            .stemming(true)
            .stopwords(true)
            .build()
    })
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
        (Script::Latin, Some(lang)) => tokenizer_for(lang),
        (Script::Cyrillic, Some(_)) => tokenizer_for(Lang::Russian),
        (Script::Greek, Some(_)) => tokenizer_for(Lang::Greek),
        (Script::Arabic, Some(_)) => tokenizer_for(Lang::Arabic),
    };
    out.extend(tokenizer.tokenize(run));
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
