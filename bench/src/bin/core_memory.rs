//! What the relay's core holds per client, without sockets: a group's cache as in loadgen's
//! default Delta run (50 Clusters and 10 Listeners taken by wildcard, 50 of 1,000
//! ClusterLoadAssignments by name per client, 1 KiB each), N clients joined into one
//! `GroupState` with every response ACKed, then updates reaching all of them. Heap bytes are
//! counted by this binary's allocator, so the figure is exact and does not move with the
//! allocator's retention the way RSS does.
//!
//! `cargo run --release -p adsrelay-bench --bin core_memory -- --clients 10000`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use adsrelay::pb::discovery::{DeltaDiscoveryRequest, Resource};
use adsrelay::xds::{DeltaStream, GroupState, Store, UpstreamUpdate};
use bytes::Bytes;
use clap::Parser;
use prost::Message;

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call forwards to `System` with the caller's arguments unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

#[derive(Parser)]
#[command(about = "Heap bytes the relay's core holds per joined Delta client")]
struct Args {
    /// Clients to join.
    #[arg(long, default_value_t = 10_000)]
    clients: u32,
    /// Updates (one Cluster each) to send every client after the join.
    #[arg(long, default_value_t = 2)]
    updates: u32,
}

fn resource(type_url: &str, name: &str, version: u32) -> Bytes {
    Resource {
        name: name.into(),
        version: version.to_string(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value: vec![7; 1024],
        }),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Sends every response the stream is due and ACKs it, as a client does.
fn drain(c: &mut DeltaStream, group: &GroupState) {
    while let Some(out) = c.next_frame(group.store()) {
        let ack = DeltaDiscoveryRequest {
            type_url: out.type_url.clone(),
            response_nonce: out.frame.nonce.to_string(),
            ..Default::default()
        };
        if let Err(e) = c.on_request(&ack) {
            panic!("the core refused an ACK: {e}");
        }
    }
}

fn main() -> Result<(), String> {
    let args = Args::parse();
    let mut store = Store::new();
    let content = [(CDS, "cluster", 50, true), (LDS, "listener", 10, true)];
    for (type_url, prefix, n, wildcard) in content {
        let resources = (0..n)
            .map(|i| resource(type_url, &format!("{prefix}-{i}"), 1))
            .collect();
        store
            .apply_delta(type_url, resources, vec![], wildcard)
            .map_err(|e| format!("{type_url}: {e}"))?;
    }
    let endpoints = (0..1000)
        .map(|i| resource(EDS, &format!("endpoints-{i}"), 1))
        .collect();
    store
        .apply_delta(EDS, endpoints, vec![], false)
        .map_err(|e| format!("{EDS}: {e}"))?;
    let mut group = GroupState::new(Duration::from_secs(30)).with_store(store);

    let before = live();
    let mut clients = Vec::with_capacity(args.clients as usize);
    for slot in 0..args.clients {
        let mut c = DeltaStream::new();
        let eds: Vec<String> = (0..50)
            .map(|i| format!("endpoints-{}", (slot * 7 + i) % 1000))
            .collect();
        for (type_url, names) in [(CDS, vec![]), (EDS, eds), (LDS, vec![])] {
            let request = DeltaDiscoveryRequest {
                type_url: type_url.into(),
                resource_names_subscribe: names,
                ..Default::default()
            };
            let effects = c.on_request(&request).map_err(|e| e.to_string())?;
            let applied = group.apply_effects(slot, &effects, Instant::now());
            c.subscribed_at(applied.seq);
        }
        drain(&mut c, &group);
        clients.push(c);
    }
    let per_client = |bytes: isize| bytes as f64 / f64::from(args.clients);
    println!(
        "{} clients joined: {:.0} bytes per client in the core",
        args.clients,
        per_client(live() - before)
    );
    for version in 2..2 + args.updates {
        let update = UpstreamUpdate {
            resources: vec![resource(CDS, "cluster-3", version)],
            ..Default::default()
        };
        let changes = group
            .apply_upstream(CDS, update)
            .map_err(|e| e.to_string())?;
        for c in clients.iter_mut() {
            c.on_change(&changes);
            drain(c, &group);
        }
    }
    println!(
        "after {} updates to all: {:.0} bytes per client in the core",
        args.updates,
        per_client(live() - before)
    );
    Ok(())
}
