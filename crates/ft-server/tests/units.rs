//! Tokenizer wrapper and incremental detokenizer against a real (tiny) byte-level BPE tokenizer.

mod common;

use common::*;
use ft_server::text::detokenizer::IncrementalDetokenizer;

#[test]
fn tokenizer_wrapper() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), VOCAB);
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(IM_START));
    assert_eq!(tok.token_to_id("Hello"), Some(262));
    assert_eq!(tok.id_to_token(IM_END).as_deref(), Some("<|im_end|>"));
    let ids = tok.encode("Hello world", false).unwrap();
    assert_eq!(ids, vec![262, 256, 257, 258]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world");
    // Special tokens in text are recognised; skip_special_tokens drops them on decode.
    let ids = tok.encode("<|im_start|>user\nHi<|im_end|>", false).unwrap();
    assert_eq!(ids.first(), Some(&IM_START));
    assert_eq!(ids.last(), Some(&IM_END));
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHi");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>user\nHi<|im_end|>");
    // Optional BOS, never doubled.
    assert_eq!(tok.encode_with_bos("Hello", Some(ENDOFTEXT)).unwrap(), vec![ENDOFTEXT, 262]);
    assert_eq!(tok.encode_with_bos("<|endoftext|>Hello", Some(ENDOFTEXT)).unwrap(), vec![ENDOFTEXT, 262]);
    assert_eq!(tok.encode_with_bos("Hello", None).unwrap(), vec![262]);
    // From a file too.
    let from_file = ft_server::text::tokenizer::Tokenizer::from_file(write_tokenizer()).unwrap();
    assert_eq!(from_file.vocab_size(), VOCAB);
    assert!(ft_server::text::tokenizer::Tokenizer::from_file("/nonexistent/tokenizer.json").is_err());
}

fn detok_all(prompt: &[u32], ids: &[u32]) -> Vec<String> {
    let tok = tokenizer();
    let mut d = IncrementalDetokenizer::new(prompt, true);
    let mut out: Vec<String> = ids.iter().map(|&t| d.push(&tok, t).unwrap()).collect();
    out.push(d.finish(&tok).unwrap());
    out
}

#[test]
fn emoji_split_over_byte_tokens_is_held_back() {
    let tok = tokenizer();
    let text = "Hi 😀 and é, ü€ 🎉!";
    let ids = tok.encode(text, false).unwrap();
    // The emoji really is split: its bytes are separate tokens that do not decode alone.
    assert!(ids.len() > text.chars().count() - 5);
    let pieces = detok_all(&[], &ids);
    for p in &pieces {
        assert!(!p.contains('\u{FFFD}'), "split character emitted: {pieces:?}");
    }
    assert_eq!(pieces.concat(), text);
    // Some pieces are empty (bytes held until the character completes).
    assert!(pieces.iter().any(|p| p.is_empty()));
    // With a prompt as context, including one that ends in the middle of nowhere special.
    let prompt = tok.encode("<|im_start|>assistant\n", false).unwrap();
    assert_eq!(detok_all(&prompt, &ids).concat(), text);
}

#[test]
fn every_split_point_decodes_the_same() {
    let tok = tokenizer();
    let text = "Hello world 😀😀 Hello ééé";
    let ids = tok.encode(text, false).unwrap();
    for cut in 0..ids.len() {
        // Output begins at `cut`: the prompt is everything before it.
        let pieces = detok_all(&ids[..cut], &ids[cut..]);
        let expected = tok.decode(&ids, true).unwrap();
        let prefix = tok.decode(&ids[..cut], true).unwrap();
        let joined = pieces.concat();
        assert!(!joined.contains('\u{FFFD}') || prefix.contains('\u{FFFD}'), "cut {cut}: {pieces:?}");
        if !prefix.contains('\u{FFFD}') {
            assert_eq!(format!("{prefix}{joined}"), expected, "cut {cut}");
        }
    }
}

#[test]
fn special_tokens_and_incomplete_tail() {
    let tok = tokenizer();
    let mut ids = tok.encode("ok", false).unwrap();
    ids.push(IM_END);
    assert_eq!(detok_all(&[], &ids).concat(), "ok");
    // A stream that ends inside a character flushes it as U+FFFD rather than dropping bytes silently.
    let emoji = tok.encode("😀", false).unwrap();
    assert_eq!(emoji.len(), 4);
    let pieces = detok_all(&[], &emoji[..2]);
    assert_eq!(pieces[..2].concat(), "");
    assert!(pieces[2].contains('\u{FFFD}'));
}

#[test]
fn long_outputs_keep_a_short_window() {
    let tok = tokenizer();
    let text = "Hello world ".repeat(200);
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(detok_all(&[], &ids).concat(), text);
}
