//! A JSON object as the model writes it, checked character by character while it streams, so the arguments
//! of a call can be forwarded before the call is over and still always close into valid JSON.
//!
//! Only a prefix that stays valid when closed is released; the rest is held:
//!
//! ```text
//!   model writes            released            closers (what a cut-off call is finished with)
//!   {                       {                   }
//!   {"city                  {                   }        (inside a key: held)
//!   {"city": "Pa            {"city": "Pa        "}
//!   {"city": "Paris", "d    {"city": "Paris"    }        (a comma only goes out with the next member)
//!   {"n": 12                {"n": 12            }        (a number that is complete so far)
//!   {"n": 1.                {"n": 1             }
//!   {"ok": tr               {                   }        (a literal only once whole)
//! ```
//!
//! Raw control characters inside strings (models write real newlines in code arguments) are released
//! escaped, so the arguments stay valid JSON.

/// How feeding went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Feed {
    /// All the input was taken; the object is not closed yet.
    More,
    /// The object closed; this many bytes of the input belonged to it.
    Done(usize),
    /// Not a JSON object (the offending character is at this byte of the input).
    Error(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Esc {
    None,
    Backslash,
    /// Inside `\uXXXX`, this many hex digits seen.
    Unicode(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

impl Num {
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits)
    }

    fn next(self, c: char) -> Option<Num> {
        Some(match (self, c) {
            (Num::Minus, '0') => Num::Zero,
            (Num::Minus, '1'..='9') => Num::Int,
            (Num::Zero | Num::Int, '.') => Num::Dot,
            (Num::Int, '0'..='9') => Num::Int,
            (Num::Dot | Num::Frac, '0'..='9') => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, 'e' | 'E') => Num::Exp,
            (Num::Exp, '+' | '-') => Num::ExpSign,
            (Num::Exp | Num::ExpSign | Num::ExpDigits, '0'..='9') => Num::ExpDigits,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing yet: `{` must come.
    Start,
    /// Just after `{`: a key or `}`.
    KeyOrEnd,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// Just after `[`: a value or `]`.
    ValueOrEnd,
    /// After `:` or `,` in an array: a value.
    Value,
    /// After a value: `,` or the container's end.
    CommaOrEnd,
    Str {
        key: bool,
        esc: Esc,
    },
    Number(Num),
    Literal {
        word: &'static str,
        matched: usize,
    },
    Done,
}

/// What a state made of one character.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Accepted: the character is held as is.
    Hold,
    /// Accepted and already dealt with (whitespace before the object, an escaped control character).
    Handled,
    /// The state moved on without the character (a number it ended): take it again.
    Again,
    /// It cannot continue a JSON object.
    Reject,
}

/// JSON's whitespace.
fn is_ws(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

pub(crate) struct JsonStream {
    /// Closing characters of the open containers, innermost last.
    stack: Vec<char>,
    state: State,
    /// Taken but not yet released (it would not close into valid JSON).
    held: String,
    /// What closes everything released so far.
    closers: String,
}

impl JsonStream {
    pub fn new() -> Self {
        JsonStream { stack: Vec::new(), state: State::Start, held: String::new(), closers: String::new() }
    }

    /// What finishes the released text into valid JSON (empty before the `{` or once the object closed).
    pub fn closers(&self) -> &str {
        &self.closers
    }

    /// Takes `input`, appending what became safe to release to `out`.
    pub fn feed(&mut self, input: &str, out: &mut String) -> Feed {
        for (i, c) in input.char_indices() {
            if !self.take(c) {
                return Feed::Error(i);
            }
            if self.safe() {
                out.push_str(&self.held);
                self.held.clear();
                self.closers = self.current_closers();
            }
            if self.state == State::Done {
                return Feed::Done(i + c.len_utf8());
            }
        }
        Feed::More
    }

    fn safe(&self) -> bool {
        match self.state {
            State::KeyOrEnd | State::ValueOrEnd | State::CommaOrEnd | State::Done => true,
            State::Str { key: false, esc: Esc::None } => true,
            State::Number(n) => n.complete(),
            _ => false,
        }
    }

    fn current_closers(&self) -> String {
        let mut s = String::new();
        if matches!(self.state, State::Str { .. }) {
            s.push('"');
        }
        s.extend(self.stack.iter().rev());
        s
    }

    fn after_value(&mut self) {
        self.state = if self.stack.is_empty() { State::Done } else { State::CommaOrEnd };
    }

    /// One character; false if it cannot continue a JSON object.
    fn take(&mut self, c: char) -> bool {
        let verdict = match self.state {
            State::Start => self.take_start(c),
            State::KeyOrEnd | State::Key => self.take_key(c),
            State::Colon => self.take_colon(c),
            State::ValueOrEnd | State::Value => self.take_value(c),
            State::CommaOrEnd => self.take_comma_or_end(c),
            State::Str { key, esc } => self.take_in_string(key, esc, c),
            State::Number(n) => self.take_in_number(n, c),
            State::Literal { word, matched } => self.take_in_literal(word, matched, c),
            State::Done => Verdict::Reject,
        };
        match verdict {
            Verdict::Hold => {
                self.held.push(c);
                true
            }
            Verdict::Handled => true,
            Verdict::Again => self.take(c),
            Verdict::Reject => false,
        }
    }

    /// Before the object: whitespace, then `{`.
    fn take_start(&mut self, c: char) -> Verdict {
        if is_ws(c) {
            return Verdict::Handled; // not released: the object has not begun
        }
        if c != '{' {
            return Verdict::Reject;
        }
        self.stack.push('}');
        self.state = State::KeyOrEnd;
        Verdict::Hold
    }

    /// Where a key may start (or, just after `{`, the object end).
    fn take_key(&mut self, c: char) -> Verdict {
        if c == '"' {
            self.state = State::Str { key: true, esc: Esc::None };
        } else if c == '}' && self.state == State::KeyOrEnd {
            self.stack.pop();
            self.after_value();
        } else if !is_ws(c) {
            return Verdict::Reject;
        }
        Verdict::Hold
    }

    fn take_colon(&mut self, c: char) -> Verdict {
        if c == ':' {
            self.state = State::Value;
        } else if !is_ws(c) {
            return Verdict::Reject;
        }
        Verdict::Hold
    }

    /// Where a value may start (or, just after `[`, the array end).
    fn take_value(&mut self, c: char) -> Verdict {
        if is_ws(c) {
        } else if c == ']' && self.state == State::ValueOrEnd {
            self.stack.pop();
            self.after_value();
        } else if !self.start_value(c) {
            return Verdict::Reject;
        }
        Verdict::Hold
    }

    /// After a value: `,` (a key or a value follows, by the container) or the container's end.
    fn take_comma_or_end(&mut self, c: char) -> Verdict {
        if c == ',' {
            self.state = if self.stack.last() == Some(&'}') { State::Key } else { State::Value };
        } else if Some(&c) == self.stack.last() {
            self.stack.pop();
            self.after_value();
        } else if !is_ws(c) {
            return Verdict::Reject;
        }
        Verdict::Hold
    }

    /// Inside a string (a key's or a value's): its end, escapes, and raw control characters.
    fn take_in_string(&mut self, key: bool, esc: Esc, c: char) -> Verdict {
        match esc {
            Esc::None => match c {
                '"' => {
                    if key {
                        self.state = State::Colon;
                    } else {
                        self.after_value();
                    }
                }
                '\\' => self.state = State::Str { key, esc: Esc::Backslash },
                c if (c as u32) < 0x20 => {
                    self.hold_escaped_control(c);
                    return Verdict::Handled;
                }
                _ => {}
            },
            Esc::Backslash => match c {
                '"' | '\\' | '/' | 'b' | 'f' | 'n' | 'r' | 't' => self.state = State::Str { key, esc: Esc::None },
                'u' => self.state = State::Str { key, esc: Esc::Unicode(0) },
                _ => return Verdict::Reject,
            },
            Esc::Unicode(n) => {
                if !c.is_ascii_hexdigit() {
                    return Verdict::Reject;
                }
                self.state = State::Str { key, esc: if n == 3 { Esc::None } else { Esc::Unicode(n + 1) } };
            }
        }
        Verdict::Hold
    }

    /// A raw control character in a string, held in its escaped form (so the released text stays JSON).
    fn hold_escaped_control(&mut self, c: char) {
        match c {
            '\n' => self.held.push_str("\\n"),
            '\r' => self.held.push_str("\\r"),
            '\t' => self.held.push_str("\\t"),
            _ => self.held.push_str(&format!("\\u{:04x}", c as u32)),
        }
    }

    fn take_in_number(&mut self, n: Num, c: char) -> Verdict {
        match n.next(c) {
            Some(next) => {
                self.state = State::Number(next);
                Verdict::Hold
            }
            None if n.complete() => {
                // The number ended at this character, which belongs to what follows.
                self.after_value();
                Verdict::Again
            }
            None => Verdict::Reject,
        }
    }

    /// Inside `true`, `false` or `null`.
    fn take_in_literal(&mut self, word: &'static str, matched: usize, c: char) -> Verdict {
        if !word[matched..].starts_with(c) {
            return Verdict::Reject;
        }
        if matched + 1 == word.len() {
            self.after_value();
        } else {
            self.state = State::Literal { word, matched: matched + 1 };
        }
        Verdict::Hold
    }

    fn start_value(&mut self, c: char) -> bool {
        self.state = match c {
            '{' => {
                self.stack.push('}');
                State::KeyOrEnd
            }
            '[' => {
                self.stack.push(']');
                State::ValueOrEnd
            }
            '"' => State::Str { key: false, esc: Esc::None },
            '-' => State::Number(Num::Minus),
            '0' => State::Number(Num::Zero),
            '1'..='9' => State::Number(Num::Int),
            't' => State::Literal { word: "true", matched: 1 },
            'f' => State::Literal { word: "false", matched: 1 },
            'n' => State::Literal { word: "null", matched: 1 },
            _ => return false,
        };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` one char at a time; after every char the released text closed with the closers must
    /// parse. Returns (released, closers, outcome).
    fn feed_chars(text: &str) -> (String, String, Feed) {
        let mut js = JsonStream::new();
        let mut out = String::new();
        let mut offset = 0;
        for c in text.chars() {
            let s = c.to_string();
            let r = js.feed(&s, &mut out);
            if !out.is_empty() {
                let closed = format!("{out}{}", js.closers());
                assert!(serde_json::from_str::<serde_json::Value>(&closed).is_ok(), "{closed:?} from {text:?}");
            }
            match r {
                Feed::More => offset += c.len_utf8(),
                Feed::Done(n) => return (out, js.closers().to_string(), Feed::Done(offset + n)),
                Feed::Error(n) => return (out, js.closers().to_string(), Feed::Error(offset + n)),
            }
        }
        (out, js.closers().to_string(), Feed::More)
    }

    #[test]
    fn doc_table() {
        let released = |t: &str| {
            let (out, closers, _) = feed_chars(t);
            (out, closers)
        };
        let s = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(released("{"), s("{", "}"));
        assert_eq!(released("{\"city"), s("{", "}"));
        assert_eq!(released("{\"city\": \"Pa"), s("{\"city\": \"Pa", "\"}"));
        assert_eq!(released("{\"city\": \"Paris\", \"d"), s("{\"city\": \"Paris\"", "}"));
        assert_eq!(released("{\"n\": 12"), s("{\"n\": 12", "}"));
        assert_eq!(released("{\"n\": 1."), s("{\"n\": 1", "}"));
        assert_eq!(released("{\"ok\": tr"), s("{", "}"));
        assert_eq!(released("{\"a\": [1, {\"b\": [\"x"), s("{\"a\": [1, {\"b\": [\"x", "\"]}]}"));
    }

    #[test]
    fn whole_objects_round_trip() {
        for text in [
            "{}",
            "{ }",
            "{\"a\": 1}",
            "{\"a\": -0.5e+10, \"b\": [true, false, null, [], {}], \"c\": {\"d\": \"e\\\"\\\\\\u00e9\"}}",
            "{\"emoji\": \"😀\", \"cjk\": \"中文\"}",
            "{\"n\":0,\"m\":-1}",
        ] {
            let (out, closers, r) = feed_chars(text);
            assert_eq!(r, Feed::Done(text.len()), "{text}");
            assert_eq!(out, text);
            assert_eq!(closers, "");
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v, serde_json::from_str::<serde_json::Value>(text).unwrap());
        }
    }

    #[test]
    fn stops_at_the_object_end() {
        let mut js = JsonStream::new();
        let mut out = String::new();
        assert_eq!(js.feed("{\"a\": 1}\n}</tool_call>", &mut out), Feed::Done(8));
        assert_eq!(out, "{\"a\": 1}");
        // A number ended by the closing brace.
        let mut js = JsonStream::new();
        let mut out = String::new();
        assert_eq!(js.feed("{\"a\":10}x", &mut out), Feed::Done(8));
    }

    #[test]
    fn raw_control_characters_are_escaped() {
        let (out, _, r) = feed_chars("{\"code\": \"a\nb\tc\u{1}\"}");
        assert!(matches!(r, Feed::Done(_)));
        assert_eq!(out, "{\"code\": \"a\\nb\\tc\\u0001\"}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["code"], "a\nb\tc\u{1}");
    }

    #[test]
    fn errors() {
        for (text, at) in [
            ("[1]", 0),
            ("\"s\"", 0),
            ("{a: 1}", 1),
            ("{\"a\" 1}", 5),
            ("{\"a\": True}", 6),
            ("{\"a\": 01}", 7),
            ("{\"a\": 1,}", 8),
            ("{\"a\": \"\\x\"}", 8),
            ("{\"a\": [1 2]}", 9),
            ("{\"a\": 1]", 7),
            ("{\"a\": -}", 7),
        ] {
            assert_eq!(feed_chars(text).2, Feed::Error(at), "{text}");
        }
    }

    #[test]
    fn escapes_split_are_held() {
        let (out, closers, _) = feed_chars("{\"a\": \"x\\");
        assert_eq!((out.as_str(), closers.as_str()), ("{\"a\": \"x", "\"}"));
        let (out, _, _) = feed_chars("{\"a\": \"x\\u00");
        assert_eq!(out, "{\"a\": \"x");
        let (out, _, _) = feed_chars("{\"a\": \"x\\u00e9");
        assert_eq!(out, "{\"a\": \"x\\u00e9");
    }
}
