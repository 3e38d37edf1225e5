//! Tool calls parsed out of the model's content as it streams (`--tool-call-parser`).
//!
//! Two formats, both opened by `<tool_call>` and closed by `</tool_call>`:
//!
//! ```text
//!   qwen3_coder (Qwen3.5/3.6, Qwen3-Coder)        hermes (Qwen3, Qwen2.5, hermes-style models)
//!   <tool_call>                                   <tool_call>
//!   <function=get_weather>                        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
//!   <parameter=city>                              </tool_call>
//!   Paris
//!   </parameter>
//!   <parameter=days>
//!   3
//!   </parameter>
//!   </function>
//!   </tool_call>
//! ```
//!
//! Both come out as the same events: [`ToolEvent::CallStart`] (index, id, name), [`ToolEvent::CallArguments`]
//! (JSON text deltas whose concatenation is the call's `arguments`, `{"city": "Paris", "days": 3}`),
//! [`ToolEvent::CallEnd`]; everything else is [`ToolEvent::Text`].
//!
//! The layers, each a small piece:
//!
//! ```text
//!   deltas ─▶ Driver: finds <tool_call>, holds back a tag split across deltas, hands the call's text
//!             │       to the format's CallBody, turns "not a call after all" back into text
//!             ▼
//!   CallBody (qwen3_coder / hermes): reads one call; says when it is committed (the header names a tool),
//!             │       emits the name and the arguments JSON as they are parsed, and where the call ends
//!             ▼
//!   ToolParser: ids and indices; CallCommit (stream a call from its header, or only once it closed);
//!             parallel_tool_calls; whitespace around calls dropped; adjacent deltas merged
//! ```
//!
//! Guarantees, all tested with random splits of the same output: the events are the same whatever the
//! split (once adjacent text deltas, and adjacent argument deltas, are joined); text that is not a
//! well-formed call is text, verbatim (a `<tool_call>` mentioned in prose, a call naming a tool the request
//! does not have, and under [`CallCommit::OnClose`] a call cut off by the end of the output or malformed);
//! only whitespace touching a call is dropped; the arguments of every call are a valid JSON object, also
//! for a call cut off under [`CallCommit::OnHeader`], which is closed with what was parsed and ends with
//! `complete: false`. Feed it content only (after the reasoning parser): a call inside `<think>` is not run.

mod hermes;
mod json_stream;
mod qwen3_coder;
mod schema;

use rand::distributions::Alphanumeric;
use rand::Rng;
use serde_json::Value as Json;

pub use hermes::HermesBody;
pub use qwen3_coder::Qwen3CoderBody;

pub(crate) const TOOL_CALL_OPEN: &str = "<tool_call>";
pub(crate) const TOOL_CALL_CLOSE: &str = "</tool_call>";
/// Longest function or parameter name accepted in a tag (longer: not a call).
pub(crate) const MAX_NAME_LEN: usize = 256;

/// One thing a parser found, in output order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Plain content.
    Text(String),
    /// A call begins. `index` counts calls in this output from 0 (OpenAI's `tool_calls[].index`).
    CallStart { index: usize, id: String, name: String },
    /// More of the call's arguments JSON (OpenAI's `function.arguments` delta, Anthropic's
    /// `input_json_delta.partial_json`).
    CallArguments { index: usize, delta: String },
    /// The call is over. `complete`: it closed well-formed; false only under [`CallCommit::OnHeader`] for
    /// a call cut off by the end of the output or malformed after its header (its arguments are still a
    /// valid JSON object: what was parsed).
    CallEnd { index: usize, complete: bool },
}

/// When a call's events start to come out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CallCommit {
    /// As soon as the header names a known tool; the arguments stream as they are parsed. A call cut off
    /// by the end of the output is closed with what was parsed (`CallEnd { complete: false }`): what
    /// OpenAI does under `max_tokens`. For streamed responses.
    #[default]
    OnHeader,
    /// Only once the call closed well-formed, all at once; a call cut off or malformed is text. For whole
    /// responses, and streams that prefer strictness to latency.
    OnClose,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolParserOptions {
    pub commit: CallCommit,
    /// `parallel_tool_calls: false`: calls after the first are dropped (not turned into text).
    pub parallel_tool_calls: bool,
}

impl Default for ToolParserOptions {
    fn default() -> Self {
        ToolParserOptions { commit: CallCommit::OnHeader, parallel_tool_calls: true }
    }
}

/// A tool as the parser needs it: the name calls must use, and the JSON schema of its arguments (for the
/// XML format's value types).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    /// The `parameters` JSON schema (`Json::Null` when the tool has none).
    pub parameters: Json,
}

