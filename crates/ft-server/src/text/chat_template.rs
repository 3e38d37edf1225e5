//! The model's own Jinja chat template, rendered with minijinja the way HF `transformers` renders it
//! (`apply_chat_template`): `trim_blocks` + `lstrip_blocks`, Python string/dict methods (`.strip()`,
//! `.startswith()`, `.items()` via minijinja-contrib's pycompat), `raise_exception`, a Python-`json.dumps`
//! flavoured `tojson`, `strftime_now`, loop controls, and the variables `messages`, `tools`,
//! `add_generation_prompt`, `bos_token`, `eos_token` plus any `chat_template_kwargs`.
//! Models without a template get ChatML.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

/// Used when the model ships no chat template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// The template failed to compile or render (including the template's own `raise_exception`): the
/// request is at fault as far as the client can tell, so it maps to 400.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatTemplateError(pub String);

impl std::fmt::Display for ChatTemplateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ChatTemplateError {}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    is_fallback: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("is_fallback", &self.is_fallback).finish()
    }
}

impl ChatTemplate {
    /// Compiles `template` (or ChatML when `None` / blank). Fails only on a template that does not compile.
    pub fn new(
        template: Option<&str>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatTemplateError> {
        let (source, is_fallback) = match template {
            Some(t) if !t.trim().is_empty() => (t.to_string(), false),
            _ => (CHATML_TEMPLATE.to_string(), true),
        };
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| ChatTemplateError(format!("the model's chat template does not compile: {}", describe(&e))))?;
        Ok(ChatTemplate { env, bos_token, eos_token, is_fallback })
    }

    /// True when the model had no template and ChatML is used.
    pub fn is_fallback(&self) -> bool {
        self.is_fallback
    }

    /// Renders the prompt. `messages` are OpenAI-style objects (`role`, `content` as a string, plus
    /// `tool_calls`, `tool_call_id`, `name`, ... passed through as given); `tools` the request's tool list;
    /// `extra` the request's `chat_template_kwargs` (they cannot override the variables above).
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        extra: Option<&Map<String, Json>>,
    ) -> Result<String, ChatTemplateError> {
        let mut ctx = extra.cloned().unwrap_or_default();
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert("tools".into(), tools.map(|t| Json::Array(t.to_vec())).unwrap_or(Json::Null));
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone().unwrap_or_default()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone().unwrap_or_default()));
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| ChatTemplateError(describe(&e)))?;
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| ChatTemplateError(format!("chat template error: {}", describe(&e))))
    }
}

/// The message of a minijinja error without its template-source dump; `raise_exception` messages verbatim.
fn describe(e: &Error) -> String {
    match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_string(),
        _ => e.to_string(),
    }
}

