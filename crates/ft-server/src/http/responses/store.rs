//! Stored responses (`store: true`, the default): what `GET /v1/responses/{id}` answers, what
//! `previous_response_id` continues and what `cancel` finds. Kept in memory, at most `--max-stored-responses`
//! of them; the least recently used (created, read, continued or cancelled) is evicted first.
//!
//! ```text
//!   resp_A ─▶ Conversation { items: A's input + A's output }          (turn 1)
//!               ▲ parent
//!   resp_B ─▶ Conversation { items: B's input + B's output }          (turn 2, previous_response_id: resp_A)
//! ```
//!
//! A conversation links to the one it continues instead of copying it, so a chain of N turns holds each item
//! once, and evicting `resp_A` does not break `resp_B` (its conversation keeps A's alive).

use serde_json::Value as Json;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The items of a conversation up to the end of one response: its parent's, then its own.
#[derive(Debug)]
pub(crate) struct Conversation {
    parent: Option<Arc<Conversation>>,
    /// This turn's input items, then its output items.
    items: Vec<Json>,
}

impl Conversation {
    pub fn new(parent: Option<Arc<Conversation>>, items: Vec<Json>) -> Arc<Self> {
        Arc::new(Conversation { parent, items })
    }

    /// Every item, oldest first.
    pub fn items(&self) -> Vec<Json> {
        let mut chain = vec![self];
        while let Some(p) = chain.last().and_then(|c| c.parent.as_deref()) {
            chain.push(p);
        }
        chain.iter().rev().flat_map(|c| c.items.iter().cloned()).collect()
    }
}

/// A response that is still generating: how to cancel it and how to learn that it ended.
#[derive(Debug)]
pub(crate) struct Live {
    /// The engine's id of the request (for `Backend::abort`).
    pub request_id: u64,
    /// `cancel` was asked for: the response ends as `cancelled`.
    cancelled: AtomicBool,
    /// Becomes true once the response ended (whatever the status) and its final object is stored.
    ended: tokio::sync::watch::Sender<bool>,
}

impl Live {
    pub fn new(request_id: u64) -> Arc<Self> {
        Arc::new(Live { request_id, cancelled: AtomicBool::new(false), ended: tokio::sync::watch::channel(false).0 })
    }

    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    pub fn mark_ended(&self) {
        self.ended.send_replace(true);
    }

    /// Waits until the response ended, at most `within`; whether it did.
    pub async fn wait_ended(&self, within: std::time::Duration) -> bool {
        let mut rx = self.ended.subscribe();
        let ended = tokio::time::timeout(within, rx.wait_for(|e| *e)).await;
        matches!(ended, Ok(Ok(_)))
    }
}

/// One stored response.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    /// The response object as `GET` returns it (`status: "in_progress"` until it ends).
    pub response: Json,
    /// The conversation through this response's output; `None` while it runs.
    pub conversation: Option<Arc<Conversation>>,
    /// While it runs.
    pub live: Option<Arc<Live>>,
}

/// The bounded store. Cheap to share (`Arc`); every operation takes one short lock.
pub(crate) struct ResponseStore {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, (u64, Entry)>,
    /// Last use → id: the first key is the least recently used.
    by_use: BTreeMap<u64, String>,
    /// The use counter.
    clock: u64,
}

impl Inner {
    /// Marks `id` used now (it must be present).
    fn touch(&mut self, id: &str) {
        self.clock += 1;
        let now = self.clock;
        if let Some((used, _)) = self.entries.get_mut(id) {
            self.by_use.remove(used);
            *used = now;
            self.by_use.insert(now, id.to_string());
        }
    }
}

impl ResponseStore {
    /// A store of at most `capacity` responses (0 stores nothing).
    pub fn new(capacity: usize) -> Self {
        ResponseStore { capacity, inner: Mutex::new(Inner::default()) }
    }

    /// Stores (or replaces) `id`, evicting the least recently used past the capacity.
    pub fn put(&self, id: &str, entry: Entry) {
        if self.capacity == 0 {
            return;
        }
        let mut inner = self.inner.lock().unwrap();
        if let Some((used, _)) = inner.entries.remove(id) {
            inner.by_use.remove(&used);
        }
        while inner.entries.len() >= self.capacity {
            let Some((_, oldest)) = inner.by_use.pop_first() else { break };
            inner.entries.remove(&oldest);
        }
        inner.entries.insert(id.to_string(), (0, entry));
        inner.touch(id);
    }

    /// Replaces a stored response's entry; nothing if it was evicted or deleted meanwhile.
    pub fn update(&self, id: &str, entry: Entry) {
        let mut inner = self.inner.lock().unwrap();
        if let Some((_, e)) = inner.entries.get_mut(id) {
            *e = entry;
        }
    }

    /// The stored response (a use: it moves to the back of the eviction order).
    pub fn get(&self, id: &str) -> Option<Entry> {
        let mut inner = self.inner.lock().unwrap();
        let entry = inner.entries.get(id).map(|(_, e)| e.clone())?;
        inner.touch(id);
        Some(entry)
    }

    /// Removes and returns it.
    pub fn remove(&self, id: &str) -> Option<Entry> {
        let mut inner = self.inner.lock().unwrap();
        let (used, entry) = inner.entries.remove(id)?;
        inner.by_use.remove(&used);
        Some(entry)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn entry(n: i64) -> Entry {
        Entry { response: json!(n), conversation: None, live: None }
    }

    #[test]
    fn least_recently_used_goes_first() {
        let s = ResponseStore::new(2);
        s.put("a", entry(1));
        s.put("b", entry(2));
        assert_eq!(s.get("a").unwrap().response, json!(1)); // a is now the most recent
        s.put("c", entry(3));
        assert!(s.get("b").is_none());
        assert_eq!((s.get("a").is_some(), s.get("c").is_some(), s.len()), (true, true, 2));
        s.update("c", entry(4));
        s.update("gone", entry(5));
        assert_eq!((s.get("c").unwrap().response, s.len()), (json!(4), 2));
        assert_eq!(s.remove("a").unwrap().response, json!(1));
        assert!(s.remove("a").is_none());
        s.put("d", entry(6));
        s.put("e", entry(7));
        assert_eq!(s.len(), 2);
        let none = ResponseStore::new(0);
        none.put("a", entry(1));
        assert!(none.get("a").is_none());
    }

    #[test]
    fn conversations_chain_and_outlive_their_entries() {
        let first = Conversation::new(None, vec![json!("q1"), json!("a1")]);
        let second = Conversation::new(Some(first.clone()), vec![json!("q2"), json!("a2")]);
        drop(first);
        assert_eq!(second.items(), vec![json!("q1"), json!("a1"), json!("q2"), json!("a2")]);
    }

    #[tokio::test]
    async fn live_ends_once() {
        let live = Live::new(7);
        assert!(!live.wait_ended(std::time::Duration::from_millis(10)).await);
        live.cancel();
        live.mark_ended();
        assert!(live.is_cancelled() && live.wait_ended(std::time::Duration::from_millis(10)).await);
    }
}
