//! A request's output text as what the chat APIs send: reasoning, content text and tool calls.
//!
//! ```text
//!   TextStream ─ Piece::Text / Finish ─▶ OutputParser: ReasoningParser ─┬─ Output::Reasoning
//!   (detokenizer, stop strings)                                         └─ content ─▶ ToolCallParser ─┬─ Output::Text
//!                                                                                                      └─ Output::Call*
//!   ─▶ sse(): every StreamFormat (OpenAI chat, Anthropic messages)    collect(): a whole Message
//! ```
//!
//! Every route shares this one layer: `sse.rs` feeds the parser and hands the [`Output`] events to the API's
//! `StreamFormat`, `collect()` folds them into a [`Message`]. Completions keep raw text ([`OutputSpec::raw`]).
//!
//! What a request gets is decided once, when it is prepared ([`OutputSpec::for_chat`]): the reasoning parser the
//! server resolved (`--reasoning-parser`), told whether the rendered prompt left a `<think>` block open; the
//! tool-call parser (`--tool-call-parser`) when the request has tools and `tool_choice` is not `none`.
//!
//! `tool_choice` `required` and named cannot be forced without constrained decoding. Instead the call is
//! started for the model: the prompt ends with the call's opening (`<tool_call>\n`; with a named tool also its
//! header, `{"name": "NAME", "arguments": ` or `<function=NAME>\n`, and the template sees only that tool), and
//! the tool-call parser reads that opening before the output. A model that still writes no well-formed call
//! answers with text (`finish_reason: "stop"`); under a named choice a call to another tool is text too.

use crate::text::reasoning::{prompt_opens_reasoning, ReasoningFormat, ReasoningParser};
use crate::text::tool_calls::{
    CallCommit, ParsedToolCall, ToolCallFormat, ToolCallParser, ToolEvent, ToolParserOptions, ToolSpec,
};
use serde_json::Value as Json;

/// One thing the output says, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Output {
    /// Content text (never empty).
    Text(String),
    /// Reasoning text (never empty).
    Reasoning(String),
    /// A tool call begins (`index` counts calls from 0; `id` is `call_...`).
    CallStart { index: usize, id: String, name: String },
    /// More of the call's arguments JSON.
    CallArguments { index: usize, delta: String },
    /// The call is over; `complete`: it closed well-formed (false: cut off, its arguments closed as parsed).
    CallEnd { index: usize, complete: bool },
}

/// `tool_choice`, as both APIs say it (OpenAI `"required"` is Anthropic's `any`, a named function its `tool`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools after validation (`validation::tools`).
#[derive(Clone, Debug)]
pub(crate) struct ToolRequest {
    /// OpenAI-shaped definitions (`{"type": "function", "function": {...}}`), as the template takes them.
    pub tools: Vec<Json>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (Anthropic: not `disable_parallel_tool_use`): calls after the first are dropped.
    pub parallel: bool,
    /// The server's tool-call format; `None`: calls are not parsed (the output stays text).
    pub format: Option<ToolCallFormat>,
}

impl ToolRequest {
    /// No tools (or `tool_choice: none`).
    #[cfg(test)]
    pub fn none() -> Self {
        ToolRequest { tools: vec![], choice: ToolChoice::None, parallel: true, format: None }
    }

    /// What the chat template gets: nothing under `none`, only the named tool under a named choice, else all.
    pub fn template_tools(&self) -> Option<Vec<Json>> {
        match &self.choice {
            ToolChoice::None => None,
            _ if self.tools.is_empty() => None,
            ToolChoice::Named(name) => {
                Some(self.tools.iter().filter(|t| tool_name(t) == Some(name.as_str())).cloned().collect())
            }
            _ => Some(self.tools.clone()),
        }
    }

    /// Whether calls are parsed out of the output.
    fn parses_calls(&self) -> bool {
        self.format.is_some() && self.choice != ToolChoice::None && !self.tools.is_empty()
    }
}

/// The `function.name` of an OpenAI-shaped tool.
pub(crate) fn tool_name(tool: &Json) -> Option<&str> {
    tool.get("function")?.get("name")?.as_str()
}

/// How one request's output is parsed. Cheap to clone; the default parses nothing (raw text).
#[derive(Clone, Debug, Default)]
pub(crate) struct OutputSpec {
    /// The reasoning format and whether the prompt opened the block.
    reasoning: Option<(ReasoningFormat, bool)>,
    tools: Option<ToolOutput>,
}

#[derive(Clone, Debug)]
struct ToolOutput {
    format: ToolCallFormat,
    specs: Vec<ToolSpec>,
    parallel: bool,
    /// A forced call's opening, appended to the prompt and read by the parser before the output.
    forced: String,
}

