//! The ferry-core conformance suite, raw and behind the adapter, over
//! real loopback sockets: on the same-host path (cross-memory attach;
//! engines in one process reach each other by it too) and forced off.

use ferry_core::DynTransferEngine;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

mod common;

use ferry_core::conformance::EngineFactory;
use ferry_core::{Result, TransferEngine};
use ferry_tcp::{SameHost, TcpConfig, TcpEngine, TlsMode};

/// The engines a factory made, by segment name, so that
/// `refuse_notifications` can reach the [`TcpEngine`] behind an
/// `Arc<dyn DynTransferEngine>` (weak: the factory keeps no engine alive).
#[derive(Default)]
struct Made(Mutex<HashMap<String, Weak<TcpEngine>>>);

impl Made {
    async fn start(&self, cfg: TcpConfig) -> Result<Arc<dyn DynTransferEngine>> {
        let e = Arc::new(TcpEngine::start(cfg).await?);
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(e.segment_name().to_owned(), Arc::downgrade(&e));
        Ok(e)
    }

    /// Makes the engine named like `engine` refuse notifications.
    fn refuse(&self, engine: &Arc<dyn DynTransferEngine>) -> bool {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match m.get(engine.segment_name()).and_then(Weak::upgrade) {
            Some(e) => {
                e.set_refuse_notifications(true);
                true
            }
            None => false,
        }
    }
}

/// Engines on ephemeral loopback ports made from one configuration.
struct TcpFactory {
    made: Made,
    config: fn() -> TcpConfig,
    /// Segment names nothing listens on are ports bound then released;
    /// `None` uses such a port, `Some` a fixed one.
    unknown: Option<&'static str>,
}

impl TcpFactory {
    fn new(config: fn() -> TcpConfig) -> TcpFactory {
        TcpFactory {
            made: Made::default(),
            config,
            unknown: None,
        }
    }

    fn unknown_at(mut self, name: &'static str) -> TcpFactory {
        self.unknown = Some(name);
        self
    }
}

#[async_trait::async_trait]
impl EngineFactory for TcpFactory {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        self.made.start((self.config)()).await
    }

    fn unknown_segment_name(&self) -> String {
        if let Some(name) = self.unknown {
            return name.to_owned();
        }
        // A port nothing listens on (bound then released).
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        addr.to_string()
    }

    async fn refuse_notifications(&self, engine: &Arc<dyn DynTransferEngine>) -> Result<bool> {
        Ok(self.made.refuse(engine))
    }
}

// Two connections per peer, authenticated with a shared secret
// (`same_host=auto`: the same-host path with its Unix control channel).
ferry_core::conformance_tests!(TcpFactory::new(|| TcpConfig::builder()
    .secret("conformance")
    .connections(2)
    .build()
    .unwrap()));

/// Three connections per peer, tiny chunks (requests are split into many
/// wire operations over all of them) and no polling, on the socket.
mod chunked {
    use super::*;

    ferry_core::conformance_tests!(TcpFactory::new(|| TcpConfig::builder()
        .connections(3)
        .chunk_size(1000)
        .spin(std::time::Duration::ZERO)
        .same_host(SameHost::Off)
        .build()
        .unwrap())
    .unknown_at("127.0.0.1:1"));
}

/// Forced on (`same_host=cma`: a peer that cannot use it is an error),
/// without the staging area and with small chunks, so that requests become
/// many CWRITE / CREAD frames, each one kernel copy by the target.
mod cma_forced {
    use super::*;

    ferry_core::conformance_tests!(TcpFactory::new(|| TcpConfig::builder()
        .secret("conformance")
        .connections(2)
        .chunk_size(4096)
        .same_host_chunk(4096)
        .same_host(SameHost::Cma)
        .same_host_stage(None)
        .build()
        .unwrap())
    .unknown_at("127.0.0.1:1"));
}

/// Forced on with every frame through the staging area
/// (`same_host_stage=1`, the default), frames of 200 000 bytes (several
/// slots, the last one part-filled) and small requests gathered into
/// multi-segment frames.
mod cma_staged {
    use super::*;

    ferry_core::conformance_tests!(TcpFactory::new(|| TcpConfig::builder()
        .connections(2)
        .chunk_size(200_000)
        .same_host_chunk(200_000)
        .same_host(SameHost::Cma)
        .same_host_stage(Some(1))
        .same_host_grant(false)
        .build()
        .unwrap())
    .unknown_at("127.0.0.1:1"));
}

/// Forced on with granted copies (the default): the initiator copies
/// every frame below 8 MiB into the target's granted memory itself, on
/// the caller's thread up to 256 KiB per call and on the blocking pool
/// above; frames of 1 MiB.
mod cma_granted {
    use super::*;

