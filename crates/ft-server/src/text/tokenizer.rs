//! The model's tokenizer: a thin wrapper over the HF `tokenizers` crate, loaded from the `tokenizer.json` the
//! worker points at (`EngineDescription::tokenizer_path`). Encoding and decoding never take the GIL. Long prompts
//! reuse the ids of text seen before (`segment_cache`: a conversation's history is not encoded again each turn).

use anyhow::{anyhow, Context};
use std::path::Path;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    segments: Option<super::segment_cache::SegmentCache>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size()).finish()
    }
}

impl Tokenizer {
    pub fn from_file(path: impl AsRef<Path>) -> anyhow::Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("{e}"))
            .with_context(|| format!("cannot load tokenizer from {}", path.display()))?;
        Ok(Self::wrap(inner))
    }

    /// From the text of a `tokenizer.json`.
    pub fn from_json(json: &str) -> anyhow::Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_bytes(json.as_bytes()).map_err(|e| anyhow!("bad tokenizer.json: {e}"))?;
        Ok(Self::wrap(inner))
    }

    fn wrap(inner: tokenizers::Tokenizer) -> Self {
        let segments = super::segment_cache::SegmentCache::new(&inner);
        if segments.is_none() {
            tracing::debug!("tokenizer: no segment cache (its added tokens or pre-tokenizer do not split exactly)");
        }
        Tokenizer { inner, segments }
    }

    /// The segment cache's (pieces found, pieces encoded and kept, bytes kept); `None` where it is off.
    pub fn segment_counters(&self) -> Option<(u64, u64, usize)> {
        self.segments.as_ref().map(|s| s.counters())
    }

    /// Ids without the segment cache (its reference, for tests and benchmarks).
    pub fn encode_plain(&self, text: &str, add_special_tokens: bool) -> anyhow::Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| anyhow!("tokenization failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) are always recognised;
    /// `add_special_tokens` runs the tokenizer's post-processor (which may add BOS/EOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> anyhow::Result<Vec<u32>> {
        match &self.segments {
            // the cache is only built for tokenizers whose post-processor adds nothing: the same ids either way
            Some(cache) if text.len() >= super::segment_cache::MIN_CACHED_BYTES => {
                cache.encode(&self.inner, text).map_err(|e| anyhow!("tokenization failed: {e}"))
            }
            _ => self.encode_plain(text, add_special_tokens),
        }
    }

    /// Like [`encode`](Self::encode) with the post-processor, then `bos` prepended unless already first.
    pub fn encode_with_bos(&self, text: &str, bos: Option<u32>) -> anyhow::Result<Vec<u32>> {
        let mut ids = self.encode(text, true)?;
        if let Some(bos) = bos {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Text of `ids`; bytes that do not form complete UTF-8 characters come out as U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> anyhow::Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| anyhow!("detokenization failed: {e}"))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The wrapped HF tokenizer, for anything this wrapper does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
