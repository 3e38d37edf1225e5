//! Reasoning split out of the model's output: Qwen3's `<think>` ... `</think>` (`--reasoning-parser qwen3`).
//!
//! Two template styles produce two output shapes, and one parser takes both:
//!
//! ```text
//!   Qwen3 (2504):     prompt "...<|im_start|>assistant\n"          output "<think>\nplan\n</think>\n\nanswer"
//!   Qwen3.5 / 3.6:    prompt "...<|im_start|>assistant\n<think>\n" output "plan\n</think>\n\nanswer"
//!                     (the prompt opened the block: construct with `prompt_opened = true`)
//!   thinking off:     prompt "...assistant\n<think>\n\n</think>\n\n"  output "answer"      (prompt_opened = false)
//! ```
//!
//! Both give reasoning `"plan"` and content `"answer"`. Rules:
//! - Only a `<think>` at the very start of the output (after whitespace) opens reasoning; a later one is
//!   text. A leading `<think>` is also skipped when the prompt opened the block (models double it).
//! - Reasoning ends at the first `</think>`; everything after is content, tags included.
//! - Qwen3.5 sometimes starts a tool call inside the block without closing it: a `<tool_call>` followed by
//!   `<function=` (qwen3_coder) or `{` (hermes) ends reasoning, and the tag starts the content so the tool
//!   parser sees it. A `<tool_call>` followed by anything else is reasoning text.
//! - Whitespace at the edges is dropped: around the reasoning, and between `</think>` and the content.
//!   Content with no reasoning block is verbatim.
//! - Output that ends inside the block (max_tokens) is all reasoning.

use super::{partial_tag_suffix, starts_with_tag};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_CALL_OPEN: &str = "<tool_call>";
const FUNCTION_OPEN: &str = "<function=";

/// A reasoning parser, by its `--reasoning-parser` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// `<think>` ... `</think>` (Qwen3, Qwen3-Next, Qwen3.5/3.6; DeepSeek-R1 writes the same tags).
    Qwen3,
}

impl ReasoningFormat {
    /// Every name `--reasoning-parser` takes (`auto` picks from the model, `off` splits nothing).
    pub const NAMES: &'static [&'static str] = &["qwen3", "deepseek_r1", "auto", "off"];

    /// A named format; `auto` and `off` are not one (see [`ReasoningFormat::resolve`]).
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "qwen3" | "deepseek_r1" => Ok(ReasoningFormat::Qwen3),
            _ => Err(format!("unknown --reasoning-parser {name:?} (valid: {})", Self::NAMES.join(", "))),
        }
    }

    /// What `--reasoning-parser` resolves to for this model: a named parser as asked (`off`: none); `auto` (and
    /// no flag) picks `qwen3` when the chat template writes `<think>` or the architecture (HF class name or
    /// model type) is a Qwen3, else none (the output is all content).
    pub fn resolve(
        flag: Option<&str>,
        architecture: &str,
        chat_template: Option<&str>,
    ) -> Result<Option<Self>, String> {
        match flag {
            Some("off") => Ok(None),
            Some(name) if name != "auto" => Self::from_name(name).map(Some),
            _ => {
                let template_thinks = chat_template.is_some_and(|t| t.contains(THINK_OPEN));
                let arch_thinks = super::model_family(architecture).starts_with("qwen3");
                Ok((template_thinks || arch_thinks).then_some(ReasoningFormat::Qwen3))
            }
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            ReasoningFormat::Qwen3 => "qwen3",
        }
    }
}

/// Whether a rendered prompt leaves a `<think>` block open for the output (Qwen3.5/3.6 with thinking on):
/// its last `<think>` comes after its last `</think>` and only whitespace follows it.
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    match prompt.rfind(THINK_OPEN) {
        Some(open) => {
            prompt.rfind(THINK_CLOSE).is_none_or(|close| close < open)
                && prompt[open + THINK_OPEN.len()..].trim().is_empty()
        }
        None => false,
    }
}

/// What one `push` (or `finish`) adds; reasoning always precedes content in the output, so the two strings
/// are in order even when one delta carries both.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReasoningDelta {
    pub reasoning: String,
    pub content: String,
}

