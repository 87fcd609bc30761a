//! The ferry-core conformance suite through the Mooncake backend, raw
//! and behind the adapter, on the faithful C-ABI test library (NOT Mooncake)
//! of every supported generation. Pre-v0.2.0 is refused by design (see
//! `backend.rs`), so it has no module here.

mod common;

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use common::{config, metadata_for, start_engine};
use ferry_core::conformance::EngineFactory;
use ferry_core::{Result, TransferEngine};
use mooncake_testlibs::Generation as Lib;

/// The segment name that makes a test library's engine refuse
/// notifications.
const REFUSE_NOTIFICATIONS: &str = "ferry-testlib:refuse-notifications";

/// Engines of one generation sharing one metadata service (`P2PHANDSHAKE`,
/// or a fresh `file://` directory for v0.2.0); one factory per test.
struct Factory {
    gen: Lib,
    metadata: String,
}

impl Factory {
    fn new(gen: Lib) -> Factory {
        Factory {
            gen,
            metadata: metadata_for(gen),
        }
    }
}

#[async_trait::async_trait]
impl EngineFactory for Factory {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        Ok(Arc::new(
            start_engine(config(self.gen, &self.metadata, "")).await?,
        ))
    }

    /// The test libraries' convention (see `mooncake_testlib.c`): opening
    /// the segment `ferry-testlib:refuse-notifications` opens nothing and
    /// makes the engine reject every notification sent to it, as TCP
    /// engines of Mooncake v0.3.5–v0.3.7 do.
    async fn refuse_notifications(&self, engine: &Arc<dyn DynTransferEngine>) -> Result<bool> {
        match engine.open_segment(REFUSE_NOTIFICATIONS).await {
            Err(ferry_core::Error::SegmentUnavailable { .. }) => Ok(true),
            Err(e) => Err(e),
            Ok(id) => panic!("{REFUSE_NOTIFICATIONS} opened a segment ({id:?})"),
        }
    }

    fn unknown_segment_name(&self) -> String {
        if self.gen.has_p2p_handshake() {
            // A port nothing listens on (bound, then released).
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = l.local_addr().expect("addr");
            drop(l);
            addr.to_string()
        } else {
            "no-such-server-name".to_owned()
        }
    }
}

mod v0_2_0 {
    use super::*;
    ferry_core::conformance_tests!(Factory::new(Lib::V0_2_0));
}

mod v0_3_0 {
    use super::*;
    ferry_core::conformance_tests!(Factory::new(Lib::V0_3_0));
}

mod v0_3_5 {
    use super::*;
    ferry_core::conformance_tests!(Factory::new(Lib::V0_3_5));
}

mod v0_3_6 {
    use super::*;
    ferry_core::conformance_tests!(Factory::new(Lib::V0_3_6));
}

mod v0_3_12 {
    use super::*;
    ferry_core::conformance_tests!(Factory::new(Lib::Current));
}
