//! Excerpts: the passage of a long recalled message that best matches the query.
//!
//! A recalled turn is put in the prompt because some of its words match the new message; a
//! long one (a pasted document, a page of code, a model's long answer) is mostly about other
//! things. Its excerpt is the run of whole sentences (or lines), at most a token budget long,
//! holding the most distinct query terms (then the most matches, then the one that starts
//! nearest a match, then the earliest); when a run of words inside a sentence too long to fit
//! holds more distinct terms, that run instead, widened back to its sentence's start when that
//! still fits. `…` marks where text was left out. Terms are compared the way recall compares
//! them ([`super::tokenize::terms`]), so a stemmed or CJK match counts here as it did in the
//! search.

use std::collections::{HashMap, HashSet};

use super::tokenize::{Lang, terms};

/// Marks where an excerpt leaves text out.
pub const ELLIPSIS: &str = "…";

/// The longest piece of text taken as one word: longer runs without spaces (Chinese,
/// Japanese, a long identifier) are cut into pieces of this many characters.
const MAX_WORD_CHARS: usize = 12;

/// The excerpt of `text`, whose tokens are `total` (a stored count), for `query_terms`, at
/// most `max_tokens` as `count` counts them (ellipses included), or `None` when `text` fits
/// whole. Never empty when `text` is not: with no term matching, the excerpt is the text's
/// beginning.
pub fn excerpt(
    text: &str,
    total: u32,
    query_terms: &HashSet<String>,
    latin: Option<Lang>,
    max_tokens: u32,
    count: impl Fn(&str) -> u32,
) -> Option<String> {
    if total <= max_tokens {
        return None;
    }
    let words = words(text);
    if words.is_empty() {
        return None;
    }
    // Each word's query terms (usually none or one). Stemming cuts or changes a word's end,
    // never its first three letters, so an ASCII word that starts like no query term cannot
    // match and is not stemmed; other scripts (CJK bigrams anywhere in a piece) always are.
    let prefixes: HashSet<String> = query_terms.iter().map(|t| prefix(t)).collect();
    let matched: Vec<Vec<String>> = words
        .iter()
        .map(|&(start, end)| {
            let word = text[start..end].trim_start_matches(|c: char| !c.is_alphanumeric());
            if word.is_ascii() && !prefixes.contains(&prefix(word)) {
                return Vec::new();
            }
            terms(word, latin)
                .into_iter()
                .filter(|t| query_terms.contains(t))
                .collect()
        })
        .collect();
    let by_sentence = best_sentences(text, &words, &matched, max_tokens, &count);
    // Whole sentences holding every term the text has cannot be beaten by a run of words.
    if let Some((terms, candidate)) = &by_sentence
        && *terms == distinct(&matched)
    {
        return Some(candidate.clone());
    }
    // A first width from the text's own tokens per word, corrected below by counting.
    let per_word = f64::from(total) / words.len() as f64;
    let mut width = ((f64::from(max_tokens) / per_word).floor() as usize).clamp(1, words.len());
    let by_word = loop {
        let (from, to) = best_run(&matched, width);
        let (from, to) = widen_to_sentence(text, &words, from, to);
        let candidate = render(text, &words, from, to);
        if count(&candidate) <= max_tokens || width == 1 {
            break (distinct(&matched[from..to]), candidate);
        }
        width = (width * 9 / 10).min(width - 1).max(1);
    };
    Some(match by_sentence {
        Some((terms, candidate)) if terms >= by_word.0 => candidate,
        _ => by_word.1,
    })
}

/// Distinct terms among `matched`.
fn distinct(matched: &[Vec<String>]) -> usize {
    matched.iter().flatten().collect::<HashSet<_>>().len()
}