impl OutputSpec {
    /// Raw text: no parsing (completions).
    pub fn raw() -> Self {
        OutputSpec::default()
    }

    /// For a chat prompt rendered to `prompt`: the spec, and what to append to the prompt (a forced call's
    /// opening, see the module doc; empty when nothing is forced).
    pub fn for_chat(reasoning: Option<ReasoningFormat>, tools: &ToolRequest, prompt: &str) -> (OutputSpec, String) {
        let mut opened = prompt_opens_reasoning(prompt);
        let mut suffix = String::new();
        let tools = tools.parses_calls().then(|| {
            let format = tools.format.expect("parses_calls");
            let forced = match &tools.choice {
                ToolChoice::Required => "<tool_call>\n".to_string(),
                ToolChoice::Named(name) => match format {
                    ToolCallFormat::Hermes => {
                        format!("<tool_call>\n{{\"name\": {}, \"arguments\": ", Json::String(name.clone()))
                    }
                    ToolCallFormat::Qwen3Coder => format!("<tool_call>\n<function={name}>\n"),
                },
                _ => String::new(),
            };
            if !forced.is_empty() {
                // The call comes first: an open reasoning block is closed as templates close it with thinking off.
                if opened {
                    suffix.push_str("\n</think>\n\n");
                    opened = false;
                }
                suffix.push_str(&forced);
            }
            let defs = match &tools.choice {
                ToolChoice::Named(_) => tools.template_tools().unwrap_or_default(),
                _ => tools.tools.clone(),
            };
            ToolOutput { format, specs: ToolSpec::from_openai_tools(&defs), parallel: tools.parallel, forced }
        });
        (OutputSpec { reasoning: reasoning.map(|f| (f, opened)), tools }, suffix)
    }

    /// A parser for one response: `commit` says when a call comes out (streams: at its header; whole
    /// responses: once it closed well-formed, so a malformed call stays text).
    pub fn parser(&self, commit: CallCommit) -> OutputParser {
        let reasoning = self.reasoning.map(|(format, opened)| {
            ReasoningParser::new(format, opened).with_tool_call_ending_block(self.tools.is_some())
        });
        let mut queued = Vec::new();
        let tools = self.tools.as_ref().map(|t| {
            let mut parser =
                t.format.parser(t.specs.clone(), ToolParserOptions { commit, parallel_tool_calls: t.parallel });
            queued.extend(parser.push(&t.forced).into_iter().map(Output::from));
            parser
        });
        OutputParser { reasoning, tools, queued, cut_off: false }
    }
}

impl From<ToolEvent> for Output {
    fn from(e: ToolEvent) -> Self {
        match e {
            ToolEvent::Text(t) => Output::Text(t),
            ToolEvent::CallStart { index, id, name } => Output::CallStart { index, id, name },
            ToolEvent::CallArguments { index, delta } => Output::CallArguments { index, delta },
            ToolEvent::CallEnd { index, complete } => Output::CallEnd { index, complete },
        }
    }
}

/// One response's parsers, fed text as it streams.
pub(crate) struct OutputParser {
    reasoning: Option<ReasoningParser>,
    tools: Option<Box<dyn ToolCallParser>>,
    /// Events to send before the next ones (a forced call's start).
    queued: Vec<Output>,
    /// A call was cut off (its `CallEnd` said `complete: false`).
    cut_off: bool,
}

impl OutputParser {
    /// More output text; what it completes.
    pub fn push(&mut self, text: &str) -> Vec<Output> {
        self.run(text, false)
    }

    /// The output ended (after the last `push`): everything held back.
    pub fn finish(&mut self) -> Vec<Output> {
        self.run("", true)
    }

    /// Calls given out so far.
    pub fn tool_calls(&self) -> usize {
        self.tools.as_ref().map_or(0, |t| t.calls())
    }

    /// Whether the output had (or the prompt opened) a reasoning block (`reasoning_content` is null when not).
    pub fn saw_reasoning(&self) -> bool {
        self.reasoning.as_ref().is_some_and(ReasoningParser::saw_reasoning_block)
    }

