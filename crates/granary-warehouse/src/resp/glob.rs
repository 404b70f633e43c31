//! Redis-style glob patterns for `SCAN MATCH` and `CONFIG GET`.
//!
//! Keys are arbitrary bytes, so matching works on bytes: `*` any run,
//! `?` one byte, `[abc]` / `[^abc]` / `[a-z]` classes, `\x` a literal `x`.
//! Matching uses backtracking over the last `*` only, so it runs in
//! O(pattern × key) and a hostile pattern cannot make it explode.

/// Whether `text` matches `pattern`; `nocase` folds ASCII case.
///
/// The empty key matches only the empty pattern, as in Redis, whose matcher
/// never enters its loop for an empty string (`KEYS *` and `SCAN` without
/// `MATCH` list it because they do not match at all).
pub fn glob_match(pattern: &[u8], text: &[u8], nocase: bool) -> bool {
    if text.is_empty() {
        return pattern.is_empty();
    }
    let eq = |a: u8, b: u8| if nocase { a.eq_ignore_ascii_case(&b) } else { a == b };
    let (mut p, mut t) = (0usize, 0usize);
    // Where to resume after the last `*`: pattern position after it, text position it covers up to.
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        let step = match pattern.get(p) {
            Some(b'*') => {
                while pattern.get(p) == Some(&b'*') {
                    p += 1;
                }
                if p == pattern.len() {
                    return true;
                }
                star = Some((p, t));
                continue;
            }
            Some(b'?') => Some(p + 1),
            Some(b'[') => match class(pattern, p + 1, text[t], &eq) {
                (true, next) => Some(next),
                (false, _) => None,
            },
            Some(b'\\') if p + 1 < pattern.len() => eq(pattern[p + 1], text[t]).then_some(p + 2),
            Some(&c) => eq(c, text[t]).then_some(p + 1),
            None => None,
        };
        match step {
            Some(next) => {
                p = next;
                t += 1;
            }
            None => match star {
                Some((sp, st)) => {
                    p = sp;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p.min(pattern.len())..].iter().all(|&c| c == b'*')
}

/// Matches byte `c` against the class starting at `p` (just after `[`);
/// returns whether it matched and the pattern position after the class.
/// An unterminated class runs to the end of the pattern, as in Redis.
fn class(pattern: &[u8], mut p: usize, c: u8, eq: &impl Fn(u8, u8) -> bool) -> (bool, usize) {
    let negate = pattern.get(p) == Some(&b'^');
    if negate {
        p += 1;
    }
    let mut hit = false;
    loop {
        match pattern.get(p) {
            None => break,
            Some(b']') => {
                p += 1;
                break;
            }
            Some(b'\\') if p + 1 < pattern.len() => {
                hit |= eq(pattern[p + 1], c);
                p += 2;
            }
            Some(&lo) if pattern.get(p + 1) == Some(&b'-') && p + 2 < pattern.len() && pattern[p + 2] != b']' => {
                let hi = pattern[p + 2];
                let (lo, hi) = if lo <= hi { (lo, hi) } else { (hi, lo) };
                let inside = |x: u8| lo <= x && x <= hi;
                let nocase = eq(b'a', b'A');
                hit |= inside(c) || (nocase && (inside(c.to_ascii_lowercase()) || inside(c.to_ascii_uppercase())));
                p += 3;
            }
            Some(&x) => {
                hit |= eq(x, c);
                p += 1;
            }
        }
    }
    (hit != negate, p)
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    fn m(p: &str, t: &str) -> bool {
        glob_match(p.as_bytes(), t.as_bytes(), false)
    }

    #[test]
    fn wildcards() {
        // Redis's matcher: the empty key matches only the empty pattern
        // (`KEYS *` lists it without matching).
        assert!(!m("*", ""));
        assert!(!m("**", ""));
        assert!(m("", ""));
        assert!(m("*", "anything"));
        assert!(m("k*", "k"));
        assert!(m("h?llo", "hello"));
        assert!(!m("h?llo", "hllo"));
        assert!(m("h*llo", "hllo"));
        assert!(m("h*llo", "heeeello"));
        assert!(m("vllm@*@0@*", "vllm@/models/llama@1@0@abcdef"));
        assert!(!m("vllm@*@0@*", "vllm@/models/llama@1@1@abcdef"));
        assert!(m("*kv_bytes", "xkv_bytes"));
        assert!(!m("*kv_bytes", "xkv_bytesmetadata"));
        assert!(m("a*b*c", "aXXbYYbZZc"));
        assert!(!m("a*b*c", "aXXbYYbZZ"));
        assert!(!m("abc", "abcd"));
        assert!(!m("abcd", "abc"));
        assert!(m("abc**", "abc"));
    }

    #[test]
    fn classes_and_escapes() {
        assert!(m("h[ae]llo", "hello"));
        assert!(m("h[ae]llo", "hallo"));
        assert!(!m("h[ae]llo", "hillo"));
        assert!(m("h[^e]llo", "hallo"));
        assert!(!m("h[^e]llo", "hello"));
        assert!(m("h[a-b]llo", "hbllo"));
        assert!(!m("h[a-b]llo", "hcllo"));
        assert!(m("h[b-a]llo", "hallo"), "reversed range");
        assert!(m("key[0-9][0-9]", "key42"));
        assert!(m("a\\*b", "a*b"));
        assert!(!m("a\\*b", "axb"));
        assert!(m("a[\\]]b", "a]b"));
        assert!(m("x[a-]", "x-"));
        assert!(m("x[abc", "xc"), "unterminated class");
    }

    #[test]
    fn bytes_and_case() {
        assert!(glob_match(b"k\xff*", b"k\xff\x00\x01", false));
        assert!(!glob_match(b"K*", b"key", false));
        assert!(glob_match(b"K*", b"key", true));
        assert!(glob_match(b"[A-C]x", b"bx", true));
    }

    #[test]
    fn pathological_pattern_is_fast() {
        let text = vec![b'a'; 4096];
        let pattern = b"*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*b";
        let start = std::time::Instant::now();
        assert!(!glob_match(pattern, &text, false));
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
    }
}
