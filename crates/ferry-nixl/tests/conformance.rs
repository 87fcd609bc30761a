//! The ferry-core conformance suite on the real NIXL library (the
//! pinned `nixl-cu12` wheel, UCX backend, DRAM to DRAM on this host), raw
//! and behind the adapter.

mod common;

use ferry_core::DynTransferEngine;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use ferry_core::conformance::EngineFactory;
use ferry_core::{Result, TransferEngine};
use ferry_nixl::NixlEngine;

/// Engines made, by segment name, so that `refuse_notifications` reaches
/// the [`NixlEngine`] behind an `Arc<dyn DynTransferEngine>` (weak: the
/// factory keeps no engine alive).
#[derive(Default)]
struct NixlFactory(Mutex<HashMap<String, Weak<NixlEngine>>>);

#[async_trait::async_trait]
impl EngineFactory for NixlFactory {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        let e = common::engine().await?;
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(e.segment_name().to_owned(), Arc::downgrade(&e));
        Ok(e)
    }

    fn unknown_segment_name(&self) -> String {
        common::unused_port()
    }

    async fn refuse_notifications(&self, engine: &Arc<dyn DynTransferEngine>) -> Result<bool> {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        Ok(match m.get(engine.segment_name()).and_then(Weak::upgrade) {
            Some(e) => {
                e.set_refuse_notifications(true);
                true
            }
            None => false,
        })
    }
}

ferry_core::conformance_tests!(NixlFactory::default());