    /// The finish reason to report for the engine's `reason`: `tool_calls` when the output ended by itself
    /// (end of turn or a stop string) after at least one call that closed.
    pub fn finish_reason(&self, reason: &'static str) -> &'static str {
        if reason == "stop" && self.tool_calls() > 0 && !self.cut_off {
            "tool_calls"
        } else {
            reason
        }
    }

    fn run(&mut self, text: &str, at_end: bool) -> Vec<Output> {
        let mut out = std::mem::take(&mut self.queued);
        let content = match &mut self.reasoning {
            Some(r) => {
                let mut d = r.push(text);
                if at_end {
                    let tail = r.finish();
                    d.reasoning.push_str(&tail.reasoning);
                    d.content.push_str(&tail.content);
                }
                if !d.reasoning.is_empty() {
                    out.push(Output::Reasoning(d.reasoning));
                }
                d.content
            }
            None => text.to_string(),
        };
        match &mut self.tools {
            Some(t) => {
                let mut events = t.push(&content);
                if at_end {
                    events.extend(t.finish());
                }
                for e in events {
                    if matches!(e, ToolEvent::CallEnd { complete: false, .. }) {
                        self.cut_off = true;
                    }
                    out.push(e.into());
                }
            }
            None if !content.is_empty() => out.push(Output::Text(content)),
            None => {}
        }
        // Adjacent text (a forced call's events, then the first push) stays in order; nothing empty goes out.
        out.retain(|o| !matches!(o, Output::Text(t) | Output::Reasoning(t) if t.is_empty()));
        out
    }
}

/// A whole response's output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Message {
    pub content: String,
    /// `None` when the output had no reasoning block (or there is no reasoning parser).
    pub reasoning: Option<String>,
    pub calls: Vec<ParsedToolCall>,
}

impl Message {
    /// Folds one event in.
    pub fn apply(&mut self, o: Output) {
        match o {
            Output::Text(t) => self.content.push_str(&t),
            Output::Reasoning(t) => self.reasoning.get_or_insert_with(String::new).push_str(&t),
            Output::CallStart { id, name, .. } => {
                self.calls.push(ParsedToolCall { id, name, arguments: String::new(), complete: false })
            }
            Output::CallArguments { index, delta } => {
                if let Some(c) = self.calls.get_mut(index) {
                    c.arguments.push_str(&delta);
                }
            }
            Output::CallEnd { index, complete } => {
                if let Some(c) = self.calls.get_mut(index) {
                    c.complete = complete;
                }
            }
        }
    }
}

