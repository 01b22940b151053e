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
    /// or the status to end the stream with. `received` keeps, per type, the earliest upstream
    /// receipt among the changes taken in (for the fan-out latency metric).
    pub fn drain_into<C: StreamCore>(
        &self,
        stream: &mut C,
        received: &mut HashMap<String, Instant>,
    ) -> Result<bool, tonic::Status> {
        let inbox = std::mem::take(&mut *lock(&self.inbox));
        if let Some(status) = inbox.close {
            return Err(status);
        }
        let any = !inbox.changes.is_empty() || !inbox.all.is_empty();
        let mut note = |type_url: &str, at: Instant| match received.get_mut(type_url) {
            Some(t) => *t = (*t).min(at),
            None => {
                received.insert(type_url.to_string(), at);
            }
        };
        for c in &inbox.changes {
            if let Some(at) = c.received_at {
                note(&c.type_url, at);
            }
            stream.on_change(c);
        }
        for (t, at) in inbox.all_since {
            note(&t, at);
        }
        for t in &inbox.all {
            stream.mark_all_pending(t);
        }
        Ok(any)
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
}
