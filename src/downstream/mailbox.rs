//! A stream's inbox of change notifications. Producers (the upstream task, the demo's file watcher)
//! post shared change sets; the stream folds them into its state when it is ready to write. The
//! inbox is bounded: past a limit, a type collapses into "look at everything", so a client that does
//! not read costs memory bounded by its subscriptions, never by the update rate.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Notify;

use crate::sync::lock;
use crate::xds::{ChangeSet, StreamCore};

const MAX_QUEUED_CHANGE_SETS: usize = 64;

#[derive(Debug, Default)]
struct Inbox {
    changes: Vec<Arc<ChangeSet>>,
    all: HashSet<String>,
    /// Earliest upstream receipt among the change sets a collapsed type dropped.
    all_since: HashMap<String, Instant>,
    /// The owner wants the stream ended with this status.
    close: Option<tonic::Status>,
}

#[derive(Debug, Default)]
pub struct Mailbox {
    inbox: Mutex<Inbox>,
    notify: Notify,
}

impl Mailbox {
    pub fn post(&self, changes: &Arc<ChangeSet>) {
        {
            let mut inbox = lock(&self.inbox);
            if inbox.all.contains(&changes.type_url) {
                // Already collapsed: everything of this type will be looked at anyway.
            } else if inbox.changes.len() < MAX_QUEUED_CHANGE_SETS {
                inbox.changes.push(changes.clone());
            } else {
                let type_url = changes.type_url.clone();
                let earliest = inbox
                    .changes
                    .iter()
                    .filter(|c| c.type_url == type_url)
                    .filter_map(|c| c.received_at)
                    .chain(changes.received_at)
                    .min();
                inbox.changes.retain(|c| c.type_url != type_url);
                if let Some(t) = earliest {
                    inbox.all_since.insert(type_url.clone(), t);
                }
                inbox.all.insert(type_url);
            }
        }
        self.notify.notify_one();
    }

    /// Everything of a type must be looked at again (e.g. the demo's resource file changed).
    pub fn post_all(&self, type_url: &str) {
        lock(&self.inbox).all.insert(type_url.to_string());
        self.notify.notify_one();
    }

    /// Asks the stream to end with `status` (e.g. the control plane going away).
    pub fn close(&self, status: tonic::Status) {
        lock(&self.inbox).close = Some(status);
        self.notify.notify_one();
    }

    pub async fn notified(&self) {
        self.notify.notified().await
    }

    /// Moves the pending notifications into the stream's state; returns whether there were any,
    /// or the status to end the stream with. `receipts` keeps, per type, the earliest upstream
    /// receipt among the changes taken in (for the fan-out latency metric).
    pub fn drain_into<C: StreamCore>(
        &self,
        stream: &mut C,
        receipts: &mut Receipts,
    ) -> Result<bool, tonic::Status> {
        let inbox = std::mem::take(&mut *lock(&self.inbox));
        if let Some(status) = inbox.close {
            return Err(status);
        }
        let any = !inbox.changes.is_empty() || !inbox.all.is_empty();
        for c in &inbox.changes {
            if let Some(at) = c.received_at {
                receipts.note(&c.type_url, at);
            }
            stream.on_change(c);
        }
        for (t, at) in inbox.all_since {
            receipts.note(&t, at);
        }
        for t in &inbox.all {
            stream.mark_all_pending(t);
        }
        Ok(any)
    }
}

/// Per type, the earliest upstream receipt among the changes a stream took in and has not yet
/// written (fan-out latency). A stream speaks a few types, so a short list whose entries stay:
/// noting a receipt allocates nothing after a type's first.
#[derive(Debug, Default)]
pub struct Receipts(Vec<(String, Option<Instant>)>);

impl Receipts {
    fn note(&mut self, type_url: &str, at: Instant) {
        match self.0.iter_mut().find(|(t, _)| t == type_url) {
            Some((_, earliest)) => *earliest = Some(earliest.map_or(at, |e| e.min(at))),
            None => self.0.push((type_url.to_string(), Some(at))),
        }
    }

    /// The earliest receipt of `type_url` not yet written, which a response now writes.
    pub fn take(&mut self, type_url: &str) -> Option<Instant> {
        self.0
            .iter_mut()
            .find(|(t, _)| t == type_url)
            .and_then(|(_, at)| at.take())
    }

    /// What was received produced nothing to write.
    pub fn clear(&mut self) {
        for (_, at) in &mut self.0 {
            *at = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inbox_stays_bounded() {
        let mb = Mailbox::default();
        for i in 0..10_000 {
            mb.post(&Arc::new(ChangeSet {
                type_url: "t".into(),
                names: vec![i.to_string().into()],
                ..ChangeSet::default()
            }));
        }
        let inbox = lock(&mb.inbox);
        assert!(inbox.changes.is_empty());
        assert!(inbox.all.contains("t"));
    }

    #[test]
    fn receipts_keep_the_earliest_until_written() {
        let t0 = Instant::now();
        let t1 = t0 + std::time::Duration::from_millis(5);
        let mut r = Receipts::default();
        r.note("a", t1);
        r.note("a", t0);
        r.note("b", t1);
        assert_eq!(r.take("a"), Some(t0));
        assert_eq!(r.take("a"), None, "a written receipt is gone");
        r.clear();
        assert_eq!(r.take("b"), None);
        r.note("a", t1);
        assert_eq!(r.take("a"), Some(t1));
    }
}
