//! Incremental RESP request parser.
//!
//! Clients send commands either as RESP arrays of bulk strings (what every
//! client library does) or as inline text lines (what a person typing into
//! `telnet` does). The parser looks at the front of the connection's input
//! buffer and either takes one whole command out of it or says how many
//! bytes must be buffered before trying again, so a large value is read
//! straight into a buffer reserved for it and parsed once. Arguments are
//! zero-copy slices of the frame's bytes. Every length a client sends is
//! checked against [`Limits`] before anything is allocated for it.

use bytes::{Bytes, BytesMut};

/// Bounds a request must respect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest bulk string (one argument).
    pub max_bulk: usize,
    /// Most arguments in one command.
    pub max_args: usize,
    /// Longest inline command line.
    pub max_inline: usize,
    /// Largest whole frame (all arguments together).
    pub max_frame: usize,
}

impl Limits {
    /// Limits for a store accepting values up to `max_value` bytes.
    pub fn for_max_value(max_value: u64) -> Limits {
        let max_value = usize::try_from(max_value).unwrap_or(usize::MAX);
        let max_bulk = max_value.saturating_add(64 * 1024);
        Limits {
            max_bulk,
            max_args: 1 << 20,
            max_inline: 64 * 1024,
            max_frame: max_bulk.saturating_mul(2).saturating_add(16 << 20),
        }
    }
}

impl Limits {
    /// Limits before AUTH on a server with tokens: as Redis allows
    /// unauthenticated clients, a few arguments and small frames.
    pub fn unauthenticated() -> Limits {
        Limits { max_bulk: 16 * 1024, max_args: 10, max_inline: 16 * 1024, max_frame: 16 * 1024 }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::for_max_value(512 << 20)
    }
}

/// Why a request could not be parsed; the connection is closed after the reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("invalid multibulk length")]
    MultibulkLength,
    #[error("invalid bulk length")]
    BulkLength,
    #[error("expected '$', got '{0}'")]
    ExpectedBulk(char),
    #[error("bulk string not terminated by CRLF")]
    MissingCrlf,
    #[error("too big inline request")]
    InlineTooBig,
    #[error("unbalanced quotes in request")]
    UnbalancedQuotes,
    #[error("request of {size} bytes exceeds the limit of {limit} bytes")]
    FrameTooBig { size: usize, limit: usize },
    #[error("bulk of {size} bytes exceeds the limit of {limit} bytes")]
    BulkTooBig { size: usize, limit: usize },
    #[error("too many arguments ({count}, limit {limit})")]
    TooManyArgs { count: usize, limit: usize },
}

/// Outcome of one parse attempt.
#[derive(Debug, PartialEq, Eq)]
pub enum Parse {
    /// One command, taken out of the buffer. Empty for a blank line or an
    /// empty array, which clients may send and which get no reply.
    Command(Vec<Bytes>),
    /// Not enough bytes yet; try again once the buffer holds at least `need` bytes.
    Incomplete { need: usize },
}

/// Longest `*<n>` / `$<n>` header line accepted (sign, 20 digits, CRLF and slack).
const MAX_HEADER_LINE: usize = 32;

/// Takes one command off the front of `buf`, if a complete one is there.
pub fn parse_command(buf: &mut BytesMut, limits: &Limits) -> Result<Parse, ProtocolError> {
    match buf.first() {
        None => Ok(Parse::Incomplete { need: 1 }),
        Some(b'*') => parse_multibulk(buf, limits),
        Some(_) => parse_inline(buf, limits),
    }
}

/// Position of the first `\r\n` at or after `from`.
fn find_crlf(b: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i + 1 < b.len() {
        match b[i..].iter().position(|&c| c == b'\r') {
            None => return None,
            Some(p) => {
                let at = i + p;
                if at + 1 < b.len() && b[at + 1] == b'\n' {
                    return Some(at);
                }
                i = at + 1;
            }
        }
    }
    None
}

/// A decimal integer as RESP writes lengths: optional '-', digits only.
fn parse_int(b: &[u8]) -> Option<i64> {
    let (neg, digits) = match b.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, b),
    };
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    let mut v: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(i64::from(d - b'0'))?;
    }
    Some(if neg { -v } else { v })
}

