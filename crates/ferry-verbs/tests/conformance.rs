//! The ferry-core conformance suite through the verbs backend, raw and
//! behind the adapter: two engines in one process, connected over the TCP
//! control channel and RC queue pairs on the same device.
//!
//! Without an RDMA device (or without the `rdma` feature) every test prints
//! `skipped: <check> (<mode>): ... the verbs backend is unavailable: <reason>`.
//! `FERRY_VERBS_URL` selects the device (default `verbs://`, the first
//! active one); `scripts/verbs-tests.sh` runs these on soft-RoCE in a VM.

use ferry_core::DynTransferEngine;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use ferry_core::conformance::EngineFactory;
use ferry_core::{Result, TransferEngine};
use ferry_verbs::{VerbsConfig, VerbsEngine};

fn base_url() -> String {
    std::env::var("FERRY_VERBS_URL").unwrap_or_else(|_| "verbs://".to_owned())
}

fn with_params(url: &str, extra: &str) -> String {
    if extra.is_empty() {
        url.to_owned()
    } else if url.contains('?') {
        format!("{url}&{extra}")
    } else {
        format!("{url}?{extra}")
    }
}

fn unused_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    addr.to_string()
}

/// The engines the factories made, by segment name: the conformance hook
/// `refuse_notifications` gets an engine possibly wrapped in an adapter and
/// finds the verbs engine behind it here.
fn made() -> &'static Mutex<HashMap<String, Weak<VerbsEngine>>> {
    static MADE: OnceLock<Mutex<HashMap<String, Weak<VerbsEngine>>>> = OnceLock::new();
    MADE.get_or_init(Default::default)
}

/// Engine logs on stderr when `RUST_LOG` is set (e.g.
/// `RUST_LOG=ferry_verbs=debug` in the guest, to see why a check failed).
fn init_logs() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}

async fn start(url: &str) -> Result<Arc<dyn DynTransferEngine>> {
    init_logs();
    let cfg = VerbsConfig::from_url(url)?;
    let e = Arc::new(VerbsEngine::start(cfg).await?);
    let mut m = made().lock().unwrap_or_else(|p| p.into_inner());
    m.retain(|_, w| w.strong_count() > 0);
    m.insert(e.segment_name().to_owned(), Arc::downgrade(&e));
    Ok(e)
}

/// Makes the engine behind `engine` refuse the notifications its peers send.
fn refuse(engine: &Arc<dyn DynTransferEngine>) -> bool {
    let m = made().lock().unwrap_or_else(|p| p.into_inner());
    match m.get(engine.segment_name()).and_then(Weak::upgrade) {
        Some(e) => {
            e.set_refuse_notifications(true);
            true
        }
        None => false,
    }
}

/// Engines with the default configuration.
struct VerbsFactory;

#[async_trait::async_trait]
impl EngineFactory for VerbsFactory {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        start(&base_url()).await
    }

    fn unknown_segment_name(&self) -> String {
        unused_port()
    }

    async fn refuse_notifications(&self, engine: &Arc<dyn DynTransferEngine>) -> Result<bool> {
        Ok(refuse(engine))
    }
}

ferry_core::conformance_tests!(VerbsFactory);

/// The same suite with a tiny send queue, tiny messages and two SGEs per
/// work request: every request is split, chains wait for send-queue room,
/// and selective signalling covers runs of unsignalled work requests. These
/// engines share a secret: every control connection is authenticated.
mod small_queues {
    use super::*;

    struct SmallFactory;

    #[async_trait::async_trait]
    impl EngineFactory for SmallFactory {
        async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
            let url = with_params(
                &base_url(),
                "sq_depth=8&signal_every=3&max_message=4k&max_sge=2&secret=conf%20secret",
            );
            start(&url).await
        }

        fn unknown_segment_name(&self) -> String {
            unused_port()
        }

        async fn refuse_notifications(&self, engine: &Arc<dyn DynTransferEngine>) -> Result<bool> {
            Ok(refuse(engine))
        }
    }

    ferry_core::conformance_tests!(SmallFactory);
}
