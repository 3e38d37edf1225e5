//! Parser tests. Most go through `check`, which parses the output whole, then in every three-way split and
//! in hundreds of random splits, and requires the same events each time (ids aside), plus the invariants
//! any event stream must keep.

use super::*;
use crate::text::split_testing::{all_three_way_splits, random_split};
use serde_json::json;

const CODER: ToolCallFormat = ToolCallFormat::Qwen3Coder;
const HERMES: ToolCallFormat = ToolCallFormat::Hermes;

fn tools() -> Vec<ToolSpec> {
    static TOOLS: std::sync::OnceLock<Vec<ToolSpec>> = std::sync::OnceLock::new();
    TOOLS.get_or_init(make_tools).clone()
}

fn make_tools() -> Vec<ToolSpec> {
    let t = |v: Json| ToolSpec::from_openai_tools(&[v]).remove(0);
    vec![
        t(
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "detailed": {"type": "boolean"},
            "units": {"type": "string", "enum": ["c", "f"]}}}}}),
        ),
        t(
            json!({"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}}}}}),
        ),
        t(
            json!({"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
            "options": {"type": "object"}, "tags": {"type": "array"}, "ratio": {"type": "number"},
            "limit": {"type": ["integer", "null"]}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}),
        ),
        t(json!({"type": "function", "function": {"name": "ping"}})),
    ]
}

fn on_header() -> ToolParserOptions {
    ToolParserOptions::default()
}

fn on_close() -> ToolParserOptions {
    ToolParserOptions { commit: CallCommit::OnClose, ..Default::default() }
}

/// All events of one run, merged across pushes, ids checked and replaced by "ID".
fn run(format: ToolCallFormat, opts: ToolParserOptions, deltas: &[String]) -> Vec<ToolEvent> {
    let mut p = format.parser(tools(), opts);
    let mut all = Vec::new();
    for d in deltas {
        all.extend(p.push(d));
    }
    all.extend(p.finish());
    check_invariants(&all, p.calls());
    merge(
        all.into_iter()
            .map(|e| match e {
                ToolEvent::CallStart { index, id, name } => {
                    assert!(
                        id.starts_with("call_") && id.len() == 29 && id[5..].chars().all(|c| c.is_ascii_alphanumeric()),
                        "{id}"
                    );
                    ToolEvent::CallStart { index, id: "ID".into(), name }
                }
                e => e,
            })
            .collect(),
    )
}

/// Indices from 0 in order, arguments only inside their call, every call ended once with a JSON object.
fn check_invariants(events: &[ToolEvent], calls: usize) {
    let mut open: Option<usize> = None;
    let mut next = 0;
    let mut args = String::new();
    for e in events {
        match e {
            ToolEvent::Text(t) => {
                assert!(open.is_none(), "text inside a call: {events:?}");
                assert!(!t.is_empty());
            }
            ToolEvent::CallStart { index, .. } => {
                assert!(open.is_none());
                assert_eq!(*index, next);
                open = Some(*index);
                args.clear();
            }
            ToolEvent::CallArguments { index, delta } => {
                assert_eq!(open, Some(*index));
                args.push_str(delta);
            }
            ToolEvent::CallEnd { index, .. } => {
                assert_eq!(open, Some(*index));
                let v: Json = serde_json::from_str(&args).unwrap_or_else(|e| panic!("arguments {args:?}: {e}"));
                assert!(v.is_object(), "{args}");
                open = None;
                next += 1;
            }
        }
    }
    assert!(open.is_none(), "a call never ended: {events:?}");
    assert_eq!(next, calls);
}

/// The whole-text events, required of every split.
fn check(format: ToolCallFormat, opts: ToolParserOptions, text: &str) -> Vec<ToolEvent> {
    let expect = run(format, opts, &[text.to_string()]);
    if text.chars().count() <= 160 {
        for split in all_three_way_splits(text) {
            assert_eq!(run(format, opts, &split), expect, "split {split:?}");
        }
    }
    for seed in 0..300 {
        let split = random_split(text, seed, 1 + (seed as usize % 9));
        assert_eq!(run(format, opts, &split), expect, "split {split:?}");
    }
    expect
}

fn text(t: &str) -> ToolEvent {
    ToolEvent::Text(t.into())
}
fn start(index: usize, name: &str) -> ToolEvent {
    ToolEvent::CallStart { index, id: "ID".into(), name: name.into() }
}
fn args(index: usize, delta: &str) -> ToolEvent {
    ToolEvent::CallArguments { index, delta: delta.into() }
}
fn end(index: usize, complete: bool) -> ToolEvent {
    ToolEvent::CallEnd { index, complete }
}