impl ToolSpec {
    /// From OpenAI `tools` (`[{"type": "function", "function": {"name", "parameters"?}}]`, as validated
    /// by `protocol::check_tool`; entries without a name are skipped). Anthropic tools go through
    /// `MessagesRequest::openai_tools` first.
    pub fn from_openai_tools(tools: &[Json]) -> Vec<ToolSpec> {
        tools
            .iter()
            .filter_map(|t| {
                let f = t.get("function")?;
                Some(ToolSpec {
                    name: f.get("name")?.as_str()?.to_string(),
                    parameters: f.get("parameters").cloned().unwrap_or(Json::Null),
                })
            })
            .collect()
    }
}

/// Finds tool calls in one request's content, incrementally.
pub trait ToolCallParser: Send {
    /// One content delta (split anywhere); what it completes.
    fn push(&mut self, delta: &str) -> Vec<ToolEvent>;
    /// The output ended: everything held back comes out (an unclosed `<tool_call>` as text, or under
    /// [`CallCommit::OnHeader`] a committed call closed).
    fn finish(&mut self) -> Vec<ToolEvent>;
    /// Calls started so far (routes answer `finish_reason: "tool_calls"` / `stop_reason: "tool_use"` when
    /// the output ended normally with at least one).
    fn calls(&self) -> usize;
}

/// A tool-call format, by its `--tool-call-parser` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<function=NAME><parameter=ARG>VALUE</parameter></function>` inside `<tool_call>`.
    Qwen3Coder,
    /// `{"name": ..., "arguments": {...}}` inside `<tool_call>`.
    Hermes,
}

impl ToolCallFormat {
    /// Every name `--tool-call-parser` takes (`auto` picks from the model, `off` parses no calls).
    pub const NAMES: &'static [&'static str] = &["qwen3_coder", "qwen", "qwen25", "hermes", "auto", "off"];

    /// A named format; `auto` and `off` are not one (see [`ToolCallFormat::resolve`]).
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "qwen3_coder" => Ok(ToolCallFormat::Qwen3Coder),
            "qwen" | "qwen25" | "hermes" => Ok(ToolCallFormat::Hermes),
            _ => Err(format!("unknown --tool-call-parser {name:?} (valid: {})", Self::NAMES.join(", "))),
        }
    }

    /// What `--tool-call-parser` resolves to for this model. A name is taken as is (`off`: none); `auto` (and
    /// no flag) looks at the chat template first (it says how the model was taught to call: `<function=` and
    /// `<parameter=` mean qwen3_coder, `<tool_call>` alone hermes), then the architecture (HF class name or
    /// model type; Qwen3.5/3.6: qwen3_coder; Qwen2/2.5/3/3-MoE/3-Next: hermes); `None` when neither tells (no
    /// parsing: output stays text).
    pub fn resolve(
        flag: Option<&str>,
        architecture: &str,
        chat_template: Option<&str>,
    ) -> Result<Option<Self>, String> {
        match flag {
            Some("off") => return Ok(None),
            Some(name) if name != "auto" => return Self::from_name(name).map(Some),
            _ => {}
        }
        if let Some(t) = chat_template {
            if t.contains("<function=") && t.contains("<parameter=") {
                return Ok(Some(ToolCallFormat::Qwen3Coder));
            }
            if t.contains(TOOL_CALL_OPEN) {
                return Ok(Some(ToolCallFormat::Hermes));
            }
        }
        let family = super::model_family(architecture);
        Ok(if family.starts_with("qwen35") || family.starts_with("qwen36") {
            Some(ToolCallFormat::Qwen3Coder)
        } else if family.starts_with("qwen2") || family.starts_with("qwen3") {
            Some(ToolCallFormat::Hermes)
        } else {
            None
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            ToolCallFormat::Qwen3Coder => "qwen3_coder",
            ToolCallFormat::Hermes => "hermes",
        }
    }

    /// A parser for one request's output.
    pub fn parser(&self, tools: Vec<ToolSpec>, options: ToolParserOptions) -> Box<dyn ToolCallParser> {
        match self {
            ToolCallFormat::Qwen3Coder => Box::new(Qwen3CoderParser::new(tools, options)),
            ToolCallFormat::Hermes => Box::new(HermesParser::new(tools, options)),
        }
    }
}

/// `call_` and 24 random alphanumerics (the shape OpenAI's ids have).
pub fn new_call_id() -> String {
    let suffix: String = rand::thread_rng().sample_iter(&Alphanumeric).take(24).map(char::from).collect();
    format!("call_{suffix}")
}

