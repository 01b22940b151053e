//! Generated protobuf types: the wire contract and the snapshot file body in proto/ (module tree
//! mirrors the proto packages so cross-package references resolve), plus the relay's own ADS
//! service over shadow messages.
#![allow(clippy::all, missing_docs)]

pub mod google {
    pub mod rpc {
        include!(concat!(env!("OUT_DIR"), "/google.rpc.rs"));
    }
}

pub mod envoy {
    pub mod admin {
        pub mod v3 {
            include!(concat!(env!("OUT_DIR"), "/envoy.admin.v3.rs"));
        }
    }
    pub mod r#type {
        pub mod matcher {
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.r#type.matcher.v3.rs"));
            }
        }
    }
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
        pub mod status {
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.service.status.v3.rs"));
            }
        }
    }
}

pub mod adsrelay {
    pub mod wire {
        include!(concat!(env!("OUT_DIR"), "/adsrelay.wire.rs"));
    }
    pub mod snapshot {
        include!(concat!(env!("OUT_DIR"), "/adsrelay.snapshot.rs"));
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
pub use envoy::service::status::v3 as csds;
pub use google::rpc;

/// The per-type discovery services (CDS, LDS, RDS, SRDS, VHDS, EDS, SDS, RTDS, ECDS), generated
/// over the same request and shadow response messages as the relay's ADS service.
pub mod per_type {
    macro_rules! include_service {
        ($module:ident, $file:literal) => {
            pub mod $module {
                include!(concat!(env!("OUT_DIR"), "/", $file));
            }
        };
    }
    include_service!(
        cluster,
        "envoy.service.cluster.v3.ClusterDiscoveryService.rs"
    );
    include_service!(
        listener,
        "envoy.service.listener.v3.ListenerDiscoveryService.rs"
    );
    include_service!(route, "envoy.service.route.v3.RouteDiscoveryService.rs");
    include_service!(
        scoped_routes,
        "envoy.service.route.v3.ScopedRoutesDiscoveryService.rs"
    );
    include_service!(
        virtual_host,
        "envoy.service.route.v3.VirtualHostDiscoveryService.rs"
    );
    include_service!(
        endpoint,
        "envoy.service.endpoint.v3.EndpointDiscoveryService.rs"
    );
    include_service!(secret, "envoy.service.secret.v3.SecretDiscoveryService.rs");
    include_service!(
        runtime,
        "envoy.service.runtime.v3.RuntimeDiscoveryService.rs"
    );
    include_service!(
        extension,
        "envoy.service.extension.v3.ExtensionConfigDiscoveryService.rs"
    );
}