/// (content, [(name, arguments as JSON, complete)]) of a run.
fn summary(events: &[ToolEvent]) -> (String, Vec<(String, Json, bool)>) {
    let mut p = ParsedOutput::default();
    for e in events {
        p.apply(e);
    }
    (
        p.content,
        p.calls.into_iter().map(|c| (c.name, serde_json::from_str(&c.arguments).unwrap(), c.complete)).collect(),
    )
}

/// A parse summarised: the text, and each call as (name, arguments, closed).
type Summary = (String, Vec<(String, Json, bool)>);

fn both(format: ToolCallFormat, t: &str) -> [Summary; 2] {
    [summary(&check(format, on_header(), t)), summary(&check(format, on_close(), t))]
}

const WEATHER_CODER: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

// ---------------------------------------------------------------------------------------------------------
// qwen3_coder

#[test]
fn coder_one_call_with_text_before() {
    let t = format!("Let me check.\n\n{WEATHER_CODER}");
    let expect = vec![
        text("Let me check."),
        start(0, "get_weather"),
        args(0, "{\"city\": \"Paris\", \"days\": 3}"),
        end(0, true),
    ];
    assert_eq!(check(CODER, on_header(), &t), expect);
    assert_eq!(check(CODER, on_close(), &t), expect);
}

#[test]
fn coder_types_from_the_schema() {
    let t = "<tool_call>\n<function=configure>\n<parameter=options>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n<parameter=ratio>\n0.25\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n<parameter=note>\nNone\n</parameter>\n</function>\n</tool_call>";
    for s in both(CODER, t) {
        assert_eq!(s.0, "");
        assert_eq!(
            s.1,
            vec![(
                "configure".into(),
                json!({"options": {"a": [1, 2]}, "tags": ["x", "y"], "ratio": 0.25, "limit": null, "note": null}),
                true
            )]
        );
    }
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nthree\n</parameter>\n<parameter=detailed>\nTrue\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>";
    for s in both(CODER, t) {
        // A string stays a string; an integer that is not one falls back to its text; undeclared: string.
        assert_eq!(s.1[0].1, json!({"city": "42", "days": "three", "detailed": true, "extra": "7"}));
    }
}

#[test]
fn coder_string_values_keep_their_text() {
    let content = "fn main() {\n    println!(\"hi \\\\ there\");\n}\n\n// end\t✓ 😀";
    let t = format!("<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.rs\n</parameter>\n<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call>");
    for s in both(CODER, &t) {
        assert_eq!(s.1[0].1, json!({"path": "/tmp/a.rs", "content": content}));
    }
    // Only one newline on each side is the template's.
    let t = "<tool_call>\n<function=write_file>\n<parameter=content>\n\nx\n\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(both(CODER, t)[0].1[0].1, json!({"content": "\nx\n"}));
    let t = "<tool_call><function=write_file><parameter=content>x</parameter></function></tool_call>";
    assert_eq!(both(CODER, t)[0].1[0].1, json!({"content": "x"}));
    let t = "<tool_call>\n<function=write_file>\n<parameter=content>\n\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(both(CODER, t)[0].1[0].1, json!({"content": ""}));
}

#[test]
fn coder_literal_closing_tags_inside_a_value() {
    // XML written to a file: its own </parameter> and </function> are followed by text, so they are value.
    let content = "<x>\n</parameter> not the end\n</function> nor this\n<parameter=y> or this\n</x>";
    let t = format!("<tool_call>\n<function=write_file>\n<parameter=content>\n{content}\n</parameter>\n<parameter=path>\nf.xml\n</parameter>\n</function>\n</tool_call>");
    for s in both(CODER, &t) {
        assert_eq!(s.1, vec![("write_file".into(), json!({"content": content, "path": "f.xml"}), true)]);
    }
}

#[test]
fn coder_missing_closing_tags() {
    // </parameter> left out before </function>.
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>";
    for s in both(CODER, t) {
        assert_eq!(s.1, vec![("get_weather".into(), json!({"city": "Paris"}), true)]);
    }
    // </parameter> left out before the next declared parameter.
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";
    for s in both(CODER, t) {
        assert_eq!(s.1, vec![("get_weather".into(), json!({"city": "Paris", "days": 2}), true)]);
    }
    // </function> left out.
    let t = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</tool_call>";
    for s in both(CODER, t) {
        assert_eq!(s.1, vec![("get_weather".into(), json!({"days": 2}), true)]);
    }
}

