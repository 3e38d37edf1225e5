//! Incremental detokenization of one request's output (the prefix/read-offset scheme of vLLM and TGI).
//!
//! Decoding token by token is wrong twice over: byte-level BPE splits one character over several tokens,
//! and SentencePiece decoders drop the leading space of the first token they see. So each step decodes a
//! short window twice and emits only what the newest tokens added:
//!
//! ```text
//!   ids:   [ ... prompt tail ... | out0 out1 out2 | out3 ]
//!                 prefix_offset ^    read_offset ^      ^ len
//!   prefix_text = decode(ids[prefix_offset..read_offset])
//!   new_text    = decode(ids[prefix_offset..])
//!   delta       = new_text[prefix_text.len()..]   unless new_text ends in U+FFFD (a character still split)
//! ```
//!
//! A delta that ends in U+FFFD is held back (both offsets stay) until the character's last byte arrives.

use crate::text::tokenizer::Tokenizer;

/// How many prompt tokens seed the window, so the first output token decodes in context.
const PROMPT_CONTEXT_TOKENS: usize = 5;

pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// `prompt` gives context (its last few tokens); none of it is emitted.
    pub fn new(prompt: &[u32], skip_special_tokens: bool) -> Self {
        let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        IncrementalDetokenizer { ids: tail.to_vec(), prefix_offset: 0, read_offset: tail.len(), skip_special_tokens }
    }

    /// Adds one token; returns the text it completes (often empty while a character is split).
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> anyhow::Result<String> {
        self.ids.push(token);
        let prefix_text =
            tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens)?;
        let new_text = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if new_text.len() <= prefix_text.len() || new_text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = match new_text.get(prefix_text.len()..) {
            Some(d) if new_text.starts_with(&prefix_text) => d.to_string(),
            // The window decoded differently once extended (rare normalisation effects): emit what is new
            // past the common prefix.
            _ => {
                let common = common_prefix_len(&prefix_text, &new_text);
                new_text[common..].to_string()
            }
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Keep the window short: drop ids before the prefix.
        if self.prefix_offset > 64 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        Ok(delta)
    }

    /// The request ended: whatever is still held back (an incomplete character comes out as U+FFFD).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> anyhow::Result<String> {
        if self.read_offset >= self.ids.len() {
            return Ok(String::new());
        }
        let prefix_text =
            tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens)?;
        let new_text = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        if new_text.len() <= prefix_text.len() {
            return Ok(String::new());
        }
        let common = common_prefix_len(&prefix_text, &new_text);
        Ok(new_text[common..].to_string())
    }
}

/// Length in bytes of the longest common prefix, at a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    let mut n = 0;
    for ((i, ca), cb) in a.char_indices().zip(b.chars()) {
        if ca != cb {
            return i;
        }
        n = i + ca.len_utf8();
    }
    n
}