/// Anthropic's id for a call (`toolu_` and the same random part as its `call_` id).
pub(crate) fn anthropic_tool_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Vec<Json> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
            json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}),
        ]
    }

    fn request(choice: ToolChoice, format: ToolCallFormat) -> ToolRequest {
        ToolRequest { tools: weather(), choice, parallel: true, format: Some(format) }
    }

    fn run(spec: &OutputSpec, commit: CallCommit, deltas: &[&str], reason: &'static str) -> (Message, &'static str) {
        let mut p = spec.parser(commit);
        let mut m = Message::default();
        for d in deltas {
            p.push(d).into_iter().for_each(|o| m.apply(o));
        }
        p.finish().into_iter().for_each(|o| m.apply(o));
        if p.saw_reasoning() && m.reasoning.is_none() {
            m.reasoning = Some(String::new());
        }
        let r = p.finish_reason(reason);
        (m, r)
    }

    #[test]
    fn reasoning_then_hermes_call() {
        let (spec, suffix) = OutputSpec::for_chat(
            Some(ReasoningFormat::Qwen3),
            &request(ToolChoice::Auto, ToolCallFormat::Hermes),
            "<|im_start|>assistant\n",
        );
        assert_eq!(suffix, "");
        let text = "<think>\nweather needed\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        for commit in [CallCommit::OnHeader, CallCommit::OnClose] {
            let deltas: Vec<&str> = text.split_inclusive(['>', ' ']).collect();
            let (m, reason) = run(&spec, commit, &deltas, "stop");
            assert_eq!(m.reasoning.as_deref(), Some("weather needed"));
            assert_eq!(m.content, "Let me check.");
            assert_eq!(m.calls.len(), 1);
            assert_eq!(
                (m.calls[0].name.as_str(), m.calls[0].arguments.as_str()),
                ("get_weather", "{\"city\": \"Paris\"}")
            );
            assert!(m.calls[0].id.starts_with("call_"));
            assert_eq!(reason, "tool_calls");
            // Cut off by max_tokens: not tool_calls.
            assert_eq!(run(&spec, commit, &deltas, "length").1, "length");
        }
    }

    #[test]
    fn no_tools_means_text_and_calls_inside_reasoning_stay_there() {
        let (spec, _) = OutputSpec::for_chat(
            Some(ReasoningFormat::Qwen3),
            &ToolRequest::none(),
            "<|im_start|>assistant\n<think>\n",
        );
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>";
        let (m, reason) = run(&spec, CallCommit::OnHeader, &["plan ", call, "</think>ok ", call], "stop");
        assert_eq!(m.reasoning.as_deref(), Some(format!("plan {call}").as_str()));
        assert_eq!(m.content, format!("ok {call}"));
        assert!(m.calls.is_empty());
        assert_eq!(reason, "stop");
        // Raw: everything verbatim.
        let (m, _) = run(&OutputSpec::raw(), CallCommit::OnClose, &["<think>a</think>", call], "stop");
        assert_eq!((m.content, m.reasoning), (format!("<think>a</think>{call}"), None));
    }

    #[test]
    fn malformed_hermes_call_is_text_in_whole_responses() {
        let (spec, _) = OutputSpec::for_chat(None, &request(ToolChoice::Auto, ToolCallFormat::Hermes), "");
        let bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
        let (m, reason) = run(&spec, CallCommit::OnClose, &[bad], "stop");
        assert_eq!((m.content.as_str(), m.calls.len(), reason), (bad, 0, "stop"));
        // An unknown tool is text in both modes.
        let other = "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>";
        for commit in [CallCommit::OnHeader, CallCommit::OnClose] {
            let (m, reason) = run(&spec, commit, &[other], "stop");
            assert_eq!((m.content.as_str(), m.calls.len(), reason), (other, 0, "stop"));
        }
    }

    #[test]
    fn forced_calls_prefill_the_opening() {
        let opened = "<|im_start|>assistant\n<think>\n";
        let (spec, suffix) = OutputSpec::for_chat(
            Some(ReasoningFormat::Qwen3),
            &request(ToolChoice::Required, ToolCallFormat::Hermes),
            opened,
        );
        assert_eq!(suffix, "\n</think>\n\n<tool_call>\n");
        let (m, reason) =
            run(&spec, CallCommit::OnHeader, &["{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"], "stop");
        assert_eq!(
            (m.calls.len(), m.calls[0].name.as_str(), m.content.as_str(), reason),
            (1, "get_time", "", "tool_calls")
        );
        assert_eq!(m.reasoning, None);

        let named = request(ToolChoice::Named("get_weather".into()), ToolCallFormat::Hermes);
        assert_eq!(named.template_tools().unwrap().len(), 1);
        let (spec, suffix) = OutputSpec::for_chat(None, &named, "p");
        assert_eq!(suffix, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ");
        for commit in [CallCommit::OnHeader, CallCommit::OnClose] {
            let (m, reason) = run(&spec, commit, &["{\"city\": \"Oslo\", ", "\"days\": 2}}\n</tool_call>"], "stop");
            assert_eq!(m.calls[0].arguments, "{\"city\": \"Oslo\", \"days\": 2}", "{commit:?}");
            assert_eq!(reason, "tool_calls");
        }
        let (spec, suffix) = OutputSpec::for_chat(
            None,
            &request(ToolChoice::Named("get_weather".into()), ToolCallFormat::Qwen3Coder),
            "p",
        );
        assert_eq!(suffix, "<tool_call>\n<function=get_weather>\n");
        let (m, _) =
            run(&spec, CallCommit::OnClose, &["<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"], "stop");
        assert_eq!(m.calls[0].arguments, "{\"days\": 3}");
        // The model ignores the forced opening: text, finish_reason stop.
        let (m, reason) = run(&spec, CallCommit::OnClose, &["no."], "stop");
        assert_eq!((m.calls.len(), reason), (0, "stop"));
        assert!(m.content.ends_with("no."), "{m:?}");
    }

    #[test]
    fn parallel_calls_and_the_switch() {
        let call = |city: &str| {
            format!("<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"{city}\"}}}}\n</tool_call>")
        };
        let text = format!("{}\n{}", call("Paris"), call("Rome"));
        let mut req = request(ToolChoice::Auto, ToolCallFormat::Hermes);
        let (spec, _) = OutputSpec::for_chat(None, &req, "");
        let (m, _) = run(&spec, CallCommit::OnHeader, &[&text], "stop");
        assert_eq!(
            m.calls.iter().map(|c| c.arguments.as_str()).collect::<Vec<_>>(),
            ["{\"city\": \"Paris\"}", "{\"city\": \"Rome\"}"]
        );
        assert_ne!(m.calls[0].id, m.calls[1].id);
        req.parallel = false;
        let (spec, _) = OutputSpec::for_chat(None, &req, "");
        let (m, _) = run(&spec, CallCommit::OnHeader, &[&text], "stop");
        assert_eq!((m.calls.len(), m.content.as_str()), (1, ""));
    }

    #[test]
    fn ids() {
        assert_eq!(anthropic_tool_id("call_abc"), "toolu_abc");
    }
}