/// The best run of whole sentences that fits (see the module's documentation), as (distinct
/// terms, excerpt); `None` when no sentence fits alone.
fn best_sentences(
    text: &str,
    words: &[(usize, usize)],
    matched: &[Vec<String>],
    max_tokens: u32,
    count: &impl Fn(&str) -> u32,
) -> Option<(usize, String)> {
    // Sentences as word ranges: one ends at a word ending a sentence or before a line break.
    let mut sentences: Vec<(usize, usize)> = Vec::new();
    let mut from = 0;
    for i in 0..words.len() {
        let word = &text[words[i].0..words[i].1];
        let line_break = words
            .get(i + 1)
            .is_some_and(|next| text[words[i].1..next.0].contains('\n'));
        if i + 1 == words.len() || line_break || ends_sentence(word) {
            sentences.push((from, i + 1));
            from = i + 1;
        }
    }
    // One sentence, and the text does not fit: it does not either.
    if sentences.len() == 1 {
        return None;
    }
    let tokens: Vec<u32> = sentences
        .iter()
        .map(|&(from, to)| count(&text[words[from].0..words[to - 1].1]))
        .collect();
    // Room for the ellipses and the spaces that join sentences.
    let budget = max_tokens.saturating_sub(2);
    let mut best: Option<(Score, (usize, usize))> = None;
    for first in 0..sentences.len() {
        let mut used = 0u32;
        let mut last = first;
        while last < sentences.len() && used + tokens[last] <= budget {
            used += tokens[last];
            last += 1;
        }
        if last == first {
            continue;
        }
        let span = &matched[sentences[first].0..sentences[last - 1].1];
        let lead = span
            .iter()
            .position(|m| !m.is_empty())
            .unwrap_or(usize::MAX);
        let score = (
            distinct(span),
            span.iter().map(Vec::len).sum(),
            std::cmp::Reverse(lead),
        );
        if best.as_ref().is_none_or(|(b, _)| score > *b) {
            best = Some((score, (first, last)));
        }
    }
    let (score, (first, mut last)) = best?;
    loop {
        let candidate = render(text, words, sentences[first].0, sentences[last - 1].1);
        if count(&candidate) <= max_tokens {
            return Some((score.0, candidate));
        }
        if last - first == 1 {
            return None;
        }
        last -= 1;
    }
}

/// How a run ranks: distinct terms, matches, nearness of the first match to its start.
type Score = (usize, usize, std::cmp::Reverse<usize>);

fn ends_sentence(word: &str) -> bool {
    word.ends_with(['.', '!', '?', ':', ';', '。', '！', '？'])
}

/// The first three characters of `word`, lowercased (all of it when shorter).
fn prefix(word: &str) -> String {
    word.chars().take(3).flat_map(char::to_lowercase).collect()
}

/// Byte ranges of the words of `text`: runs between whitespace, long runs cut into pieces.
fn words(text: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start: Option<usize> = None;
    let mut chars = 0;
    for (i, c) in text.char_indices() {
        if c.is_whitespace() {
            if let Some(s) = start.take() {
                out.push((s, i));
            }
            chars = 0;
            continue;
        }
        if start.is_some() && chars == MAX_WORD_CHARS {
            out.push((start.unwrap_or(i), i));
            start = None;
            chars = 0;
        }
        if start.is_none() {
            start = Some(i);
        }
        chars += 1;
    }
    if let Some(s) = start {
        out.push((s, text.len()));
    }
    out
}

/// The window of `width` words (`from..to`) with the most distinct matched terms, then the
/// most matches, then the one whose first match is nearest its start (the passage is read
/// from the match on), then the earliest: one pass, sliding.
fn best_run(matched: &[Vec<String>], width: usize) -> (usize, usize) {
    let width = width.min(matched.len());
    // The index of the first matching word at or after each word.
    let mut next_match = vec![matched.len(); matched.len() + 1];
    for i in (0..matched.len()).rev() {
        next_match[i] = if matched[i].is_empty() {
            next_match[i + 1]
        } else {
            i
        };
    }
    let lead = |from: usize| {
        let first = next_match[from];
        std::cmp::Reverse(if first < from + width {
            first - from
        } else {
            usize::MAX
        })
    };
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut hits = 0usize;
    for terms in &matched[..width] {
        enter(&mut seen, &mut hits, terms);
    }
    let distinct = |seen: &HashMap<&str, usize>| seen.values().filter(|&&n| n > 0).count();
    let mut best = ((distinct(&seen), hits, lead(0)), 0);
    for from in 1..=matched.len() - width {
        leave(&mut seen, &mut hits, &matched[from - 1]);
        enter(&mut seen, &mut hits, &matched[from + width - 1]);
        let score = (distinct(&seen), hits, lead(from));
        if score > best.0 {
            best = (score, from);
        }
    }
    (best.1, best.1 + width)
}

fn enter<'a>(seen: &mut HashMap<&'a str, usize>, hits: &mut usize, terms: &'a [String]) {
    for term in terms {
        *seen.entry(term.as_str()).or_insert(0) += 1;
        *hits += 1;
    }
}

fn leave(seen: &mut HashMap<&str, usize>, hits: &mut usize, terms: &[String]) {
    for term in terms {
        if let Some(n) = seen.get_mut(term.as_str()) {
            *n -= 1;
            *hits -= 1;
        }
    }
}