/// One call, whole (non-streaming responses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub id: String,
    pub name: String,
    /// The arguments JSON object, as text.
    pub arguments: String,
    pub complete: bool,
}

/// A whole output after parsing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    pub content: String,
    pub calls: Vec<ParsedToolCall>,
}

impl ParsedOutput {
    /// Folds events in (streams can keep one of these to know the final message).
    pub fn apply(&mut self, event: &ToolEvent) {
        match event {
            ToolEvent::Text(t) => self.content.push_str(t),
            ToolEvent::CallStart { id, name, .. } => self.calls.push(ParsedToolCall {
                id: id.clone(),
                name: name.clone(),
                arguments: String::new(),
                complete: false,
            }),
            ToolEvent::CallArguments { index, delta } => {
                if let Some(c) = self.calls.get_mut(*index) {
                    c.arguments.push_str(delta);
                }
            }
            ToolEvent::CallEnd { index, complete } => {
                if let Some(c) = self.calls.get_mut(*index) {
                    c.complete = *complete;
                }
            }
        }
    }

    /// Parses a whole output.
    pub fn parse(parser: &mut dyn ToolCallParser, text: &str) -> ParsedOutput {
        let mut out = ParsedOutput::default();
        for e in parser.push(text).iter().chain(parser.finish().iter()) {
            out.apply(e);
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------------------
// The format-specific half.

// (Public only because `ToolParser<B>` is; routes use `ToolCallFormat::parser` and the trait above.)

/// What a [`CallBody`] emits while it reads a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BodyEvent {
    /// The call is committed: it names this tool.
    Start(String),
    /// More arguments JSON.
    Args(String),
}

/// What a [`CallBody`] made of the input it was shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Took this many bytes (0 allowed when its state moved on); call again.
    Took(usize),
    /// Cannot go on without more input (nothing taken).
    Wait,
    /// Not a call after all (only before `Start`): the `<tool_call>` tag is text.
    NotACall,
    /// The call ended after this many bytes (its `</tool_call>` included). `complete`: well-formed.
    End { took: usize, complete: bool },
}

/// Reads what follows one `<tool_call>` tag.
pub trait CallBody: Send {
    fn new(tools: Vec<ToolSpec>) -> Self
    where
        Self: Sized;
    /// A new call begins (its `<tool_call>` tag is consumed).
    fn begin(&mut self);
    /// Looks at `input` (what follows what was taken so far). `at_end`: no more input will come, so
    /// everything decidable must be decided (a closing tag at the very end counts as closing).
    fn step(&mut self, input: &str, at_end: bool, out: &mut Vec<BodyEvent>) -> Step;
    /// The output ended inside a committed call: emit what closes its arguments JSON.
    fn cut_off(&mut self, out: &mut Vec<BodyEvent>);
}

/// The known tools, looked up by name.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tools(Vec<ToolSpec>);

impl Tools {
    pub fn find(&self, name: &str) -> Option<&ToolSpec> {
        self.0.iter().find(|t| t.name == name)
    }

    /// Whether a call may name this tool: any plausible name when the request declared none.
    pub fn accepts(&self, name: &str) -> bool {
        valid_name(name) && (self.0.is_empty() || self.find(name).is_some())
    }
}

/// A name as models write it in tags and JSON: no whitespace, quotes, braces or angle brackets.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && !name.chars().any(|c| c.is_whitespace() || "{}<>\"'`=".contains(c))
}

// ---------------------------------------------------------------------------------------------------------
// The driver: plain text vs. inside a call.

#[derive(Clone, Debug, PartialEq, Eq)]
enum DriverEvent {
    Text(String),
    Start(String),
    Args(String),
    /// `raw`: the call's text from its `<tool_call>` on (what it becomes if it is turned back into text).
    End {
        complete: bool,
        raw: String,
    },
}

struct Driver<B: CallBody> {
    body: B,
    /// Input not yet taken.
    buf: String,
    in_call: bool,
    /// The body emitted `Start` for the current call.
    committed: bool,
    /// The current call's text taken so far, from its `<tool_call>`.
    raw: String,
}

