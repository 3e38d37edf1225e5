//! Our minijinja rendering against Python jinja2 set up the way HF `transformers` renders chat templates
//! (`trim_blocks`, `lstrip_blocks`, loop controls, its `tojson`), on the project's own Qwen template
//! (`python/freetoken/loading/qwen_tokenizer.py`) and SmolLM2's. Skips when no Python with jinja2 is found
//! (set `FT_PYTHON` to choose the interpreter).

use ft_server::text::chat_template::ChatTemplate;
use serde_json::{json, Value};
use std::io::Write;
use std::process::{Command, Stdio};

const HF_RENDER: &str = r#"
import json, sys
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.ext import loopcontrols
from jinja2.exceptions import TemplateError

def raise_exception(message):
    raise TemplateError(message)

def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

req = json.load(sys.stdin)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
out = []
for case in req["cases"]:
    t = env.from_string(case["template"])
    try:
        out.append(t.render(messages=case["messages"], tools=case["tools"], add_generation_prompt=case["add_generation_prompt"],
                            bos_token=case["bos_token"], eos_token=case["eos_token"], **case["kwargs"]))
    except TemplateError as e:
        out.append({"error": str(e)})
json.dump(out, sys.stdout)
"#;

fn python() -> Option<String> {
    let candidates = match std::env::var("FT_PYTHON") {
        Ok(p) => vec![p],
        Err(_) => {
            let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.venv/bin/python").to_string();
            vec![venv, "python3".into(), "python".into()]
        }
    };
    candidates.into_iter().find(|p| {
        Command::new(p).args(["-c", "import jinja2"]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    })
}

fn qwen_template() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../python/freetoken/loading/qwen_tokenizer.py");
    let src = std::fs::read_to_string(path).expect("qwen_tokenizer.py");
    let start =
        src.find("QWEN_CHAT_TEMPLATE = r\"\"\"").expect("QWEN_CHAT_TEMPLATE") + "QWEN_CHAT_TEMPLATE = r\"\"\"".len();
    let end = start + src[start..].find("\"\"\"").unwrap();
    src[start..end].to_string()
}

const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A template exercising what HF templates lean on: Python string methods, namespace, loop controls,
/// slicing, `tojson` with indent, `is defined`, `raise_exception`.
const FEATURES: &str = r#"{%- set ns = namespace(n=0) -%}
{%- for m in messages[::-1] %}
  {%- if m.role == 'user' and ns.n == 0 %}{% set ns.n = loop.index %}{% endif %}
{%- endfor %}
{{ bos_token }}last user from the end: {{ ns.n }}
{% for m in messages %}
  {% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('Unexpected role: ' + m.role) }}{% endif %}
  {% if loop.index > 3 %}{% break %}{% endif %}
  [{{ m.role | upper }}] {{ m.content.strip() }}{% if m.content.startswith('Q') %} (question){% endif %}
  {%- if m.content.endswith('?') %} ends with ?{% endif %}
  {% if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}
{% endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}
{{ messages[0].content.split(' ')[-1] }} {{ messages[0].content.replace('a', 'A') }} {{ messages | length }}
{%- if add_generation_prompt %}
<|assistant|>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{% endif %}"#;

fn conversations() -> Vec<(Vec<Value>, Value)> {
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city — é ü 😀",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    vec![
        (vec![json!({"role": "user", "content": "Hi"})], Value::Null),
        (
            vec![
                json!({"role": "system", "content": "Be brief and say a lot."}),
                json!({"role": "user", "content": "  Q: what is 2+2?  "}),
                json!({"role": "assistant", "content": "4", "reasoning_content": "easy"}),
                json!({"role": "user", "content": "and 3+3?"}),
            ],
            Value::Null,
        ),
        (
            vec![
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Nice\"}"}}]}),
                json!({"role": "tool", "content": "sunny", "tool_call_id": "c1"}),
                json!({"role": "tool", "content": "rainy", "tool_call_id": "c2"}),
                json!({"role": "assistant", "content": "Sunny in Paris, rainy in Nice."}),
                json!({"role": "user", "content": "Thanks"}),
            ],
            tools.clone(),
        ),
        (vec![json!({"role": "system", "content": "sys a"}), json!({"role": "user", "content": "x"})], tools),
    ]
}

#[test]
fn minijinja_matches_hf_jinja2() {
    let Some(py) = python() else {
        eprintln!("skipped: no Python with jinja2 (set FT_PYTHON)");
        return;
    };
    let mut templates =
        vec![("qwen", qwen_template()), ("smollm2", SMOLLM2.to_string()), ("features", FEATURES.to_string())];
    templates.push(("chatml", ft_server::text::chat_template::CHATML_TEMPLATE.to_string()));
    let mut cases = vec![];
    for (name, template) in &templates {
        for (messages, tools) in conversations() {
            for add_generation_prompt in [true, false] {
                for kwargs in [json!({}), json!({"enable_thinking": false})] {
                    cases.push((name.to_string(), json!({
                        "template": template, "messages": messages, "tools": tools,
                        "add_generation_prompt": add_generation_prompt, "bos_token": "<s>", "eos_token": "<|im_end|>",
                        "kwargs": kwargs,
                    })));
                }
            }
        }
    }
    // A template that refuses a role.
    cases.push((
        "features-error".into(),
        json!({
            "template": FEATURES, "messages": [{"role": "wizard", "content": "x"}], "tools": null,
            "add_generation_prompt": true, "bos_token": "", "eos_token": "", "kwargs": {},
        }),
    ));

    let mut child =
        Command::new(&py).args(["-c", HF_RENDER]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let input = json!({"cases": cases.iter().map(|(_, c)| c.clone()).collect::<Vec<_>>()}).to_string();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "python failed");
    let expected: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(expected.len(), cases.len());

    eprintln!("comparing {} renderings with {py}", cases.len());
    for ((name, case), want) in cases.iter().zip(expected) {
        let t = ChatTemplate::new(
            case["template"].as_str(),
            Some(case["bos_token"].as_str().unwrap().into()),
            Some(case["eos_token"].as_str().unwrap().into()),
        )
        .unwrap();
        let messages = case["messages"].as_array().unwrap();
        let tools = case["tools"].as_array().map(|v| v.as_slice());
        let got =
            t.render(messages, tools, case["add_generation_prompt"].as_bool().unwrap(), case["kwargs"].as_object());
        match (want, got) {
            (Value::String(want), Ok(got)) => assert_eq!(got, want, "template {name}, case {case}"),
            (Value::Object(err), Err(got)) => {
                let msg = err["error"].as_str().unwrap();
                assert!(got.0.contains(msg), "template {name}: {got} vs {msg}");
            }
            (want, got) => panic!("template {name}, case {case}: jinja2 gave {want}, we gave {got:?}"),
        }
    }
}