impl ReasoningDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Only whitespace so far: a `<think>` may still open the block. `in_block`: the prompt opened it.
    Start { in_block: bool },
    /// Inside the block. `at_start`: no reasoning text yet (leading whitespace is dropped).
    Reasoning { at_start: bool },
    /// Just past `</think>`: whitespace before the content is dropped.
    AfterBlock,
    /// Everything from here is content, verbatim.
    Content,
}

/// Splits one request's output into reasoning and content, incrementally.
#[derive(Clone, Debug)]
pub struct ReasoningParser {
    phase: Phase,
    /// Text not yet classified: a possible tag at the end, or leading whitespace.
    buf: String,
    /// Trailing whitespace of the reasoning so far, emitted only if more reasoning follows.
    pending_ws: String,
    /// Whether a `<tool_call>` that starts a call ends the block (see the module doc).
    tool_call_ends_block: bool,
    saw_block: bool,
}

impl ReasoningParser {
    /// `prompt_opened`: the rendered prompt left a `<think>` block open ([`prompt_opens_reasoning`]).
    pub fn new(format: ReasoningFormat, prompt_opened: bool) -> Self {
        match format {
            ReasoningFormat::Qwen3 => ReasoningParser {
                phase: Phase::Start { in_block: prompt_opened },
                buf: String::new(),
                pending_ws: String::new(),
                tool_call_ends_block: true,
                saw_block: prompt_opened,
            },
        }
    }

    /// Whether a `<tool_call>` that starts a call ends an unclosed block (default on; routes turn it off
    /// for requests whose tool calls are not parsed, so the call text stays in the reasoning).
    pub fn with_tool_call_ending_block(mut self, on: bool) -> Self {
        self.tool_call_ends_block = on;
        self
    }

    /// Whether the output had (or the prompt opened) a reasoning block; `reasoning_content` is `null` when not.
    pub fn saw_reasoning_block(&self) -> bool {
        self.saw_block
    }

    /// Whether the block is over (everything from now on is content). Routes feed the tool-call parser
    /// only content, so a call written inside the reasoning is never run.
    pub fn in_content(&self) -> bool {
        matches!(self.phase, Phase::AfterBlock | Phase::Content)
    }

    pub fn push(&mut self, delta: &str) -> ReasoningDelta {
        self.buf.push_str(delta);
        let mut out = ReasoningDelta::default();
        self.advance(false, &mut out);
        out
    }