impl<B: CallBody> Driver<B> {
    /// Runs over `buf`: text until a `<tool_call>`, then the body until the call ends, again and again, until
    /// more input is needed (or, `at_end`, everything is out).
    fn run(&mut self, at_end: bool, out: &mut Vec<DriverEvent>) {
        let mut body_out = Vec::new();
        // Bodies always make progress; a bug that stops doing so must not hang the engine's stream.
        let mut idle_steps = 0;
        loop {
            if !self.in_call {
                if self.scan_text(at_end, out) {
                    continue;
                }
                return;
            }
            let step = self.body.step(&self.buf, at_end, &mut body_out);
            self.forward(&mut body_out, out);
            idle_steps = if step == Step::Took(0) { idle_steps + 1 } else { 0 };
            if idle_steps > 16 {
                debug_assert!(false, "tool-call body made no progress");
                return;
            }
            if !self.apply(step, at_end, &mut body_out, out) {
                return;
            }
        }
    }

    /// Outside a call: the text before a `<tool_call>` out and the call begun (true), or the text out up to a
    /// possible tag split across deltas (false: wait for more).
    fn scan_text(&mut self, at_end: bool, out: &mut Vec<DriverEvent>) -> bool {
        if let Some(i) = self.buf.find(TOOL_CALL_OPEN) {
            out.push(DriverEvent::Text(self.buf[..i].to_string()));
            self.buf.drain(..i + TOOL_CALL_OPEN.len());
            self.raw = TOOL_CALL_OPEN.to_string();
            self.in_call = true;
            self.committed = false;
            self.body.begin();
            return true;
        }
        let keep = if at_end { 0 } else { super::partial_tag_suffix(&self.buf, TOOL_CALL_OPEN) };
        let text: String = self.buf.drain(..self.buf.len() - keep).collect();
        out.push(DriverEvent::Text(text));
        false
    }

    /// The body's events out; a `Start` commits the call.
    fn forward(&mut self, body_out: &mut Vec<BodyEvent>, out: &mut Vec<DriverEvent>) {
        for e in body_out.drain(..) {
            out.push(match e {
                BodyEvent::Start(name) => {
                    self.committed = true;
                    DriverEvent::Start(name)
                }
                BodyEvent::Args(a) => DriverEvent::Args(a),
            });
        }
    }

    /// Acts on what the body made of the input; false when it must wait for more.
    fn apply(&mut self, step: Step, at_end: bool, body_out: &mut Vec<BodyEvent>, out: &mut Vec<DriverEvent>) -> bool {
        match step {
            Step::Took(n) => self.take_raw(n),
            Step::End { took, complete } => {
                self.take_raw(took);
                self.end_call(complete, out);
            }
            Step::NotACall => self.not_a_call(out),
            Step::Wait if !at_end => return false,
            Step::Wait if self.committed => {
                // Cut off by the end of the output.
                self.body.cut_off(body_out);
                self.forward(body_out, out);
                let rest = self.buf.len();
                self.take_raw(rest);
                self.end_call(false, out);
            }
            Step::Wait => self.not_a_call(out),
        }
        true
    }

    /// The first `n` bytes of `buf` are the call's.
    fn take_raw(&mut self, n: usize) {
        self.raw.push_str(&self.buf[..n]);
        self.buf.drain(..n);
    }

    fn end_call(&mut self, complete: bool, out: &mut Vec<DriverEvent>) {
        self.in_call = false;
        out.push(DriverEvent::End { complete, raw: std::mem::take(&mut self.raw) });
    }

    /// The tag is text; what followed it is scanned again (it may hold a real call).
    fn not_a_call(&mut self, out: &mut Vec<DriverEvent>) {
        debug_assert!(!self.committed, "a committed call cannot become text");
        out.push(DriverEvent::Text(TOOL_CALL_OPEN.to_string()));
        let mut rest = self.raw.split_off(TOOL_CALL_OPEN.len());
        rest.push_str(&self.buf);
        self.buf = rest;
        self.raw.clear();
        self.in_call = false;
    }
}

// ---------------------------------------------------------------------------------------------------------
// The public parser: ids, indices, commit policy, parallel calls, whitespace.

/// A [`ToolCallParser`] for one format.
pub struct ToolParser<B: CallBody> {
    driver: Driver<B>,
    options: ToolParserOptions,
    /// Calls given out (their indices are 0..calls).
    calls: usize,
    /// The call being read: its id, its index, whether it is dropped (parallel calls off).
    current: Option<(String, usize, bool)>,
    /// Under `OnClose`: the current call's name and arguments so far.
    held_name: String,
    held_args: String,
    /// Trailing whitespace of the text so far (dropped if a call follows).
    pending_ws: String,
    /// A call just ended: leading whitespace of the next text is dropped.
    after_call: bool,
}

pub type Qwen3CoderParser = ToolParser<Qwen3CoderBody>;
pub type HermesParser = ToolParser<HermesBody>;

