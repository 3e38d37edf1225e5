//! The tool-calling test model: the tests' byte-level BPE plus `<tool_call>`, `</tool_call>`, `<think>`,
//! `</think>` as added (non-special) tokens, as Qwen's tokenizers have them, a hermes-style ChatML template with
//! tools and `enable_thinking`, and a scripted backend that "says" a given text in those tokens. Shared by the
//! tool-call tests of every API.
#![allow(dead_code)]

use super::*;
use ft_core::request::FinishReason;
use ft_server::backend::EngineDescription;
use ft_server::text::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::time::Duration;

pub const TOOL_CALL: u32 = 266;
pub const THINK: u32 = 268;

/// A hermes-style ChatML template with tools and `enable_thinking` (the prompt opens `<think>` when it is on).
pub const TEMPLATE: &str = r#"{%- if tools %}<|im_start|>system
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}"#;

pub fn tokenizer_json() -> String {
    let mut t: Value = serde_json::from_str(&super::tokenizer_json()).unwrap();
    for (i, content) in ["<tool_call>", "</tool_call>", "<think>", "</think>"].iter().enumerate() {
        t["added_tokens"].as_array_mut().unwrap().push(json!({"id": 266 + i, "content": content, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": false}));
    }
    t.to_string()
}

pub fn tool_tokenizer() -> Tokenizer {
    Tokenizer::from_json(&tokenizer_json()).unwrap()
}

pub fn info() -> EngineDescription {
    let mut info = engine_description();
    let path = write_tokenizer().with_file_name("tools-tokenizer.json");
    std::fs::write(&path, tokenizer_json()).unwrap();
    info.tokenizer_path = path;
    info.vocab_size = 270;
    info.max_context = 4096;
    info.architecture = "Qwen3ForCausalLM".into();
    info.chat_template = Some(TEMPLATE.into());
    info
}

pub async fn server(flags: &[&str]) -> TestServer {
    TestServer::start_with(flags, info()).await
}

/// The model "says" `text` (tags as their own tokens), then ends its turn.
pub fn says(s: &TestServer, text: &str) {
    let mut tokens = tool_tokenizer().encode(text, false).unwrap();
    assert!(text.contains("<tool_call>") <= tokens.contains(&TOOL_CALL));
    assert!(text.contains("<think>") <= tokens.contains(&THINK));
    tokens.push(IM_END);
    s.backend.set_script(move |_| {
        Ok(Script {
            tokens: tokens.clone(),
            end: End::Finish(FinishReason::Stop),
            delay: Duration::ZERO,
            cached_tokens: 0,
        })
    });
}

pub fn prompt(s: &TestServer) -> String {
    tool_tokenizer().decode(&s.backend.submitted().last().unwrap().prompt, false).unwrap()
}

pub fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
    ])
}

pub fn call(name: &str, args: &str) -> String {
    format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
}

/// `(event name, data)` pairs of an SSE body with named events (and the status).
pub async fn post_named_events(s: &TestServer, path: &str, body: Value) -> (u16, Vec<(String, Value)>) {
    let resp = s.client.post(s.url(path)).json(&body).send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    let mut out = vec![];
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let name = block.lines().find_map(|l| l.strip_prefix("event: "));
        let data = block.lines().find_map(|l| l.strip_prefix("data: "));
        if let (Some(name), Some(data)) = (name, data) {
            out.push((name.to_string(), serde_json::from_str(data).unwrap()));
        }
    }
    (status, out)
}