#[test]
fn coder_no_parameters() {
    let t = "<tool_call>\n<function=ping>\n</function>\n</tool_call>";
    let expect = vec![start(0, "ping"), args(0, "{}"), end(0, true)];
    assert_eq!(check(CODER, on_header(), t), expect);
    assert_eq!(check(CODER, on_close(), t), expect);
}

#[test]
fn coder_parallel_calls_and_text_around() {
    let t = format!("Two calls:\n{WEATHER_CODER}\n{WEATHER_CODER}\n\nDone.  ");
    let expect = vec![
        text("Two calls:"),
        start(0, "get_weather"),
        args(0, "{\"city\": \"Paris\", \"days\": 3}"),
        end(0, true),
        start(1, "get_weather"),
        args(1, "{\"city\": \"Paris\", \"days\": 3}"),
        end(1, true),
        text("Done.  "),
    ];
    assert_eq!(check(CODER, on_header(), &t), expect);
    assert_eq!(check(CODER, on_close(), &t), expect);
    // parallel_tool_calls: false keeps the first call only.
    for commit in [CallCommit::OnHeader, CallCommit::OnClose] {
        let opts = ToolParserOptions { commit, parallel_tool_calls: false };
        let events = check(CODER, opts, &t);
        assert_eq!(
            events,
            vec![expect[0].clone(), expect[1].clone(), expect[2].clone(), expect[3].clone(), text("Done.  ")]
        );
    }
}

#[test]
fn coder_not_calls_stay_text() {
    for t in [
        "Use <tool_call> tags to call tools.",
        "<tool_call>\n<function=unknown_tool>\n</function>\n</tool_call>",
        "<tool_call>\n<function=bad name>\n</function>\n</tool_call>",
        "<tool_call>",
        "<tool_call>\n<function=get_weat",
        "<tool_call>\n<function=get_weather",
        "a </tool_call> b </function>",
        "<tool_call",
        "<<tool_call>>",
        "",
        "  \n ",
    ] {
        for commit in [CallCommit::OnHeader, CallCommit::OnClose] {
            let events = check(CODER, ToolParserOptions { commit, ..Default::default() }, t);
            let expect = if t.is_empty() { vec![] } else { vec![text(t)] };
            assert_eq!(events, expect, "{t:?}");
        }
    }
    // A mention first, then a real call: the mention is text, the call a call.
    let t = format!("I will use <tool_call> now: {WEATHER_CODER}");
    for s in both(CODER, &t) {
        assert_eq!(s.0, "I will use <tool_call> now:");
        assert_eq!(s.1.len(), 1);
    }
}

#[test]
fn coder_cut_off_calls() {
    let t = "Sure.\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/x\n</parameter>\n<parameter=content>\nhello\nwor";
    // Streamed: the call comes out closed with what was parsed, marked incomplete.
    assert_eq!(
        summary(&check(CODER, on_header(), t)),
        ("Sure.".into(), vec![("write_file".into(), json!({"path": "/tmp/x", "content": "hello\nwor"}), false)])
    );
    // Strict: a call that never closed is text, verbatim.
    assert_eq!(check(CODER, on_close(), t), vec![text(t)]);
    // Cut inside a typed value, inside a tag, after </function>.
    for (t, args) in [
        ("<tool_call>\n<function=get_weather>\n<parameter=days>\n1", json!({"days": 1})),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param", json!({"city": "Paris\n</param"})),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>", json!({"city": "Paris"})),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_",
            json!({"city": "Paris"}),
        ),
        ("<tool_call>\n<function=get_weather>\n<parameter=ci", json!({})),
        ("<tool_call>\n<function=get_weather>", json!({})),
    ] {
        assert_eq!(summary(&check(CODER, on_header(), t)).1, vec![("get_weather".into(), args, false)], "{t:?}");
        assert_eq!(check(CODER, on_close(), t), vec![text(t)], "{t:?}");
    }
}