/// Reads a header line starting at `at` (its type byte included); returns
/// the integer after the type byte and the position after the CRLF.
fn header(b: &[u8], at: usize, err: ProtocolError) -> Result<Option<(i64, usize)>, ProtocolError> {
    // A valid line ends within MAX_HEADER_LINE + 2 bytes; look no further.
    let window = &b[..b.len().min(at + MAX_HEADER_LINE + 2)];
    match find_crlf(window, at) {
        Some(end) => {
            let n = parse_int(&b[at + 1..end]).ok_or(err)?;
            Ok(Some((n, end + 2)))
        }
        None if window.len() == at + MAX_HEADER_LINE + 2 => Err(err),
        None => Ok(None),
    }
}

fn parse_multibulk(buf: &mut BytesMut, limits: &Limits) -> Result<Parse, ProtocolError> {
    let b = &buf[..];
    let Some((count, mut pos)) = header(b, 0, ProtocolError::MultibulkLength)? else {
        return Ok(Parse::Incomplete { need: b.len() + 1 });
    };
    if count <= 0 {
        // `*0` and `*-1` carry no command.
        let _ = buf.split_to(pos);
        return Ok(Parse::Command(Vec::new()));
    }
    let count = usize::try_from(count).map_err(|_| ProtocolError::MultibulkLength)?;
    if count > limits.max_args {
        return Err(ProtocolError::TooManyArgs { count, limit: limits.max_args });
    }
    let mut ranges = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let Some(&t) = b.get(pos) else { return Ok(Parse::Incomplete { need: pos + 1 }) };
        if t != b'$' {
            return Err(ProtocolError::ExpectedBulk(char::from(t)));
        }
        let Some((len, data)) = header(b, pos, ProtocolError::BulkLength)? else {
            return Ok(Parse::Incomplete { need: b.len() + 1 });
        };
        let len = usize::try_from(len).map_err(|_| ProtocolError::BulkLength)?;
        if len > limits.max_bulk {
            return Err(ProtocolError::BulkTooBig { size: len, limit: limits.max_bulk });
        }
        let end = data.checked_add(len).ok_or(ProtocolError::BulkLength)?;
        let next = end.checked_add(2).ok_or(ProtocolError::BulkLength)?;
        if next > limits.max_frame {
            return Err(ProtocolError::FrameTooBig { size: next, limit: limits.max_frame });
        }
        if b.len() < next {
            // The bytes after the header are the value's: nothing to check
            // until all of them are here.
            return Ok(Parse::Incomplete { need: next });
        }
        if &b[end..next] != b"\r\n" {
            return Err(ProtocolError::MissingCrlf);
        }
        ranges.push((data, end));
        pos = next;
    }
    let frame = buf.split_to(pos).freeze();
    Ok(Parse::Command(ranges.into_iter().map(|(s, e)| frame.slice(s..e)).collect()))
}