    /// The output ended: whatever is held back is classified now (an unclosed block is all reasoning).
    pub fn finish(&mut self) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        self.advance(true, &mut out);
        out
    }

    /// Whole-output convenience (non-streaming responses): `(reasoning, content)`, reasoning `None` when
    /// the output had no block.
    pub fn split_whole(format: ReasoningFormat, prompt_opened: bool, text: &str) -> (Option<String>, String) {
        let mut p = ReasoningParser::new(format, prompt_opened);
        let mut a = p.push(text);
        let b = p.finish();
        a.reasoning.push_str(&b.reasoning);
        a.content.push_str(&b.content);
        (p.saw_block.then_some(a.reasoning), a.content)
    }

    /// Runs the phase machine over `buf` until it needs more input (or, `at_end`, has classified it all).
    fn advance(&mut self, at_end: bool, out: &mut ReasoningDelta) {
        loop {
            let progress = match self.phase {
                Phase::Start { in_block } => self.step_start(in_block, at_end),
                Phase::Reasoning { at_start } => self.step_reasoning(at_start, at_end, out),
                Phase::AfterBlock => self.step_after_block(),
                Phase::Content => self.step_content(out),
            };
            if progress == Progress::Wait {
                return;
            }
        }
    }

    /// Only whitespace so far: a `<think>` opens the block, anything else decides there is none (or that the
    /// prompt's block goes on).
    fn step_start(&mut self, in_block: bool, at_end: bool) -> Progress {
        let rest = self.buf.trim_start();
        let ws = self.buf.len() - rest.len();
        let opens = if rest.is_empty() { None } else { starts_with_tag(rest, THINK_OPEN) };
        match (opens, at_end) {
            (Some(true), _) => {
                self.buf.drain(..ws + THINK_OPEN.len());
                self.saw_block = true;
                self.phase = Phase::Reasoning { at_start: true };
            }
            (Some(false), _) | (None, true) => {
                self.phase = if in_block { Phase::Reasoning { at_start: true } } else { Phase::Content };
            }
            (None, false) => return Progress::Wait,
        }
        Progress::Moved
    }

    /// Inside the block: reasoning out up to `</think>` (or a `<tool_call>` that starts a call), holding back
    /// what may be the start of either.
    fn step_reasoning(&mut self, at_start: bool, at_end: bool, out: &mut ReasoningDelta) -> Progress {
        if at_start {
            if !self.drop_leading_whitespace() {
                return Progress::Wait;
            }
            self.phase = Phase::Reasoning { at_start: false };
        }
        match self.find_block_end(at_end) {
            BlockEnd::Close(i) => {
                self.end_reasoning(i, out);
                self.buf.drain(..THINK_CLOSE.len());
                self.phase = Phase::AfterBlock;
            }
            BlockEnd::ToolCall(i) => {
                self.end_reasoning(i, out);
                self.phase = Phase::Content;
            }
            BlockEnd::NotYet(safe) => {
                let reasoning: String = self.buf.drain(..safe).collect();
                self.emit_reasoning(&reasoning, out);
                if at_end {
                    self.pending_ws.clear();
                }
                return Progress::Wait;
            }
        }
        Progress::Moved
    }

    /// Just past `</think>`: the whitespace before the content is dropped.
    fn step_after_block(&mut self) -> Progress {
        if !self.drop_leading_whitespace() {
            return Progress::Wait;
        }
        self.phase = Phase::Content;
        Progress::Moved
    }

    /// Everything buffered is content.
    fn step_content(&mut self, out: &mut ReasoningDelta) -> Progress {
        out.content.push_str(&self.buf);
        self.buf.clear();
        Progress::Wait
    }

    /// Drops the leading whitespace of `buf`; whether anything is left.
    fn drop_leading_whitespace(&mut self) -> bool {
        let ws = self.buf.len() - self.buf.trim_start().len();
        self.buf.drain(..ws);
        !self.buf.is_empty()
    }

    /// The block ends at byte `i` of `buf`: the reasoning before it goes out, its trailing whitespace dropped.
    fn end_reasoning(&mut self, i: usize, out: &mut ReasoningDelta) {
        let reasoning: String = self.buf.drain(..i).collect();
        self.emit_reasoning(&reasoning, out);
        self.pending_ws.clear();
    }

    /// Where the block ends in `buf`, or how much of it is reasoning for sure.
    fn find_block_end(&self, at_end: bool) -> BlockEnd {
        let close = self.buf.find(THINK_CLOSE);
        let limit = close.unwrap_or(self.buf.len());
        if self.tool_call_ends_block {
            let mut from = 0;
            while let Some(rel) = self.buf[from..limit].find(TOOL_CALL_OPEN) {
                let at = from + rel;
                let after = self.buf[at + TOOL_CALL_OPEN.len()..].trim_start();
                let starts_call = if after.starts_with('{') {
                    Some(true)
                } else if after.is_empty() {
                    None
                } else {
                    starts_with_tag(after, FUNCTION_OPEN)
                };
                match starts_call {
                    Some(true) => return BlockEnd::ToolCall(at),
                    // Undecided (at the end of the output: it was not a call).
                    None if !at_end => return BlockEnd::NotYet(at),
                    _ => from = at + TOOL_CALL_OPEN.len(),
                }
            }
        }
        if let Some(i) = close {
            return BlockEnd::Close(i);
        }
        if at_end {
            return BlockEnd::NotYet(self.buf.len());
        }
        let mut hold = partial_tag_suffix(&self.buf, THINK_CLOSE);
        if self.tool_call_ends_block {
            hold = hold.max(partial_tag_suffix(&self.buf, TOOL_CALL_OPEN));
        }
        BlockEnd::NotYet(self.buf.len() - hold)
    }

    /// Reasoning text out, its trailing whitespace held until more reasoning follows.
    fn emit_reasoning(&mut self, text: &str, out: &mut ReasoningDelta) {
        let body = text.trim_end();
        if body.is_empty() {
            self.pending_ws.push_str(text);
            return;
        }
        out.reasoning.push_str(&self.pending_ws);
        out.reasoning.push_str(body);
        self.pending_ws = text[body.len()..].to_string();
    }
}

/// Whether a phase step moved the parser on (run the next phase) or needs more input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Progress {
    Moved,
    Wait,
}

