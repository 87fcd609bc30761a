//! The capability report of every generation, asserted exactly (native and
//! through the default adapter), plus the strict-mode refusal.

mod common;

use std::sync::Arc;

use backend_mooncake::MooncakeEngine;
use common::{metadata_for, start, SUPPORTED};
use mooncake_testlibs::{library_path, Generation as Lib};
use transport_core::{AdapterConfig, CapabilityAdapter, Error, Operation, TransferEngine};

fn expected(gen: Lib, engine: &MooncakeEngine) -> String {
    let path = library_path(gen).display().to_string();
    let (generation, metadata) = match gen {
        Lib::V0_2_0 => (
            "Mooncake v0.2.0 or later (no getLocalIpAndPort; createTransferEngine may take 4 or 5 arguments)",
            engine.config().metadata.clone(),
        ),
        Lib::V0_3_0 => (
            "Mooncake v0.3.0 or later (getLocalIpAndPort present; no notification symbols)",
            "P2PHANDSHAKE".to_owned(),
        ),
        Lib::V0_3_5 => (
            "Mooncake v0.3.5 or later (submitTransferWithNotify present; no freeNotifsMsgBuf)",
            "P2PHANDSHAKE".to_owned(),
        ),
        Lib::V0_3_6 => (
            "Mooncake v0.3.6 or later (freeNotifsMsgBuf present; no discoverTopology)",
            "P2PHANDSHAKE".to_owned(),
        ),
        Lib::Current => (
            "Mooncake v0.3.12 or later (getNicLoadStats present)",
            "P2PHANDSHAKE".to_owned(),
        ),
        Lib::PreV0_2_0 => unreachable!(),
    };
    let mut s = format!(
        "backend: mooncake\n\
         library: {path}\n\
         library source: engine config (lib=)\n\
         generation: {generation}\n\
         metadata: {metadata}\n\
         protocol: tcp\n\
         segment: {}\n",
        engine.segment_name()
    );
    // The TCP transport's guarantees: acknowledged writes and address checks
    // at the target arrived in v0.3.12 (upstream #2850 and #2314).
    if gen < Lib::Current {
        s.push_str(
            "completion: sent, not landed: this build's TCP transport reports a write \
             completed when it is handed to the socket, before the peer has written it \
             (acknowledged from Mooncake v0.3.12)\n\
             peer address validation: no: this build's TCP transport writes at the peer \
             wherever the address points, registered or not, and reports success; Ferry \
             checks peers in this process itself (checked at the peer from Mooncake v0.3.12)\n",
        );
    } else {
        s.push_str(
            "completion: landed (acknowledged by the peer)\n\
             peer address validation: yes (the peer refuses addresses outside its registered \
             regions)\n",
        );
    }
    if gen == Lib::V0_3_5 {
        s.push_str(
            "notification buffers: released with free() (freeNotifsMsgBuf needs Mooncake v0.3.6)\n",
        );
    }
    s.push_str(
        "max batch length: unlimited\n\
         memory: host yes, cuda no\n  \
         batch_register    native\n  \
         batch_unregister  native\n  \
         batch_transfer    native\n  \
         async_batch       native\n  \
         batch_wait        native\n",
    );
    if gen >= Lib::V0_3_5 {
        s.push_str("  notify            native\n");
    } else {
        s.push_str(&format!(
            "  notify            unsupported: {path} ({}) has no \
             submitTransferWithNotify/getNotifsFromEngine/genNotifyInEngine; needs Mooncake v0.3.5\n",
            gen.version()
        ));
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capability_report_of_every_generation() {
    for gen in SUPPORTED {
        let engine = start(gen, &metadata_for(gen)).await;
        let want = expected(gen, &engine);
        let shared: Arc<dyn TransferEngine> = Arc::new(engine);
        let report =
            CapabilityAdapter::from_arc(Arc::clone(&shared), AdapterConfig::default()).report();
        let text = report.to_string();
        println!("--- {gen} ---\n{text}");
        assert_eq!(text, want, "{gen}");
        assert_eq!(
            report.native, report.effective,
            "{gen}: nothing is emulated"
        );
        let notify = report.info.note(Operation::Notify);
        if gen < Lib::V0_3_5 {
            assert_eq!(
                notify.and_then(|m| m.min_version.clone()),
                Some("Mooncake v0.3.5".into())
            );
        } else {
            assert!(notify.is_none());
        }
        let details: Vec<&str> = report
            .info
            .details
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert!(details.contains(&"library") && details.contains(&"generation"));

        // Strict mode names the missing operation and the version that adds it.
        let strict = CapabilityAdapter::from_arc(shared, AdapterConfig::strict());
        let got = strict.require(&[
            Operation::BatchRegister,
            Operation::AsyncBatch,
            Operation::Notify,
        ]);
        if gen < Lib::V0_3_5 {
            match got {
                Err(Error::MissingCapabilities { backend, missing }) => {
                    assert_eq!(backend, "mooncake");
                    assert_eq!(missing.len(), 1);
                    assert_eq!(missing[0].operation, Operation::Notify);
                    assert_eq!(missing[0].min_version.as_deref(), Some("Mooncake v0.3.5"));
                }
                other => panic!("{gen}: expected MissingCapabilities, got {other:?}"),
            }
        } else {
            got.unwrap();
        }
    }
}