fn parse_inline(buf: &mut BytesMut, limits: &Limits) -> Result<Parse, ProtocolError> {
    let Some(nl) = buf.iter().position(|&c| c == b'\n') else {
        if buf.len() > limits.max_inline {
            return Err(ProtocolError::InlineTooBig);
        }
        return Ok(Parse::Incomplete { need: buf.len() + 1 });
    };
    if nl > limits.max_inline {
        return Err(ProtocolError::InlineTooBig);
    }
    let line = buf.split_to(nl + 1);
    let mut text = &line[..nl];
    if let Some(stripped) = text.strip_suffix(b"\r") {
        text = stripped;
    }
    let args = split_inline(text)?;
    if args.len() > limits.max_args {
        return Err(ProtocolError::TooManyArgs { count: args.len(), limit: limits.max_args });
    }
    Ok(Parse::Command(args.into_iter().map(Bytes::from).collect()))
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Splits an inline command line into words. Words may be quoted: `"..."`
/// understands `\n \r \t \b \a \\ \" \xHH`; `'...'` only `\'`. A closing
/// quote must be followed by a space or the end of the line.
pub fn split_inline(line: &[u8]) -> Result<Vec<Vec<u8>>, ProtocolError> {
    let mut out = Vec::new();
    let mut i = 0;
    let n = line.len();
    loop {
        while i < n && line[i].is_ascii_whitespace() {
            i += 1;
        }
        if i >= n {
            return Ok(out);
        }
        let mut word = Vec::new();
        match line[i] {
            b'"' => {
                i += 1;
                loop {
                    let Some(&c) = line.get(i) else { return Err(ProtocolError::UnbalancedQuotes) };
                    match c {
                        b'"' => {
                            i += 1;
                            break;
                        }
                        b'\\'
                            if i + 3 < n
                                && line[i + 1] == b'x'
                                && hex_val(line[i + 2]).is_some()
                                && hex_val(line[i + 3]).is_some() =>
                        {
                            let hi = hex_val(line[i + 2]).unwrap_or(0);
                            let lo = hex_val(line[i + 3]).unwrap_or(0);
                            word.push(hi * 16 + lo);
                            i += 4;
                        }
                        b'\\' if i + 1 < n => {
                            word.push(match line[i + 1] {
                                b'n' => b'\n',
                                b'r' => b'\r',
                                b't' => b'\t',
                                b'b' => 8,
                                b'a' => 7,
                                other => other,
                            });
                            i += 2;
                        }
                        c => {
                            word.push(c);
                            i += 1;
                        }
                    }
                }
            }
            b'\'' => {
                i += 1;
                loop {
                    let Some(&c) = line.get(i) else { return Err(ProtocolError::UnbalancedQuotes) };
                    match c {
                        b'\'' => {
                            i += 1;
                            break;
                        }
                        b'\\' if line.get(i + 1) == Some(&b'\'') => {
                            word.push(b'\'');
                            i += 2;
                        }
                        c => {
                            word.push(c);
                            i += 1;
                        }
                    }
                }
            }
            _ => {
                while i < n && !line[i].is_ascii_whitespace() {
                    word.push(line[i]);
                    i += 1;
                }
                out.push(word);
                continue;
            }
        }
        if i < n && !line[i].is_ascii_whitespace() {
            return Err(ProtocolError::UnbalancedQuotes);
        }
        out.push(word);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(args: &[&[u8]]) -> Vec<u8> {
        let mut v = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            v.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            v.extend_from_slice(a);
            v.extend_from_slice(b"\r\n");
        }
        v
    }

    fn parse_all(bytes: &[u8], limits: &Limits) -> Result<(Vec<Vec<Bytes>>, usize), ProtocolError> {
        let mut buf = BytesMut::from(bytes);
        let mut out = Vec::new();
        loop {
            match parse_command(&mut buf, limits)? {
                Parse::Command(c) => out.push(c),
                Parse::Incomplete { need } => {
                    assert!(need > buf.len(), "need {need} must exceed buffered {}", buf.len());
                    return Ok((out, buf.len()));
                }
            }
        }
    }

    #[test]
    fn whole_frame_is_taken_and_args_are_slices() {
        let wire = encode(&[b"SET", b"key", b"val\r\nue"]);
        let mut buf = BytesMut::from(&wire[..]);
        buf.extend_from_slice(b"*1\r\n$4\r\nPING\r\n");
        let Parse::Command(args) = parse_command(&mut buf, &Limits::default()).unwrap() else { panic!("incomplete") };
        assert_eq!(
            args,
            vec![Bytes::from_static(b"SET"), Bytes::from_static(b"key"), Bytes::from_static(b"val\r\nue")]
        );
        assert_eq!(&buf[..], b"*1\r\n$4\r\nPING\r\n");
    }

    #[test]
    fn every_split_point_of_a_pipeline() {
        let mut wire = encode(&[b"SET", b"k", &[0u8, 255, 13, 10, 42][..]]);
        wire.extend(encode(&[b"GET", b"k"]));
        wire.extend_from_slice(b"PING \"a b\"\r\n");
        wire.extend(encode(&[b"DEL", b""]));
        let expected = vec![
            vec![Bytes::from_static(b"SET"), Bytes::from_static(b"k"), Bytes::from_static(&[0, 255, 13, 10, 42])],
            vec![Bytes::from_static(b"GET"), Bytes::from_static(b"k")],
            vec![Bytes::from_static(b"PING"), Bytes::from_static(b"a b")],
            vec![Bytes::from_static(b"DEL"), Bytes::new()],
        ];
        let limits = Limits::default();
        for split in 0..=wire.len() {
            let mut buf = BytesMut::new();
            let mut got = Vec::new();
            for chunk in [&wire[..split], &wire[split..]] {
                buf.extend_from_slice(chunk);
                while let Parse::Command(c) = parse_command(&mut buf, &limits).unwrap() {
                    got.push(c);
                }
            }
            assert_eq!(got, expected, "split at {split}");
            assert!(buf.is_empty());
        }
        // And byte by byte.
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for &byte in &wire {
            buf.extend_from_slice(&[byte]);
            loop {
                match parse_command(&mut buf, &limits).unwrap() {
                    Parse::Command(c) => got.push(c),
                    Parse::Incomplete { need } => {
                        assert!(need > buf.len());
                        break;
                    }
                }
            }
        }
        assert_eq!(got, expected);
    }

    #[test]
    fn incomplete_value_reports_the_whole_frame_size() {
        let wire = encode(&[b"SET", b"k", &vec![7u8; 100_000]]);
        let mut buf = BytesMut::from(&wire[..30]);
        assert_eq!(parse_command(&mut buf, &Limits::default()).unwrap(), Parse::Incomplete { need: wire.len() });
        assert_eq!(buf.len(), 30, "nothing consumed while incomplete");
    }

    #[test]
    fn inline_commands() {
        let (cmds, rest) =
            parse_all(b"set a 'it\\'s'\r\nget   \"x\\x41\\n\"\n\r\n   \r\nping", &Limits::default()).unwrap();
        assert_eq!(
            cmds,
            vec![
                vec![Bytes::from_static(b"set"), Bytes::from_static(b"a"), Bytes::from_static(b"it's")],
                vec![Bytes::from_static(b"get"), Bytes::from_static(b"xA\n")],
                vec![],
                vec![],
            ]
        );
        assert_eq!(rest, 4, "unterminated line waits");
        assert_eq!(parse_all(b"get \"abc\r\n", &Limits::default()), Err(ProtocolError::UnbalancedQuotes));
        assert_eq!(parse_all(b"get \"a\"b\r\n", &Limits::default()), Err(ProtocolError::UnbalancedQuotes));
    }

    #[test]
    fn empty_arrays_are_skipped() {
        let (cmds, rest) = parse_all(b"*0\r\n*-1\r\n*1\r\n$4\r\nPING\r\n", &Limits::default()).unwrap();
        assert_eq!(cmds, vec![vec![], vec![], vec![Bytes::from_static(b"PING")]]);
        assert_eq!(rest, 0);
    }

    #[test]
    fn malformed_frames_are_errors() {
        let l = Limits::default();
        assert_eq!(parse_all(b"*x\r\n", &l), Err(ProtocolError::MultibulkLength));
        assert_eq!(parse_all(b"*2\r\n+OK\r\n", &l), Err(ProtocolError::ExpectedBulk('+')));
        assert_eq!(parse_all(b"*1\r\n$-1\r\n", &l), Err(ProtocolError::BulkLength));
        assert_eq!(parse_all(b"*1\r\n$abc\r\n", &l), Err(ProtocolError::BulkLength));
        assert_eq!(parse_all(b"*1\r\n$3\r\nabcde\r\n", &l), Err(ProtocolError::MissingCrlf));
        assert_eq!(parse_all(b"*99999999999999999999999\r\n", &l), Err(ProtocolError::MultibulkLength));
        assert_eq!(parse_all(&[b'*'; 100], &l), Err(ProtocolError::MultibulkLength));
        assert_eq!(parse_all(b"*1\r\n$1111111111111111111111111111111111", &l), Err(ProtocolError::BulkLength));
    }

    #[test]
    fn limits_are_enforced_before_buffering() {
        let l = Limits { max_bulk: 10, max_args: 3, max_inline: 16, max_frame: 40 };
        assert_eq!(parse_all(b"*1\r\n$11\r\n", &l), Err(ProtocolError::BulkTooBig { size: 11, limit: 10 }));
        assert_eq!(parse_all(b"*4\r\n", &l), Err(ProtocolError::TooManyArgs { count: 4, limit: 3 }));
        assert_eq!(
            parse_all(b"*1000000000\r\n", &l),
            Err(ProtocolError::TooManyArgs { count: 1_000_000_000, limit: 3 })
        );
        assert!(matches!(
            parse_all(b"*3\r\n$10\r\n0123456789\r\n$10\r\n0123456789\r\n$10\r\n", &l),
            Err(ProtocolError::FrameTooBig { .. })
        ));
        assert_eq!(parse_all(&[b'a'; 17], &l), Err(ProtocolError::InlineTooBig));
        assert_eq!(parse_all(b"a b c d\r\n", &l), Err(ProtocolError::TooManyArgs { count: 4, limit: 3 }));
        // Exactly at the limits is fine.
        let (cmds, _) = parse_all(&encode(&[b"0123456789"]), &l).unwrap();
        assert_eq!(cmds.len(), 1);
        let (cmds, _) = parse_all(b"0123456789abcd\r\n", &l).unwrap();
        assert_eq!(cmds.len(), 1);
    }

    #[test]
    fn limits_follow_the_store() {
        let l = Limits::for_max_value(1 << 20);
        assert!(l.max_bulk >= 1 << 20 && l.max_bulk < (1 << 20) + (1 << 17));
        assert!(l.max_frame >= 2 * l.max_bulk);
    }
}
