//! When a question is about: the dates it names ("on 13 October 2023", "in July 2022",
//! "summer 2021", "last week", "three days ago"), read as a period of UTC days, so recall can
//! favour the turns stored in it (`hybrid.rs`). English only; a question naming no date has no
//! period and recall is as before.
//!
//! A turn matches a period from the period's first day to [`TOLD_WITHIN_DAYS`] after its last:
//! people tell of what they did in the days after ("last weekend I went hiking"). Several
//! dates in one question ("between August 11 and August 15") make one period spanning them.
//! A date without a year is the latest one not after today; a month or weekday alone needs a
//! preposition ("in May", "on Monday"), so "may" and "march" as words are not dates.

use std::borrow::Cow;

use time::{Date, Duration, Month, OffsetDateTime, Weekday};

/// Days after a period in which a turn still tells of it.
pub const TOLD_WITHIN_DAYS: i64 = 14;

const MS_PER_DAY: i64 = 86_400_000;

/// A span of whole UTC days, inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub first: Date,
    pub last: Date,
}

impl Period {
    fn day(date: Date) -> Period {
        Period {
            first: date,
            last: date,
        }
    }

    fn union(self, other: Period) -> Period {
        Period {
            first: self.first.min(other.first),
            last: self.last.max(other.last),
        }
    }

    /// Whether a turn stored at `at_ms` (UTC ms since the epoch) tells of this period: stored
    /// on one of its days or within [`TOLD_WITHIN_DAYS`] after it.
    pub fn holds(&self, at_ms: i64) -> bool {
        let start = day_ms(self.first);
        let end = day_ms(self.last) + (1 + TOLD_WITHIN_DAYS) * MS_PER_DAY;
        (start..end).contains(&at_ms)
    }
}

/// UTC ms of `date`'s midnight.
fn day_ms(date: Date) -> i64 {
    date.midnight().assume_utc().unix_timestamp() * 1000
}

/// The period `text` names, read on the day of `now_ms` (UTC ms since the epoch): `None` when
/// it names no date.
pub fn period(text: &str, now_ms: i64) -> Option<Period> {
    let today = OffsetDateTime::from_unix_timestamp(now_ms.div_euclid(1000))
        .ok()?
        .date();
    let words = words(text);
    let mut found: Option<Period> = None;
    let mut i = 0;
    while i < words.len() {
        match read_at(&words, i, today) {
            Some((period, used)) => {
                found = Some(found.map_or(period, |f| f.union(period)));
                i += used.max(1);
            }
            None => i += 1,
        }
    }
    found
}

/// The text's words, lower case: letters and digits runs, ordinals' suffixes dropped
/// ("13th" → "13"), ISO dates kept whole. A word already in lower case is borrowed.
fn words(text: &str) -> Vec<Cow<'_, str>> {
    let mut out = Vec::new();
    for raw in text.split(|c: char| !(c.is_alphanumeric() || c == '-')) {
        let raw = raw.trim_matches('-');
        if raw.is_empty() {
            continue;
        }
        if iso(raw).is_some() {
            out.push(Cow::Borrowed(raw));
            continue;
        }
        for part in raw.split('-').filter(|p| !p.is_empty()) {
            let lower = if part.chars().all(lower_already) {
                Cow::Borrowed(part)
            } else {
                Cow::Owned(part.to_lowercase())
            };
            let digits = lower.chars().take_while(char::is_ascii_digit).count();
            if digits > 0 && digits < lower.len() {
                let (number, suffix) = lower.split_at(digits);
                if matches!(suffix, "st" | "nd" | "rd" | "th") {
                    out.push(Cow::Owned(number.to_string()));
                    continue;
                }
            }
            out.push(lower);
        }
    }
    out
}

/// Whether `c` is its own lower case (one char, itself).
fn lower_already(c: char) -> bool {
    if c.is_ascii() {
        return !c.is_ascii_uppercase();
    }
    let mut lower = c.to_lowercase();
    lower.next() == Some(c) && lower.next().is_none()
}

