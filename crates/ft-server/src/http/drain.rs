//! Graceful shutdown at the HTTP layer, for any [`Backend`](crate::backend::Backend).
//!
//! ```text
//!  SIGTERM ─▶ draining: new generation requests and /health get 503, the listener stays open
//!             wait until no request is live, the --shutdown-grace period ends, a second signal
//!             arrives, or the engine dies
//!          ─▶ cancel: every live request still waiting is answered "shutting down" (503 / SSE error event)
//!             and aborted in the engine (its stream is dropped)
//!          ─▶ close the listener, let the last responses flush, return
//! ```
//!
//! A request is live from the moment its [`TextStream`](crate::http) exists (right after submit) until the
//! stream is dropped: the non-streaming handler returned, or the SSE body sent its final event or lost its
//! client. Requests that slip past the 503 gate while the drain starts are caught by the cancel flag, which
//! stays set: a stream created after it is cancelled at its first wait.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::{watch, Notify};

#[derive(Debug)]
pub struct Drain {
    draining: AtomicBool,
    /// Set once: every live request gives up.
    cancel: watch::Sender<bool>,
    live: AtomicUsize,
    /// Woken whenever `live` drops to zero.
    idle: Notify,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            draining: AtomicBool::new(false),
            cancel: watch::Sender::new(false),
            live: AtomicUsize::new(0),
            idle: Notify::new(),
        }
    }
}

impl Drain {
    /// New requests are refused from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Every live request (and any created later) stops waiting and answers "shutting down".
    pub fn cancel_live(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.cancel.send_replace(true);
    }

    /// Requests whose response is still being produced.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Counts a request as live until the guard drops.
    pub fn track(self: &Arc<Self>) -> LiveGuard {
        self.live.fetch_add(1, Ordering::SeqCst);
        LiveGuard { drain: self.clone() }
    }

    /// Resolves once [`cancel_live`](Self::cancel_live) was called (at once if it already was).
    pub fn cancelled(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.cancel.subscribe();
        async move {
            // Err only if the sender is gone, which cannot happen while a request holds the state.
            let _ = rx.wait_for(|c| *c).await;
        }
    }

    /// Resolves when no request is live.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.live() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Keeps one request counted as live.
#[derive(Debug)]
pub struct LiveGuard {
    drain: Arc<Drain>,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        if self.drain.live.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.drain.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn idle_and_cancel() {
        let d = Arc::new(Drain::default());
        d.wait_idle().await;
        let g1 = d.track();
        let g2 = d.track();
        assert_eq!(d.live(), 2);
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.wait_idle().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        drop(g1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        drop(g2);
        tokio::time::timeout(Duration::from_secs(2), waiter).await.unwrap().unwrap();

        let before = d.cancelled();
        assert!(!d.is_draining());
        d.cancel_live();
        assert!(d.is_draining());
        tokio::time::timeout(Duration::from_secs(2), before).await.unwrap();
        // A stream created after the cancel gives up at once too.
        tokio::time::timeout(Duration::from_secs(2), d.cancelled()).await.unwrap();
    }
}
