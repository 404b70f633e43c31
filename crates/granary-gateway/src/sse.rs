//! Server-sent events (`text/event-stream`): the one parser of the
//! engines' KV event streams and of the answers the proxy relays.

/// An incremental parser of `text/event-stream`: feed it chunks as they
/// come, get the `data` of each complete event.
#[derive(Default)]
pub struct SseParser {
    line: Vec<u8>,
    data: Vec<String>,
}

impl SseParser {
    /// The events completed by `chunk` (their `data` lines joined by `\n`).
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        for &b in chunk {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            if self.line.last() == Some(&b'\r') {
                self.line.pop();
            }
            if self.line.is_empty() {
                if !self.data.is_empty() {
                    out.push(self.data.join("\n"));
                    self.data.clear();
                }
            } else if let Some(rest) = self.line.strip_prefix(b"data:") {
                let rest = rest.strip_prefix(b" ").unwrap_or(rest);
                self.data.push(String::from_utf8_lossy(rest).into_owned());
            }
            self.line.clear();
        }
        out
    }
}

/// Splits an SSE byte stream into whole events (raw bytes kept for
/// passthrough, `data` extracted for inspection).
#[derive(Default)]
pub struct EventFilter {
    pending: Vec<u8>,
}

pub struct RawEvent {
    pub raw: Vec<u8>,
    pub data: Option<String>,
}

impl EventFilter {
    pub fn push(&mut self, chunk: &[u8]) -> Vec<RawEvent> {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some(end) = find_event_end(&self.pending) {
            let raw: Vec<u8> = self.pending.drain(..end).collect();
            let mut parser = SseParser::default();
            let data = parser.push(&raw).into_iter().next();
            out.push(RawEvent { raw, data });
        }
        out
    }

    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

/// The end (exclusive) of the first complete event: after `\n\n` or `\r\n\r\n`.
fn find_event_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' {
            if buf[i + 1] == b'\n' {
                return Some(i + 2);
            }
            if buf[i + 1] == b'\r' && buf.get(i + 2) == Some(&b'\n') {
                return Some(i + 3);
            }
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_handles_split_chunks_and_multiline_data() {
        let mut p = SseParser::default();
        assert!(p.push(b"event: stored\ndata: {\"a\"").is_empty());
        assert_eq!(
            p.push(b":1}\n\n: comment\n\ndata: x\r\ndata: y\r\n\r\n"),
            vec!["{\"a\":1}".to_string(), "x\ny".into()]
        );
        assert!(p.push(b"data: partial").is_empty());
    }

    #[test]
    fn event_filter_splits_whole_events_only() {
        let mut f = EventFilter::default();
        assert!(f.push(b"data: {\"a\"").is_empty());
        let evs = f.push(b":1}\n\ndata: [DONE]\r\n\r\ndata: tail");
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].raw, b"data: {\"a\":1}\n\n");
        assert_eq!(evs[0].data.as_deref(), Some("{\"a\":1}"));
        assert_eq!(evs[1].data.as_deref(), Some("[DONE]"));
        assert_eq!(f.finish(), b"data: tail");
    }
}