enum BlockEnd {
    /// `</think>` at this byte offset.
    Close(usize),
    /// A `<tool_call>` starting a call at this offset: the content begins there.
    ToolCall(usize),
    /// No end yet; this many leading bytes are reasoning.
    NotYet(usize),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::split_testing::{all_three_way_splits, random_split};

    fn run(prompt_opened: bool, deltas: &[String]) -> (String, String, bool) {
        let mut p = ReasoningParser::new(ReasoningFormat::Qwen3, prompt_opened);
        let (mut r, mut c) = (String::new(), String::new());
        for d in deltas {
            let out = p.push(d);
            // Order: reasoning never arrives after content has started.
            assert!(out.reasoning.is_empty() || c.is_empty(), "reasoning after content");
            r.push_str(&out.reasoning);
            c.push_str(&out.content);
        }
        let out = p.finish();
        assert!(out.reasoning.is_empty() || c.is_empty(), "reasoning after content");
        r.push_str(&out.reasoning);
        c.push_str(&out.content);
        (r, c, p.saw_reasoning_block())
    }

    fn whole(prompt_opened: bool, text: &str) -> (String, String) {
        let (r, c, _) = run(prompt_opened, &[text.to_string()]);
        (r, c)
    }

    /// Every 3-way split and 200 random splits give the whole-text answer.
    fn check_splits(prompt_opened: bool, text: &str) -> (String, String) {
        let expect = whole(prompt_opened, text);
        for split in all_three_way_splits(text) {
            let (r, c, _) = run(prompt_opened, &split);
            assert_eq!((r, c), expect, "split {split:?}");
        }
        for seed in 0..200 {
            let split = random_split(text, seed, 6);
            let (r, c, _) = run(prompt_opened, &split);
            assert_eq!((r, c), expect, "split {split:?}");
        }
        expect
    }

    fn rc(r: &str, c: &str) -> (String, String) {
        (r.to_string(), c.to_string())
    }

    #[test]
    fn qwen3_generated_block() {
        assert_eq!(check_splits(false, "<think>\nplan it\n</think>\n\nThe answer."), rc("plan it", "The answer."));
        assert_eq!(check_splits(false, "\n <think>x</think>y"), rc("x", "y"));
    }

    #[test]
    fn qwen35_prompt_opened_block() {
        assert_eq!(check_splits(true, "plan it\n</think>\n\nThe answer."), rc("plan it", "The answer."));
        // A doubled <think> at the start is skipped.
        assert_eq!(check_splits(true, "<think>\nplan</think>ans"), rc("plan", "ans"));
        // Immediately closed.
        assert_eq!(check_splits(true, "</think>\n\nans"), rc("", "ans"));
        assert_eq!(check_splits(true, "\n\n</think>\n\nans"), rc("", "ans"));
    }

    #[test]
    fn no_block_is_verbatim_content() {
        assert_eq!(
            check_splits(false, "  Hello <think> there </think> x  "),
            rc("", "  Hello <think> there </think> x  ")
        );
        assert_eq!(check_splits(false, "\n\nplain"), rc("", "\n\nplain"));
        assert_eq!(check_splits(false, "   "), rc("", "   "));
        assert_eq!(check_splits(false, ""), rc("", ""));
        assert_eq!(check_splits(false, "<thin"), rc("", "<thin"));
        assert_eq!(check_splits(false, "<thinking>x"), rc("", "<thinking>x"));
        assert!(!run(false, &["plain".into()]).2);
    }

    #[test]
    fn truncated_inside_block_is_all_reasoning() {
        assert_eq!(check_splits(true, "step one\nstep two\n"), rc("step one\nstep two", ""));
        assert_eq!(check_splits(false, "<think>\nhalf a thou"), rc("half a thou", ""));
        assert_eq!(check_splits(true, "thinking </thi"), rc("thinking </thi", ""));
        assert_eq!(check_splits(false, "<think>"), rc("", ""));
        assert_eq!(check_splits(true, ""), rc("", ""));
        assert!(run(true, &[]).2);
    }

    #[test]
    fn tags_after_the_block_are_content() {
        assert_eq!(check_splits(false, "<think>a</think>b<think>c</think>d"), rc("a", "b<think>c</think>d"));
        assert_eq!(check_splits(true, "a<think>b</think>c"), rc("a<think>b", "c"));
        assert_eq!(check_splits(true, "a</think></think>"), rc("a", "</think>"));
    }

