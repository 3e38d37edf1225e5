//! Text in and out of the model: the tokenizer (with `segment_cache`, the ids of text it has seen), the chat
//! template, and what happens to the output between the tokens and the wire: the incremental detokenizer, stop
//! strings, reasoning split out of `<think>` blocks (`reasoning`), tool calls parsed out of the content
//! (`tool_calls`).
//!
//! ```text
//!   tokens ─▶ detokenizer ─▶ stop strings ─▶ ReasoningParser ─┬─ reasoning ─────────────▶ reasoning_content / thinking
//!                                                             └─ content ─▶ ToolCallParser ─┬─ text ─▶ content / text blocks
//!                                                                                            └─ calls ▶ tool_calls / tool_use
//! ```
//!
//! Both parsers take text deltas split anywhere (a tag can straddle two deltas) and give the same result
//! whatever the split; both hold back only the shortest tail that could still grow into a tag.

pub mod chat_template;
pub mod detokenizer;
pub mod reasoning;
pub mod segment_cache;
pub mod stop_strings;
pub mod token_text;
pub mod tokenizer;
pub mod tool_calls;

/// An architecture as the parsers' `resolve` compares it: HF's class name (`Qwen3_5MoeForConditionalGeneration`,
/// what the engine description carries) or a model type (`qwen3_5_moe`), lower-cased, without the `For...`
/// suffix and without underscores: `qwen35moe`.
pub(crate) fn model_family(architecture: &str) -> String {
    let name = architecture.find("For").map_or(architecture, |i| &architecture[..i]);
    name.chars().filter(|c| *c != '_' && *c != '-').flat_map(char::to_lowercase).collect()
}

/// Length in bytes of the longest suffix of `text` that is a proper, non-empty prefix of `tag` (0 when none).
/// That tail is held back: the next delta may complete the tag. Always a char boundary of `text`.
pub(crate) fn partial_tag_suffix(text: &str, tag: &str) -> usize {
    let max = tag.len().saturating_sub(1).min(text.len());
    for n in (1..=max).rev() {
        let start = text.len() - n;
        if text.is_char_boundary(start) && tag.starts_with(&text[start..]) {
            return n;
        }
    }
    0
}

/// How `text` stands against `tag`, for decisions that need the whole tag: `Some(true)` if it starts with
/// it, `Some(false)` if it cannot (a character differs), `None` if `text` is a proper prefix of it (wait).
pub(crate) fn starts_with_tag(text: &str, tag: &str) -> Option<bool> {
    if text.starts_with(tag) {
        Some(true)
    } else if tag.starts_with(text) {
        None
    } else {
        Some(false)
    }
}

#[cfg(test)]
pub(crate) mod split_testing {
    //! Random splits of one output into deltas, for the "same result whatever the split" tests.

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// `text` cut at random char boundaries into pieces of 0..=max_len chars (empty deltas included: the
    /// detokenizer emits them while a character is still split).
    pub fn random_split(text: &str, seed: u64, max_len: usize) -> Vec<String> {
        let mut rng = StdRng::seed_from_u64(seed);
        let chars: Vec<char> = text.chars().collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let n = rng.gen_range(0..=max_len).min(chars.len() - i);
            out.push(chars[i..i + n].iter().collect());
            i += n;
        }
        out
    }

    /// Every way to cut `text` into at most three pieces (all pairs of char boundaries).
    pub fn all_three_way_splits(text: &str) -> Vec<Vec<String>> {
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain(std::iter::once(text.len())).collect();
        let mut out = Vec::new();
        for (a, &i) in bounds.iter().enumerate() {
            for &j in &bounds[a..] {
                out.push(vec![text[..i].to_string(), text[i..j].to_string(), text[j..].to_string()]);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::reasoning::{ReasoningFormat, ReasoningParser};
    use super::split_testing::random_split;
    use super::tool_calls::{ParsedOutput, ToolCallFormat, ToolParserOptions, ToolSpec};
    use super::*;

    /// The two parsers chained as a route chains them: reasoning first, its content into the tool parser.
    fn pipeline(prompt_opened: bool, deltas: &[String]) -> (String, ParsedOutput) {
        let tools = ToolSpec::from_openai_tools(&[
            serde_json::json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
        ]);
        let mut reasoning = ReasoningParser::new(ReasoningFormat::Qwen3, prompt_opened);
        let mut calls = ToolCallFormat::Qwen3Coder.parser(tools, ToolParserOptions::default());
        let (mut thought, mut out) = (String::new(), ParsedOutput::default());
        let mut split: Vec<_> = deltas.iter().map(|d| reasoning.push(d)).collect();
        split.push(reasoning.finish());
        for d in split {
            thought.push_str(&d.reasoning);
            for e in calls.push(&d.content) {
                out.apply(&e);
            }
        }
        for e in calls.finish() {
            out.apply(&e);
        }
        (thought, out)
    }

    #[test]
    fn reasoning_then_tool_calls() {
        let call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";
        for (prompt_opened, text, content) in [
            (true, format!("Need the weather.\n</think>\n\nChecking.\n{call}"), "Checking."),
            (false, format!("<think>\nNeed the weather.\n</think>\n\n{call}"), ""),
            // The call starts inside the unclosed block (Qwen3.5 does this).
            (true, format!("Need the weather.\n{call}"), ""),
        ] {
            for seed in 0..100 {
                let (thought, out) = pipeline(prompt_opened, &random_split(&text, seed, 7));
                assert_eq!(thought, "Need the weather.");
                assert_eq!(out.content, content);
                assert_eq!(out.calls.len(), 1);
                assert_eq!(out.calls[0].arguments, "{\"city\": \"Paris\", \"days\": 2}");
                assert!(out.calls[0].complete);
            }
        }
        // A whole call inside the block ends it even if a `</think>` follows (what vLLM's qwen3 parser does
        // too); the stray tag is then content.
        let (thought, out) = pipeline(true, &[format!("maybe {call}?</think>No call needed.")]);
        assert_eq!((thought.as_str(), out.calls.len(), out.content.as_str()), ("maybe", 1, "?</think>No call needed."));
    }

    #[test]
    fn model_families() {
        assert_eq!(model_family("Qwen3_5MoeForConditionalGeneration"), "qwen35moe");
        assert_eq!(model_family("qwen3_5_moe"), "qwen35moe");
        assert_eq!(model_family("Qwen3MoeForCausalLM"), "qwen3moe");
        assert_eq!(model_family("LlamaForCausalLM"), "llama");
        assert_eq!(model_family(""), "");
    }

    #[test]
    fn partial_suffix() {
        assert_eq!(partial_tag_suffix("abc<tool", "<tool_call>"), 5);
        assert_eq!(partial_tag_suffix("abc<", "<tool_call>"), 1);
        assert_eq!(partial_tag_suffix("abc", "<tool_call>"), 0);
        // The whole tag is not a *proper* prefix: the caller has found it already.
        assert_eq!(partial_tag_suffix("<think>", "<think>"), 0);
        assert_eq!(partial_tag_suffix("é<th", "<think>"), 3);
        assert_eq!(partial_tag_suffix("", "<think>"), 0);
    }

    #[test]
    fn tag_prefix_states() {
        assert_eq!(starts_with_tag("<function=f>", "<function="), Some(true));
        assert_eq!(starts_with_tag("<func", "<function="), None);
        assert_eq!(starts_with_tag("", "<function="), None);
        assert_eq!(starts_with_tag("<fun!", "<function="), Some(false));
    }
}