fn iso(word: &str) -> Option<Date> {
    let mut parts = word.split('-');
    let (y, m, d) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || y.len() != 4 || m.len() != 2 || d.len() != 2 {
        return None;
    }
    let month = Month::try_from(m.parse::<u8>().ok()?).ok()?;
    Date::from_calendar_date(y.parse().ok()?, month, d.parse().ok()?).ok()
}

fn month(word: &str) -> Option<Month> {
    Some(match word {
        "january" | "jan" => Month::January,
        "february" | "feb" => Month::February,
        "march" | "mar" => Month::March,
        "april" | "apr" => Month::April,
        "may" => Month::May,
        "june" | "jun" => Month::June,
        "july" | "jul" => Month::July,
        "august" | "aug" => Month::August,
        "september" | "sep" | "sept" => Month::September,
        "october" | "oct" => Month::October,
        "november" | "nov" => Month::November,
        "december" | "dec" => Month::December,
        _ => return None,
    })
}

fn weekday(word: &str) -> Option<Weekday> {
    Some(match word {
        "monday" => Weekday::Monday,
        "tuesday" => Weekday::Tuesday,
        "wednesday" => Weekday::Wednesday,
        "thursday" => Weekday::Thursday,
        "friday" => Weekday::Friday,
        "saturday" => Weekday::Saturday,
        "sunday" => Weekday::Sunday,
        _ => return None,
    })
}

fn year(word: &str) -> Option<i32> {
    let year: i32 = word.parse().ok()?;
    (word.len() == 4 && (1900..=2200).contains(&year)).then_some(year)
}

fn day_of_month(word: &str) -> Option<u8> {
    let day: u8 = word.parse().ok()?;
    (word.len() <= 2 && (1..=31).contains(&day)).then_some(day)
}

fn number(word: &str) -> Option<i64> {
    if let Ok(n) = word.parse::<i64>() {
        return (word.len() <= 3).then_some(n);
    }
    Some(match word {
        "a" | "an" | "one" => 1,
        "two" | "couple" => 2,
        "three" | "few" => 3,
        "four" => 4,
        "five" => 5,
        "six" => 6,
        "seven" => 7,
        "eight" => 8,
        "nine" => 9,
        "ten" => 10,
        "eleven" => 11,
        "twelve" => 12,
        _ => return None,
    })
}

/// Words that make a lone month or weekday a date.
fn preposition(word: &str) -> bool {
    matches!(
        word,
        "in" | "on"
            | "during"
            | "since"
            | "of"
            | "from"
            | "until"
            | "till"
            | "by"
            | "before"
            | "after"
            | "early"
            | "mid"
            | "late"
            | "last"
            | "this"
            | "past"
            | "previous"
    )
}

fn month_period(year: i32, month: Month) -> Option<Period> {
    let first = Date::from_calendar_date(year, month, 1).ok()?;
    let next = match month {
        Month::December => Date::from_calendar_date(year + 1, Month::January, 1).ok()?,
        _ => Date::from_calendar_date(year, month.next(), 1).ok()?,
    };
    Some(Period {
        first,
        last: next - Duration::days(1),
    })
}

fn year_period(year: i32) -> Option<Period> {
    Some(Period {
        first: Date::from_calendar_date(year, Month::January, 1).ok()?,
        last: Date::from_calendar_date(year, Month::December, 31).ok()?,
    })
}

/// The latest `month` whose first day is not after `today`.
fn latest_month(month: Month, today: Date) -> Option<Period> {
    let this_year = month_period(today.year(), month)?;
    if this_year.first <= today {
        Some(this_year)
    } else {
        month_period(today.year() - 1, month)
    }
}

/// The latest `day` of `month` not after `today`.
fn latest_day(month: Month, day: u8, today: Date) -> Option<Period> {
    match Date::from_calendar_date(today.year(), month, day) {
        Ok(date) if date <= today => Some(Period::day(date)),
        _ => Date::from_calendar_date(today.year() - 1, month, day)
            .ok()
            .map(Period::day),
    }
}

