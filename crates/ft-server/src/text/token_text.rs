//! One token's own bytes and text, for logprobs (OpenAI's `token` and `bytes` fields): what the token adds to
//! the output by itself, whatever comes before it.
//!
//! Decoding one id alone is lossy twice over: a byte-level BPE token may hold part of a UTF-8 character
//! (decoding gives U+FFFD), and SentencePiece decoders drop the leading space of the first token they see. So
//! the bytes come from the vocabulary piece:
//!
//! ```text
//!   ByteLevel decoder (GPT-2, Qwen, SmolLM)   "Ġworld" ─GPT-2 byte table─▶ b" world",  "ðŁ" ─▶ [0xF0, 0x9F]
//!   SentencePiece pieces                      "▁world" ─▶ b" world",  "<0xF0>" (byte fallback) ─▶ [0xF0]
//!   anything else                             decode([id]) as UTF-8
//! ```
//!
//! Added tokens (`<|im_end|>`) are their own content. The text is the bytes as UTF-8, a split character as
//! U+FFFD (the `bytes` field keeps it exact).

use crate::text::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::sync::LazyLock;
use tokenizers::DecoderWrapper;

/// GPT-2's printable character of each byte, inverted: the byte a byte-level piece's character stands for.
static BYTE_OF_CHAR: LazyLock<HashMap<char, u8>> = LazyLock::new(|| {
    let printable = |b: u32| (33..=126).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut shifted = 0;
    (0..=255u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            (char::from_u32(c).expect("a valid char"), b as u8)
        })
        .collect()
});

/// The bytes `id` stands for (empty for an id outside the vocabulary).
pub fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    let Some(piece) = tokenizer.id_to_token(id) else { return Vec::new() };
    if is_added(tokenizer, id) {
        return piece.into_bytes();
    }
    if byte_level(tokenizer) {
        return piece.chars().map(|c| BYTE_OF_CHAR.get(&c).copied()).collect::<Option<Vec<u8>>>().unwrap_or_else(
            || piece.clone().into_bytes(), // not a byte-level piece after all
        );
    }
    if let Some(byte) = byte_fallback(&piece) {
        return vec![byte];
    }
    if piece.contains('\u{2581}') {
        return piece.replace('\u{2581}', " ").into_bytes();
    }
    tokenizer.decode(&[id], false).map(String::into_bytes).unwrap_or_default()
}

/// The text of `id` alone: its bytes as UTF-8 (a split character as U+FFFD).
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(&token_bytes(tokenizer, id)).into_owned()
}

fn is_added(tokenizer: &Tokenizer, id: u32) -> bool {
    tokenizer.inner().get_added_vocabulary().simple_id_to_token(id).is_some()
}

/// Whether the tokenizer decodes with GPT-2's byte-level scheme (alone or in a sequence of decoders).
fn byte_level(tokenizer: &Tokenizer) -> bool {
    match tokenizer.inner().get_decoder() {
        Some(DecoderWrapper::ByteLevel(_)) => true,
        Some(DecoderWrapper::Sequence(seq)) => {
            seq.get_decoders().iter().any(|d| matches!(d, DecoderWrapper::ByteLevel(_)))
        }
        _ => false,
    }
}

/// A SentencePiece byte-fallback piece `<0xHH>`.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_round_trips() {
        assert_eq!(BYTE_OF_CHAR.len(), 256);
        assert_eq!(BYTE_OF_CHAR[&'Ġ'], b' ');
        assert_eq!(BYTE_OF_CHAR[&'a'], b'a');
        assert_eq!(BYTE_OF_CHAR[&'Ċ'], b'\n');
        assert_eq!(byte_fallback("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_fallback("<0x0AB>"), None);
        assert_eq!(byte_fallback("hello"), None);
    }
}
