//! Stop strings over streamed text. Text arrives in chunks that can split a stop string anywhere, so the
//! matcher holds back the longest tail that could still grow into one, and on a match returns the text
//! before it (the stop string itself is never emitted).
//!
//! ```text
//!   stop = "END"      push("abcE") -> emit "abc", hold "E"
//!                     push("Nx")   -> "ENx" has no match, "E" was a false start -> emit "ENx"
//!                     push("yEN")  -> emit "y", hold "EN";  push("D!") -> Stopped("")
//! ```

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// No stop string yet; this text is safe to emit (may be empty while a partial match is held).
    Continue(String),
    /// A stop string matched; emit this last text and end the request.
    Stopped(String),
}

#[derive(Clone, Debug, Default)]
pub struct StopStringMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
    /// The stop string that matched (Anthropic reports it as `stop_sequence`).
    matched: Option<String>,
}

impl StopStringMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        StopStringMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
            matched: None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stopped {
            return StopOutcome::Stopped(String::new());
        }
        if self.stops.is_empty() {
            return StopOutcome::Continue(text.to_string());
        }
        self.held.push_str(text);
        // The earliest match of any stop string wins.
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|pos| (pos, s)))
            .min_by_key(|(pos, _)| *pos);
        if let Some((pos, stop)) = first {
            self.stopped = true;
            self.matched = Some(stop.clone());
            let out = self.held[..pos].to_string();
            self.held.clear();
            return StopOutcome::Stopped(out);
        }
        let keep_from = self.partial_match_start();
        let out = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        StopOutcome::Continue(out)
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// The stream ended without a match: the held-back text is plain output after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Byte offset of the longest suffix of `held` that is a proper prefix of some stop string
    /// (`held.len()` when none is).
    fn partial_match_start(&self) -> usize {
        let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let min_start = self.held.len().saturating_sub(longest.saturating_sub(1));
        for (i, _) in self.held.char_indices() {
            if i < min_start {
                continue;
            }
            let tail = &self.held[i..];
            if self.stops.iter().any(|s| s.len() > tail.len() && s.starts_with(tail)) {
                return i;
            }
        }
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let mut m = StopStringMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for c in chunks {
            match m.push(c) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn doc_example() {
        let mut m = StopStringMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abcE"), StopOutcome::Continue("abc".into()));
        assert_eq!(m.push("Nx"), StopOutcome::Continue("ENx".into()));
        assert_eq!(m.push("yEN"), StopOutcome::Continue("y".into()));
        assert_eq!(m.push("D!"), StopOutcome::Stopped("".into()));
    }

    #[test]
    fn split_across_every_boundary() {
        let text = "hello world, STOP here";
        for cut1 in 0..=text.len() {
            for cut2 in cut1..=text.len() {
                let (out, stopped) = run(&["STOP"], &[&text[..cut1], &text[cut1..cut2], &text[cut2..]]);
                assert!(stopped);
                assert_eq!(out, "hello world, ");
            }
        }
    }

    #[test]
    fn earliest_of_several_and_multibyte() {
        assert_eq!(run(&["xyz", "é!"], &["abé", "!cxyz"]), ("ab".into(), true));
        assert_eq!(run(&["😀😀"], &["a😀", "b😀", "😀c"]), ("a😀b".into(), true));
        assert_eq!(run(&["\n\n"], &["line\n", "more\n", "\nrest"]), ("line\nmore".into(), true));
    }

    #[test]
    fn no_match_releases_everything() {
        assert_eq!(run(&["STOP"], &["ST", "O", "P"]), ("".into(), true));
        assert_eq!(run(&["STOP"], &["ST", "O"]), ("STO".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), false));
    }
}