#[test]
fn coder_malformed_body() {
    let t = "<tool_call>\n<function=get_weather>\nchatter\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call> after";
    assert_eq!(
        summary(&check(CODER, on_header(), t)),
        ("after".into(), vec![("get_weather".into(), json!({"city": "Paris"}), false)])
    );
    assert_eq!(check(CODER, on_close(), t), vec![text(t)]);
    // Junk after </function>: skipped to </tool_call>.
    let t = "<tool_call>\n<function=ping>\n</function>\njunk <x> \n</tool_call>";
    assert_eq!(summary(&check(CODER, on_header(), t)).1, vec![("ping".into(), json!({}), false)]);
    assert_eq!(check(CODER, on_close(), t), vec![text(t)]);
}

#[test]
fn coder_streams_before_the_call_closes() {
    let mut p = CODER.parser(tools(), on_header());
    let mut events = p.push("<tool_call>\n<function=write_file>\n<parameter=content>\nline one\nline t");
    events.extend(p.push("wo\n"));
    let streamed: String = events
        .iter()
        .filter_map(|e| match e {
            ToolEvent::CallArguments { delta, .. } => Some(delta.as_str()),
            _ => None,
        })
        .collect();
    assert!(matches!(events[0], ToolEvent::CallStart { .. }));
    // The last newline is held: it may be the template's.
    assert_eq!(streamed, "{\"content\": \"line one\\nline two");
    assert!(p
        .push("</parameter>\n</function>\n</tool_call>")
        .iter()
        .any(|e| matches!(e, ToolEvent::CallEnd { complete: true, .. })));
    // Strict mode gives nothing before the close.
    let mut p = CODER.parser(tools(), on_close());
    assert!(p.push("<tool_call>\n<function=write_file>\n<parameter=content>\nline one\n").is_empty());
    // Plain text is not held back longer than a possible tag.
    let mut p = CODER.parser(tools(), on_header());
    assert_eq!(p.push("Hello <tool"), vec![text("Hello")]);
    assert_eq!(p.push("box> x"), vec![text(" <toolbox> x")]);
}

