//! Stop strings over streamed text.
//!
//! Text arrives in pieces (one per token, as the detokenizer completes
//! characters) and a stop string may span several pieces. [`StopMatcher`]
//! releases text only once it cannot be the start of a stop string, so
//! nothing past a stop string is ever sent.

/// How a request's generated text is cut and written: its stop strings,
/// whether the one found stays in the answer (vLLM's
/// `include_stop_str_in_output`), how many tokens come before a stop string
/// may end the answer (vLLM's `min_tokens`), and whether special tokens are
/// written out (vLLM's `skip_special_tokens: false`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct TextRules {
    /// Non-empty stop strings.
    pub stop: Vec<String>,
    pub include_stop: bool,
    pub min_tokens: usize,
    pub keep_special: bool,
}

impl TextRules {
    /// Stop strings alone, cut before the one found.
    #[cfg(test)]
    pub fn stop(stop: &[&str]) -> TextRules {
        TextRules { stop: stop.iter().map(|s| s.to_string()).collect(), ..TextRules::default() }
    }
}

/// Finds the first stop string in a stream of text pieces.
#[derive(Debug)]
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    /// The stop string found stays in the text.
    include: bool,
    /// Text received but not released: a suffix that may begin a stop string.
    held: String,
}

/// What one piece of text released.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Matched {
    /// No stop string yet; the text is safe to send (may be empty).
    Pending(String),
    /// A stop string was found: the text before it, the last to send.
    Stop(String),
}

impl StopMatcher {
    /// Empty stop strings are ignored. With `include`, the text released
    /// at a match ends with the stop string instead of before it.
    pub fn new(stops: Vec<String>, include: bool) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), include, held: String::new() }
    }

    /// Takes the next piece. Only an `armed` matcher stops; one not armed
    /// yet (fewer than `min_tokens` generated) releases stop strings as
    /// text, holding back only what may begin one.
    pub fn push(&mut self, piece: &str, armed: bool) -> Matched {
        if self.stops.is_empty() {
            return Matched::Pending(piece.to_owned());
        }
        self.held.push_str(piece);
        // Held text never contains a whole stop string, so the earliest
        // match found now is the earliest in the whole output.
        let found =
            || self.stops.iter().filter_map(|s| Some((self.held.find(s.as_str())?, s.len()))).min_by_key(|m| m.0);
        if let Some((at, len)) = armed.then(found).flatten() {
            self.held.truncate(if self.include { at + len } else { at });
            return Matched::Stop(std::mem::take(&mut self.held));
        }
        let keep = self.partial_suffix_len();
        let rest = self.held.split_off(self.held.len() - keep);
        Matched::Pending(std::mem::replace(&mut self.held, rest))
    }

    /// The text still held when generation ended without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The longest suffix of `held` that is a proper prefix of a stop string.
    fn partial_suffix_len(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let longest = (stop.len() - 1).min(self.held.len());
            for len in (best + 1..=longest).rev() {
                if stop.is_char_boundary(len) && self.held.ends_with(&stop[..len]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` and returns (the text released, whether it stopped).
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        run_with(stops, false, 0, pieces)
    }

    /// As [`run`], keeping the stop string (`include`) and arming the
    /// matcher at piece `min` (a piece per token).
    fn run_with(stops: &[&str], include: bool, min: usize, pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect(), include);
        let mut out = String::new();
        for (i, p) in pieces.iter().enumerate() {
            match m.push(p, i + 1 >= min) {
                Matched::Pending(t) => out.push_str(&t),
                Matched::Stop(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn without_stop_strings_text_passes_through() {
        let mut m = StopMatcher::new(vec![String::new()], false);
        assert_eq!(m.push("abc", true), Matched::Pending("abc".into()));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn a_stop_string_inside_one_piece() {
        assert_eq!(run(&["END"], &["hello END world"]), ("hello ".into(), true));
        assert_eq!(run(&["END"], &["END"]), (String::new(), true));
    }

    #[test]
    fn a_stop_string_across_pieces() {
        assert_eq!(run(&["</answer>"], &["42", "</", "ans", "wer", ">", "more"]), ("42".into(), true));
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(run(&["abc"], &["xa", "b", "c"]), ("x".into(), true));
    }

    #[test]
    fn text_that_might_start_a_stop_string_is_held_back() {
        let mut m = StopMatcher::new(vec!["STOP".into()], false);
        assert_eq!(m.push("go ST", true), Matched::Pending("go ".into()));
        assert_eq!(m.push("O", true), Matched::Pending(String::new()));
        // Not a stop string after all: everything held is released.
        assert_eq!(m.push("NE", true), Matched::Pending("STONE".into()));
        assert_eq!(m.push("S", true), Matched::Pending(String::new()));
        assert_eq!(m.finish(), "S");
    }

    #[test]
    fn a_false_start_followed_by_a_real_match() {
        assert_eq!(run(&["aab"], &["a", "a", "a", "b", "z"]), ("a".into(), true));
        assert_eq!(run(&["abab"], &["ab", "a", "bab"]), (String::new(), true));
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        assert_eq!(run(&["world", "lo"], &["hello world"]), ("hel".into(), true));
        assert_eq!(run(&["xyz", "b"], &["axy", "b"]), ("axy".into(), true));
        // "long stop" starts before "op" does, though it completes with the same piece.
        assert_eq!(run(&["op", "long stop"], &["a long st", "op"]), ("a ".into(), true));
    }

    #[test]
    fn no_match_releases_everything_at_the_end() {
        assert_eq!(run(&["zz"], &["abz", "cz"]), ("abzcz".into(), false));
        assert_eq!(run(&["###"], &["a#", "#"]), ("a##".into(), false));
    }

    #[test]
    fn multi_byte_characters_are_never_split() {
        // A stop string sharing a first byte with the text must not cut a character.
        assert_eq!(run(&["é!"], &["caf", "é", "?", "é", "!"]), ("café?".into(), true));
        let mut m = StopMatcher::new(vec!["日本語".into()], false);
        assert_eq!(m.push("x日", true), Matched::Pending("x".into()));
        assert_eq!(m.push("本", true), Matched::Pending(String::new()));
        assert_eq!(m.push("人", true), Matched::Pending("日本人".into()));
    }

    #[test]
    fn an_included_stop_string_ends_the_text() {
        assert_eq!(run_with(&["END"], true, 0, &["hello EN", "D world"]), ("hello END".into(), true));
        // The earliest match is kept whole, not the first stop string listed.
        assert_eq!(run_with(&["world", "lo"], true, 0, &["hello world"]), ("hello".into(), true));
    }

    #[test]
    fn before_min_tokens_a_stop_string_is_text() {
        // Armed from the third piece: the first "." passes, the second stops.
        assert_eq!(run_with(&["."], false, 3, &["a.", "b", "c.", "d"]), ("a.bc".into(), true));
        // A stop string begun before arming and completed after it stops.
        assert_eq!(run_with(&["xy"], false, 2, &["ax", "y", "z"]), ("a".into(), true));
        // Never armed: everything is released.
        assert_eq!(run_with(&["."], false, 9, &["a.", "b."]), ("a.b.".into(), false));
    }
}
