//! Token ids of the text between added tokens, remembered across requests.
//!
//! A chat request's prompt is the whole conversation rendered by the template: at turn 10 of an agent session of
//! 30k tokens only the last turn's text is new, yet encoding all of it again costs ~1-3 us a token (30-90 ms, more
//! than the cached turn's prefill on the H200). The tokenizer splits its input on added tokens (`<|im_start|>`,
//! `<tool_call>`, ...) before anything else and encodes each piece between them by itself, so a piece's ids do not
//! depend on what surrounds it: [`SegmentCache`] splits the text the same way (leftmost-longest matches of the
//! added tokens' contents), looks up every piece by its text, and encodes only the pieces it has not seen. Short
//! pieces are kept too: the tokenizer's fixed cost per call (~20-50 us) made a turn's many short pieces (role
//! headers, a thought, a tool call) cost as much as the long ones.
//!
//! Used only where that split is exactly the tokenizer's ([`SegmentCache::new`] returns `None` otherwise): every
//! added token matched on the raw text as written (not normalized, no lstrip / rstrip / single_word), no Metaspace
//! pre-tokenizer (its prefix depends on the piece's position), a post-processor that adds no tokens, no truncation or
//! padding, and a probe text that encodes the same both ways.

use aho_corasick::{AhoCorasick, MatchKind};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// Shorter prompts are encoded whole, without the cache (`Tokenizer::encode`).
pub const MIN_CACHED_BYTES: usize = 256;
/// The cache keeps pieces (text, ids and bookkeeping) up to this many bytes, least recently used out first.
pub const MAX_CACHED_BYTES: usize = 64 << 20;
/// Bytes an entry costs beyond its text and ids (the two maps' nodes, the shared pointers), counted in the budget
/// so that many tiny pieces cannot outgrow it.
const ENTRY_OVERHEAD: usize = 96;

pub struct SegmentCache {
    matcher: AhoCorasick,
    ids: Vec<u32>,
    entries: Mutex<Entries>,
}

#[derive(Default)]
struct Entries {
    by_text: HashMap<Arc<str>, (Arc<[u32]>, u64)>,
    by_use: BTreeMap<u64, Arc<str>>,
    clock: u64,
    bytes: usize,
    hits: u64,
    misses: u64,
}

impl Entries {
    fn get(&mut self, text: &str) -> Option<Arc<[u32]>> {
        self.clock += 1;
        let Some((ids, stamp)) = self.by_text.get_mut(text) else {
            self.misses += 1;
            return None;
        };
        // the recency list's entry for the old stamp holds the key: move it to the new one
        let key = self.by_use.remove(&std::mem::replace(stamp, self.clock)).expect("every entry is stamped");
        self.by_use.insert(self.clock, key);
        self.hits += 1;
        Some(ids.clone())
    }

    fn put(&mut self, text: &str, ids: Arc<[u32]>) {
        let size = entry_size(text, &ids);
        if size > MAX_CACHED_BYTES || self.by_text.contains_key(text) {
            return;
        }
        while self.bytes + size > MAX_CACHED_BYTES {
            let Some((_, oldest)) = self.by_use.pop_first() else { break };
            if let Some((ids, _)) = self.by_text.remove(&oldest) {
                self.bytes -= entry_size(&oldest, &ids);
            }
        }
        self.clock += 1;
        let key: Arc<str> = Arc::from(text);
        self.by_use.insert(self.clock, key.clone());
        self.by_text.insert(key, (ids, self.clock));
        self.bytes += size;
    }
}

fn entry_size(text: &str, ids: &[u32]) -> usize {
    text.len() + 4 * ids.len() + ENTRY_OVERHEAD
}

impl SegmentCache {
    /// A cache for `tok`, or `None` where splitting on added tokens would not give the tokenizer's own ids.
    pub fn new(tok: &tokenizers::Tokenizer) -> Option<Self> {
        let added = tok.get_added_tokens_decoder();
        if added.values().any(|t| t.normalized || t.lstrip || t.rstrip || t.single_word || t.content.is_empty()) {
            return None;
        }
        if tok.get_post_processor().is_some_and(|p| tokenizers::PostProcessor::added_tokens(p, false) > 0) {
            return None;
        }
        if tok.get_truncation().is_some() || tok.get_padding().is_some() {
            return None; // they act on the whole text's ids
        }
        if serde_json::to_string(&tok.get_pre_tokenizer()).map_or(true, |s| s.contains("Metaspace")) {
            return None;
        }
        let mut pairs: Vec<(String, u32)> = added.into_iter().map(|(id, t)| (t.content, id)).collect();
        pairs.sort();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(pairs.iter().map(|(content, _)| content.as_str()))
            .ok()?;
        let cache =
            SegmentCache { matcher, ids: pairs.iter().map(|(_, id)| *id).collect(), entries: Default::default() };
        // a probe with every added token between pieces of text (spaces, accents, digits, newlines around them)
        let mut probe = String::from("  Héllo wörld 12345\n");
        for (content, _) in &pairs {
            probe.push_str(content);
            probe.push_str(" a\n\n  b:c 99 ");
        }
        let plain = tok.encode(probe.as_str(), false).ok()?.get_ids().to_vec();
        (cache.encode_uncached(tok, &probe).ok()? == plain).then_some(cache)
    }

    /// The ids `tok.encode(text, false)` gives, from cached pieces where it has them.
    pub fn encode(&self, tok: &tokenizers::Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
        self.split(tok, text, true)
    }

    fn encode_uncached(&self, tok: &tokenizers::Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
        self.split(tok, text, false)
    }

    fn split(&self, tok: &tokenizers::Tokenizer, text: &str, cached: bool) -> tokenizers::Result<Vec<u32>> {
        let mut out = Vec::new();
        let mut last = 0;
        for m in self.matcher.find_iter(text) {
            self.piece(tok, &text[last..m.start()], cached, &mut out)?;
            out.push(self.ids[m.pattern().as_usize()]);
            last = m.end();
        }
        self.piece(tok, &text[last..], cached, &mut out)?;
        Ok(out)
    }

    fn piece(
        &self,
        tok: &tokenizers::Tokenizer,
        piece: &str,
        cached: bool,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        if piece.is_empty() {
            return Ok(());
        }
        if !cached {
            out.extend_from_slice(tok.encode(piece, false)?.get_ids());
            return Ok(());
        }
        if let Some(ids) = self.lock().get(piece) {
            out.extend_from_slice(&ids);
            return Ok(());
        }
        // encoded outside the lock: other requests keep their lookups meanwhile
        let ids: Arc<[u32]> = Arc::from(tok.encode(piece, false)?.get_ids());
        out.extend_from_slice(&ids);
        self.lock().put(piece, ids);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// (pieces found, pieces encoded and kept, bytes kept) so far.
    pub fn counters(&self) -> (u64, u64, usize) {
        let e = self.lock();
        (e.hits, e.misses, e.bytes)
    }
}
