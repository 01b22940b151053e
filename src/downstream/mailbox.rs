//! A stream's inbox of change notifications. Producers (the upstream task, the demo's file watcher)
//! post shared change sets; the stream folds them into its state when it is ready to write. The
//! inbox is bounded: past a limit, a type collapses into "look at everything", so a client that does
//! not read costs memory bounded by its subscriptions, never by the update rate.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::sync::lock;
use crate::xds::{ChangeSet, StreamCore};

const MAX_QUEUED_CHANGE_SETS: usize = 64;

#[derive(Debug, Default)]
struct Inbox {
    changes: Vec<Arc<ChangeSet>>,
    all: HashSet<String>,
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
                inbox.changes.retain(|c| c.type_url != type_url);
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
    /// or the status to end the stream with.
    pub fn drain_into<C: StreamCore>(&self, stream: &mut C) -> Result<bool, tonic::Status> {
        let inbox = std::mem::take(&mut *lock(&self.inbox));
        if let Some(status) = inbox.close {
            return Err(status);
        }
        let any = !inbox.changes.is_empty() || !inbox.all.is_empty();
        for c in &inbox.changes {
            stream.on_change(c);
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
                wildcard_synced_now: false,
            }));
        }
        let inbox = lock(&mb.inbox);
        assert!(inbox.changes.is_empty());
        assert!(inbox.all.contains("t"));
    }
}