#[test]
fn coder_random_outputs() {
    // Random mixes of text, calls, partial tags and multi-byte text: every split agrees, invariants hold.
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let pieces = [
        "hello ",
        "é😀 ",
        "<tool_call>",
        "</tool_call>",
        "\n",
        "<function=get_weather>",
        "<function=nope>",
        "<parameter=city>",
        "<parameter=days>",
        "</parameter>",
        "</function>",
        "12",
        "Paris",
        "<",
        WEATHER_CODER,
    ];
    let mut rng = StdRng::seed_from_u64(7);
    for _ in 0..150 {
        let n = rng.gen_range(1..12);
        let t: String = (0..n).map(|_| pieces[rng.gen_range(0..pieces.len())]).collect();
        for commit in [CallCommit::OnHeader, CallCommit::OnClose] {
            let opts = ToolParserOptions { commit, ..Default::default() };
            let events = run(CODER, opts, std::slice::from_ref(&t));
            for seed in 0..40 {
                assert_eq!(run(CODER, opts, &random_split(&t, seed, 5)), events, "{t:?}");
            }
            if commit == CallCommit::OnClose {
                // Nothing is lost: content plus the calls' raw text is the output (whitespace aside).
                let s = summary(&events);
                if s.1.is_empty() {
                    assert_eq!(s.0.trim(), t.trim(), "{t:?}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// hermes

const WEATHER_HERMES: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>";

#[test]
fn hermes_one_call() {
    let t = format!("Checking.\n{WEATHER_HERMES}");
    let expect =
        vec![text("Checking."), start(0, "get_weather"), args(0, "{\"city\": \"Paris\", \"days\": 3}"), end(0, true)];
    assert_eq!(check(HERMES, on_header(), &t), expect);
    assert_eq!(check(HERMES, on_close(), &t), expect);
}

#[test]
fn hermes_parallel_nested_and_unicode() {
    let t = "<tool_call>\n{\"name\":\"configure\",\"arguments\":{\"options\":{\"a\":[1,{\"b\":null}]},\"tags\":[\"é\",\"😀\"],\"ratio\":-1.5e-3}}\n</tool_call>\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>";
    for s in both(HERMES, t) {
        assert_eq!(
            s.1,
            vec![
                (
                    "configure".into(),
                    json!({"options": {"a": [1, {"b": null}]}, "tags": ["é", "😀"], "ratio": -1.5e-3}),
                    true
                ),
                ("ping".into(), json!({}), true),
            ]
        );
    }
}

#[test]
fn hermes_other_shapes_parse_whole() {
    for t in [
        "<tool_call>\n{\"arguments\": {\"city\": \"Paris\"}, \"name\": \"get_weather\"}\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}\n</tool_call>",
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>",
    ] {
        for s in both(HERMES, t) {
            assert_eq!(s, ("".into(), vec![("get_weather".into(), json!({"city": "Paris"}), true)]), "{t}");
        }
    }
    // No arguments at all.
    assert_eq!(
        both(HERMES, "<tool_call>{\"name\": \"ping\"}</tool_call>")[0].1,
        vec![("ping".into(), json!({}), true)]
    );
}

#[test]
fn hermes_close_tag_inside_a_string() {
    let t = "<tool_call>\n{\"name\": \"write_file\", \"arguments\": {\"content\": \"a </tool_call> b\"}}\n</tool_call>";
    for s in both(HERMES, t) {
        assert_eq!(s.1, vec![("write_file".into(), json!({"content": "a </tool_call> b"}), true)]);
    }
    // Also on the whole-parse path.
    let t = "<tool_call>\n{\"arguments\": {\"content\": \"a </tool_call> b\"}, \"name\": \"write_file\"}\n</tool_call>";
    for s in both(HERMES, t) {
        assert_eq!(s.1, vec![("write_file".into(), json!({"content": "a </tool_call> b"}), true)]);
    }
}

#[test]
fn hermes_raw_newlines_in_strings() {
    let t = "<tool_call>\n{\"name\": \"write_file\", \"arguments\": {\"content\": \"line1\nline2\"}}\n</tool_call>";
    for s in both(HERMES, t) {
        assert_eq!(s.1, vec![("write_file".into(), json!({"content": "line1\nline2"}), true)]);
    }
}

#[test]
fn hermes_not_calls_stay_text() {
    for t in [
        "Use <tool_call> to call.",
        "<tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"arguments\": {}, \"name\": \"unknown\"}\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": [1]}\n</tool_call>",
        "<tool_call>\n{not json}\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
        "<tool_call>\n{\"name\": \"get_we",
        "<tool_call>\n[1, 2]\n</tool_call>",
    ] {
        assert_eq!(check(HERMES, on_close(), t), vec![text(t)], "{t:?}");
    }
    // Prose after the tag is released at once, not held until the output ends.
    let mut p = HERMES.parser(tools(), on_header());
    assert_eq!(p.push("see <tool_call> tags"), vec![text("see <tool_call> tags")]);
}

#[test]
fn hermes_cut_off_and_malformed_streamed() {
    for (t, args) in [
        ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par", json!({"city": "Par"})),
        ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"da", json!({"city": "Paris"})),
        ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 1", json!({"days": 1})),
        ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"detailed\": tr", json!({})),
        ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a\\", json!({"city": "a"})),
        ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool", json!({})),
        // Malformed inside the arguments (Python literal): closed where it went wrong, rest dropped.
        (
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"X\", \"detailed\": True}}\n</tool_call>",
            json!({"city": "X"}),
        ),
        // Missing the call object's closing brace.
        ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 2}\n</tool_call>", json!({"days": 2})),
    ] {
        assert_eq!(summary(&check(HERMES, on_header(), t)).1, vec![("get_weather".into(), args, false)], "{t:?}");
        assert_eq!(check(HERMES, on_close(), t), vec![text(t)], "{t:?}");
    }
}

#[test]
fn hermes_streams_arguments() {
    let mut p = HERMES.parser(tools(), on_header());
    let events = p.push("<tool_call>\n{\"name\": \"write_file\", \"arguments\": {\"content\": \"abc");
    assert_eq!(events, vec![events[0].clone(), args(0, "{\"content\": \"abc")]);
    assert!(matches!(&events[0], ToolEvent::CallStart { name, .. } if name == "write_file"));
    assert_eq!(p.push("def\"}}\n</tool_call>"), vec![args(0, "def\"}"), end(0, true)]);
    assert_eq!(p.calls(), 1);
}

#[test]
fn hermes_random_outputs() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let pieces = [
        "hi ",
        "ü ",
        "<tool_call>",
        "</tool_call>",
        "\n",
        "{\"name\": \"get_weather\", ",
        "\"arguments\": ",
        "{\"city\": \"Pa",
        "ris\"}",
        "}",
        "{",
        "\"",
        "[1, 2]",
        WEATHER_HERMES,
    ];
    let mut rng = StdRng::seed_from_u64(11);
    for _ in 0..150 {
        let n = rng.gen_range(1..12);
        let t: String = (0..n).map(|_| pieces[rng.gen_range(0..pieces.len())]).collect();
        for commit in [CallCommit::OnHeader, CallCommit::OnClose] {
            let opts = ToolParserOptions { commit, ..Default::default() };
            let events = run(HERMES, opts, std::slice::from_ref(&t));
            for seed in 0..40 {
                assert_eq!(run(HERMES, opts, &random_split(&t, seed, 5)), events, "{t:?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// registry, ids, helpers

#[test]
fn registry_names() {
    assert_eq!(ToolCallFormat::from_name("qwen3_coder"), Ok(CODER));
    for n in ["qwen", "qwen25", "hermes"] {
        assert_eq!(ToolCallFormat::from_name(n), Ok(HERMES));
    }
    let err = ToolCallFormat::from_name("nonsense_xyz").unwrap_err();
    assert_eq!(
        err,
        "unknown --tool-call-parser \"nonsense_xyz\" (valid: qwen3_coder, qwen, qwen25, hermes, auto, off)"
    );
    assert_eq!(ToolCallFormat::resolve(Some("off"), "qwen3_5_moe", None), Ok(None));
    assert!(ToolCallFormat::resolve(Some("nonsense_xyz"), "qwen3", None).is_err());
    assert_eq!(ToolCallFormat::resolve(Some("hermes"), "qwen3_5_moe", None), Ok(Some(HERMES)));
}

#[test]
fn auto_resolution() {
    let coder_template = "{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}{{- '<parameter=' + k + '>' }}";
    let hermes_template = "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
    assert_eq!(ToolCallFormat::resolve(None, "llama", Some(coder_template)), Ok(Some(CODER)));
    assert_eq!(ToolCallFormat::resolve(Some("auto"), "qwen3_5_moe", Some(hermes_template)), Ok(Some(HERMES)));
    assert_eq!(ToolCallFormat::resolve(None, "qwen3_5_moe", None), Ok(Some(CODER)));
    assert_eq!(ToolCallFormat::resolve(None, "qwen3_5_moe", Some("no tools here")), Ok(Some(CODER)));
    assert_eq!(ToolCallFormat::resolve(None, "Qwen3_5MoeForConditionalGeneration", None), Ok(Some(CODER)));
    for arch in ["qwen2", "qwen3", "qwen3_moe", "qwen3_next", "Qwen3MoeForCausalLM", "Qwen2ForCausalLM"] {
        assert_eq!(ToolCallFormat::resolve(None, arch, None), Ok(Some(HERMES)), "{arch}");
    }
    assert_eq!(ToolCallFormat::resolve(None, "llama", Some("{{ messages }}")), Ok(None));
    assert_eq!(ToolCallFormat::resolve(None, "llama", None), Ok(None));
    assert_eq!(ToolCallFormat::resolve(None, "LlamaForCausalLM", None), Ok(None));
}

#[test]
fn ids_are_random() {
    let a = new_call_id();
    let b = new_call_id();
    assert_ne!(a, b);
    assert_eq!(a.len(), 29);
}

#[test]
fn tool_specs_from_openai_tools() {
    let specs = ToolSpec::from_openai_tools(&[
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
        json!({"type": "function", "function": {"name": "g"}}),
        json!({"type": "function", "function": {}}),
    ]);
    assert_eq!(specs.len(), 2);
    assert_eq!(specs[0].parameters, json!({"type": "object"}));
    assert_eq!(specs[1].parameters, Json::Null);
}

#[test]
fn no_declared_tools_accepts_any_name() {
    let mut p = CODER.parser(Vec::new(), on_header());
    let out = ParsedOutput::parse(
        p.as_mut(),
        "<tool_call>\n<function=anything>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>",
    );
    assert_eq!(out.calls.len(), 1);
    assert_eq!(out.calls[0].name, "anything");
    // Without a schema every value is a string.
    assert_eq!(out.calls[0].arguments, "{\"n\": \"5\"}");
    assert!(out.calls[0].complete);
}

#[test]
fn parsed_output_whole() {
    let mut p = HERMES.parser(tools(), on_close());
    let out = ParsedOutput::parse(p.as_mut(), &format!("A {WEATHER_HERMES} B"));
    // Whitespace touching a call is not content, on either side.
    assert_eq!(out.content, "AB");
    assert_eq!(out.calls.len(), 1);
    assert_eq!(out.calls[0].arguments, "{\"city\": \"Paris\", \"days\": 3}");
}
