//! The hermes JSON call (Qwen3, Qwen2.5, NousResearch Hermes and the models that copied its template):
//!
//! ```text
//!   <tool_call>
//!   {"name": "get_weather", "arguments": {"city": "Paris"}}
//!   </tool_call>
//! ```
//!
//! Two paths:
//! - The form every such template teaches (`{"name": "NAME", "arguments": {` in that order, any
//!   whitespace; `"parameters"` accepted for `"arguments"`) commits at the arguments' `{`, and the
//!   arguments stream through `JsonStream` as the model writes them (a `</tool_call>` inside a string is
//!   just text to it).
//! - Anything else that opens with `{` (keys in another order, arguments encoded as a JSON string) waits
//!   for `</tool_call>` and is parsed whole. What does not parse is text.

use super::json_stream::{Feed, JsonStream};
use super::qwen3_coder::skip_to_close;
use super::{BodyEvent, CallBody, Step, ToolSpec, Tools, MAX_NAME_LEN, TOOL_CALL_CLOSE};
use crate::text::starts_with_tag;
use serde_json::Value as Json;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Just after `<tool_call>`: matching the canonical header.
    Header,
    /// Committed: the arguments object streams.
    Arguments,
    /// The arguments closed: `}` of the call object, then `</tool_call>`.
    Tail { outer_closed: bool },
    /// Not the canonical header: wait for `</tool_call>`, then parse the whole call. `searched`: bytes of
    /// the input already known to hold no `</tool_call>`.
    Whole { searched: usize },
    /// Malformed after committing: everything up to `</tool_call>` is dropped.
    SkipToClose,
}

/// Reads one hermes call.
pub struct HermesBody {
    tools: Tools,
    state: State,
    json: JsonStream,
    malformed: bool,
}

enum Halt {
    /// The input ends before the header could be matched.
    More,
    /// Not the canonical header.
    No,
}

/// A cursor over the header's tokens.
struct Cursor<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    fn ws(&mut self) {
        let rest = &self.s[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }

    fn lit(&mut self, t: &str) -> Result<(), Halt> {
        match starts_with_tag(&self.s[self.at..], t) {
            Some(true) => {
                self.at += t.len();
                Ok(())
            }
            None => Err(Halt::More),
            Some(false) => Err(Halt::No),
        }
    }

    /// One of several literals.
    fn lit_any(&mut self, ts: &[&str]) -> Result<(), Halt> {
        let mut more = false;
        for t in ts {
            match self.lit(t) {
                Ok(()) => return Ok(()),
                Err(Halt::More) => more = true,
                Err(Halt::No) => {}
            }
        }
        Err(if more { Halt::More } else { Halt::No })
    }

    /// A JSON string without escapes (a tool name).
    fn simple_string(&mut self) -> Result<&'a str, Halt> {
        self.lit("\"")?;
        let rest = &self.s[self.at..];
        for (i, c) in rest.char_indices() {
            if i > MAX_NAME_LEN || c == '\\' || (c as u32) < 0x20 {
                return Err(Halt::No);
            }
            if c == '"' {
                self.at += i + 1;
                return Ok(&rest[..i]);
            }
        }
        Err(Halt::More)
    }

    /// `{"name": "NAME", "arguments": ` up to the arguments' `{`: the name, with the cursor on the `{`.
    fn header(&mut self) -> Result<&'a str, Halt> {
        self.ws();
        self.lit("{")?;
        self.ws();
        self.lit("\"name\"")?;
        self.ws();
        self.lit(":")?;
        self.ws();
        let name = self.simple_string()?;
        self.ws();
        self.lit(",")?;
        self.ws();
        self.lit_any(&["\"arguments\"", "\"parameters\""])?;
        self.ws();
        self.lit(":")?;
        self.ws();
        match self.s[self.at..].chars().next() {
            None => Err(Halt::More),
            Some('{') => Ok(name),
            Some(_) => Err(Halt::No),
        }
    }
}

/// A whole call object parsed: `Ok(Some((name, arguments JSON)))`, `Ok(None)` if it is not a call, `Err`
/// if the JSON was cut short (the `</tool_call>` that ended it was inside a string).
fn parse_whole(text: &str, tools: &Tools) -> Result<Option<(String, String)>, ()> {
    let v: Json = match serde_json::from_str(text.trim()) {
        Ok(v) => v,
        Err(e) if e.is_eof() => return Err(()),
        Err(_) => return Ok(None),
    };
    let Some(obj) = v.as_object() else { return Ok(None) };
    let Some(name) = obj.get("name").and_then(Json::as_str).filter(|n| tools.accepts(n)) else { return Ok(None) };
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Json::Null) => Json::Object(Default::default()),
        Some(a @ Json::Object(_)) => a.clone(),
        Some(Json::String(s)) => match serde_json::from_str::<Json>(s) {
            Ok(a @ Json::Object(_)) => a,
            _ => return Ok(None),
        },
        Some(_) => return Ok(None),
    };
    Ok(Some((name.to_string(), args.to_string())))
}

