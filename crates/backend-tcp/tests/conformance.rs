//! The transport-core conformance suite, raw and behind the adapter, over
//! real loopback sockets: on the same-host path (cross-memory attach;
//! engines in one process reach each other by it too) and forced off.

use std::sync::Arc;

use backend_tcp::{SameHost, TcpConfig, TcpEngine};
use transport_core::conformance::EngineFactory;
use transport_core::{Result, TransferEngine};

/// Engines on ephemeral loopback ports, two connections per peer,
/// authenticated with a shared secret.
struct TcpFactory;

#[async_trait::async_trait]
impl EngineFactory for TcpFactory {
    async fn create(&self) -> Result<Arc<dyn TransferEngine>> {
        let cfg = TcpConfig {
            secret: Some("conformance".to_owned()),
            connections: 2,
            ..TcpConfig::default()
        };
        Ok(Arc::new(TcpEngine::start(cfg).await?))
    }

    fn unknown_segment_name(&self) -> String {
        // A port nothing listens on (bound then released).
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        addr.to_string()
    }
}

transport_core::conformance_tests!(TcpFactory);

/// The same suite with three connections per peer, tiny chunks (requests
/// are split into many wire operations over all of them) and no polling.
mod chunked {
    use super::*;

    struct ChunkedFactory;

    #[async_trait::async_trait]
    impl EngineFactory for ChunkedFactory {
        async fn create(&self) -> Result<Arc<dyn TransferEngine>> {
            let cfg = TcpConfig {
                connections: 3,
                chunk_size: 1000,
                spin: std::time::Duration::ZERO,
                same_host: SameHost::Off,
                ..TcpConfig::default()
            };
            Ok(Arc::new(TcpEngine::start(cfg).await?))
        }

        fn unknown_segment_name(&self) -> String {
            "127.0.0.1:1".to_owned()
        }
    }

    transport_core::conformance_tests!(ChunkedFactory);
}

/// Forced on (`same_host=cma`: a peer that cannot use it is an error), with
/// small chunks so that requests become many CWRITE / CREAD frames.
mod cma_forced {
    use super::*;

    struct CmaFactory;

    #[async_trait::async_trait]
    impl EngineFactory for CmaFactory {
        async fn create(&self) -> Result<Arc<dyn TransferEngine>> {
            let cfg = TcpConfig {
                secret: Some("conformance".to_owned()),
                connections: 2,
                chunk_size: 4096,
                same_host: SameHost::Cma,
                ..TcpConfig::default()
            };
            Ok(Arc::new(TcpEngine::start(cfg).await?))
        }

        fn unknown_segment_name(&self) -> String {
            "127.0.0.1:1".to_owned()
        }
    }

    transport_core::conformance_tests!(CmaFactory);
}

/// Forced off: every payload on the socket.
mod socket_forced {
    use super::*;

    struct OffFactory;

    #[async_trait::async_trait]
    impl EngineFactory for OffFactory {
        async fn create(&self) -> Result<Arc<dyn TransferEngine>> {
            let cfg = TcpConfig {
                secret: Some("conformance".to_owned()),
                connections: 2,
                same_host: SameHost::Off,
                ..TcpConfig::default()
            };
            Ok(Arc::new(TcpEngine::start(cfg).await?))
        }

        fn unknown_segment_name(&self) -> String {
            "127.0.0.1:1".to_owned()
        }
    }

    transport_core::conformance_tests!(OffFactory);
}