    #[test]
    fn inner_whitespace_kept_edges_dropped() {
        assert_eq!(check_splits(true, "\n a \n\n b \n</think>\n c \n"), rc("a \n\n b", "c \n"));
    }

    #[test]
    fn multibyte_around_tags() {
        assert_eq!(check_splits(true, "思考😀</think>答案é"), rc("思考😀", "答案é"));
        assert_eq!(check_splits(false, "<think>ü</think>ß"), rc("ü", "ß"));
    }

    #[test]
    fn tool_call_inside_block_ends_it() {
        let text =
            "I should call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(check_splits(true, text), rc("I should call it.", &text[18..]));
        let hermes = "hmm <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(check_splits(true, hermes), rc("hmm", &hermes[4..]));
        // A mention that does not start a call stays reasoning, and a later real one still ends the block.
        let mention = "use <tool_call> tags. <tool_call>\n<function=f>\n</function>\n</tool_call>";
        assert_eq!(check_splits(true, mention), rc("use <tool_call> tags.", &mention[22..]));
        // Cut off right after the tag: it was not a call.
        assert_eq!(check_splits(true, "x <tool_call>\n"), rc("x <tool_call>", ""));
        // Turned off: the call text is reasoning.
        let mut p = ReasoningParser::new(ReasoningFormat::Qwen3, true).with_tool_call_ending_block(false);
        let mut out = p.push(text);
        let end = p.finish();
        out.reasoning.push_str(&end.reasoning);
        assert_eq!(out.reasoning, text);
        assert!(out.content.is_empty() && end.content.is_empty());
    }

    #[test]
    fn in_content_and_split_whole() {
        let mut p = ReasoningParser::new(ReasoningFormat::Qwen3, true);
        assert!(!p.in_content());
        p.push("a</think>");
        assert!(p.in_content());
        let mut p = ReasoningParser::new(ReasoningFormat::Qwen3, false);
        p.push("  ");
        assert!(!p.in_content());
        p.push("x");
        assert!(p.in_content());
        assert_eq!(ReasoningParser::split_whole(ReasoningFormat::Qwen3, false, "hi"), (None, "hi".to_string()));
        assert_eq!(
            ReasoningParser::split_whole(ReasoningFormat::Qwen3, false, "<think>r</think>c"),
            (Some("r".to_string()), "c".to_string())
        );
    }

    #[test]
    fn prompt_open_detection() {
        assert!(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n"));
        // An earlier turn's closed block does not count.
        assert!(!prompt_opens_reasoning("<think>a</think>b<|im_start|>assistant\n"));
        assert!(!prompt_opens_reasoning("user: what does <think> mean?<|im_start|>assistant\n"));
    }

    #[test]
    fn registry() {
        assert_eq!(ReasoningFormat::from_name("qwen3"), Ok(ReasoningFormat::Qwen3));
        let err = ReasoningFormat::from_name("nonsense_xyz").unwrap_err();
        assert!(err.contains("nonsense_xyz") && err.contains("qwen3, deepseek_r1, auto") && !err.contains('\n'));
        assert_eq!(
            ReasoningFormat::resolve(Some("auto"), "llama", Some("{{ '<think>' }}")),
            Ok(Some(ReasoningFormat::Qwen3))
        );
        assert_eq!(ReasoningFormat::resolve(None, "qwen3_5_moe", None), Ok(Some(ReasoningFormat::Qwen3)));
        assert_eq!(ReasoningFormat::resolve(None, "llama", Some("plain")), Ok(None));
        assert_eq!(ReasoningFormat::resolve(Some("qwen3"), "llama", None), Ok(Some(ReasoningFormat::Qwen3)));
        assert!(ReasoningFormat::resolve(Some("bogus"), "qwen3", None).is_err());
        assert_eq!(ReasoningFormat::resolve(Some("off"), "qwen3", None), Ok(None));
        assert_eq!(ReasoningFormat::resolve(None, "Qwen3MoeForCausalLM", None), Ok(Some(ReasoningFormat::Qwen3)));
        assert_eq!(ReasoningFormat::resolve(None, "LlamaForCausalLM", None), Ok(None));
    }
}
