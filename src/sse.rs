//! An incremental parser of server-sent events, fed with body chunks as they pass.
//!
//! It keeps only the unfinished line and the current event's data, so a stream of any length
//! is read in bounded memory (a single line is capped at [`MAX_LINE_BYTES`]). Chunks may split
//! anywhere, inside a line, a `\r\n` pair or a UTF-8 sequence.

/// The longest line, and the longest event's data, kept by default; past it the stream is
/// marked unreadable rather than growing.
pub const MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

#[derive(Debug)]
pub struct SseParser {
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    /// The previous chunk ended with `\r`: a `\n` starting the next one belongs to it.
    after_cr: bool,
    overflow: bool,
    /// The longest line and the longest event data kept.
    max_bytes: usize,
}

impl Default for SseParser {
    fn default() -> SseParser {
        SseParser::with_limit(MAX_LINE_BYTES)
    }
}

impl SseParser {
    pub fn new() -> SseParser {
        SseParser::default()
    }

    /// A parser that keeps at most `max_bytes` of one line and of one event's data.
    pub fn with_limit(max_bytes: usize) -> SseParser {
        SseParser {
            line: Vec::new(),
            data: Vec::new(),
            has_data: false,
            after_cr: false,
            overflow: false,
            max_bytes,
        }
    }

    /// True once a line or an event's data passed the limit; the parser then yields nothing
    /// more.
    pub fn overflowed(&self) -> bool {
        self.overflow
    }

    /// Feeds a chunk; `on_event` receives the data of each event completed by it.
    pub fn feed(&mut self, mut chunk: &[u8], mut on_event: impl FnMut(&str)) {
        if self.overflow {
            return;
        }
        if self.after_cr {
            self.after_cr = false;
            if let Some(rest) = chunk.strip_prefix(b"\n") {
                chunk = rest;
            }
        }
        while let Some(pos) = chunk.iter().position(|&b| b == b'\n' || b == b'\r') {
            let (head, rest) = chunk.split_at(pos);
            self.line.extend_from_slice(head);
            let mut rest = &rest[1..];
            if chunk[pos] == b'\r' {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    None => self.after_cr = true,
                    Some(_) => {}
                }
            }
            self.end_line(&mut on_event);
            chunk = rest;
        }
        self.line.extend_from_slice(chunk);
        if self.line.len() > self.max_bytes || self.data.len() > self.max_bytes {
            self.overflow = true;
            self.line = Vec::new();
            self.data = Vec::new();
        }
    }

    fn end_line(&mut self, on_event: &mut impl FnMut(&str)) {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            if self.has_data {
                on_event(&String::from_utf8_lossy(&self.data));
            }
            self.data.clear();
            self.has_data = false;
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(0) => return, // a comment
            Some(i) => {
                let value = &line[i + 1..];
                (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (&line[..], &b""[..]),
        };
        if field == b"data" {
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        self.line = line;
        self.line.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn events(chunks: &[&[u8]]) -> Vec<String> {
        let mut parser = SseParser::new();
        let mut out = Vec::new();
        for chunk in chunks {
            parser.feed(chunk, |e| out.push(e.to_string()));
        }
        out
    }

    #[test]
    fn an_event_past_the_limit_overflows_instead_of_growing() {
        // Many short data lines of one event that never ends: its data is capped too.
        let mut parser = SseParser::with_limit(64);
        let mut seen = 0;
        for _ in 0..100 {
            parser.feed(b"data: 0123456789\n", |_| seen += 1);
        }
        assert!(parser.overflowed());
        assert!(parser.data.capacity() <= 1024);
        parser.feed(b"\ndata: after\n\n", |_| seen += 1);
        assert_eq!(seen, 0, "nothing more is yielded once overflowed");
        // A long line alone.
        let mut parser = SseParser::with_limit(64);
        parser.feed(&[b'x'; 100], |_| {});
        assert!(parser.overflowed());
        // Within the limit: as before.
        let mut parser = SseParser::with_limit(64);
        let mut out = Vec::new();
        parser.feed(b"data: short\n\n", |e| out.push(e.to_string()));
        assert_eq!(out, ["short"]);
    }

    #[test]
    fn parses_events_comments_and_multiline_data() {
        let input =
            b": keep-alive\n\ndata: {\"a\":1}\n\nevent: x\ndata: one\ndata: two\n\ndata:[DONE]\n\n";
        assert_eq!(events(&[input]), vec!["{\"a\":1}", "one\ntwo", "[DONE]"]);
    }

    #[test]
    fn handles_crlf_split_across_chunks() {
        assert_eq!(
            events(&[b"data: a\r", b"\n\r", b"\ndata: b\r\r"]),
            vec!["a", "b"]
        );
    }

    #[test]
    fn an_unfinished_event_is_not_emitted() {
        assert_eq!(events(&[b"data: a\n\ndata: b\n"]), vec!["a"]);
    }

    proptest! {
        #[test]
        fn any_split_gives_the_same_events(
            texts in proptest::collection::vec("[a-z\u{4e00}-\u{4e10} {}\":,]{0,20}", 0..8),
            crlf in any::<bool>(),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..10),
        ) {
            let nl = if crlf { "\r\n" } else { "\n" };
            let mut input = String::new();
            for t in &texts {
                input.push_str(&format!("data: {t}{nl}{nl}"));
            }
            let bytes = input.as_bytes();
            let mut points: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            points.sort_unstable();
            let mut chunks: Vec<&[u8]> = Vec::new();
            let mut last = 0;
            for p in points {
                chunks.push(&bytes[last..p]);
                last = p;
            }
            chunks.push(&bytes[last..]);
            prop_assert_eq!(events(&chunks), texts);
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut parser = SseParser::new();
            parser.feed(&data, |_| {});
        }
    }
}
