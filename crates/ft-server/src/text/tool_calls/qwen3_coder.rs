//! The qwen3_coder XML call (Qwen3.5/3.6, Qwen3-Coder):
//!
//! ```text
//!   <tool_call>
//!   <function=NAME>          ◀ header: commits the call when NAME is one of the request's tools
//!   <parameter=ARG>
//!   VALUE                    ◀ one leading and one trailing newline are the template's, not the value's
//!   </parameter>
//!   ...
//!   </function>
//!   </tool_call>
//! ```
//!
//! Values are bare text, typed by the tool's schema (`schema.rs`). A plain string value streams out as
//! it comes (JSON-escaped); a typed one goes out whole when it ends.
//!
//! Where a value ends is the hard part: code arguments can contain `</parameter>` themselves. A
//! `</parameter>` ends the value only when what follows it (after whitespace) is `<parameter=`,
//! `</function>`, `</tool_call>` or the end of the output, so the parser waits to see that much. Two
//! slips models make are taken as ends too: a missing `</parameter>` before `</function>` + `</tool_call>`,
//! and before `\n<parameter=NAME>` where NAME is another declared, not yet given parameter of the tool.
//! Anything else between the tags marks the call malformed (skipped, `complete: false`).

use super::schema::{self, ParamType};
use super::{BodyEvent, CallBody, Step, ToolSpec, Tools, MAX_NAME_LEN, TOOL_CALL_CLOSE};
use crate::text::{partial_tag_suffix, starts_with_tag};
use serde_json::{Map, Value as Json};

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

#[derive(Clone, Debug)]
enum State {
    /// Just after `<tool_call>`: whitespace, then `<function=NAME>`.
    Header,
    /// Between parameters: whitespace, then `<parameter=`, `</function>` (or `</tool_call>`).
    Params,
    /// Inside a value. `at_start`: its leading newline is not yet checked.
    Value { name: String, ty: ParamType, streams: bool, at_start: bool },
    /// After `</function>`: whitespace, then `</tool_call>`.
    AfterFunction,
    /// Malformed: everything up to `</tool_call>` is dropped.
    SkipToClose,
}

/// Reads one qwen3_coder call.
pub struct Qwen3CoderBody {
    tools: Tools,
    state: State,
    /// The called tool's declared parameters (`None`: no schema).
    props: Option<Map<String, Json>>,
    /// A member is in the arguments object (the next needs a comma).
    wrote_member: bool,
    /// Parameters given so far.
    seen: Vec<String>,
    /// The current typed value's text (plain strings stream instead).
    value: String,
    malformed: bool,
}

/// How a `<` inside a value reads.
enum Verdict {
    /// It ends the value; the call goes on after this many bytes of the input.
    End(usize),
    /// Cannot tell yet.
    Undecided,
    /// Part of the value.
    Text,
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// `s` JSON-escaped without the quotes (escaping is per character, so pieces concatenate).
fn json_fragment(s: &str) -> String {
    let quoted = json_str(s);
    quoted[1..quoted.len() - 1].to_string()
}

/// Byte length of the first character.
fn first_char_len(s: &str) -> usize {
    s.chars().next().map_or(0, char::len_utf8)
}

impl Qwen3CoderBody {
    fn member_prefix(&mut self, name: &str) -> String {
        let comma = if self.wrote_member { ", " } else { "" };
        self.wrote_member = true;
        format!("{comma}{}: ", json_str(name))
    }

    /// The rest is not a tag that belongs here: drop it up to the next `<`.
    fn garbage(&mut self, ws: usize, rest: &str) -> Step {
        self.malformed = true;
        let first = first_char_len(rest);
        let skip = rest[first..].find('<').map_or(rest.len(), |p| p + first);
        Step::Took(ws + skip)
    }

    fn step_header(&mut self, input: &str, out: &mut Vec<BodyEvent>) -> Step {
        let rest = input.trim_start();
        let ws = input.len() - rest.len();
        if rest.is_empty() {
            return Step::Wait;
        }
        match starts_with_tag(rest, FUNCTION_OPEN) {
            None => Step::Wait,
            Some(false) => Step::NotACall,
            Some(true) => {
                let after = &rest[FUNCTION_OPEN.len()..];
                let Some(gt) = after.find('>') else {
                    let hopeless = after.len() > MAX_NAME_LEN || after.contains(['<', '\n']);
                    return if hopeless { Step::NotACall } else { Step::Wait };
                };
                let name = &after[..gt];
                if !self.tools.accepts(name) {
                    return Step::NotACall;
                }
                self.props = self.tools.find(name).and_then(|t| schema::properties(&t.parameters)).cloned();
                self.wrote_member = false;
                self.seen.clear();
                self.malformed = false;
                out.push(BodyEvent::Start(name.to_string()));
                out.push(BodyEvent::Args("{".into()));
                self.state = State::Params;
                Step::Took(ws + FUNCTION_OPEN.len() + gt + 1)
            }
        }
    }