/// `raise_exception(msg)`: how HF templates refuse a conversation (e.g. roles not alternating).
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)` — Python's spacing (`{"a": 1, "b": 2}`), no HTML escaping.
fn tojson(value: Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.as_str().unwrap_or_default().to_string()),
        },
        None => None,
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let json =
        serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    PyJson { indent: indent.as_deref(), item_sep: &item_sep, key_sep: &key_sep, sort_keys }.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python `json.dumps` formatting.
struct PyJson<'a> {
    indent: Option<&'a str>,
    item_sep: &'a str,
    key_sep: &'a str,
    sort_keys: bool,
}

impl PyJson<'_> {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &Json, level: usize, out: &mut String) {
        match v {
            Json::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Json::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(level + 1, out);
                    out.push_str(&serde_json::to_string(k).unwrap_or_default());
                    out.push_str(self.key_sep);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
            Json::Array(_) => out.push_str("[]"),
            Json::Object(_) => out.push_str("{}"),
            Json::Bool(true) => out.push_str("true"),
            Json::Bool(false) => out.push_str("false"),
            Json::Null => out.push_str("null"),
            other => out.push_str(&serde_json::to_string(other).unwrap_or_default()),
        }
    }
}

/// `strftime_now(fmt)`: the local time formatted like Python's `time.strftime` (Llama 3 templates put the
/// date in the system prompt).
fn strftime_now(format: String) -> Result<Value, Error> {
    let fmt = std::ffi::CString::new(format)
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now: NUL in format"))?;
    // SAFETY: `localtime_r` fills the `tm` we own; `strftime` writes at most `buf.len()` bytes into `buf`.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(Error::new(ErrorKind::InvalidOperation, "strftime_now: no local time"));
        }
        let mut buf = [0u8; 256];
        let n = libc::strftime(buf.as_mut_ptr() as *mut libc::c_char, buf.len(), fmt.as_ptr(), &tm);
        Ok(Value::from(String::from_utf8_lossy(&buf[..n]).into_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_default_system_prompt() {
        let t = ChatTemplate::new(Some(SMOLLM2), None, Some("<|im_end|>".into())).unwrap();
        assert!(!t.is_fallback());
        let out = t.render(&[json!({"role": "user", "content": "Hi"})], None, true, None).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t
            .render(
                &[
                    json!({"role": "system", "content": "Be brief."}),
                    json!({"role": "user", "content": "Hi"}),
                    json!({"role": "assistant", "content": "Hello!"}),
                    json!({"role": "user", "content": "Bye"}),
                ],
                None,
                false,
                None,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        );
    }

    #[test]
    fn chatml_fallback() {
        let t = ChatTemplate::new(None, None, None).unwrap();
        assert!(t.is_fallback());
        let out = t.render(&[json!({"role": "user", "content": "x"})], None, true, None).unwrap();
        assert_eq!(out, "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_methods_raise_exception_and_trim_blocks() {
        let src = "{{ bos_token }}{% for m in messages %}\n  {% if m.role not in ['user', 'assistant', 'system', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}\n  {% if m.content.startswith('!') %}BANG{% endif %}\n[{{ m.role.upper() }}]{{ m.content.strip() }}\n{% endfor %}{% if tools %}{{ tools[0] | tojson }}{% endif %}{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}";
        let t = ChatTemplate::new(Some(src), Some("<s>".into()), None).unwrap();
        let msgs = [json!({"role": "user", "content": "  hi  "}), json!({"role": "tool", "content": "!x"})];
        let tools = [json!({"type": "function", "function": {"name": "f", "parameters": {"a": [1, 2]}}})];
        let mut kw = Map::new();
        kw.insert("enable_thinking".into(), json!(false));
        let out = t.render(&msgs, Some(&tools), false, Some(&kw)).unwrap();
        assert_eq!(
            out,
            "<s>[USER]hi\nBANG[TOOL]!x\n{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"a\": [1, 2]}}}<nothink>"
        );
        let err = t.render(&[json!({"role": "robot", "content": "x"})], None, false, None).unwrap_err();
        assert!(err.0.contains("bad role robot"), "{}", err.0);
    }

    #[test]
    fn tojson_indent_and_dict_methods() {
        let src = "{{ x | tojson(indent=2) }}|{% for k, v in x.items() %}{{ k }}={{ v }};{% endfor %}|{{ x.get('missing', 'dflt') }}|{{ 'a,b'.split(',') | length }}|{{ strftime_now('%Y') | length }}";
        let t = ChatTemplate::new(Some(src), None, None).unwrap();
        let mut kw = Map::new();
        kw.insert("x".into(), json!({"b": 1, "a": "é<"}));
        let out = t.render(&[], None, false, Some(&kw)).unwrap();
        assert_eq!(out, "{\n  \"b\": 1,\n  \"a\": \"é<\"\n}|b=1;a=é<;|dflt|2|4");
    }

    #[test]
    fn compile_error_is_reported() {
        assert!(ChatTemplate::new(Some("{% for %}"), None, None).is_err());
    }
}