impl HermesBody {
    fn step_header(&mut self, input: &str, out: &mut Vec<BodyEvent>) -> Step {
        let mut c = Cursor { s: input, at: 0 };
        match c.header() {
            Err(Halt::More) => Step::Wait,
            Err(Halt::No) => {
                if input.trim_start().starts_with('{') {
                    self.state = State::Whole { searched: 0 };
                    Step::Took(0)
                } else {
                    Step::NotACall
                }
            }
            Ok(name) => {
                if !self.tools.accepts(name) {
                    return Step::NotACall;
                }
                out.push(BodyEvent::Start(name.to_string()));
                self.json = JsonStream::new();
                self.malformed = false;
                self.state = State::Arguments;
                Step::Took(c.at)
            }
        }
    }

    fn step_arguments(&mut self, input: &str, out: &mut Vec<BodyEvent>) -> Step {
        if input.is_empty() {
            return Step::Wait;
        }
        let mut released = String::new();
        let step = match self.json.feed(input, &mut released) {
            Feed::More => Step::Took(input.len()),
            Feed::Done(n) => {
                self.state = State::Tail { outer_closed: false };
                Step::Took(n)
            }
            Feed::Error(n) => {
                released.push_str(self.json.closers());
                self.malformed = true;
                self.state = State::SkipToClose;
                Step::Took(n)
            }
        };
        out.push(BodyEvent::Args(released));
        step
    }

    fn step_tail(&mut self, input: &str, outer_closed: bool) -> Step {
        let rest = input.trim_start();
        let ws = input.len() - rest.len();
        if rest.is_empty() {
            return if ws > 0 { Step::Took(ws) } else { Step::Wait };
        }
        if !outer_closed {
            if rest.starts_with('}') {
                self.state = State::Tail { outer_closed: true };
                return Step::Took(ws + 1);
            }
        } else {
            match starts_with_tag(rest, TOOL_CALL_CLOSE) {
                Some(true) => return Step::End { took: ws + TOOL_CALL_CLOSE.len(), complete: !self.malformed },
                None => return Step::Wait,
                Some(false) => {}
            }
        }
        self.malformed = true;
        self.state = State::SkipToClose;
        Step::Took(ws)
    }

    fn step_whole(&mut self, input: &str, searched: usize, out: &mut Vec<BodyEvent>) -> Step {
        let mut from = searched;
        while let Some(rel) = input[from..].find(TOOL_CALL_CLOSE) {
            let i = from + rel;
            match parse_whole(&input[..i], &self.tools) {
                Ok(Some((name, args))) => {
                    out.push(BodyEvent::Start(name));
                    out.push(BodyEvent::Args(args));
                    return Step::End { took: i + TOOL_CALL_CLOSE.len(), complete: true };
                }
                Ok(None) => return Step::NotACall,
                Err(()) => from = i + 1,
            }
        }
        // Nothing before the last few bytes can start a `</tool_call>` any more.
        let mut s = input.len().saturating_sub(TOOL_CALL_CLOSE.len()).max(from);
        while !input.is_char_boundary(s) {
            s += 1;
        }
        self.state = State::Whole { searched: s };
        Step::Wait
    }
}

impl CallBody for HermesBody {
    fn new(tools: Vec<ToolSpec>) -> Self {
        HermesBody { tools: Tools(tools), state: State::Header, json: JsonStream::new(), malformed: false }
    }

    fn begin(&mut self) {
        self.state = State::Header;
    }

    fn step(&mut self, input: &str, _at_end: bool, out: &mut Vec<BodyEvent>) -> Step {
        match self.state {
            State::Header => self.step_header(input, out),
            State::Arguments => self.step_arguments(input, out),
            State::Tail { outer_closed } => self.step_tail(input, outer_closed),
            State::Whole { searched } => self.step_whole(input, searched, out),
            State::SkipToClose => skip_to_close(input, "", out),
        }
    }

    fn cut_off(&mut self, out: &mut Vec<BodyEvent>) {
        if self.state == State::Arguments {
            out.push(BodyEvent::Args(self.json.closers().to_string()));
        }
        self.state = State::Header;
    }
}