    fn step_params(&mut self, input: &str, out: &mut Vec<BodyEvent>) -> Step {
        let rest = input.trim_start();
        let ws = input.len() - rest.len();
        if rest.is_empty() {
            return if ws > 0 { Step::Took(ws) } else { Step::Wait };
        }
        let [param, func_close, call_close] =
            [PARAM_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE].map(|t| starts_with_tag(rest, t));
        if param == Some(true) {
            let after = &rest[PARAM_OPEN.len()..];
            let Some(gt) = after.find('>') else {
                let hopeless = after.len() > MAX_NAME_LEN || after.contains(['<', '\n']);
                return if hopeless { self.garbage(ws, rest) } else { Step::Wait };
            };
            let name = &after[..gt];
            if !super::valid_name(name) {
                return self.garbage(ws, rest);
            }
            let ty = ParamType::of(self.props.as_ref().and_then(|p| p.get(name)));
            let streams = ty.is_plain_string();
            if streams {
                let prefix = self.member_prefix(name);
                out.push(BodyEvent::Args(format!("{prefix}\"")));
            }
            self.value.clear();
            self.state = State::Value { name: name.to_string(), ty, streams, at_start: true };
            Step::Took(ws + PARAM_OPEN.len() + gt + 1)
        } else if func_close == Some(true) {
            self.state = State::AfterFunction;
            Step::Took(ws + FUNCTION_CLOSE.len())
        } else if call_close == Some(true) {
            // `</function>` left out: the call is still whole.
            out.push(BodyEvent::Args("}".into()));
            Step::End { took: ws + TOOL_CALL_CLOSE.len(), complete: !self.malformed }
        } else if param.is_none() || func_close.is_none() || call_close.is_none() {
            if ws > 0 {
                Step::Took(ws)
            } else {
                Step::Wait
            }
        } else {
            self.garbage(ws, rest)
        }
    }

    /// Whether `name`, met as `\n<parameter=name>` inside a value, is the next parameter (so the value's
    /// `</parameter>` was left out): declared, not given yet, not the current one.
    fn is_next_param(&self, name: &str, current: &str) -> bool {
        name != current
            && !self.seen.iter().any(|s| s == name)
            && self.props.as_ref().is_some_and(|p| p.contains_key(name))
    }

    fn classify(&self, input: &str, p: usize, at_end: bool, current: &str) -> Verdict {
        let tail = &input[p..];
        if let Some(after) = tail.strip_prefix(PARAM_CLOSE) {
            let after = after.trim_start();
            if after.is_empty() {
                return if at_end { Verdict::End(p + PARAM_CLOSE.len()) } else { Verdict::Undecided };
            }
            let next = [PARAM_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE].map(|t| starts_with_tag(after, t));
            return if next.contains(&Some(true)) || (at_end && next.contains(&None)) {
                Verdict::End(p + PARAM_CLOSE.len())
            } else if next.contains(&None) {
                Verdict::Undecided
            } else {
                Verdict::Text
            };
        }
        if let Some(after) = tail.strip_prefix(FUNCTION_CLOSE) {
            let after = after.trim_start();
            return match (after.is_empty(), starts_with_tag(after, TOOL_CALL_CLOSE)) {
                (true, _) | (false, None) if at_end => Verdict::End(p),
                (true, _) | (false, None) => Verdict::Undecided,
                (false, Some(true)) => Verdict::End(p),
                (false, Some(false)) => Verdict::Text,
            };
        }
        if let Some(after) = tail.strip_prefix(PARAM_OPEN) {
            if !input[..p].ends_with('\n') || self.props.is_none() {
                return Verdict::Text;
            }
            return match after.find('>') {
                Some(gt) if self.is_next_param(&after[..gt], current) => Verdict::End(p),
                Some(_) => Verdict::Text,
                None if at_end || after.len() > MAX_NAME_LEN || after.contains(['<', '\n']) => Verdict::Text,
                None => Verdict::Undecided,
            };
        }
        if !at_end && [PARAM_CLOSE, FUNCTION_CLOSE, PARAM_OPEN].iter().any(|t| t.starts_with(tail)) {
            return Verdict::Undecided;
        }
        Verdict::Text
    }

