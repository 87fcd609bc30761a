//! The conformance suite through the facade: `Engine::open(url)` (static
//! dispatch + capability adapter) must behave exactly like the backend.
#![cfg(feature = "tcp")]

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry::{Engine, Result};
use ferry_core::conformance::EngineFactory;

/// Engines opened from a URL through the facade.
struct UrlFactory(&'static str);

#[async_trait::async_trait]
impl EngineFactory for UrlFactory {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        Ok(Engine::open(self.0).await?.into_dyn())
    }

    fn unknown_segment_name(&self) -> String {
        // A port nothing listens on (bound, then released).
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        addr.to_string()
    }
}

ferry_core::conformance_tests!(UrlFactory("tcp://127.0.0.1:0?secret=conformance"));

/// Strict mode: with every operation native on TCP, nothing may change.
mod strict {
    use super::*;
    ferry_core::conformance_tests!(UrlFactory("tcp://127.0.0.1:0?strict=1&coalesce=0"));
}