impl<B: CallBody> ToolParser<B> {
    pub fn new(tools: Vec<ToolSpec>, options: ToolParserOptions) -> Self {
        ToolParser {
            driver: Driver {
                body: B::new(tools),
                buf: String::new(),
                in_call: false,
                committed: false,
                raw: String::new(),
            },
            options,
            calls: 0,
            current: None,
            held_name: String::new(),
            held_args: String::new(),
            pending_ws: String::new(),
            after_call: false,
        }
    }

    fn run(&mut self, delta: &str, at_end: bool) -> Vec<ToolEvent> {
        self.driver.buf.push_str(delta);
        let mut raw = Vec::new();
        self.driver.run(at_end, &mut raw);
        let mut out = Vec::new();
        for e in raw {
            self.handle(e, &mut out);
        }
        if at_end && !self.pending_ws.is_empty() {
            out.push(ToolEvent::Text(std::mem::take(&mut self.pending_ws)));
        }
        merge(out)
    }

    fn handle(&mut self, e: DriverEvent, out: &mut Vec<ToolEvent>) {
        let on_close = self.options.commit == CallCommit::OnClose;
        match e {
            DriverEvent::Text(t) => self.text(&t, out),
            DriverEvent::Start(name) => {
                let dropped = !self.options.parallel_tool_calls && self.calls > 0;
                let id = new_call_id();
                let index = self.calls;
                if on_close {
                    self.held_name = name;
                    self.held_args.clear();
                } else if !dropped {
                    self.pending_ws.clear();
                    out.push(ToolEvent::CallStart { index, id: id.clone(), name });
                    self.calls += 1;
                }
                self.current = Some((id, index, dropped));
            }
            DriverEvent::Args(a) => match &self.current {
                Some((_, _, true)) | None => {}
                Some(_) if on_close => self.held_args.push_str(&a),
                Some((_, index, false)) => out.push(ToolEvent::CallArguments { index: *index, delta: a }),
            },
            DriverEvent::End { complete, raw } => {
                let current = self.current.take();
                let dropped = matches!(current, Some((_, _, true)));
                if on_close && !complete && !dropped {
                    return self.text(&raw, out);
                }
                self.pending_ws.clear();
                self.after_call = true;
                match current {
                    Some((_, _, true)) | None => {}
                    Some((id, index, false)) if on_close => {
                        out.push(ToolEvent::CallStart { index, id, name: std::mem::take(&mut self.held_name) });
                        out.push(ToolEvent::CallArguments { index, delta: std::mem::take(&mut self.held_args) });
                        out.push(ToolEvent::CallEnd { index, complete });
                        self.calls += 1;
                    }
                    Some((_, index, false)) => out.push(ToolEvent::CallEnd { index, complete }),
                }
            }
        }
    }

    /// Text out, with the whitespace between text and calls dropped (a call's neighbours are not content).
    fn text(&mut self, t: &str, out: &mut Vec<ToolEvent>) {
        let mut t = t;
        if self.after_call {
            t = t.trim_start();
            if t.is_empty() {
                return;
            }
            self.after_call = false;
        }
        let body = t.trim_end();
        if body.is_empty() {
            self.pending_ws.push_str(t);
            return;
        }
        let mut s = std::mem::take(&mut self.pending_ws);
        s.push_str(body);
        out.push(ToolEvent::Text(s));
        self.pending_ws = t[body.len()..].to_string();
    }
}

impl<B: CallBody> ToolCallParser for ToolParser<B> {
    fn push(&mut self, delta: &str) -> Vec<ToolEvent> {
        self.run(delta, false)
    }

    fn finish(&mut self) -> Vec<ToolEvent> {
        self.run("", true)
    }

    fn calls(&self) -> usize {
        self.calls
    }
}

/// Adjacent text and adjacent argument deltas of one call merged; empty ones dropped.
fn merge(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut out: Vec<ToolEvent> = Vec::with_capacity(events.len());
    for e in events {
        match (&e, out.last_mut()) {
            (ToolEvent::Text(t), _) if t.is_empty() => {}
            (ToolEvent::CallArguments { delta, .. }, _) if delta.is_empty() => {}
            (ToolEvent::Text(t), Some(ToolEvent::Text(prev))) => prev.push_str(t),
            (ToolEvent::CallArguments { index, delta }, Some(ToolEvent::CallArguments { index: pi, delta: prev }))
                if index == pi =>
            {
                prev.push_str(delta)
            }
            _ => out.push(e),
        }
    }
    out
}

#[cfg(test)]
mod tests;