fn season(word: &str, year: i32) -> Option<Period> {
    let (first, last) = match word {
        "spring" => ((year, Month::March), (year, Month::May)),
        "summer" => ((year, Month::June), (year, Month::August)),
        "autumn" | "fall" => ((year, Month::September), (year, Month::November)),
        "winter" => ((year, Month::December), (year + 1, Month::February)),
        _ => return None,
    };
    Some(Period {
        first: month_period(first.0, first.1)?.first,
        last: month_period(last.0, last.1)?.last,
    })
}

/// The week (Monday to Sunday) holding `date`.
fn week_of(date: Date) -> Period {
    let first = date - Duration::days(i64::from(date.weekday().number_days_from_monday()));
    Period {
        first,
        last: first + Duration::days(6),
    }
}

/// Reads a date starting at `words[i]`: the period and how many words it took.
fn read_at(words: &[Cow<'_, str>], i: usize, today: Date) -> Option<(Period, usize)> {
    let word = |k: usize| words.get(i + k).map_or("", |w| w.as_ref());
    let before = if i > 0 { words[i - 1].as_ref() } else { "" };
    let w0 = word(0);
    if let Some(date) = iso(w0) {
        return Some((Period::day(date), 1));
    }
    // A day of a month, then maybe its year: the period and the words taken (`used` before
    // the year).
    let day_in = |m: Month, day: u8, used: usize| match year(word(used)) {
        Some(y) => Date::from_calendar_date(y, m, day)
            .ok()
            .map(|d| (Period::day(d), used + 1)),
        None => latest_day(m, day, today).map(|p| (p, used)),
    };
    // "13 october 2023", "13 of october", "13 october"
    if let Some(day) = day_of_month(w0) {
        let of = usize::from(word(1) == "of");
        if let Some(m) = month(word(1 + of)) {
            return day_in(m, day, 2 + of);
        }
    }
    if let Some(m) = month(w0) {
        // "october 13, 2023", "october 13"
        if let Some(day) = day_of_month(word(1)) {
            return day_in(m, day, 2);
        }
        // "july 2022", "july of 2022"
        let of = usize::from(word(1) == "of");
        if let Some(y) = year(word(1 + of)) {
            return month_period(y, m).map(|p| (p, 2 + of));
        }
        // "in july"
        if preposition(before) {
            return latest_month(m, today).map(|p| (p, 1));
        }
        return None;
    }
    // "summer 2021", "summer of 2021"
    if matches!(w0, "spring" | "summer" | "autumn" | "fall" | "winter") {
        let of = usize::from(word(1) == "of");
        return year(word(1 + of)).and_then(|y| season(w0, y).map(|p| (p, 2 + of)));
    }
    // "in 2023"
    if let Some(y) = year(w0) {
        return preposition(before)
            .then(|| year_period(y))
            .flatten()
            .map(|p| (p, 1));
    }
    match w0 {
        "today" | "tonight" => return Some((Period::day(today), 1)),
        "yesterday" => return Some((Period::day(today - Duration::days(1)), 1)),
        _ => {}
    }
    // "last week", "this month", "last weekend", "last night", "last monday"
    if matches!(w0, "last" | "this" | "past" | "previous") {
        let back = w0 != "this";
        let unit = word(1);
        let period = match unit {
            "night" if back => Period::day(today - Duration::days(1)),
            "week" => {
                let this = week_of(today);
                if back {
                    week_of(this.first - Duration::days(1))
                } else {
                    this
                }
            }
            "weekend" => {
                let this = week_of(today);
                let week = if back {
                    week_of(this.first - Duration::days(1))
                } else {
                    this
                };
                Period {
                    first: week.last - Duration::days(1),
                    last: week.last,
                }
            }
            "month" => {
                let this = month_period(today.year(), today.month())?;
                if back {
                    let previous = this.first - Duration::days(1);
                    month_period(previous.year(), previous.month())?
                } else {
                    this
                }
            }
            "year" => year_period(today.year() - i32::from(back))?,
            _ => {
                let day = weekday(unit)?;
                return Some((latest_weekday(day, today), 2));
            }
        };
        return Some((period, 2));
    }
    // "on monday"
    if let Some(day) = weekday(w0)
        && preposition(before)
    {
        return Some((latest_weekday(day, today), 1));
    }
    // "three days ago", "a couple of weeks ago", "2 months ago"
    if let Some(n) = number(w0) {
        let of = usize::from(word(1) == "of");
        let unit = word(1 + of).trim_end_matches('s');
        if word(2 + of) == "ago" {
            let period = match unit {
                "day" => Period::day(today - Duration::days(n)),
                "week" => {
                    let around = today - Duration::days(7 * n);
                    Period {
                        first: around - Duration::days(3),
                        last: around + Duration::days(3),
                    }
                }
                "month" => {
                    let (mut y, mut m) = (today.year(), today.month());
                    for _ in 0..n.min(1200) {
                        if m == Month::January {
                            y -= 1;
                        }
                        m = m.previous();
                    }
                    month_period(y, m)?
                }
                "year" => year_period(today.year() - i32::try_from(n).ok()?)?,
                _ => return None,
            };
            return Some((period, 3 + of));
        }
    }
    None
}

/// The latest `day` of the week before `today`.
fn latest_weekday(day: Weekday, today: Date) -> Period {
    let mut date = today - Duration::days(1);
    while date.weekday() != day {
        date -= Duration::days(1);
    }
    Period::day(date)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Thursday 26 October 2023, noon UTC.
    const NOW: i64 = 1_698_321_600_000;

    fn date(y: i32, m: u8, d: u8) -> Date {
        Date::from_calendar_date(y, Month::try_from(m).unwrap(), d).unwrap()
    }

    fn span(text: &str) -> Option<(Date, Date)> {
        period(text, NOW).map(|p| (p.first, p.last))
    }

    #[test]
    fn words_are_lower_case_whether_borrowed_or_made() {
        let text = "On the 13TH of October, ÉTÉ 2023-10-13 ǅemal ß straße İstanbul mid-July 2nd";
        let read = words(text);
        let got: Vec<&str> = read.iter().map(|w| w.as_ref()).collect();
        assert_eq!(
            got,
            [
                "on",
                "the",
                "13",
                "of",
                "october",
                "été",
                "2023-10-13",
                "ǆemal",
                "ß",
                "straße",
                "i̇stanbul",
                "mid",
                "july",
                "2"
            ]
        );
        // Borrowed exactly when the text's word is its own lower case.
        let borrowed: Vec<bool> = words("July july 2nd été ÉTÉ")
            .iter()
            .map(|w| matches!(w, Cow::Borrowed(_)))
            .collect();
        assert_eq!(borrowed, [false, true, false, true, false]);
    }

    #[test]
    fn the_clock_reads_the_day_it_is() {
        assert_eq!(
            span("what did I do today?"),
            Some((date(2023, 10, 26), date(2023, 10, 26)))
        );
    }

    #[test]
    fn absolute_dates_are_read_in_their_usual_english_forms() {
        let day = Some((date(2023, 10, 13), date(2023, 10, 13)));
        for text in [
            "What did Caroline share on October 13, 2023?",
            "What happened on 13 October 2023?",
            "what happened on the 13th of October 2023",
            "Which painting, 2023-10-13?",
            "on Oct 13th 2023",
        ] {
            assert_eq!(span(text), day, "{text}");
        }
        assert_eq!(
            span("Where did Joanna travel to in July 2022?"),
            Some((date(2022, 7, 1), date(2022, 7, 31)))
        );
        assert_eq!(
            span("What state did Joanna visit in summer 2021?"),
            Some((date(2021, 6, 1), date(2021, 8, 31)))
        );
        assert_eq!(
            span("winter of 2022"),
            Some((date(2022, 12, 1), date(2023, 2, 28)))
        );
        assert_eq!(
            span("What did she start in 2022?"),
            Some((date(2022, 1, 1), date(2022, 12, 31)))
        );
    }

    #[test]
    fn a_date_without_its_year_is_the_latest_not_after_today() {
        assert_eq!(span("in July"), Some((date(2023, 7, 1), date(2023, 7, 31))));
        assert_eq!(
            span("in December"),
            Some((date(2022, 12, 1), date(2022, 12, 31)))
        );
        assert_eq!(
            span("on 2 November"),
            Some((date(2022, 11, 2), date(2022, 11, 2)))
        );
        assert_eq!(
            span("Where was John between August 11 and August 15 2023?"),
            Some((date(2023, 8, 11), date(2023, 8, 15)))
        );
    }

    #[test]
    fn dates_relative_to_today_count_back_from_it() {
        assert_eq!(
            span("yesterday"),
            Some((date(2023, 10, 25), date(2023, 10, 25)))
        );
        // The week before the one holding Thursday the 26th: Monday 16th to Sunday 22nd.
        assert_eq!(
            span("what did I say last week"),
            Some((date(2023, 10, 16), date(2023, 10, 22)))
        );
        assert_eq!(
            span("last weekend"),
            Some((date(2023, 10, 21), date(2023, 10, 22)))
        );
        assert_eq!(
            span("this month"),
            Some((date(2023, 10, 1), date(2023, 10, 31)))
        );
        assert_eq!(
            span("last month"),
            Some((date(2023, 9, 1), date(2023, 9, 30)))
        );
        assert_eq!(
            span("last year"),
            Some((date(2022, 1, 1), date(2022, 12, 31)))
        );
        assert_eq!(
            span("three days ago"),
            Some((date(2023, 10, 23), date(2023, 10, 23)))
        );
        assert_eq!(
            span("2 months ago"),
            Some((date(2023, 8, 1), date(2023, 8, 31)))
        );
        assert_eq!(
            span("a couple of weeks ago"),
            Some((date(2023, 10, 9), date(2023, 10, 15)))
        );
        assert_eq!(
            span("on Monday"),
            Some((date(2023, 10, 23), date(2023, 10, 23)))
        );
        assert_eq!(
            span("last thursday"),
            Some((date(2023, 10, 19), date(2023, 10, 19)))
        );
    }

    #[test]
    fn words_that_only_look_like_dates_are_not_read_as_dates() {
        for text in [
            "May I ask what car I drive?",
            "I will march on",
            "the 2000 people at the conference",
            "I sued them",
            "we should meet soon",
            "what is the weather like",
            "I have 3 dogs",
            "Monday is my favourite day",
        ] {
            assert_eq!(span(text), None, "{text}");
        }
        // A date by its form is read as one, whatever it is about.
        assert!(span("the 13 october street sign").is_some());
    }

    #[test]
    fn a_turn_tells_of_a_period_from_its_first_day_to_two_weeks_after_its_last() {
        let p = period("in July 2022", NOW).unwrap();
        let at = |y, m, d| day_ms(date(y, m, d)) + 3_600_000;
        assert!(!p.holds(at(2022, 6, 30)));
        assert!(p.holds(day_ms(date(2022, 7, 1))));
        assert!(p.holds(at(2022, 7, 31)));
        assert!(p.holds(at(2022, 8, 14)));
        assert!(!p.holds(day_ms(date(2022, 8, 15))));
    }

    #[test]
    fn nothing_in_any_text_makes_it_panic() {
        for text in [
            "",
            "-",
            "--2023--",
            "31 february 2023",
            "february 30",
            "0 days ago",
            "999 years ago",
            "in 1900",
            "last",
            "on",
            "13th",
            "2023-13-45",
            "in the summer",
            "1200 months ago",
        ] {
            let _ = period(text, NOW);
            let _ = period(text, i64::MIN);
            let _ = period(text, 0);
        }
    }
}
