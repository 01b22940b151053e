//! Generated protobuf types: the wire contract in proto/ (module tree mirrors the proto packages so
//! cross-package references resolve), plus the relay's own ADS service over shadow messages.
#![allow(clippy::all, missing_docs)]

pub mod google {
    pub mod rpc {
        include!(concat!(env!("OUT_DIR"), "/google.rpc.rs"));
    }
}

pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.config.core.v3.rs"));
            }
        }
    }
    pub mod service {
        pub mod discovery {
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.service.discovery.v3.rs"));
            }
        }
    }
}

pub mod adsrelay {
    pub mod wire {
        include!(concat!(env!("OUT_DIR"), "/adsrelay.wire.rs"));
    }
}

/// The ADS service as the relay serves and consumes it: requests decode into the full
/// `DeltaDiscoveryRequest`, responses are `wire::DeltaDiscoveryResponse` (resources as bytes).
pub mod relay_ads {
    include!(concat!(
        env!("OUT_DIR"),
        "/envoy.service.discovery.v3.AggregatedDiscoveryService.rs"
    ));
}

pub use adsrelay::wire;
pub use envoy::config::core::v3 as core;
pub use envoy::service::discovery::v3 as discovery;
pub use google::rpc;