    fn step_value(&mut self, input: &str, at_end: bool, out: &mut Vec<BodyEvent>) -> Step {
        let State::Value { name, at_start, .. } = &mut self.state else { unreachable!() };
        if *at_start {
            if input.is_empty() && !at_end {
                return Step::Wait;
            }
            *at_start = false;
            return Step::Took(if input.starts_with('\n') { 1 } else { 0 });
        }
        let current = name.clone();
        // The first `<` that ends the value, or where undecided text begins.
        let mut from = 0;
        let mut end = None;
        let mut safe = input.len();
        while let Some(rel) = input[from..].find('<') {
            let p = from + rel;
            match self.classify(input, p, at_end, &current) {
                Verdict::End(took) => {
                    end = Some((p, took));
                    safe = p;
                    break;
                }
                Verdict::Undecided => {
                    safe = p;
                    break;
                }
                Verdict::Text => from = p + 1,
            }
        }
        match end {
            Some((p, took)) => {
                let text = input[..p].strip_suffix('\n').unwrap_or(&input[..p]);
                self.value_text(text, out);
                self.end_value(out);
                Step::Took(took)
            }
            None if at_end => {
                // Cut off inside the value: it ends with the output.
                let text = input.strip_suffix('\n').unwrap_or(input);
                self.value_text(text, out);
                self.end_value(out);
                Step::Took(input.len())
            }
            None => {
                // A trailing newline may be the template's (dropped before the closing tag): held.
                let s = if input[..safe].ends_with('\n') { safe - 1 } else { safe };
                if s == 0 {
                    return Step::Wait;
                }
                self.value_text(&input[..s], out);
                Step::Took(s)
            }
        }
    }

    fn value_text(&mut self, text: &str, out: &mut Vec<BodyEvent>) {
        if text.is_empty() {
            return;
        }
        match &self.state {
            State::Value { streams: true, .. } => out.push(BodyEvent::Args(json_fragment(text))),
            _ => self.value.push_str(text),
        }
    }

    fn end_value(&mut self, out: &mut Vec<BodyEvent>) {
        let State::Value { name, ty, streams, .. } = std::mem::replace(&mut self.state, State::Params) else { return };
        if streams {
            out.push(BodyEvent::Args("\"".into()));
        } else {
            let v = schema::convert(&self.value, &ty);
            let prefix = self.member_prefix(&name);
            out.push(BodyEvent::Args(format!(
                "{prefix}{}",
                serde_json::to_string(&v).unwrap_or_else(|_| "null".into())
            )));
        }
        self.seen.push(name);
    }

    fn step_after_function(&mut self, input: &str, out: &mut Vec<BodyEvent>) -> Step {
        let rest = input.trim_start();
        let ws = input.len() - rest.len();
        if rest.is_empty() {
            return if ws > 0 { Step::Took(ws) } else { Step::Wait };
        }
        match starts_with_tag(rest, TOOL_CALL_CLOSE) {
            Some(true) => {
                out.push(BodyEvent::Args("}".into()));
                Step::End { took: ws + TOOL_CALL_CLOSE.len(), complete: !self.malformed }
            }
            None => Step::Wait,
            Some(false) => {
                self.malformed = true;
                self.state = State::SkipToClose;
                Step::Took(ws)
            }
        }
    }
}

/// Drops input up to `</tool_call>` (a malformed call's rest); its arguments are closed with `close`.
pub(crate) fn skip_to_close(input: &str, close: &str, out: &mut Vec<BodyEvent>) -> Step {
    match input.find(TOOL_CALL_CLOSE) {
        Some(i) => {
            if !close.is_empty() {
                out.push(BodyEvent::Args(close.to_string()));
            }
            Step::End { took: i + TOOL_CALL_CLOSE.len(), complete: false }
        }
        None => {
            let n = input.len() - partial_tag_suffix(input, TOOL_CALL_CLOSE);
            if n > 0 {
                Step::Took(n)
            } else {
                Step::Wait
            }
        }
    }
}

impl CallBody for Qwen3CoderBody {
    fn new(tools: Vec<ToolSpec>) -> Self {
        Qwen3CoderBody {
            tools: Tools(tools),
            state: State::Header,
            props: None,
            wrote_member: false,
            seen: Vec::new(),
            value: String::new(),
            malformed: false,
        }
    }

    fn begin(&mut self) {
        self.state = State::Header;
    }

    fn step(&mut self, input: &str, at_end: bool, out: &mut Vec<BodyEvent>) -> Step {
        match self.state {
            State::Header => self.step_header(input, out),
            State::Params => self.step_params(input, out),
            State::Value { .. } => self.step_value(input, at_end, out),
            State::AfterFunction => self.step_after_function(input, out),
            State::SkipToClose => skip_to_close(input, "}", out),
        }
    }

    fn cut_off(&mut self, out: &mut Vec<BodyEvent>) {
        if matches!(self.state, State::Value { .. }) {
            self.end_value(out);
        }
        out.push(BodyEvent::Args("}".into()));
        self.state = State::Header;
    }
}