/// Moves a run that starts inside a sentence back to the sentence's first word when that is
/// at most a quarter of the run away, dropping as many words at its end.
fn widen_to_sentence(
    text: &str,
    words: &[(usize, usize)],
    from: usize,
    to: usize,
) -> (usize, usize) {
    let reach = (to - from) / 4;
    for back in 0..=reach.min(from) {
        let i = from - back;
        let sentence_start = i == 0 || ends_sentence(&text[words[i - 1].0..words[i - 1].1]);
        if sentence_start {
            return (i, to - back);
        }
    }
    (from, to)
}

fn render(text: &str, words: &[(usize, usize)], from: usize, to: usize) -> String {
    let mut out = String::new();
    if from > 0 {
        out.push_str(ELLIPSIS);
        out.push(' ');
    }
    out.push_str(&text[words[from].0..words[to - 1].1]);
    if to < words.len() {
        out.push(' ');
        out.push_str(ELLIPSIS);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One token per word and per ellipsis, as a stand-in for a tokenizer in these tests.
    fn count(text: &str) -> u32 {
        text.split_whitespace().count() as u32
    }

    /// [`excerpt`], the text counted by `count`.
    fn cut(
        text: &str,
        query_terms: &HashSet<String>,
        latin: Option<Lang>,
        max_tokens: u32,
        count: impl Fn(&str) -> u32,
    ) -> Option<String> {
        excerpt(text, count(text), query_terms, latin, max_tokens, count)
    }

    fn query(text: &str) -> HashSet<String> {
        terms(text, Some(Lang::English)).into_iter().collect()
    }

    #[test]
    fn a_text_that_fits_is_left_whole() {
        assert_eq!(cut("short text", &query("text"), None, 10, count), None);
    }

    #[test]
    fn the_passage_with_the_query_terms_is_kept() {
        let filler = "the weather was mild and nothing else happened that day. ".repeat(10);
        let text =
            format!("{filler}My locker code is 4471 and the locker is in the basement. {filler}");
        let got = cut(
            &text,
            &query("what is my locker code"),
            Some(Lang::English),
            16,
            count,
        )
        .unwrap();
        assert!(got.contains("My locker code is 4471"), "{got}");
        assert!(
            got.starts_with(ELLIPSIS) && got.ends_with(ELLIPSIS),
            "{got}"
        );
        assert!(count(&got) <= 16, "{got}");
    }

    #[test]
    fn stemmed_terms_match() {
        let text = format!(
            "{} We were running late for the concert in Lisbon. {}",
            "nothing to see here at all. ".repeat(8),
            "more filler words follow now. ".repeat(8)
        );
        let got = cut(
            &text,
            &query("did we run to the concerts"),
            Some(Lang::English),
            12,
            count,
        )
        .unwrap();
        assert!(got.contains("running late for the concert"), "{got}");
    }

    #[test]
    fn the_excerpt_starts_its_sentence_when_it_can() {
        let text = "Alpha beta gamma delta. The invoice number was 88123 for the March order. \
                    Then many other words followed here without any relevance whatsoever today.";
        let got = cut(
            text,
            &query("invoice number"),
            Some(Lang::English),
            14,
            count,
        )
        .unwrap();
        assert!(got.starts_with("… The invoice number"), "{got}");
    }

    #[test]
    fn whole_lines_are_kept_when_they_fit() {
        // A message joining several turns, one per line: the matching line comes whole.
        let text = "I went hiking last weekend with my dog\n\
                    We saw a waterfall near the old mill and I took many photos of it\n\
                    Then we had pizza";
        let got = cut(
            text,
            &query("photos of the waterfall"),
            Some(Lang::English),
            18,
            count,
        )
        .unwrap();
        assert!(
            got.contains("We saw a waterfall near the old mill and I took many photos of it"),
            "{got}"
        );
    }

    #[test]
    fn no_match_keeps_the_beginning_and_text_without_spaces_is_cut() {
        let text = "one two three four five six seven eight nine ten";
        assert_eq!(
            cut(text, &query("zebra"), None, 4, count).unwrap(),
            "one two three …"
        );
        // Chinese: no spaces, cut into pieces; the matching piece is kept.
        let text = format!(
            "{}我的储物柜密码是四四七一{}",
            "天气很好".repeat(12),
            "没有别的事".repeat(12)
        );
        let terms: HashSet<String> = terms("储物柜密码", None).into_iter().collect();
        let got = cut(&text, &terms, None, 14, |t| {
            t.chars().filter(|c| !c.is_whitespace()).count() as u32
        })
        .unwrap();
        assert!(got.contains("储物柜"), "{got}");
    }
}