    ferry_core::conformance_tests!(TcpFactory::new(|| TcpConfig::builder()
        .connections(2)
        .chunk_size(1 << 20)
        .same_host_chunk(1 << 20)
        .same_host(SameHost::Cma)
        .build()
        .unwrap())
    .unknown_at("127.0.0.1:1"));
}

/// Forced on with the frames kept on the TCP connection
/// (`same_host_control=tcp`: the path a target without `pidfd_getfd`
/// falls back to).
mod cma_tcp_control {
    use super::*;

    ferry_core::conformance_tests!(TcpFactory::new(|| TcpConfig::builder()
        .connections(2)
        .chunk_size(64 * 1024)
        .same_host_chunk(64 * 1024)
        .same_host(SameHost::Cma)
        .same_host_unix(false)
        .build()
        .unwrap())
    .unknown_at("127.0.0.1:1"));
}

/// Forced off: every payload on the socket.
mod socket_forced {
    use super::*;

    ferry_core::conformance_tests!(TcpFactory::new(|| TcpConfig::builder()
        .secret("conformance")
        .connections(2)
        .same_host(SameHost::Off)
        .build()
        .unwrap())
    .unknown_at("127.0.0.1:1"));
}

/// TLS 1.3 with the identity derived from the secret, on the socket.
mod tls_secret {
    use super::*;

    ferry_core::conformance_tests!(TcpFactory::new(|| TcpConfig::builder()
        .secret("conformance")
        .tls(TlsMode::Require)
        .connections(2)
        .same_host(SameHost::Off)
        .build()
        .unwrap())
    .unknown_at("127.0.0.1:1"));
}

/// TLS 1.3 with certificates (mutual), no secret, small chunks on three
/// connections, on the socket.
mod tls_cert {
    use super::*;

    ferry_core::conformance_tests!(TcpFactory::new(|| {
        let f = common::tls_files();
        TcpConfig::builder()
            .tls(TlsMode::Require)
            .tls_cert(f.cert.clone())
            .tls_key(f.key.clone())
            .tls_ca(f.ca.clone())
            .connections(3)
            .chunk_size(100_000)
            .same_host(SameHost::Off)
            .build()
            .unwrap()
    })
    .unknown_at("127.0.0.1:1"));
}

/// TLS 1.3 then the same-host path (its payloads stay kernel copies).
mod tls_same_host {
    use super::*;

    ferry_core::conformance_tests!(TcpFactory::new(|| TcpConfig::builder()
        .secret("conformance")
        .tls(TlsMode::Require)
        .connections(2)
        .build()
        .unwrap())
    .unknown_at("127.0.0.1:1"));
}

/// Every same-host configuration again on a `current_thread` runtime: the
/// engines, their tasks and the checks share one thread, so anything that
/// blocks or spins inside the caller's runtime (instead of yielding, or
/// running on a thread the engine owns) starves the engine itself.
mod current_thread {
    use super::*;

    mod auto {
        use super::*;
        ferry_core::conformance_tests!(
            current_thread,
            TcpFactory::new(|| TcpConfig::builder()
                .secret("conformance")
                .connections(2)
                .build()
                .unwrap())
            .unknown_at("127.0.0.1:1")
        );
    }

    mod cma_forced {
        use super::*;
        ferry_core::conformance_tests!(
            current_thread,
            TcpFactory::new(|| TcpConfig::builder()
                .connections(2)
                .chunk_size(4096)
                .same_host_chunk(4096)
                .same_host(SameHost::Cma)
                .same_host_stage(None)
                .build()
                .unwrap())
            .unknown_at("127.0.0.1:1")
        );
    }

    mod cma_staged {
        use super::*;
        ferry_core::conformance_tests!(
            current_thread,
            TcpFactory::new(|| TcpConfig::builder()
                .connections(2)
                .chunk_size(200_000)
                .same_host_chunk(200_000)
                .same_host(SameHost::Cma)
                .same_host_stage(Some(1))
                .same_host_grant(false)
                .build()
                .unwrap())
            .unknown_at("127.0.0.1:1")
        );
    }

    mod cma_granted {
        use super::*;
        ferry_core::conformance_tests!(
            current_thread,
            TcpFactory::new(|| TcpConfig::builder()
                .connections(2)
                .chunk_size(1 << 20)
                .same_host_chunk(1 << 20)
                .same_host(SameHost::Cma)
                .build()
                .unwrap())
            .unknown_at("127.0.0.1:1")
        );
    }

    mod cma_tcp_control {
        use super::*;
        ferry_core::conformance_tests!(
            current_thread,
            TcpFactory::new(|| TcpConfig::builder()
                .connections(2)
                .chunk_size(64 * 1024)
                .same_host_chunk(64 * 1024)
                .same_host(SameHost::Cma)
                .same_host_unix(false)
                .build()
                .unwrap())
            .unknown_at("127.0.0.1:1")
        );
    }
}
